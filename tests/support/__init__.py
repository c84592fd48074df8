"""Test support: the habits every test shares, each in one home.

- :mod:`tests.support.waiting`: wait on a condition with a deadline and a clear failure message
  (never a fixed sleep as synchronisation).
- :mod:`tests.support.sockets`: free 127.0.0.1 ports, a bound socket to serve on, a URL nothing
  listens on.
- :mod:`tests.support.serving`: serve an ASGI app on 127.0.0.1, in the test's event loop or in a
  thread of its own.
- :mod:`tests.support.controllers`: a fake controller API that serves a routing table and records
  every request.
- :mod:`tests.support.collector`: the collector service on an event loop of its own, in a thread.

Test code only: nothing in the product imports this package.
"""
