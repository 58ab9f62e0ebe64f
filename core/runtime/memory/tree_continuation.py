"""What the radix tree holds right after a request's tokens: the `ngram` proposer's second source
(core.runtime.speculative.ngram). Another request that had this one's whole context so far (the same
prompt asked again, a retried call, a fork's sibling at temperature 0) left its continuation in the tree.

A read-only walk: it neither splits edges nor touches access times, so looking costs the tree nothing.
"""

from __future__ import annotations

from radixlm.core.runtime.memory.radix_cache import TreeNode
from radixlm.core.runtime.memory.token_prefix import shared_len


def cached_continuation(node: TreeNode, tokens: list[int], k: int) -> list[int]:
    """Up to k tokens the tree holds after the path to `node` followed by `tokens`, taking the most
    recently used child where the path forks; [] where the tree does not hold `tokens` whole there."""
    out: list[int] = []
    pos = 0
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            return []
        shared = shared_len(child.key, tokens, pos)
        pos += shared
        if pos < len(tokens) and shared < len(child.key):
            return []  # the tokens leave the tree inside this edge
        node = child
        if pos == len(tokens):
            out = child.key[shared:shared + k]  # the rest of the edge the tokens end in
    while len(out) < k and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out += node.key[:k - len(out)]
    return out
