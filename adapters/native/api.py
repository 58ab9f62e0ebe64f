"""The SGLang frontend language, name for name: `import radixlm as sgl` runs SGLang programs."""

from __future__ import annotations

import re
from typing import Any

from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.core.lang.config import global_config
from radixlm.core.lang.errors import ProgramError
from radixlm.core.lang.function import SglFunction, function  # noqa: F401  (re-exported)
from radixlm.core.lang.backends.resolve import resolve_backend
from radixlm.core.lang.ir import (
    Expr, ExprList, Gen, GenParams, Image, RoleBegin, RoleEnd, Select, Video, as_expr, dtype_name,
)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, dtype: Any = None, regex: str | None = None,
        json_schema: str | dict | None = None, choices: list[str] | None = None, *,
        choices_method: ChoicesSamplingMethod | None = None,
        return_text_in_logprobs: bool | None = None) -> Expr:
    """Generate text into the variable `name`. Unset parameters inherit the run's defaults.
    With `choices`, this is `select`."""
    if choices:
        return Select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if dtype is not None:
        dtype_name(dtype)
    if regex is not None:
        re.compile(regex)  # fail at the call site, not deep inside the engine
    return Gen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype, regex=regex, json_schema=json_schema))


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """An integer, as text (`int(s[name])` converts it)."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """A double-quoted string of letters, digits and blanks."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """The choice the model finds most likely (by `choices_method`) after the current text."""
    if choices is None:
        raise ValueError("select needs choices")
    return Select(name, choices, temperature, choices_method)


def image(source: Any) -> Expr:
    """An image in a prompt: a file path, encoded image bytes or a PIL image (for a vision-language
    model: the local engine on a LLaVA checkpoint, or an OpenAI chat model)."""
    return Image(source)


def video(frames: Any, num_frames: int = -1) -> Expr:
    """SGLang's video primitive, for a video model (Qwen2-VL on the local engine or a radixlm server):
    the video as its frames (a list of what sgl.image takes, or a uint8 array [frames, height, width,
    3]); radixlm decodes no video files. num_frames > 0 samples that many frames evenly."""
    if isinstance(frames, (str, bytes)):
        raise ProgramError("sgl.video takes a video's frames (a list of images or a uint8 array [frames, height, "
                           "width, 3]): radixlm decodes no video files")
    if hasattr(frames, "ndim"):  # an array: its frames as images
        from PIL import Image as PILImage

        frames = [PILImage.fromarray(frame) for frame in frames]
    frames = list(frames)
    if not frames:
        raise ProgramError("sgl.video needs at least one frame")
    if 0 < num_frames < len(frames):
        frames = [frames[i * len(frames) // num_frames] for i in range(num_frames)]
    return Video(frames)


def _role(role: str, expr: Any = None) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> Expr:
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def set_default_backend(backend: Any) -> None:
    """Where programs run by default: a backend, a `Runtime` (kept as given, as SGLang does, so that code
    reading `global_config.default_backend.endpoint` works; programs resolve it where they run), or a
    `radixlm.Engine` (kept as its program backend: SGLang's default backend is always a backend or a
    Runtime, and SGLang code calls backend methods on it)."""
    if isinstance(backend, BaseBackend) or hasattr(backend, "endpoint"):
        global_config.default_backend = backend
    else:  # a radixlm.Engine becomes its program backend; anything else is a TypeError here
        global_config.default_backend = resolve_backend(backend)


def flush_cache(backend: Any = None) -> bool:
    """Empties the backend's prefix cache; False if it could not (requests running, no cache)."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
