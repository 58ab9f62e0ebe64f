"""Overlap scheduling (enable_overlap_schedule): the next decode step is launched with the sampled tokens
still on the device, and results are applied one step behind. On the CPU the device is synchronous, so
what these tests prove is the logic: the futures feed the right rows, a request finished in step N drops
the token step N+1 computed for it and gives its KV back, and outputs equal those without overlap.

Two oracles: the scheduler unit tests' fake runner (its logits are a function of the tokens each request's
slots hold, so a slot written to the wrong place changes the output) against plain Python lists, and the
tiny Llama engine with overlap on against the same engine with it off.
"""

from __future__ import annotations

import json

import dataclasses

import pytest
import torch

import radixlm
from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.models.config import ModelConfig
from test_scheduler_units import EOS, load_bench_scheduler, oracle, prompts_with_shared_prefixes, run_scheduler

# ---- the scheduler with a fake runner ---------------------------------------------------------------


def chained_steps(sched) -> int:
    return sum(1 for b in sched.runner.steps if b.input_future is not None)


def chained_extends(sched) -> int:
    """Extend steps whose riding decodes took their input from a pending step's tokens on the device."""
    return sum(1 for b in sched.runner.steps if b.input_future is not None and not b.is_decode)


def test_fake_runner_outputs_match_the_oracle_with_chained_steps():
    prompts = prompts_with_shared_prefixes(10)
    params = [{"max_new_tokens": 5 + 3 * i, "ignore_eos": i % 2 == 0} for i in range(10)]
    sched, finals = run_scheduler(512, prompts, params, enable_overlap_schedule=True)
    for out, prompt, p in zip(finals, prompts, params):
        assert out.output_ids == oracle(prompt, p["max_new_tokens"], ignore_eos=p["ignore_eos"])
    assert any(out.output_ids[-1] == EOS for out in finals)  # some finished by EOS, one step behind
    assert chained_steps(sched) > 0
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 512


def test_fake_runner_retracts_under_memory_pressure_with_overlap():
    prompts = prompts_with_shared_prefixes(8)
    params = [{"max_new_tokens": 24, "ignore_eos": True}] * 8
    sched, finals = run_scheduler(64, prompts, params, max_running_requests=4, enable_overlap_schedule=True)
    assert sched.stats.retractions_total > 0 and chained_steps(sched) > 0
    for out, prompt in zip(finals, prompts):
        assert out.output_ids == oracle(prompt, 24, ignore_eos=True)
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 64


def test_fake_runner_applies_a_pending_step_under_the_next_extend(monkeypatch):
    """Requests admitted while others decode: the extend step is launched before the pending decode
    step is applied (its host work hides under the extend), and outputs stay the oracle's."""
    from radixlm.core.runtime.scheduler.execute import Executor

    under_extend = []
    run_extend = Executor.run_extend

    def spy(self, extends, pending=None):
        under_extend.append(pending is not None)
        return run_extend(self, extends, pending)

    monkeypatch.setattr(Executor, "run_extend", spy)
    prompts = prompts_with_shared_prefixes(9)
    params = [{"max_new_tokens": 4 + 5 * (i % 3), "ignore_eos": True} for i in range(9)]
    _, finals = run_scheduler(512, prompts, params, max_running_requests=3, enable_overlap_schedule=True)
    for out, prompt, p in zip(finals, prompts, params):
        assert out.output_ids == oracle(prompt, p["max_new_tokens"], ignore_eos=True)
    assert any(under_extend)


