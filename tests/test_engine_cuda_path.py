"""The CPU-checkable pieces of the CUDA path: batched request-to-token writes, the padded static-buffer
decode that CUDA graphs replay, the vectorized sampler, lazy detokenization and random ("dummy") weights.
"""

from __future__ import annotations

import random

import pytest
import torch

import radixlm
from radixlm.core.runtime.execution.cuda_graph_runner import (DECODE_ROWS_MAX_EXTEND, DecodeGraphRunner,
                                                              ExtendGraphRunner, as_decode_rows, batch_size_ladder,
                                                              extend_buckets)
from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.core.runtime.memory.memory_pool import ReqToTokenPool
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.hidden_export import HiddenExport
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.messages import GenerateRequest
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.execution.sampler import Sampler, chunked_argmax
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.runtime.models.config import ModelConfig


# ---- request-to-token table ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_batched_table_writes_match_sequential_assignment(seed):
    rng = random.Random(seed)
    rows, width = 6, 40
    pool = ReqToTokenPool(rows, width, "cpu")
    expected = torch.zeros(rows + 1, width, dtype=torch.int32)
    for _ in range(60):
        row = rng.randrange(rows)
        start = rng.randrange(width)
        slots = [rng.randrange(1, 10_000) for _ in range(rng.randrange(0, width - start + 1))]
        pool.write(row, start, slots)  # rewrites of a queued row must land in order
        expected[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32)
        if rng.random() < 0.2:
            pool.flush()
    pool.flush()
    assert torch.equal(pool.table, expected)
    assert pool.padding_row == rows and pool.available() == rows  # the padding row is never handed out


# ---- the padded decode path of the CUDA graphs --------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(llama_ckpt):
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 512, "max_running_requests": 8})
    return ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt), opts)


def test_padded_static_decode_matches_eager(runner):
    """n=5 requests run as a padded batch of 8 on the static buffers: same logits as the eager step,
    and the padding rows write only the reserved KV slot 0 and the table's padding row."""
    gen = torch.Generator().manual_seed(0)
    lens = [3, 9, 1, 14, 6]
    rows = [4, 0, 7, 2, 5]
    slot_iter = iter(torch.randperm(300, generator=gen)[: sum(lens) + len(lens)].add(1).tolist())
    prefill = BatchInput(False, [], [], [], rows, lens, lens, [])
    for row, n in zip(rows, lens):
        slots = [next(slot_iter) for _ in range(n)]
        runner.req_to_token.write(row, 0, slots)
        prefill.input_ids += torch.randint(0, 900, (n,), generator=gen).tolist()
        prefill.positions += list(range(n))
        prefill.out_cache_loc += slots
    runner.forward(prefill)
    decode = BatchInput(True, torch.randint(0, 900, (5,), generator=gen).tolist(), list(lens),
                        [next(slot_iter) for _ in lens], rows, [n + 1 for n in lens], [1] * 5, list(range(5)))
    eager = runner.forward(decode).clone()
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    table_before = runner.req_to_token.table.clone()

    graphs = DecodeGraphRunner(runner, max_bs=16, capture=False)
    assert graphs.sizes == [1, 2, 3, 4, 8, 16]
    padded = graphs.run(decode)
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    new_slots = torch.tensor(decode.out_cache_loc)
    others = torch.ones(runner.kv_pool.k_buffers[0].shape[0], dtype=torch.bool)
    others[0] = others[new_slots] = False
    for before, after in zip(k_before, runner.kv_pool.k_buffers):
        assert torch.equal(before[others], after[others])  # no other slot is touched
        torch.testing.assert_close(after[new_slots], before[new_slots])  # the new tokens' KV, recomputed
    changed = (runner.req_to_token.table != table_before).nonzero().tolist()
    assert all(r == runner.req_to_token.padding_row for r, _ in changed)
    # the decode step recorded each new slot in the table
    for row, pos, slot in zip(rows, lens, decode.out_cache_loc):
        assert int(runner.req_to_token.table[row, pos]) == slot


