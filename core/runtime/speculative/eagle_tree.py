"""EAGLE draft trees (`speculative_eagle_topk` > 1, EAGLE-2's dynamic trees as SGLang builds them): the
head's catch-up gives the first draft position's distribution; its topk likeliest tokens are the first
nodes. Each further step (`speculative_num_steps` in all) runs the head over the tree grown so far, each
node attending to the request's prefix and its own ancestors (the kernels' tree mask), and gives every
newest node its topk likeliest children, scored by the path's summed log-probability; the topk best of
those children are expanded at the next step. The tree drafted is the speculative_num_draft_tokens
best-scored nodes (a node scores no higher than its parent, so they form a tree).

A node enters the head as the chain's tokens do: its token with the head's output at the row that
proposed it (its parent's row; the catch-up's last row for the first nodes). The tree's rows are
recomputed at every step (a handful of rows of one layer) and their head KV freed after it, so the head
keeps KV of positions read from the target only. After a verify step the target's hidden states of the
kept path become the request's next positions (`kept_rows`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.eagle import EagleProposer
from radixlm.core.runtime.speculative.tree import DraftTree, ancestry


@dataclass
class _Node:
    token: int
    parent: int  # index in the request's node list; -1: the root
    score: float  # the path's summed log-probability under the head
    feature: torch.Tensor  # [1, hidden]: the head's output at the row that proposed it
    depth: int


class EagleTreeProposer(EagleProposer):
    trees = True  # its budget counts nodes (core.runtime.speculative.proposer)
    def __init__(self, runner: Any, target_runner: Any, vocab_size: int, topk: int, steps: int) -> None:
        super().__init__(runner, target_runner, vocab_size)
        self.topk, self.steps = topk, steps
        self.logits: torch.Tensor | None = None  # the head's latest logits, every row
        self.rows_out: torch.Tensor | None = None  # the head's outputs at every logit row of a tree step

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int] | DraftTree]:
        drafts: list[list[int] | DraftTree] = [[] for _ in reqs]
        active = [i for i, k in enumerate(budgets) if k > 0 and self._catch_up_room(reqs[i])]
        if active:
            sub = [reqs[i] for i in active]
            self._catch_up(sub)
            firsts = [self._children(self.logits[j], -1, 0.0, self.out[r], 1) for j, r in enumerate(sub)]
            for i, tree in zip(active, self._grow(sub, firsts, [budgets[i] for i in active])):
                drafts[i] = tree
        self._forget_drafts(reqs)
        return drafts

    def kept_rows(self, req: Req, rows: list[int]) -> None:
        """A verify step of a tree kept these of its rows (0: the request's newest token): the target's
        hidden states of them, in that order, are the request's next positions' (the step's rows are the row's
        last piece of states: observe_target joins older pieces only)."""
        chunks = self.states.get(req.row)
        if chunks:
            first, hidden = chunks[-1]
            chunks[-1] = (first, hidden[torch.tensor(rows, device=hidden.device)])

    def _greedy(self, batch: BatchInput) -> list[int]:
        self.logits = self.runner.forward(batch)[:, :self.vocab_size].float()
        return self.logits.argmax(dim=-1).tolist()

    def _observe_head(self, batch: BatchInput, hidden: torch.Tensor) -> None:
        if self.in_step:
            super()._observe_head(batch, hidden)
        else:  # a tree step: every row's output
            self.rows_out = hidden[batch.logit_rows]

    def _children(self, logits: torch.Tensor, parent: int, score: float, feature: torch.Tensor,
                  depth: int) -> list[_Node]:
        logp = torch.log_softmax(logits, dim=-1).topk(self.topk)
        return [_Node(t, parent, score + v, feature, depth) for v, t in zip(logp.values.tolist(), logp.indices.tolist())]

    def _grow(self, reqs: list[Req], firsts: list[list[_Node]], budgets: list[int]) -> list[DraftTree]:
        nodes = [list(f) for f in firsts]  # every candidate so far, per request
        frontier = [list(range(len(f))) for f in firsts]  # the nodes to expand next
        for _ in range(min(self.steps, max(budgets)) - 1):  # a tree of k nodes is at most k deep
            expanded = self._expand(reqs, nodes, frontier)
            for j, (req_nodes, rows) in enumerate(zip(nodes, expanded)):
                children = []
                for node, (logits, out) in rows.items():
                    n = req_nodes[node]
                    children += self._children(logits, node, n.score, out, n.depth + 1)
                best = sorted(range(len(children)), key=lambda c: -children[c].score)[:self.topk]
                frontier[j] = [len(req_nodes) + c for c in best]
                req_nodes += children
        return [_best_tree(req_nodes, k) for req_nodes, k in zip(nodes, budgets)]

    def _expand(self, reqs: list[Req], nodes: list[list[_Node]],
                frontier: list[list[int]]) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """One head step over each request's tree so far (the frontier and its ancestors, recomputed, at
        their depths' positions, tree-masked): the logits and head output at each frontier node."""
        batch = BatchInput(False, [], [], [], [], [], [], [], tree_parents=[])
        feats, placed = [], []
        for req, req_nodes, front in zip(reqs, nodes, frontier):
            parents = [n.parent for n in req_nodes]
            keep = sorted({a for f in front for a in ancestry(parents, f)})
            index = {node: r for r, node in enumerate(keep)}
            kv = self.held[req]
            slots = self.allocator.alloc(len(keep))
            if slots is None:  # the head's pool is full: this request's tree stops growing
                placed.append(None)
                continue
            base = len(kv.ids)
            self.runner.req_to_token.write(kv.row, base, slots)
            at = len(batch.input_ids)
            for node in keep:
                n = req_nodes[node]
                batch.input_ids.append(n.token)
                batch.positions.append(base - 1 + n.depth)
                batch.tree_parents.append(index[n.parent] if n.parent >= 0 else -1)
                feats.append(n.feature)
            batch.out_cache_loc.extend(slots)
            batch.rows.append(kv.row)
            batch.seq_lens.append(base + len(keep))
            batch.extend_lens.append(len(keep))
            placed.append((slots, {f: at + index[f] for f in front}))
            batch.logit_rows.extend(at + index[f] for f in front)
        if not batch.rows:
            return [{} for _ in reqs]
        batch.features = torch.cat(feats)
        self.in_step = []
        logits = self.runner.forward(batch)[:, :self.vocab_size].float()
        where = {row: i for i, row in enumerate(batch.logit_rows)}
        out: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        for p in placed:
            if p is None:
                out.append({})
                continue
            slots, rows = p
            self.allocator.free(slots)
            out.append({f: (logits[where[r]], self.rows_out[where[r]:where[r] + 1]) for f, r in rows.items()})
        return out


def _best_tree(nodes: list[_Node], k: int) -> DraftTree:
    """The k best-scored nodes as a tree (parents first: a child scores no higher than its parent, and
    ties go to the shallower node)."""
    keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:k]
    return DraftTree([n.token for n in nodes], [n.parent for n in nodes]).subtree(keep)
