"""Speculative decoding (core/runtime/speculative): outputs with it on equal those with it off.

The oracle is the same engine with speculation off. Most tests draft with `OracleProposer`
(radixlm.testing.speculative): it drafts the output without speculation, corrupted at a varying position, so
that every accepted length from none to the whole draft occurs, per request. A verify step that kept a
rejected token, lost an accepted one, or left a KV slot at the wrong position changes the output (the
next steps attend over that KV) or the slot accounting checked after every step
(debug_check_invariants) and at the end (free + cached = total after a flush).
"""

from __future__ import annotations

import pytest
import torch

import radixlm
from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.memory.radix_cache import RadixCache
from radixlm.core.runtime.memory.tree_continuation import cached_continuation
from radixlm.core.runtime.speculative.ngram import NgramIndex
from radixlm.core.runtime.speculative.policy import MIN_GAIN, StepTimes, choose_lengths
from radixlm.core.runtime.speculative.state import SpecState
from radixlm.core.runtime.speculative.tree import DraftTree, accepted_path, merge_continuations
from radixlm.testing.speculative import OracleProposer

PROMPTS = [[5, 17, 300, 41, 41, 9], [7] * 3, list(range(100, 160)), [999, 3, 71, 2, 500, 17, 44]]


def engine(ckpt: str, **kw) -> radixlm.Engine:
    return radixlm.Engine(ckpt, max_total_tokens=kw.pop("max_total_tokens", 4096), debug_check_invariants=True, **kw)


def with_oracle(e: radixlm.Engine, expected: dict, corrupt: bool = True, tree: bool = False) -> OracleProposer:
    sched = e.frontend.scheduler.scheduler
    sched.speculator.proposer = OracleProposer(expected, sched.sampler.vocab_size, corrupt, tree)
    return sched.speculator.proposer


def assert_kv_whole(e: radixlm.Engine) -> None:
    assert e.flush_cache()
    stats = e.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"], stats


def run_pair(ckpt: str, prompts, params, spec_kw=None, tree: bool = False, **kw):
    """Outputs with speculation off and with the oracle drafting (trees with `tree`); the spec engine's
    stats."""
    with engine(ckpt, **kw) as e:
        base = e.generate(input_ids=prompts, sampling_params=params)
    expected = {tuple(p): o["output_ids"] for p, o in zip(prompts, base)}
    with engine(ckpt, speculative_algorithm="ngram", speculative_adaptive=False, **(spec_kw or {}), **kw) as e:
        oracle = with_oracle(e, expected, tree=tree)
        spec = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
    assert oracle.calls > 0
    return base, spec, stats


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_greedy_outputs_equal_with_every_accepted_length(llama_ckpt, tree):
    params = [{"max_new_tokens": 20 + 9 * i, "temperature": 0, "ignore_eos": True} for i in range(len(PROMPTS))]
    base, spec, stats = run_pair(llama_ckpt, PROMPTS, params, spec_kw={"speculative_num_draft_tokens": 5}, tree=tree)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["spec_verify_steps_total"] > 0
    # Some drafts were accepted whole, some in part (the oracle corrupts one position of most).
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]
    for o in spec:
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.0
        # fewer forward steps than tokens: each verify step gave accept_length tokens on average
        assert meta["spec_verify_ct"] < meta["completion_tokens"]


def decode_graph_twin(runner, max_bs: int = 32) -> list[tuple[bool, int]]:
    """Gives a CPU runner the eager twin of CUDA decode graphs (the same padded static buffers, run
    without capture), so that its steps take the paths they take on a GPU; returns the list each replay's
    (rows all of one request's tokens?, row count) is appended to."""
    graphs = DecodeGraphRunner(runner, max_bs, capture=False)
    replays: list[tuple[bool, int]] = []
    real_run = graphs.run

    def run(batch):
        replays.append((len(set(batch.rows)) < len(batch.rows), len(batch.rows)))
        return real_run(batch)

    graphs.run = run
    runner.graph_runner = graphs
    return replays


