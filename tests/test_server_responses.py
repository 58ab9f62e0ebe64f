"""/v1/responses through the official `openai` client (create, stream, tools, text.format json_schema,
previous_response_id) and LangChain's ChatOpenAI(use_responses_api=True); and any model name served."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from pydantic import BaseModel, Field

from radixlm.server.openai_protocol import ResponsesRequest
from radixlm.server.responses_api import _chat_request, input_messages
from server_harness import render_chat, shared_server, wait_idle

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class Place(BaseModel):
    city: str = Field(max_length=12)


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused")


def test_create_matches_chat_completion(client, live):
    r = client.responses.create(model=live.model, input="Name a colour.", instructions="Be brief.",
                                max_output_tokens=6, **GREEDY)
    chat = client.chat.completions.create(model=live.model, max_tokens=6, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}], **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == live.model
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    expected_prompt = render_chat(live.engine, [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Name a colour."}])
    assert r.usage.input_tokens == len(expected_prompt) and r.usage.output_tokens == 6
    assert r.usage.total_tokens == len(expected_prompt) + 6
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_stream_events_and_helper(client, live):
    events = list(client.responses.create(model=live.model, input="Hello", max_output_tokens=8, stream=True,
                                          **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text and final.usage.output_tokens == 8
    assert kinds.count("response.output_text.delta") > 1  # streamed as it came, not whole
    # The SDK's helper (its final response needs response.completed: a reply that ends by itself).
    with client.responses.stream(model=live.model, input="Where?", text_format=Place, max_output_tokens=60,
                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and final.status == "completed"
    assert final.output_parsed == Place.model_validate_json(text)
    wait_idle(live)


def test_json_schema_format(client, live):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=live.model, input="Where?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_tools_and_previous_response_id(client, live):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                             "required": ["city"]}}]
    r = client.responses.create(model=live.model, input="Weather in Paris?", tools=tools, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), tools[0]["parameters"])
    follow = client.responses.create(model=live.model, previous_response_id=r.id, tools=tools, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], **GREEDY)
    # The same conversation sent in full gives the same prompt.
    whole = client.responses.create(model=live.model, tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], **GREEDY)
    assert follow.usage.input_tokens == whole.usage.input_tokens and follow.output_text == whole.output_text
    stream = list(client.responses.create(model=live.model, input="Weather in Rome?", tools=tools, stream=True,
                                          tool_choice="required", max_output_tokens=60, temperature=0))
    item = next(e.item for e in stream if e.type == "response.output_item.done")
    assert item.type == "function_call" and item.name == "get_weather"
    args = next(e for e in stream if e.type == "response.function_call_arguments.done").arguments
    assert args == item.arguments


def test_bad_requests(client, live):
    with pytest.raises(BadRequestError, match="previous_response_not_found|not found"):
        client.responses.create(model=live.model, input="x", previous_response_id="resp_nope")
    with pytest.raises(BadRequestError, match="only text content parts"):
        client.responses.create(model=live.model, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    with pytest.raises(NotFoundError):
        client.responses.retrieve("resp_nope")


def test_store_is_bounded(live):
    from radixlm.server.responses_api import ResponsesAPI

    api = ResponsesAPI(None, None, max_stored=2)  # only the store is exercised
    body = ResponsesRequest.model_validate({"input": "x"})
    meta = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0, "finish_reason": {"type": "stop"}}
    api.openai = type("O", (), {"engine": live.engine})()
    for i in range(3):
        api._finish(body, f"resp_{i}", [{"role": "user", "content": "x"}], [], meta)
    assert list(api._stored) == ["resp_1", "resp_2"]


def test_input_items_to_messages():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "r1"}]
    messages = input_messages(items)
    assert messages[0] == {"role": "developer", "content": "ab"}
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "r1"}
    chat = _chat_request(ResponsesRequest.model_validate({"input": "x", "tool_choice": {"type": "function",
                                                                                        "name": "f"}}), messages)
    assert chat.tool_choice.function.name == "f"


def test_chat_openai_any_model_and_responses_api(live):
    from langchain_openai import ChatOpenAI

    base = {"base_url": live.url + "/v1", "api_key": "unused", "temperature": 0, "max_tokens": 5}
    no_model = ChatOpenAI(**base).invoke("Hello")  # ChatOpenAI's default model name
    other = ChatOpenAI(model="gpt-4o", **base).invoke("Hello")
    assert no_model.content == other.content and other.response_metadata["model_name"] == live.model
    llm = ChatOpenAI(model=live.model, use_responses_api=True, **base)
    reply = llm.invoke("Hello")
    assert reply.id.startswith("resp_") and reply.text and reply.response_metadata["model_name"] == live.model
    assert reply.usage_metadata["output_tokens"] <= 5
    chunks = list(llm.stream("Hello"))
    assert "".join(c.text for c in chunks) == reply.text

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    called = ChatOpenAI(model=live.model, use_responses_api=True, **{**base, "max_tokens": 40}).bind_tools(
        [get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert isinstance(called.tool_calls[0]["args"].get("city"), str)
