"""LLaVA in the engine against transformers' LlavaForConditionalGeneration on the same tiny random
checkpoint: prompt logprobs (with top-k) and greedy tokens, single and batched, with the image prefix
computed and served from the radix cache, whole and chunked; and the cache keyed by image content."""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

import radixlm
from radixlm.core.errors import InvalidRequestError
from radixlm.testing.vision import build_llava_checkpoint, png_bytes, sample_image

QUESTION = "<|im_start|>user\n<image>\nWhat is in this picture? Describe it.<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\n<image>\nWhat colour is it?<|im_end|>\n<|im_start|>assistant\n"
TOP = 5
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava_checkpoint(str(tmp_path_factory.mktemp("llava") / "ckpt"))


class Oracle:
    def __init__(self, path: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.processor = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=self.tok,
                                        patch_size=14, vision_feature_select_strategy="default",
                                        num_additional_image_tokens=1)  # the class token, as llava-hf sets it
        self.model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(self, prompt: str, image) -> dict:
        return self.processor(text=prompt, images=image, return_tensors="pt")

    @torch.no_grad()
    def logprobs(self, prompt: str, image) -> tuple[list[int], torch.Tensor]:
        """The expanded prompt ids and the log-softmax after each position."""
        inputs = self.inputs(prompt, image)
        logits = self.model(**inputs).logits[0].float()
        return inputs["input_ids"][0].tolist(), torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: str, image, n: int) -> list[int]:
        inputs = self.inputs(prompt, image)
        out = self.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def oracle(llava) -> Oracle:
    return Oracle(llava)


IMAGES = [sample_image(0), sample_image(1, (40, 70))]


def check_logprobs(out: dict, oracle, prompt: str, image, start: int) -> None:
    """The engine's prompt logprobs (from position `start`) against the oracle's transformers model
    (this file's Oracle or Qwen2-VL's), image positions excepted."""
    ids, expected = oracle.logprobs(prompt, image)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids)  # the placeholder widened as transformers' processor does
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(entries) == len(ids) - start
    image_id = oracle.model.config.image_token_id
    compared = 0
    for pos, (entry, top) in enumerate(zip(entries, tops), start=start):
        if pos == 0 or ids[pos] == image_id:
            assert entry[0] is None  # no logprob for the first token nor for image positions
            continue
        assert entry[1] == ids[pos]
        assert entry[0] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=2e-4)
        want = torch.topk(expected[pos - 1], TOP)
        assert [t for _, t, _ in top] == want.indices.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(want.values.tolist(), abs=2e-4)
        compared += 1
    assert compared > 5


@pytest.mark.parametrize("options", [
    {}, {"chunked_prefill_size": 7}, {"disable_cpu_prepack": True},
    # a pool smaller than two requests: image prefixes evicted, requests retracted and resumed
    {"chunked_prefill_size": 5, "max_total_tokens": 96, "max_running_requests": 3},
], ids=["whole", "chunked", "plain-linear", "chunked-small-pool"])
def test_logprobs_and_greedy_match_transformers(llava, oracle, options):
    options = {"max_total_tokens": 2048, **options}
    with radixlm.Engine(llava, debug_check_invariants=True, **options) as engine:
        lp = {"max_new_tokens": 1, "temperature": 0}
        # single, the image given as PNG bytes and as a PIL image
        for image in (png_bytes(IMAGES[0]), IMAGES[0]):
            out = engine.generate(QUESTION, lp, return_logprob=True, logprob_start_len=0, top_logprobs_num=TOP,
                                  image_data=image)
            check_logprobs(out, oracle, QUESTION, IMAGES[0], 0)
        # batched: two prompts, two images
        outs = engine.generate([QUESTION, OTHER], lp, return_logprob=True, logprob_start_len=0,
                               top_logprobs_num=TOP, image_data=IMAGES)
        check_logprobs(outs[0], oracle, QUESTION, IMAGES[0], 0)
        check_logprobs(outs[1], oracle, OTHER, IMAGES[1], 0)
        # greedy continuations, single then batched (image prefixes now cached)
        expected = [oracle.greedy(QUESTION, IMAGES[0], 8), oracle.greedy(OTHER, IMAGES[1], 8)]
        assert engine.flush_cache()
        assert engine.generate(QUESTION, GREEDY, image_data=IMAGES[0])["output_ids"] == expected[0]
        outs = engine.generate([QUESTION, OTHER], GREEDY, image_data=IMAGES)
        assert [o["output_ids"] for o in outs] == expected
        assert outs[0]["meta_info"]["cached_tokens"] > 16  # the first prompt's image came from the cache


