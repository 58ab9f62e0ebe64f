"""Qwen2-VL in the engine against transformers' Qwen2VLForConditionalGeneration on the same tiny random
checkpoint: prompt logprobs (with top-k) and greedy tokens (M-RoPE decode positions), single and batched,
images of different grids, the image prefix computed and served from the radix cache (its M-RoPE
positions the same), whole and chunked; and the cache keyed by image content."""

from __future__ import annotations

import pytest
import torch

import radixlm
from radixlm.core.errors import InvalidRequestError
from radixlm.testing.vision import QWEN2_VL_IMAGE, build_qwen2_vl_checkpoint, png_bytes, sample_image
from qwen2vl_oracle import Qwen2VLOracle, video_inputs
from test_vision_llava import check_logprobs  # any oracle with logprobs(prompt, images) and the model

QUESTION = f"<|im_start|>user\n{QWEN2_VL_IMAGE}What is in this picture? Describe it.<|im_end|>\n<|im_start|>assistant\n"
OTHER = f"<|im_start|>user\n{QWEN2_VL_IMAGE}What colour is it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{QWEN2_VL_IMAGE} and {QWEN2_VL_IMAGE}: which is darker?<|im_end|>\n<|im_start|>assistant\n"
TOP = 5
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# grids (after the 2x2 merge) 2x2, 3x2 and 4x4: different token counts and M-RoPE extents
IMAGES = [sample_image(0), sample_image(1, (56, 84)), sample_image(2, (112, 112))]


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory) -> str:
    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2vl") / "ckpt"))


@pytest.fixture(scope="module")
def oracle(qwen2vl) -> Qwen2VLOracle:
    return Qwen2VLOracle(qwen2vl)


@pytest.mark.parametrize("options", [
    {}, {"chunked_prefill_size": 7},
    {"chunked_prefill_size": 5, "max_total_tokens": 96, "max_running_requests": 3},
], ids=["whole", "chunked", "chunked-small-pool"])
def test_logprobs_and_greedy_match_transformers(qwen2vl, oracle, options):
    options = {"max_total_tokens": 2048, **options}
    lp = {"max_new_tokens": 1, "temperature": 0}
    with radixlm.Engine(qwen2vl, debug_check_invariants=True, **options) as engine:
        out = engine.generate(QUESTION, lp, return_logprob=True, logprob_start_len=0, top_logprobs_num=TOP,
                              image_data=png_bytes(IMAGES[0]))
        check_logprobs(out, oracle, QUESTION, IMAGES[0], 0)
        # batched: three prompts, one of them with two images of different grids
        outs = engine.generate([QUESTION, OTHER, TWO], lp, return_logprob=True, logprob_start_len=0,
                               top_logprobs_num=TOP, image_data=[IMAGES[2], IMAGES[1], [IMAGES[1], IMAGES[0]]])
        check_logprobs(outs[0], oracle, QUESTION, IMAGES[2], 0)
        check_logprobs(outs[1], oracle, OTHER, IMAGES[1], 0)
        check_logprobs(outs[2], oracle, TWO, [IMAGES[1], IMAGES[0]], 0)
        # greedy continuations (decode positions = text position + rope delta), single then batched
        expected = [oracle.greedy(QUESTION, IMAGES[1], 8), oracle.greedy(TWO, [IMAGES[2], IMAGES[0]], 8)]
        assert engine.flush_cache()
        assert engine.generate(QUESTION, GREEDY, image_data=IMAGES[1])["output_ids"] == expected[0]
        outs = engine.generate([QUESTION, TWO], GREEDY, image_data=[IMAGES[1], [IMAGES[2], IMAGES[0]]])
        assert [o["output_ids"] for o in outs] == expected
        assert outs[0]["meta_info"]["cached_tokens"] > 6  # the first prompt's image came from the cache


