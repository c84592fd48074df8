"""``pdscope whatif``: what a candidate policy config would have done to a stored window, on the simulator.

From the window's request records and D snapshots, :func:`simulator.fit.fit` fits the simulated
fleet that ran (the workload, each P's prefill rate, each D's step time, the link bandwidth, and
the degradations found as fault specs at their offsets). The fitted fleet is then run here, on
127.0.0.1, as the same services as in production (``pdscope sim``, ``collect``, ``control``,
``proxy`` as subprocesses of one generated pdscope.yaml, a temporary SQLite store), with the
window's arrivals replayed open-loop and the fitted faults injected at their offsets: once under
the policy config that ran (the config file's ``controller``/``proxy`` sections) and, with
``--candidate``, once under the candidate. Each replay is judged from its own store's records by
the same rule as the window (``store.queries.slo_summary`` under ``slo.*``).

Bound: a replay lasts at most ``--max-replay-s`` (default 120 s) of load. A longer window is
thinned: every k-th arrival at 1/k of its offset, the faults' offsets and durations divided by k,
so the arrival rate (and so each instance's load) is the window's; the controller's own time
constants are not compressed, which is stated in the output when k > 1.

Prints observed | fitted(old) | candidate: goodput (requests meeting every SLO per second), SLO
attainment, p99 TTFT, and the fit's error on the actual run (fitted(old) against observed). A
candidate whose goodput is under fitted(old)'s by more than ``--tolerance`` gets a ``WORSE``
verdict line and exit code 3. Exit codes: 0 done, 1 no data in the range / a store that cannot be
read / a candidate that fails validation (the error names the field) / a replay that failed,
2 a bad range, 3 the candidate would have cut goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from pdscope.cli.bounds import MAX_BUCKETS, WINDOW, fail, refuse
from pdscope.config import ConfigError, Settings, load_settings, validated
from pdscope.stack import LOOPBACK, Child, ChildGroup, free_ports, loopback_url, pdscope_argv, write_config
from pdscope.stats import effective_size, quantile_interval
from simulator.fit import FitError, FitParams, FittedFleet, RequestObs, SnapshotObs, fit

logger = logging.getLogger(__name__)

EXIT_WORSE = 3
CANDIDATE_SECTIONS = ("controller", "proxy", "alerts")
MAX_CANDIDATE_BYTES = 1 << 20
REPLAY_SEED = 0
LOOP_LAG_TRUST_S = 0.05  # simulator.loop_lag_threshold_s's default: past it simulated timings are suspect


# -- the candidate --------------------------------------------------------------------------


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_candidate(path: str) -> dict[str, Any]:
    """The candidate file: a mapping of pdscope.yaml sections (controller, proxy, alerts) laid over
    the config that ran. Raises ConfigError naming the file and the key."""
    p = Path(path)
    try:
        raw = p.read_bytes()[: MAX_CANDIDATE_BYTES + 1]
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    if len(raw) > MAX_CANDIDATE_BYTES:
        raise ConfigError([f"{p}: larger than {MAX_CANDIDATE_BYTES} bytes"])
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError([f"{p}: expected a mapping of sections ({', '.join(CANDIDATE_SECTIONS)})"])
    bad = [str(k) for k in data if k not in CANDIDATE_SECTIONS]
    if bad:
        raise ConfigError(
            [f"{p}: {k}: a candidate changes only {', '.join(CANDIDATE_SECTIONS)}" for k in sorted(bad)]
        )
    for k, v in data.items():
        if not isinstance(v, dict):
            raise ConfigError([f"{p}: {k}: expected a mapping"])
    return data


def validate(config: dict[str, Any], source: str) -> Settings:
    """``config`` as Settings; a ConfigError naming ``source`` and each bad field."""
    return validated(Settings, config, source, "config")


# -- reading the window -----------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    requests: list[RequestObs]
    roles: dict[str, str]
    snapshots: list[SnapshotObs]
    policies: list[str]  # the policy fingerprints of the window's decisions


def read_window(url: str, settings: Settings, lo: float, hi: float) -> Window:
    from sqlalchemy import select

    from store import queries as q
    from store.db import opened, transaction
    from store.models import Decision, RequestRecord, Snapshot

    r = RequestRecord
    with opened(url) as sessions, transaction(sessions) as s:
        rows = s.execute(
            select(
                r.proxy_in, r.status, r.http_status, r.prompt_tokens, r.completion_tokens,
                r.p_instance, r.d_instance, r.ttft_s, r.tpot_s, r.p_prefill_s, r.p_done,
                r.first_token, r.kv_bytes, r.p_cached_tokens,
            ).where(r.proxy_in >= lo, r.proxy_in <= hi)
        ).all()  # fmt: skip
        snaps = s.execute(
            select(
                Snapshot.instance, Snapshot.role, Snapshot.ts, Snapshot.nixl_xfer_time_sum,
                Snapshot.nixl_bytes_sum,
            ).where(Snapshot.ts >= lo, Snapshot.ts <= hi)
        ).all()  # fmt: skip
        policies = s.execute(
            select(Decision.policy).where(Decision.ts >= lo, Decision.ts <= hi).distinct()
        ).all()
    reqs = [
        RequestObs(
            arrival=row.proxy_in,
            status=row.status,
            prompt_tokens=row.prompt_tokens,
            output_tokens=row.completion_tokens,
            p=row.p_instance,
            d=row.d_instance,
            ttft_s=row.ttft_s,
            tpot_s=row.tpot_s,
            p_prefill_s=row.p_prefill_s,
            handoff_s=None if row.first_token is None or row.p_done is None else row.first_token - row.p_done,
            kv_bytes=row.kv_bytes,
            p_cached_tokens=row.p_cached_tokens,
        )
        for row in rows
        if not q.is_client_error(row.status, row.http_status)
    ]
    roles: dict[str, str] = {inst.name: str(settings.pools[pool].role) for pool, inst in settings.instances()}
    for sn in snaps:
        roles.setdefault(sn.instance, sn.role)
    seen = {n for rq in reqs for n in (rq.p, rq.d) if n}
    roles = {n: role for n, role in roles.items() if n in seen or any(sn.instance == n for sn in snaps)}
    d_snaps = [
        SnapshotObs(sn.instance, sn.ts, sn.nixl_xfer_time_sum, sn.nixl_bytes_sum)
        for sn in snaps
        if sn.role == "decode"
    ]
    return Window(reqs, roles, d_snaps, sorted(str(p[0]) for p in policies if p[0]))


# -- one run of the services ------------------------------------------------------------------


def _http_json(url: str, body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="GET" if body is None else "POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def stack_config(
    base: Settings, roles: dict[str, str], simulator: dict[str, Any], store_url: str
) -> dict[str, Any]:
    """A pdscope.yaml for one run on 127.0.0.1: ``base``'s model, SLOs, alerts and its controller,
    proxy and collector settings; ``roles``' instances on free ports (in their pools where ``base``
    has them); ``simulator`` as the simulator section; every service on a free port."""
    ports = iter(free_ports(len(roles) + 4))
    pools: dict[str, dict[str, Any]] = {}
    for name, role in sorted(roles.items()):
        pool = base.pool_of(name)
        if pool is None or base.pools[pool].role != role:
            pool = role
        pools.setdefault(pool, {"role": role, "instances": []})["instances"].append(
            {"name": name, "url": loopback_url(next(ports))}
        )

    def section(name: str) -> dict[str, Any]:
        dumped: dict[str, Any] = getattr(base, name).model_dump(mode="json", exclude_defaults=True)
        return dumped

    port = {k: next(ports) for k in ("proxy", "collector", "controller", "admin")}
    collector = loopback_url(port["collector"])
    return {
        "model": section("model"),
        "pools": pools,
        "slo": section("slo"),
        "alerts": section("alerts"),
        "store": {"url": store_url},
        "simulator": {**simulator, "admin_port": port["admin"], "tracing": True},
        "collector": {**section("collector"), "host": LOOPBACK, "port": port["collector"]},
        "controller": {**section("controller"), "host": LOOPBACK, "port": port["controller"]},
        "proxy": {
            **section("proxy"),
            "host": LOOPBACK,
            "port": port["proxy"],
            "controller_url": loopback_url(port["controller"]),
            "tracing": True,
            "otlp_endpoint": f"{collector}/v1/traces",
        },
    }


@dataclass(frozen=True)
class RunResult:
    since: float
    until: float
    store_url: str
    sent: int
    loop_lag_max_s: float | None


class Stack:
    """``with Stack(config, tmp) as s:`` starts ``pdscope sim``, ``collect``, ``control`` and
    ``proxy`` from one pdscope.yaml and waits until each answers; stops them on exit (SIGTERM,
    then SIGKILL after 15 s). A service that does not start raises :class:`pdscope.stack.StartError`."""

    def __init__(self, config: dict[str, Any], tmp: Path) -> None:
        self.config = config
        self.tmp = tmp
        self.path = write_config(tmp / "pdscope.yaml", config)
        self.children = ChildGroup(grace_s=15.0)
        self.admin_url = loopback_url(config["simulator"]["admin_port"])
        self.proxy_url = loopback_url(config["proxy"]["port"])
        self.controller_url = loopback_url(config["controller"]["port"])

    def __enter__(self) -> Stack:
        from store.migrate import upgrade

        with self.children.starting():
            upgrade(self.config["store"]["url"])
            for command, ready_url in (
                ("sim", self.admin_url + "/instances"),
                ("collect", None),
                ("control", self.controller_url + "/healthz"),
                ("proxy", self.proxy_url + "/healthz"),
            ):
                argv = pdscope_argv(self.path, command, log_level="WARNING")
                self.children.start(
                    Child(command, argv, self.tmp / f"{command}.log", ready_url=ready_url), 90.0
                )
        return self

    def __exit__(self, *exc: object) -> None:
        self.children.stop()


def _records_settled(url: str, since: float, expected: int, timeout_s: float) -> int:
    """Poll the store until it holds a record per request sent since ``since`` or the count stops
    growing for three polls; the count."""
    from sqlalchemy import func, select

    from store.db import opened, transaction
    from store.models import RequestRecord

    deadline = time.monotonic() + timeout_s
    last, steady, n = -1, 0, 0
    with opened(url) as sessions:
        while time.monotonic() < deadline:
            with transaction(sessions) as s:
                n = int(s.scalar(select(func.count()).where(RequestRecord.proxy_in >= since)) or 0)
            if n >= expected:
                return n
            steady = steady + 1 if n == last else 0
            if steady >= 3 and n > 0:
                return n
            last = n
            time.sleep(1.0)  # the collector assembles a record once its trace is complete
    return n


def run_load(
    config: dict[str, Any],
    tmp: Path,
    planned: list[tuple[float, int, int]],
    faults: list[dict[str, Any]],
) -> RunResult:
    """Start the services of ``config``, send ``planned`` (offset s, prompt tokens, output tokens)
    open-loop through the proxy and inject ``faults`` (their ``at`` counted from the first send);
    wait for the records; stop everything. The run's window is [first send, last planned offset]."""
    from simulator.loadgen import LoadTarget
    from simulator.loadgen import run_load as send
    from simulator.workload import Planned

    plan = [Planned(at, prompt, out) for at, prompt, out in planned]
    horizon = max((p.at for p in plan), default=0.0)
    with Stack(config, tmp) as stack:
        t0: list[float] = []

        def on_start() -> None:
            t0.append(time.time())
            for f in faults:
                _http_json(stack.admin_url + "/faults", f)

        target = LoadTarget(model=str(config["model"]["name"]), url=stack.proxy_url)
        timeout = float(config.get("proxy", {}).get("timeouts", {}).get("decode_total_s", 60.0))
        asyncio.run(send(target, plan, timeout_s=timeout, seed=REPLAY_SEED, on_start=on_start))
        since = t0[0]
        _records_settled(config["store"]["url"], since, len(plan), timeout_s=30.0)
        try:
            lag = float(_http_json(stack.admin_url + "/stats").get("loop_lag_max_s"))
        except (OSError, ValueError, TypeError):
            lag = None
    return RunResult(since, since + max(horizon, 1e-3), config["store"]["url"], len(plan), lag)


