"""Test fixtures for vision-language models, never on a user's path: a tiny random LLaVA-1.5 checkpoint
(CLIP ViT tower, MLP projector, Llama language model) saved by transformers' own classes, with the tiny
tokenizer plus an `<image>` token, and the image processor saved alongside. Tests use transformers'
LlavaForConditionalGeneration on the same weights as the logits oracle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from radixlm.testing.checkpoints import IM_END, IM_START, build_lock, build_tokenizer

IMAGE_TOKEN = "<image>"
TINY_LLAVA_NAME = "default-tiny-llava-v1"


def build_llava_checkpoint(out_dir: str, *, seed: int = 0, image_size: int = 56, patch_size: int = 14,
                           select_strategy: str = "default") -> str:
    """Writes a tiny random LLaVA checkpoint into out_dir (created) and returns out_dir.

    Language model: hidden 64, 2 layers, 4 heads (2 KV heads), fp32; vision tower: hidden 32, 3 layers,
    4 heads on image_size-pixel images in patch_size patches (16 image tokens by default)."""
    import torch
    from transformers import (
        CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
        LlavaForConditionalGeneration, PreTrainedTokenizerFast,
    )

    out = Path(out_dir)
    build_tokenizer(str(out))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, IMAGE_TOKEN]})
    tokenizer.save_pretrained(str(out))
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    bos_id, eos_id, pad_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       rope_theta=500000.0, rms_norm_eps=1e-6, initializer_range=0.2,
                       bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=32,
                              initializer_range=0.2)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token_id,
                         vision_feature_select_strategy=select_strategy, vision_feature_layer=-2,
                         image_seq_length=(image_size // patch_size) ** 2)
    with build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
        # transformers zero-initialises the class embedding scale; random values make every part count.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "vision_tower" in name or "multi_modal_projector" in name:
                    if p.dim() == 1 and "norm" not in name:
                        p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                       ).save_pretrained(str(out))
    GenerationConfig(bos_token_id=bos_id, eos_token_id=[eos_id, tokenizer.convert_tokens_to_ids(IM_END)],
                     pad_token_id=pad_id).save_pretrained(str(out))
    return str(out)


def tiny_llava_path() -> str:
    """The tiny LLaVA (seed 0) built once into `$RADIXLM_CACHE` (else `~/.cache/radixlm`) and reused."""
    return _cached_build(TINY_LLAVA_NAME, build_llava_checkpoint)


def _cached_build(name: str, build: Any) -> str:
    cache = Path(os.environ.get("RADIXLM_CACHE") or Path.home() / ".cache" / "radixlm")
    path = cache / name
    if not path.exists():
        tmp = cache / f".{name}.{os.getpid()}.tmp"
        build(str(tmp))
        try:
            os.rename(tmp, path)
        except OSError:
            pass  # another process built it first
    return str(path)


def sample_image(seed: int = 0, size: tuple[int, int] = (64, 48)) -> Any:
    """A random RGB PIL image (a photo-like gradient plus noise), reproducible by seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    h, w = size[1], size[0]
    grad = np.linspace(0, 255, w)[None, :, None] * rng.uniform(0.2, 1.0, size=(1, 1, 3))
    pixels = np.clip(grad + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen2-VL's chat template puts per image
TINY_QWEN2_VL_NAME = "default-tiny-qwen2-vl-v1"


def build_qwen2_vl_checkpoint(out_dir: str, *, seed: int = 0) -> str:
    """Writes a tiny random Qwen2-VL checkpoint into out_dir (created) and returns out_dir.

    Language model: Qwen2, hidden 64, 2 layers, 4 heads (2 KV heads, head_dim 16), M-RoPE sections
    (2, 3, 3), fp32; vision tower: embed 32, 2 blocks, 4 heads, 14-pixel patches merged 2x2. The image
    processor resizes images to between 56x56 and 112x112 pixels (4 to 16 tokens)."""
    import torch
    from transformers import (
        GenerationConfig, PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    out = Path(out_dir)
    build_tokenizer(str(out))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *QWEN2_VL_TOKENS]})
    tokenizer.save_pretrained(str(out))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    bos_id, eos_id, pad_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.2, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    with build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
        with torch.no_grad():  # random biases and norms too, so that every part counts
            for name, p in model.named_parameters():
                if "visual" in name and p.dim() == 1:
                    p.normal_(1.0 if "norm" in name or "ln_q" in name else 0.0, 0.2)
    model.save_pretrained(str(out))
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2,
                          merge_size=2).save_pretrained(str(out))
    GenerationConfig(bos_token_id=bos_id, eos_token_id=[eos_id, tokenizer.convert_tokens_to_ids(IM_END)],
                     pad_token_id=pad_id).save_pretrained(str(out))
    return str(out)


def tiny_qwen2_vl_path() -> str:
    """The tiny Qwen2-VL (seed 0) built once into `$RADIXLM_CACHE` (else `~/.cache/radixlm`) and reused."""
    return _cached_build(TINY_QWEN2_VL_NAME, build_qwen2_vl_checkpoint)
