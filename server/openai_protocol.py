"""OpenAI request bodies as strict pydantic models: wrong types and out-of-range values are rejected
here with the field named, before anything reaches the engine. Fields OpenAI defines that do not
change generation (user, metadata, store, ...) and unknown fields are ignored, as vLLM and SGLang do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ImageURL(_Strict):
    url: str
    detail: str | None = None  # accepted and ignored: the model's image processor fixes the resolution


class ContentPart(_Strict):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Parts other than text and image_url (audio, files) are rejected when the prompt is rendered;
    # image_url parts too unless the model is a vision-language one.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Strict):
    """Fields chat and completions share: OpenAI's sampling knobs and the vLLM/SGLang extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras (vLLM / SGLang names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    timeout: float | None = Field(None, gt=0)  # seconds (the request's deadline); default: --request-timeout


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class ResponseTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Strict):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)


class ResponseTool(FunctionDef):
    """A function tool in the Responses API's flat shape (other tool types are refused)."""

    type: Literal["function"]


class ResponseNamedToolChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """POST /v1/responses. `input` items are checked when they are turned into chat messages."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extras, as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
