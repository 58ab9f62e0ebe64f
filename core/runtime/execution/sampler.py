"""Turns next-token logits into tokens: penalties, biases, constraint masks, temperature, top-k/p, min-p.

Logprobs reported to users are those of the model's raw distribution (log-softmax of the logits
before any penalty, mask or temperature), as SGLang and HF report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.core.runtime.constrained.tokens.masks import apply_token_masks
from radixlm.core.runtime.request import Req
from radixlm.kernels.registry import get_ops


_ARGMAX_CHUNKS = 64


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [B, V] scores; on a GPU in two stages where a row splits evenly (chunked_argmax):
    torch's argmax reduces one row in one block (27 µs for a 128k row on the H200). On the CPU, torch's."""
    rows, width = x.shape
    if not x.is_cuda or rows * _ARGMAX_CHUNKS > 4096 or width % _ARGMAX_CHUNKS or not x.is_contiguous():
        return x.argmax(dim=-1)  # (many rows fill the device already)
    return chunked_argmax(x, _ARGMAX_CHUNKS)


def chunked_argmax(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """x.argmax(dim=-1) of a contiguous [B, V] with V a multiple of `chunks`: each row's chunks reduced
    side by side, then the best chunk. The same result: the first index of the largest value, NaN
    counting as largest (torch's max and argmax agree on both)."""
    rows, width = x.shape
    values, index = x.view(rows, chunks, width // chunks).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (index.gather(1, best) + best * (width // chunks)).squeeze(1)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # raw logprob of each sampled token
    top_logprobs: list[list[tuple[float, int, None]]] | None
    invalid: frozenset[int] = frozenset()  # rows whose adjusted logits or distribution were not numbers


@dataclass
class DeviceSample:
    """Sampled tokens still on the device, with what the host reads about them (logprobs, rows found
    invalid), all computed on the device so that sampling never waits for it; `resolve` copies them to
    the host."""

    tokens: torch.Tensor  # [B] int64
    invalid: torch.Tensor | None = None  # [B] bool
    chosen_logprobs: torch.Tensor | None = None  # [B] raw logprob of each token, when a request wants them
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # values, ids [B, k] for the largest k asked
    host: list[torch.Tensor | None] | None = None  # the copies `start_copy` started
    copied: torch.cuda.Event | None = None

    def _parts(self) -> list[torch.Tensor | None]:
        top = self.top_logprobs or (None, None)
        return [self.tokens, self.invalid, self.chosen_logprobs, *top]

    def start_copy(self) -> None:
        """Starts copying to pinned host memory right behind the sampling on the stream, so that
        `resolve` waits for this step alone, not for a step launched after it (a plain `tolist` would
        wait for everything queued on the stream)."""
        if self.tokens.device.type != "cuda":
            return
        self.host = []
        for part in self._parts():
            if part is not None:
                copy = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                part = copy.copy_(part, non_blocking=True)
            self.host.append(part)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def resolve(self, reqs: list[Req]) -> SampleResult:
        if self.copied is not None:
            self.copied.synchronize()
        tokens, invalid, chosen, top_values, top_ids = self.host if self.host is not None else self._parts()
        bad = frozenset(i for i, flag in enumerate(invalid.tolist()) if flag) if invalid is not None else frozenset()
        if chosen is None:
            return SampleResult(tokens.tolist(), None, None, bad)
        tops = [None] * len(reqs)
        if top_values is not None:
            values, ids = top_values.tolist(), top_ids.tolist()
            tops = [[(v, t, None) for v, t in zip(values[i][:k], ids[i][:k])] if k else None
                    for i, k in enumerate(r.inp.top_logprobs_num for r in reqs)]
        return SampleResult(tokens.tolist(), chosen.tolist(), tops, bad)


def top_logprob_entries(logprobs: torch.Tensor, k: int) -> list[tuple[float, int, None]]:
    values, ids = logprobs.topk(k)
    return [(float(v), int(i), None) for v, i in zip(values.tolist(), ids.tolist())]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], generator: torch.Generator) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator = generator

    def sample(self, logits: torch.Tensor, reqs: list[Req], masks: list[torch.Tensor | None]) -> SampleResult:
        """logits: [B, V] fp32, one row per request; masks: per-request allowed-token masks or None.
        Rows found invalid are listed in the result's `invalid`."""
        return self.sample_on_device(logits, reqs, masks).resolve(reqs)

    @torch.inference_mode()  # the model's logits are inference tensors, masked in place
    def sample_on_device(self, logits: torch.Tensor, reqs: list[Req],
                         masks: list[torch.Tensor | None]) -> DeviceSample:
        """Like `sample`, but the tokens stay on the device and nothing waits for it (the overlap
        scheduler feeds them to the next step before it reads them). Rows whose adjusted logits or
        distribution are not numbers are flagged (`invalid`), not raised: the caller ends those requests."""
        logits = logits[:, : self.vocab_size]
        raw = top = None
        if any(r.inp.return_logprob for r in reqs):
            raw = torch.log_softmax(logits, dim=-1)
            k = max(r.inp.top_logprobs_num for r in reqs)
            top = tuple(raw.topk(k)) if k else None
        invalid = None
        banned_some = False  # a bias or a min_new_tokens ban may leave a constrained row with nothing allowed
        if self._needs_adjust(reqs):
            logits = logits.clone()
            banned_some = self._adjust(logits, reqs)
            invalid = torch.isnan(logits).any(dim=-1)
        if any(m is not None for m in masks):
            # In place even on the model's logits: masking twice is masking once (a fallback that samples
            # rows alone masks them again), and nothing reads them after sampling.
            apply_token_masks(logits, masks, rescue_banned_rows=banned_some)
        tokens, empty = self._choose(logits, reqs)
        if empty is not None:
            invalid = empty if invalid is None else invalid | empty
        chosen = raw.gather(1, tokens.view(-1, 1)).squeeze(1) if raw is not None else None
        return DeviceSample(tokens, invalid, chosen, top)

    @staticmethod
    def _needs_adjust(reqs: list[Req]) -> bool:
        """False on the common path (no penalty, bias or min_new_tokens ban): no per-request work."""
        for req in reqs:
            p = req.params
            if (p.logit_bias or len(req.output_ids) < p.min_new_tokens
                    or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
                return True
        return False

    def _adjust(self, logits: torch.Tensor, reqs: list[Req]) -> bool:
        """Applies penalties, biases and min_new_tokens bans in place; True if it banned or biased any."""
        banned_some = False
        for i, req in enumerate(reqs):
            p = req.params
            row = logits[i]
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._penalize(row, req)
            if p.logit_bias:
                banned_some = True
                ids = device_tensor(list(p.logit_bias), torch.int64, row.device)
                row[ids] += device_tensor(list(p.logit_bias.values()), row.dtype, row.device)
            if len(req.output_ids) < p.min_new_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < self.vocab_size]
                row[device_tensor(banned, torch.int64, row.device)] = float("-inf")
                banned_some = True
        return banned_some

    @staticmethod
    def _penalize(row: torch.Tensor, req: Req) -> None:
        p = req.params
        if p.repetition_penalty != 1.0:
            # Image positions hold ids past the vocabulary (their hash): not tokens, not penalised.
            seen = device_tensor(sorted(t for t in set(req.fill_ids) if t < row.numel()), torch.int64, row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if req.output_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(device_tensor(req.output_ids, torch.int64, row.device), minlength=row.numel())
            counts = counts[: row.numel()].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _choose(self, logits: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows take the argmax. The others sample all at once by the exponential race: the
        argmax of p / E with E ~ Exp(1) per token is a draw from p. E comes from the shared generator,
        or, for a request with its own seed, from a hash of (seed, output position, token id), so that
        a seeded request draws the same tokens in any batch without a generator of its own per row.
        Returns the tokens and, where any row samples, which rows had nothing to draw from (not-a-number
        values, or all zero)."""
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if not sampled:
            return row_argmax(logits), None
        dev = logits.device
        sub = [reqs[i] for i in sampled]
        whole = len(sampled) == len(reqs)
        index = None if whole else device_tensor(sampled, torch.int64, dev)
        temps = device_tensor([max(r.params.temperature, 1e-5) for r in sub], torch.float32, dev)
        probs = torch.softmax((logits if whole else logits[index]) / temps[:, None], dim=-1)
        probs = self._filter(probs, sub)
        empty = ~(probs.sum(dim=-1) > 0)  # would pick garbage
        picks = row_argmax(probs / self._exponential_noise(probs, sub))
        if whole:
            return picks, empty
        out = row_argmax(logits)
        out[index] = picks
        return out, torch.zeros(len(reqs), dtype=torch.bool, device=dev).index_copy_(0, index, empty)

    def _exponential_noise(self, probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Exp(1) noise of probs' shape: seeded rows from their hash, the rest from the shared generator."""
        seeded = [j for j, r in enumerate(reqs) if r.params.seed is not None]
        if not seeded:
            return self._generator_noise(probs)
        keys = [_row_key(reqs[j].params.seed, len(reqs[j].output_ids)) for j in seeded]
        hashed = get_ops(probs.device).seeded_exponential(device_tensor(keys, torch.int64, probs.device),
                                                          probs.shape[1])
        if len(seeded) == len(reqs):
            return hashed
        noise = self._generator_noise(probs)
        noise[device_tensor(seeded, torch.int64, probs.device)] = hashed
        return noise

    def _generator_noise(self, probs: torch.Tensor) -> torch.Tensor:
        # Floored: a zero draw would turn a banned token's 0 / 0 into a NaN that argmax picks.
        return torch.empty_like(probs).exponential_(generator=self.generator).clamp_(min=1e-30)

    @staticmethod
    def _filter(probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """top-k, then top-p, then min-p, each relative to the distribution it receives; batched."""
        params = [r.params for r in reqs]
        if all(p.top_k == -1 and p.top_p >= 1.0 and p.min_p <= 0 for p in params):
            return probs
        vocab = probs.shape[-1]
        table = device_tensor([[p.top_k if p.top_k > 0 else vocab, p.top_p, p.min_p] for p in params],
                               torch.float32, probs.device)
        ks, ps, mins = table[:, 0:1], table[:, 1:2], table[:, 2:3]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)[None, :]
        sorted_probs = sorted_probs.masked_fill(rank >= ks, 0.0)
        cum = sorted_probs.cumsum(-1)
        # keep a token if the mass before it is < top_p; the first token always (a top_p that rounds to 0
        # would drop it too)
        sorted_probs = sorted_probs.masked_fill(((cum - sorted_probs) >= ps * cum[:, -1:]) & (rank > 0), 0.0)
        sorted_probs = sorted_probs.masked_fill(sorted_probs < mins * sorted_probs[:, :1], 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _row_key(seed: int, position: int) -> int:
    """A 32-bit key for one seeded draw: splitmix64's finalizer over (seed, position), on the host."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device in one non-blocking copy (from pinned memory on CUDA)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
