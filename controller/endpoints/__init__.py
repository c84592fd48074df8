"""The control API's routers, one module per concern; :func:`controller.api.create_app` assembles them.

* :mod:`.routing`: the routing table proxies poll, pools and instance weights (reads).
* :mod:`.overrides`: operator overrides: instance weight, drain/undrain, pool weight (mutations).
* :mod:`.history`: the policy's stored decisions.
* :mod:`.regret`: what followed the policy's cuts over a range (recovered, undone, flapping).
* :mod:`.alerts`: alerts, the alert rules as configured, SLO status.
* :mod:`.attribution`: why the SLO was missed over a range (stages, instances, pairs, causes).
* :mod:`.tenants`: each tenant's SLO figures over a range (served, rejected, attainment, shares).
* :mod:`.replay`: the policy re-run over a stored window, as it was or with changed settings.
* :mod:`.ops`: health, the caller's identity, Prometheus metrics.

Routers read through :class:`.context.ApiContext` and render with :class:`.views.Views`;
they do no policy.
"""
