"""How a service's command runs its async main: until SIGINT or SIGTERM, and a failed socket is one line.

:func:`stop_on_signals` makes SIGINT and SIGTERM set the event a service waits on (where the loop
can take signal handlers); :func:`run_main` runs the main to its end and returns the command's exit
code: 0, or 1 with ``<prog>: <error>`` on stderr when it raised ``OSError`` (a port in use, an
address not to be had).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` from now on (nothing where the loop cannot take handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


def run_main(
    main: Callable[[], Coroutine[Any, Any, None]],
    prog: str,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """Run ``main()`` on a new loop (``loop_factory``'s, else asyncio's); see the module docstring."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(main())
        except OSError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
    return 0
