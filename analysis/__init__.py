"""pdscope's after-the-fact analyses: what the stored history says, as pure functions.

SLO-miss attribution (:mod:`analysis.attribution`, fed row by row by
:mod:`analysis.attribution_records`), decision regret (:mod:`analysis.regret`) and the fleet's rates,
the prior of the proxy's TTFT predictor (:mod:`analysis.rates`). Values in,
findings out: no I/O, no clock (every time is passed in). The rows come from the store's reads
(``store.attribution``, ``store.regret``); the controller serves the findings and the dashboard
shows them, both from the same read.

A floor of its own: below the services (the controller and the dashboard import it), above the
store and the kernel; it imports no service and no I/O library (the contracts in ``pyproject.toml``).
"""
