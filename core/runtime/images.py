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

from radixlm.core.runtime.messages import ImageInput
from radixlm.core.errors import InvalidRequestError, UnsupportedModelError
from radixlm.core.runtime.layers.mrope import mrope_positions

# Hash-derived ids lie in [vocab_size, vocab_size + _PAD_ID_RANGE): far from any token id, and wide
# enough that two different images colliding is out of the question in practice.
_PAD_ID_RANGE = 1 << 48


class ImagePreparer:
    def __init__(self, model_path: str, vision: Any, vocab_size: int, max_image_bytes: int,
                 max_image_pixels: int, max_video_frames: int) -> None:
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
        self.max_video_frames = max_video_frames

    @property
    def image_token_id(self) -> int:
        return self.vision.image_token_id

    def placeholder(self, tokenizer: Any, video: bool = False) -> str | None:
        """The text that stands for one image (or video: None where the model takes none) in a
        prompt, as the checkpoint's chat template puts it."""
        if video and not hasattr(self.vision, "video_token_id"):
            return None
        ids = [self.vision.video_token_id if video else self.image_token_id]
        if self.vision.tokens_per_image is None:  # Qwen2-VL brackets the pad token
            ids = [self.vision.vision_start_token_id, *ids, self.vision.vision_end_token_id]
        return "".join(tokenizer.convert_ids_to_tokens(ids))

    def expand(self, ids: list[int], items: list[Any], videos: list[Any] = (),
               param: str = "image_data") -> tuple[list[int], list[ImageInput]]:
        """The prompt with each placeholder token (an image's, or a video's) widened to its image's
        positions (holding the placeholder id, still valid vocabulary: `pad` puts the cache keys in),
        and the images, videos included, in prompt order."""
        video_token = getattr(self.vision, "video_token_id", None)
        if videos and video_token is None:
            raise InvalidRequestError("this model takes no video (LLaVA-1.5 takes images; Qwen2-VL takes video)",
                                      "video_data")
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        video_places = [i for i, t in enumerate(ids) if t == video_token] if videos else []
        for kind, found, given, token, name in (("image", places, items, self.image_token_id, param),
                                                ("video", video_places, videos, video_token, "video_data")):
            if len(found) != len(given):
                raise InvalidRequestError(
                    f"the prompt has {len(found)} {kind} placeholder tokens for {len(given)} {kind}s: put one "
                    f"{kind} token (id {token}) where each {kind} goes", name)
        queue = sorted([(p, "image", item) for p, item in zip(places, items)]
                       + [(p, "video", v) for p, v in zip(video_places, videos)], key=lambda entry: entry[0])
        out: list[int] = []
        images: list[ImageInput] = []
        start = 0
        for place, kind, item in queue:
            out.extend(ids[start:place])
            pixels, grid = self.pixel_values(item, param) if kind == "image" else self.video_values(item)
            width = self.vision.tokens_per_image or math.prod(grid) // self.vision.spatial_merge_size**2
            digest = hashlib.sha256(repr(grid).encode() + pixels.tobytes()).digest()
            pad_id = self.vocab_size + int.from_bytes(digest[:8], "little") % _PAD_ID_RANGE
            images.append(ImageInput(pixel_values=pixels, pad_id=pad_id, offset=len(out), length=width, grid_thw=grid))
            out.extend([ids[place]] * width)
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

    def video_values(self, video: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A video (a list of frames, each an image as image_data takes them, or a uint8 array
        [frames, height, width, 3]) as Qwen2-VL's patches [patches, patch values] and grid (t, h, w).

        Each frame goes through the checkpoint's image processor (resize to its pixel limits,
        normalisation, patch order); each temporal patch then takes temporal_patch_size consecutive
        frames (the last repeated to fill the final one) where an image repeats its one frame."""
        if isinstance(video, np.ndarray):
            if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
                raise InvalidRequestError("a video array must be uint8 [frames, height, width, 3]", "video_data")
            from PIL import Image

            video = [Image.fromarray(frame, "RGB") for frame in video]
        if not isinstance(video, (list, tuple)) or not video:
            raise InvalidRequestError("a video is a non-empty list of frames or a uint8 array [frames, height, "
                                      "width, 3]", "video_data")
        if len(video) > self.max_video_frames:
            raise InvalidRequestError(f"the video has {len(video)} frames; the limit is {self.max_video_frames} "
                                      "(max_video_frames)", "video_data")
        frames = [self.pixel_values(frame, "video_data") for frame in video]
        if len({grid for _, grid in frames}) != 1:
            raise InvalidRequestError("the frames of a video must all be one size", "video_data")
        step = self.vision.temporal_patch_size
        frames += [frames[-1]] * (-len(frames) % step)
        _, (_, h, w) = frames[0]
        c, p = self.vision.in_channels, self.vision.patch_size
        # [patches, channels, temporal, p, p] of each frame (its temporal copies alike): take one copy
        firsts = np.stack([pixels.reshape(h * w, c, step, p, p)[:, :, 0] for pixels, _ in frames])
        t = len(frames) // step
        patches = firsts.reshape(t, step, h * w, c, p, p).transpose(0, 2, 3, 1, 4, 5)
        return np.ascontiguousarray(patches.reshape(t * h * w, c * step * p * p)), (t, h, w)

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


def videos_of(video_data: Any, prompts: int, single: bool) -> list[list[Any]]:
    """video_data as a list of videos per prompt. A video is a list of frames or an array; for one
    prompt video_data is a video or a list of videos, for a list of prompts one such entry (or None)
    per prompt."""
    def videos(entry: Any) -> list[Any]:
        if entry is None:
            return []
        if isinstance(entry, list) and entry and all(isinstance(v, (list, tuple, np.ndarray)) for v in entry):
            return list(entry)
        return [entry]

    if video_data is None:
        return [[] for _ in range(prompts)]
    if single:
        return [videos(video_data)]
    if not isinstance(video_data, list) or len(video_data) != prompts:
        raise InvalidRequestError(f"video_data must hold one entry per prompt ({prompts})", "video_data")
    return [videos(entry) for entry in video_data]


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
