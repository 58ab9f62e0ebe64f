"""The KV pool on the CPU: one lazily zeroed allocation, and its default size (model and machine)."""

from __future__ import annotations

import os

import pytest
import torch

from radixlm.core.runtime.execution import model_runner
from radixlm.core.runtime.memory.memory_pool import KVPool
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.models.config import ModelConfig


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_cpu_pool_is_zeroed_on_first_touch_and_costs_no_memory_until_then():
    layers, kv_heads, head_dim = 4, 2, 64
    slots = (1 << 30) // KVPool.bytes_per_token(layers, kv_heads, head_dim, torch.float32)  # a 1 GiB pool
    before = _rss_bytes()
    pool = KVPool(slots, layers, kv_heads, head_dim, torch.float32, "cpu")
    assert _rss_bytes() - before < 64 << 20
    assert len(pool.k_buffers) == len(pool.v_buffers) == layers
    assert pool.k_buffers[0].shape == (slots + 1, kv_heads, head_dim) and pool.k_buffers[0].is_contiguous()
    sample = torch.randint(0, slots + 1, (1000,))
    assert all(not buf[sample].any() for buf in pool.k_buffers + pool.v_buffers)
    pool.k_buffers[1][7] = 1.0  # layers and K/V are separate views: one write shows in one buffer only
    assert [bool(buf[7].any()) for buf in pool.k_buffers + pool.v_buffers] == [i == 1 for i in range(2 * layers)]


@pytest.fixture(scope="module")
def runner(llama_ckpt):
    opts = EngineOptions.from_kwargs({"device": "cpu"})
    return ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt), opts)


def _size(runner: ModelRunner, **options) -> int:
    return runner._kv_pool_size(EngineOptions.from_kwargs({"device": "cpu", **options}))


def test_cpu_default_pool_size(runner, monkeypatch):
    cfg = runner.cfg
    per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # The engine's own pool is the default size: for this tiny model the floor of 256 MiB exceeds what
    # max_running_requests (64 on CPU) full-context requests can use, so that bounds it.
    assert runner.num_slots == _size(runner) == 64 * cfg.context_len
    assert runner.kv_pool.k_buffers[0].shape[0] == runner.num_slots + 1
    assert _size(runner, max_running_requests=2) == 2 * cfg.context_len
    # Twice the weights' bytes, once the floor is out of the way ...
    monkeypatch.setattr(model_runner, "_CPU_KV_MIN_BYTES", 0)
    assert 256 < 2 * weights // per_token < 64 * cfg.context_len
    assert _size(runner) == 2 * weights // per_token
    # ... within a quarter of mem_fraction_static of the available RAM ...
    monkeypatch.setattr(model_runner, "host_available_bytes", lambda: 8 << 20)
    ram_bound = int((8 << 20) * 0.5 * 0.25 // per_token)
    assert 256 < ram_bound < 2 * weights // per_token
    assert _size(runner, mem_fraction_static=0.5) == ram_bound
    # ... and max_total_tokens overrides all of it.
    assert _size(runner, max_total_tokens=1000) == 1000