@pytest.mark.parametrize("algorithm", ["oracle", "draft", "oracle-tree"])
def test_verify_steps_on_the_decode_graphs_keep_outputs(llama_ckpt, algorithm):
    """With decode graphs (their eager twin on the CPU) verify steps replay them, one row per token, and
    outputs stay those without speculation at every accepted length; the `draft` proposer's model
    decodes on its own runner's graphs too. Steps holding a tree run eagerly (the graphs are causal)."""
    params = [{"max_new_tokens": 20 + 9 * i, "temperature": 0, "ignore_eos": True} for i in range(len(PROMPTS))]
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=params)
    expected = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, base)}
    kw = {"speculative_draft_model_path": llama_ckpt} if algorithm == "draft" else {}
    with engine(llama_ckpt, speculative_algorithm="draft" if kw else "ngram", speculative_adaptive=False,
                speculative_num_draft_tokens=5, **kw) as e:
        replays = decode_graph_twin(e._runner)
        speculator = e.frontend.scheduler.scheduler.speculator
        if kw:
            draft_replays = decode_graph_twin(speculator.proposer.runner)
        else:
            with_oracle(e, expected, tree=algorithm == "oracle-tree")
        spec = e.generate(input_ids=PROMPTS, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["spec_verify_steps_total"] > 0 and stats["spec_accepted_tokens_total"] > 0
    verify_replays = [n for shared, n in replays if shared]  # rows of one request: a verify step's
    if algorithm == "oracle-tree":
        assert len(verify_replays) < stats["spec_verify_steps_total"] / 2
    else:
        assert len(verify_replays) == stats["spec_verify_steps_total"]
    if kw:
        assert draft_replays and not any(shared for shared, _ in draft_replays)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_stop_strings_stop_tokens_and_logprobs_equal(llama_ckpt, tree):
    """Logprobs equal to 1e-4: a verify row that saw another branch's keys would be off by far more."""
    with engine(llama_ckpt) as e:  # stop strings taken from the plain output, so that they do match
        probe = e.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 30, "temperature": 0,
                                                               "ignore_eos": True})
    params = []
    for i, o in enumerate(probe):
        ids = o["output_ids"]
        p = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
        if i % 2:
            p["stop"] = [o["text"][len(o["text"]) // 2:][:3]] if len(o["text"]) > 6 else []
        else:
            p["stop_token_ids"] = [ids[11]]
        params.append(p)
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    expected = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, base)}
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False) as e:
        with_oracle(e, expected, tree=tree)
        spec = e.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=3)
        assert_kv_whole(e)
    assert any(o["meta_info"]["finish_reason"]["matched"] is not None for o in base)
    for a, b in zip(base, spec):
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lb] == [t for _, t, _ in la]
        assert [v for v, _, _ in lb] == pytest.approx([v for v, _, _ in la], abs=1e-4)
        tops_a, tops_b = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
        assert [[t for _, t, _ in x] for x in tops_b] == [[t for _, t, _ in x] for x in tops_a]


def test_seeded_samples_and_n_equal(llama_ckpt):
    """A seeded draw is keyed by the output position, so the sample at a draft position is the one drawn
    there without speculation: seeded outputs, `n` of them, are the same tokens."""
    params = {"max_new_tokens": 25, "temperature": 0.8, "top_p": 0.95, "seed": 11, "n": 3, "ignore_eos": True}
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
    # each prompt's n samples differ: the oracle drafts the first, and the others verify against it
    expected = {tuple(PROMPTS[i]): base[3 * i]["output_ids"] for i in range(2)}
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False) as e:
        with_oracle(e, expected)
        spec = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
        assert_kv_whole(e)
    assert len(spec) == 6 and [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert len({tuple(o["output_ids"]) for o in base[:3]}) > 1


def test_retraction_under_a_small_pool_keeps_outputs(llama_ckpt):
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    base, spec, stats = run_pair(llama_ckpt, prompts, params, max_total_tokens=160)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["retractions_total"] > 0 and stats["spec_accepted_tokens_total"] > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_constraint_masks_every_draft_position(llama_ckpt, tree):
    """The grammar masks each verify row as of the draft before it (in a tree, as of its path: a fork per
    node); a draft token it forbids ends the draft (its subtree). The outputs match the pattern and equal
    those without speculation."""
    import re

    pattern = r"(ab|cd)[0-9]{3,12}(x|yz){2,6}"
    params = {"max_new_tokens": 40, "temperature": 0, "regex": pattern}
    base, spec, stats = run_pair(llama_ckpt, PROMPTS, params, tree=tree)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert all(re.fullmatch(pattern, o["text"]) for o in spec)
    assert stats["spec_verify_steps_total"] > 0


def test_abort_mid_generation_frees_everything(llama_ckpt):
    import threading

    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False) as e:
        with_oracle(e, {})  # no expectations: empty drafts, plain decodes
        sched = e.frontend.scheduler.scheduler
        sched.speculator.proposer.expected = {tuple(PROMPTS[2]): list(range(1, 400))}  # wrong drafts, all long
        stream = e.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 300, "temperature": 0,
                                                                    "ignore_eos": True}, stream=True, rid="victim")
        next(stream)
        threading.Timer(0.05, e.abort_request, args=("victim",)).start()
        last = list(stream)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert_kv_whole(e)


