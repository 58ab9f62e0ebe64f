"""Reading a JSON request body into a strict pydantic model, with a size bound."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from radixlm.server.errors import APIError, bad_request, from_validation_error

# Bigger than any prompt a context of a few hundred thousand tokens could hold as JSON.
MAX_BODY_BYTES = 32 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"Request body larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"Request body larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("Request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
