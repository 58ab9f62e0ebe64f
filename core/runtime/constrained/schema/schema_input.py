"""What a caller may give as a JSON schema (a dict, a bool, JSON text, a pydantic model class) read into
the schema itself."""

from __future__ import annotations

import json
from typing import Any


def load_schema(schema: Any) -> Any:
    """The schema (a dict or a bool); ValueError when `schema` is none of the accepted forms."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        return schema.model_json_schema()
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    return schema
