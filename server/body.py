"""Reading a JSON request body into a strict pydantic model, with a size bound."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from radixlm.server.errors import bad_request, from_validation_error
from radixlm.server.front import read_body

# Bigger than any prompt a context of a few hundred thousand tokens could hold as JSON.
MAX_BODY_BYTES = 32 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    body = await read_body(request, MAX_BODY_BYTES)
    if not body.strip():
        raise bad_request("Request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
