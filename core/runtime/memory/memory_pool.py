"""KV memory: a token-granular KV pool with its slot allocator, and the request-to-token table.

Slot 0 of the KV pool is never handed out: padded positions (CUDA-graph batches, dummy rows) write
there, so a real request's KV is never overwritten by padding, and padded reads (the CPU kernels'
masked keys) read it.
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from radixlm.core.errors import InvalidRequestError, OutOfMemoryError


def host_int64(parts: Sequence[Sequence[int]], pin: bool) -> torch.Tensor:
    """The int lists one after another in one int64 host tensor (pinned for a non-blocking copy), for
    a step's index tensors to cross to the device in one copy. Through numpy: 4x faster than
    torch.tensor of a list at a 16 x 1024-token prefill (0.75 against 3.0 ms), 3x at a decode of 64."""
    n = sum(len(p) for p in parts)
    host = torch.empty(n, dtype=torch.int64, pin_memory=pin)
    host.numpy()[:] = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=n)
    return host


def host_available_bytes() -> int:
    """The host memory free for use (MemAvailable), or 8 GiB where /proc/meminfo cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


class KVPool:
    """Per-layer key and value buffers of shape [num_slots + 1, num_kv_heads, head_dim], views of one
    zeroed allocation. On the CPU that allocation is an anonymous memory map: the OS hands its pages out
    zeroed on first touch, so the pool costs no start-up time and only the RAM that requests fill.

    The dtype is the model's, or fp8 (EngineOptions.kv_cache_dtype): one byte per value, so the same
    memory holds twice the tokens of bf16. The kernels cast on store and upcast on load."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        shape = (2, num_layers, num_slots + 1, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            # The tensor keeps the map alive; it is unmapped when the last view is freed.
            kv = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)
        else:
            kv = torch.zeros(shape, dtype=dtype, device=device)
        self.kv = kv  # [2 (keys, values), num_layers, num_slots + 1, num_kv_heads, head_dim]
        self.k_buffers, self.v_buffers = list(kv[0].unbind(0)), list(kv[1].unbind(0))

    @staticmethod
    def check_dtype(dtype: torch.dtype, device: torch.device | str, ops: ModuleType, triton: bool) -> None:
        """Raises InvalidRequestError where an fp8 pool cannot run: the Triton kernels' fp8 casts need a GPU
        of compute capability 8.9 or later (Ada, Hopper); and the kernel set `ops` must store into the
        dtype and torch read it back (a probe of both)."""
        if dtype.itemsize != 1:
            return
        device = torch.device(device)
        if triton and torch.cuda.get_device_capability(device) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise InvalidRequestError(f"kv_cache_dtype {dtype}: the GPU ({name}) has no fp8 conversions (compute "
                                      "capability 8.9+ needed); use kv_cache_dtype=auto", "kv_cache_dtype")
        try:
            k, v = torch.zeros((2, 1, 16), dtype=dtype, device=device), torch.zeros((2, 1, 16), dtype=dtype, device=device)
            one = torch.ones((1, 1, 16), device=device)
            ops.store_kv(k, v, torch.ones(1, dtype=torch.int64, device=device), one, one)
            k.index_select(0, torch.ones(1, dtype=torch.int64, device=device)).float()
        except (RuntimeError, TypeError) as e:
            raise InvalidRequestError(f"kv_cache_dtype {dtype} is not supported on {device} by torch "
                                      f"{torch.__version__}: {e}", "kv_cache_dtype") from e

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class SlotAllocator:
    """Hands out KV slots 1..num_slots. Free slots are kept on the host as a stack of ints."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = []
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.num_slots, 0, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None when fewer than n are free (the caller evicts or retracts, then retries)."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_set(self) -> set[int]:
        return set(self._free)


class ReqToTokenPool:
    """Table [max_requests + 1, max_context_len]: row r, column i = KV slot of position i of request r.

    The last row (`padding_row`) is never handed out: padded batch rows (CUDA graphs) point at it.
    Writes are queued on the host and applied by `flush()` in one indexed assignment (one host-to-device
    copy for the whole step instead of one per request); the model runner flushes before every forward.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._pending: list[tuple[int, int, list[int]]] = []
        self._pending_rows: set[int] = set()

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfMemoryError("no free request row; lower max_running_requests pressure")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """Queues table[row, start : start + len(slots)] = slots (applied by the next flush)."""
        if not slots:
            return
        if row in self._pending_rows:
            # One indexed assignment has no order among duplicate cells: the earlier write goes first.
            self.flush()
        self._pending.append((row, start, list(slots)))
        self._pending_rows.add(row)

    def flush(self) -> None:
        """Applies the queued writes: one host-to-device copy of each cell's row, column and value
        (expanded on the host, where it costs microseconds, not a launch each), one scatter, no sync."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_rows.clear()
        k = len(pending)
        lens = np.fromiter((len(v) for _, _, v in pending), dtype=np.int64, count=k)
        total = int(lens.sum())
        # Each cell's column: its write's start plus its offset within that write.
        starts = np.fromiter((s for _, s, _ in pending), dtype=np.int64, count=k)
        host = torch.empty(3 * total, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        cells = host.numpy().reshape(3, total)
        cells[0] = np.repeat(np.fromiter((r for r, _, _ in pending), dtype=np.int64, count=k), lens)
        cells[1] = np.arange(total) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        cells[2] = np.fromiter(itertools.chain.from_iterable(v for _, _, v in pending), dtype=np.int64, count=total)
        rows, cols, slots = host.to(self.device, non_blocking=True).view(3, total)
        self.table[rows, cols] = slots.to(torch.int32)
