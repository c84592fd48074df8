"""The tenant a proxy root span names (``pdscope.tenant``), checked before a record carries it.

The attribute arrives from whoever can send spans, so it is hostile input: a tenant id is a string of
1-63 letters, digits and ``_.@-`` (``pdscope.config.tenants.TENANT_ID``, the whole string: a trailing
newline is not one), and with ``tenants.enabled`` one the config declares. Anything else (a number,
control characters, a huge value, an id nobody declared) is left out of the record and named in its
``dropped`` notes, as the other root attributes are (``collector.rootattrs``); the record then has no
tenant, which readers count as ``default``'s. So the column holds at most the config's ids (or, with
tenants off, well-formed ones) and a tenant label never grows past the file.

Pure: attributes and settings in, the value out; no I/O.
"""

from __future__ import annotations

from typing import Any

from collector.rootattrs import Check, checked
from pdscope import semconv as sc
from pdscope.config import TENANT_ID, TenantSettings


def tenant_check(settings: TenantSettings | None) -> Check:
    """The check of a ``pdscope.tenant`` value: a well-formed id, and a declared one when tenants are on."""
    declared = frozenset(settings.tenants) if settings is not None and settings.enabled else None

    def check(value: Any) -> str | None:
        if not isinstance(value, str) or TENANT_ID.fullmatch(value) is None:
            return None
        return value if declared is None or value in declared else None

    return check


def tenant_of(attrs: dict[str, Any], settings: TenantSettings | None) -> tuple[str | None, tuple[str, ...]]:
    """The root's tenant (None: absent or refused) and the keys that were present but refused."""
    values, dropped = checked(attrs, ((sc.TENANT, tenant_check(settings)),))
    return values[0], dropped
