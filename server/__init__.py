"""radixlm.server: OpenAI-compatible and SGLang-native HTTP endpoints over an Engine.

    radixlm serve --model-path /path/to/model --port 30000
    python -m radixlm.server --port 30000

or, in-process: `create_app(engine)` gives the starlette app, `serve(...)` runs it with uvicorn.
"""

from typing import Any

from radixlm.server.args import ServerArgs

__all__ = ["ServerArgs", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the command line reads ServerArgs without loading the app (and torch).
    if name == "create_app":
        from radixlm.server.app import create_app

        return create_app
    if name == "serve":
        from radixlm.server.launch import serve

        return serve
    raise AttributeError(f"module 'radixlm.server' has no attribute {name!r}")