def test_ngram_proposer_on_the_tiny_model_keeps_outputs(llama_ckpt):
    prompt = [list(range(200, 230)) * 3 + [200, 201], [9, 8, 7] * 10]
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=prompt, sampling_params=params)
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_ngram_min_match_window_size=1,
                speculative_adaptive=False) as e:
        spec = e.generate(input_ids=prompt, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["spec_draft_tokens_total"] > 0 and stats["spec_algorithm"] == "ngram"


def test_ngram_trees_keep_outputs(llama_ckpt):
    """ngram drafting trees (3 continuations merged) on prompts that repeat with variations, the second
    call of each prompt also drafting the radix cache's answer (the first, its own n-grams alone): outputs
    equal those without speculation, and every slot comes back."""
    prompt = [list(range(200, 215)) + [1, 2] + list(range(200, 215)) + [3, 4] + list(range(200, 212)),
              [9, 8, 7, 1] * 4 + [9, 8, 7, 2] * 3 + [9, 8]]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=prompt, sampling_params=params)
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_ngram_min_match_window_size=1,
                speculative_ngram_max_bfs_breadth=3, speculative_num_draft_tokens=8, speculative_adaptive=False) as e:
        trees = []
        real_forward = e._runner.forward
        e._runner.forward = lambda batch: (trees.append(batch.tree_parents is not None), real_forward(batch))[1]
        spec = e.generate(input_ids=prompt, sampling_params=params)
        again = e.generate(input_ids=prompt, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in again] == [o["output_ids"] for o in base]
    assert any(trees) and stats["spec_accepted_tokens_total"] > 0


def chi_square_p_value(observed: dict, expected: dict, n: int) -> float:
    """Pearson's test of counts against probabilities; cells expected fewer than 5 times are pooled."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        if p * n < 5:
            pooled_obs, pooled_exp = pooled_obs + observed.get(cell, 0), pooled_exp + p * n
            continue
        stat, dof = stat + (observed.get(cell, 0) - p * n) ** 2 / (p * n), dof + 1
    if pooled_exp > 0:
        stat, dof = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, dof + 1
    assert sum(observed.values()) == n and set(observed) <= set(expected)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def top4(e: radixlm.Engine, ids: list[int]) -> dict[int, float]:
    """The model's next-token distribution after `ids` restricted to its 4 likeliest tokens (top_k 4)."""
    out = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                     return_logprob=True, top_logprobs_num=4)
    tops = out["meta_info"]["output_top_logprobs"][0]
    probs = torch.tensor([v for v, _, _ in tops]).softmax(0).tolist()
    return {t: p for (_, t, _), p in zip(tops, probs)}


def top4_joint(e: radixlm.Engine, prompt: list[int], steps: int) -> dict[tuple, float]:
    """The exact joint distribution of `steps` tokens sampled at temperature 1 with top_k 4."""
    exact: dict[tuple, float] = {(): 1.0}
    for _ in range(steps):
        exact = {seq + (t,): p * q for seq, p in exact.items() for t, q in top4(e, prompt + list(seq)).items()}
    return exact


def sample_counts(e: radixlm.Engine, prompt: list[int], n: int) -> tuple[dict[tuple, int], dict]:
    """How often each 3-token output comes in n samples (temperature 1, top_k 4), and the engine's stats;
    the KV pool whole after them."""
    outs = e.generate(input_ids=[prompt] * (n // 100), sampling_params={
        "max_new_tokens": 3, "temperature": 1.0, "top_k": 4, "n": 100, "ignore_eos": True})
    assert_kv_whole(e)
    counts: dict[tuple, int] = {}
    for o in outs:
        counts[tuple(o["output_ids"])] = counts.get(tuple(o["output_ids"]), 0) + 1
    return counts, e.get_stats()


