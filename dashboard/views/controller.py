"""Controller: what the controller decided and why (timeline with reasons, weights over
time), whether it enforces or only advises, the audit trail, and forms that override a
weight, clear it, drain or undrain an instance, or set a pool's weight — all through
the controller API, as the signed-in user (``dashboard.auth``; see ``dashboard.auth``):
with their own token (login) or the server's token on their behalf (header). Without an
identity the forms are shown disabled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from dashboard import auth, charts, context, data, replayview, ui
from dashboard.api import ApiResult, ControllerClient, ControllerError
from dashboard.views import regret

view = context.current()
url = view.store_url
settings = view.settings
identity = auth.current(settings)


def _mode_banner(routing: dict[str, Any] | None) -> None:
    if routing is not None:
        mode, enforce = routing.get("mode", "?"), bool(routing.get("enforce"))
        source = f"controller at {settings.controller_url}, routing table v{routing.get('version')}"
    else:
        mode = data.latest_mode(url) or settings.controller.mode
        enforce = mode == "enforce"
        source = (
            f"controller unreachable at {settings.controller_url}; "
            "mode from the last stored decision or config"
        )
    if enforce:
        st.success(
            f"**Enforcing**: the proxy applies these weights and limits. ({source})", icon=":material/gavel:"
        )
    else:
        st.warning(
            f"**Advisory ({mode})**: decisions are computed and shown; the proxy does not apply them. "
            f"({source})",
            icon=":material/visibility:",
        )


def _report(action: str, call: Any) -> None:
    try:
        result: ApiResult = call()
    except ControllerError as exc:
        hint = " — retry when the controller is back" if exc.retryable else ""
        if exc.status in (401, 403):
            if settings.dashboard.auth == "login":
                auth.sign_out()  # a revoked or expired token: ask for a fresh sign-in
                hint = " — the controller no longer accepts your token; sign in again"
            else:
                hint = f" — check the server's token in ${settings.controller.api_token_env}"
        st.error(f"{action} failed: {exc}{hint}", icon=":material/error:")
        return
    body = result.body
    audit = body.get("audit_id")
    served = body.get("weight")
    st.success(
        f"{action}: done (HTTP {result.status}"
        + (f", served weight now {served:.2f}" if isinstance(served, int | float) else "")
        + (f", audit #{audit}" if audit is not None else "")
        + ").",
        icon=":material/check:",
    )
    st.cache_data.clear()


def _has_reason(reason: str) -> bool:
    """False (after saying so) when the reason is blank: every change is audited with its reason."""
    if not reason.strip():
        st.error("A reason is required; it goes into the audit trail.")
        return False
    return True


# a change the forms make: what it is, in words, and the call that makes it with the given reason
Change = tuple[str, Callable[[ControllerClient, str], ApiResult]]


def _reason(key: str) -> str:
    return st.text_input("Reason", key=key, placeholder="why (required)")


def _do_or_undo(labels: tuple[str, str], off: bool, do: Change, undo: Change) -> Change | None:
    """A form's two submit buttons side by side, the first primary: the change of the one clicked, if any."""
    a, b = st.columns(2)
    did = a.form_submit_button(labels[0], type="primary", disabled=off)
    undid = b.form_submit_button(labels[1], disabled=off)
    return do if did else undo if undid else None


def _submit(client: ControllerClient | None, reason: str, change: Change | None) -> None:
    """Make the change and say how it went, when there is one, a client and a reason."""
    if change is not None and client is not None and _has_reason(reason):
        action, call = change
        _report(action, lambda: call(client, reason.strip()))


