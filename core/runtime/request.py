"""A request as the scheduler sees it: tokens, KV bookkeeping, sampling state, and an explicit status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.core.runtime.constraint import TokenConstraint
from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.core.runtime.messages import GenerateRequest
from radixlm.core.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is an entity: `in` / `remove` on the scheduler's lists compare identity
class Req:
    inp: GenerateRequest
    detok: IncrementalDetokenizer  # finds stop strings (the output text is the front end's)
    arrival: int  # order of arrival, for fcfs and fairness
    constraint: TokenConstraint | None = None  # built from inp.constraint on arrival
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping: positions [0, kv_len) have KV in the slots `slots`; the first `cached_len` of
    # them belong to the radix tree (locked through `last_node`), the rest to this request.
    row: int | None = None
    slots: list[int] = field(default_factory=list)
    cached_len: int = 0
    last_node: Any = None
    # Prefix matched when the request was first scheduled, for `cached_tokens`.
    cached_tokens: int | None = None
    prefill_done: bool = False  # the prompt's logits (for input logprobs) have been taken once
    passed_over: int = 0  # scheduling rounds this request was eligible but not taken (fairness)
    finish_type: str | None = None
    finish_matched: str | int | None = None
    error: str | None = None  # why it ended early, for its client
    error_status: int | None = None  # set when it ended by a failure: the HTTP status its client gets
    # Logprob results: lists of (logprob, token_id, None) and top-k lists.
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    streamed_logprobs: int = 0  # output logprob entries already sent in stream chunks
    streamed_ids: int = 0  # output ids already sent in stream chunks
    replaced_sent: int = 0  # of those, how many jump-forward replaced since (the next chunk says so)
    created: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when first given KV (the end of its queue time)
    first_token_time: float | None = None
    spec: Any = None  # speculative decoding's state (core.runtime.speculative.state.SpecState), when on

    @property
    def rid(self) -> str:
        return self.inp.rid

    @property
    def params(self) -> SamplingParams:
        return self.inp.sampling_params

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: the prompt and all outputs but the newest, plus the
        newest (its KV is computed by the next step)."""
        return self.inp.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.inp.input_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        return len(self.slots)

    @property
    def finished(self) -> bool:
        return self.finish_type is not None

    def input_logprob_start(self) -> int | None:
        """First prompt position whose logprob is wanted, or None when no input logprobs are."""
        if not self.inp.return_logprob or self.inp.logprob_start_len is None or self.prefill_done:
            return None
        return max(0, min(self.inp.logprob_start_len, len(self.inp.input_ids)))