def test_fake_runner_streams_and_aborts_with_overlap():
    prompts = [[1] * 6, [2] * 6, [3] * 5]
    params = [{"max_new_tokens": 40, "ignore_eos": True, "stream": True},
              {"max_new_tokens": 12, "ignore_eos": True, "stream": True}, {"max_new_tokens": 9}]
    chunks: dict[int, list[int]] = {0: [], 1: []}

    def collect_and_abort(sched, i: int, out) -> None:
        chunks[i] += out.output_ids
        if i == 0 and len(chunks[0]) >= 5:
            sched.inbox.put(radixlm.core.runtime.messages.Abort("q0"))

    sched, finals = run_scheduler(256, prompts, params, on_chunk=collect_and_abort, enable_overlap_schedule=True)
    assert finals[0].finish.type == "abort" and finals[0].completion_tokens < 40
    streamed = chunks[0] + finals[0].output_ids
    assert streamed == oracle(prompts[0], 40, ignore_eos=True)[: len(streamed)]
    assert chunks[1] + finals[1].output_ids == oracle(prompts[1], 12, ignore_eos=True)
    assert finals[2].output_ids == oracle(prompts[2], 9)
    assert chained_steps(sched) > 0
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 256


class JumpEveryThird:
    """A constraint that allows every token and forces two tokens after every third one sampled,
    replacing the newest sampled token whenever the scheduler lets it (`max_replace`), as canonical
    re-tokenization does: the outputs show what each jump was allowed."""

    def __init__(self) -> None:
        self.sampled, self.jumped_at, self.asked = 0, -1, []

    def allowed_token_mask(self, vocab_size: int, packed: bool = False) -> torch.Tensor:
        return torch.full((-(-vocab_size // 32),), -1, dtype=torch.int32) if packed else torch.ones(vocab_size, dtype=torch.bool)

    def advance(self, token_id: int) -> None:
        self.sampled += 1

    def is_finished(self) -> bool:
        return False

    def jump_forward(self, output_ids, tokenizer, max_replace=1, max_new_tokens=None):
        if self.sampled % 3 or self.jumped_at == self.sampled:
            return None
        self.jumped_at = self.sampled
        self.asked.append(max_replace)
        return min(max_replace, 1), [20 + len(self.asked) % 5, 9]


def test_fake_runner_constrained_jumps_equal_with_late_sampled_chained_steps(monkeypatch):
    """Constrained requests chain too, sampled late: launched with the pending tokens, sampled once
    they are applied. A request that jumps forward when its pending token is applied is then without
    the chained step's slot, as without overlap, so its jump may replace that token (max_replace 1)."""
    from radixlm.core.runtime.messages import ConstraintSpec
    from radixlm.core.runtime import constraint_compiler

    prompts = prompts_with_shared_prefixes(6)
    params = [{"max_new_tokens": 14 + i, "ignore_eos": True, "constraint": ConstraintSpec("regex", "stub")}
              for i in range(6)]
    got = {}
    for overlap in (False, True):
        made: list[JumpEveryThird] = []
        monkeypatch.setattr(constraint_compiler, "build_constraint", lambda *a, **kw: made.append(JumpEveryThird()) or made[-1])
        sched, finals = run_scheduler(512, prompts, params, enable_overlap_schedule=overlap)
        got[overlap] = ([out.output_ids for out in finals], [c.asked for c in made])
        assert (chained_steps(sched) > 0) == overlap and (chained_extends(sched) > 0) == overlap
        assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 512
    assert got[True] == got[False]
    assert all(asked[0] == 0 and 1 in asked for asked in got[True][1])  # jumps replaced sampled tokens
    # Alone, a request that may jump does not chain: a jump would leave a whole chained step unused.
    sched, finals = run_scheduler(512, prompts[:1], params[:1], enable_overlap_schedule=True)
    assert chained_steps(sched) == 0 and finals[0].output_ids == got[False][0][0]


def test_fake_runner_chains_across_extend_steps_with_mixed_requests(monkeypatch):
    """Jumping requests beside plain and penalized ones: the extend steps computing the jumped text take
    the other requests riding on the pending decode step's tokens (chained), and the outputs equal
    those without overlap, where every such step first applies the pending one."""
    from radixlm.core.runtime.messages import ConstraintSpec
    from radixlm.core.runtime import constraint_compiler

    monkeypatch.setattr(constraint_compiler, "build_constraint", lambda *a, **kw: JumpEveryThird())
    prompts = prompts_with_shared_prefixes(12)
    kinds = [{"constraint": ConstraintSpec("regex", "stub")}, {}, {"frequency_penalty": 1.5}]
    params = [{"max_new_tokens": 16 + i, "ignore_eos": i % 2 == 0, **kinds[i % 3]} for i in range(12)]
    got = {}
    for overlap in (False, True):
        sched, finals = run_scheduler(512, prompts, params, enable_overlap_schedule=overlap)
        got[overlap] = [out.output_ids for out in finals]
        assert (chained_extends(sched) > 0) == overlap
        assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 512
    assert got[True] == got[False]
    for out, prompt, p in zip(got[True], prompts, params):
        if "constraint" not in p and "frequency_penalty" not in p:
            assert out == oracle(prompt, p["max_new_tokens"], ignore_eos=p["ignore_eos"])


@pytest.mark.parametrize("num_slots", [80, 96])
def test_fake_runner_chained_extends_under_memory_pressure(monkeypatch, num_slots):
    """A small pool: requests are retracted, and jump-forward continuations wait holding their KV; they go
    first when planned (behind a request that cannot fit until their KV is freed they waited forever
    with overlap on). Outputs equal those without overlap, with extend steps chained."""
    from radixlm.core.runtime.messages import ConstraintSpec
    from radixlm.core.runtime import constraint_compiler

    monkeypatch.setattr(constraint_compiler, "build_constraint", lambda *a, **kw: JumpEveryThird())
    prompts = prompts_with_shared_prefixes(8)
    kinds = [{"constraint": ConstraintSpec("regex", "stub")}, {}]
    params = [{"max_new_tokens": 24, "ignore_eos": True, **kinds[i % 2]} for i in range(8)]
    got = {}
    for overlap in (False, True):
        sched, finals = run_scheduler(num_slots, prompts, params, max_running_requests=6,
                                      enable_overlap_schedule=overlap)
        got[overlap] = [out.output_ids for out in finals]
        assert sched.stats.retractions_total > 0 and (chained_extends(sched) > 0) == overlap
        assert all(out.finish.type == "length" for out in finals)
        assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == num_slots
    assert got[True] == got[False]


@pytest.mark.parametrize("caller", ["_apply_then_sample", "chain_extend", "after_chain_extend", "_extend_step"])
def test_a_failure_applying_a_late_sampled_step_leaks_no_kv(monkeypatch, caller):
    """The step fails while a pending step applies: in late sampling (the chained slots set aside), under
    an extend step with riders on the pending tokens (its continuations already given KV), in the
    first step after such an extend left its rows pending, or before an extend step whose riders could
    not chain: the requests in flight are aborted with a 500 and every KV slot comes back."""
    import sys

    from radixlm.core.runtime import constraint_compiler
    from radixlm.core.runtime.scheduler.execute import Executor
    from radixlm.core.runtime.scheduler.prefill import PrefillPlanner
    from radixlm.core.runtime.messages import ConstraintSpec

    monkeypatch.setattr(constraint_compiler, "build_constraint", lambda *a, **kw: JumpEveryThird())
    if caller == "_extend_step":  # riders cannot chain (as when memory is short): applied first
        monkeypatch.setattr(PrefillPlanner, "ride_ahead", lambda self, reqs: None)
    calls, resolve, chain_extend, extended = [0], Executor.resolve, Executor.chain_extend, [False]

    def chaining(self, extends, pending):
        nxt = chain_extend(self, extends, pending)
        extended[0] = extended[0] or nxt is not None
        return nxt

    def failing(self, pending):
        callers = (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name)
        if caller in callers or (caller == "after_chain_extend" and extended[0]):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("boom: the device failed")
        return resolve(self, pending)

    monkeypatch.setattr(Executor, "chain_extend", chaining)
    monkeypatch.setattr(Executor, "resolve", failing)
    prompts = prompts_with_shared_prefixes(4)
    params = [{"max_new_tokens": 40, "ignore_eos": True, "constraint": ConstraintSpec("regex", "stub")}] * 4
    sched, finals = run_scheduler(256, prompts, params, enable_overlap_schedule=True)
    assert calls[0] >= 3 and all(out.finish.type == "abort" for out in finals)
    assert (chained_extends(sched) > 0) == (caller != "_extend_step")
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 256


def test_bench_scheduler_with_overlap_computes_one_dropped_step():
    """benchmarks/bench_scheduler.py --overlap at a tiny size: one prefill step, one decode step per further
    token, and one more whose tokens are dropped (launched before the last token's finish is known)."""
    elapsed, cpu, steps, _, deferred = load_bench_scheduler().run_once(batch=3, prompt_len=5, new_tokens=4, seed=0, overlap=True)
    assert steps == 5 and 0 < deferred < elapsed


def test_overlap_with_tensor_parallelism_is_refused():
    with pytest.raises(radixlm.core.errors.InvalidRequestError, match="enable_overlap_schedule with tp_size"):
        EngineOptions.from_kwargs({"enable_overlap_schedule": True, "tp_size": 2})


# ---- the model runner: a decode input from the device ---------------------------------------------------


def test_decode_input_from_the_device_matches_host_ids(llama_ckpt):
    """A decode batch whose input ids come as a device tensor (input_future; the host list holds
    placeholders) gives the logits of the same batch with host ids, eagerly and on the padded static
    buffers that the CUDA graphs replay."""
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 256, "max_running_requests": 4})
    runner = ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt), opts)
    lens, rows = [4, 7, 2], [1, 0, 3]
    slots = iter(range(1, 200))
    prefill = BatchInput(False, [], [], [], rows, lens, lens, [])
    for row, n in zip(rows, lens):
        mine = [next(slots) for _ in range(n)]
        runner.req_to_token.write(row, 0, mine)
        prefill.input_ids += [(row * 37 + j * 11) % 500 for j in range(n)]
        prefill.positions += list(range(n))
        prefill.out_cache_loc += mine
    runner.forward(prefill)
    ids = [17, 301, 42]
    decode = BatchInput(True, ids, list(lens), [next(slots) for _ in lens], rows, [n + 1 for n in lens], [1] * 3,
                        [0, 1, 2])
    expected = runner.forward(decode).clone()
    future = dataclasses.replace(decode, input_ids=[0, 0, 0], input_future=torch.tensor(ids))
    torch.testing.assert_close(runner.forward(future), expected, rtol=1e-5, atol=1e-5)
    graphs = DecodeGraphRunner(runner, max_bs=4, capture=False)
    torch.testing.assert_close(graphs.run(future), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(runner.forward(dataclasses.replace(decode, input_ids=[0, 0, 0])), expected)


def test_extend_input_from_the_device_matches_host_ids(llama_ckpt):
    """An extend batch whose riding rows take their input ids from a device tensor (extend_batch with
    `future`: the ids go to the device with those tokens scattered in) gives the logits of the same
    batch with host ids, eagerly and on the padded static buffers that the extend CUDA graphs replay."""
    from radixlm.core.runtime.execution.cuda_graph_runner import ExtendGraphRunner
    from radixlm.core.runtime.scheduler.batch import extend_batch
    from radixlm.core.runtime.scheduler.prefill import Extend
    from test_scheduler_units import make_req

    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 256, "max_running_requests": 4})
    runner = ModelRunner(llama_ckpt, ModelConfig.from_dir(llama_ckpt), opts)
    reqs = [make_req([(r * 37 + j * 11) % 500 for j in range(n)], arrival=r) for r, n in enumerate([5, 3, 6])]
    slots = iter(range(1, 200))
    for row, req in enumerate(reqs):  # each request's prompt in the cache but for its last token
        req.row, req.slots = row, [next(slots) for _ in req.fill_ids]
        runner.req_to_token.write(row, 0, req.slots)
    prefill, _ = extend_batch([Extend(r, 0, len(r.fill_ids), True) for r in reqs])
    runner.forward(prefill)
    ids = [17, 301]  # what a pending step sampled for the riders (requests 0 and 2)
    for req, token in zip((reqs[0], reqs[2]), ids):
        req.slots.append(next(slots))
        runner.req_to_token.write(req.row, len(req.fill_ids), req.slots[-1:])
    reqs[1].output_ids, reqs[1].slots = [88, 99], reqs[1].slots + [next(slots), next(slots)]
    runner.req_to_token.write(reqs[1].row, 3, reqs[1].slots[3:])
    riders = [Extend(reqs[0], 5, 1, True, rides_along=True, ahead=True), Extend(reqs[2], 6, 1, True, rides_along=True, ahead=True)]
    batch, _ = extend_batch([Extend(reqs[1], 3, 2, True), *riders], future=torch.tensor(ids))
    assert batch.input_ids == [88, 99, 0, 0] and batch.input_future.tolist() == [88, 99, *ids]
    host = dataclasses.replace(batch, input_ids=[88, 99, *ids], input_future=None)
    expected = runner.forward(host).clone()
    torch.testing.assert_close(runner.forward(batch), expected, rtol=1e-5, atol=1e-5)
    graphs = ExtendGraphRunner(runner, max_bs=4, max_tokens=16, capture=False)
    torch.testing.assert_close(graphs.run(batch, graphs.bucket_for(batch)), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(runner.forward(dataclasses.replace(batch, input_future=None)), expected)


# ---- the tiny Llama engine: overlap on equals overlap off ---------------------------------------------

PROMPTS = ["Once upon a time", "The harbour at dawn", "Tell me a story about the lighthouse keeper", "short"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def count_chained(engine) -> list[int]:
    """Counts the engine's steps whose input came from the device (a list, updated): decode steps, then
    extend steps with riders on a pending step's tokens."""
    runner, count = engine._runner, [0, 0]
    forward = runner.forward

    def counting(batch):
        if batch.input_future is not None:
            count[0 if batch.is_decode else 1] += 1
        return forward(batch)

    runner.forward = counting
    return count


def same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


@pytest.fixture(scope="module")
def engines(llama_ckpt):
    with radixlm.Engine(llama_ckpt, max_total_tokens=4096, debug_check_invariants=True) as off, \
            radixlm.Engine(llama_ckpt, max_total_tokens=4096, debug_check_invariants=True,
                           enable_overlap_schedule=True) as on:
        chained = count_chained(on)
        yield off, on, chained
        for e in (off, on):
            assert e.flush_cache()
            stats = e.get_stats()
            assert stats["kv_slots_free"] == stats["kv_slots_total"]


CASES = {
    "batch": {"max_new_tokens": 24, "temperature": 0},
    "ignore_eos": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
    "max_new_tokens_1": {"max_new_tokens": 1, "temperature": 0},
    "n_3": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 3},
    "stop_token_and_min_new": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "min_new_tokens": 4,
                               "stop_token_ids": [3, 7, 11]},
    "logprobs": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
    "penalty": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "frequency_penalty": 1.5},
    "seeded": {"max_new_tokens": 16, "temperature": 1.0, "seed": 7},
    "json_jump_forward": {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
}