def _weight_form(tab: DeltaGenerator, names: list[str], off: bool, client: ControllerClient | None) -> None:
    with tab, st.form("weight_form"):
        inst = str(st.selectbox("Instance", names, key="w_instance"))
        weight = st.number_input(
            "Weight", min_value=0.0, max_value=100.0, value=0.5, step=0.05, key="w_weight"
        )
        ttl_min = st.number_input("For (minutes)", min_value=1, max_value=7 * 24 * 60, value=30, key="w_ttl")
        reason = _reason("w_reason")
        change = _do_or_undo(
            ("Set override", "Clear override"),
            off,
            (
                f"Weight {weight:g} on {inst}",
                lambda c, why: c.set_instance_weight(inst, float(weight), ttl_min * 60.0, why),
            ),
            (f"Clear override on {inst}", lambda c, why: c.clear_instance_weight(inst, why)),
        )
    _submit(client, reason, change)


def _drain_form(tab: DeltaGenerator, names: list[str], off: bool, client: ControllerClient | None) -> None:
    with tab, st.form("drain_form"):
        inst = str(st.selectbox("Instance", names, key="d_instance"))
        ttl_min = st.number_input(
            "Drain for (minutes, 0 = until undrained)",
            min_value=0,
            max_value=7 * 24 * 60,
            value=0,
            key="d_ttl",
        )
        reason = _reason("d_reason")
        change = _do_or_undo(
            ("Drain", "Undrain"),
            off,
            (f"Drain {inst}", lambda c, why: c.drain(inst, why, ttl_min * 60.0 if ttl_min else None)),
            (f"Undrain {inst}", lambda c, why: c.undrain(inst, why)),
        )
    _submit(client, reason, change)


def _pool_form(tab: DeltaGenerator, off: bool, client: ControllerClient | None) -> None:
    with tab, st.form("pool_form"):
        pool = st.selectbox("Pool", list(settings.pools), key="p_pool")
        pweight = st.number_input(
            "Weight (relative to pools of the same role)",
            min_value=0.0,
            max_value=100.0,
            value=1.0,
            step=0.1,
            key="p_weight",
        )
        pttl = st.number_input("For (minutes)", min_value=1, max_value=7 * 24 * 60, value=30, key="p_ttl")
        preason = _reason("p_reason")
        clicked = st.form_submit_button("Set pool weight", type="primary", disabled=off)
    change: Change = (
        f"Pool {pool} weight {pweight:g}",
        lambda c, why: c.set_pool_weight(str(pool), float(pweight), pttl * 60.0, why),
    )
    _submit(client, preason, change if clicked else None)


def _forms() -> None:
    names = [inst.name for _, inst in settings.instances()]
    why_not = auth.read_only_reason(settings, identity)
    off = why_not is not None
    if why_not is not None:
        st.info(why_not, icon=":material/key:")
    elif identity is not None:
        st.caption(f"Changes are made and audited as **{identity.name}**.")
    client = None if off or identity is None else identity.client(settings)
    weight_tab, drain_tab, pool_tab = st.tabs(["Instance weight", "Drain / undrain", "Pool weight"])
    # each form's outcome is drawn below the tabs, not in its tab
    _weight_form(weight_tab, names, off, client)
    _drain_form(drain_tab, names, off, client)
    _pool_form(pool_tab, off, client)


def _history() -> None:
    presence = data.presence(url)
    latest = data.latest_ts(url)
    window = view.window(context.now(), latest)
    if not presence.schema:
        ui.no_store(view)
        return
    st.subheader("Decisions")
    decisions = data.decisions(url, window.start, window.end)
    if decisions.empty:
        if presence.decisions:
            ui.no_data(view, "decisions", latest)
        else:
            st.info(
                f"**No decisions yet.** Start the controller: `pdscope --config {view.config_path} control` "
                f"(it needs snapshots from `pdscope collect`).",
                icon=":material/hourglass_empty:",
            )
    else:
        tl = ui.to_time(decisions.rename(columns={"ts": "time"}), "time")
        st.altair_chart(charts.timeline(tl), width="stretch")
        with st.expander(f"{len(decisions)} decisions with their reasons and arithmetic", expanded=True):
            st.dataframe(
                ui.to_time(decisions.drop(columns=["id"]), "ts"), hide_index=True, width="stretch", height=240
            )
        weights = data.weight_history(url, window.start, window.end)
        if not weights.empty:
            w = ui.to_time(weights.rename(columns={"ts": "time"}), "time")
            st.altair_chart(
                charts.lines(w, "weight", "subject", "Policy weights over time", "weight", step=True),
                width="stretch",
            )
    if presence.decisions:
        regret.section(view, window)

    left, right = st.columns(2)
    with left:
        st.subheader("Overrides in force")
        ui.table_or_caption(data.active_overrides(url, window.end), "None.", ("created", "expires"))
    with right:
        st.subheader("Audit trail")
        ui.table_or_caption(
            data.audit_trail(url, window.start, window.end),
            "No change was made through the API in this time range.",
            ("ts",),
            height=240,
        )