def _extend_batch(runner, gen, rows, prefix_lens, new_lens, slot_iter, logits_at_last=True):
    """An extend over requests whose prefixes already have KV (written by an eager prefill first)."""
    if any(prefix_lens):
        pre = BatchInput(False, [], [], [], [], [], [], [])
        for row, p in zip(rows, prefix_lens):
            if p:
                slots = [next(slot_iter) for _ in range(p)]
                runner.req_to_token.write(row, 0, slots)
                pre.input_ids += torch.randint(0, 900, (p,), generator=gen).tolist()
                pre.positions += list(range(p))
                pre.out_cache_loc += slots
                pre.rows.append(row)
                pre.seq_lens.append(p)
                pre.extend_lens.append(p)
        runner.forward(pre)
    batch = BatchInput(False, [], [], [], list(rows), [], list(new_lens), [])
    for row, p, n in zip(rows, prefix_lens, new_lens):
        slots = [next(slot_iter) for _ in range(n)]
        runner.req_to_token.write(row, p, slots)
        batch.input_ids += torch.randint(0, 900, (n,), generator=gen).tolist()
        batch.positions += list(range(p, p + n))
        batch.out_cache_loc += slots
        batch.seq_lens.append(p + n)
        if logits_at_last:
            batch.logit_rows.append(len(batch.input_ids) - 1)
    return batch


@pytest.mark.parametrize("case", [
    ([0, 5, 2], [4, 1, 9]),  # a fresh prompt, a one-token ride-along, a continuation: 14 tokens, 3 requests
    ([7], [1]),
    ([3, 0, 6, 1, 2], [1, 1, 1, 12, 1]),
])
def test_padded_static_extend_matches_eager(runner, case):
    """Extends run on the padded static buffers of the extend graphs give the eager step's logits, and
    the padding touches nothing but KV slot 0."""
    prefix_lens, new_lens = case
    gen = torch.Generator().manual_seed(sum(new_lens))
    rows = [6, 1, 3, 0, 5][: len(new_lens)]
    slot_iter = iter(torch.randperm(400, generator=gen)[:120].add(1).tolist())
    batch = _extend_batch(runner, gen, rows, prefix_lens, new_lens, slot_iter)
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    eager = runner.forward(batch).clone()
    k_eager = [k.clone() for k in runner.kv_pool.k_buffers]
    for k, before in zip(runner.kv_pool.k_buffers, k_before):
        k.copy_(before)
    graphs = ExtendGraphRunner(runner, max_bs=8, max_tokens=64, capture=False)
    key = graphs.bucket_for(batch)
    assert key is not None and key[0] >= len(rows) and key[1] >= len(batch.input_ids)
    padded = graphs.run(batch, key)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    for after, want in zip(runner.kv_pool.k_buffers, k_eager):
        torch.testing.assert_close(after[1:], want[1:])  # only the reserved slot 0 may differ


def test_extend_graphs_take_only_what_they_can_replay(runner):
    gen = torch.Generator().manual_seed(9)
    slot_iter = iter(torch.randperm(400, generator=gen)[:200].add(1).tolist())
    graphs = ExtendGraphRunner(runner, max_bs=4, max_tokens=32, capture=False)
    assert graphs.bucket_for(_extend_batch(runner, gen, [0, 1], [0, 0], [3, 4], slot_iter)) == (2, 16, 15)
    assert graphs.bucket_for(_extend_batch(runner, gen, [0], [0], [40], slot_iter)) is None  # too many tokens
    assert graphs.bucket_for(_extend_batch(runner, gen, list(range(5)), [0] * 5, [1] * 5, slot_iter)) is None
    wants_prompt_logits = _extend_batch(runner, gen, [2], [0], [6], slot_iter)
    wants_prompt_logits.logit_rows = [3, 4, 5]  # input logprobs: not the last token only
    assert graphs.bucket_for(wants_prompt_logits) is None
    # a chunk that wants no logits at all (a middle chunk of a long prompt) still replays
    middle = _extend_batch(runner, gen, [3], [0], [10], slot_iter, logits_at_last=False)
    key = graphs.bucket_for(middle)
    assert key is not None and graphs.run(middle, key).shape[0] == 0


def _verify_batch(runner, gen, rows, prefix_lens, new_lens, slot_iter):
    """A verify step's shape: each request's new tokens after its cached prefix, logits at every token."""
    batch = _extend_batch(runner, gen, rows, prefix_lens, new_lens, slot_iter, logits_at_last=False)
    batch.logit_rows = list(range(len(batch.input_ids)))
    return batch


