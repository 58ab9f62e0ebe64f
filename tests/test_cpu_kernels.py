"""The CPU kernel set's batched attention (radixlm.kernels.cpu) against the per-request references."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from paged_kv import PagedBatch, random_trees, tree_oracle

from radixlm.kernels import cpu, reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3 (SmolLM2's 9 / 3), 8; a head_dim not a power of 2.
GQA_SHAPES = [(2, 2, 64), (9, 3, 64), (8, 1, 40)]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
@pytest.mark.parametrize("case", [
    ([0, 21, 5], [20, 3, 17]),  # a fresh prompt, a short continuation, a continuation mid-sequence
    ([0, 4, 300, 90, 0], [250, 1, 1, 1, 2]),  # a long prefill beside ride-along decodes: several groups
], ids=["one-group", "groups"])
def test_extend_attention_matches_reference(case, heads, dtype):
    prefix_lens, extend_lens = case
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, dtype, torch.int32)
    q = torch.randn(sum(extend_lens), num_heads, head_dim).to(dtype)
    ext = torch.tensor(extend_lens, dtype=torch.int32)
    expected = reference.extend_attention(q, *batch.tables(), ext, head_dim**-0.5)
    _check(cpu.extend_attention(q, *batch.tables(), ext, head_dim**-0.5), expected)
    assert (len(cpu._groups(extend_lens, seq_lens)) > 1) == (max(seq_lens) > 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
@pytest.mark.parametrize("seq_lens", [
    [40, 1, 17, 0, 9000, 33],  # ragged, one context far longer (its own group), a padding row of length 0
    [37, 37, 37],  # equal lengths: one group, no mask
    [12],
], ids=["ragged", "equal", "one"])
def test_decode_attention_matches_reference(seq_lens, heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, dtype, torch.int64)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    expected = reference.decode_attention(q, *batch.tables(), 0.125)
    _check(cpu.decode_attention(q, *batch.tables(), 0.125), expected)
    plan = cpu.plan_attention(*batch.tables()[2:], None)
    assert (len(plan.groups) > 1) == (max(seq_lens) > 100)
    assert (plan.groups[0].mask is None) == (len(set(seq_lens)) == 1)


@pytest.mark.parametrize("heads", GQA_SHAPES, ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
@pytest.mark.parametrize("seed", range(3))
def test_tree_masked_extend_matches_the_oracle(heads, seed):
    """A verify step of draft trees: each row attends to its prefix and its ancestors only (an oracle
    gathering exactly those keys), in the reference and the CPU set, planned and not; a request of one
    token, one with no prefix, and one far longer than the others (a group of its own) among them."""
    rng = random.Random(seed)
    num_heads, num_kv_heads, head_dim = heads
    extend_lens = [rng.randint(2, 12), 1, 9, rng.randint(20, 64), 5]
    prefix_lens = [rng.randint(1, 30), 7, 0, 3, 300]
    trees = random_trees(extend_lens, rng)
    batch = PagedBatch([p + e for p, e in zip(prefix_lens, extend_lens)], num_kv_heads, head_dim, torch.float32,
                       torch.int64)
    q = torch.randn(sum(extend_lens), num_heads, head_dim)
    ext = torch.tensor(extend_lens)
    mask = torch.tensor([b for parents in trees for b in reference.ancestor_bits(parents)])
    expected = tree_oracle(q, batch, extend_lens, trees, 0.125).float()
    _check(reference.extend_attention(q, *batch.tables(), ext, 0.125, tree_mask=mask), expected)
    _check(cpu.extend_attention(q, *batch.tables(), ext, 0.125, tree_mask=mask), expected)
    plan = cpu.plan_attention(*batch.tables()[2:], ext, mask)
    assert len(plan.groups) > 1
    _check(cpu.extend_attention(q, *batch.tables(), ext, 0.125, plan), expected)


@pytest.mark.parametrize("ops", [reference, cpu], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_siblings_kv_never_reaches_a_row(ops):
    """Tree [0: root, 1 and 2 under it, 3 under 1, 4 under 2]: rewriting the keys and values of branch 2-4
    leaves rows 0, 1 and 3 exactly as they were (and changes rows 2 and 4: the rewrite is seen where due)."""
    parents, prefix = [-1, 0, 0, 1, 2], 6
    batch = PagedBatch([prefix + 5], 2, 16, torch.float32, torch.int32)
    q = torch.randn(5, 4, 16)
    args = (torch.tensor([5]), 0.25)
    mask = torch.tensor(reference.ancestor_bits(parents))
    before = ops.extend_attention(q, *batch.tables(), *args, tree_mask=mask)
    branch = batch.req_to_token[batch.req_pool_indices[0], [prefix + 2, prefix + 4]].long()
    batch.k_buffer[branch] = 50 * torch.randn(2, 2, 16)
    batch.v_buffer[branch] = 1e3
    after = ops.extend_attention(q, *batch.tables(), *args, tree_mask=mask)
    assert torch.equal(after[[0, 1, 3]], before[[0, 1, 3]])
    assert (after[[2, 4]] - before[[2, 4]]).abs().amax(dim=(1, 2)).min() > 1


def test_ancestor_bits_of_parent_lists():
    assert reference.ancestor_bits([-1, 0, 1, 2]) == [1, 3, 7, 15]  # a chain: causal
    assert reference.ancestor_bits([-1, 0, 0, 1, 2]) == [1, 3, 5, 11, 21]
    assert reference.ancestor_bits([-1] + list(range(63)))[-1] == -1  # 64 tokens: bit 63 is the sign
    for bad in ([0], [-1, 1], [-1] * 65):
        with pytest.raises(ValueError):
            reference.ancestor_bits(bad)


def test_padding_reads_only_slot_zero():
    """Keys past a request's length are read from slot 0 and masked: NaN in every slot no request holds
    (the pool is not zeroed beyond slot 0) leaves the output unchanged."""
    seq_lens, extend_lens = [30, 5, 12], [30, 2, 1]
    batch = PagedBatch(seq_lens, 2, 16, torch.float32, torch.int32)
    q = torch.randn(sum(extend_lens), 4, 16)
    ext = torch.tensor(extend_lens)
    expected = reference.extend_attention(q, *batch.tables(), ext, 0.25)
    held = torch.zeros(batch.k_buffer.shape[0], dtype=torch.bool)
    for row, n in zip(batch.req_pool_indices.tolist(), seq_lens):
        held[batch.req_to_token[row, :n].long()] = True
    held[0] = True
    batch.k_buffer[~held] = float("nan")
    batch.v_buffer[~held] = float("nan")
    _check(cpu.extend_attention(q, *batch.tables(), ext, 0.25), expected)
    _check(cpu.decode_attention(q[:3], *batch.tables(), 0.25),
           reference.decode_attention(q[:3], *batch.tables(), 0.25))


def test_groups_cover_every_request_once_and_bound_the_padding():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        ext = [rng.choice([1, 1, 1, rng.randint(1, 3000)]) for _ in range(n)]
        seq = [e + rng.choice([0, rng.randint(0, 5000)]) for e in ext]
        seq = [0 if rng.random() < 0.05 else s for s in seq]  # padding rows
        groups = cpu._groups(ext, seq)
        members = sorted(i for g in groups for i in g)
        assert members == [i for i in range(n) if seq[i] > 0]
        for g in groups:
            padded = len(g) * max(ext[i] for i in g) * max(seq[i] for i in g)
            assert padded <= 2 * sum(ext[i] * seq[i] for i in g) + cpu._PADDING_SLACK or len(g) == 1
    # Equal decodes of similar length batch as one; a far longer context goes alone.
    assert cpu._groups([1] * 16, [100 + i for i in range(16)]) == [list(range(15, -1, -1))]
    assert len(cpu._groups([1] * 17, [100] * 16 + [50_000])) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norms_and_rotary_match_reference(dtype):
    x, residual = torch.randn(5, 80).to(dtype), torch.randn(5, 80).to(dtype)
    weight = torch.randn(80).to(dtype)
    _check(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    out, summed = cpu.fused_add_rms_norm(x, residual, weight, 1e-5)
    exp_out, exp_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, exp_summed)
    _check(out, exp_out)
    # q and k as strided views of a fused QKV output, at shuffled positions.
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    angles = torch.rand(50, head_dim // 2, dtype=torch.float64) * 100
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    positions = torch.randperm(50)[:num_tokens]
    want = reference.apply_rotary(q, k, positions, cache)
    for got, expected in zip(cpu.apply_rotary(q, k, positions, cache), want):
        _check(got, expected)
    # With a plan, the first layer keeps the cos and sin rows and later layers rotate with them: a second
    # layer's q and k at the same positions, then another step's positions through a fresh plan.
    plan = cpu.AttentionPlan([])
    for got, expected in zip(cpu.apply_rotary(q, k, positions, cache, plan), want):
        _check(got, expected)
    assert plan.rotary is not None
    q2, k2 = q.flip(0), k.flip(0)
    for got, expected in zip(cpu.apply_rotary(q2, k2, positions, cache, plan),
                             reference.apply_rotary(q2, k2, positions, cache)):
        _check(got, expected)
    other = torch.randperm(50)[:num_tokens]
    for got, expected in zip(cpu.apply_rotary(q, k, other, cache, cpu.AttentionPlan([])),
                             reference.apply_rotary(q, k, other, cache)):
        _check(got, expected)


@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("src_dtype, pool_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=str)
def test_store_kv_matches_reference(src_dtype, pool_dtype, loc_dtype):
    qkv = torch.randn(5, 4 * 3 * 24).to(src_dtype)  # k and v as strided views of a fused QKV output
    k, v = qkv[:, 72:144].view(-1, 3, 24), qkv[:, 144:216].view(-1, 3, 24)
    loc = (torch.randperm(12)[:5] + 1).to(loc_dtype)
    k_buf, v_buf = torch.randn(13, 3, 24).to(pool_dtype), torch.randn(13, 3, 24).to(pool_dtype)
    k_exp, v_exp = k_buf.clone(), v_buf.clone()
    reference.store_kv(k_exp, v_exp, loc, k, v)
    cpu.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, k_exp) and torch.equal(v_buf, v_exp)


# ---- an fp8 KV pool (kv_cache_dtype fp8_e4m3 / fp8_e5m2) ----------------------------------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)  # CPU torch compares no fp8 tensors; their bytes it does


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_store_kv_into_fp8_saturates_and_matches_reference(pool_dtype, src_dtype):
    k, v = (torch.randn(6, 3, 24) * 4).to(src_dtype), torch.randn(6, 3, 24).to(src_dtype)
    big = 10 * torch.finfo(pool_dtype).max  # past the format: an unclamped cast gives NaN (e4m3fn) or inf
    k[0, 0, :2], v[1, 2, 3] = torch.tensor([big, -big]), -big
    loc = (torch.randperm(12)[:6] + 1).to(torch.int32)
    k_buf, v_buf = torch.randn(13, 3, 24).to(pool_dtype), torch.randn(13, 3, 24).to(pool_dtype)
    k_exp, v_exp = k_buf.clone(), v_buf.clone()
    reference.store_kv(k_exp, v_exp, loc, k, v)
    cpu.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(_bits(k_buf), _bits(k_exp)) and torch.equal(_bits(v_buf), _bits(v_exp))
    top = torch.finfo(pool_dtype).max
    slots = loc.long()
    assert k_buf[slots[0], 0, :2].float().tolist() == [top, -top] and v_buf[slots[1], 2, 3].float() == -top
    stored = torch.stack((k_buf[slots], v_buf[slots])).float()
    assert torch.isfinite(stored).all()
    # Round to nearest: within half a unit of the format's 3 (e4m3) or 2 (e5m2) mantissa bits, where not
    # clamped (or below the smallest normal, where the unit is fixed).
    mantissa = 3 if pool_dtype == torch.float8_e4m3fn else 2
    src = torch.stack((k, v)).float().clamp(-top, top)
    bound = src.abs() * 2.0 ** -(mantissa + 1) + torch.finfo(pool_dtype).smallest_normal * 2.0 ** -mantissa
    assert ((stored - src).abs() <= bound).all()


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_attention_reads_an_fp8_pool_like_the_reference(pool_dtype, q_dtype):
    """Both ops upcast the gathered fp8 keys and values to q's dtype; the references upcast to fp32."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    prefix_lens, extend_lens = [0, 4, 300, 90, 0], [250, 1, 1, 1, 2]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch = PagedBatch(seq_lens, num_kv_heads, head_dim, pool_dtype, torch.int32)
    q = torch.randn(sum(extend_lens), num_heads, head_dim).to(q_dtype)
    ext = torch.tensor(extend_lens, dtype=torch.int32)
    _check(cpu.extend_attention(q, *batch.tables(), ext, head_dim**-0.5),
           reference.extend_attention(q, *batch.tables(), ext, head_dim**-0.5))
    q = q[: len(seq_lens)]
    _check(cpu.decode_attention(q, *batch.tables(), 0.125), reference.decode_attention(q, *batch.tables(), 0.125))
