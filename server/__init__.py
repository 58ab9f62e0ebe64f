"""radixlm.server: OpenAI-compatible and SGLang-native HTTP endpoints over an Engine.

    radixlm serve --model-path /path/to/model --port 30000
    python -m radixlm.server --port 30000

or, in-process: `create_app(engine)` gives the starlette app, `serve(...)` runs it with uvicorn.
"""

from radixlm.server.app import ServerArgs, create_app
from radixlm.server.launch import serve

__all__ = ["ServerArgs", "create_app", "serve"]