@pytest.mark.parametrize("case", [
    ([12], [9]),  # batch 1, 8 drafts
    ([5, 20, 3], [9, 1, 4]),  # drafts of 8, none (a ride-along) and 3
    ([0, 7], [3, 2]),  # a request with no cached prefix
])
def test_verify_steps_replay_the_decode_path_as_one_row_per_token(runner, case):
    """A verify step run as decode rows on the padded static buffers of the decode graphs gives the eager
    extend's logits at every token and writes the same KV, touching nothing else but KV slot 0 and the
    table's padding row."""
    prefix_lens, new_lens = case
    gen = torch.Generator().manual_seed(7 + sum(new_lens))
    rows = [3, 6, 0][: len(new_lens)]
    slot_iter = iter(torch.randperm(400, generator=gen)[:150].add(1).tolist())
    batch = _verify_batch(runner, gen, rows, prefix_lens, new_lens, slot_iter)
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    runner.req_to_token.flush()
    table_before = runner.req_to_token.table.clone()
    eager = runner.forward(batch).clone()
    k_eager = [k.clone() for k in runner.kv_pool.k_buffers]
    for k, before in zip(runner.kv_pool.k_buffers, k_before):
        k.copy_(before)
    graphs = DecodeGraphRunner(runner, max_bs=16, capture=False)
    decode_rows = as_decode_rows(batch)
    assert decode_rows is not None and decode_rows.is_decode
    padded = graphs.run(decode_rows)
    assert padded.shape == eager.shape == (sum(new_lens), runner.cfg.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    for after, want in zip(runner.kv_pool.k_buffers, k_eager):
        torch.testing.assert_close(after[1:], want[1:])  # only the reserved slot 0 may differ
    changed = (runner.req_to_token.table != table_before).nonzero().tolist()
    assert all(r == runner.req_to_token.padding_row for r, _ in changed)


def test_as_decode_rows_takes_only_what_the_decode_path_computes(runner):
    gen = torch.Generator().manual_seed(11)
    slot_iter = iter(torch.randperm(400, generator=gen)[:200].add(1).tolist())
    batch = _verify_batch(runner, gen, [2, 5], [4, 6], [3, 1], slot_iter)
    rows = as_decode_rows(batch)
    assert rows.rows == [2, 2, 2, 5] and rows.seq_lens == [5, 6, 7, 7] and rows.positions == [4, 5, 6, 6]
    assert rows.out_cache_loc == batch.out_cache_loc and rows.input_ids == batch.input_ids
    assert rows.logit_rows == [0, 1, 2, 3] and rows.extend_lens == [1] * 4
    last_only = _extend_batch(runner, gen, [1], [2], [3], slot_iter)  # logits at the last token only
    assert as_decode_rows(last_only) is None
    reordered = _verify_batch(runner, gen, [1], [2], [3], slot_iter)
    reordered.logit_rows = [2, 1, 0]
    assert as_decode_rows(reordered) is None
    too_long = _verify_batch(runner, gen, [4], [0], [DECODE_ROWS_MAX_EXTEND + 1], slot_iter)
    assert as_decode_rows(too_long) is None
    at_most = _verify_batch(runner, gen, [4], [0], [DECODE_ROWS_MAX_EXTEND], slot_iter)
    assert as_decode_rows(at_most) is not None
    rope = _verify_batch(runner, gen, [1], [2], [2], slot_iter)
    rope.rope_positions = [[p + 5 for p in rope.positions]] * 3  # shifted M-RoPE positions, t = h = w: a decode's
    assert as_decode_rows(rope).rope_positions == rope.rope_positions
    rope.rope_positions = [rope.rope_positions[0], rope.positions, rope.positions]  # t != h: an image's
    assert as_decode_rows(rope) is None
    shifted = _verify_batch(runner, gen, [1], [2], [2], slot_iter)
    shifted.positions = [p + 1 for p in shifted.positions]  # positions not the table's
    assert as_decode_rows(shifted) is None


def test_the_runner_replays_verify_steps_on_the_decode_graphs(runner, monkeypatch):
    """ModelRunner.forward sends an extend with logits at every token to the decode graphs (here their
    eager twin) when it has at most their largest batch of tokens, and runs the others eagerly."""
    gen = torch.Generator().manual_seed(12)
    slot_iter = iter(torch.randperm(400, generator=gen)[:200].add(1).tolist())
    graphs = DecodeGraphRunner(runner, max_bs=8, capture=False)
    seen: list[int] = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch: seen.append(len(batch.rows)) or real_run(batch))
    monkeypatch.setattr(runner, "graph_runner", graphs)
    runner.forward(_verify_batch(runner, gen, [1, 4], [3, 5], [5, 3], slot_iter))
    assert seen == [8]
    runner.forward(_verify_batch(runner, gen, [1, 4], [9, 9], [5, 4], slot_iter))  # 9 tokens: eager
    runner.forward(_extend_batch(runner, gen, [2], [0], [4], slot_iter))  # last-token logits: eager
    monkeypatch.setattr(runner, "hidden_sink", lambda batch, hidden: None)  # EAGLE reads every step's states
    runner.forward(_verify_batch(runner, gen, [1, 4], [3, 5], [5, 3], slot_iter))
    assert seen == [8]


