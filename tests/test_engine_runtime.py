"""Engine behaviour: prefix reuse, KV accounting, retraction, fairness, streaming, aborts, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

import radixlm
from radixlm.core.errors import InvalidRequestError, UnsupportedModelError

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PREFIX = ("System: you are a careful assistant who answers questions about the lighthouse, the harbour, "
          "the fishing boats and the weather of the northern coast. Question: ")


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    with radixlm.Engine(llama_ckpt, max_total_tokens=4096, debug_check_invariants=True) as e:
        yield e


def test_shared_prefix_is_computed_once(engine):
    assert engine.flush_cache()
    before = engine.get_stats()
    prompts = [PREFIX + q for q in ("where?", "when did it happen?", "who was there?", "why?")]
    prefix_len = len(engine.tokenizer(PREFIX)["input_ids"])
    outs = engine.generate(prompts, GREEDY)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0  # the first computes the prefix...
    assert all(c >= prefix_len - 2 for c in cached[1:])  # ...every other reuses it (up to BPE merges at the seam)
    after = engine.get_stats()
    reused = after["cached_tokens_total"] - before["cached_tokens_total"]
    prompt_tokens = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert reused == sum(cached)
    assert prompt_tokens == sum(o["meta_info"]["prompt_tokens"] for o in outs)
    assert after["cache_hit_rate"] == after["cached_tokens_total"] / after["prompt_tokens_total"]
    # n > 1 branches share the prompt's KV too
    fresh = "A different long prompt about mountains, rivers, forests and the animals that live there. " * 2
    outs = engine.generate(fresh, {**GREEDY, "n": 3})
    prompt_len = outs[0]["meta_info"]["prompt_tokens"]
    assert len(outs) == 3 and sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, prompt_len - 1, prompt_len - 1]


def test_flush_frees_every_slot(engine):
    engine.generate([PREFIX + str(i) for i in range(6)], GREEDY)
    stats = engine.get_stats()
    assert stats["kv_slots_cached"] > 0
    assert engine.flush_cache()
    stats = engine.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"]
    assert stats["kv_slots_cached"] == 0


def test_small_pool_retracts_and_matches_large_pool(llama_ckpt):
    prompts = [PREFIX + f"question number {i}" for i in range(6)] + ["short"]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(llama_ckpt) as big:
        expected = [o["output_ids"] for o in big.generate(prompts, params)]
    with radixlm.Engine(llama_ckpt, max_total_tokens=160, debug_check_invariants=True) as small:
        got = [o["output_ids"] for o in small.generate(prompts, params)]
        stats = small.get_stats()
        assert small.flush_cache()
        assert small.get_stats()["kv_slots_free"] == stats["kv_slots_total"]
    assert got == expected
    assert stats["retractions_total"] > 0


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "lof", "random"])
def test_every_policy_gives_the_same_greedy_outputs(llama_ckpt, policy):
    prompts = [PREFIX + "a", "other text entirely", PREFIX + "b", PREFIX[:40] + "c"]
    with radixlm.Engine(llama_ckpt, schedule_policy=policy, max_running_requests=2, max_total_tokens=2048,
                        debug_check_invariants=True) as e:
        got = [o["output_ids"] for o in e.generate(prompts, GREEDY)]
        ref = [e.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert got == ref


def _later_requests_overtaking_unrelated(ckpt: str, bound: int) -> int:
    """Queues 10 prefix-sharing requests, an unrelated one, then 20 more sharing ones, on an engine
    that runs one request at a time (so completion order is scheduling order). Returns how many of
    the requests that arrived after the unrelated one overtook it. LPM reorders here at any memory
    pressure (the pool holds them all, which would otherwise keep arrival order)."""
    with radixlm.Engine(ckpt, max_running_requests=1, schedule_fairness_bound=bound,
                        schedule_only_under_pressure=False) as e:
        e.generate(PREFIX, {"max_new_tokens": 1})  # the prefix is cached: every sharing request matches it
        params = {"max_new_tokens": 2}

        async def main() -> list[str]:
            finished: list[str] = []

            def submit(prompt: str, label: str) -> asyncio.Future:
                task = asyncio.ensure_future(e.async_generate(prompt, params))
                task.add_done_callback(lambda _: finished.append(label))
                return task

            tasks = [submit(PREFIX + f"early {i}", "early") for i in range(10)]
            tasks.append(submit("zz unrelated prompt that matches nothing", "unrelated"))
            tasks += [submit(PREFIX + f"late {i}", "late") for i in range(20)]
            await asyncio.gather(*tasks)
            return finished

        finished = asyncio.run(main())
        return finished[: finished.index("unrelated")].count("late")


def test_lpm_does_not_starve_an_unrelated_request(llama_ckpt):
    """Under LPM a stream of requests sharing a cached prefix always matches better than an unrelated
    request; the fairness bound still gets it scheduled before more than `bound` later ones overtake it."""
    bound = 4
    assert _later_requests_overtaking_unrelated(llama_ckpt, bound) <= bound + 1
    # the same workload without an effective bound: pure LPM lets every later request overtake it
    assert _later_requests_overtaking_unrelated(llama_ckpt, 10_000) == 20


def test_streaming_concatenates_to_the_full_text(engine):
    params = {"max_new_tokens": 30, "temperature": 0}
    full = engine.generate("Tell me a story", params)
    chunks = list(engine.generate("Tell me a story", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum(len(c["output_ids"]) for c in chunks) == len(full["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stop_strings_split_across_tokens(engine):
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    text = engine.generate("Once upon a time", params)["text"]
    assert len(text) > 6
    stop = text[3:7]  # 4 characters that very likely span a token boundary
    out = engine.generate("Once upon a time", {**params, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate("Once upon a time", {**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    streamed = "".join(c["text"] for c in engine.generate("Once upon a time", {**params, "stop": [stop]}, stream=True))
    assert streamed == out["text"]


def test_stop_token_ids_and_min_new_tokens(engine):
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    ids = engine.generate("Once upon a time", params)["output_ids"]
    out = engine.generate("Once upon a time", {**params, "stop_token_ids": [ids[4]]})
    assert out["output_ids"] == ids[: ids.index(ids[4]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[4]}
    forced = engine.generate("Once upon a time", {**params, "stop_token_ids": [ids[0]], "min_new_tokens": 5})
    assert len(forced["output_ids"]) >= 5 and ids[0] not in forced["output_ids"][:5]
    # a stop string the output reaches before min_new_tokens does not end (or cut) it
    text = engine.generate("Once upon a time", params)["text"]
    early = engine.generate("Once upon a time", {**params, "stop": [text[:2]], "min_new_tokens": 10})
    assert len(early["output_ids"]) >= 10 and early["text"].startswith(text[:2])


def test_seeded_sampling_is_reproducible(engine):
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    a = engine.generate("Seeded", params)["output_ids"]
    b = engine.generate("Seeded", params)["output_ids"]
    assert a == b
    outs = engine.generate("Seeded", {**params, "n": 4})
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_sampling_filters_restrict_the_support(engine):
    # top_k=1 is greedy whatever the temperature; min_p=1 keeps only the most likely token
    greedy = engine.generate("Filters", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})["output_ids"]
    for params in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        out = engine.generate("Filters", {"max_new_tokens": 10, "temperature": 1.5, "ignore_eos": True, **params})
        assert out["output_ids"] == greedy, params


def test_penalties_change_greedy_output(engine):
    base = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = engine.generate("Repeat", base)["output_ids"]
    penalized = engine.generate("Repeat", {**base, "frequency_penalty": 2.0})["output_ids"]
    assert max(penalized.count(t) for t in set(penalized)) <= max(plain.count(t) for t in set(plain))
    bias = engine.generate("Repeat", {**base, "logit_bias": {plain[0]: -100.0}})["output_ids"]
    assert plain[0] not in bias


def test_abort_frees_memory(engine):
    assert engine.flush_cache()
    stream = engine.generate("Abort me", {"max_new_tokens": 500, "ignore_eos": True}, stream=True, rid="to-abort")
    next(stream)
    engine.abort_request("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.flush_cache()
    stats = engine.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"]


def test_async_generate(engine):
    async def main():
        one = await engine.async_generate("async", GREEDY)
        many = await asyncio.gather(*(engine.async_generate(f"async {i}", GREEDY) for i in range(5)))
        chunks = [c async for c in await engine.async_generate("async", GREEDY, stream=True)]
        return one, many, chunks

    one, many, chunks = asyncio.run(main())
    assert one["output_ids"] == engine.generate("async", GREEDY)["output_ids"]
    assert len(many) == 5
    assert "".join(c["text"] for c in chunks) == one["text"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": "x", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "word " * 3000}, "prompt"),
        ({"input_ids": [1, 2, 10**9]}, "input_ids"),
        ({"prompt": "x", "input_ids": [1]}, "prompt"),
        ({"prompt": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(engine, kwargs, param):
    with pytest.raises(ValueError) as info:
        engine.generate(**kwargs)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == param
    assert param in str(info.value) or param == "prompt"
    assert engine.generate("still alive", GREEDY)["meta_info"]["completion_tokens"] == 8


def test_unknown_engine_option_is_an_error(llama_ckpt):
    with pytest.raises(ValueError, match="max_batch"):
        radixlm.Engine(llama_ckpt, max_batch=4)


def test_unsupported_architecture_names_it(llama_ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        radixlm.Engine(str(bad))


def test_default_model_runs_without_a_path():
    with radixlm.Engine(max_total_tokens=1024) as e:
        out = e.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 4
    assert e.model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(e.model_path)


def test_shutdown_releases_weights_and_kv_pool(llama_ckpt):
    """After shutdown nothing of the engine holds its weights or KV pool any more, so their memory goes
    back to the process for the next engine (on a GPU: the next engine's KV pool is sized from it)."""
    import gc
    import weakref

    engine = radixlm.Engine(llama_ckpt, max_total_tokens=512)
    assert engine.generate("hi", {"max_new_tokens": 2, "temperature": 0})["output_ids"]
    kv = weakref.ref(engine._runner.kv_pool.k_buffers[0])
    weight = weakref.ref(engine._runner.model.lm_head.weight)
    engine.shutdown()
    gc.collect()
    assert kv() is None and weight() is None
    with pytest.raises(Exception, match="shut"):
        engine.generate("hi", {"max_new_tokens": 2})


def test_unset_max_new_tokens_runs_to_the_end_of_the_context(llama_ckpt):
    with radixlm.Engine(llama_ckpt, context_length=32, max_total_tokens=256) as e:
        ids = list(range(5, 15))
        out = e.generate(input_ids=ids, sampling_params={"max_new_tokens": None, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 32 - len(ids)
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):  # an explicit one past it is refused
            e.generate(input_ids=ids, sampling_params={"max_new_tokens": 23})