def test_cached_image_prefix_gives_the_same_logprobs(qwen2vl, oracle):
    """A second question about the same image reuses the KV of its prefix (image included, computed at
    the same M-RoPE positions); its own tokens' logprobs are those of transformers on the whole prompt."""
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        engine.generate(QUESTION, {"max_new_tokens": 0}, image_data=IMAGES[2])
        second = QUESTION.replace("Describe it.", "Is it dark?")
        ids, _ = oracle.logprobs(second, IMAGES[2])
        first_ids, _ = oracle.logprobs(QUESTION, IMAGES[2])
        shared = next(i for i, (a, b) in enumerate(zip(ids, first_ids)) if a != b)
        out = engine.generate(second, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                              logprob_start_len=shared + 1, top_logprobs_num=TOP, image_data=IMAGES[2])
        assert out["meta_info"]["cached_tokens"] == shared > 16 + 5
        check_logprobs(out, oracle, second, IMAGES[2], shared + 1)
        # and a continuation of the same conversation decodes as transformers does
        follow = second + "It is not.<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
        got = engine.generate(follow, GREEDY, image_data=IMAGES[2])
        assert got["meta_info"]["cached_tokens"] > shared
        assert got["output_ids"] == oracle.greedy(follow, IMAGES[2], 8)


def test_cache_keys_images_by_content(qwen2vl):
    """The same image shares its prefix's KV; a different image (or the same pixels at another size)
    shares only the text before it."""
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        tokens_before_image = len(engine.tokenizer(QUESTION.split("<|image_pad|>")[0])["input_ids"])
        first = engine.generate(QUESTION, GREEDY, image_data=png_bytes(IMAGES[0]))
        assert first["meta_info"]["cached_tokens"] == 0
        again = engine.generate(QUESTION, GREEDY, image_data=IMAGES[0].copy())
        assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
        assert again["output_ids"] == first["output_ids"]
        for other in (IMAGES[1], IMAGES[0].resize((112, 112))):
            out = engine.generate(QUESTION, GREEDY, image_data=other)
            assert out["meta_info"]["cached_tokens"] == tokens_before_image
        engine.check_invariants()


def test_text_prompts_on_a_qwen2vl_checkpoint_match_transformers(qwen2vl, oracle):
    """No image: plain 1-D positions (t = h = w), the text paths of the engine."""
    prompt = "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n"
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        out = engine.generate(prompt, GREEDY)
    ids = oracle.tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = oracle.model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert out["output_ids"] == want


def test_bad_images_are_refused(qwen2vl):
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        with pytest.raises(InvalidRequestError, match="could not be decoded"):
            engine.generate(QUESTION, GREEDY, image_data=b"not an image")
        with pytest.raises(InvalidRequestError, match="1 image placeholder tokens for 2 images"):
            engine.generate(QUESTION, GREEDY, image_data=IMAGES[:2])
        assert engine.generate(QUESTION, GREEDY, image_data=IMAGES[0])["meta_info"]["completion_tokens"] == 8


VIDEO = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens here?<|im_end|>\n<|im_start|>assistant\n"
FRAMES = [sample_image(10 + i, (84, 56)) for i in range(4)]  # 4 frames: 2 temporal patches of a 6x4 grid


def test_video_matches_transformers(qwen2vl, oracle):
    """A video as frames (PIL images or a uint8 array): grid t = 2, logprobs and greedy tokens as
    transformers' model computes them on the same video patches; the cache keys it by content."""
    import numpy as np

    inputs = video_inputs(oracle, VIDEO, FRAMES)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = torch.log_softmax(oracle.model(**inputs).logits[0].float(), -1)
        greedy = oracle.model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist()
    with radixlm.Engine(qwen2vl, max_total_tokens=2048, chunked_prefill_size=9) as engine:
        out = engine.generate(VIDEO, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                              return_logprob=True, logprob_start_len=0, video_data=FRAMES)
        assert out["meta_info"]["prompt_tokens"] == len(ids) and out["output_ids"] == greedy
        compared = 0
        for pos, entry in enumerate(out["meta_info"]["input_token_logprobs"]):
            if entry[0] is not None:
                assert entry[0] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=2e-4)
                compared += 1
        assert compared > 5
        array = np.stack([np.asarray(frame) for frame in FRAMES])
        again = engine.generate([VIDEO, TWO], GREEDY, video_data=[array, None], image_data=[None, IMAGES[:2]])
        assert again[0]["output_ids"] == greedy
        assert again[0]["meta_info"]["cached_tokens"] == len(ids) - 1
        other = engine.generate(VIDEO, GREEDY, video_data=FRAMES[::-1])
        assert other["meta_info"]["cached_tokens"] < 10
        engine.check_invariants()


