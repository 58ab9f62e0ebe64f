"""Image-QA throughput on LLaVA and Qwen2-VL with shared images against distinct images: what keying the
radix cache by image content buys (the shared runs encode each image once and reuse its prefix KV).

    python benchmarks/bench_images.py --model llava-7b-shape --out images.json   # the H200
    python benchmarks/bench_images.py --model qwen2vl-2b-shape --out qwen2vl.json  # the H200
    python benchmarks/bench_images.py --model tiny                               # CPU, seconds
    python benchmarks/bench_images.py --model qwen2vl-tiny                       # CPU, seconds

Workload: N requests, each a random system prefix (shared by all), one image, a random question and a
fixed number of output tokens (greedy, ignore_eos), all submitted at once. `shared`: the requests ask
about K images (N/K questions each); `distinct`: every request has its own image. Reported: wall time,
requests/s, output tokens/s and the prompt tokens served from the cache.

Models: `llava-7b-shape` is LLaVA-1.5-7B's shape (CLIP ViT-L/14 at 336 px: 576 image tokens; Llama-2-7B
language model, vocab 32064) with random bf16 weights made on the device (load_format "dummy": nothing
downloaded); its tokenizer is the small local one plus `<image>`, so prompts are random token ids. `tiny`
is the test checkpoint (testing.vision: 16 image tokens). `qwen2vl-2b-shape` is Qwen2-VL-2B's shape
(ViT 32 x 1280, Qwen2-1.5B language model with M-RoPE, vocab 151936) with dummy bf16 weights and Qwen2-VL's
own image-processor limits (a 640x480 image takes 391 positions); `qwen2vl-tiny` the Qwen2-VL test
checkpoint (4 image positions at 64x48).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

import radixlm
from radixlm.testing.vision import build_llava_checkpoint, build_qwen2_vl_checkpoint, png_bytes, sample_image

PRESETS = {
    "llava-7b-shape": dict(requests=256, shared_images=4, prefix=64, question=32, output=64, image_px=(640, 480)),
    "qwen2vl-2b-shape": dict(requests=256, shared_images=4, prefix=64, question=32, output=64, image_px=(640, 480)),
    "tiny": dict(requests=16, shared_images=2, prefix=16, question=8, output=8, image_px=(64, 48)),
    "qwen2vl-tiny": dict(requests=16, shared_images=2, prefix=16, question=8, output=8, image_px=(64, 48)),
}

QWEN2_VL_2B_SHAPE = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "tie_word_embeddings": True,
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}

LLAVA_7B_SHAPE = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                      "projection_dim": 768, "hidden_act": "quick_gelu"},
}


def make_model_dir(name: str, root: str) -> tuple[str, dict[str, Any]]:
    path = os.path.join(root, name)
    if name == "tiny":
        return build_llava_checkpoint(path), {}
    if name.startswith("qwen2vl"):
        return make_qwen2vl_dir(name, path)
    # The tiny checkpoint's tokenizer and image processor, under LLaVA-1.5-7B's config.
    build_llava_checkpoint(path, image_size=336)
    os.remove(os.path.join(path, "model.safetensors"))
    config = json.loads(json.dumps(LLAVA_7B_SHAPE))
    with open(os.path.join(path, "config.json")) as f:  # the tokenizer's <image> id
        tiny = json.load(f)
    config["image_token_index"] = tiny.get("image_token_index", tiny.get("image_token_id"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path, {"load_format": "dummy"}


def make_qwen2vl_dir(name: str, path: str) -> tuple[str, dict[str, Any]]:
    build_qwen2_vl_checkpoint(path)
    if name == "qwen2vl-tiny":
        return path, {}
    # The tiny checkpoint's tokenizer (its placeholder ids) under Qwen2-VL-2B's config and image processor.
    from transformers import Qwen2VLImageProcessor

    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        tiny = json.load(f)
    config = {**QWEN2_VL_2B_SHAPE, **{k: tiny[k] for k in tiny if k.endswith("token_id")}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(path)
    return path, {"load_format": "dummy"}


def workload(p: dict[str, Any], image_token: int, shared: bool, seed: int = 0) -> tuple[list[list[int]], list[bytes]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 900) for _ in range(p["prefix"])]
    n_images = p["shared_images"] if shared else p["requests"]
    images = [png_bytes(sample_image(seed * 100_000 + i, p["image_px"])) for i in range(n_images)]
    prompts, data = [], []
    for i in range(p["requests"]):
        question = [rng.randrange(10, 900) for _ in range(p["question"])]
        prompts.append(prefix + [image_token] + question)
        data.append(images[i % n_images])
    return prompts, data


def run_one(engine: Any, p: dict[str, Any], shared: bool, seed: int) -> dict[str, Any]:
    prompts, images = workload(p, engine.images.image_token_id, shared, seed)
    assert engine.flush_cache()
    params = {"max_new_tokens": p["output"], "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, image_data=images)
    wall = time.perf_counter() - start
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    output = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"mode": "shared" if shared else "distinct", "requests": len(outs), "wall_s": round(wall, 3),
            "requests_per_s": round(len(outs) / wall, 2), "output_tokens_per_s": round(output / wall, 1),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "cache_hit_rate": round(cached / prompt_tokens, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--requests", type=int, help="override the preset's request count")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (the best is reported)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.model])
    if args.requests:
        p["requests"] = args.requests
    with tempfile.TemporaryDirectory() as root:
        path, options = make_model_dir(args.model, root)
        with radixlm.Engine(path, **options) as engine:
            run_one(engine, {**p, "requests": min(4, p["requests"])}, True, seed=99)  # warm-up (graphs, kernels)
            results = []
            for shared in (True, False):
                runs = [run_one(engine, p, shared, seed=r) for r in range(args.repeats)]
                best = max(runs, key=lambda r: r["requests_per_s"])
                results.append(best)
                print(json.dumps(best))
    speedup = results[0]["requests_per_s"] / results[1]["requests_per_s"]
    print(f"{args.model}: shared images {results[0]['requests_per_s']} req/s, distinct {results[1]['requests_per_s']} "
          f"req/s: x{speedup:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "preset": p, "results": results, "speedup": speedup}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
