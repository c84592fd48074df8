"""Alert notifications to a webhook, in Alertmanager's webhook format (version 4).

:class:`WebhookNotifier.send` never blocks and never raises: it appends to a bounded
queue (the oldest batch is dropped, and counted, when full) and a background thread
POSTs each batch with a timeout. A failed POST is counted and logged, not retried
forever: a firing alert is re-sent by the policy every ``resend_s`` anyway.

The payload is what Alertmanager sends to a ``webhook_config`` receiver::

    {"version": "4", "status": "firing"|"resolved", "receiver": "pdscope", "groupKey": ...,
     "groupLabels": {}, "commonLabels": {...}, "commonAnnotations": {...}, "externalURL": ...,
     "truncatedAlerts": 0,
     "alerts": [{"status", "labels": {"alertname", "severity", ...}, "annotations",
                 "startsAt", "endsAt", "generatorURL", "fingerprint"}]}

An alert with an incident bundle (``controller.bundle``) carries where it is in its annotations:
``bundle`` (the path on the controller's host), ``bundle_name`` and, when the controller serves it,
``bundle_url`` (``GET /v1/bundles/<name>``); ``bundle_error`` when it could not be written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import httpx

from controller.policy import AlertState

log = logging.getLogger(__name__)

T = TypeVar("T")

ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's "no end yet"

Annotate = Callable[[AlertState], Mapping[str, str]]  # more annotations for an alert (its bundle)


class Notifier(Protocol):
    sent: int
    failed: int
    dropped: int

    def send(self, alerts: Sequence[AlertState]) -> None: ...

    def close(self, timeout: float = 2.0) -> None: ...


def _rfc3339(ts: float | None) -> str:
    if ts is None:
        return ZERO_TIME
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def alert_json(st: AlertState, external_url: str, annotate: Annotate | None = None) -> dict[str, Any]:
    status = "resolved" if st.state == "resolved" else "firing"
    extra = dict(annotate(st)) if annotate is not None else {}
    return {
        "status": status,
        "labels": {"alertname": st.rule, "severity": st.severity, "source": "controller", **st.labels},
        "annotations": {
            **extra,
            "summary": st.summary,
            "description": st.description,
            "value": f"{st.value:g}",
        },
        "startsAt": _rfc3339(st.fired_at or st.active_since),
        "endsAt": _rfc3339(st.resolved_at) if status == "resolved" else ZERO_TIME,
        "generatorURL": f"{external_url}/v1/alerts",
        "fingerprint": st.fingerprint,
    }


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    if not dicts:
        return {}
    first = dicts[0]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in dicts[1:])}


def webhook_payload(
    alerts: Sequence[AlertState],
    external_url: str,
    receiver: str = "pdscope",
    annotate: Annotate | None = None,
) -> dict[str, Any]:
    items = [alert_json(a, external_url, annotate) for a in alerts]
    status = "firing" if any(i["status"] == "firing" for i in items) else "resolved"
    return {
        "version": "4",
        "groupKey": "{}:{}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": {},
        "commonLabels": _common([i["labels"] for i in items]),
        "commonAnnotations": _common([i["annotations"] for i in items]),
        "externalURL": external_url,
        "alerts": items,
    }


def take_next(cond: threading.Condition, queue: deque[T], closed: Callable[[], bool]) -> T | None:
    """For a queue's worker thread, called holding ``cond``: wait for the next item and take it
    (oldest first); None once ``closed()`` and the queue is drained (the worker then ends)."""
    while not queue and not closed():
        cond.wait()
    return queue.popleft() if queue else None


class WebhookNotifier:
    """POSTs batches of alerts from a background thread; bounded, drops the oldest."""

    def __init__(
        self,
        url: str,
        external_url: str,
        *,
        max_batches: int = 256,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        annotate: Annotate | None = None,
    ) -> None:
        """``annotate``: more annotations per alert, asked when its batch is POSTed (never raises)."""
        self.url = url
        self.external_url = external_url
        self.annotate = annotate
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._queue: deque[list[AlertState]] = deque()
        self._max = max_batches
        self._cond = threading.Condition()
        self._closed = False
        self._client = httpx.Client(timeout=timeout_s, transport=transport)
        self._thread = threading.Thread(target=self._run, name="pdscope-webhook", daemon=True)
        self._thread.start()

    def send(self, alerts: Sequence[AlertState]) -> None:
        if not alerts:
            return
        with self._cond:
            if self._closed:
                self.dropped += 1
                return
            if len(self._queue) >= self._max:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(list(alerts))
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = take_next(self._cond, self._queue, lambda: self._closed)
            if batch is None:
                return
            self._post(batch)

    def _post(self, batch: list[AlertState]) -> None:
        try:
            payload = webhook_payload(batch, self.external_url, annotate=self.annotate)
            resp = self._client.post(self.url, json=payload)
            resp.raise_for_status()
            self.sent += 1
        except httpx.HTTPError as exc:
            self.failed += 1
            log.warning("alert webhook %s failed: %s", self.url, exc)

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (up to ``timeout``) and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        self._client.close()


class NullNotifier:
    """No webhook configured: notifications are only stored and exported."""

    def __init__(self) -> None:
        self.sent = self.failed = self.dropped = 0

    def send(self, alerts: Sequence[AlertState]) -> None:
        return None

    def close(self, timeout: float = 2.0) -> None:
        return None
