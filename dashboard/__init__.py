"""pdscope's Streamlit dashboard for SREs.

``app.py`` is the entrypoint (``st.navigation`` over ``views/``); ``queries/`` reads the
store (never writes), ``data.py`` caches those reads, ``summaries.py`` and ``derive.py``
do the arithmetic, ``charts.py`` draws, ``api.py`` is the only way to change anything
(the controller's HTTP API). ``seed.py`` writes a demo history for tests and benchmarks
and is never imported by the app. Nothing here imports the proxy, collector, controller
or simulator.
"""
