"""The fleet benchmark (issue 16): ``python -m bench.fleet`` or ``python -m bench.fleet.run``."""