def test_sampled_outputs_keep_the_target_distribution(llama_ckpt):
    """Temperature 1 over the top 4 tokens, 3 tokens a sample (the prefill samples the first; a verify
    step the second, drafted as the greedy one, and the third where the draft is accepted): the joint
    distribution over 3,000 samples against the exact one (from the model's logprobs), by a chi-square
    test at p > 0.001. Accepting a draft token more often than p gives it (e.g. resampling a rejected
    position from p instead of the residual: p + (1 - p) p) fails it."""
    prompt, n = [5, 17, 300, 41], 3000
    with engine(llama_ckpt) as e:
        greedy = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0})["output_ids"]
        exact = top4_joint(e, prompt, 3)
        p_draft = top4(e, prompt + greedy[:1])[greedy[1]]
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False, max_requests_per_call=n,
                max_running_requests=256) as e:
        with_oracle(e, {tuple(prompt): greedy}, corrupt=False)
        counts, stats = sample_counts(e, prompt, n)
    assert stats["spec_verifies_total"] == n and 0 < stats["spec_accepted_tokens_total"] < n
    assert 0.1 < p_draft < 0.9  # the draft is often accepted and often not: both branches of the rule run
    assert chi_square_p_value(counts, exact, n) > 1e-3


class FixedTreeProposer(OracleProposer):
    """Drafts one tree to every request with one output token (the others nothing)."""

    def __init__(self, tree: DraftTree) -> None:
        super().__init__({}, 0)
        self.tree = tree

    def propose(self, reqs, budgets):
        self.calls += len(reqs)
        return [self.tree if len(r.output_ids) == 1 and k else [] for r, k in zip(reqs, budgets)]


def test_sampled_outputs_keep_the_target_distribution_with_trees(llama_ckpt):
    """As above with a tree: the second token drafted as each of the two likeliest tokens after the greedy
    first one (siblings; their children fall to max_new_tokens). The walk keeps the first child with p(a),
    else the second with p(b) / (1 - p(a)) of the rest, which is what sampling from p and descending to
    the child holding the sample does; the joint distribution of 3,000 samples against the exact one, by a
    chi-square test. Keeping a sibling's token more often than p gives it fails it."""
    prompt, n = [5, 17, 300, 41], 3000
    with engine(llama_ckpt) as e:
        greedy = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})["output_ids"]
        exact = top4_joint(e, prompt, 3)
        second = top4(e, prompt + greedy)
        (a, p_a), (b, p_b) = sorted(second.items(), key=lambda kv: -kv[1])[:2]
        c, d = (max(top4(e, prompt + greedy + [t]).items(), key=lambda kv: kv[1])[0] for t in (a, b))
    tree = DraftTree([a, b, c, d], [-1, -1, 0, 1])
    with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False, max_requests_per_call=n,
                max_running_requests=256, speculative_num_draft_tokens=4) as e:
        e.frontend.scheduler.scheduler.speculator.proposer = FixedTreeProposer(tree)
        counts, stats = sample_counts(e, prompt, n)
    on_b = sum(v for seq, v in counts.items() if seq[1] == b)
    assert stats["spec_verifies_total"] == n and 0 < stats["spec_accepted_tokens_total"] < n
    assert p_a + p_b < 0.95 and p_b > 0.05 and on_b > 30  # both children and the miss branch all run
    assert chi_square_p_value(counts, exact, n) > 1e-3


# ---- the units -------------------------------------------------------------------------------------


def test_ngram_index_finds_the_longest_latest_match():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert index.continuations(tokens, 3) == [[4, 5, 9]]  # after [1, 2, 3]
    tokens += [4, 7]
    assert index.continuations(tokens, 3) == []  # [4, 7] never occurred before
    tokens += [1, 2, 3, 4, 8, 0, 3, 4]
    assert index.continuations(tokens, 2) == [[8, 0]]  # the latest [3, 4] is followed by 8, 0
    assert NgramIndex(2, 4).continuations([5, 5], 4) == []  # a suffix needs an earlier occurrence
    assert NgramIndex(1, 4).continuations([5, 6, 5], 4) == [[6, 5]]


def test_ngram_index_gives_several_continuations_latest_and_longest_first():
    index = NgramIndex(1, 3, breadth=3)
    tokens = [7, 1, 2, 5, 6, 1, 2, 8, 9, 3, 2, 4, 1, 2]
    # [1, 2] after 7: ... 5 6 (first), 8 9 (second, later); then the suffix [2] alone adds [4, 1]
    assert index.continuations(tokens, 2) == [[8, 9], [5, 6], [4, 1]] and index.matched == 2
    assert NgramIndex(1, 3, breadth=2).continuations(tokens, 2) == [[8, 9], [5, 6]]


