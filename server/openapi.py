"""The OpenAPI 3.1 document served at /openapi.json, built from the request models themselves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

import radixlm
from radixlm.server.native import AbortRequest, GenerateRequest
from radixlm.server.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest

_ERROR = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_JSON_OR_STREAM = {"description": "The result, or server-sent events when stream is true",
                   "content": {"application/json": {}, "text/event-stream": {}}}

# path -> method -> (summary, request model or None, success response)
_ENDPOINTS: dict[str, dict[str, tuple[str, type[BaseModel] | None, dict[str, Any]]]] = {
    "/v1/chat/completions": {"post": ("OpenAI chat completion", ChatCompletionRequest, _JSON_OR_STREAM)},
    "/v1/completions": {"post": ("OpenAI (legacy) text completion", CompletionRequest, _JSON_OR_STREAM)},
    "/v1/responses": {"post": ("OpenAI Responses API (text, tools, text.format, previous_response_id)",
                               ResponsesRequest, _JSON_OR_STREAM)},
    "/v1/responses/{response_id}": {"get": ("A stored response", None, {"description": "Response object"})},
    "/v1/models": {"get": ("Lists the served model", None, {"description": "Model list"})},
    "/v1/models/{model}": {"get": ("Describes the served model", None, {"description": "Model card"})},
    "/generate": {"post": ("SGLang native generation (text or input_ids, single or batch)", GenerateRequest,
                           _JSON_OR_STREAM)},
    "/health": {"get": ("200 while the server accepts requests", None, {"description": "Healthy"})},
    "/health_generate": {"get": ("200 if the engine generates a token", None, {"description": "Healthy"})},
    "/get_model_info": {"get": ("Model path, context length, vocabulary", None, {"description": "Model info"})},
    "/get_server_info": {"get": ("Server and engine options, engine statistics (KV slots, cache hit rate)",
                                 None, {"description": "Server info"})},
    "/flush_cache": {"post": ("Drops every cached prefix (400 while requests run)", None,
                              {"description": "Flushed"})},
    "/abort_request": {"post": ("Aborts a request by rid, or all with abort_all", AbortRequest,
                                {"description": "Aborted"})},
    "/metrics": {"get": ("Prometheus metrics", None, {"description": "Prometheus text format",
                                                      "content": {"text/plain": {}}})},
    "/openapi.json": {"get": ("This document", None, {"description": "OpenAPI document"})},
}


def openapi_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    }
    paths: dict[str, Any] = {}
    for path, methods in _ENDPOINTS.items():
        paths[path] = {}
        for method, (summary, model, success) in methods.items():
            op: dict[str, Any] = {"summary": summary, "responses": {"200": success, "4XX": _ERROR, "5XX": _ERROR}}
            if model is not None:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            paths[path][method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixlm", "version": radixlm.__version__,
                 "description": "OpenAI-compatible and SGLang-native endpoints of a radixlm engine."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