def test_extend_buckets_bound_the_longest_extend():
    buckets = extend_buckets(256, 512)
    assert (1, 16, 16) in buckets and (256, 512, 384) in buckets
    for bs, tokens, longest in buckets:
        # a batch taking this bucket has more requests than the next smaller count, each >= 1 token
        smaller = max([b for b, t, _ in buckets if t == tokens and b < bs], default=0)
        assert longest == tokens - smaller and bs <= tokens


def test_batch_size_ladder():
    ladder = batch_size_ladder(512)
    assert ladder[:4] == [1, 2, 3, 4] and ladder[-1] == 512 and ladder == sorted(set(ladder))
    assert all(b / a <= 2 for a, b in zip(ladder, ladder[1:]))  # padding never doubles a batch
    assert batch_size_ladder(6) == [1, 2, 3, 4, 6]


# ---- the vectorized sampler ---------------------------------------------------------------------------------


def make_req(**params) -> Req:
    sp = SamplingParams.from_dict(params)
    return Req(inp=GenerateRequest(rid="r", input_ids=[1, 2], sampling_params=sp), detok=None, arrival=0)


def filtered_by_definition(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the textbook way: keep the k most likely, then the smallest prefix (by probability)
    whose mass before each kept token is < top_p, then those >= min_p x the top probability."""
    order = sorted(range(probs.numel()), key=lambda t: -float(probs[t]))
    kept = order[:top_k] if top_k > 0 else order
    mass, total, nucleus = 0.0, sum(float(probs[t]) for t in kept), []
    for t in kept:
        if mass >= top_p * total:
            break
        nucleus.append(t)
        mass += float(probs[t])
    top = float(probs[nucleus[0]])
    out = torch.zeros_like(probs)
    for t in nucleus:
        if float(probs[t]) >= min_p * top:
            out[t] = probs[t]
    return out


def test_batched_filter_matches_per_request_definition():
    gen = torch.Generator().manual_seed(3)
    settings = [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=12, top_p=0.5, min_p=0.05),
                dict(), dict(top_k=1000)]
    probs = torch.softmax(torch.randn(len(settings), 50, generator=gen) * 3, dim=-1)
    reqs = [make_req(temperature=1.0, **s) for s in settings]
    got = Sampler._filter(probs, reqs)
    for i, s in enumerate(settings):
        want = filtered_by_definition(probs[i], s.get("top_k", -1), s.get("top_p", 1.0), s.get("min_p", 0.0))
        torch.testing.assert_close(got[i], want)


def test_vectorized_sampling_draws_from_the_filtered_distribution():
    sampler = Sampler(vocab_size=8, eos_token_ids=[], generator=torch.Generator().manual_seed(0))
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])
    n = 6000
    reqs = [make_req(temperature=0.7, top_k=4, top_p=0.95) for _ in range(n)]
    tokens = sampler.sample(logits.repeat(n, 1), reqs, [None] * n).token_ids
    probs = torch.softmax(logits / 0.7, dim=-1)
    want = filtered_by_definition(probs[0], 4, 0.95, 0.0)
    want = want / want.sum()
    freq = torch.bincount(torch.tensor(tokens), minlength=8).float() / n
    assert freq[want == 0].sum() == 0  # nothing outside the support
    assert torch.allclose(freq, want, atol=0.025)


def test_chunked_argmax_equals_argmax():
    """The two-stage argmax the GPU sampler takes against torch's: ties (the first index wins, also
    across chunks), rows all -inf (index 0), NaN anywhere (the first NaN wins), integer-valued scores."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        rows, chunks = trial % 4 + 1, (2, 8, 64)[trial % 3]
        x = torch.randn(rows, chunks * (trial % 5 + 1), generator=g)
        if trial % 5 == 0:
            x[:] = x[:, :1]  # every value tied
        if trial % 6 == 0:
            x = x.round()  # many ties, some across chunks
        if trial % 7 == 0:
            x[0] = float("-inf")
        if trial % 11 == 0:
            x[-1, x.shape[1] // 3] = x[-1, x.shape[1] // 2] = float("nan")
        assert torch.equal(chunked_argmax(x, chunks), x.argmax(dim=-1)), trial


def test_greedy_rows_and_seeded_rows_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=gen)
    mixed = [make_req(temperature=0), make_req(temperature=1.0, seed=7), make_req(temperature=0.5),
             make_req(top_k=1, temperature=1.0), make_req(temperature=1.0, seed=7), make_req(temperature=0)]
    sampler = Sampler(vocab_size=30, eos_token_ids=[], generator=torch.Generator().manual_seed(0))
    tokens = sampler.sample(logits, mixed, [None] * 6).token_ids
    greedy = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 3, 5)] == [greedy[i] for i in (0, 3, 5)]
    # a seeded request draws from its own seed: the same token alone as in any batch
    for i in (1, 4):
        alone = Sampler(30, [], torch.Generator().manual_seed(99)).sample(
            logits[i : i + 1], [make_req(temperature=1.0, seed=7)], [None]).token_ids[0]
        assert tokens[i] == alone