def test_cached_continuation_follows_the_tree_after_a_whole_context():
    """The tokens the radix tree holds after a context: the rest of the edge it ends in, then the most
    recently used child at each fork; nothing where the context leaves the tree. From a request's own
    node (its cached prefix) the walk takes only the tokens past it."""
    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    for key in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9, 8], [7, 7]):  # the second inserted later: more recent
        cache.insert(key, alloc.alloc(len(key)))
    root = cache.root
    assert cached_continuation(root, [1, 2], 3) == [3, 9, 9]
    assert cached_continuation(root, [1, 2], 10) == [3, 9, 9, 9, 8]
    assert cached_continuation(root, [1, 2, 3, 4], 10) == [5, 6]
    assert cached_continuation(root, [1, 2, 3, 4, 5, 6], 4) == []  # the tree ends there
    assert cached_continuation(root, [1, 2, 5], 4) == [] and cached_continuation(root, [3], 4) == []
    assert cached_continuation(root, [], 1) in ([1], [7])
    _, node = cache.match_prefix([1, 2, 3])  # a request's last node, [1, 2, 3] cached
    assert cached_continuation(node, [4], 2) == [5, 6] and cached_continuation(node, [], 2) == [9, 9]


def test_ngram_drafts_a_repeated_prompt_from_the_radix_cache(llama_ckpt):
    """The same prompt asked again: its first answer is in the radix tree after the prompt, so the second
    call drafts it whole (every draft kept), with the same output; without the tree the prompt, which
    repeats nothing, gives the n-grams little."""
    prompt = [999, 3, 71, 2, 500, 17, 44]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    runs = {}
    for radix in (True, False):
        with engine(llama_ckpt, speculative_algorithm="ngram", speculative_adaptive=False,
                    speculative_ngram_radix_cache=radix) as e:
            first = e.generate(input_ids=prompt, sampling_params=params)
            again = e.generate(input_ids=prompt, sampling_params=params)
            assert_kv_whole(e)
        assert again["output_ids"] == first["output_ids"]
        runs[radix] = again["meta_info"]
    assert runs[True]["spec_accept_length"] > 4.5  # 4 drafts a step, all kept (5 tokens a step)
    assert runs[False]["spec_accept_length"] < runs[True]["spec_accept_length"] - 1


def test_accepted_path_descends_to_the_sampled_child():
    chain = DraftTree.chain
    assert accepted_path(chain([4, 5, 6]), [4, 5, 6, 7]) == [0, 1, 2]
    assert accepted_path(chain([4, 5, 6]), [4, 9, 6, 7]) == [0]
    assert accepted_path(chain([4]), [3, 1]) == [] and accepted_path(chain([]), [3]) == []
    # root -> 0 (4) -> 2 (6); root -> 1 (5) -> 3 (7); samples at rows root, 0, 1, 2, 3
    tree = DraftTree([4, 5, 6, 7], [-1, -1, 0, 1])
    assert accepted_path(tree, [5, 9, 7, 0, 0]) == [1, 3]
    assert accepted_path(tree, [4, 6, 0, 0, 0]) == [0, 2]
    assert accepted_path(tree, [4, 7, 0, 0, 0]) == [0]  # 7 is under the other branch
    assert accepted_path(tree, [8, 0, 0, 0, 0]) == []


def test_merge_continuations_keeps_the_likeliest_nodes():
    assert merge_continuations([[1, 2, 3]], 2) == DraftTree([1, 2], [-1, 0])  # one: a chain
    # weights 1, 1/2, 1/3, 1/4: 1 and 2 score 22/25, 3 (8/11 of them) 0.64, 4 0.48, 5 0.24, 6 0.16, 7 0.12
    tree = merge_continuations([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6], [7]], 6)
    assert tree.tokens == [1, 2, 3, 4, 5, 6] and tree.parents == [-1, 0, 1, 2, 1, 2]
    assert merge_continuations([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6], [7]], 7).tokens[-1] == 7
    assert merge_continuations([[1, 2], [3, 4]], 3).tokens == [1, 2, 3]  # the better branch first, whole
    # drafts often kept: deep along the best continuation; seldom: its first token's alternative first
    assert merge_continuations([[1, 2, 3, 4], [5, 6]], 4, rate=0.9).tokens == [1, 2, 3, 4]
    assert merge_continuations([[1, 2, 3, 4], [5, 6]], 4, rate=0.3).tokens == [1, 5, 2, 6]


