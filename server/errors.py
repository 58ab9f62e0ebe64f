"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every endpoint.

Handlers raise APIError; the exception handlers installed by the app turn it (and Starlette's own
404/405, the engine's InvalidRequestError, and anything unexpected) into that JSON body.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixlm.core.errors import InvalidRequestError

logger = logging.getLogger("radixlm.server")

# OpenAI's error `type` for each status this server returns.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    408: "timeout_error",
    500: "server_error",
    503: "service_unavailable_error",
    507: "server_error",
}
# The error `code` of a request the engine ended by a failure, by the HTTP status it carries.
_FAILURE_CODES = {408: "timeout", 503: "shutdown", 507: "out_of_memory"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def failure_code(status: int) -> str:
    """The `code` of a request the engine ended by a failure with this status: a deadline (408), the
    engine stopping (503), memory (507), else a generation failure."""
    return _FAILURE_CODES.get(status, "generation_failed")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, with the offending field as `param`."""
    first = exc.errors(include_url=False)[0]
    loc = first.get("loc", ())
    if first["type"] == "json_invalid":
        return bad_request(f"Invalid JSON body: {first['msg']}", code="invalid_json")
    if not loc:
        return bad_request(f"Request body: {first['msg']}")
    # Pydantic puts union-member tags (e.g. 'str', 'list[int]') into the location; they mean nothing to
    # a client, so the reported path keeps field names and list indices only.
    path = ".".join(str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS))
    return bad_request(f"'{path}': {first['msg']}", param=str(loc[0]))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


def from_engine_error(exc: InvalidRequestError) -> APIError:
    return bad_request(str(exc), param=exc.param)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = {404: f"Not found: {request.method} {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return error_response(APIError(exc.status_code, message, headers=exc.headers))


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return error_response(from_engine_error(exc))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return error_response(from_validation_error(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"Internal server error: {type(exc).__name__}"))


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    HTTPException: _http_exception,
    InvalidRequestError: _invalid_request,
    ValidationError: _validation_error,
    Exception: _unexpected,
}