@pytest.mark.parametrize("case", CASES)
def test_engine_outputs_equal_with_overlap_on_and_off(engines, case):
    """Every case chains its decode steps (those whose sampling reads the newest token sampled late,
    after the pending step applies), and gives the outputs of the engine without overlap."""
    params = CASES[case]
    kwargs = {"return_logprob": True, "top_logprobs_num": 2} if case == "logprobs" else {}
    chained_before = engines[2][0]
    off, on = (e.generate(PROMPTS, params, **kwargs) for e in engines[:2])
    assert (engines[2][0] > chained_before) == (params["max_new_tokens"] > 2)
    for a, b in zip(off, on):
        same(a, b)
        if kwargs:
            lp_a, lp_b = (o["meta_info"]["output_token_logprobs"] for o in (a, b))
            assert [t for _, t, _ in lp_a] == [t for _, t, _ in lp_b] == a["output_ids"]
            assert [v for v, _, _ in lp_a] == pytest.approx([v for v, _, _ in lp_b], abs=1e-5)


def test_engine_json_jump_forward_in_a_mixed_batch_chains_extend_steps(engines):
    """JSON requests with jump-forward beside plain, penalized, seeded and min_new_tokens ones, at batch 12,
    with logprobs: the extend steps that compute jumped text chain on the pending decode step (riders take
    its tokens on the device), and every output equals the engine's without overlap."""
    schema = json.dumps(SCHEMA)
    prompts = [f"{PROMPTS[i % 4]} #{i}" for i in range(12)]
    kinds = [{"json_schema": schema}, {"ignore_eos": True}, {"ignore_eos": True, "repetition_penalty": 1.3},
             {"json_schema": schema, "frequency_penalty": 0.5}, {"json_schema": schema, "temperature": 1.0, "seed": 3},
             {"ignore_eos": True, "min_new_tokens": 30}]
    params = [{"max_new_tokens": 40, "temperature": 0, **kinds[i % len(kinds)]} for i in range(12)]
    off, on, chained = engines
    before = chained[1]
    want, got = (e.generate(prompts, params, return_logprob=True, top_logprobs_num=2) for e in (off, on))
    assert chained[1] > before
    for a, b in zip(want, got):
        same(a, b)
        lp_a, lp_b = (o["meta_info"]["output_token_logprobs"] for o in (a, b))
        assert [v for v, _, _ in lp_a] == pytest.approx([v for v, _, _ in lp_b], abs=1e-5)
    ended = [o for o, p in zip(got, params) if "json_schema" in p and o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended and all(json.loads(o["text"]).keys() == {"name", "age"} for o in ended)


def test_engine_stop_strings_and_streams_equal_with_overlap(engines):
    off, on, _ = engines
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    text = off.generate(PROMPTS[0], params)["text"]
    stop = {**params, "stop": [text[3:7]]}
    for p in (params, stop):
        full = off.generate(PROMPTS, p)
        for prompt, ref in zip(PROMPTS, full):
            same(ref, on.generate(prompt, p))
            chunks = list(on.generate(prompt, p, stream=True))
            assert "".join(c["text"] for c in chunks) == ref["text"]
            assert sum(len(c["output_ids"]) for c in chunks) == len(ref["output_ids"])


def test_engine_abort_with_overlap_frees_memory(engines):
    _, on, _ = engines
    assert on.flush_cache()
    stream = on.generate("Abort me", {"max_new_tokens": 500, "ignore_eos": True}, stream=True, rid="to-abort")
    next(stream)
    on.abort_request("to-abort")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert on.flush_cache()
    stats = on.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"]


@pytest.mark.parametrize("extra", [{}, {"hicache_size_gb": 0.001}], ids=["retraction", "host_tier"])
def test_small_pool_equal_with_overlap(llama_ckpt, extra):
    prompts = [PROMPTS[2] + f" number {i}" for i in range(6)] + ["short"]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    got = {}
    for overlap in (False, True):
        with radixlm.Engine(llama_ckpt, max_total_tokens=160, debug_check_invariants=True,
                            enable_overlap_schedule=overlap, **extra) as e:
            chained = count_chained(e)
            got[overlap] = [o["output_ids"] for o in e.generate(prompts, params)]
            got[overlap].append(e.generate(prompts[0], params)["output_ids"])  # after spilling: host hits
            stats = e.get_stats()
            assert stats["hicache_host_hit_tokens_total"] > 0 if extra else stats["retractions_total"] > 0
            assert (chained[0] > 0) == overlap
            assert e.flush_cache() and e.get_stats()["kv_slots_free"] == stats["kv_slots_total"]
    assert got[True] == got[False]