def test_seeded_draws_follow_the_distribution_and_vary_by_position():
    """Seeded rows sample through a hash of (seed, position): across seeds the draws must follow the
    filtered softmax like any sample, and one seed must not repeat the same draw at every position."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])
    n = 6000
    reqs = [make_req(temperature=0.8, top_k=6, seed=s) for s in range(n)]
    tokens = Sampler(8, [], torch.Generator()).sample(logits.repeat(n, 1), reqs, [None] * n).token_ids
    want = filtered_by_definition(torch.softmax(logits / 0.8, dim=-1)[0], 6, 1.0, 0.0)
    want = want / want.sum()
    freq = torch.bincount(torch.tensor(tokens), minlength=8).float() / n
    assert freq[want == 0].sum() == 0
    assert torch.allclose(freq, want, atol=0.025)
    one = make_req(temperature=1.0, seed=11)
    flat = torch.zeros(1, 8)
    draws = []
    for _ in range(400):  # the request's position advances as its output grows
        draws.append(Sampler(8, [], torch.Generator()).sample(flat, [one], [None]).token_ids[0])
        one.output_ids.append(draws[-1])
    freq = torch.bincount(torch.tensor(draws), minlength=8).float() / len(draws)
    assert torch.allclose(freq, torch.full((8,), 1 / 8), atol=0.07)


def test_seeded_noise_is_never_zero():
    """-log(u) must stay > 0 for every 32-bit hash value: a zero would make a banned token's 0 / 0 a NaN,
    which argmax picks (a constrained request then samples a forbidden token)."""
    from radixlm.kernels.reference import unit_interval

    extremes = torch.tensor([0, 1, 511, 512, (1 << 32) - 513, (1 << 32) - 1], dtype=torch.int64)
    u = unit_interval(extremes)
    assert bool((u > 0).all() and (u < 1).all()) and bool((-torch.log(u) > 0).all())


def test_masked_sampling_never_leaves_the_mask():
    """A batch of seeded and unseeded rows with most of a large vocabulary banned, over many draws."""
    vocab, rows = 50_000, 8
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(vocab, [], torch.Generator().manual_seed(0))
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for i in range(rows):
        allowed[i, torch.randperm(vocab, generator=gen)[:3]] = True
    reqs = [make_req(temperature=1.5, seed=i if i % 2 else None) for i in range(rows)]
    for step in range(60):
        logits = torch.randn(rows, vocab, generator=gen) * 4
        tokens = sampler.sample(logits, reqs, list(allowed)).token_ids
        assert all(bool(allowed[i, t]) for i, t in enumerate(tokens)), step
        for r, t in zip(reqs, tokens):
            r.output_ids.append(t)


def test_adjustments_still_apply_next_to_the_fast_path():
    """A batch where one request has a bias takes the full path; the others are unaffected."""
    logits = torch.zeros(3, 10)
    logits[:, 2] = 1.0
    reqs = [make_req(temperature=0), make_req(temperature=0, logit_bias={7: 5.0}), make_req(temperature=0)]
    tokens = Sampler(10, [], torch.Generator()).sample(logits, reqs, [None] * 3).token_ids
    assert tokens == [2, 7, 2]
    assert not Sampler._needs_adjust([reqs[0], reqs[2]])


# ---- lazy detokenization, dummy weights, options ---------------------------------------------------------------


def test_lazy_detokenizer_matches_incremental(tokenizer_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        eager = IncrementalDetokenizer(tok, True, [], False)
        lazy = IncrementalDetokenizer(tok, True, [], False, lazy=True)
        for t in ids:
            assert lazy.add(t) is None
            eager.add(t)
        eager.flush()
        lazy.flush()
        assert lazy.text == eager.text == tok.decode(ids, skip_special_tokens=True)


def test_dummy_weights_load_without_files(llama_ckpt, tmp_path):
    import shutil

    # only config and tokenizer: "dummy" reads no weights
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{llama_ckpt}/{name}", tmp_path / name)
    with radixlm.Engine(str(tmp_path), load_format="dummy", max_total_tokens=256, device="cpu") as e:
        out = e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True})
        assert len(out["output_ids"]) == 4
        weights = dict(e._runner.model.named_parameters())
        assert torch.equal(weights["norm.weight"], torch.ones_like(weights["norm.weight"]))
        down = weights["layers.0.mlp.down_proj.weight"].detach()
        down = down.to_dense() if down.is_mkldnn else down  # a CPU engine prepacks its linear layers
        assert 0.015 < float(down.std()) < 0.025


def test_new_options_are_validated():
    from radixlm.core.errors import InvalidRequestError

    opts = EngineOptions.from_kwargs({"device": "cpu", "max_running_requests": 40})
    assert opts.disable_cuda_graph is False and opts.cuda_graph_max_bs == 40 and opts.load_format == "auto"
    with pytest.raises(InvalidRequestError):
        EngineOptions.from_kwargs({"device": "cpu", "load_format": "pt"})
    with pytest.raises(InvalidRequestError):
        EngineOptions.from_kwargs({"device": "cpu", "cuda_graph_max_bs": 0})


@pytest.mark.parametrize("name, value, message", [
    ("enable_overlap_schedule", "false", "must be true or false"),  # a truthy string would turn it on
    ("disable_radix_cache", 1, "must be true or false"),
    ("max_running_requests", "8", "must be an integer or None"),
    ("tp_size", True, "must be an integer"),
    ("mem_fraction_static", "0.5", "must be a number"),
    ("schedule_policy", None, "must be a string"),
    ("device", 0, "must be a string or None"),  # str | None
    ("enable_overlap_schedule", 0, "must be true or false or None"),  # bool | None
    ("context_length", 2048.0, "must be an integer or None"),  # int | None: a float is not an int
    ("prepare_timeout", "1", "must be a number"),
])
def test_option_values_of_the_wrong_type_are_refused(name, value, message):
    """Options given from Python are checked against their types (the CLI's parser already gives them)."""
    from radixlm.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=f"{name} {message}"):
        EngineOptions.from_kwargs({"device": "cpu", name: value})
    with pytest.raises(InvalidRequestError, match=f"{name} {message}"):
        EngineOptions(**{name: value})  # built directly, too
    opts = EngineOptions.from_kwargs({"device": "cpu", "mem_fraction_static": 0.5, "hicache_size_gb": 1,
                                      "max_total_tokens": None})
    assert opts.hicache_size_gb == 1.0 and isinstance(opts.hicache_size_gb, float)


