"""The request front end (core.runtime.frontend): streams of batches and n > 1, aborting a request with its
n samples, and its detokenizer stage. Oracle: the same requests without streaming (whole outputs)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import radixlm
from radixlm.core.runtime.branches import branch_params, branch_rid
from radixlm.core.runtime.sampling_params import SamplingParams

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The harbour at dawn", "A list of colours:"]


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    with radixlm.Engine(llama_ckpt, max_total_tokens=4096, debug_check_invariants=True) as e:
        yield e


def _joined(chunks: list[dict], count: int) -> list[tuple[str, list[int]]]:
    """Each request's text and ids, from its chunks (tagged with "index" when there are several)."""
    texts, ids = [""] * count, [[] for _ in range(count)]
    for c in chunks:
        i = c.get("index", 0)
        texts[i] += c["text"]
        ids[i] += c["output_ids"]
    return list(zip(texts, ids))


def test_n_splitting_names_and_seeds_the_samples():
    sp = SamplingParams.from_dict({"n": 3, "seed": 7})
    assert [(p.n, p.seed) for p in branch_params(sp)] == [(1, 7), (1, 8), (1, 9)]
    assert [p.seed for p in branch_params(SamplingParams.from_dict({"n": 2}))] == [None, None]
    assert branch_rid("req", 1, 3) == "req-1" and branch_rid("req", 0, 1) == "req"


def test_a_batch_with_n_streams_as_its_whole_outputs(engine):
    params = {**GREEDY, "n": 2, "stop": ["zz"]}
    whole = engine.generate(PROMPTS, params)
    chunks = list(engine.generate(PROMPTS, params, stream=True))
    assert sorted({c["index"] for c in chunks}) == [0, 1, 2, 3]
    assert _joined(chunks, 4) == [(o["text"], o["output_ids"]) for o in whole]
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert len(finals) == 4 and all(c["meta_info"]["completion_tokens"] == 10 for c in finals)

    async def collect() -> list[dict]:
        return [c async for c in await engine.async_generate(PROMPTS, params, stream=True)]

    assert _joined(asyncio.run(collect()), 4) == [(o["text"], o["output_ids"]) for o in whole]


def test_leaving_a_batch_stream_early_aborts_every_request(engine):
    it = engine.generate(PROMPTS, {**GREEDY, "max_new_tokens": 500}, stream=True)
    next(it)
    it.close()
    stats = engine.get_stats()
    assert stats["in_flight"] == 0 and stats["running"] == stats["waiting"] == 0


def test_abort_request_ends_all_n_samples(engine):
    box: list = []
    t = threading.Thread(target=lambda: box.append(engine.generate(
        "Many samples", {**GREEDY, "max_new_tokens": 1500, "n": 3}, rid="group")))
    t.start()
    while engine.get_stats()["running"] < 3:
        pass
    engine.abort_request("group")
    t.join(60)
    assert [o["meta_info"]["id"] for o in box[0]] == ["group-0", "group-1", "group-2"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in box[0])


def test_stream_text_is_the_whole_text_with_stop_strings_and_multibyte_tokens(engine):
    """The front end decodes: chunks hold back a possible stop-string start and add up to the whole text."""
    for prompt in ("Über die Brücke", "ein 😀 lächeln"):
        params = {"max_new_tokens": 40, "temperature": 0, "stop": ["e", "\n\n"]}
        whole = engine.generate(prompt, params)
        chunks = list(engine.generate(prompt, params, stream=True))
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_a_stream_that_fell_behind_gets_its_queued_chunks_merged(engine):
    """An async consumer that falls behind (a busy event loop) takes what was queued meanwhile as one
    chunk per request: fewer chunks, the same texts, ids and logprobs as the whole outputs."""
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "n": 2}
    whole = engine.generate("The harbour at dawn", params, return_logprob=True)

    async def slow() -> list[dict]:
        stream = await engine.async_generate("The harbour at dawn", params, return_logprob=True, stream=True)
        first = await stream.__anext__()  # (the requests go in on the first step)
        await asyncio.sleep(1.5)  # the rest is queued meanwhile
        return [first] + [c async for c in stream]

    chunks = asyncio.run(slow())
    assert len(chunks) < 2 * params["max_new_tokens"]
    assert _joined(chunks, 2) == [(w["text"], w["output_ids"]) for w in whole]
    for i, w in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        logprobs = [lp for c in mine for lp in c["meta_info"]["output_token_logprobs"]]
        expected = w["meta_info"]["output_token_logprobs"]  # (a cached prefix may change the last digits)
        assert [lp[1] for lp in logprobs] == [lp[1] for lp in expected]
        assert [lp[0] for lp in logprobs] == pytest.approx([lp[0] for lp in expected], abs=1e-4)
        assert mine[-1]["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]


def test_merging_chunks_carries_replaced_ids():
    """A jump-forward chunk's ids replace the last ones sent: merged, they come off the earlier chunk's
    new ids first, and only the rest is still to replace."""
    from radixlm.core.runtime.delivery import merge_chunks

    def chunk(text, ids, replaced=0, finish=None):
        meta = {"completion_tokens": 0, "finish_reason": finish, **({"replaced_ids": replaced} if replaced else {})}
        return {"text": text, "output_ids": ids, "meta_info": meta}

    merged = merge_chunks(chunk("a", [1, 2], replaced=1), chunk("b", [7, 8, 9], replaced=1))
    assert merged["output_ids"] == [1, 7, 8, 9] and merged["text"] == "ab"
    assert merged["meta_info"]["replaced_ids"] == 1
    merged = merge_chunks(chunk("a", [1, 2]), chunk("b", [7], replaced=3, finish={"type": "length"}))
    assert merged["output_ids"] == [7] and merged["meta_info"]["replaced_ids"] == 1
    assert merged["meta_info"]["finish_reason"] == {"type": "length"}
    assert "replaced_ids" not in merge_chunks(chunk("a", [1]), chunk("b", [2]))["meta_info"]
