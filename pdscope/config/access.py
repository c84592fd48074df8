"""Who may talk to a service: named-token variables, the proxy secret, loopback hosts."""

from __future__ import annotations

import ipaddress

# Names of token holders (API identities, span senders): they end up in audit rows and in
# request records, so they are short and plain.
MAX_TOKEN_NAME_CHARS = 63
MIN_PROXY_SECRET_CHARS = 16


def parse_named_tokens(raw: str, env_name: str) -> dict[str, str]:
    """``name:token[,name:token...]`` (the value of ``$env_name``) -> {name: token}.

    The one parser of named-token variables (controller API identities, OTLP senders).
    Raises ``ValueError`` naming the variable and the entry: not ``name:token``, a name that is
    not 1-63 of letters, digits, ``-_.@``, a name given twice, or one token given two names.
    """
    out: dict[str, str] = {}
    for i, entry in enumerate(p.strip() for p in raw.split(",")):
        if not entry:
            continue
        name, sep, token = entry.partition(":")
        name, token = name.strip(), token.strip()
        where = f"${env_name} entry {i + 1}"
        if not sep or not token:
            raise ValueError(f"{where}: expected name:token")
        if not (
            0 < len(name) <= MAX_TOKEN_NAME_CHARS
            and all(c.isascii() and (c.isalnum() or c in "-_.@") for c in name)
        ):
            raise ValueError(
                f"{where}: name {name!r} must be 1-{MAX_TOKEN_NAME_CHARS} characters "
                "of letters, digits, '-', '_', '.', '@'"
            )
        if name in out:
            raise ValueError(f"{where}: name {name!r} appears twice")
        if token in out.values():
            raise ValueError(f"${env_name}: two names share one token")
        out[name] = token
    return out


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts local connections (127.x, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
