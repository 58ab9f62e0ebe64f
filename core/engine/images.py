"""Images of a request, from what a caller gives to what the scheduler needs (ImageInput messages).

A caller gives an image as bytes, a PIL image, a file path, a `data:` URL or base64 text. The front end
decodes it (refusing what is not an image, is too large or is a remote URL: the engine fetches
nothing), runs the checkpoint's own image processor (its preprocessor_config.json, through
transformers), and expands each image placeholder token of the prompt into one position per feature
row. Those positions carry an id derived from a hash of the image's pixels, beyond the vocabulary:
the radix cache then keys them by content, so prompts with the same image share its KV and prompts
with different images never do (SGLang pads image tokens the same way).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
from typing import Any

import numpy as np

from radixlm.core.engine.messages import ImageInput
from radixlm.core.errors import InvalidRequestError, UnsupportedModelError
from radixlm.core.layers.mrope import mrope_positions

# Hash-derived ids lie in [vocab_size, vocab_size + _PAD_ID_RANGE): far from any token id, and wide
# enough that two different images colliding is out of the question in practice.
_PAD_ID_RANGE = 1 << 48


class ImagePreparer:
    def __init__(self, model_path: str, vision: Any, vocab_size: int, max_image_bytes: int,
                 max_image_pixels: int) -> None:
        try:
            import PIL  # noqa: F401  (decoding; transformers' image processors need it too)
        except ImportError:
            raise UnsupportedModelError("this checkpoint takes images, which need Pillow: pip install "
                                        "'radixlm[vision]'") from None
        from transformers import AutoImageProcessor  # only for vision checkpoints

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.vision = vision
        self.vocab_size = vocab_size
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels

    @property
    def image_token_id(self) -> int:
        return self.vision.image_token_id

    def placeholder(self, tokenizer: Any) -> str:
        """The text that stands for one image in a prompt (what the checkpoint's chat template puts)."""
        ids = [self.image_token_id]
        if self.vision.tokens_per_image is None:  # Qwen2-VL brackets the image pad token
            ids = [self.vision.vision_start_token_id, self.image_token_id, self.vision.vision_end_token_id]
        return "".join(tokenizer.convert_ids_to_tokens(ids))

    def expand(self, ids: list[int], items: list[Any], param: str = "image_data") -> tuple[list[int], list[ImageInput]]:
        """The prompt with each placeholder token widened to its image's positions (holding the
        placeholder id, still valid vocabulary: `pad` puts the cache keys in), and the images."""
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(places) != len(items):
            raise InvalidRequestError(
                f"the prompt has {len(places)} image placeholder tokens for {len(items)} images: put one "
                f"image token (id {self.image_token_id}) where each image goes", param)
        out: list[int] = []
        images: list[ImageInput] = []
        start = 0
        for place, item in zip(places, items):
            out.extend(ids[start:place])
            pixels, grid = self.pixel_values(item, param)
            width = self.vision.tokens_per_image or math.prod(grid) // self.vision.spatial_merge_size**2
            digest = hashlib.sha256(repr(grid).encode() + pixels.tobytes()).digest()
            pad_id = self.vocab_size + int.from_bytes(digest[:8], "little") % _PAD_ID_RANGE
            images.append(ImageInput(pixel_values=pixels, pad_id=pad_id, offset=len(out), length=width, grid_thw=grid))
            out.extend([self.image_token_id] * width)
            start = place + 1
        out.extend(ids[start:])
        return out, images

    def rope_positions(self, length: int, images: list[ImageInput]) -> tuple[Any, int]:
        """M-RoPE models (Qwen2-VL): a prompt's rotary positions [3, length] and the delta of later ones;
        (None, 0) for other models or a prompt without images."""
        if not images or self.vision.tokens_per_image is not None:
            return None, 0
        m = self.vision.spatial_merge_size
        return mrope_positions(length, [(im.offset, im.length, (im.grid_thw[0], im.grid_thw[1] // m,
                                                                 im.grid_thw[2] // m)) for im in images])

    @staticmethod
    def pad(ids: list[int], images: list[ImageInput]) -> list[int]:
        """ids with every image's positions holding its hash-derived id (the radix cache's key)."""
        ids = list(ids)
        for image in images:
            ids[image.offset:image.offset + image.length] = [image.pad_id] * image.length
        return ids

    def pixel_values(self, item: Any, param: str) -> tuple[np.ndarray, tuple[int, int, int] | None]:
        """The image as the checkpoint's image processor makes it, float32: LLaVA [channels, height,
        width]; Qwen2-VL [patches, patch values] and its patch grid (t, h, w)."""
        image = self.decode(item, param)
        try:
            out = self.processor(images=image.convert("RGB"), return_tensors="np")
        except Exception as e:
            raise InvalidRequestError(f"the image could not be preprocessed: {e}", param) from None
        if "image_grid_thw" in out:
            grid = tuple(int(n) for n in out["image_grid_thw"][0])
            return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grid
        return np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32), None

    def decode(self, item: Any, param: str) -> Any:
        from PIL import Image

        if isinstance(item, Image.Image):
            return self._checked_size(item, param)
        if isinstance(item, str) and len(item) > self.max_image_bytes * 4 // 3 + 4096:  # before decoding base64
            raise InvalidRequestError(f"the image is over {self.max_image_bytes} bytes (max_image_bytes)", param)
        data = self.image_bytes(item, param)
        if len(data) > self.max_image_bytes:
            raise InvalidRequestError(f"the image is {len(data)} bytes; the limit is {self.max_image_bytes} "
                                      "(max_image_bytes)", param)
        try:
            image = Image.open(io.BytesIO(data))
            self._checked_size(image, param)
            image.load()
        except InvalidRequestError:
            raise
        except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
            raise InvalidRequestError(f"the image could not be decoded: {e}", param) from None
        return image

    def _checked_size(self, image: Any, param: str) -> Any:
        width, height = image.size
        if width * height > self.max_image_pixels:
            raise InvalidRequestError(f"the image is {width}x{height} pixels; the limit is {self.max_image_pixels} "
                                      "pixels (max_image_pixels)", param)
        return image

    @staticmethod
    def image_bytes(item: Any, param: str) -> bytes:
        """The encoded image a caller gave: bytes, a data URL, a file path or base64 text."""
        if isinstance(item, (bytes, bytearray)):
            return bytes(item)
        if not isinstance(item, str):
            raise InvalidRequestError(f"an image must be bytes, a PIL image, a path, a data URL or base64 text, "
                                      f"not {type(item).__name__}", param)
        if item.startswith(("http://", "https://")):
            raise InvalidRequestError("image URLs are not fetched (the engine has no network access): send the "
                                      "image as a data URL (data:image/png;base64,...)", param)
        if item.startswith("data:"):
            header, sep, payload = item.partition(",")
            if not sep or not header.endswith(";base64"):
                raise InvalidRequestError("an image data URL must be base64 (data:image/...;base64,...)", param)
            item = payload
        elif len(item) < 4096 and os.path.isfile(item):
            with open(item, "rb") as f:
                return f.read()
        try:
            return base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the image is neither a readable file nor valid base64", param) from None


def images_of(image_data: Any, prompts: int, single: bool) -> list[list[Any]]:
    """image_data as a list of images per prompt: for one prompt an image or a list of them; for a
    list of prompts a list with one entry (an image, a list, or None) per prompt."""
    if image_data is None:
        return [[] for _ in range(prompts)]
    if single:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != prompts:
        raise InvalidRequestError(f"image_data must hold one entry per prompt ({prompts})", "image_data")
    return [[] if d is None else list(d) if isinstance(d, list) else [d] for d in image_data]
