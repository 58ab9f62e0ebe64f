"""The engine against HF transformers on the same tiny random checkpoints: greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import radixlm

CHECKPOINTS = ["llama_ckpt", "llama_tied_ckpt", "qwen2_ckpt", "mistral_ckpt", "llama3_rope_ckpt", "sharded_ckpt"]

SHARED = "In a quiet village by the sea, the old lighthouse keeper told every visitor the same story: "
PROMPTS = [
    SHARED + "the storm",
    "Completely unrelated words",
    SHARED + "the ship that never came back",
    SHARED + "a whale",
    "x",
]
MAX_NEW = 12


class HFOracle:
    def __init__(self, path: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def greedy(self, prompt: str, max_new: int) -> list[int]:
        ids = self.tok(prompt, return_tensors="pt").input_ids
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log-softmax over the next token after every position of ids."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def ckpt(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def oracle(ckpt) -> HFOracle:
    return HFOracle(ckpt)


@pytest.fixture(scope="module")
def expected(oracle) -> list[list[int]]:
    return [oracle.greedy(p, MAX_NEW) for p in PROMPTS]


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 7},
        {"chunked_prefill_size": 5, "max_total_tokens": 96, "max_running_requests": 3},
        {"disable_cpu_prepack": True},  # the prepacked linears' twin, F.linear on the plain weights
    ],
    ids=["radix", "no-radix", "chunked", "chunked-small-pool", "plain-linear"],
)
def test_greedy_matches_hf(ckpt, expected, options):
    options = {"max_total_tokens": 2048, **options}  # small pools keep the per-step invariant check cheap
    with radixlm.Engine(ckpt, debug_check_invariants=True, **options) as engine:
        # one at a time, then as one mixed batch (shared prefixes now partly cached), then again
        singles = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        assert singles == expected
        batch = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert batch == expected
        assert engine.flush_cache()
        batch = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert batch == expected
        engine.check_invariants()


def test_logprobs_match_hf(ckpt, oracle):
    with radixlm.Engine(ckpt, chunked_prefill_size=6) as engine:
        # warm the cache with the shared prefix: input logprobs must still cover the whole prompt
        engine.generate(PROMPTS[0], GREEDY)
        outs = engine.generate(PROMPTS[:3], GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    for prompt, out in zip(PROMPTS, outs):
        prompt_ids = oracle.tok(prompt)["input_ids"]
        ids = prompt_ids + out["output_ids"]
        ref = oracle.logprobs(ids)
        meta = out["meta_info"]
        inp = meta["input_token_logprobs"]
        assert [t for _, t, _ in inp] == prompt_ids
        assert inp[0][0] is None
        for pos in range(1, len(prompt_ids)):
            assert inp[pos][0] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
            top = meta["input_top_logprobs"][pos]
            ref_top = ref[pos - 1].topk(3)
            assert [t for _, t, _ in top] == ref_top.indices.tolist()
        for j, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
            pos = len(prompt_ids) + j
            assert tok == ids[pos]
            assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
            assert meta["output_top_logprobs"][j][0][1] == tok  # greedy: the top token is the one taken


def test_logprob_start_len_limits_input_logprobs(llama_ckpt):
    with radixlm.Engine(llama_ckpt) as engine:
        ids = engine.tokenizer(PROMPTS[2])["input_ids"]
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=5)
        assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids[5:]
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
        assert all(lp is not None for lp, _, _ in out["meta_info"]["input_token_logprobs"])
