"""Prompt lookup (the `ngram` proposer): the longest suffix of a request's tokens (prompt and output)
that occurred earlier in them predicts that what followed it then follows now. Free to propose (no
model), it pays where the output repeats the input: extraction, quoting, summaries, code edits.

First, with `radix_cache` on, it asks the radix tree for the tokens another request left after this
request's whole context (core.runtime.memory.tree_continuation): a prompt asked again, or a retried or
forked call, then drafts its full earlier answer.

With `breadth` > 1 (speculative_ngram_max_bfs_breadth) it drafts a tree: that many continuations (the
radix tree's, then those after the latest earlier occurrences of the matched suffix, then of shorter
ones) merged into a trie of at most speculative_num_draft_tokens nodes (tree.merge_continuations)."""

from __future__ import annotations

import weakref

from radixlm.core.runtime.memory.tree_continuation import cached_continuation
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.policy import PRIOR_RATE
from radixlm.core.runtime.speculative.tree import DraftTree, merge_continuations

# The draft class of a draft from the radix tree (core.runtime.speculative.policy learns its rate apart
# from suffix matches, whose class is the matched length).
TREE_MATCH = 1_000


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one request's tokens ended, its latest `breadth`
    occurrences, built incrementally as the request grows: each token is indexed once."""

    def __init__(self, min_n: int, max_n: int, breadth: int = 1) -> None:
        self.min_n, self.max_n, self.breadth = min_n, max_n, breadth
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the indices just past its occurrences, latest last
        self.indexed = 0  # n-grams ending at or before this index are in `ends`
        self.matched = 0  # the length of the suffix the latest proposal matched (0: none)

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        """Up to `breadth` distinct continuations of k tokens, best first: what followed the latest earlier
        occurrences of the longest matching suffix, then of shorter ones."""
        end = len(tokens)
        # Every n-gram that ends before the suffix itself: an occurrence must leave a continuation.
        for e in range(self.indexed + 1, end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                seen = self.ends.setdefault(tuple(tokens[e - n:e]), [])
                seen.append(e)
                if len(seen) > self.breadth:
                    del seen[0]
        self.indexed = max(self.indexed, end - 1)
        self.matched = 0
        found: list[list[int]] = []
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            for at in reversed(self.ends.get(tuple(tokens[end - n:]), ())):
                cont = tokens[at:at + k]
                if cont not in found:
                    self.matched = self.matched or n
                    found.append(cont)
                    if len(found) == self.breadth:
                        return found
        return found


class NgramProposer:
    name = "ngram"
    free = True

    def __init__(self, min_n: int, max_n: int, radix_cache: bool = True, breadth: int = 1) -> None:
        """`breadth` > 1: drafts are trees merging that many continuations (speculative_ngram_max_bfs_breadth)."""
        self.min_n, self.max_n = min_n, max_n
        self.radix_cache = radix_cache
        self.breadth = breadth
        self.trees = breadth > 1
        # A request's index lives as long as the request (retracted ones keep theirs: same tokens).
        self.indexes: "weakref.WeakKeyDictionary[Req, NgramIndex]" = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int] | DraftTree]:
        drafts: list[list[int] | DraftTree] = []
        for req, k in zip(reqs, budgets):
            index = self.indexes.get(req)
            if index is None:
                index = self.indexes[req] = NgramIndex(self.min_n, self.max_n, self.breadth)
            drafts.append(self._propose(req, index, k) if k > 0 else [])
        return drafts

    def _propose(self, req: Req, index: NgramIndex, k: int) -> list[int] | DraftTree:
        """The radix tree's continuation first, then the request's own n-grams': one is a chain, several
        merge into a tree of at most k nodes."""
        cached: list[int] = []
        if self.radix_cache and req.last_node is not None:
            cached = cached_continuation(req.last_node, req.fill_ids[req.cached_len:], k)
        found = [cached] if cached else []
        if len(found) < self.breadth:
            found += [c for c in index.continuations(req.fill_ids, k) if c != cached][:self.breadth - len(found)]
        if cached:
            index.matched = TREE_MATCH
        if not found:
            return []
        if len(found) == 1:
            return found[0]
        # The request's own rate of kept draft tokens shapes the tree (deep where drafts are kept, wide
        # where they are not); before any, an even chance.
        return merge_continuations(found, k, req.spec.rate(PRIOR_RATE) if req.spec is not None else PRIOR_RATE)

    def draft_class(self, req: Req) -> int:
        """The matched suffix's length (a longer match predicts a longer run of kept tokens), or TREE_MATCH."""
        index = self.indexes.get(req)
        return index.matched if index is not None else 0

    def release(self, req: Req) -> None:
        self.indexes.pop(req, None)
