"""pdscope's controller: observe the store -> pure policy -> persist -> serve.

Modules: ``observe`` (the store window -> an Observation), ``policy/`` (pure: weights,
admission limits, overrides, alert states), ``persist`` (decisions, alerts, reload),
``loop`` (the level-triggered reconciler), ``notify`` (Alertmanager-format webhook),
``metrics`` (Prometheus), ``api`` + ``schemas`` (FastAPI), ``cli`` (``pdscope control``).
It never imports the proxy or the collector; it meets them in ``store/`` and over HTTP.
"""