# -- judging a run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    requests: int
    completed: int
    goodput_per_s: float
    attainment: float | None
    ttft_p99_s: float | None
    # the p99's 95 % sampling interval (pdscope.stats.quantile_interval) at the run's effective size (its
    # slow requests come in clumps: pdscope.stats.effective_size): where another run's could be
    ttft_p99_interval_s: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "goodput_per_s": self.goodput_per_s,
            "attainment": self.attainment,
            "ttft_p99_s": self.ttft_p99_s,
            "ttft_p99_interval_s": None
            if self.ttft_p99_interval_s is None
            else list(self.ttft_p99_interval_s),
        }


def figures(url: str, settings: Settings, lo: float, hi: float) -> Figures:
    from store import queries as q
    from store.db import opened, transaction

    only = q.RecordFilter(charged_only=True)
    with opened(url) as sessions, transaction(sessions) as s:
        got = q.slo_summary(s, lo, hi, only=only, slo=settings.slo).get("all")
        ttfts = q.completed_ttfts(s, lo, hi, only=only)
    if got is None:
        return Figures(0, 0, 0.0, None, None)
    interval = quantile_interval(ttfts, 99.0, effective_n=max(1.0, effective_size(ttfts)))
    return Figures(got.requests, got.completed, got.goodput_per_s, got.attainment, got.ttft_p99_s, interval)


def overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool | None:
    """Whether two sampling intervals overlap (the two runs' figures could be one process's); None
    when either is unknown."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def rel_error(fitted: float | None, observed: float | None) -> float | None:
    """(fitted - observed) / observed; None when either is unknown or observed is 0."""
    if fitted is None or observed is None or observed == 0:
        return None
    return (fitted - observed) / observed


def verdict(old: Figures, cand: Figures, tolerance: float) -> tuple[str, bool]:
    """The candidate against fitted(old): (line, worse)."""
    if old.goodput_per_s <= 0:
        worse = False
        change = "fitted(old) met no SLO: goodput cannot be compared"
    else:
        rel = (cand.goodput_per_s - old.goodput_per_s) / old.goodput_per_s
        worse = rel < -tolerance
        change = f"goodput {old.goodput_per_s:.3f} -> {cand.goodput_per_s:.3f} req/s ({rel:+.1%})"
    if worse:
        return f"WORSE: the candidate would have cut goodput: {change}", True
    return f"NOT WORSE (within {tolerance:.0%} or better): {change}", False


# -- the command -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", help="a duration back from --until (or now): 90s, 30m, 2h")
    parser.add_argument("--from", dest="from_", type=float, help="start, Unix seconds (instead of --since)")
    parser.add_argument("--until", type=float, help="end, Unix seconds (default: now)")
    parser.add_argument(
        "--candidate", help="YAML of controller/proxy/alerts sections laid over the config that ran"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--max-replay-s",
        type=float,
        default=120.0,
        help="longest replay, seconds of load (a longer window is thinned, default 120)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="goodput loss that makes a candidate WORSE (0.05)"
    )
    parser.add_argument("--bucket-s", type=float, default=5.0, help="the fit's time bucket (default 5 s)")
    parser.add_argument("--fit-only", action="store_true", help="print the fitted fleet; replay nothing")
    parser.add_argument("--store", help="store URL (default: store.url)")
    parser.add_argument(
        "--workdir", help="keep each replay's config, store and logs here (default: a temp dir)"
    )


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _interval(iv: tuple[float, float] | None) -> str:
    return "n/a" if iv is None else f"{iv[0]:.2f}-{iv[1]:.2f}"


def _sampling(within: bool | None) -> str:
    if within is None:
        return ""
    return " (within sampling: the runs' 95 % intervals overlap)" if within else " (beyond sampling)"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _table(cols: dict[str, Figures]) -> list[str]:
    names = list(cols)
    rows: list[tuple[str, Callable[[Figures], str]]] = [
        ("requests", lambda f: str(f.requests)),
        ("goodput (req/s)", lambda f: _num(f.goodput_per_s, ".3f")),
        ("SLO attainment", lambda f: _num(None if f.attainment is None else 100 * f.attainment, ".1f") + "%"),
        ("p99 TTFT (s)", lambda f: _num(f.ttft_p99_s, ".3f")),
        ("  95 % interval", lambda f: _interval(f.ttft_p99_interval_s)),
    ]
    out = [f"{'':18}" + "".join(f"{n:>14}" for n in names)]
    for label, get in rows:
        out.append(f"{label:18}" + "".join(f"{get(cols[n]):>14}" for n in names))
    return out


@dataclass(frozen=True)
class Plan:
    settings: Settings
    candidate: Settings | None
    candidate_overlay: dict[str, Any] | None
    lo: float
    hi: float


def _replay(
    plan: Plan, fitted: FittedFleet, k: int, overlay: dict[str, Any] | None, workdir: Path, label: str
) -> tuple[Figures, RunResult]:
    tmp = workdir / label
    tmp.mkdir(parents=True, exist_ok=True)
    sim = {
        **fitted.simulator_section(),
        "seed": REPLAY_SEED,
        "lease_duration_s": plan.settings.controller.kv_lease_s,
    }
    cfg = stack_config(plan.settings, fitted.roles(), sim, f"sqlite:///{tmp / 'store.db'}")
    cfg["collector"]["spool_dir"] = str(tmp / "collector-spool")  # the run's, gone with its folder
    if overlay:
        keep = {s: cfg[s] for s in CANDIDATE_SECTIONS}
        cfg = _merge(cfg, overlay)
        for s in ("controller", "proxy"):  # the run's own addresses win over the candidate's
            for key in ("host", "port", "controller_url", "otlp_endpoint", "tracing"):
                if key in keep[s]:
                    cfg[s][key] = keep[s][key]
    settings = validate(cfg, label)
    trace = [(a.at, a.prompt_tokens, a.output_tokens) for a in fitted.replay_trace(k)]
    faults = [f.model_dump(exclude_none=True) for f in fitted.scenario(k)]
    logger.info("whatif: replaying %d requests under %s (%s)", len(trace), label, tmp)
    run = run_load(cfg, tmp, trace, faults)
    # judged over the window's span on the replay's clock (goodput is per second of the window)
    run = RunResult(run.since, run.since + fitted.duration_s / k, run.store_url, run.sent, run.loop_lag_max_s)
    return figures(run.store_url, settings, run.since, run.until), run


BOUNDS = {**WINDOW, "max_replay_s": (1.0, 86_400.0), "tolerance": (0.0, 0.99), "bucket_s": (0.1, 3600.0)}


def _resolve(args: argparse.Namespace) -> Plan | int:
    from controller.attribution import BadRange, resolve_range

    if (code := refuse("whatif", args, BOUNDS)) is not None:
        return code
    settings = load_settings(args)
    try:
        lo, hi = resolve_range(time.time(), since=args.since, from_=args.from_, until=args.until)
        if not args.max_replay_s > 0:
            raise BadRange("max-replay-s", "must be more than 0")
        if not 0 <= args.tolerance < 1:
            raise BadRange("tolerance", "must be 0 to 1")
        if not args.bucket_s > 0:
            raise BadRange("bucket-s", "must be more than 0")
        if (hi - lo) / args.bucket_s > MAX_BUCKETS:
            raise BadRange("bucket-s", f"{hi - lo:g} s / {args.bucket_s:g} s is over {MAX_BUCKETS} buckets")
    except BadRange as exc:
        return fail("whatif", f"--{exc.param}: {exc.reason}", 2)
    overlay = None if args.candidate is None else load_candidate(args.candidate)
    cand = None
    if overlay is not None:  # validated before anything runs: the error names the field
        cand = validate(
            _merge(settings.model_dump(mode="json", exclude_defaults=True), overlay), args.candidate
        )
    return Plan(settings, cand, overlay, lo, hi)


def _policies(plan: Plan, window: Window) -> dict[str, Any]:
    """The policy fingerprints: the window's decisions', the config file's and the candidate's; a note
    when the config file's is not among the window's (the replay runs the config file's)."""
    from controller.policy.config import PolicyConfig

    old = PolicyConfig.from_settings(plan.settings).fingerprint()
    out: dict[str, Any] = {"policies_in_window": window.policies, "policy_old": old}
    if plan.candidate is not None:
        out["policy_candidate"] = PolicyConfig.from_settings(plan.candidate).fingerprint()
    if window.policies and old not in window.policies:
        out["policy_note"] = (
            f"the config file's policy {old} took none of the window's decisions "
            f"({', '.join(window.policies)}): the replay runs the config file's"
        )
    return out


@contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="pdscope-whatif-") as tmp:
        yield Path(tmp)


