"""The tenants benchmark (issue 31; ``python -m bench.tenants``; see ``run.py``)."""
