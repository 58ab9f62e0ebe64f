"""Every Triton kernel against its pure-torch twin (radixlm.kernels.reference).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here if the environment
did not); on a GPU machine the same tests run them natively. The interpreter runs every program in
Python, so shapes are tiny but chosen to cross block edges: the CPU launch shapes use 16-row query
blocks and 16-key steps. Notes on the interpreter: it cannot run a bfloat16 `tl.dot` (it multiplies
the raw bit patterns, triton-lang/triton#11584), so the attention kernels are checked here in fp32
and fp16, and in bf16 by benchmarks/gpu_check_kernels.py on the GPU.
"""

from __future__ import annotations

import inspect
import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import random  # noqa: E402

from paged_kv import PagedBatch, random_trees, tree_oracle  # noqa: E402

from radixlm.kernels import registry as kernels  # noqa: E402
from radixlm.core.runtime.layers.attention_backend import AttentionBackend  # noqa: E402
from radixlm.core.runtime.layers.forward_batch import ForwardBatch  # noqa: E402
from radixlm.core.runtime.models.config import ModelConfig  # noqa: E402
from radixlm.kernels import cpu as cpu_ops  # noqa: E402
from radixlm.kernels import reference as ref  # noqa: E402
from radixlm.kernels import triton as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh inputs per test, reproducible per test id.
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_same_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-equal, except bf16 under the interpreter, whose fp32 -> bf16 cast truncates where the GPU and
    torch round to nearest even: there, one bf16 ulp."""
    if expected.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(actual, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


# ----------------------------------------------------------------------------------- attention

# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 4, 8; one head_dim not a power of two.
GQA_SHAPES = [(2, 2, 64), (4, 1, 64), (8, 1, 40)]


def extend_case(heads: tuple[int, int, int], prefix_lens: list[int], extend_lens: list[int]):
    """A ragged fp32 extend batch: its paged tables, q, the extend lengths, the scale, the reference output."""
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float32, torch.int32, DEVICE)
    q = randn(sum(extend_lens), num_heads, head_dim)
    ext = torch.tensor(extend_lens, device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    return batch, q, ext, scale, ref.extend_attention(q, *batch.tables(), ext, scale)


@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_extend_attention_fp32(heads):
    # Ragged: no prefix and 2 query blocks; a prefix spanning 2 key blocks; a prefix ending mid-block.
    batch, q, ext, scale, expected = extend_case(heads, [0, 21, 5], [20, 3, 17])
    assert_close(tri.extend_attention(q, *batch.tables(), ext, scale), expected)


def test_extend_attention_fp16_int64_strided_q_and_precomputed_starts():
    num_heads, num_kv_heads, head_dim = 4, 1, 64
    prefix_lens, extend_lens = [16, 0], [18, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float16, torch.int64, DEVICE)
    # q sliced out of a fused QKV projection output, as the model produces it.
    qkv = randn(sum(extend_lens), (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float16)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    ext = torch.tensor(extend_lens, device=DEVICE, dtype=torch.int64)
    starts = torch.tensor([0, extend_lens[0]], device=DEVICE, dtype=torch.int64)
    expected = ref.extend_attention(q, *batch.tables(), ext, 0.125)
    out = tri.extend_attention(q, *batch.tables(), ext, 0.125, extend_start_loc=starts, max_extend_len=18)
    assert_close(out, expected)


@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_extend_attention_reads_the_new_tokens_packed(heads):
    """With new_kv the new tokens' keys and values come from the packed tensors, not their pool slots:
    the slots hold garbage here, and the output still equals the reference over the right values."""
    num_heads, num_kv_heads, head_dim = heads
    prefix_lens, extend_lens = [0, 21, 5], [20, 3, 17]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float32, torch.int32, DEVICE)
    k_buf, v_buf, req_to_token, rows, seqs = batch.tables()
    q = randn(sum(extend_lens), num_heads, head_dim)
    ext = torch.tensor(extend_lens, device=DEVICE, dtype=torch.int32)
    new_slots = torch.cat([req_to_token[r, p:p + e].long() for r, p, e in zip(rows.tolist(), prefix_lens, extend_lens)])
    # Strided, as the rotary's k and the projection's v are.
    kv = randn(len(new_slots), 2, num_kv_heads, head_dim)
    k_new, v_new = kv[:, 0], kv[:, 1]
    k_buf[new_slots], v_buf[new_slots] = k_new, v_new
    expected = ref.extend_attention(q, k_buf, v_buf, req_to_token, rows, seqs, ext, 0.125)
    k_buf[new_slots], v_buf[new_slots] = float("nan"), float("nan")
    out = tri.extend_attention(q, k_buf, v_buf, req_to_token, rows, seqs, ext, 0.125, new_kv=(k_new, v_new))
    assert_close(out, expected)


@pytest.mark.parametrize("heads,packed", [(GQA_SHAPES[0], False), (GQA_SHAPES[1], True), (GQA_SHAPES[2], False)],
                         ids=lambda v: f"H{v[0]}-KH{v[1]}-D{v[2]}" if isinstance(v, tuple) else ("new-kv" if v else "pool"))
def test_extend_attention_tree_mask(heads, packed):
    """Draft trees (random parents; once 64 tokens, the most a mask holds, across 4 query blocks): each row
    sees its prefix and its ancestors only, against an oracle gathering exactly those keys, the new
    tokens' keys read through the pool or packed; `split_short` is ignored for trees (every row goes
    through the masked extend kernel)."""
    rng = random.Random(sum(heads) + packed)
    extend_lens = [7, 1, 64 if packed else 24, 20]
    prefix_lens = [5, 9, 17, 0]
    batch = PagedBatch([p + e for p, e in zip(prefix_lens, extend_lens)], heads[1], heads[2], torch.float32,
                       torch.int32, DEVICE)
    trees = random_trees(extend_lens, rng)
    q = randn(sum(extend_lens), heads[0], heads[2])
    ext = torch.tensor(extend_lens, device=DEVICE)
    mask = torch.tensor([b for parents in trees for b in ref.ancestor_bits(parents)], device=DEVICE)
    expected = tree_oracle(q, batch, extend_lens, trees, 0.125).float().to(DEVICE)
    k_buf, v_buf, req_to_token, rows, seqs = batch.tables()
    extra = {}
    if packed:
        new = torch.cat([req_to_token[r, p:p + e].long() for r, p, e in zip(rows.tolist(), prefix_lens, extend_lens)])
        extra["new_kv"] = (k_buf[new].clone(), v_buf[new].clone())
    out = tri.extend_attention(q, *batch.tables(), ext, 0.125, tree_mask=mask, split_short=True, **extra)
    assert_close(out, expected)


@pytest.mark.parametrize("splits", [3, 1, None], ids=["3-splits", "direct", "default"])
@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_extend_attention_short_extends_through_the_split_kernel(heads, splits):
    """split_short: requests with at most SHORT_EXTEND_TOKENS new tokens through the split kernel (causal
    among their new tokens, the keys split across programs), the longer ones through the extend kernel
    skipping the short ones; together the reference's output. Prefixes of 0 (the new tokens' keys only),
    1, one mid-block and ones spanning several key blocks; a padding request (no tokens) last."""
    short = tri.SHORT_EXTEND_TOKENS
    extend_lens = [1, short, short + 1, 1, 3, 17, 2, 0]
    batch, q, ext, scale, expected = extend_case(heads, [30, 0, 21, 1, 16, 5, 40, 0], extend_lens)
    if splits is None:
        out = tri.extend_attention(q, *batch.tables(), ext, scale, split_short=True)
        assert_close(out, expected)
        return
    # The split kernel alone, with a given number of splits: the short requests' rows, the others untouched.
    starts = torch.cumsum(ext, 0) - ext
    out = torch.full_like(q, float("nan"))
    k_buf, v_buf, req_to_token, rows, seqs = batch.tables()
    tri.attention._split_attention(q, k_buf, v_buf, out, req_to_token, rows, seqs, scale, splits, short, ext, starts)
    is_short = torch.tensor([e <= short for e in extend_lens for _ in range(e)], device=DEVICE)
    assert_close(out[is_short], expected[is_short])
    assert out[~is_short].isnan().all()


@pytest.mark.parametrize("splits", [3, 1], ids=["3-splits", "direct"])
@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_decode_attention_split_kv_fp32(heads, splits):
    num_heads, num_kv_heads, head_dim = heads
    # 3 splits: length 40 spans all three (16 + 16 + 8 keys); 17 leaves the third empty; 1 and 0 leave
    # two or three empty (0 is a padding row: the reference gives zeros). One split: the split kernel
    # writes the output itself (no reduce launch).
    seq_lens = [40, 1, 17, 0]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float32, torch.int32, DEVICE)
    q = randn(len(seq_lens), num_heads, head_dim)
    expected = ref.decode_attention(q, *batch.tables(), head_dim**-0.5)
    assert_close(tri.decode_attention(q, *batch.tables(), head_dim**-0.5, num_kv_splits=splits), expected)


@pytest.mark.parametrize("splits", [3, 1, None], ids=["3-splits", "direct", "default"])
@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_decode_rows_of_an_extend_are_its_causal_attention(heads, splits):
    """Verify steps replay the decode graphs with one decode row per new token (cuda_graph_runner.
    as_decode_rows): rows sharing their request's table row, row j's length its prefix + j + 1. The
    decode kernel over them must equal the extend's causal attention: 8 drafts after a prefix spanning
    key blocks, a ride-along decode, a draft of 2 with no prefix."""
    prefix_lens, extend_lens = [37, 5, 0], [9, 1, 3]
    batch, q, ext, scale, expected = extend_case(heads, prefix_lens, extend_lens)
    k_buf, v_buf, req_to_token, rows, _ = batch.tables()
    row_of = rows.repeat_interleave(ext.to(rows.device).long())
    lens = torch.tensor([p + j + 1 for p, e in zip(prefix_lens, extend_lens) for j in range(e)], device=DEVICE,
                        dtype=rows.dtype)
    out = tri.decode_attention(q, k_buf, v_buf, req_to_token, row_of, lens, scale, num_kv_splits=splits)
    assert_close(out, expected)


def test_decode_attention_fp16_int64_default_splits():
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    seq_lens = [33, 7]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float16, torch.int64, DEVICE)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=torch.float16)
    expected = ref.decode_attention(q, *batch.tables(), 0.125)
    assert_close(tri.decode_attention(q, *batch.tables(), 0.125), expected)


# ------------------------------------------------------------------------------- element-wise

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize(
    "src_dtype, pool_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=str,
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_store_kv_writes_only_its_slots(src_dtype, pool_dtype, index_dtype):
    num_tokens, num_kv_heads, head_dim = 5, 3, 24
    # k and v as strided views of a fused QKV output.
    qkv = randn(num_tokens, 4 * num_kv_heads * head_dim, dtype=src_dtype)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(-1, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(-1, num_kv_heads, head_dim)
    loc = (torch.randperm(12)[:num_tokens] + 1).to(DEVICE, index_dtype)
    k_buf = randn(13, num_kv_heads, head_dim, dtype=pool_dtype)
    v_buf = randn(13, num_kv_heads, head_dim, dtype=pool_dtype)
    k_exp, v_exp = k_buf.clone(), v_buf.clone()
    ref.store_kv(k_exp, v_exp, loc, k, v)
    tri.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, k_exp) and torch.equal(v_buf, v_exp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype):
    x = randn(2, 3, 48, dtype=dtype)  # 48: not a power of two
    weight = randn(48)
    assert_close(tri.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(dtype):
    x, residual = randn(5, 80, dtype=dtype), randn(5, 80, dtype=dtype)
    weight = randn(80, dtype=dtype)
    out, summed = tri.fused_add_rms_norm(x, residual, weight, 1e-5)
    exp_out, exp_summed = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_same_rounding(summed, exp_summed)
    assert_close(out, exp_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    gate_up = randn(2, 3, 2 * 40, dtype=dtype) * 3
    assert_close(tri.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_strided_qk_shuffled_positions(dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, max_pos = 6, 4, 2, 32, 50
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    # Any angles at all: the kernel only reads the precomputed cache (llama3 scaling is in the angles).
    angles = torch.rand(max_pos, head_dim // 2, device=DEVICE, dtype=torch.float64) * 100
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    positions = torch.randperm(max_pos)[:num_tokens].to(DEVICE)
    q_out, k_out = tri.apply_rotary(q, k, positions, cache)
    q_exp, k_exp = ref.apply_rotary(q, k, positions, cache)
    assert_close(q_out, q_exp)
    assert_close(k_out, k_exp)


def rope_cache(scaling: str, head_dim: int, max_pos: int) -> torch.Tensor:
    """The model runner's own cos/sin cache (ModelConfig.rope_cos_sin_cache) for a rope variant the models use."""
    rope_scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        # A GGUF's rope_freqs tensor (Llama 3.1 GGUFs): one divisor per frequency.
        "freq_factors": {"rope_type": "freq_factors", "factors": [1.0 + i for i in range(head_dim // 2)]},
    }[scaling]
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=500000.0,
        rope_scaling=rope_scaling, max_position_embeddings=max_pos, tie_word_embeddings=False, qkv_bias=False,
        context_len=max_pos, bos_token_id=None, eos_token_ids=[],
    )
    return cfg.rope_cos_sin_cache(DEVICE)


# (num_heads, num_kv_heads, head_dim): GQA 2 and 4, odd head counts, a head_dim whose half is not a power of two.
ROTARY_SHAPES = [(4, 2, 32), (3, 3, 24), (5, 1, 40)]


@pytest.mark.parametrize("heads", ROTARY_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
@pytest.mark.parametrize(
    "dtype, pool_dtype, index_dtype, scaling",
    [
        (torch.float32, torch.float32, torch.int32, "default"),
        (torch.bfloat16, torch.bfloat16, torch.int64, "llama3"),
        (torch.float16, torch.float16, torch.int32, "freq_factors"),
        (torch.float32, torch.float16, torch.int64, "linear"),  # a pool of another dtype than the model's
    ],
    ids=str,
)
def test_apply_rotary_store_kv_matches_the_unfused_pair(heads, dtype, pool_dtype, index_dtype, scaling):
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, max_pos, num_slots = 5, 64, 12
    # q, k, v as strided views of a fused QKV output, positions in any order (a mixed batch).
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    positions = torch.randperm(max_pos)[:num_tokens].to(DEVICE)
    cache = rope_cache(scaling, head_dim, max_pos)
    loc = (torch.randperm(num_slots - 1)[:num_tokens] + 1).to(DEVICE, index_dtype)
    k_buf = randn(num_slots, num_kv_heads, head_dim, dtype=pool_dtype)
    v_buf = randn(num_slots, num_kv_heads, head_dim, dtype=pool_dtype)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    k_ref, v_ref, k_pair, v_pair = k_buf.clone(), v_buf.clone(), k_buf.clone(), v_buf.clone()

    k_out, k_out_ref = torch.empty_like(k), torch.empty_like(k)
    q_out = tri.apply_rotary_store_kv(q, k, v, positions, cache, k_buf, v_buf, loc, k_out)
    q_ref = ref.apply_rotary_store_kv(q, k, v, positions, cache, k_ref, v_ref, loc, k_out_ref)
    q_pair, k_rot = tri.apply_rotary(q, k, positions, cache)
    tri.store_kv(k_pair, v_pair, loc, k_rot, v)

    # The fused kernel is the unfused pair, bit for bit; both are the reference within rounding.
    assert torch.equal(q_out, q_pair) and torch.equal(k_buf, k_pair) and torch.equal(v_buf, v_pair)
    assert torch.equal(k_out, k_rot) and torch.equal(tri.apply_rotary_store_kv(q, k, v, positions, cache, k_buf,
                                                                               v_buf, loc), q_out)
    assert_close(k_out, k_out_ref)
    assert_close(q_out, q_ref)
    assert_close(k_buf, k_ref)
    assert torch.equal(v_buf, v_ref)
    slots = loc.long()
    assert torch.equal(v_buf[slots], v.to(pool_dtype))
    assert not torch.equal(k_buf[slots], k.to(pool_dtype))  # the stored keys are the rotated ones
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_buf[untouched], k_before[untouched]) and torch.equal(v_buf[untouched], v_before[untouched])


# ----------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_token_bitmask(dtype):
    vocab = 4100  # crosses a 4096-token block; not a multiple of 32
    allowed = torch.rand(3, vocab, device=DEVICE) < 0.3
    allowed[1] = True
    allowed[2, -31:] = True  # sets the sign bit of the last words
    bitmask = ref.pack_token_mask(allowed)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (3, (vocab + 31) // 32)
    logits = randn(3, vocab, dtype=dtype)
    expected = logits.masked_fill(~allowed, float("-inf"))  # the bool mask itself is the oracle
    ref_logits = logits.clone()
    ref.apply_token_bitmask(ref_logits, bitmask)
    tri.apply_token_bitmask(logits, bitmask)
    assert torch.equal(ref_logits, expected)
    assert torch.equal(logits, expected)


def test_seeded_exponential():
    keys = torch.tensor([0, 1, 12345, (1 << 32) - 1, 987654321], dtype=torch.int64, device=DEVICE)
    vocab = 5000  # crosses the 2048-token blocks
    want = ref.seeded_exponential(keys, vocab)
    got = tri.seeded_exponential(keys, vocab)
    assert got.shape == want.shape == (5, vocab) and bool((want > 0).all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # Exp(1): mean 1, P(E > 1) = 1/e; independent of the key's neighbours
    assert abs(float(want.mean()) - 1.0) < 0.02
    assert abs(float((want > 1).float().mean()) - 0.3679) < 0.01
    assert float(torch.corrcoef(want[1:3])[0, 1]).__abs__() < 0.05


# ----------------------------------------------------------------------------------- dispatch

def test_every_set_exposes_every_op_with_the_reference_signature():
    for name in kernels.OP_NAMES + kernels.OPTIONAL_OP_NAMES:
        ref_params = inspect.signature(getattr(ref, name)).parameters
        for ops in (tri, cpu_ops):
            if name in kernels.OPTIONAL_OP_NAMES and not hasattr(ops, name):
                continue
            # The other sets may only append optional parameters; the reference's keyword-only ones they
            # take too (anywhere among their keywords).
            params = inspect.signature(getattr(ops, name)).parameters
            positional = [p for p in ref_params if ref_params[p].kind != inspect.Parameter.KEYWORD_ONLY]
            assert list(params)[: len(positional)] == positional, (ops.__name__, name)
            assert set(ref_params) <= set(params), (ops.__name__, name)
            for extra in list(params)[len(positional):]:
                assert params[extra].default is not inspect.Parameter.empty, (ops.__name__, name)


def test_get_ops_dispatch(monkeypatch):
    assert kernels.get_ops("cpu") is cpu_ops
    monkeypatch.setenv("RADIXLM_DISABLE_TRITON", "1")
    assert kernels.get_ops("cuda") is cpu_ops
    monkeypatch.delenv("RADIXLM_DISABLE_TRITON")
    assert kernels.get_ops("cuda") is (tri if torch.cuda.is_available() else cpu_ops)


@pytest.mark.parametrize("shape", ["decode", "extend", "jump step"])
def test_attention_backend_fused_rotary_store_equals_the_composed_ops(shape, monkeypatch):
    """The backend over the Triton set (rotary + KV store in one launch) against the backend over the CPU
    set (apply_rotary, then store_kv): the same attention output and the same pool. The jump step (a few
    new tokens a request on average, one request with more) takes the split kernel for its short ones."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    is_decode = shape == "decode"
    seq_lens, extend_lens = {"decode": ([9, 4], [1, 1]), "extend": ([9, 14], [5, 12]),
                             "jump step": ([12, 9, 4], [1, 6, 1])}[shape]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, torch.float32, torch.int32, DEVICE)
    rows = batch.req_to_token[batch.req_pool_indices.long()]
    positions = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)]).to(DEVICE)
    loc = torch.cat([rows[b, s - e : s] for b, (s, e) in enumerate(zip(seq_lens, extend_lens))])
    num_tokens = sum(extend_lens)
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    fused_calls = []
    fused = tri.apply_rotary_store_kv
    monkeypatch.setattr(tri, "apply_rotary_store_kv", lambda *args: fused_calls.append(1) or fused(*args))
    split_calls = []
    split = tri.attention._split_attention
    monkeypatch.setattr(tri.attention, "_split_attention", lambda *args: split_calls.append(args[9]) or split(*args))
    results = []
    for ops in (tri, cpu_ops):
        pool = type("Pool", (), {"k_buffers": [batch.k_buffer.clone()], "v_buffers": [batch.v_buffer.clone()]})()
        backend = AttentionBackend(ops)
        fb = ForwardBatch(
            is_decode=is_decode, input_ids=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
            positions=positions, out_cache_loc=loc, req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, extend_lens=torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE),
            req_to_token=batch.req_to_token, kv_pool=pool, attn_backend=backend,
            cos_sin_cache=rope_cache("llama3", head_dim, 16),
        )
        results.append((backend.forward(q, k, v, 0, fb), pool.k_buffers[0], pool.v_buffers[0]))
    (out, k_buf, v_buf), (cpu_out, cpu_k, cpu_v) = results
    assert fused_calls == [1]  # the Triton set took the one-launch path
    assert split_calls == {"decode": [1], "extend": [], "jump step": [tri.SHORT_EXTEND_TOKENS]}[shape]
    monkeypatch.setenv("RADIXLM_UNFUSED_ROTARY_STORE", "1")  # the benchmarks' ablation: the unfused pair
    pool = type("Pool", (), {"k_buffers": [batch.k_buffer.clone()], "v_buffers": [batch.v_buffer.clone()]})()
    fb.kv_pool, fb.attn_backend = pool, AttentionBackend(tri)
    torch.testing.assert_close(fb.attn_backend.forward(q, k, v, 0, fb), out, atol=0, rtol=0)
    assert fused_calls == [1] and torch.equal(pool.k_buffers[0], k_buf)
    assert_close(out, cpu_out)
    assert_close(k_buf, cpu_k)
    assert torch.equal(v_buf, cpu_v)


# ----------------------------------------------------------------------------- an fp8 KV pool

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Triton's interpreter rounds fp32 -> fp8 wrongly (ties away from zero, a carry into the exponent lost:
# triton-lang/triton#8322), so there the stores are checked on values fp8 holds exactly (no rounding)
# and on out-of-range ones (saturation); on a GPU also on arbitrary values (benchmarks/gpu_check.py's
# fp8 step runs them at real sizes).
INTERPRETED = DEVICE == "cpu"


def fp8_inputs(shape: tuple[int, ...], pool_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Random values, on the fp8 grid under the interpreter, with two past the format's range."""
    x = randn(*shape) * 8
    if INTERPRETED:
        x = x.to(pool_dtype).float()
    x.view(-1)[:2] = torch.tensor([1e5, -1e5])
    return x.to(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_store_kv_into_fp8_matches_the_reference_bit_for_bit(pool_dtype, src_dtype):
    num_tokens, num_kv_heads, head_dim = 5, 3, 24
    kv = fp8_inputs((num_tokens, 2, num_kv_heads, head_dim), pool_dtype, src_dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided, as out of a fused projection
    loc = (torch.randperm(12)[:num_tokens] + 1).to(DEVICE, torch.int32)
    k_buf, v_buf = randn(13, num_kv_heads, head_dim, dtype=pool_dtype), randn(13, num_kv_heads, head_dim, dtype=pool_dtype)
    k_exp, v_exp = k_buf.clone(), v_buf.clone()
    ref.store_kv(k_exp, v_exp, loc, k, v)
    tri.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(bits(k_buf), bits(k_exp)) and torch.equal(bits(v_buf), bits(v_exp))
    assert k_buf[loc[0].long(), 0, :2].float().tolist() == [torch.finfo(pool_dtype).max, -torch.finfo(pool_dtype).max]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's fp32 -> fp8 rounding (triton-lang/triton#8322)")
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_apply_rotary_store_kv_into_fp8_matches_the_reference(pool_dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, max_pos = 7, 8, 2, 64, 64
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16) * 8
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    positions = torch.randperm(max_pos)[:num_tokens].to(DEVICE)
    cache = rope_cache("llama3", head_dim, max_pos)
    loc = (torch.randperm(11)[:num_tokens] + 1).to(DEVICE, torch.int32)
    k_buf, v_buf = randn(12, num_kv_heads, head_dim, dtype=pool_dtype), randn(12, num_kv_heads, head_dim, dtype=pool_dtype)
    k_ref, v_ref, k_pair, v_pair = k_buf.clone(), v_buf.clone(), k_buf.clone(), v_buf.clone()
    q_out = tri.apply_rotary_store_kv(q, k, v, positions, cache, k_buf, v_buf, loc)
    ref.apply_rotary_store_kv(q, k, v, positions, cache, k_ref, v_ref, loc)
    tri.store_kv(k_pair, v_pair, loc, tri.apply_rotary(q, k, positions, cache)[1], v)
    assert torch.equal(bits(k_buf), bits(k_pair)) and torch.equal(bits(v_buf), bits(v_pair))
    assert torch.equal(bits(v_buf), bits(v_ref))
    # The rotated keys round to bf16 and then to fp8 on both sides; the fp32 rotation itself may differ
    # in its last bit (FMA), which can move a key by one fp8 unit.
    mantissa = 3 if pool_dtype == torch.float8_e4m3fn else 2
    torch.testing.assert_close(k_buf.float(), k_ref.float(), rtol=2.0**-mantissa, atol=1e-3)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_attention_over_an_fp8_pool_matches_the_reference(pool_dtype, q_dtype):
    """The kernels upcast each loaded block of fp8 keys and values to q's dtype (fp16 for bf16 q); the references read the
    same fp8 pool (upcast to fp32). (bf16 q: the interpreter has no bf16 tl.dot; gpu_check runs it.)"""
    num_heads, num_kv_heads, head_dim = 4, 1, 64
    prefix_lens, extend_lens = [0, 21, 5], [20, 3, 17]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, pool_dtype, torch.int32, DEVICE)
    q = randn(sum(extend_lens), num_heads, head_dim, dtype=q_dtype)
    ext = torch.tensor(extend_lens, device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    assert_close(tri.extend_attention(q, *batch.tables(), ext, scale),
                 ref.extend_attention(q, *batch.tables(), ext, scale))
    decode = PagedBatch([40, 1, 17, 0], num_kv_heads, head_dim, pool_dtype, torch.int32, DEVICE)
    q = q[:4]
    assert_close(tri.decode_attention(q, *decode.tables(), scale, num_kv_splits=3),
                 ref.decode_attention(q, *decode.tables(), scale))
