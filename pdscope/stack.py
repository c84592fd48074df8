"""The local-stack launcher: pdscope's services as child processes on 127.0.0.1.

Every local stack starts here: the demo, the what-if's replays, the benches' stacks and the test
fleet. A :class:`Child` is one command (usually ``pdscope --config FILE <command>``, built by
:func:`pdscope_argv`) with its log file, its environment and an HTTP readiness probe with a
deadline; :class:`ChildGroup` holds the children started together and stops them in the reverse
order. :func:`free_ports` picks loopback ports for a stack, :func:`write_config` writes its config.

Every child runs in a session (process group) of its own: a signal sent to it, by its PID, reaches
it and whatever it started, and a Ctrl-C at the terminal reaches only the parent, which stops its
children itself. Stopping is SIGCONT (a paused child can then take the next signal), SIGTERM, then
SIGKILL after a grace. Nothing here is found by name: a process is signalled only through the PID
this module started.

Kernel floor: it runs processes and HTTP probes (httpx) and imports no service and no store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

LOOPBACK = "127.0.0.1"
PROBE_TIMEOUT_S = 2.0
KILL_WAIT_S = 10.0  # after SIGKILL: only a process stuck in the kernel outlives it

Ready = Callable[[httpx.Response], bool]


def answered(response: httpx.Response) -> bool:
    """Ready once it answers without a server error (the default probe)."""
    return response.status_code < 500


def succeeded(response: httpx.Response) -> bool:
    """Ready once it answers 2xx."""
    return response.is_success


# -- ports, URLs, config files -------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (free now, not reserved): every
    socket is held until all are picked, so the ports differ."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One loopback port that was free a moment ago (also: a port nothing listens on)."""
    return free_ports(1)[0]


def loopback_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config`` as the YAML file ``path`` (keys in their order); returns ``path``."""
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path


def pdscope_argv(config: Path, command: str, *args: str, log_level: str | None = None) -> list[str]:
    """``pdscope --config FILE [--log-level L] COMMAND ARGS...`` run by this interpreter."""
    level = [] if log_level is None else ["--log-level", log_level]
    return [sys.executable, "-m", "pdscope.cli", "--config", str(config), *level, command, *args]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: unbuffered Python output (the log is read while it
    runs), plus ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


def probe(url: str, ready: Ready = answered, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """One GET of ``url``: whether ``ready`` holds for its answer. Never raises; no answer is False.
    Loopback only: the environment's HTTP proxy is not used."""
    try:
        return ready(httpx.get(url, timeout=timeout_s, trust_env=False))
    except (httpx.HTTPError, OSError, ValueError):
        return False


# -- one child -----------------------------------------------------------------------------------


class StartError(RuntimeError):
    """A child exited during start-up or did not become ready before its deadline; the message
    names it and ends with the last lines of its log."""


class Child:
    """One child process: ``argv`` with stdout and stderr to ``log_path``, stdin closed.

    ``env`` None: :func:`child_env`. The first start truncates the log; a restart appends to it.
    ``ready_url``: where :meth:`wait_ready` probes (None: ready once started)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        ready_url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.ready_url = ready_url
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (does not wait). Raises OSError when the command cannot be run."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if self.proc is not None else "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env if self.env is not None else child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a signal to it reaches only it
            )

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        """Its exit status; None while it runs or before it starts."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to its process group, by its PID; nothing when it is not running."""
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> bool:
        """SIGCONT and SIGTERM, then SIGKILL after ``grace_s``; waits for it. Returns False only
        when it still runs after SIGKILL (stuck in the kernel). Idempotent."""
        if self.proc is None or not self.alive():
            return True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
            return True
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            return False
        return True

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of its log ("" when there is none)."""
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(
        self,
        timeout_s: float,
        *,
        ready: Ready = answered,
        every_s: float = 0.2,
        abort: Callable[[], bool] | None = None,
    ) -> bool:
        """Block until ``ready`` holds for ``ready_url``'s answer; True then. False as soon as
        ``abort()`` is true (a Ctrl-C during start-up: the caller stops it). Raises
        :class:`StartError` when it exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while abort is None or not abort():
            if not self.alive():
                raise StartError(f"{self.name} exited ({self.returncode()}) during start-up:\n{self.tail()}")
            if self.ready_url is None or probe(self.ready_url, ready):
                return True
            if time.monotonic() >= deadline:
                raise StartError(
                    f"{self.name} not ready at {self.ready_url} after {timeout_s:g}s:\n{self.tail()}"
                )
            time.sleep(every_s)  # polling a service that is starting, bounded by the deadline
        return False


# -- a group ---------------------------------------------------------------------------------------


class ChildGroup:
    """Children started in order and stopped in the reverse order, each after the one started
    after it has gone (``with ChildGroup() as g:`` stops them on leaving the block)."""

    def __init__(self, children: Sequence[Child] = (), grace_s: float = 10.0) -> None:
        self.children: list[Child] = list(children)
        self.grace_s = grace_s

    def __iter__(self) -> Iterator[Child]:
        return iter(list(self.children))

    def __getitem__(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(name)

    def start(
        self,
        child: Child,
        timeout_s: float = 60.0,
        *,
        ready: Ready = answered,
        abort: Callable[[], bool] | None = None,
    ) -> bool:
        """Start ``child``, hold it, and wait until it is ready (:meth:`Child.wait_ready`)."""
        child.start()
        self.children.append(child)
        return child.wait_ready(timeout_s, ready=ready, abort=abort)

    def stop(self) -> list[Child]:
        """Stop every child, last started first; the ones that outlived SIGKILL."""
        return [child for child in reversed(self.children) if not child.stop(self.grace_s)]

    @contextlib.contextmanager
    def starting(self) -> Iterator[ChildGroup]:
        """``with group.starting():`` around a stack's start: a start that raises stops every
        child started so far, then the error goes on (nothing is left running half-started)."""
        try:
            yield self
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> ChildGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
