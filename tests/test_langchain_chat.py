"""ChatSGLang's own behaviour, against independent oracles: the engine's greedy output on the prompt rendered
independently with the chat template (server_harness.render_chat), jsonschema for constrained replies,
the engine's own logprobs, and the chat template for message rendering. In-process and through the server
(one engine behind both, shared with the other langchain test files)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import jsonschema
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumpd, load
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from radixlm.adapters.langchain import ChatSGLang
from radixlm.adapters.langchain.tools import parse_reply, tool_mode
from radixlm.testing.checkpoints import tiny_model_path
from server_harness import LiveServer, render_chat, shared_server

MAX = 12


@pytest.fixture(scope="module")
def live() -> Any:
    return shared_server(tiny_model_path())


@pytest.fixture
def llm(live: Any) -> ChatSGLang:
    return ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX)


def greedy(engine: Any, messages: list[dict[str, Any]], max_new_tokens: int = MAX, **kwargs: Any) -> dict[str, Any]:
    ids = render_chat(engine, messages)
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0,
                                                           **kwargs})


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "sunny"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Person(BaseModel):
    """A person."""

    name: str = Field(description="their name")
    age: int = Field(description="their age in years", ge=0, le=150)


CONVERSATION = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]
ORACLE_CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


# ----- plain chat -----

def test_invoke_matches_the_engine_on_the_independently_rendered_prompt(llm: ChatSGLang, live: Any) -> None:
    expected = greedy(live.engine, ORACLE_CONVERSATION)
    reply = llm.invoke(CONVERSATION)
    assert reply.content == expected["text"]
    assert reply.usage_metadata["input_tokens"] == len(render_chat(live.engine, ORACLE_CONVERSATION))
    assert reply.usage_metadata["output_tokens"] == expected["meta_info"]["completion_tokens"]
    assert reply.usage_metadata["total_tokens"] == reply.usage_metadata["input_tokens"] + reply.usage_metadata["output_tokens"]
    assert reply.response_metadata["model_name"] == live.engine.served_model_name
    assert reply.response_metadata["finish_reason"] == expected["meta_info"]["finish_reason"]["type"]


def test_stream_adds_up_to_invoke(llm: ChatSGLang) -> None:
    reply = llm.invoke(CONVERSATION)
    chunks = list(llm.stream(CONVERSATION))
    assert len(chunks) > 2
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.content == reply.content
    assert [c.chunk_position for c in chunks].count("last") == 1 and chunks[-1].chunk_position == "last"
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    assert full.usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert full.usage_metadata["output_tokens"] == reply.usage_metadata["output_tokens"]
    assert full.response_metadata["model_name"] == reply.response_metadata["model_name"]
    assert full.response_metadata["finish_reason"] == reply.response_metadata["finish_reason"]


def test_streaming_flag_streams_invoke_to_callbacks(live: Any) -> None:
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = Tokens()
    streaming = ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX, streaming=True)
    reply = streaming.invoke(CONVERSATION, config={"callbacks": [handler]})
    assert len(handler.tokens) > 2 and "".join(handler.tokens) == reply.content
    assert reply.content == ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX).invoke(CONVERSATION).content
    assert reply.usage_metadata["output_tokens"] == MAX


def test_through_the_server_gives_the_in_process_replies(llm: ChatSGLang, live: Any) -> None:
    for base_url in (live.url, live.url + "/v1"):
        remote = ChatSGLang(base_url=base_url, temperature=0, max_tokens=MAX)
        reply = remote.invoke(CONVERSATION)
        assert reply.content == llm.invoke(CONVERSATION).content
        assert "".join(c.content for c in remote.stream(CONVERSATION)) == reply.content
        assert reply.response_metadata["model_name"] == live.engine.served_model_name


def test_async_calls(llm: ChatSGLang) -> None:
    expected = llm.invoke("Hello").content

    async def run() -> tuple[Any, list[Any], str]:
        one = await llm.ainvoke("Hello")
        many = await llm.abatch(["Hello", "Hello"])
        streamed = "".join([c.content async for c in llm.astream("Hello")])
        return one, many, streamed

    one, many, streamed = asyncio.run(run())
    assert one.content == expected and [m.content for m in many] == [expected, expected] and streamed == expected


def test_stop_strings_and_call_options(llm: ChatSGLang, live: Any) -> None:
    full = greedy(live.engine, ORACLE_CONVERSATION)["text"]
    stop = full[3:5]  # a string the reply is known to contain
    reply = llm.invoke(CONVERSATION, stop=[stop])
    assert reply.content == greedy(live.engine, ORACLE_CONVERSATION, stop=[stop])["text"] == full[:full.index(stop)]
    assert ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX, stop=[stop]).invoke(CONVERSATION).content \
        == reply.content
    short = llm.invoke(CONVERSATION, max_tokens=3)
    assert short.usage_metadata["output_tokens"] == 3 and short.response_metadata["finish_reason"] == "length"
    call = llm.to_call(CONVERSATION, None, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
                       frequency_penalty=0.25)
    params = call.params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.presence_penalty,
            params.frequency_penalty) == (0.7, 0.9, 5, 0.1, 0.5, 0.25)
    # No max_tokens: whatever room the context leaves.
    room = ChatSGLang(engine=live.engine).to_call(CONVERSATION).params.max_new_tokens
    assert room == live.engine.context_len - len(render_chat(live.engine, ORACLE_CONVERSATION))


def test_cache_reads_are_reported(llm: ChatSGLang, live: Any) -> None:
    prompt = "Explain radix trees to a new engineer, step by step. " * 6
    assert live.engine.flush_cache()
    first = llm.invoke(prompt)
    second = llm.invoke(prompt)
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    # Everything but the last prompt token (which the engine recomputes to get the next logits) is reused.
    assert second.usage_metadata["input_token_details"]["cache_read"] >= second.usage_metadata["input_tokens"] - 1


def test_logprobs_are_the_engines(llm: ChatSGLang, live: Any) -> None:
    reply = llm.invoke(CONVERSATION, logprobs=True, top_logprobs=3, max_tokens=4)
    oracle = live.engine.generate(input_ids=render_chat(live.engine, ORACLE_CONVERSATION),
                                  sampling_params={"max_new_tokens": 4, "temperature": 0},
                                  return_logprob=True, top_logprobs_num=3)["meta_info"]
    content = reply.response_metadata["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx([lp for lp, _, _ in oracle["output_token_logprobs"]])
    assert "".join(e["token"] for e in content) == reply.content
    for entry, top in zip(content, oracle["output_top_logprobs"]):
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp for lp, _, _ in top])
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely one
    assert "logprobs" not in llm.invoke(CONVERSATION).response_metadata


# ----- tools -----

def test_named_tool_choice_gives_arguments_that_follow_the_schema(llm: ChatSGLang) -> None:
    bound = llm.bind_tools([get_weather, add], tool_choice="add", max_string_length=8)
    reply = bound.invoke("What is 2 + 2?", max_tokens=40)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    assert [c["name"] for c in reply.tool_calls] == ["add"]
    jsonschema.validate(reply.tool_calls[0]["args"], convert_to_openai_tool(add)["function"]["parameters"])
    assert reply.tool_calls[0]["id"].startswith("call_") and reply.content == ""
    streamed = None
    for chunk in bound.stream("What is 2 + 2?", max_tokens=40):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    # The {"type": "function", ...} form names a tool too.
    other = llm.bind_tools([get_weather, add], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert other.invoke("Weather?", max_tokens=40, max_string_length=8).tool_calls[0]["name"] == "get_weather"


def test_required_tool_choice_calls_declared_tools(llm: ChatSGLang) -> None:
    one = llm.bind_tools([get_weather, add], tool_choice="any", parallel_tool_calls=False)
    reply = one.invoke("Weather in Paris?", max_tokens=48, max_string_length=6)
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    schemas = {t.name: convert_to_openai_tool(t)["function"]["parameters"] for t in (get_weather, add)}
    jsonschema.validate(call["args"], schemas[call["name"]])
    # With parallel calls allowed, every call of the array is one of the tools with valid arguments.
    many = llm.bind_tools([get_weather, add], tool_choice="required").invoke("Weather?", max_tokens=120,
                                                                            max_string_length=4)
    assert many.tool_calls or many.invalid_tool_calls
    for c in many.tool_calls:
        jsonschema.validate(c["args"], schemas[c["name"]])


def test_a_forced_call_cut_short_is_an_invalid_tool_call(llm: ChatSGLang) -> None:
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?", max_tokens=3)
    assert reply.tool_calls == [] and len(reply.invalid_tool_calls) == 1
    assert reply.invalid_tool_calls[0]["name"] == "get_weather" and "not complete JSON" in reply.invalid_tool_calls[0]["error"]
    assert reply.response_metadata["finish_reason"] == "length"


def test_tools_in_the_prompt(llm: ChatSGLang, live: Any) -> None:
    question = [HumanMessage("Weather?")]
    oracle_tools = [convert_to_openai_tool(get_weather)]
    with_tools = live.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}],
                                                           tools=oracle_tools, tokenize=False,
                                                           add_generation_prompt=True)
    assert llm.to_call(question, tools=oracle_tools).prompt == with_tools  # auto: tools in the prompt
    assert "# Tools" in with_tools
    assert llm.to_call(question, tools=oracle_tools, tool_choice="none").prompt == llm.to_call(question).prompt


def test_tool_histories_render_as_the_chat_template_does(llm: ChatSGLang, live: Any) -> None:
    messages = [HumanMessage("What is 1 + 2?"),
                AIMessage([{"type": "text", "text": "Let me add."},
                           {"type": "tool_use", "id": "abc", "name": "add", "input": {"a": 1, "b": 2}}],
                          tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "abc", "type": "tool_call"}]),
                ToolMessage(json.dumps({"result": 3}), tool_call_id="abc", name="add")]
    oracle = [{"role": "user", "content": "What is 1 + 2?"},
              {"role": "assistant", "content": "Let me add.",
               "tool_calls": [{"id": "abc", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
              {"role": "tool", "content": '{"result": 3}', "tool_call_id": "abc", "name": "add"}]
    expected = live.engine.tokenizer.apply_chat_template(oracle, tokenize=False, add_generation_prompt=True)
    assert llm.to_call(messages).prompt == expected
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in expected
    assert isinstance(llm.invoke(messages), AIMessage)


def test_auto_tool_calls_are_parsed_from_the_text() -> None:
    mode = tool_mode([convert_to_openai_tool(get_weather), convert_to_openai_tool(add)], "auto", None)
    hermes = parse_reply(mode, 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert hermes.content == "Sure." and [(c["name"], c["args"]) for c in hermes.calls] == [("add", {"a": 1, "b": 2})]
    llama = parse_reply(mode, '[{"name": "get_weather", "parameters": {"location": "Paris"}}, '
                              '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}]')
    assert [(c["name"], c["args"]) for c in llama.calls] == [("get_weather", {"location": "Paris"}), ("add", {"a": 1, "b": 1})]
    for text in ('{"name": "unknown_tool", "arguments": {}}', "<tool_call>{not json</tool_call>", "plain words"):
        assert parse_reply(mode, text).calls == [] and parse_reply(mode, text).content == text


# ----- structured output -----

def test_structured_output_follows_the_schema(live: Any) -> None:
    llm = ChatSGLang(engine=live.engine, temperature=0, max_tokens=48, max_string_length=6)

    class PersonDict(TypedDict):
        name: str
        age: int

    for schema in (Person, PersonDict, Person.model_json_schema()):
        for method in ("json_schema", "function_calling"):
            structured = llm.with_structured_output(schema, method=method, include_raw=True)
            out = structured.invoke("Describe someone.")
            assert out["parsing_error"] is None, (schema, method, out)
            raw = out["raw"]
            value = json.loads(raw.content) if method == "json_schema" else raw.tool_calls[0]["args"]
            jsonschema.validate(value, convert_to_json_schema(schema))
            parsed = out["parsed"]
            assert isinstance(parsed, Person) if schema is Person else parsed == value


def test_json_mode_constrains_to_a_json_object(llm: ChatSGLang, live: Any) -> None:
    bound = llm.bind(response_format={"type": "json_object"})
    reply = bound.invoke(CONVERSATION)
    oracle = greedy(live.engine, ORACLE_CONVERSATION, json_schema=json.dumps({"type": "object"}))
    assert reply.content == oracle["text"] and reply.content.startswith("{")
    assert llm.to_call(CONVERSATION, response_format={"type": "json_object"}).params.json_schema == {"type": "object"}


def test_string_bound_only_narrows_the_schema(llm: ChatSGLang) -> None:
    call = llm.to_call(CONVERSATION, response_format=Person, max_string_length=5)
    assert call.params.json_schema["properties"]["name"]["maxLength"] == 5
    assert "maxLength" not in llm.to_call(CONVERSATION, response_format=Person).params.json_schema["properties"]["name"]
    value = json.loads(llm.invoke(CONVERSATION, response_format=Person, max_string_length=5, max_tokens=40).content)
    jsonschema.validate(value, call.params.json_schema)
    jsonschema.validate(value, Person.model_json_schema())


# ----- configuration and errors -----

def test_model_names_are_checked(llm: ChatSGLang, live: Any) -> None:
    assert llm.invoke("Hi", model=live.engine.served_model_name).response_metadata["model_name"] \
        == live.engine.served_model_name
    with pytest.raises(ValueError, match="not served here"):
        ChatSGLang(engine=live.engine, model="gpt-4o").invoke("Hi")


def test_bad_requests_are_refused(llm: ChatSGLang, live: Any) -> None:
    with pytest.raises(ValueError, match="text-only"):
        llm.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])
    with pytest.raises(ValueError, match="unsupported call option"):
        llm.invoke("Hi", frobnicate=True)
    with pytest.raises(ValueError, match="not among the tools"):
        llm.bind_tools([get_weather], tool_choice="add")
    with pytest.raises(ValueError, match="forced tool_choice cannot be combined"):
        llm.bind_tools([get_weather], tool_choice="any").invoke("Hi", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="one of engine, model_path and base_url"):
        ChatSGLang(engine=live.engine, base_url=live.url)
    with pytest.raises(ValueError, match="sampling parameter 'temperature'"):
        llm.invoke("Hi", temperature=-1)


def test_in_process_timeout(live: Any) -> None:
    slow = ChatSGLang(engine=live.engine, temperature=0, max_tokens=64, timeout=0.001)
    with pytest.raises(TimeoutError):
        slow.invoke("Hello")


def test_model_path_starts_one_shared_engine(live: Any) -> None:
    a = ChatSGLang(model_path=tiny_model_path(), temperature=0, max_tokens=MAX)
    b = ChatSGLang(model_path=tiny_model_path(), temperature=1)
    assert a.connection().backend is b.connection().backend
    assert a.connection().backend.engine is not live.engine
    # Same checkpoint, another engine: the same greedy reply.
    assert a.invoke(CONVERSATION).content == ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX).invoke(
        CONVERSATION).content


@pytest.mark.filterwarnings("ignore:The function `load` is in beta")
def test_serialization_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = ChatSGLang(base_url="http://127.0.0.1:9", api_key="sekret", model="m", temperature=0.5, max_tokens=7)
    dumped = dumpd(llm)
    assert "sekret" not in json.dumps(dumped)
    assert dumped["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["RADIXLM_API_KEY"]}
    monkeypatch.setenv("RADIXLM_API_KEY", "from-env")
    loaded = load(dumped, valid_namespaces=["radixlm"], allowed_objects=[ChatSGLang], secrets_from_env=True)
    assert isinstance(loaded, ChatSGLang) and loaded.asdict() == llm.asdict()
    assert loaded.api_key.get_secret_value() == "from-env" and loaded.max_tokens == 7


def test_server_api_key(live: Any) -> None:
    guarded = LiveServer(live.engine, api_key="sekret")
    try:
        ok = ChatSGLang(base_url=guarded.url, api_key="sekret", temperature=0, max_tokens=4)
        assert ok.invoke("Hi").content == ChatSGLang(engine=live.engine, temperature=0, max_tokens=4).invoke("Hi").content
        with pytest.raises(Exception, match="401"):
            ChatSGLang(base_url=guarded.url, api_key="wrong", max_tokens=4).invoke("Hi")
    finally:
        guarded.stop()


class _Flaky(ThreadingHTTPServer):
    """A proxy in front of the server whose first `failures` /generate calls answer 503."""

    def __init__(self, target: str, failures: int) -> None:
        self.target, self.failures, self.generate_calls = target, failures, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                response = httpx.get(proxy.target + self.path)
                self._answer(response.status_code, response.content)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.generate_calls += 1
                if proxy.generate_calls <= proxy.failures:
                    self._answer(503, b'{"error": {"message": "queue full"}}')
                    return
                response = httpx.post(proxy.target + self.path, content=body,
                                      headers={"Content-Type": "application/json"}, timeout=60)
                self._answer(response.status_code, response.content)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_server_calls_are_retried(live: Any) -> None:
    flaky = _Flaky(live.url, failures=2)
    try:
        reply = ChatSGLang(base_url=flaky.url, max_retries=2, temperature=0, max_tokens=4).invoke("Hi")
        assert flaky.generate_calls == 3 and reply.usage_metadata["output_tokens"] == 4
        flaky.generate_calls = 0
        with pytest.raises(Exception, match="503"):
            ChatSGLang(base_url=flaky.url, max_retries=1, max_tokens=4).invoke("Hi")
        assert flaky.generate_calls == 2
    finally:
        flaky.shutdown()
