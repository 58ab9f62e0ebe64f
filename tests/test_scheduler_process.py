"""The front end / scheduler boundary (issue 15): every message is plain picklable data, and the
scheduler loop run in its own process (`scheduler_process=True`) gives what the in-thread engine gives.
Oracle: the in-thread engine on the same tiny checkpoint, greedy."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

import radixlm
from radixlm.core.runtime import messages as m
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.errors import EngineShutdownError, InvalidRequestError

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The harbour at dawn", "A list of colours:", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
OPTIONS = {"max_total_tokens": 2048, "debug_check_invariants": True}


def _every_message() -> list:
    sp = SamplingParams.from_dict({"json_schema": json.dumps(SCHEMA), "stop": ["\n"], "logit_bias": {5: 1.0}})
    return [
        m.GenerateRequest("r1", [1, 2, 3], sp, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                          stream=True, constraint=m.ConstraintSpec.of(sp)),
        m.GenerateRequest("r2", [4], SamplingParams(choices=["yes", "no"]),
                          constraint=m.ConstraintSpec.of(SamplingParams(choices=["yes", "no"]))),
        m.GenerateOutput("r1", [7, 8], replaced=1, prompt_tokens=3, completion_tokens=4, cached_tokens=2,
                         input_token_logprobs=[(None, 1, None), (-0.5, 2, None)], input_top_logprobs=[None, [(-0.5, 2, None)]],
                         output_token_logprobs=[(-0.1, 7, None)], output_top_logprobs=[[(-0.1, 7, None)]],
                         finish=m.FinishReason("abort", None, "aborted by request", 500), e2e_latency=0.5, ttft=0.1,
                         queue_time=0.01, dp_rank=1),
        m.GenerateOutput("r2", [9], finish=m.FinishReason("stop", "\n")),
        m.Abort("r1"), m.FlushCache(3), m.GetStats(4), m.CheckInvariants(5),
        m.CallReply(4, {"running": 0, "cache_hit_rate": 0.5}),
        m.StatsSnapshot({"running": 1}, 12.5), m.Ready(4096),
    ]


@pytest.mark.parametrize("msg", _every_message(), ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_through_pickle_and_holds_only_data(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg

    def plain(value) -> bool:  # nothing callable, no lock, queue, tensor or tokenizer inside
        if dataclasses.is_dataclass(value):
            return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(plain(k) and plain(v) for k, v in value.items())
        return value is None or isinstance(value, (str, int, float, bool))

    assert plain(msg)


def test_replies_carry_errors_across_the_boundary():
    reply = pickle.loads(pickle.dumps(m.CallReply(1, error=InvalidRequestError("bad", "rid"))))
    assert type(reply.error) is InvalidRequestError and str(reply.error) == "bad"
    ready = pickle.loads(pickle.dumps(m.Ready(error=EngineShutdownError("no"))))
    assert type(ready.error) is EngineShutdownError


@pytest.fixture(scope="module")
def engines(llama_ckpt):
    with radixlm.Engine(llama_ckpt, **OPTIONS) as thread, \
            radixlm.Engine(llama_ckpt, scheduler_process=True, **OPTIONS) as process:
        yield thread, process


def _strip(out: dict, *also: str) -> dict:
    """An output without its timings (which differ run to run), nor the meta fields `also` names."""
    meta = {k: v for k, v in out["meta_info"].items() if k not in ("e2e_latency", "ttft", "queue_time", *also)}
    return {**out, "meta_info": meta}


def _same(a, b) -> bool:
    """Equal, floats within 1e-5: two processes may sum in another order (their torch thread counts
    differ), which moves logprobs by about 1e-6 and nothing else."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_process_mode_matches_the_thread_engine(engines):
    thread, process = engines
    assert process.kv_pool_size == thread.kv_pool_size and process.context_len == thread.context_len
    batch = dict(prompt=PROMPTS, sampling_params=GREEDY, rid=["a", "b", "c"], return_logprob=True, top_logprobs_num=2)
    assert _same([_strip(o) for o in process.generate(**batch)], [_strip(o) for o in thread.generate(**batch)])
    n2 = dict(prompt="Two samples", sampling_params={**GREEDY, "n": 2}, rid="pair")
    outs = process.generate(**n2)
    assert [o["meta_info"]["id"] for o in outs] == ["pair-0", "pair-1"]
    # Whether the second sample finds the first's prompt cached depends on whether both reached the
    # scheduler before its next step (a process queue's items arrive one by one): not compared.
    assert [_strip(o, "cached_tokens") for o in outs] == [_strip(o, "cached_tokens") for o in thread.generate(**n2)]
    stream = dict(prompt="Streaming along", sampling_params={**GREEDY, "stop": ["zz"]}, stream=True)
    chunks = [list(e.generate(**stream)) for e in (thread, process)]
    assert [(c["text"], c["output_ids"]) for c in chunks[1]] == [(c["text"], c["output_ids"]) for c in chunks[0]]
    assert "".join(c["text"] for c in chunks[1]) == thread.generate("Streaming along", {**GREEDY, "stop": ["zz"]})["text"]


def test_process_mode_constrains_from_the_spec(engines):
    thread, process = engines
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    out = process.generate("A person:", params)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert _strip(out)["output_ids"] == thread.generate("A person:", params)["output_ids"]
    with pytest.raises(InvalidRequestError, match="regex"):  # refused by the front end, before queueing
        process.generate("x", {"regex": "(unclosed"})


def test_process_mode_streams_aborts_flushes_and_counts(engines):
    _, process = engines

    async def aborted_stream() -> dict:
        it = await process.async_generate("An endless story", {"max_new_tokens": 400, "temperature": 0,
                                                               "ignore_eos": True}, stream=True, rid="long")
        last = await it.__anext__()
        assert last["meta_info"]["finish_reason"] is None
        process.abort_request("long")
        async for last in it:
            pass
        return last

    assert asyncio.run(aborted_stream())["meta_info"]["finish_reason"]["type"] == "abort"
    stats = process.get_stats()
    assert stats["running"] == stats["waiting"] == stats["in_flight"] == 0 and stats["aborted_total"] >= 1
    assert process.flush_cache() is True
    assert process.get_stats()["kv_slots_cached"] == 0
    process.check_invariants()
    time.sleep(0.6)  # the child publishes its statistics a few times a second
    assert process.stats_snapshot()["kv_slots_total"] == process.kv_pool_size


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_dead_scheduler_process_fails_callers_and_shutdown_leaves_no_process(llama_ckpt):
    engine = radixlm.Engine(llama_ckpt, scheduler_process=True, **OPTIONS)
    pid = engine.frontend.scheduler.pid
    stream = engine.generate("Going on", {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}, stream=True)
    next(stream)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineShutdownError):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    with pytest.raises(EngineShutdownError):
        engine.generate("after", GREEDY)
    engine.shutdown()
    # A clean shutdown reaps the child.
    with radixlm.Engine(llama_ckpt, scheduler_process=True, **OPTIONS) as engine:
        pid = engine.frontend.scheduler.pid
        assert engine.generate("hi", GREEDY)["meta_info"]["completion_tokens"] == 12
    assert _gone(pid, within=1)


def test_the_scheduler_process_exits_with_its_parent(llama_ckpt):
    """No orphan: the parent is killed outright (no shutdown, no atexit) and the child goes too."""
    code = ("import os, radixlm; e = radixlm.Engine(%r, scheduler_process=True, max_total_tokens=2048); "
            "print(e.frontend.scheduler.pid, flush=True); os.kill(os.getpid(), 9)" % llama_ckpt)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    assert _gone(pid, within=5)
