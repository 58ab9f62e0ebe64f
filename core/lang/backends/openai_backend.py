"""`sgl.OpenAI`: programs on an OpenAI-style API (OpenAI itself, or any compatible server such as
radixlm's own), through the official `openai` client.

An API keeps no KV state between calls, so every gen resends the whole prompt; programs declared
with `@function(num_api_spec_tokens=N)` save calls by API speculative execution
(core/lang/backends/speculative.py). `token_usage` counts what the calls cost.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from radixlm.core.lang.backends.base import BaseBackend, StreamState
from radixlm.core.errors import InvalidRequestError
from radixlm.core.lang.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from radixlm.core.lang.errors import ProgramError

if TYPE_CHECKING:
    from radixlm.core.lang.choices import ChoicesDecision, ChoicesSamplingMethod
    from radixlm.core.lang.ir import GenParams

# OpenAI models that only have the completions API; every other name is taken for a chat model.
INSTRUCT_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


@dataclass
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.requests = 0


class OpenAI(BaseBackend):
    supports_api_speculation = True

    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool | None = None, chat_template: str | ChatTemplate | None = None,
                 **client_kwargs: Any) -> None:
        super().__init__()
        import openai

        api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = model_name not in INSTRUCT_MODEL_NAMES if is_chat_model is None else is_chat_model
        self.supports_vision = self.is_chat_model
        if isinstance(chat_template, str):
            self.chat_template = get_chat_template(chat_template)
        else:
            self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        self.token_usage = TokenUsage()
        self._usage_lock = threading.Lock()

    def get_model_name(self) -> str:
        return self.model_name

    # ----- calls -----

    def _arguments(self, s: "StreamState", params: "GenParams") -> dict[str, Any]:
        if params.constraint()[0]:
            raise InvalidRequestError("regex, json_schema and dtype gens need constrained decoding, which the "
                                      "OpenAI API does not offer; use a radixlm Engine or RuntimeEndpoint", "regex")
        arguments = {"model": self.model_name, **params.openai_kwargs()}
        if self.is_chat_model:
            arguments["messages"] = self._messages(s)
            if params.return_logprob:
                arguments["logprobs"] = True
                if params.top_logprobs_num:
                    arguments["top_logprobs"] = params.top_logprobs_num
        else:
            arguments["prompt"] = s.text_
            if params.return_logprob:
                arguments["logprobs"] = params.top_logprobs_num or 0
        return arguments

    def _messages(self, s: "StreamState") -> list[dict[str, Any]]:
        """The conversation so far. A chat model writes whole assistant messages, so a gen must be
        inside an assistant role; text the program already put in that message is sent as a final
        assistant message for the model to continue."""
        if s.cur_role != "assistant":
            raise ProgramError("a chat model generates only inside an assistant role: wrap the gen in "
                               "sgl.assistant(...) / `with s.assistant():`")
        messages = list(s.messages_)
        partial = s.text_[s.cur_role_begin_pos:]
        if partial:
            messages.append({"role": "assistant", "content": partial})
        return messages

    def _count(self, usage: Any) -> None:
        with self._usage_lock:
            self.token_usage.requests += 1
            if usage is not None:
                self.token_usage.prompt_tokens += usage.prompt_tokens
                self.token_usage.completion_tokens += usage.completion_tokens

    def generate(self, s: "StreamState", params: "GenParams") -> tuple[str, dict[str, Any]]:
        arguments = self._arguments(s, params)
        if self.is_chat_model:
            response = self.client.chat.completions.create(**arguments)
            choice = response.choices[0]
            text = choice.message.content or ""
            tokens = [(t.logprob, t.token) for t in choice.logprobs.content or []] if choice.logprobs else None
        else:
            response = self.client.completions.create(**arguments)
            choice = response.choices[0]
            text = choice.text
            tokens = list(zip(choice.logprobs.token_logprobs, choice.logprobs.tokens)) if choice.logprobs else None
        self._count(response.usage)
        usage = response.usage
        meta: dict[str, Any] = {"finish_reason": choice.finish_reason,
                                "prompt_tokens": usage.prompt_tokens if usage else None,
                                "completion_tokens": usage.completion_tokens if usage else None}
        if tokens is not None:
            meta["output_token_logprobs"] = [(lp, None, token) for lp, token in tokens]
        return text, meta

    def generate_stream(self, s: "StreamState", params: "GenParams") -> Iterator[tuple[str, dict[str, Any]]]:
        arguments = self._arguments(s, params)
        arguments.update(stream=True, stream_options={"include_usage": True})
        create = self.client.chat.completions.create if self.is_chat_model else self.client.completions.create
        usage = None
        for chunk in create(**arguments):
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = (choice.delta.content if self.is_chat_model else choice.text) or ""
            if text or choice.finish_reason:
                yield text, {"finish_reason": choice.finish_reason}
        self._count(usage)

    def select(self, s: "StreamState", choices: list[str], temperature: float,
               choices_method: "ChoicesSamplingMethod") -> "ChoicesDecision":
        """Completion models: one call scores every choice (echo of prompt + choice with logprobs,
        no new tokens); the choice's tokens are those that end past the prompt's text."""
        if self.is_chat_model:
            raise ProgramError("select needs prompt logprobs, which chat APIs do not return; use a "
                               "completion model (is_chat_model=False) or a radixlm Engine/RuntimeEndpoint")
        if temperature > 1e-5:
            raise InvalidRequestError("select picks the best choice (temperature 0); sampling among choices "
                                      "is not supported", "temperature")
        if choices_method.requires_unconditional_logprobs:
            raise ProgramError(f"{choices_method!r} needs logprobs of the choices' token ids alone, which an "
                               "OpenAI-style API does not expose; use a radixlm Engine or RuntimeEndpoint")
        response = self.client.completions.create(model=self.model_name, prompt=[s.text_ + c for c in choices],
                                                  max_tokens=0, echo=True, logprobs=0, temperature=0)
        self._count(response.usage)
        start = len(s.text_)
        scored = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            lp = choice.logprobs
            scored.append([(logprob, None, token) for token, logprob, offset in
                           zip(lp.tokens, lp.token_logprobs, lp.text_offset)
                           if offset + len(token) > start and logprob is not None])
        return choices_method(choices=choices,
                              normalized_prompt_logprobs=[sum(e[0] for e in row) / len(row) for row in scored],
                              input_token_logprobs=scored, output_token_logprobs=[[] for _ in choices])
