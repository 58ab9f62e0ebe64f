"""The messages between the request front end and the scheduler: plain, picklable dataclasses.

Nothing else crosses the boundary: no closure, lock, queue, tensor, tokenizer or live constraint.
The front end puts `GenerateRequest`, `Abort` and the calls (`FlushCache`, `GetStats`,
`CheckInvariants`) on the scheduler's inbox; the scheduler puts `GenerateOutput` and `CallReply` on
one outbox. So the scheduler loop can run on a thread or in its own process (`scheduler_process`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from radixlm.core.runtime.sampling_params import SamplingParams

CONSTRAINT_KINDS = ("regex", "json_schema", "choices")


@dataclass(frozen=True)
class ConstraintSpec:
    """What to constrain the output to; the scheduler compiles it (through the grammar index cache)."""

    kind: str  # one of CONSTRAINT_KINDS
    spec: str | tuple[str, ...]  # the pattern, the schema's JSON text, or the choices

    @classmethod
    def of(cls, params: SamplingParams) -> "ConstraintSpec | None":
        """The constraint the sampling parameters ask for (at most one kind), or None."""
        for kind in CONSTRAINT_KINDS:
            spec = getattr(params, kind)
            if spec is not None:
                return cls(kind, tuple(spec) if isinstance(spec, list) else spec)
        return None

    def value(self) -> str | list[str]:
        """The spec as build_constraint takes it."""
        return list(self.spec) if isinstance(self.spec, tuple) else self.spec


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed by the front end (core.runtime.images): a numpy array, which
    pickles. Prompt positions [offset, offset + length) hold `pad_id` and take its feature rows."""

    pixel_values: Any  # numpy float32: LLaVA [channels, height, width]; Qwen2-VL [patches, patch values]
    pad_id: int  # an id past the vocabulary derived from the pixels' hash: the radix cache's key
    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: the patch grid (frames, rows, columns)


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # n == 1 and max_new_tokens resolved: the front end splits and checks
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    stream: bool = False
    constraint: ConstraintSpec | None = None
    images: tuple[ImageInput, ...] = ()  # in prompt order; their positions in input_ids hold pad ids
    # M-RoPE models with images: the prompt's rotary positions [3, len(input_ids)] (numpy int64, t/h/w)
    # and the offset of every later position (output tokens): position = index + rope_delta.
    rope_positions: Any = None
    rope_delta: int = 0
    deadline: float | None = None  # time.time() past which the scheduler ends it (a timeout); None: none


@dataclass
class FinishReason:
    type: str  # "stop", "length" or "abort"
    matched: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # why it ended early, for its client
    status_code: int | None = None  # set when it ended by a failure: the HTTP status its client gets


@dataclass
class GenerateOutput:
    """One output of a request: a stream chunk, or its final output (`finish` set). `output_ids` are the
    ids new since the previous output of this request; they replace its last `replaced` ids first
    (jump-forward re-tokenized a tail that had already been sent). `text` is a stream chunk's new text,
    or the whole text of a final output that was not streamed."""

    rid: str
    output_ids: list[int]
    text: str = ""
    replaced: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # (logprob, token id, None) per token and top-k lists; the output ones new since the last output.
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    output_token_logprobs: list | None = None
    output_top_logprobs: list | None = None
    finish: FinishReason | None = None
    # Seconds, on the final output: end to end, to the first token, waiting for KV.
    e2e_latency: float | None = None
    ttft: float | None = None
    queue_time: float | None = None
    dp_rank: int | None = None  # the data-parallel worker that ran it (dp_size > 1)
    # Speculative decoding (on the final output, when on): verify steps that checked a draft of this
    # request, and the draft tokens accepted in all.
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int | None = None


@dataclass
class Abort:
    rid: str


@dataclass
class FlushCache:
    """Drop every cached prefix; replied True, or False (dropping nothing) while requests are in flight."""

    call_id: int = 0


@dataclass
class GetStats:
    """Exact statistics, read between two steps; replied with a dict of numbers."""

    call_id: int = 0


@dataclass
class CheckInvariants:
    """Debug check of the KV slot accounting; replied None, or with the AssertionError."""

    call_id: int = 0


@dataclass
class CallReply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass
class StatsSnapshot:
    """The statistics after a loop iteration, published (no more than a few times a second) by a
    scheduler in its own process, for what must answer without waiting for a step (/metrics, /health)."""

    stats: dict[str, Any] = field(default_factory=dict)
    last_progress: float = 0.0  # time.time() of the loop's latest progress


@dataclass
class Ready:
    """A scheduler in its own process has loaded the model (or failed to: `error`)."""

    kv_pool_size: int = 0
    error: BaseException | None = None


Call = Union[FlushCache, GetStats, CheckInvariants]
InboxMessage = Union[GenerateRequest, Abort, FlushCache, GetStats, CheckInvariants, None]  # None: stop
OutboxMessage = Union[GenerateOutput, CallReply, StatsSnapshot, Ready, None]  # None: stop draining