def render() -> None:
    window = view.window(context.now(), data.latest_ts(url))
    ui.header("Controller", view, window, "decisions, weights, overrides and audit")
    routing = data.routing_table(settings.controller_url)
    _mode_banner(routing)
    if routing is not None and routing.get("instances"):
        served = pd.DataFrame(routing["instances"])
        keep = [c for c in ("name", "pool", "role", "weight", "drained", "reason") if c in served]
        st.dataframe(served[keep], hide_index=True, width="stretch")
    _proxies(routing)
    _history()


def _parts_chart(live: pd.DataFrame) -> None:
    """Each live proxy's part of each pool's limits, as stacked bars."""
    chart = live.assign(part=live["share"].fillna(0.0))
    st.vega_lite_chart(
        chart,
        {
            "mark": {"type": "bar"},
            "encoding": {
                "y": {"field": "pool", "type": "nominal", "title": None},
                "x": {
                    "field": "part",
                    "type": "quantitative",
                    "stack": "normalize",
                    "title": "part of the limits",
                },
                "color": {"field": "proxy", "type": "nominal"},
                "tooltip": [
                    {"field": "proxy"},
                    {"field": "max_inflight_requests", "title": "request slots"},
                    {"field": "inflight"},
                    {"field": "demand_per_s", "format": ".1f"},
                ],
            },
            "height": 40 + 30 * live["pool"].nunique(),
        },
        width="stretch",
    )


def _proxies(routing: dict[str, Any] | None) -> None:
    """Who admits into the pools and with what part of their limits (``GET /v1/proxies``' rows)."""
    st.subheader("Proxies and their parts of the limits")
    rows = data.proxies(url, context.now(), settings.controller.proxy_ttl_s)
    if rows.empty:
        st.caption(
            "No proxy has reported on a routing poll yet (a proxy older than this controller, or none "
            "polling): each proxy then admits the config's limits divided by proxy.expected_replicas."
        )
        return
    live = rows[rows["live"]]
    n_live = live["proxy"].nunique()
    version = None if routing is None else routing.get("version")
    behind = sorted(set(live.loc[live["applied_version"] != version, "proxy"])) if version is not None else []
    parts = live.groupby("pool")["max_inflight_requests"].sum()
    summary = ", ".join(f"{pool}: {int(n)}" for pool, n in parts.items())
    st.caption(
        f"{n_live} live prox{'y' if n_live == 1 else 'ies'} (polled within controller.proxy_ttl_s = "
        f"{settings.controller.proxy_ttl_s:g} s); request slots held between them per pool: {summary}."
        + (f" Not on table v{version} yet: {', '.join(behind)}." if behind else "")
    )
    if int(rows["duplicates"].max() or 0) > 0:
        st.warning(
            "Two processes poll under one proxy id (see duplicates): give every proxy process its own "
            "proxy.id; the earlier one is refused its part.",
            icon=":material/warning:",
        )
    if not live.empty:
        _parts_chart(live)
    st.dataframe(rows, hide_index=True, width="stretch")


st.fragment(run_every=view.refresh_s if view.live else None)(render)()
with st.container(border=True):
    st.subheader("Change routing")
    _forms()
# last and outside the live fragment: a replay runs when asked, not on every refresh
_window = view.window(context.now(), data.latest_ts(url))
replayview.render(settings.controller_url, _window.start, _window.end)
