"""Turning a generate call into requests: tokenizing prompts (the one place that does), checking the
sampling parameters, ids, the context and the fan-out, widening image placeholders, and splitting `n`
into requests of one sample each (core.runtime.branches)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.branches import branch_params, branch_rid
from radixlm.core.runtime.images import ImagePreparer, images_of, videos_of
from radixlm.core.runtime.messages import ConstraintSpec, GenerateRequest, ImageInput
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.sampling_params import SamplingParams


class RequestBuilder:
    def __init__(self, tokenizer: Any, opts: EngineOptions, vocab_size: int, context_len: int,
                 images: ImagePreparer | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = opts
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.images = images  # a vision-language model's image preparation, else None
        # A prompt longer than this many UTF-8 bytes has more tokens than the context holds whatever
        # they are: refused before it is tokenized.
        self.max_prompt_bytes = context_len * longest_token_bytes(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a prompt's text (with the tokenizer's BOS where add_special_tokens)."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_prompt(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """`encode` after the size check: a prompt the context cannot hold is refused untokenized."""
        self.check_prompt_size(len(text.encode("utf-8", "surrogatepass")), param)
        return self.encode(text, add_special_tokens)

    def check_prompt_size(self, size_bytes: int, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a prompt of more UTF-8 bytes than the context can hold as tokens."""
        if size_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"the prompt is {size_bytes} bytes: more tokens than this model's context of {self.context_len} "
                f"could hold (the limit is {self.max_prompt_bytes} bytes)", param)

    def check_fan_out(self, count: int) -> None:
        """Refuses a call that would make more engine requests (prompts x n) than max_requests_per_call."""
        if count > self.options.max_requests_per_call:
            raise InvalidRequestError(
                f"the request makes {count} generations (prompts x n); the limit is "
                f"{self.options.max_requests_per_call} (max_requests_per_call)", "n")

    def build(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, stream, rid, image_data=None, video_data=None) -> tuple[list[GenerateRequest], bool]:
        """Validates a generate call and turns it into requests (one per prompt and sample); True when
        the call answers with one output rather than a list."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt and input_ids", "prompt")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise InvalidRequestError("prompt must be a string or a list of strings", "prompt")
            self.check_fan_out(len(prompts))
            id_lists = [self.encode_prompt(p) for p in prompts]
        else:
            single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
            id_lists = [input_ids] if single else input_ids
            if not isinstance(id_lists, list) or not all(isinstance(ids, list) for ids in id_lists):
                raise InvalidRequestError("input_ids must be a list of ints or a list of lists of ints", "input_ids")
            self.check_fan_out(len(id_lists))
        if not id_lists:
            raise InvalidRequestError("the prompt list is empty", "prompt")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(id_lists):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling_params for {len(id_lists)} prompts", "sampling_params")
            params = [SamplingParams.from_dict(sp) for sp in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
        self.check_fan_out(sum(sp.n for sp in params))
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num must be an integer in [0, 20]", "top_logprobs_num")
        if logprob_start_len is not None and (not isinstance(logprob_start_len, int) or logprob_start_len < -1):
            raise InvalidRequestError("logprob_start_len must be an integer >= -1", "logprob_start_len")
        if logprob_start_len == -1:
            logprob_start_len = None
        rids = self._rids(rid, len(id_lists))
        image_lists = images_of(image_data, len(id_lists), single)
        video_lists = videos_of(video_data, len(id_lists), single)
        reqs: list[GenerateRequest] = []
        for ids, sp, r, items, videos in zip(id_lists, params, rids, image_lists, video_lists):
            ids, images = self.prepare_images(ids, items, videos)
            sp = self.validate_ids(ids, sp)
            rope_positions, rope_delta = self.images.rope_positions(len(ids), images) if images else (None, 0)
            ids = ImagePreparer.pad(ids, images)
            constraint = ConstraintSpec.of(sp)
            for i, branch in enumerate(branch_params(sp)):
                reqs.append(GenerateRequest(
                    rid=branch_rid(r, i, sp.n), input_ids=list(ids), sampling_params=branch,
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, stream=stream, constraint=constraint,
                    images=tuple(images), rope_positions=rope_positions, rope_delta=rope_delta))
        return reqs, single and len(reqs) == 1

    def prepare_images(self, ids: list[int], items: list[Any], videos: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image and video placeholders widened (core.runtime.images), and its images
        (videos included)."""
        if not items and not videos:
            return ids, []
        if self.images is None:
            param = "image_data" if items else "video_data"
            raise InvalidRequestError("this model takes no images (it is not a vision-language model)", param)
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return ids, []  # validate_ids names the problem
        return self.images.expand(ids, items, videos)

    @staticmethod
    def _rids(rid, count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise InvalidRequestError("rid must be a string per prompt", "rid")
        return rids

    def validate_ids(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
        """Checks a prompt against the vocabulary and the context; returns sp with an unset
        max_new_tokens resolved to the rest of the context."""
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"input_ids must be token ids in [0, {self.vocab_size})", "input_ids")
        if sp.max_new_tokens is None:
            sp = dataclasses.replace(sp, max_new_tokens=max(self.context_len - len(ids), 0))
        needed = len(ids) + (1 if sp.max_new_tokens > 0 else 0)
        if needed > self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this server's context is {self.context_len} tokens", "prompt")
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {sp.max_new_tokens}: more than this "
                f"server's context of {self.context_len} tokens", "max_new_tokens")
        sp.check_vocab(self.vocab_size)
        return sp


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: its longest vocabulary entry (byte-level
    and SentencePiece entries spell each byte with one character of at least one byte)."""
    return max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())