def cpu_like_times(token_cost: float = 0.25, base: float = 0.3) -> StepTimes:
    """Step times of a device where each token computed beyond the first costs token_cost s, and a verify
    step `base` s more than a decode step of as many tokens (what a CPU measures, roughly)."""
    times = StepTimes(token_cost)
    for b in range(1, 5):
        times.record_decode(b, 1.0 + token_cost * (b - 1))
    for n in range(2, 40):
        times.record_verify(n, 1.0 + base + token_cost * (n - 1))
    return times


def expected_rate(rates, lengths, times):
    """Expected tokens per second of a step; a decode step's counted MIN_GAIN times (what drafts must beat)."""
    b = len(lengths)
    tokens = b + sum(sum(r ** j for j in range(1, k + 1)) for r, k in zip(rates, lengths))
    if not any(lengths):
        return MIN_GAIN * tokens / times.decode_time(b)
    return tokens / times.verify_time(b, b + sum(lengths), times.decode_time(b))


@pytest.mark.parametrize("seed", range(6))
def test_policy_lengths_are_the_best_by_brute_force(seed):
    """The chosen lengths give the most expected tokens per second of every combination (the oracle:
    enumerating them all), and never fewer than a decode step."""
    import itertools
    import random

    rng = random.Random(seed)
    times = cpu_like_times(rng.choice([0.03, 0.25]), rng.choice([0.0, 0.4]))
    rates = [rng.choice([0.0, 0.2, 0.5, 0.8, 0.95, 1.0]) for _ in range(rng.randint(1, 3))]
    caps = [rng.randint(0, 5) for _ in rates]
    chosen = choose_lengths(rates, caps, times)
    assert all(0 <= k <= c for k, c in zip(chosen, caps))
    best = max(expected_rate(rates, list(ks), times) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert expected_rate(rates, chosen, times) == pytest.approx(best)
    assert expected_rate(rates, chosen, times) >= expected_rate(rates, [0] * len(caps), times)


def test_policy_drafts_long_where_kept_and_not_where_lost():
    times = cpu_like_times()
    assert choose_lengths([0.3], [8], times) == [0]  # chat-like: a decode step does better
    assert choose_lengths([0.95], [8], times) == [8]
    assert choose_lengths([0.95, 0.3], [8, 8], times)[1] == 0
    assert choose_lengths([0.9], [8], StepTimes(0.25)) == [0]  # no decode step measured yet: measure one


def test_request_rate_follows_its_drafts_and_returns_to_its_class():
    s = SpecState()
    assert s.rate(0.5) == 0.5
    for _ in range(5):
        s.record(4, 0, True)
    assert s.rate(0.5) < 0.2
    for _ in range(200):
        s.idle()
    assert s.rate(0.5) > 0.45  # long idle: its class's rate again
    for _ in range(5):
        s.record(4, 4, False)
    assert s.rate(0.5) > 0.9 and s.verify_ct == 10 and s.accepted == 20 and s.accept_length == 3.0


class WrongProposer:
    """Drafts tokens the target never samples (a chat request's failing lookups, made sure)."""
    name, free = "wrong", True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, reqs, budgets):
        return [[(r.output_ids[-1] + 1 + j) % self.vocab_size for j in range(k)] for r, k in zip(reqs, budgets)]

    def draft_class(self, req) -> int:
        return 0

    def release(self, req) -> None:
        pass


def policy_engine(ckpt: str, proposer_fn, expected=None, **kw):
    """A spec engine with the adaptive policy on fixed step times (a verify token costs 0.1 decode step:
    first drafts, at the prior rate, pay), drafting with proposer_fn."""
    e = engine(ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=8, **kw)
    spec = e.frontend.scheduler.scheduler.speculator
    times = spec.policy.times = cpu_like_times(0.1, 0.0)
    times.record_decode = times.record_verify = lambda *a: None  # keep the times fixed
    spec.proposer = proposer_fn(spec.executor.sampler.vocab_size)
    return e