def run(args: argparse.Namespace) -> int:
    from store.db import StoreError

    plan = _resolve(args)
    if isinstance(plan, int):
        return plan
    url = args.store or plan.settings.store.url
    try:
        window = read_window(url, plan.settings, plan.lo, plan.hi)
        observed = figures(url, plan.settings, plan.lo, plan.hi)
    except StoreError as exc:
        return fail("whatif", f"the store cannot be read: {exc}")
    try:
        fitted = fit(
            window.requests, window.roles, plan.lo, plan.hi, snapshots=window.snapshots,
            params=FitParams(bucket_s=args.bucket_s),
        )  # fmt: skip
    except FitError as exc:
        return fail("whatif", f"{exc} from {_when(plan.lo)} to {_when(plan.hi)}")
    k = fitted.compression(args.max_replay_s)
    result: dict[str, Any] = {"window": {"since": plan.lo, "until": plan.hi}, "fit": fitted.summary()}
    result["compression"] = k
    result |= _policies(plan, window)
    if args.fit_only:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return 0
    cols = {"observed": observed}
    try:
        with _workdir(args.workdir) as wd:
            cols["fitted(old)"], old_run = _replay(plan, fitted, k, None, wd, "fitted-old")
            if plan.candidate_overlay is not None:
                cols["candidate"], _ = _replay(plan, fitted, k, plan.candidate_overlay, wd, "candidate")
    except (RuntimeError, TimeoutError, OSError) as exc:
        return fail("whatif", f"a replay failed: {exc}")
    return _report(args, result, cols, old_run, k)


