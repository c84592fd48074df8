"""Which processes are still running: the check that a command left nothing behind."""

from __future__ import annotations

import os
from pathlib import Path


def processes_mentioning(needle: str) -> list[int]:
    """PIDs (not this one) whose command line contains ``needle``, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            pids.append(int(entry.name))
    return pids