def test_cached_image_prefix_gives_the_same_logprobs(llava, oracle):
    """A second question about the same image reuses the KV of its prefix (image included); the
    logprobs of its own tokens are those transformers computes for the whole prompt."""
    with radixlm.Engine(llava, max_total_tokens=2048) as engine:
        engine.generate(QUESTION, {"max_new_tokens": 0}, image_data=IMAGES[0])
        second = QUESTION.replace("Describe it.", "Is it dark?")
        ids, _ = oracle.logprobs(second, IMAGES[0])
        first_ids, _ = oracle.logprobs(QUESTION, IMAGES[0])
        shared = next(i for i, (a, b) in enumerate(zip(ids, first_ids)) if a != b)
        # logprobs from the first new token on: everything before it may come from the cache
        out = engine.generate(second, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                              logprob_start_len=shared + 1, top_logprobs_num=TOP, image_data=IMAGES[0])
        assert out["meta_info"]["cached_tokens"] == shared > 16 + 5
        start = shared + 1
        check_logprobs(out, oracle, second, IMAGES[0], start)


def test_cache_keys_images_by_content(llava):
    """The same image (even re-encoded) shares its prefix's KV; a different image shares only the text
    before it."""
    with radixlm.Engine(llava, max_total_tokens=2048) as engine:
        tokens_before_image = len(engine.tokenizer(QUESTION.split("<image>")[0])["input_ids"])
        first = engine.generate(QUESTION, GREEDY, image_data=png_bytes(IMAGES[0]))
        assert first["meta_info"]["cached_tokens"] == 0
        again = engine.generate(QUESTION, GREEDY, image_data=IMAGES[0].copy())  # a PIL image, same pixels
        assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
        assert again["output_ids"] == first["output_ids"]
        other = engine.generate(QUESTION, GREEDY, image_data=IMAGES[1])
        assert other["meta_info"]["cached_tokens"] == tokens_before_image
        engine.check_invariants()


def test_requests_with_images_pickle(llava):
    with radixlm.Engine(llava, max_total_tokens=2048) as engine:
        reqs, _ = engine.frontend.prepare(QUESTION, {"max_new_tokens": 1}, None, False, None, 0, False, None,
                                          IMAGES[0])
        copy = pickle.loads(pickle.dumps(reqs[0]))
        assert copy.input_ids == reqs[0].input_ids
        assert (copy.images[0].pixel_values == reqs[0].images[0].pixel_values).all()


def test_scheduler_process_runs_images(llava):
    """The images cross to a scheduler in its own process inside the request messages."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(llava, max_total_tokens=2048) as engine:
        expected = [o["output_ids"] for o in engine.generate([QUESTION, OTHER], params, image_data=IMAGES)]
    with radixlm.Engine(llava, max_total_tokens=2048, scheduler_process=True) as engine:
        outs = engine.generate([QUESTION, OTHER], params, image_data=IMAGES)
        assert [o["output_ids"] for o in outs] == expected


@pytest.mark.parametrize("image_data, message", [
    (b"not an image at all", "could not be decoded"),
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,@@@", "base64"),
    ([IMAGES[0], IMAGES[1]], "1 image placeholder tokens for 2 images"),
])
def test_bad_images_are_refused(llava, image_data, message):
    with radixlm.Engine(llava, max_total_tokens=2048, max_image_pixels=10_000) as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate(QUESTION, GREEDY, image_data=image_data)
        with pytest.raises(InvalidRequestError, match="max_image_pixels"):
            engine.generate(QUESTION, GREEDY, image_data=sample_image(2, (200, 100)))
        assert engine.generate(QUESTION, GREEDY, image_data=IMAGES[0])["meta_info"]["completion_tokens"] == 8


def test_text_model_refuses_images(llama_ckpt):
    with radixlm.Engine(llama_ckpt, max_total_tokens=512) as engine:
        with pytest.raises(InvalidRequestError, match="takes no images"):
            engine.generate("hi", GREEDY, image_data=png_bytes(IMAGES[0]))
