"""Who is using the dashboard, and with which token it may change routing.

``dashboard.auth`` picks one of three modes (see ``pdscope.config.DashboardSettings``):

- ``login``: the user signs in from the sidebar with *their own* controller API token; the
  dashboard checks it with ``GET /v1/whoami`` and uses that token for every change in this
  browser session. The audit actor is the identity the controller names for the token.
- ``header``: a trusted auth proxy in front of the dashboard sets ``identity_header``; changes
  use the server's token (``controller.api_token_env``) with ``X-Actor: <identity>``, so the
  controller records ``api:<identity>``. No header: read-only.
- ``none``: read-only; the forms are disabled.

There is no free-text actor anywhere. The token a user pasted lives only in this Streamlit
session's state (server memory), never in the URL or the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import streamlit as st

from dashboard.api import ControllerClient, ControllerError
from pdscope.config import Settings
from pdscope.text import clean_name

_LOGIN_KEY = "_pdscope_login"
MAX_IDENTITY_CHARS = 64


@dataclass(frozen=True)
class Identity:
    """A user allowed to change routing, and how the dashboard calls the controller for them."""

    name: str
    token: str | None  # the bearer token to send
    actor: str | None  # X-Actor to send (header mode: the proxy's identity), else None
    source: str  # "login" or "header"

    def client(self, settings: Settings, timeout_s: float = 5.0) -> ControllerClient:
        return ControllerClient(settings.controller_url, self.token, timeout_s=timeout_s, actor=self.actor)


def clean_identity(raw: str | None) -> str | None:
    """An identity from a header: NFC, printable characters only, at most 64 characters; None when
    nothing visible is left (:func:`pdscope.text.clean_name`, the controller's X-Actor rule)."""
    if raw is None:
        return None
    return clean_name(raw, MAX_IDENTITY_CHARS)


def request_headers() -> Mapping[str, str]:
    """The headers of the browser's request to this Streamlit session (case-insensitive)."""
    return st.context.headers  # empty outside a browser session (bare runs, AppTest)


def _header_identity(settings: Settings) -> Identity | None:
    header = settings.dashboard.identity_header
    if header is None:
        return None
    headers = request_headers()
    raw = headers.get(header)
    if raw is None:  # Streamlit's headers are case-insensitive; a plain dict (tests) may not be
        raw = next((v for k, v in headers.items() if k.lower() == header.lower()), None)
    name = clean_identity(raw)
    if name is None:
        return None
    return Identity(name=name, token=settings.api_token(), actor=name, source="header")


def current(settings: Settings) -> Identity | None:
    """The signed-in user of this session, or None (read-only)."""
    mode = settings.dashboard.auth
    if mode == "login":
        got = st.session_state.get(_LOGIN_KEY)
        return got if isinstance(got, Identity) else None
    if mode == "header":
        return _header_identity(settings)
    return None


def sign_out() -> None:
    st.session_state.pop(_LOGIN_KEY, None)


def sign_in(settings: Settings, token: str) -> tuple[Identity | None, str | None]:
    """Check ``token`` with the controller; on success remember it for this session.

    Returns ``(identity, None)`` or ``(None, why not)``.
    """
    token = token.strip()
    if not token:
        return None, "Paste your controller API token."
    try:
        name = clean_identity(ControllerClient(settings.controller_url, token, timeout_s=5.0).whoami())
    except ControllerError as exc:
        if exc.status in (401, 403):
            return None, "The controller refused this token."
        return None, f"Cannot check the token: {exc}"
    if name is None:
        return None, "The controller named no identity for this token."
    ident = Identity(name=name, token=token, actor=None, source="login")
    st.session_state[_LOGIN_KEY] = ident
    return ident, None


def sidebar(settings: Settings) -> Identity | None:
    """The sidebar's sign-in box (login mode) or identity line; returns the current identity."""
    sb = st.sidebar
    mode = settings.dashboard.auth
    if mode == "none":
        sb.caption("Read-only dashboard (`dashboard.auth: none`).")
        return None
    if mode == "header":
        ident = current(settings)
        if ident is None:
            sb.caption(f"Read-only: no `{settings.dashboard.identity_header}` header from the auth proxy.")
        else:
            sb.caption(f"Signed in as **{ident.name}** (from `{settings.dashboard.identity_header}`).")
        return ident
    ident = current(settings)
    if ident is not None:
        sb.caption(f"Signed in as **{ident.name}**.")
        if sb.button("Sign out", key="sign_out"):
            sign_out()
            st.rerun()
        return ident
    with sb.form("login_form", clear_on_submit=True):
        token = st.text_input(
            "Controller API token",
            type="password",
            key="login_token",
            help="Your own token for the controller API: changes are made, and audited, as its identity.",
        )
        submitted = st.form_submit_button("Sign in")
    if submitted:
        ident, why = sign_in(settings, str(token or ""))
        if why:
            sb.error(why, icon=":material/lock:")
        else:
            st.rerun()  # redraw the sidebar and the forms as the signed-in user
    return ident


def read_only_reason(settings: Settings, ident: Identity | None) -> str | None:
    """Why the forms are disabled for this session, or None when they are enabled."""
    d = settings.dashboard
    if d.auth == "none":
        return (
            "This dashboard is read-only (`dashboard.auth: none`); change routing through the controller API."
        )
    if d.auth == "login":
        return (
            None
            if ident is not None
            else "Sign in (sidebar) with your controller API token to change routing."
        )
    if ident is None:
        return (
            f"Read-only: the request carries no `{d.identity_header}` header, so the auth proxy in "
            "front of the dashboard did not identify you."
        )
    if ident.token is None:
        return (
            f"Set `${settings.controller.api_token_env}` in the dashboard's environment to enable these "
            "actions (the controller refuses changes without its token)."
        )
    return None
