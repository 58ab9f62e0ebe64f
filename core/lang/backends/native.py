"""The logic shared by the backends that speak radixlm's native generate protocol: the in-process
Engine (`Engine.generate(**request)`) and a server's `/generate` (the same fields as JSON).

Both sit on a radix cache, so this is where the program model meets it:
- before forks (and for `f.cache()`), a state's text is sent once with max_new_tokens=0, so every
  branch finds the shared prefix cached;
- a select is one prefill of the prefix plus one scoring request for all choices
  (max_new_tokens=0, logprobs from where the choices start), never a full call per choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from radixlm.core.lang.backends.base import BaseBackend, StreamState
from radixlm.core.errors import InvalidRequestError
from radixlm.core.lang.choices import ChoicesDecision, ChoicesSamplingMethod

if TYPE_CHECKING:
    from radixlm.core.lang.ir import GenParams


def _images(s: "StreamState") -> dict[str, Any]:
    """The state's images (sgl.image) and videos (sgl.video) as the request's image_data and
    video_data: data URLs in prompt order (a video's: a list, one per frame)."""
    out: dict[str, Any] = {}
    for _, data in s.images_:
        if isinstance(data, str):
            out.setdefault("image_data", []).append(f"data:image/png;base64,{data}")
        else:
            out.setdefault("video_data", []).append([f"data:image/png;base64,{frame}" for frame in data])
    return out


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class NativeGenerateBackend(BaseBackend):
    """Subclasses provide `_generate(request) -> dict | list[dict]`, `_generate_stream(request)`
    (chunks holding only new text), `_encode(text)` (prompt ids as the engine makes them) and
    `tokenizer` (the engine's, for token texts)."""

    tokenizer: Any = None

    def _generate(self, request: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        """Token ids of a prompt, exactly as the engine tokenizes a text prompt."""
        raise NotImplementedError

    # ----- gen -----

    def _request(self, s: "StreamState", params: "GenParams") -> dict[str, Any]:
        return {"text": s.text_, "sampling_params": params.sampling_params(), **params.logprob_options(),
                **_images(s)}

    def generate(self, s: "StreamState", params: "GenParams") -> tuple[str, dict[str, Any]]:
        out = self._generate(self._request(s, params))
        meta = out["meta_info"]
        if params.return_text_in_logprobs:
            self._add_token_texts(meta)
        return out["text"], meta

    def generate_stream(self, s: "StreamState", params: "GenParams") -> Iterator[tuple[str, dict[str, Any]]]:
        for chunk in self._generate_stream(self._request(s, params)):
            meta = chunk["meta_info"]
            if params.return_text_in_logprobs:
                self._add_token_texts(meta)
            yield chunk["text"], meta

    def _add_token_texts(self, meta: dict[str, Any]) -> None:
        """Fills the text slot of every (logprob, token_id, text) entry of meta_info."""
        def with_text(entry: Any) -> Any:
            lp, token_id = entry[0], entry[1]
            return (lp, token_id, self.tokenizer.decode([token_id]))

        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta.get(key) is not None:
                meta[key] = [with_text(e) for e in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if meta.get(key) is not None:
                meta[key] = [None if row is None else [with_text(e) for e in row] for row in meta[key]]

    # ----- the radix cache -----

    def cache_prefix(self, prefix: str, images: dict[str, Any] | None = None) -> None:
        if prefix:
            self._generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}, **(images or {})})

    def commit_lazy_operations(self, s: "StreamState", extra_text: str = "") -> None:
        self.cache_prefix(s.text_ + extra_text, _images(s))

    # ----- select -----

    def select(self, s: "StreamState", choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if temperature > 1e-5:
            raise InvalidRequestError("select on a local or native-endpoint backend picks the best choice "
                                      "(temperature 0); sampling among choices is not supported",
                                      "temperature")
        prefix_ids = self._encode(s.text_)
        full_ids = [self._encode(s.text_ + choice) for choice in choices]
        # Where each choice's own tokens start: after the tokens it shares with the prefix (a choice
        # may re-tokenize the prefix's last token), but never before position 1, which has a logprob.
        starts = [max(1, min(_common_prefix_len(prefix_ids, ids), len(ids) - 1)) for ids in full_ids]
        first = min(starts)
        images = _images(s)
        cached = self._generate({"input_ids": prefix_ids, "sampling_params": {"max_new_tokens": 0}, **images})
        # The engine widens each image's placeholder to the image's positions: logprob positions shift.
        shift = cached["meta_info"]["prompt_tokens"] - len(prefix_ids) if images else 0
        if images:  # one prompt per choice, each with the prefix's images and videos
            images = {key: [value] * len(choices) for key, value in images.items()}
        outs = self._generate({"input_ids": full_ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                               "return_logprob": True, "logprob_start_len": first + shift, **images})
        input_token_logprobs = [out["meta_info"]["input_token_logprobs"][start - first:]
                                for out, start in zip(outs, starts)]
        output_token_logprobs = [out["meta_info"].get("output_token_logprobs") or [] for out in outs]
        normalized = [sum(lp for lp, *_ in entries) / len(entries) for entries in input_token_logprobs]

        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            alone = [ids[start:] for ids, start in zip(full_ids, starts)]
            outs = self._generate({"input_ids": alone, "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": 0})
            unconditional = [out["meta_info"]["input_token_logprobs"] for out in outs]

        return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                              input_token_logprobs=input_token_logprobs,
                              output_token_logprobs=output_token_logprobs,
                              unconditional_token_logprobs=unconditional)