@pytest.mark.parametrize("kind", ["wrong", "right"])
def test_adaptive_lengths_stop_failing_drafts_and_grow_kept_ones(llama_ckpt, kind):
    """Drafts that always fail cost a few verify steps and then none (the class and request rates fall);
    drafts that are always right grow to the whole budget. Outputs equal those without speculation."""
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=params)
    expected = {tuple(p): o["output_ids"] for p, o in zip(PROMPTS, base)}
    make = WrongProposer if kind == "wrong" else lambda v: OracleProposer(expected, v, corrupt=False)
    with policy_engine(llama_ckpt, make) as e:
        spec = e.generate(input_ids=PROMPTS, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    if kind == "wrong":
        assert 0 < stats["spec_verify_steps_total"] <= 8 and stats["spec_accepted_tokens_total"] == 0
    else:
        assert stats["spec_accept_length"] > 5


@pytest.mark.parametrize("kw,param", [
    ({"speculative_algorithm": "medusa"}, "speculative_algorithm"),
    ({"speculative_algorithm": "draft"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 3,
      "speculative_ngram_max_match_window_size": 2}, "speculative_ngram_max_match_window_size"),
    ({"speculative_algorithm": "ngram", "enable_overlap_schedule": True}, "enable_overlap_schedule"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_max_bfs_breadth": 0}, "speculative_ngram_max_bfs_breadth"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_max_bfs_breadth": 2, "speculative_num_draft_tokens": 64},
     "speculative_num_draft_tokens"),
])
def test_bad_options_are_named(kw, param):
    with pytest.raises(InvalidRequestError) as err:
        EngineOptions.from_kwargs({"device": "cpu", **kw})
    assert err.value.param == param


def test_overlap_schedule_falls_back_off_with_speculation():
    """On one CUDA device overlap scheduling is on by default; with speculation it is off (documented), and
    asking for both is refused (test_bad_options_are_named)."""
    assert EngineOptions.from_kwargs({"device": "cuda"}).enable_overlap_schedule is True
    assert EngineOptions.from_kwargs({"device": "cuda", "speculative_algorithm": "ngram"}).enable_overlap_schedule is False


def test_sglang_spellings_are_taken():
    assert EngineOptions.from_kwargs({"device": "cpu", "speculative_algorithm": "NGRAM"}).speculative_algorithm == "ngram"
    opts = EngineOptions.from_kwargs({"device": "cpu", "speculative_algorithm": "STANDALONE",
                                      "speculative_draft_model_path": "x"})
    assert opts.speculative_algorithm == "draft" and not opts.enable_overlap_schedule


def test_metrics_and_native_meta_info_over_http(llama_ckpt):
    """/metrics (parsed by prometheus_client) carries the counters by proposer; /generate's meta_info
    carries the request's."""
    from prometheus_client.parser import text_string_to_metric_families
    from server_harness import LiveServer

    e = engine(llama_ckpt, speculative_algorithm="ngram", speculative_ngram_min_match_window_size=1,
               speculative_adaptive=False)
    live = LiveServer(e)
    try:
        with live.client() as http:
            body = {"input_ids": [9, 8, 7] * 10, "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                                                      "ignore_eos": True}}
            meta = http.post("/generate", json=body).json()["meta_info"]
            text = http.get("/metrics").text
    finally:
        live.stop()
        e.shutdown()
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] >= 1.0
    families = {f.name: f for f in text_string_to_metric_families(text)}
    drafted = families["radixlm:spec_draft_tokens"].samples[0]
    assert drafted.labels["algorithm"] == "ngram" and drafted.value > 0
    for name in ("radixlm:spec_verify_steps", "radixlm:spec_verify", "radixlm:spec_accepted_tokens"):
        assert families[name].type == "counter"
    assert families["radixlm:spec_accept_length"].samples[0].value >= 1.0


# ---- the draft-model proposer -------------------------------------------------------------------------

MIXED = [  # greedy, a stop token, a seeded sample, a constraint: one continuous batch
    {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop_token_ids": [17, 300]},
    {"max_new_tokens": 30, "temperature": 0.9, "seed": 5, "ignore_eos": True},
    {"max_new_tokens": 40, "temperature": 0, "regex": r"(ab|cd)[0-9]{3,12}(x|yz){2,6}"},
]


def draft_pool_whole(e: radixlm.Engine) -> None:
    proposer = e.frontend.scheduler.scheduler.speculator.proposer
    assert proposer.slots_held() == 0 and not proposer.held
    assert proposer.allocator.available() == proposer.allocator.num_slots


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_keeps_outputs(llama_ckpt, llama_tied_ckpt, draft):
    """The target itself as its draft (every draft accepted but for float noise) and another model of
    the tokenizer (nearly every draft rejected): outputs equal those without speculation."""
    path = llama_ckpt if draft == "same" else llama_tied_ckpt
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=MIXED)
    with engine(llama_ckpt, speculative_algorithm="draft", speculative_draft_model_path=path,
                speculative_num_draft_tokens=5, speculative_adaptive=False) as e:  # drafts every step
        spec = e.generate(input_ids=PROMPTS, sampling_params=MIXED)
        stats = e.get_stats()
        assert_kv_whole(e)
        draft_pool_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["spec_algorithm"] == "draft" and stats["spec_verifies_total"] > 0
    # The greedy request (the first): the target's own drafts are kept but for float noise.
    greedy = spec[0]["meta_info"]["spec_accept_length"]
    assert greedy > 5 if draft == "same" else greedy < 2, greedy


