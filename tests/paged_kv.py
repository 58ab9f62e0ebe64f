"""A paged KV batch for the attention kernel tests (tests/test_kernels.py, tests/test_cpu_kernels.py)."""

from __future__ import annotations

import torch


class PagedBatch:
    """A KV pool filled with random values everywhere, and requests whose positions map to shuffled
    slots (never slot 0) in shuffled rows of a request-to-token table whose unused cells hold other
    valid slot ids, so any read of a wrong position or slot changes the answer."""

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 index_dtype: torch.dtype, device: str = "cpu") -> None:
        batch, total = len(seq_lens), sum(seq_lens)
        num_slots = total + 9
        self.k_buffer = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=device).to(dtype)
        self.v_buffer = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=device).to(dtype)
        slots = torch.randperm(num_slots)[:total] + 1
        num_rows, width = batch + 3, max(seq_lens, default=0) + 5
        self.req_to_token = torch.randint(1, num_slots + 1, (num_rows, width), dtype=torch.int32)
        self.req_pool_indices = torch.randperm(num_rows)[:batch]
        start = 0
        for row, seq_len in zip(self.req_pool_indices.tolist(), seq_lens):
            self.req_to_token[row, :seq_len] = slots[start : start + seq_len].to(torch.int32)
            start += seq_len
        self.req_to_token = self.req_to_token.to(device, index_dtype)
        self.req_pool_indices = self.req_pool_indices.to(device, index_dtype)
        self.seq_lens = torch.tensor(seq_lens, device=device, dtype=index_dtype)

    def tables(self) -> tuple[torch.Tensor, ...]:
        return self.k_buffer, self.v_buffer, self.req_to_token, self.req_pool_indices, self.seq_lens


def random_trees(extend_lens: list[int], rng) -> list[list[int]]:
    """Per request, its new tokens' parents as a draft tree's: each token after the first hangs off a random
    earlier one (the first, a verify step's root, off the prefix); a chain where the draw makes one."""
    return [[-1] + [rng.randrange(i) for i in range(1, n)] for n in extend_lens]


def tree_oracle(q: torch.Tensor, batch: PagedBatch, extend_lens: list[int], trees: list[list[int]],
                scale: float) -> torch.Tensor:
    """Each query row's softmax attention over exactly the keys it should see: its request's prefix and
    its ancestors among the new tokens (itself included), gathered one by one, in fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // batch.k_buffer.shape[1]
    at = 0
    for row, seq_len, ext, parents in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist(), extend_lens,
                                          trees):
        prefix = seq_len - ext
        for i in range(ext):
            path, node = [], i
            while node >= 0:
                path.append(prefix + node)
                node = parents[node]
            slots = batch.req_to_token[row, list(range(prefix)) + sorted(path)].long().cpu()
            k = batch.k_buffer.cpu()[slots].double().repeat_interleave(group, 1)  # [L, H, D]
            v = batch.v_buffer.cpu()[slots].double().repeat_interleave(group, 1)
            w = (torch.einsum("hd,lhd->hl", q[at + i].cpu().double(), k) * scale).softmax(-1)
            out[at + i] = torch.einsum("hl,lhd->hd", w, v)
        at += ext
    return out
