"""The prefix-aware routing benchmark (``python -m bench.prefix``; see ``run.py``)."""
