"""The radix cache's second tier: a KV pool in host memory and the copies between it and the device pool.

When the device pool runs short, the radix cache writes an evicted node's KV back here instead of
dropping it; a later request whose prefix runs into such a node has it loaded back into fresh device
slots instead of recomputing it (radix_cache.py keeps the bookkeeping; this module only moves bytes).

Host layout is token-major, [num_slots + 1, 2, num_layers, num_kv_heads, head_dim]: one slot holds one
token's keys and values of every layer contiguously, so a run of consecutive host slots is one
contiguous block and one DMA copy (on CUDA the buffer is pinned). The device pool is layer-major
(memory_pool.KVPool), so each copy goes through a device staging tensor gathered or scattered with
one indexing kernel.

On CUDA, write-backs gather on the compute stream (the evicted slots may be reused by the very next
kernel, and stream order makes that safe) and copy to the host on a copy stream; loads copy and scatter
on the copy stream after waiting for the compute stream (their fresh device slots were last read
there), and end with an event the scheduler polls: a request is admitted once its load has landed, so
the decode loop never waits for a copy. On the CPU every copy completes before the call returns.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.core.runtime.memory.memory_pool import KVPool, SlotAllocator, host_available_bytes
from radixlm.core.errors import InvalidRequestError



@dataclass
class TierStats:
    """Counters of the host tier."""

    hicache_host_hit_tokens_total: int = 0  # prompt tokens loaded back from host memory, not recomputed
    hicache_loads_total: int = 0
    hicache_writes_total: int = 0  # evicted nodes written back to host memory
    hicache_bytes_to_host_total: int = 0
    hicache_bytes_to_device_total: int = 0
    hicache_load_wait_s: float = 0.0  # summed over loads: seconds from issue until seen complete


class HostKVPool:
    """Token-major KV slots 1..num_slots in host memory (pinned when `pin`), with their own allocator."""

    def __init__(self, num_slots: int, like: KVPool, pin: bool) -> None:
        _, layers, _, heads, head_dim = like.kv.shape
        self.num_slots = num_slots
        self.allocator = SlotAllocator(num_slots)
        shape = (num_slots + 1, 2, layers, heads, head_dim)
        self.kv = torch.empty(shape, dtype=like.kv.dtype, pin_memory=pin)
        self.bytes_per_token = self.kv[0].numel() * self.kv.element_size()

    @staticmethod
    def slots_for(size_gb: float, like: KVPool) -> int:
        """How many token slots `size_gb` GiB of host memory holds for this device pool's layout."""
        _, layers, _, heads, head_dim = like.kv.shape
        return int(size_gb * 2**30 // KVPool.bytes_per_token(layers, heads, head_dim, like.kv.dtype))


@dataclass
class Transfer:
    """Copies in flight between the tiers (a load, or a write-back); done once they have landed."""

    started: float = field(default_factory=time.perf_counter)
    event: torch.cuda.Event | None = None
    keep: list[torch.Tensor] = field(default_factory=list)  # staging tensors the copies still use

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostTier:
    """Moves KV between the device pool and a HostKVPool. `write` is fire-and-forget (ordered before any
    later copy); `load` returns a Transfer to poll."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool) -> None:
        # Weak: the model runner owns the device pool and frees it at shutdown.
        self._device_pool = weakref.ref(device_pool)
        self.host = host_pool
        self.stats = TierStats()
        self.device = device_pool.kv.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._writes: list[Transfer] = []  # write-backs in flight, kept until their staging may be freed

    @classmethod
    def create(cls, size_gb: float, device_pool: KVPool) -> HostTier:
        """The tier for the `hicache_size_gb` option."""
        num_slots = HostKVPool.slots_for(size_gb, device_pool)
        if num_slots < 1:
            raise InvalidRequestError(f"hicache_size_gb={size_gb} holds no token of this model's KV", "hicache_size_gb")
        if size_gb * 2**30 > host_available_bytes():
            raise InvalidRequestError(f"hicache_size_gb={size_gb} is more than the host's available memory "
                                      f"({host_available_bytes() / 2**30:.1f} GiB)", "hicache_size_gb")
        return cls(device_pool, HostKVPool(num_slots, device_pool, pin=device_pool.kv.device.type == "cuda"))

    @property
    def device_kv(self) -> torch.Tensor:
        """The device pool's [2, layers, slots + 1, heads, head_dim] tensor."""
        pool = self._device_pool()
        assert pool is not None, "the device KV pool was released"
        return pool.kv

    @property
    def allocator(self) -> SlotAllocator:
        return self.host.allocator

    def write(self, dev_slots: list[int], host_slots: list[int]) -> None:
        """Copies the KV of `dev_slots` into `host_slots`. The device slots may be reused at once."""
        self._reap_writes()
        # Gather on the compute stream: the next kernel there may overwrite these slots.
        staged = self.device_kv[:, :, self._index(dev_slots)].permute(2, 0, 1, 3, 4).contiguous()
        write = Transfer(keep=[staged])
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy_runs(host_slots, staged, to_host=True)
                write.event = torch.cuda.Event()
                write.event.record(self.stream)
            self._writes.append(write)
        else:
            self._copy_runs(host_slots, staged, to_host=True)
        self.stats.hicache_writes_total += 1
        self.stats.hicache_bytes_to_host_total += len(dev_slots) * self.host.bytes_per_token

    def load(self, host_slots: list[int], dev_slots: list[int]) -> Transfer:
        """Starts copying `host_slots` into `dev_slots`; the device slots hold the KV once it is done."""
        self._reap_writes()
        load = Transfer()
        if self.cuda:
            # The fresh device slots were last read (or written back) on the compute stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._load_now(host_slots, dev_slots, load)
                load.event = torch.cuda.Event()
                load.event.record(self.stream)
        else:
            self._load_now(host_slots, dev_slots, load)
        self.stats.hicache_loads_total += 1
        self.stats.hicache_host_hit_tokens_total += len(dev_slots)
        self.stats.hicache_bytes_to_device_total += len(dev_slots) * self.host.bytes_per_token
        return load

    def finished(self, load: Transfer) -> None:
        """Counts a load seen complete and lets its staging go."""
        self.stats.hicache_load_wait_s += time.perf_counter() - load.started
        load.keep.clear()

    def _load_now(self, host_slots: list[int], dev_slots: list[int], load: Transfer) -> None:
        staged = torch.empty((len(host_slots), *self.host.kv.shape[1:]), dtype=self.host.kv.dtype,
                             device=self.device)
        self._copy_runs(host_slots, staged, to_host=False)
        self.device_kv[:, :, self._index(dev_slots)] = staged.permute(1, 2, 0, 3, 4)
        load.keep.append(staged)

    def _copy_runs(self, host_slots: list[int], staged: torch.Tensor, to_host: bool) -> None:
        """One copy per run of consecutive host slots between host.kv and the token-major `staged`."""
        start = 0
        for end in range(1, len(host_slots) + 1):
            if end < len(host_slots) and host_slots[end] == host_slots[end - 1] + 1:
                continue
            first = host_slots[start]
            host = self.host.kv[first : first + end - start]
            if to_host:
                host.copy_(staged[start:end], non_blocking=True)
            else:
                staged[start:end].copy_(host, non_blocking=True)
            start = end

    def _index(self, slots: list[int]) -> torch.Tensor:
        host = torch.tensor(slots, dtype=torch.int64, pin_memory=self.cuda)
        return host.to(self.device, non_blocking=True)

    def _reap_writes(self) -> None:
        self._writes = [w for w in self._writes if not w.done()]

    def synchronize(self) -> None:
        """Waits for every copy in flight (before the host pool is reset or freed)."""
        if self.stream is not None:
            self.stream.synchronize()
        self._writes.clear()


def tier_stats(tier: HostTier | None, cached_tokens_total: int) -> dict[str, Any]:
    """The tier's counters and gauges for get_stats (zeros without a tier); device hits are the cached
    prompt tokens that did not come from the host."""
    counters = dataclasses.asdict(tier.stats if tier is not None else TierStats())
    host_hits = counters["hicache_host_hit_tokens_total"]
    counters["hicache_device_hit_tokens_total"] = max(cached_tokens_total - host_hits, 0)
    counters["hicache_slots_total"] = tier.host.num_slots if tier is not None else 0
    counters["hicache_slots_free"] = tier.allocator.available() if tier is not None else 0
    return counters
