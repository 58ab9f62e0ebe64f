"""OpenAI's output shapes, made from the engine's outputs (their `meta_info`): logprobs, usage (cached
prompt tokens included), finish reasons and tool_calls entries. The one place for them, shared by the
server's /v1/chat/completions, /v1/completions and /v1/responses and by ChatSGLang (LangChain's
response_metadata and usage), so that every front door reports the same numbers the same way.
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.core.chat.tool_calls import new_call_id

# Logprobs of tokens the sampler could never pick are -inf, which JSON cannot carry; OpenAI-compatible
# servers send this floor instead.
MIN_LOGPROB = -9999.0


def logprob_value(lp: float | None) -> float | None:
    """A logprob as OpenAI reports it: -inf floored to MIN_LOGPROB; None (no logprob: the first prompt
    token) stays None."""
    return None if lp is None else max(lp, MIN_LOGPROB)


class TokenText:
    """token id -> its text (tokenizer.decode([id])), remembered: logprobs name every token they list."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(meta: dict[str, Any], top_n: int, token_text: TokenText) -> dict[str, Any]:
    """The chat `logprobs` object of the output tokens in meta: each token's text, logprob and UTF-8
    bytes, with its top_n most likely alternatives."""

    def entry(lp: float | None, token_id: int) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob_value(lp), "bytes": list(text.encode("utf-8"))}

    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (lp, token_id, _) in enumerate(meta.get("output_token_logprobs") or []):
        item = entry(lp, token_id)
        top = tops[i] if i < len(tops) and tops[i] else []
        item["top_logprobs"] = [entry(t_lp, t_id) for t_lp, t_id, _ in top[:top_n]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(meta: dict[str, Any], with_input: bool, offset: int, token_text: TokenText) -> dict[str, Any]:
    """The legacy completions `logprobs` object (the prompt's tokens first when with_input, as `echo`
    wants); text offsets count from `offset` characters."""
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [None] * len(entries))
    if with_input:
        entries = list(meta.get("input_token_logprobs") or []) + entries
        tops = list(meta.get("input_top_logprobs") or [None] * (len(entries) - len(tops))) + tops
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for (lp, token_id, _), top in zip(entries, tops):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob_value(lp))
        top_logprobs.append({token_text(t_id): logprob_value(t_lp) for t_lp, t_id, _ in top}
                            if top else (None if lp is None else {}))
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def usage(finals: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """The chat/completions `usage` of final outputs that come n per prompt: OpenAI counts each prompt
    (and its cached tokens) once however many choices it has."""
    prompts = finals[::n]
    prompt_tokens = sum(m["prompt_tokens"] for m in prompts)
    completion_tokens = sum(m["completion_tokens"] for m in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in prompts)}}


def responses_usage(meta: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's `usage` of one final output (the same counts under that API's names)."""
    u = usage([meta])
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def finish_reason(meta: dict[str, Any], tool_calls: bool = False) -> str | None:
    """The output's finish reason (None while it runs): the engine's stop, length or abort, and
    "tool_calls" for an output that stopped by itself after making tool calls (one cut short by the
    token limit stays "length", as OpenAI reports it)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return "tool_calls" if tool_calls and reason["type"] == "stop" else reason["type"]


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One `tool_calls` entry; arguments are serialized JSON, as OpenAI sends them (a string is taken as
    already serialized)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
