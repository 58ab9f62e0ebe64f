"""Draft trees: several guessed continuations of a request, verified in one step. A chain is the tree
whose every node has one child. Node i holds tokens[i] and follows node parents[i] (-1: the request's
newest token, the root); parents come before their children, so any first k nodes are a tree too.

In a verify step row 0 is the root and row i + 1 node i; each row attends to the request's prefix and its
own ancestors (the kernels' tree mask), at position (the root's) + its depth. The target samples its token
at every row with the request's own sampler as of the path to that row; the walk (`accepted_path`)
starts at the root and descends to the child holding the sampled token while there is one. Since drafts
are deterministic, that is rejection sampling with one-hot draft distributions, child after child:
child c is kept with probability p(c); if not, the draw is from p without c renormalised, which keeps
the next child c' with p(c') / (1 - p(c)), and so on; where no child is kept the token is the draw
itself, distributed as the residual. Every emitted token is therefore the target's sample at its
position: the output distribution is the target's, and greedy outputs are its greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def cut(self, k: int) -> "DraftTree":
        """Its first k nodes (a tree: parents come first)."""
        return DraftTree(self.tokens[:k], self.parents[:k])

    def within_depth(self, depth: int) -> "DraftTree":
        """Without its nodes deeper than `depth` (the root's children are at depth 1)."""
        keep = [i for i in range(len(self)) if self.depth(i) <= depth]
        return self if len(keep) == len(self) else self.subtree(keep)

    def subtree(self, keep: list[int]) -> "DraftTree":
        """The nodes `keep`, in that order, as a tree: each one's parent is among them and listed first."""
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree([self.tokens[i] for i in keep], [index[self.parents[i]] if self.parents[i] >= 0 else -1
                                                         for i in keep])

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node` (none for the root, -1)."""
        return ancestry(self.parents, node)[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def depth(self, node: int) -> int:
        return len(self.path(node))

    def row_parents(self) -> list[int]:
        """The verify rows' parents (core.runtime.execution.batch_input's tree_parents): row 0, the root,
        follows the prefix; row i + 1 (node i) follows row parents[i] + 1."""
        return [-1] + [p + 1 for p in self.parents]

    def has_children(self, node: int) -> bool:
        return node in self.parents


def ancestry(parents: list[int], node: int) -> list[int]:
    """`node` and its ancestors, deepest first, in a node list whose node i follows parents[i] (-1: the
    root; none for the root itself)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out


def accepted_path(tree: DraftTree, sampled: list[int]) -> list[int]:
    """The draft nodes kept: from the root, while a child of the current node holds the token the target
    sampled at it (sampled[i + 1] at node i, sampled[0] at the root), descend to it. The first such child
    in node order (drafts do not repeat a token among siblings; if one did, either is the same token)."""
    path, node = [], -1
    while True:
        want = sampled[node + 1]
        child = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == want), None)
        if child is None:
            return path
        path.append(child)
        node = child


def merge_continuations(continuations: list[list[int]], k: int, rate: float = 1.0) -> DraftTree:
    """A tree of at most k nodes from guessed continuations, best first: their trie, keeping the nodes
    likeliest to be kept. Continuation c weighs 1 / (c + 1); a node's chance given its parent is `rate`
    (how often a draft token is kept) times the weight of the continuations through it over those
    through its parent, its score the product along its path: with a high rate the best continuation's
    branch goes deep, with a low one its first tokens' alternatives come first. A node scores no higher
    than its parent and ties go to the shallower node, so the kept nodes are a tree. One continuation
    is a chain."""
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[float] = []
    first: list[int] = []  # the continuation that made the node
    children: dict[tuple[int, int], int] = {}
    for c, cont in enumerate(continuations):
        node = -1
        for token in cont:
            nxt = children.get((node, token))
            if nxt is None:
                nxt = children[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                weights.append(0.0)
                first.append(c)
            weights[nxt] += 1 / (c + 1)
            node = nxt
    total = sum(1 / (c + 1) for c, cont in enumerate(continuations) if cont)
    score: list[float] = []
    depth: list[int] = []
    for i, p in enumerate(parents):  # parents come first
        score.append(rate * (weights[i] / total if p < 0 else score[p] * weights[i] / weights[p]))
        depth.append(1 if p < 0 else depth[p] + 1)
    # In that order parents come before their children, and a cut to fewer nodes keeps the best ones.
    best = sorted(range(len(tokens)), key=lambda i: (-score[i], depth[i], first[i], i))[:k]
    return DraftTree(tokens, parents).subtree(best)