def test_a_still_video_is_its_image(qwen2vl):
    """Two equal frames make the same temporal patch as an image (which the processor repeats): the
    same pixels, grid and positions, hence the same cache key and tokens."""
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        image = engine.generate(QUESTION, GREEDY, image_data=IMAGES[1])
        video = engine.generate(QUESTION.replace("image_pad", "video_pad"), GREEDY, video_data=[IMAGES[1]] * 2)
        assert video["output_ids"] == image["output_ids"]


def test_bad_videos_are_refused(qwen2vl, llama_ckpt):
    with radixlm.Engine(qwen2vl, max_total_tokens=2048, max_video_frames=4) as engine:
        for video, message in (([], "non-empty"), (FRAMES * 2, "max_video_frames"),
                               ([FRAMES[0], IMAGES[0]], "one size"), ([b"nope"], "could not be decoded")):
            with pytest.raises(InvalidRequestError, match=message):
                engine.generate(VIDEO, GREEDY, video_data=video)
        with pytest.raises(InvalidRequestError, match="0 video placeholder tokens for 1 videos"):
            engine.generate(QUESTION, GREEDY, video_data=FRAMES, image_data=IMAGES[0])


def test_transformers_4_checkpoint_layout(qwen2vl, tmp_path):
    """Hub Qwen2-VL checkpoints were written by transformers 4: a flat config (rope_scaling of type
    "mrope", vision "in_chans") and weights named model.* / visual.*; they load to the same model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "v4"
    shutil.copytree(qwen2vl, old)
    config = json.loads((old / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    vision = config["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("rope_parameters")
    flat = {**{k: v for k, v in text.items() if k != "model_type"}, **config, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (old / "config.json").write_text(json.dumps(flat))
    weights = load_file(str(old / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in weights.items()}
    assert any(k.startswith("visual.") for k in renamed) and any(k.startswith("model.layers") for k in renamed)
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    outs = []
    for path in (qwen2vl, old):
        with radixlm.Engine(str(path), max_total_tokens=1024) as engine:
            outs.append(engine.generate(TWO, {**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                                        logprob_start_len=0, image_data=IMAGES[:2]))
    assert outs[1]["output_ids"] == outs[0]["output_ids"]
    assert outs[1]["meta_info"]["input_token_logprobs"] == outs[0]["meta_info"]["input_token_logprobs"]


def test_hub_qwen2vl_2b_config_is_read_as_transformers_reads_it():
    """Qwen2-VL-2B-Instruct's config.json (transformers 4 layout): tied embeddings, M-RoPE sections,
    the tower's shape, the placeholder ids; compared with transformers' Qwen2VLConfig."""
    from transformers import Qwen2VLConfig

    from radixlm.core.runtime.models.config import ModelConfig

    hub = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
           "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
           "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
           "image_token_id": 151655, "video_token_id": 151656,
           "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                             "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
                             "spatial_patch_size": 14, "temporal_patch_size": 2}}
    cfg = ModelConfig.from_hf_dict(hub, 151645)
    theirs = Qwen2VLConfig.from_dict(hub)
    assert cfg.tie_word_embeddings is True and cfg.mrope_section == (16, 24, 24) and cfg.qkv_bias
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (128, 2, theirs.text_config.rope_parameters["rope_theta"])
    v = cfg.vision
    assert (v.depth, v.embed_dim, v.num_heads, v.out_hidden_size, v.image_token_id, v.video_token_id) == (
        theirs.vision_config.depth, 1280, 16, 1536, theirs.image_token_id, theirs.video_token_id)


def test_decodes_through_the_cuda_graph_path(qwen2vl, oracle):
    """The decode graphs' padded static-buffer path (run eagerly here, as on CPU) carries M-RoPE
    decodes' shifted rotary positions: greedy tokens are transformers' with images and without."""
    from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner

    text = "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n"
    expected = [oracle.greedy(QUESTION, IMAGES[1], 8), oracle.greedy(TWO, [IMAGES[2], IMAGES[0]], 8)]
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        want_text = engine.generate(text, GREEDY)["output_ids"]
        graphs = DecodeGraphRunner(engine._runner, max_bs=4, capture=False)
        assert graphs.mrope
        runs = []
        real_run = graphs.run
        graphs.run = lambda batch: runs.append(len(batch.rows)) or real_run(batch)
        engine._runner.graph_runner = graphs
        outs = engine.generate([QUESTION, TWO, text], GREEDY, image_data=[IMAGES[1], [IMAGES[2], IMAGES[0]], None])
        assert [o["output_ids"] for o in outs] == [*expected, want_text]
        assert runs and max(runs) == 3  # the decodes went through the graph path, padded to 4


def test_scheduler_process_runs_qwen2vl(qwen2vl):
    """The M-RoPE positions and the images' grids cross to a scheduler in its own process."""
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts, images = [QUESTION, TWO], [IMAGES[2], [IMAGES[1], IMAGES[0]]]
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        expected = [o["output_ids"] for o in engine.generate(prompts, params, image_data=images)]
    with radixlm.Engine(qwen2vl, max_total_tokens=2048, scheduler_process=True) as engine:
        assert [o["output_ids"] for o in engine.generate(prompts, params, image_data=images)] == expected


