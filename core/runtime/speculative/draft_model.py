"""The `draft` proposer: a smaller checkpoint sharing the target's tokenizer drafts greedily, with its
own model runner (its own KV pool and request-to-token table). Per request the draft keeps the KV of
the tokens it has seen; each step it first catches up on what the target accepted since (one extend
step for all requests, from the longest prefix it still agrees with), which also gives the first draft
token, then decodes the others one step each. It pays where the draft model predicts the target well
and costs much less per token (a model several times smaller of the same family)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req


@dataclass
class DraftKV:
    """What the draft model holds for one request: the KV of `ids` (positions 0..len - 1) in `slots`."""

    row: int
    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class DraftModelProposer:
    name = "draft"
    free = False

    def __init__(self, runner: Any, vocab_size: int) -> None:
        """`runner`: the draft model's ModelRunner; `vocab_size`: the target's (drafts stay below it)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.allocator = SlotAllocator(runner.num_slots)
        self.held: dict[Req, DraftKV] = {}

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [i for i, k in enumerate(budgets) if k > 0 and self._catch_up_room(reqs[i])]
        if not active:
            return drafts
        firsts = self._catch_up([reqs[i] for i in active])
        for i, token in zip(active, firsts):
            drafts[i].append(token)
        for _ in range(max(budgets[i] for i in active) - 1):
            active = [i for i in active if len(drafts[i]) < budgets[i]]
            slots = self.allocator.alloc(len(active))
            if not active or slots is None:
                break
            for i, token in zip(active, self._decode([reqs[i] for i in active], [drafts[i][-1] for i in active], slots)):
                drafts[i].append(token)
        return drafts

    def draft_class(self, req: Req) -> int:
        return 0  # one class: the model's drafts

    def release(self, req: Req) -> None:
        kv = self.held.pop(req, None)
        if kv is not None:
            self.allocator.free(kv.slots)
            self.runner.req_to_token.free(kv.row)

    def slots_held(self) -> int:
        return sum(len(kv.slots) for kv in self.held.values())

    def _catch_up_room(self, req: Req) -> bool:
        """Keeps the request's draft KV for the longest prefix it shares with the request's tokens (all
        but the newest, which the catch-up computes) and takes slots for the rest; False (its draft KV
        dropped) when the draft pool cannot hold them."""
        kv = self.held.get(req)
        if kv is None:
            if self.runner.req_to_token.available() == 0:
                return False
            kv = self.held[req] = DraftKV(self.runner.req_to_token.alloc())
        tokens = self._kv_tokens(req)
        keep = 0
        limit = min(len(kv.ids), len(tokens) - 1)
        while keep < limit and kv.ids[keep] == tokens[keep]:
            keep += 1
        self.allocator.free(kv.slots[keep:])
        del kv.slots[keep:], kv.ids[keep:]
        new = self.allocator.alloc(len(tokens) - keep)
        if new is None:
            self.release(req)
            return False
        self.runner.req_to_token.write(kv.row, keep, new)
        kv.slots.extend(new)
        return True

    def _catch_up(self, reqs: list[Req]) -> list[int]:
        """One extend step computing each request's tokens the draft has not seen (slots taken by
        _catch_up_room); returns the draft's next token after each."""
        batch = BatchInput(False, [], [], [], [], [], [], [])
        spans = []
        for req in reqs:
            kv, tokens = self.held[req], self._kv_tokens(req)
            start = len(kv.ids)
            spans.append((req, start, len(tokens)))
            batch.input_ids.extend(tokens[start:])
            batch.positions.extend(range(start, len(tokens)))
            batch.out_cache_loc.extend(kv.slots[start:])
            batch.rows.append(kv.row)
            batch.seq_lens.append(len(tokens))
            batch.extend_lens.append(len(tokens) - start)
            batch.logit_rows.append(len(batch.input_ids) - 1)
            kv.ids = list(tokens)
        batch.features = self._features(spans)
        return self._greedy(batch)

    def _decode(self, reqs: list[Req], inputs: list[int], slots: list[int]) -> list[int]:
        """One decode step of the draft model over each request's newest draft token."""
        n = len(reqs)
        batch = BatchInput(True, list(inputs), [], list(slots), [], [], [1] * n, list(range(n)))
        for req, token, slot in zip(reqs, inputs, slots):
            kv = self.held[req]
            batch.positions.append(len(kv.ids))
            batch.rows.append(kv.row)
            batch.seq_lens.append(len(kv.ids) + 1)
            kv.ids.append(token)
            kv.slots.append(slot)
        batch.features = self._chain_features(reqs)
        return self._greedy(batch)

    def _greedy(self, batch: BatchInput) -> list[int]:
        return self.runner.forward(batch)[:, :self.vocab_size].argmax(dim=-1).tolist()

    # What a draft model reads per position, which the EAGLE proposer (core.runtime.speculative.eagle)
    # changes: the token there, and nothing else.
    def _kv_tokens(self, req: Req) -> list[int]:
        """The tokens the draft KV follows, one per position: the request's."""
        return req.fill_ids

    def _features(self, spans: list[tuple[Req, int, int]]) -> torch.Tensor | None:
        """Inputs beside the tokens for the catch-up of positions [start, end) of each request: none."""
        return None

    def _chain_features(self, reqs: list[Req]) -> torch.Tensor | None:
        """Inputs beside the tokens for a draft decode step of these requests: none."""
        return None
