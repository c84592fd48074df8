"""What the goodput bench can run: fleet shapes, workload mixes, loads, faults, contenders, cell names.

Pure values and functions (no I/O, no clock). A *cell* is one fleet x one load x one fault,
named ``FLEET:LOAD:FAULT`` (``2p4d:75:slow_prefill``); every contender runs once per cell and seed
on a fresh fleet. ``fault_plan`` turns a fault name into the simulator fault specs to inject at
onset (``at`` delays one past onset), the instances the fault is about (a cut of any other
instance's weight is a cut of a healthy one), the pools whose limit cuts are an expected answer
to it, the extra load it adds, and the workload mix of the cell (the capacity is measured per
fleet and mix).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any

CONTENDERS = ("round_robin", "static", "controller", "oracle", "killed")
# the order of a cell's runs in the job queue: the two heavy (controlled) runs apart, so that three
# runs at a time hold at most two of them
RUN_ORDER = ("controller", "round_robin", "static", "killed", "oracle")
CONTROLLED = ("controller", "killed")  # contenders that run pdscope collect + control
LOADS = (75, 90)
FAULTS = (
    "degraded_decode_link",
    "slow_prefill",
    "transfer_failures",
    "stuck_decode",
    "bad_pair",
    "p_nic",
    "p_failing",
    "p_kv",
    "decode_down",
    "kv_capacity",
    "burst",
    # overload: more offered than the fleet (or what is left of it) can serve in time
    "surge",
    "p_down",
    "d_lost",
    "degrade",
    "prefill_heavy",
)
OVERLOAD = ("burst", "surge", "p_down", "d_lost", "degrade", "prefill_heavy")
# the old bench's scenario letters, still accepted by --faults
LETTERS = {"a": "degraded_decode_link", "b": "burst", "c": "slow_prefill"}
HEALTHY = "healthy"  # the fault name of a --healthy run: nothing is injected


@dataclass(frozen=True)
class FleetShape:
    name: str
    n_p: int
    n_d: int

    @property
    def label(self) -> str:
        return f"{self.n_p}P+{self.n_d}D"

    def prefills(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.n_p)]

    def decodes(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.n_d)]

    @property
    def bad_p(self) -> str:
        """The P a P fault hits: the last one."""
        return f"prefill-{self.n_p - 1}"

    @property
    def bad_d(self) -> str:
        """The D a D fault hits: the last one."""
        return f"decode-{self.n_d - 1}"


FLEETS = {
    "2p4d": FleetShape("2p4d", 2, 4),
    "3p6d": FleetShape("3p6d", 3, 6),
    "4p2d": FleetShape("4p2d", 4, 2),  # P:D 2:1
    "3p3d": FleetShape("3p3d", 3, 3),  # P:D 1:1
}


@dataclass(frozen=True)
class Mix:
    """A workload's prompt and output lengths (``simulator.workload.LengthDist`` text) and
    ``rate_scale``: the capacity steps' rates (given for the chat mix) times this, about the chat
    mix's mean prompt over this mix's (prefill work per request sets P's capacity)."""

    name: str
    prompt: str
    output: str
    rate_scale: float = 1.0


CHAT = "chat"
MIXES = {
    CHAT: Mix(CHAT, "fixed:2048", "fixed:32"),
    # long prompts of spread lengths, short answers: P is the bottleneck, and a request's cost is
    # its tokens, not one request's worth
    "prefill_heavy": Mix("prefill_heavy", "uniform:4096,8192", "fixed:8", rate_scale=2048 / 6144),
}


@dataclass(frozen=True)
class FaultPlan:
    """``injections``: simulator fault specs POSTed at onset (``duration`` where the fault ends);
    ``faulty``: the instances the fault is about; ``limit_pools``: pools whose limit cuts answer it;
    ``burst``: (total offered load as a multiple of capacity, seconds) added at onset, or None."""

    name: str
    injections: tuple[dict[str, Any], ...] = ()
    faulty: frozenset[str] = frozenset()
    limit_pools: frozenset[str] = frozenset()
    burst: tuple[float, float] | None = None
    ends_after_s: float | None = None  # the fault is cleared this long after onset (decode_down)
    mix: str = CHAT  # the workload of the cell (MIXES)
    about: str = ""
    notes: dict[str, Any] = field(default_factory=dict)


BURST_MULTIPLE = 1.5  # total offered load during the burst, times the measured capacity
BURST_SHARE = 0.5  # of the measured phase
DOWN_SHARE = 0.4  # of the measured phase the D is down before it comes back
BAD_PAIR_FACTOR = 10.0
SLOW_LINK_FACTOR = 10.0
SLOW_PREFILL_FACTOR = 3.0
TRANSFER_FAILURE_RATE = 0.3
KV_FRACTION = 0.1
P_KV_FRACTION = 0.012  # a P's KV: about one prompt and a half (at 3 % it held enough: no loss)
SURGE_MULTIPLE = 2.0  # total offered load during the surge, times the measured capacity
SURGE_SHARE = 0.6  # of the measured phase
DEGRADE_STEPS = (1.5, 2.0, 3.0)  # the P's slowdown, stepped up at equal thirds of the measured phase
HEAVY_MULTIPLE = 1.3  # prefill_heavy: total offered load over the whole measured phase, times capacity


def fault_plan(fault: str, fleet: FleetShape, measure_s: float) -> FaultPlan:
    if fault == HEALTHY:
        return FaultPlan(HEALTHY, about="no fault")
    d = fleet.bad_d
    if fault == "decode_down":
        down_s = round(max(2.0, DOWN_SHARE * measure_s), 1)
        plan = _hit(
            fault,
            {"kind": "down", "instance": d, "duration": down_s},
            f"{d} down for {down_s:g} s, then back",
        )
        return replace(plan, ends_after_s=down_s)
    found = _one_injection(fault, fleet) or _overload_plan(fault, fleet, measure_s)
    if found is None:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    return found


def _hit(fault: str, injection: dict[str, Any], about: str, *limit_pools: str) -> FaultPlan:
    """A fault of one injection: the instances it names are the faulty ones, and limit cuts of
    ``limit_pools`` answer it."""
    faulty = frozenset(injection[k] for k in ("prefill", "decode", "instance") if k in injection)
    return FaultPlan(fault, (injection,), faulty, limit_pools=frozenset(limit_pools), about=about)


Row = tuple[dict[str, Any], str, tuple[str, ...]]  # (injection, about, the pools whose limit cuts answer it)


def _one_injection(fault: str, fleet: FleetShape) -> FaultPlan | None:
    """The faults that are one injection from onset on, hitting the last P or D (``bad_pair``: the
    link between the first P and the last D)."""
    rows = {**_d_side(fleet), **_p_side(fleet)}
    if fault not in rows:
        return None
    injection, about, limit_pools = rows[fault]
    return _hit(fault, injection, about, *limit_pools)


def _d_side(fleet: FleetShape) -> dict[str, Row]:
    d = fleet.bad_d
    return {
        "degraded_decode_link": (
            {"kind": "slow_nic", "decode": d, "factor": SLOW_LINK_FACTOR},
            f"{d}'s NIC {SLOW_LINK_FACTOR:g}x slower (its leases expire)",
            (),
        ),
        "transfer_failures": (
            {"kind": "transfer_failure", "decode": d, "rate": TRANSFER_FAILURE_RATE},
            f"{TRANSFER_FAILURE_RATE:.0%} of {d}'s KV transfers fail",
            (),
        ),
        "stuck_decode": (
            {"kind": "stop_pulling", "decode": d},
            f"{d} stops pulling (P's leases for its requests expire)",
            (),
        ),
        "kv_capacity": (
            {"kind": "kv_capacity", "instance": d, "fraction": KV_FRACTION},
            f"{d}'s KV capacity cut to {KV_FRACTION:.0%}",
            (),
        ),
        "d_lost": (
            {"kind": "down", "instance": d},
            f"{d} down for good: the D pool keeps {fleet.n_d - 1} of {fleet.n_d}",
            ("decode",),
        ),
    }


def _p_side(fleet: FleetShape) -> dict[str, Row]:
    """The P's faults, and the pair's (the first P x the last D)."""
    d, p, p0 = fleet.bad_d, fleet.bad_p, fleet.prefills()[0]
    return {
        "slow_prefill": (
            {"kind": "slow", "instance": p, "factor": SLOW_PREFILL_FACTOR},
            f"{p} {SLOW_PREFILL_FACTOR:g}x slower",
            ("prefill",),
        ),
        "bad_pair": (
            {"kind": "slow_link", "prefill": p0, "decode": d, "factor": BAD_PAIR_FACTOR},
            f"the {p0} x {d} link {BAD_PAIR_FACTOR:g}x slower",
            (),
        ),
        "p_nic": (  # a P-side fault: its handoffs are slow toward every D (issue 29)
            {"kind": "slow_nic", "prefill": p, "factor": SLOW_LINK_FACTOR},
            f"{p}'s NIC {SLOW_LINK_FACTOR:g}x slower toward every D",
            ("prefill",),
        ),
        "p_failing": (  # a P-side fault: its transfers fail toward every D, and each D counts them
            {"kind": "transfer_failure", "prefill": p, "rate": TRANSFER_FAILURE_RATE},
            f"{TRANSFER_FAILURE_RATE:.0%} of {p}'s KV transfers fail, toward every D",
            ("prefill",),
        ),
        "p_kv": (  # a P-side fault: its KV nearly full, so prefill waits on the leases D has yet to pull
            {"kind": "kv_capacity", "instance": p, "fraction": P_KV_FRACTION},
            f"{p}'s KV capacity cut to {P_KV_FRACTION:.0%}: its blocks are held by prefills and by "
            "leases until D pulls them, and new prefills wait for them",
            ("prefill",),
        ),
        "p_down": (
            {"kind": "down", "instance": p},
            f"{p} down for good: the P pool keeps {fleet.n_p - 1} of {fleet.n_p}",
            ("prefill",),
        ),
    }


def degrade_steps(measure_s: float) -> list[tuple[float, float]]:
    """(seconds after onset, the P's total slowdown from then): ``DEGRADE_STEPS`` at 0, 1/3, 2/3."""
    return [(round(i * measure_s / len(DEGRADE_STEPS), 1), f) for i, f in enumerate(DEGRADE_STEPS)]


def _degrade(fleet: FleetShape, measure_s: float) -> FaultPlan:
    # the simulator multiplies the factors of a P's active `slow` faults: each step adds the ratio
    p, before, injections = fleet.bad_p, 1.0, []
    for at, total in degrade_steps(measure_s):
        injections.append({"kind": "slow", "instance": p, "factor": round(total / before, 6), "at": at})
        before = total
    return FaultPlan(
        "degrade",
        tuple(injections),
        frozenset({p}),
        limit_pools=frozenset({"prefill"}),
        about=f"{p} slows in steps: "
        + ", ".join(f"{f:g}x at +{at:g} s" for at, f in degrade_steps(measure_s)),
    )


def _overload_plan(fault: str, fleet: FleetShape, measure_s: float) -> FaultPlan | None:
    """The overload faults (but ``p_down`` and ``d_lost``, ``_one_injection``'s): more offered than the
    fleet, or what is left of it, serves in time."""
    if fault == "burst":
        return _extra_load(fault, BURST_MULTIPLE, BURST_SHARE, measure_s)
    if fault == "surge":
        return _extra_load(fault, SURGE_MULTIPLE, SURGE_SHARE, measure_s)
    if fault == "degrade":
        return _degrade(fleet, measure_s)
    if fault == "prefill_heavy":
        return FaultPlan(
            fault,
            limit_pools=frozenset({"prefill"}),
            burst=(HEAVY_MULTIPLE, round(measure_s, 1)),
            mix="prefill_heavy",
            about=f"prompts {MIXES['prefill_heavy'].prompt}, outputs {MIXES['prefill_heavy'].output}; "
            f"{HEAVY_MULTIPLE:g}x that mix's capacity over the measured phase",
        )
    return None


def _extra_load(fault: str, multiple: float, share: float, measure_s: float) -> FaultPlan:
    """``multiple`` x the measured capacity offered in all from onset, for ``share`` of the measured
    phase (2 s at least); cuts of either pool's limit answer it."""
    for_s = round(max(2.0, share * measure_s), 1)
    return FaultPlan(
        fault,
        limit_pools=frozenset({"prefill", "decode"}),
        burst=(multiple, for_s),
        about=f"{multiple:g}x capacity for {for_s:g} s",
    )


@dataclass(frozen=True, order=True)
class Cell:
    fleet: str
    load: int
    fault: str

    @property
    def name(self) -> str:
        return f"{self.fleet}:{self.load}:{self.fault}"


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _pick(patterns: list[str], universe: tuple[str, ...], what: str) -> list[str]:
    """Names in ``universe`` matching any pattern (exact name or glob), in universe order."""
    if not patterns:
        return list(universe)
    out = []
    for pat in patterns:
        hits = [u for u in universe if fnmatch.fnmatchcase(u, pat)]
        if not hits:
            raise ValueError(f"--{what}: {pat!r} matches none of {', '.join(universe)}")
        out += [h for h in hits if h not in out]
    return [u for u in universe if u in out]


def select_cells(
    cells: str | None = None, fleets: str | None = None, loads: str | None = None, faults: str | None = None
) -> list[Cell]:
    """The cells to run. ``cells``: comma-separated ``FLEET:LOAD:FAULT`` patterns (globs per part,
    e.g. ``2p4d:*:burst``, ``*:90:*``); ``fleets``/``loads``/``faults`` narrow further (names or globs;
    ``faults`` also takes the old letters a, b, c)."""
    fleet_names = _pick(_split(fleets), tuple(FLEETS), "fleets")
    load_names = _pick(_split(loads), tuple(str(x) for x in LOADS), "loads")
    fault_names = _pick([LETTERS.get(f, f) for f in _split(faults)], FAULTS, "faults")
    every = [Cell(f, int(ld), x) for f in fleet_names for ld in load_names for x in fault_names]
    pats = _split(cells)
    if not pats:
        return every
    chosen: list[Cell] = []
    for pat in pats:
        parts = pat.split(":")
        if len(parts) != 3:
            raise ValueError(f"--cells: {pat!r} is not FLEET:LOAD:FAULT (globs allowed, e.g. 2p4d:*:burst)")
        parts[2] = LETTERS.get(parts[2], parts[2])
        hits = [
            c
            for c in every
            if all(
                fnmatch.fnmatchcase(v, q) for v, q in zip((c.fleet, str(c.load), c.fault), parts, strict=True)
            )
        ]
        if not hits:
            raise ValueError(f"--cells: {pat!r} matches no cell of the chosen fleets, loads and faults")
        chosen += [h for h in hits if h not in chosen]
    return sorted(chosen, key=every.index)


def select_contenders(text: str | None) -> list[str]:
    return _pick(_split(text), CONTENDERS, "contenders")
