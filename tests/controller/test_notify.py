"""The alert webhook: Alertmanager's payload, non-blocking, bounded, counted."""

from __future__ import annotations

import json
import threading

import httpx

from controller.notify import ZERO_TIME, WebhookNotifier, webhook_payload
from controller.policy.alerts import AlertState


def alert(state: str = "firing", **kw: object) -> AlertState:
    base: dict[str, object] = dict(
        rule="KVLeaseExpired",
        fingerprint="abc123",
        labels={"instance": "prefill-0"},
        severity="warning",
        state=state,
        value=2.0,
        description="2 expired",
        summary="KV leases expired",
        active_since=1_800_000_000.0,
        last_eval=1_800_000_010.0,
        fired_at=1_800_000_000.0,
        resolved_at=1_800_000_060.0 if state == "resolved" else None,
    )
    base.update(kw)
    return AlertState(**base)  # type: ignore[arg-type]


def test_payload_is_alertmanager_webhook_v4() -> None:
    p = webhook_payload([alert(), alert("resolved", fingerprint="def")], "http://ctl:8300")
    assert p["version"] == "4" and p["status"] == "firing" and p["receiver"] == "pdscope"
    a, r = p["alerts"]
    assert a["labels"] == {
        "alertname": "KVLeaseExpired",
        "severity": "warning",
        "source": "controller",
        "instance": "prefill-0",
    }
    assert a["startsAt"] == "2027-01-15T08:00:00Z" and a["endsAt"] == ZERO_TIME
    assert (
        a["annotations"]["summary"] == "KV leases expired"
        and a["generatorURL"] == "http://ctl:8300/v1/alerts"
    )
    assert r["status"] == "resolved" and r["endsAt"] == "2027-01-15T08:01:00Z"
    assert p["commonLabels"] == {
        "alertname": "KVLeaseExpired",
        "severity": "warning",
        "source": "controller",
        "instance": "prefill-0",
    }
    assert webhook_payload([alert("resolved")], "x")["status"] == "resolved"


def test_send_posts_in_the_background_and_counts() -> None:
    got: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(json.loads(request.content))
        return httpx.Response(200 if len(got) == 1 else 500)

    n = WebhookNotifier("http://hook/alerts", "http://ctl", transport=httpx.MockTransport(handler))
    n.send([alert()])
    n.send([alert("resolved")])
    n.send([])  # nothing to say: nothing sent
    n.close()
    assert [g["status"] for g in got] == ["firing", "resolved"]
    assert (n.sent, n.failed, n.dropped) == (1, 1, 0)


def test_a_slow_webhook_never_blocks_send_and_the_queue_is_bounded() -> None:
    release = threading.Event()
    answered = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal answered
        release.wait(30)  # the webhook hangs until the test releases it (30 s: a guard, not a bound)
        answered += 1
        return httpx.Response(200)

    n = WebhookNotifier("http://hook", "http://ctl", max_batches=3, transport=httpx.MockTransport(handler))
    for i in range(10):
        n.send([alert(fingerprint=str(i))])
    # had send() waited for the webhook, the first call would have been answered before it returned
    assert answered == 0, "send() must not wait for the webhook"
    release.set()
    n.close(timeout=5)
    assert n.dropped >= 6 and n.sent + n.dropped == 10
