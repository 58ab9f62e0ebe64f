"""How many tokens each running request drafts in a step: the lengths that give the step the most
expected tokens per second, or none where no draft beats a plain decode step. Inputs: each request's
chance of keeping a draft token (core.runtime.speculative.state, with its draft class's rate as the
prior) and the step times measured on this device, for decode steps by batch size and for verify steps
by tokens computed.

A draft token is kept only when every one before it is, so with rate r the j-th token of a draft adds
r**j expected tokens: per request the gains fall with j, and the best drafts of T tokens in all take
the T largest gains across requests. The step's rate is (batch + those gains) / (the verify step's
time for batch + T tokens), against batch / (the decode step's time) for T = 0, which a draft must beat
by MIN_GAIN."""

from __future__ import annotations

import bisect

from radixlm.core.runtime.speculative.state import SpecState

# Step-time averages: each new time counts this much.
TIME_WEIGHT = 0.2
# Before a verify step of a size is measured: each token it computes beyond the batch's one each costs
# this fraction of a decode step (a CPU computes a few more tokens at a real price; a GPU's decode step
# streams the weights, where a few more tokens cost little).
PRIOR_TOKEN_COST = {"cpu": 0.25, "cuda": 0.03}
# A draft class's rate before any of its drafts is checked, and the drafts' worth of evidence it counts as.
PRIOR_RATE, PRIOR_DRAFTS = 0.5, 2.0
# A draft class's evidence decays by this per draft of it checked.
CLASS_DECAY = 0.98
# A step drafts only where its expected tokens per second beat a decode step's by this factor: rates and
# times are estimates (the times of a loaded machine swing by tens of percent), and a draft that only
# breaks even on them risks a slowdown for nothing.
MIN_GAIN = 1.1


def _average(table: dict[int, float], key: int, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else old + TIME_WEIGHT * (seconds - old)


class StepTimes:
    """Measured step times: decode steps by batch size, verify steps by tokens computed."""

    def __init__(self, token_cost: float) -> None:
        self.token_cost = token_cost  # PRIOR_TOKEN_COST for the device
        self.decode: dict[int, float] = {}
        self.verify: dict[int, float] = {}
        self._verify_sizes: list[int] = []  # verify's keys, sorted

    def record_decode(self, batch: int, seconds: float) -> None:
        _average(self.decode, batch, seconds)

    def record_verify(self, tokens: int, seconds: float) -> None:
        if tokens not in self.verify:
            bisect.insort(self._verify_sizes, tokens)
        _average(self.verify, tokens, seconds)

    def decode_time(self, batch: int) -> float | None:
        """The decode step's time at this batch size (the nearest measured size's); None before any."""
        if not self.decode:
            return None
        return self.decode[min(self.decode, key=lambda b: (abs(b - batch), b))]

    def verify_time(self, batch: int, tokens: int, decode: float) -> float:
        """A verify step's time for `tokens` tokens at this batch size: measured, else the nearest measured
        size's plus the prior cost of the difference, else the decode step's plus the prior cost."""
        if tokens in self.verify:
            return self.verify[tokens]
        sizes = self._verify_sizes
        if sizes:
            at = bisect.bisect_left(sizes, tokens)
            near = min(sizes[max(0, at - 1):at + 1], key=lambda n: (abs(n - tokens), n))
            return max(decode, self.verify[near] + self.token_cost * decode * (tokens - near))
        return decode * (1.0 + self.token_cost * (tokens - batch))


def choose_lengths(rates: list[float], caps: list[int], times: StepTimes) -> list[int]:
    """Per request the draft length (at most caps[i]) that, with the others', gives the step the most
    expected tokens per second; all 0 where that does not beat a decode step's by MIN_GAIN (or no decode
    step is measured yet)."""
    batch = len(caps)
    decode = times.decode_time(batch)
    if decode is None:
        return [0] * batch
    gains = sorted(((r ** j, i) for i, (r, cap) in enumerate(zip(rates, caps)) for j in range(1, cap + 1)),
                   reverse=True)
    best, best_rate, tokens = 0, MIN_GAIN * batch / decode, float(batch)
    for t, (gain, _) in enumerate(gains, 1):
        tokens += gain
        rate = tokens / times.verify_time(batch, batch + t, decode)
        if rate > best_rate:
            best, best_rate = t, rate
    lengths = [0] * batch
    for _, i in gains[:best]:
        lengths[i] += 1
    return lengths


class DraftPolicy:
    """The draft lengths of a speculator's steps (speculative_adaptive); it learns from every step."""

    def __init__(self, device_type: str) -> None:
        self.times = StepTimes(PRIOR_TOKEN_COST.get(device_type, PRIOR_TOKEN_COST["cuda"]))
        self.kept: dict[int, float] = {}  # draft class -> tokens kept (decayed)
        self.cut: dict[int, float] = {}  # draft class -> drafts cut by a rejection (decayed)

    def class_rate(self, cls: int) -> float:
        kept, cut = self.kept.get(cls, 0.0), self.cut.get(cls, 0.0)
        return (kept + PRIOR_DRAFTS * PRIOR_RATE) / (kept + cut + PRIOR_DRAFTS)

    def lengths(self, states: list[SpecState], classes: list[int], caps: list[int]) -> list[int]:
        rates = [s.rate(self.class_rate(c)) for s, c in zip(states, classes)]
        return choose_lengths(rates, caps, self.times)

    def record(self, state: SpecState, drafted: int, accepted: int, cut: bool) -> None:
        cls = state.draft_class
        self.kept[cls] = CLASS_DECAY * self.kept.get(cls, 0.0) + accepted
        self.cut[cls] = CLASS_DECAY * self.cut.get(cls, 0.0) + cut
        state.record(drafted, accepted, cut)