def _report(
    args: argparse.Namespace, result: dict[str, Any], cols: dict[str, Figures], old_run: RunResult, k: int
) -> int:
    obs, old = cols["observed"], cols["fitted(old)"]
    err = {
        "goodput": rel_error(old.goodput_per_s, obs.goodput_per_s),
        "ttft_p99": rel_error(old.ttft_p99_s, obs.ttft_p99_s),
        "attainment": rel_error(old.attainment, obs.attainment),
    }
    within = overlap(old.ttft_p99_interval_s, obs.ttft_p99_interval_s)
    line, worse = ("", False)
    if "candidate" in cols:
        line, worse = verdict(old, cols["candidate"], args.tolerance)
    result |= {
        "figures": {n: f.as_dict() for n, f in cols.items()},
        "fit_error": {**err, "ttft_p99_within_sampling": within},
        "replay": {"requests": old_run.sent, "seconds": old_run.until - old_run.since},
        "replay_loop_lag_max_s": old_run.loop_lag_max_s,
        "verdict": line or None,
        "worse": worse,
    }
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return EXIT_WORSE if worse else 0
    w = result["window"]
    print(f"{_when(w['since'])} .. {_when(w['until'])}: {obs.requests} requests; replayed {old_run.sent}")
    if k > 1:
        print(f"(thinned {k}x to {old_run.until - old_run.since:.0f} s of load; controller times not scaled)")
    for f in result["fit"]["faults"]:
        print(f"fitted fault: {json.dumps(f, sort_keys=True)}")
    notes = [*result["fit"]["notes"], *([result["policy_note"]] if "policy_note" in result else [])]
    lag = old_run.loop_lag_max_s
    if lag is not None and lag > LOOP_LAG_TRUST_S:
        notes.append(
            f"the replay's simulator lagged {lag:.3f}s (over {LOOP_LAG_TRUST_S}s): its timings are suspect"
        )
    for n in notes:
        print(f"note: {n}")
    for row in _table(cols):
        print(row)
    print(
        f"fit error on the actual run: goodput {_pct(err['goodput'])}, p99 TTFT {_pct(err['ttft_p99'])}"
        f"{_sampling(within)}, attainment {_pct(err['attainment'])}"
    )
    if line:
        print(line)
    return EXIT_WORSE if worse else 0
