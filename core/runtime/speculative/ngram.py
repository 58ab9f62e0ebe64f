"""Prompt lookup (the `ngram` proposer): the longest suffix of a request's tokens (prompt and output)
that occurred earlier in them predicts that what followed it then follows now. Free to propose (no
model), it pays where the output repeats the input: extraction, quoting, summaries, code edits.

First, with `radix_cache` on, it asks the radix tree for the tokens another request left after this
request's whole context (core.runtime.memory.tree_continuation): a prompt asked again, or a retried or
forked call, then drafts its full earlier answer."""

from __future__ import annotations

import weakref

from radixlm.core.runtime.memory.tree_continuation import cached_continuation
from radixlm.core.runtime.request import Req

# The draft class of a draft from the radix tree (core.runtime.speculative.policy learns its rate apart
# from suffix matches, whose class is the matched length).
TREE_MATCH = 1_000


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one request's tokens last ended, built incrementally
    as the request grows: each token is indexed once."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest occurrence
        self.indexed = 0  # n-grams ending at or before this index are in `ends`
        self.matched = 0  # the length of the suffix the latest proposal matched (0: none)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        # Every n-gram that ends before the suffix itself: an occurrence must leave a continuation.
        for e in range(self.indexed + 1, end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self.ends.get(tuple(tokens[end - n:]))
            if at is not None:
                self.matched = n
                return tokens[at:at + k]
        self.matched = 0
        return []


class NgramProposer:
    name = "ngram"
    free = True

    def __init__(self, min_n: int, max_n: int, radix_cache: bool = True) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.radix_cache = radix_cache
        # A request's index lives as long as the request (retracted ones keep theirs: same tokens).
        self.indexes: "weakref.WeakKeyDictionary[Req, NgramIndex]" = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, budgets):
            index = self.indexes.get(req)
            if index is None:
                index = self.indexes[req] = NgramIndex(self.min_n, self.max_n)
            drafts.append(self._propose(req, index, k) if k > 0 else [])
        return drafts

    def _propose(self, req: Req, index: NgramIndex, k: int) -> list[int]:
        if self.radix_cache and req.last_node is not None:
            draft = cached_continuation(req.last_node, req.fill_ids[req.cached_len:], k)
            if draft:
                index.matched = TREE_MATCH
                return draft
        return index.propose(req.fill_ids, k)

    def draft_class(self, req: Req) -> int:
        """The matched suffix's length (a longer match predicts a longer run of kept tokens), or TREE_MATCH."""
        index = self.indexes.get(req)
        return index.matched if index is not None else 0

    def release(self, req: Req) -> None:
        self.indexes.pop(req, None)
