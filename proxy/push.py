"""Push mode (vLLM's ``NixlPushConnector``): D's leg goes out with P's.

In push mode D does not read P's blocks: it allocates its own, registers them with P over
NIXL (a notification naming P's engine) and waits; P, once its prefill is done, writes the
KV into them. P matches the registration to its request by the request id without vLLM's
random suffix, so both legs carry the same ``X-Request-Id`` (the proxy's). What D needs to
register is P's side channel -- ``remote_engine_id``, ``remote_host``, ``remote_port``,
``tp_size`` -- not P's blocks, so the proxy can send D's leg before P has answered, once it
knows that P's side channel: from P's last push-mode answer (:class:`SideChannels`). The first
request through a P (or the first after its engine changed) goes P first, then D. Sending D's leg
early is ``proxy.push_early`` (off by default: it saves only the proxy's round trip and D's
admission, which the simulator cannot tell from noise, and on real vLLM 0.32.0 on CPU, with NIXL
1.5.1, push itself was not dependable: see docs/proxy.md). D gets the keys vLLM's own push proxy
sends (:meth:`PushPeer.decode_params`), not P's whole answer, with which D failed in 3 of 3 tries
there (the subset worked in the same runs).

The early leg is kept only while P's answer names the engine D registered with: an answer
from another engine (P restarted with a new engine id, or the prefill was retried on
another P) makes the early leg void (it is cancelled and not counted against D) and D is
sent again with P's answer. The early leg's ``remote_request_id`` is the proxy's request id
(P's internal id is not known yet; vLLM's D requires the key, its engine dies without it), so
D's lease heartbeats for it extend nothing; P writes as soon as it finishes, well within its
lease.

Every P answer of a pool says its mode (``transfer_mode``); an answer in the other mode than
the fleet's ``handoff`` is refused as a bad answer (a pull P never writes into a push D's
blocks, which would wait out vLLM's registration timeout, 480 s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proxy.protocol import PrefillAnswer, ProtocolError

PUSH = "push"
PULL = "pull"
_MAX_FIELD = 256  # an engine id or host longer than this is not a side channel


@dataclass(frozen=True, slots=True)
class PushPeer:
    """A P's NIXL side channel, as its last push-mode answer gave it."""

    engine_id: str
    host: str
    port: int
    tp_size: int

    def decode_params(self, remote_request_id: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` D gets in push mode: what vLLM's push-mode D reads, as vLLM's own
        push proxy sends it (on vLLM 0.32.0 CPU, D given P's whole answer failed in 3 of 3 tries)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
        }


def _text(params: dict[str, Any], key: str) -> str | None:
    value = params.get(key)
    return value if isinstance(value, str) and 0 < len(value) <= _MAX_FIELD else None


def _count(params: dict[str, Any], key: str) -> int | None:
    value = params.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 16
    return value if ok else None


def peer_of(params: dict[str, Any] | None) -> PushPeer | None:
    """P's side channel from its push-mode ``kv_transfer_params``; None when a field is missing or
    malformed (then no early leg goes to it)."""
    if not params:
        return None
    engine, host = _text(params, "remote_engine_id"), _text(params, "remote_host")
    port, tp = _count(params, "remote_port"), _count(params, "tp_size")
    if engine is None or host is None or port is None or tp is None:
        return None
    return PushPeer(engine, host, port, tp)


def decode_answer(answer: PrefillAnswer) -> PrefillAnswer:
    """P's push-mode answer with the params D gets (:meth:`PushPeer.decode_params`); as it came when they
    are malformed (D then refuses them, as it would P's)."""
    params = answer.kv_transfer_params
    peer = peer_of(params)
    rid = _text(params, "remote_request_id") if params else None
    if peer is None or rid is None:
        return answer
    return replace(answer, kv_transfer_params=peer.decode_params(rid))


def check_mode(params: dict[str, Any] | None, mode: str) -> None:
    """P's answer must be in the fleet's handoff mode (vLLM 0.32+ says which in ``transfer_mode``; an
    answer without it is a pull P's). Raises ProtocolError otherwise."""
    if not params:
        return  # nothing to hand off (P said so): D computes, whatever the mode
    said = params.get("transfer_mode", PULL)
    if said != mode:
        raise ProtocolError(f"P answered in {said!r} mode; the fleet's handoff is {mode!r}")


class SideChannels:
    """Each P's side channel, learned from its answers in either mode (one entry per P of the fleet): the
    early leg's address in push mode, and in both modes a restart signal of P's own, its engine id
    changing (``pdscope_proxy_engine_changes_total``; vLLM draws a new one at each start unless
    ``kv_transfer_config.engine_id`` fixes it)."""

    def __init__(self, limit: int = 100_000) -> None:
        self._peers: dict[str, PushPeer] = {}
        self._limit = limit

    def get(self, p: str) -> PushPeer | None:
        return self._peers.get(p)

    def learn(self, p: str, params: dict[str, Any] | None) -> bool:
        """Keep ``p``'s side channel from its answer; True when it names another engine than before
        (P restarted, or another process took its address)."""
        old = self._peers.get(p)
        if old is not None and params and params.get("remote_engine_id") == old.engine_id:
            return False  # the common case: the same engine (one process: one side channel)
        peer = peer_of(params)
        if peer is None:
            self._peers.pop(p, None)  # no early leg until a well-formed answer again
            return False
        if old is None and len(self._peers) >= self._limit:
            return False
        self._peers[p] = peer
        return old is not None and old.engine_id != peer.engine_id
