"""The JSON schema of the end-to-end constrained-decoding benchmarks (bench_constrained.py --e2e,
profile_steps.py): bounded strings, so that every output ends by itself within the token limit."""

E2E_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "staff"]}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "zip", "tags", "role", "active"],
}