def test_draft_model_under_retraction(llama_ckpt):
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with engine(llama_ckpt, max_total_tokens=160) as e:
        base = e.generate(input_ids=prompts, sampling_params=params)
    with engine(llama_ckpt, max_total_tokens=160, speculative_algorithm="draft",
                speculative_draft_model_path=llama_ckpt, speculative_adaptive=False) as e:
        spec = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
        draft_pool_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["retractions_total"] > 0 and stats["spec_accepted_tokens_total"] > 0


def test_a_draft_model_with_a_shorter_context_is_refused(llama_ckpt, tmp_path):
    from radixlm.testing.checkpoints import build_checkpoint

    short = build_checkpoint(str(tmp_path / "short"), "llama", max_position_embeddings=256)
    with pytest.raises(InvalidRequestError) as err:
        radixlm.Engine(llama_ckpt, speculative_algorithm="draft", speculative_draft_model_path=short)
    assert err.value.param == "speculative_draft_model_path"
    with radixlm.Engine(llama_ckpt, context_length=256, speculative_algorithm="draft",
                        speculative_draft_model_path=short) as e:
        assert e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "llama_tied_ckpt", "qwen2_ckpt"])
def test_parameter_count_is_the_checkpoints(ckpt, request):
    """ModelConfig.parameter_count (what a draft model's weights take, sized before it loads) against
    transformers' model of the checkpoint: untied and tied embeddings, qkv biases."""
    from transformers import AutoModelForCausalLM

    from radixlm.core.runtime.models.config import ModelConfig

    path = request.getfixturevalue(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert ModelConfig.from_dir(path).parameter_count() == sum(p.numel() for p in hf.parameters())


def test_the_target_pool_leaves_room_for_the_draft_model(llama_ckpt, llama_tied_ckpt, monkeypatch):
    """On CUDA the target's KV pool is sized from the memory free after its weights; the `draft`
    proposer's runner then takes its weights, graphs and a pool of as many tokens. The target's pool must
    leave that room: its pool and the draft's together, with the draft's weights and buffers, within the
    bytes the target's pool alone would take. (The device's memory is mocked: sizing is arithmetic.)"""
    from radixlm.core.runtime.execution.model_runner import ModelRunner
    from radixlm.core.runtime.memory.memory_pool import KVPool
    from radixlm.core.runtime.models.config import ModelConfig

    gib = 1 << 30
    sizing = {"device": "cpu", "max_running_requests": 4096}
    runner = ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt),
                         EngineOptions.from_kwargs({**sizing, "max_total_tokens": 512}))
    plain_opts = EngineOptions.from_kwargs(sizing)
    total, budget = 16 * gib, 2 * gib  # memory left for the target's pool: 2 GiB
    in_use = total * plain_opts.mem_fraction_static - runner._activation_reserve(plain_opts) - budget
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - int(in_use), total))
    plain = runner._kv_pool_size(plain_opts)
    draft_opts = EngineOptions.from_kwargs({**sizing, "speculative_algorithm": "draft",
                                            "speculative_draft_model_path": llama_tied_ckpt})
    shared = runner._kv_pool_size(draft_opts)
    target_bytes = runner._kv_bytes_per_token()
    draft = ModelConfig.from_dir(llama_tied_ckpt)
    draft_bytes = KVPool.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, runner.kv_dtype)
    draft_weights = draft.parameter_count() * 4  # float32
    assert plain * target_bytes == pytest.approx(budget, rel=1e-3)
    assert shared * (target_bytes + draft_bytes) + draft_weights <= plain * target_bytes
    assert shared > plain / 5  # room left, not the floor: the draft's buffers take ~1 GiB of the 2
    assert runner._kv_pool_size(EngineOptions.from_kwargs({**sizing, "speculative_algorithm": "ngram"})) == plain
