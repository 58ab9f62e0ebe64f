"""core.chat.openai_output, the one shaping of OpenAI outputs, checked against the official `openai` client's
types (what a client parses) and strict JSON; ChatSGLang's usage and finish reason come from it too."""

from __future__ import annotations

import json
import math

from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import CompletionUsage
from openai.types.responses import ResponseUsage

from radixlm.adapters.langchain.messages import response_metadata, usage_metadata
from radixlm.adapters.langchain.tools import ParsedCalls
from radixlm.core.chat.openai_output import (MIN_LOGPROB, TokenText, chat_logprobs, completion_logprobs, finish_reason,
                                        responses_usage, usage)

INF = math.inf


class Tokenizer:
    """Token i decodes to a multi-byte string (so `bytes` are checked on UTF-8, not ASCII); decodes counted."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(f"é{i}" for i in ids)


def _meta(**fields) -> dict:
    return {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 4, "finish_reason": {"type": "stop"},
            **fields}


def test_chat_logprobs_parse_as_openai_types_with_inf_floored():
    tokenizer = Tokenizer()
    meta = _meta(output_token_logprobs=[(-0.25, 5, None), (-INF, 7, None)],
                 output_top_logprobs=[[(-0.25, 5, None), (-2.0, 6, None)], [(-1.0, 8, None), (-INF, 7, None)]])
    shaped = chat_logprobs(meta, 2, TokenText(tokenizer))
    parsed = ChoiceLogprobs.model_validate(json.loads(json.dumps(shaped, allow_nan=False)))
    assert [(e.token, e.logprob) for e in parsed.content] == [("é5", -0.25), ("é7", MIN_LOGPROB)]
    assert [(t.token, t.logprob) for t in parsed.content[1].top_logprobs] == [("é8", -1.0), ("é7", MIN_LOGPROB)]
    assert all(bytes(e.bytes).decode() == e.token for e in parsed.content)
    assert tokenizer.calls == 4  # each distinct token decoded once
    assert [len(e.top_logprobs) for e in ChoiceLogprobs.model_validate(chat_logprobs(meta, 1, TokenText(tokenizer))).content] == [1, 1]


def test_completion_logprobs_parse_as_openai_types_and_echo_the_prompt():
    meta = _meta(input_token_logprobs=[(None, 1, None), (-INF, 2, None)],
                 input_top_logprobs=[None, [(-0.5, 3, None)]],
                 output_token_logprobs=[(-0.75, 4, None), (-INF, 5, None)],
                 output_top_logprobs=[[(-0.75, 4, None)], [(-INF, 5, None)]])
    parsed = Logprobs.model_validate(json.loads(json.dumps(
        completion_logprobs(meta, False, 3, TokenText(Tokenizer())), allow_nan=False)))
    assert parsed.tokens == ["é4", "é5"] and parsed.text_offset == [3, 5]
    assert parsed.token_logprobs == [-0.75, MIN_LOGPROB]
    assert parsed.top_logprobs == [{"é4": -0.75}, {"é5": MIN_LOGPROB}]
    # with echo the prompt comes first; its first token has no logprob (null, as OpenAI sends it)
    echoed = completion_logprobs(meta, True, 0, TokenText(Tokenizer()))
    assert echoed["tokens"] == ["é1", "é2", "é4", "é5"] and echoed["text_offset"] == [0, 2, 4, 6]
    assert echoed["token_logprobs"] == [None, MIN_LOGPROB, -0.75, MIN_LOGPROB]
    assert echoed["top_logprobs"] == [None, {"é3": -0.5}, {"é4": -0.75}, {"é5": MIN_LOGPROB}]


def test_usage_counts_each_prompt_once_with_its_cached_tokens():
    finals = [_meta(prompt_tokens=10, cached_tokens=4, completion_tokens=c) for c in (1, 2)]
    finals += [_meta(prompt_tokens=20, cached_tokens=0, completion_tokens=c) for c in (3, 4)]
    u = CompletionUsage.model_validate(usage(finals, n=2))
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (30, 10, 40)
    assert u.prompt_tokens_details.cached_tokens == 4
    # the Responses API's names for the same counts (its client types also want cache_write_tokens, which
    # the server does not report: constructed as the client parses, leniently)
    r = ResponseUsage.construct(**responses_usage(finals[0]))
    assert (r.input_tokens, r.output_tokens, r.total_tokens) == (10, 1, 11)
    assert r.input_tokens_details.cached_tokens == 4 and r.output_tokens_details.reasoning_tokens == 0
    # ChatSGLang reports the same counts in LangChain's shape
    lc = usage_metadata(finals[0])
    assert (lc["input_tokens"], lc["output_tokens"], lc["total_tokens"]) == (10, 1, 11)
    assert lc["input_token_details"]["cache_read"] == 4


def test_finish_reasons():
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason(_meta()) == "stop"
    assert finish_reason(_meta(), tool_calls=True) == "tool_calls"
    # a call cut short by the token limit is reported as such, not as a finished call
    assert finish_reason(_meta(finish_reason={"type": "length"}), tool_calls=True) == "length"
    assert finish_reason(_meta(finish_reason={"type": "abort"}), tool_calls=True) == "abort"
    calls = ParsedCalls("", calls=[{"name": "f", "args": {}, "id": "call_1", "type": "tool_call"}])
    assert response_metadata(_meta(), "m", calls)["finish_reason"] == "tool_calls"
    assert response_metadata(_meta(finish_reason={"type": "length"}), "m", calls)["finish_reason"] == "length"
