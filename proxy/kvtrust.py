"""Whether an instance's KV events are borne out: predicted prefix hits checked against vLLM's own count.

The precise view (``proxy.precise``) credits an instance with the prompt tokens its KV events
say it holds. Events can be wrong: forged by whoever can answer the instance's publisher address,
or from a vLLM that lost its cache without saying so. vLLM reports what it really reused for each
request (``usage.prompt_tokens_details.cached_tokens``), so each credited prediction is checked:
a **miss** is a prediction of at least one block of which less than half came true, by more than
one block (vLLM recomputes a prompt's last token, so a full hit reports up to a block less).

``misses_to_distrust`` misses in a row (a hit resets the run) distrust the instance for a
backoff (``base_s``, doubled at each distrust in a row, at most ``max_s``): its events are
credited nothing meanwhile (routing to it goes by load alone). When the backoff ends it is on
probation: credited again, and its next checked prediction decides, a hit trusting it fully
(the doubling reset), a miss distrusting it again at once. With ``distrust=False`` (the approximate
view, ``proxy.approx``, which acts on a miss itself) it only counts: verdicts hit or miss, never
distrusted. Every checked prediction's tokens are summed per instance (``tokens``: predicted, and
reported as far as the prediction went), the health figure of either view. Pure: values in,
verdicts out, the time passed in; one thread (the caller holds the view's lock).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["unchecked", "hit", "miss", "distrusted", "trusted"]

MISSES_TO_DISTRUST = 3
BASE_S = 30.0
MAX_S = 600.0


@dataclass
class _State:
    misses: int = 0  # in a row
    strikes: int = 0  # distrusts in a row (not ended by a hit)
    until: float | None = None  # distrusted until then
    probation: bool = False


class HitCheck:
    """Per instance: predicted cached tokens against reported ones; who is distrusted now."""

    def __init__(
        self,
        block_size: int,
        *,
        misses_to_distrust: int = MISSES_TO_DISTRUST,
        base_s: float = BASE_S,
        max_s: float = MAX_S,
        distrust: bool = True,
    ) -> None:
        self.block_size = block_size
        self.distrust = distrust
        self.misses_to_distrust, self.base_s, self.max_s = misses_to_distrust, base_s, max_s
        self._state: dict[str, _State] = {}
        self.counts: Counter[tuple[str, str]] = Counter()  # (instance, hit|miss|distrusted|trusted)
        self.tokens: Counter[tuple[str, str]] = Counter()  # (instance, predicted|reported), checked ones

    def is_miss(self, predicted: int, reported: int) -> bool:
        return reported * 2 < predicted and predicted - reported > self.block_size

    def observe(self, instance: str, predicted: int, reported: int | None, now: float) -> Verdict:
        """One request's check: ``predicted`` cached tokens (as credited when routed) against the
        ``reported`` ones (None: vLLM did not say). Never raises."""
        if reported is None or predicted < self.block_size or reported < 0:
            return "unchecked"
        st = self._state.setdefault(instance, _State())
        if st.until is not None:  # routed while distrusted with a credit: cannot happen; not evidence
            return "unchecked"
        self.tokens[(instance, "predicted")] += predicted
        self.tokens[(instance, "reported")] += min(reported, predicted)
        if not self.is_miss(predicted, reported):
            self.counts[(instance, "hit")] += 1
            st.misses = 0
            if st.probation:
                st.probation, st.strikes = False, 0
                self.counts[(instance, "trusted")] += 1
                return "trusted"
            return "hit"
        self.counts[(instance, "miss")] += 1
        if not self.distrust:
            return "miss"
        st.misses += 1
        if st.misses < self.misses_to_distrust and not st.probation:
            return "miss"
        st.strikes += 1
        st.misses, st.probation = 0, False
        st.until = now + min(self.max_s, self.base_s * 2 ** min(st.strikes - 1, 30))
        self.counts[(instance, "distrusted")] += 1
        return "distrusted"

    def distrusted(self, now: float) -> set[str]:
        """The instances distrusted at ``now``; one whose backoff has ended goes on probation."""
        out: set[str] = set()
        for instance, st in self._state.items():
            if st.until is None:
                continue
            if now < st.until:
                out.add(instance)
            else:
                st.until, st.probation = None, True
        return out
