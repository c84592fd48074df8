"""The ``dashboard`` section: the Streamlit app and who may change things through it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdscope.config.base import Port, _Frozen


class DashboardSettings(_Frozen):
    host: str = "127.0.0.1"
    """address the Streamlit app listens on; a non-loopback one needs auth login or header"""
    port: Port = 8501
    """port of the Streamlit app"""
    auth: Literal["login", "header", "none"] = "login"
    """login: each user signs in with their own controller API token (checked with GET /v1/whoami) and changes
    are made with it; header: the identity comes from identity_header, set by a trusted auth proxy, and
    changes use the server's token with X-Actor; none: read-only (forms disabled). A non-loopback host
    needs login or header."""
    identity_header: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")
    """request header carrying the user set by the auth proxy (auth: header), e.g. X-Forwarded-User; required
    with auth: header, ignored otherwise"""

    @model_validator(mode="after")
    def _header_mode_names_its_header(self) -> DashboardSettings:
        if self.auth == "header" and self.identity_header is None:
            raise ValueError(
                "auth: header needs identity_header (e.g. X-Forwarded-User, set by your auth proxy)"
            )
        return self
