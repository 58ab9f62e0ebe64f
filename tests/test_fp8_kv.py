"""An fp8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2) end to end on the CPU: the engine against HF
transformers whose attention reads its keys and values rounded the same way (the tight oracle) and against
plain HF (the loose one, the quantization's own error); the pool's capacity; the host tier's copies.

The kernels' own tests: tests/test_cpu_kernels.py and tests/test_kernels.py (their fp8 sections), and
benchmarks/gpu_check.py's fp8 step for the Triton path on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import radixlm
from radixlm.core.runtime.execution import model_runner
from radixlm.core.runtime.memory.hicache import HostKVPool, HostTier
from radixlm.core.runtime.memory.memory_pool import KVPool
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.kernels.reference import to_kv_dtype

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SHARED = "In a quiet village by the sea, the old lighthouse keeper told every visitor the same story: "
PROMPTS = [SHARED + "the storm", "Completely unrelated words", SHARED + "the ship that never came back"]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
# Max |logprob - plain HF's| over every prompt and output position of PROMPTS on the tiny checkpoint
# (measured 0.66 for e4m3 and 1.69 for e5m2, 2026-12-02): its random weights (initializer range 0.2)
# give large, sensitive logits, so fp8's 3 (e4m3) or 2 (e5m2) mantissa bits show; bounds at 1.5x.
PLAIN_HF_BOUND = {"fp8_e4m3": 1.0, "fp8_e5m2": 2.5}


def _hf_with_kv_rounded_to(path: str, fmt: str):
    """HF transformers whose attention reads keys and values as stored in an fp8 pool (saturated, rounded
    to nearest, upcast), registered as an attention implementation around HF's own SDPA one."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = FORMATS[fmt]

    def attention(module, query, key, value, *args, **kwargs):
        key, value = (to_kv_dtype(x, dtype).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(f"radixlm_{fmt}", attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=f"radixlm_{fmt}").eval()


@pytest.fixture(scope="module")
def plain_hf(llama_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()


@torch.no_grad()
def _logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_matches_hf_reading_the_same_fp8_kv(llama_ckpt, plain_hf, fmt):
    oracle = _hf_with_kv_rounded_to(llama_ckpt, fmt)
    with radixlm.Engine(llama_ckpt, kv_cache_dtype=fmt, chunked_prefill_size=16, debug_check_invariants=True) as engine:
        assert engine._runner.kv_pool.kv.dtype == FORMATS[fmt]
        engine.generate(PROMPTS[0], GREEDY)  # the shared prefix cached: the batch reads it from the fp8 pool
        outs = engine.generate(PROMPTS, GREEDY, return_logprob=True)
        assert engine.get_stats()["cached_tokens_total"] > 0
        # Prompt logprobs (every position recomputed), in a batch of its own.
        scored = engine.generate(PROMPTS, {**GREEDY, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
        tok = engine.tokenizer
    tight = loose = 0.0
    for prompt, out, prompt_scores in zip(PROMPTS, outs, scored):
        prompt_ids = tok(prompt)["input_ids"]
        ids = prompt_ids + out["output_ids"]
        want, plain = _logprobs(oracle, ids), _logprobs(plain_hf, ids)
        # Greedy: each output token is the oracle's argmax given the ones before (decode read the fp8 pool).
        assert out["output_ids"] == want[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        logprobs = prompt_scores["meta_info"]["input_token_logprobs"] + out["meta_info"]["output_token_logprobs"]
        assert len(logprobs) == len(ids)
        for pos, (lp, token, _) in enumerate(logprobs):
            if lp is not None:
                tight = max(tight, abs(lp - float(want[pos - 1, token])))
                loose = max(loose, abs(lp - float(plain[pos - 1, token])))
    assert tight < 1e-4  # measured 6e-6: fp32 rounding, not fp8's
    assert 0.05 < loose < PLAIN_HF_BOUND[fmt]  # the quantization shows, within its bound


def test_auto_is_the_model_dtype_and_bad_values_are_refused(llama_ckpt, monkeypatch):
    with radixlm.Engine(llama_ckpt, max_total_tokens=64) as engine:
        assert engine._runner.kv_pool.kv.dtype == torch.float32
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        EngineOptions.from_kwargs({"device": "cpu", "kv_cache_dtype": "fp8"})
    monkeypatch.delattr(torch, "float8_e5m2")  # a torch build without the dtype
    with pytest.raises(InvalidRequestError, match="has no torch.float8_e5m2"):
        _ = EngineOptions.from_kwargs({"device": "cpu", "kv_cache_dtype": "fp8_e5m2"}).torch_kv_dtype


def test_a_kernel_set_that_cannot_store_fp8_is_refused_at_start():
    class NoFp8:
        @staticmethod
        def store_kv(k_buffer, v_buffer, loc, k, v):
            k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))  # CPU torch has no fp8 index_copy_

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype torch.float8_e4m3fn is not supported on cpu"):
        KVPool.check_dtype(torch.float8_e4m3fn, "cpu", NoFp8, triton=False)
    KVPool.check_dtype(torch.bfloat16, "cpu", NoFp8, triton=False)  # wider dtypes are not probed


def test_fp8_doubles_the_pool_of_a_bf16_model(llama_ckpt, monkeypatch):
    """Same memory budget (twice the weights' bytes, the CPU default once its floor is out of the way),
    twice the token slots; the pool's tensor takes the same bytes."""
    monkeypatch.setattr(model_runner, "_CPU_KV_MIN_BYTES", 0)
    cfg = ModelConfig.from_dir(llama_ckpt)
    runners = {kv: ModelRunner(llama_ckpt, cfg, EngineOptions.from_kwargs(
        {"device": "cpu", "dtype": "bfloat16", "kv_cache_dtype": kv, "max_running_requests": 4096}))
        for kv in ("auto", "fp8_e4m3")}
    auto, fp8 = runners["auto"], runners["fp8_e4m3"]
    assert fp8._kv_bytes_per_token() * 2 == auto._kv_bytes_per_token()
    assert fp8.num_slots in (2 * auto.num_slots, 2 * auto.num_slots + 1)
    assert abs(fp8.kv_pool.kv.nbytes - auto.kv_pool.kv.nbytes) <= auto._kv_bytes_per_token()


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_tier_copies_fp8_kv_byte_for_byte(fmt):
    dtype = FORMATS[fmt]
    pool = KVPool(12, 2, 2, 8, dtype, "cpu")
    host = HostKVPool(6, pool, pin=False)
    assert host.kv.dtype == dtype and host.bytes_per_token == KVPool.bytes_per_token(2, 2, 8, dtype)
    tier = HostTier(pool, host)
    pool.kv.view(torch.uint8)[:, :, 1:].copy_(torch.randint(0, 256, pool.kv[:, :, 1:].shape, dtype=torch.uint8))
    before = pool.kv.view(torch.uint8).clone()
    tier.write([3, 7, 9], [2, 3, 5])  # two runs of host slots
    pool.kv.view(torch.uint8)[:, :, [3, 7, 9]] = 0
    tier.load([2, 3, 5], [10, 11, 12]).wait()
    assert torch.equal(pool.kv.view(torch.uint8)[:, :, [10, 11, 12]], before[:, :, [3, 7, 9]])


def test_engine_with_fp8_kv_and_the_host_tier(llama_ckpt):
    """Prefixes spilling to host memory and coming back: the same greedy tokens as without the tier."""
    users = [[(u * 37 + i * 11) % 200 + 3 for i in range(60)] for u in range(6)]
    rounds = [[h + [250 + r] * 4 for h in users] for r in range(2)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    results = {}
    for size_gb in (0.0, 0.001):
        with radixlm.Engine(llama_ckpt, kv_cache_dtype="fp8_e4m3", max_total_tokens=160, hicache_size_gb=size_gb,
                            debug_check_invariants=True) as engine:
            results[size_gb] = [o["output_ids"] for r in rounds for o in engine.generate(input_ids=r,
                                                                                         sampling_params=params)]
            hits = engine.get_stats()["hicache_host_hit_tokens_total"]
    assert hits > 0
    assert results[0.001] == results[0.0]


def test_overlap_scheduling_gives_the_same_tokens_on_an_fp8_pool(llama_ckpt):
    """The H200 benchmark runs fp8 with overlap on: the same greedy tokens as with it off."""
    outs = {}
    for overlap in (False, True):
        with radixlm.Engine(llama_ckpt, kv_cache_dtype="fp8_e4m3", enable_overlap_schedule=overlap,
                            max_total_tokens=256, debug_check_invariants=True) as engine:
            outs[overlap] = [o["output_ids"] for o in engine.generate(PROMPTS * 3, GREEDY)]
    assert outs[True] == outs[False]