class _ByPromptLength(dict):
    """Expected outputs keyed by prompt length (an image prompt's ids are derived from its image's hash)."""

    def get(self, key, default=None):
        return super().get(len(key), default)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph-twin"])
def test_speculation_after_images_keeps_outputs(qwen2vl, graphs):
    """Verify steps of requests after images rotate their tokens at the shifted M-RoPE positions their
    decode steps use: greedy outputs with drafts at every accepted length (radixlm.testing.speculative) equal
    those without, as an eager extend and on the decode graphs' path (its eager twin here)."""
    from radixlm.testing.speculative import OracleProposer

    from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner

    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts, images = [QUESTION, TWO], [IMAGES[1], [IMAGES[2], IMAGES[0]]]
    with radixlm.Engine(qwen2vl, max_total_tokens=2048) as engine:
        base = engine.generate(prompts, params, image_data=images)
    expected = _ByPromptLength({o["meta_info"]["prompt_tokens"]: o["output_ids"] for o in base})
    assert len(expected) == 2
    with radixlm.Engine(qwen2vl, max_total_tokens=2048, speculative_algorithm="ngram",
                        speculative_adaptive=False) as engine:
        runs: list[int] = []
        if graphs:
            twin = DecodeGraphRunner(engine._runner, max_bs=16, capture=False)
            real_run = twin.run
            twin.run = lambda batch: (len(set(batch.rows)) < len(batch.rows) and runs.append(1)) or real_run(batch)
            engine._runner.graph_runner = twin
        speculator = engine.frontend.scheduler.scheduler.speculator
        speculator.proposer = OracleProposer(expected, engine.vocab_size)
        spec = engine.generate(prompts, params, image_data=images)
        stats = engine.get_stats()
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]
    assert len(runs) == (stats["spec_verify_steps_total"] if graphs else 0)
