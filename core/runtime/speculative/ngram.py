"""Prompt lookup (the `ngram` proposer): the longest suffix of a request's tokens (prompt and output)
that occurred earlier in them predicts that what followed it then follows now. Free to propose (no
model), it pays where the output repeats the input: extraction, quoting, summaries, code edits."""

from __future__ import annotations

import weakref

from radixlm.core.runtime.request import Req


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

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # A request's index lives as long as the request (retracted ones keep theirs: same tokens).
        self.indexes: "weakref.WeakKeyDictionary[Req, NgramIndex]" = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, budgets):
            index = self.indexes.get(req)
            if index is None:
                index = self.indexes[req] = NgramIndex(self.min_n, self.max_n)
            drafts.append(index.propose(req.fill_ids, k) if k > 0 else [])
        return drafts

    def draft_class(self, req: Req) -> int:
        """The matched suffix's length: a longer match predicts a longer run of kept tokens."""
        index = self.indexes.get(req)
        return index.matched if index is not None else 0

    def release(self, req: Req) -> None:
        self.indexes.pop(req, None)