def test_every_option_type_is_one_the_check_knows():
    """The type check covers each kind of annotation the options use: a field of a new kind fails here."""
    import dataclasses

    kinds = {f.type for f in dataclasses.fields(EngineOptions)}
    assert kinds <= {f"{t}{o}" for t in ("bool", "int", "float", "str") for o in ("", " | None")}, kinds


def test_overlap_is_on_by_default_for_one_cuda_device_only():
    resolved = {kw.get("device"): EngineOptions.from_kwargs(kw).enable_overlap_schedule
                for kw in ({"device": "cpu"}, {"device": "cuda"})}
    assert resolved == {"cpu": False, "cuda": True}
    assert not EngineOptions.from_kwargs({"device": "cuda", "tp_size": 2}).enable_overlap_schedule
    assert not EngineOptions.from_kwargs({"device": "cuda", "dp_size": 2}).enable_overlap_schedule
    assert EngineOptions.from_kwargs({"device": "cpu", "enable_overlap_schedule": True}).enable_overlap_schedule


# ---- hidden states exported by the decode graphs (an EAGLE proposer's input) ------------------------------------


@pytest.mark.parametrize("aux_layers", [(), (0, 1)])  # the final states (EAGLE-1/2); two layers' inputs (EAGLE-3)
def test_the_decode_graphs_export_the_states_a_hidden_sink_reads(llama_ckpt, aux_layers):
    """With an export the runner sends verify and decode steps to the decode graphs (their eager twin here)
    even with a hidden sink, and hands the sink the step's own batch with its tokens' exported states (no
    padding row), equal to the eager step's, which the sink may not keep: the buffer is the next step's."""
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 512, "max_running_requests": 8})
    export = HiddenExport(aux_layers)
    runner = ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt), opts, export=export)
    width = runner.cfg.hidden_size * max(1, len(aux_layers))
    gen = torch.Generator().manual_seed(21)
    slot_iter = iter(torch.randperm(400, generator=gen)[:200].add(1).tolist())
    verify = _verify_batch(runner, gen, [1, 4], [6, 3], [4, 1], slot_iter)  # 5 rows: a graph of 8, 3 padding
    decode = BatchInput(True, [11, 12, 13], [5, 9, 2], [next(slot_iter) for _ in range(3)], [2, 5, 6], [6, 10, 3],
                        [1] * 3, [0, 1, 2])
    _extend_batch(runner, gen, [2, 5, 6], [5, 9, 2], [0, 0, 0], slot_iter)  # their prefixes (prefilled)
    seen: list[tuple[BatchInput, torch.Tensor]] = []
    runner.hidden_sink = lambda batch, hidden: seen.append((batch, hidden.clone()))
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    eager = [runner.forward(b).clone() for b in (verify, decode)]
    for k, before in zip(runner.kv_pool.k_buffers, k_before):
        k.copy_(before)
    graphs = DecodeGraphRunner(runner, max_bs=16, capture=False)
    assert graphs.hidden.shape == (16, width) and graphs.features is None
    graphs.hidden.fill_(float("nan"))  # what no real row's state may show
    runner.graph_runner = graphs
    replayed: list[int] = []
    real_run = graphs.run
    graphs.run = lambda batch: replayed.append(len(batch.rows)) or real_run(batch)
    on = [runner.forward(b).clone() for b in (verify, decode)]
    assert replayed == [5, 3]
    for off_logits, on_logits in zip(eager, on):
        torch.testing.assert_close(on_logits, off_logits, rtol=1e-5, atol=1e-5)
    (v_off, h_v_off), (d_off, h_d_off), (v_on, h_v_on), (d_on, h_d_on) = seen
    assert v_on is verify and d_on is decode and v_off is verify
    assert h_v_on.shape == h_v_off.shape == (5, width) and h_d_on.shape == h_d_off.shape == (3, width)
    torch.testing.assert_close(h_v_on, h_v_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_d_on, h_d_off, rtol=1e-5, atol=1e-5)
    if aux_layers:  # layer 0's input is the token embedding
        emb = runner.model.embed_tokens.weight[torch.tensor(verify.input_ids)]
        torch.testing.assert_close(h_v_on[:, :runner.cfg.hidden_size], emb)


def test_the_decode_graphs_take_features_only_of_their_width(runner):
    """A model reading per-token features (an EAGLE head) gets a static buffer of its chain width: a batch
    with features of another width (EAGLE-3's catch-up of the target's three states), or none, runs
    eagerly; padding rows read zeros."""
    runner.model.feature_width = 16
    try:
        graphs = DecodeGraphRunner(runner, max_bs=8, capture=False)
    finally:
        del runner.model.feature_width
    assert graphs.features.shape == (8, 16) and graphs.hidden is None
    batch = BatchInput(True, [1, 2, 3], [0, 0, 0], [1, 2, 3], [0, 1, 2], [1, 1, 1], [1] * 3, [0, 1, 2])
    assert not graphs.takes(batch)
    batch.features = torch.ones(3, 48)
    assert not graphs.takes(batch)
    batch.features = torch.ones(3, 16)
    assert graphs.takes(batch)
    batch.rows = list(range(9))
    assert not graphs.takes(batch)
    plain = DecodeGraphRunner(runner, max_bs=8, capture=False)
    assert plain.features is None and not plain.takes(batch) and not plain.takes(
        BatchInput(True, [1], [0], [1], [0], [1], [1], [0], features=torch.ones(1, 16)))
