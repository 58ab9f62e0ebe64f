"""The in-process backend: programs run on a `radixlm.Engine` in the same Python process."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from radixlm.core.lang.backends.native import NativeGenerateBackend
from radixlm.core.lang.chat_template import chat_template_from_tokenizer


class EngineBackend(NativeGenerateBackend):
    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template_from_tokenizer(self.tokenizer) or self.chat_template
        images = engine.images
        self.supports_vision = images is not None
        if images is not None:  # sgl.image writes the checkpoint's own placeholder
            video = images.placeholder(self.tokenizer, video=True)
            self.supports_video = video is not None
            self.chat_template = dataclasses.replace(self.chat_template, image_token=images.placeholder(self.tokenizer),
                                                     video_token=video or self.chat_template.video_token)

    def _encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def _generate(self, request: dict[str, Any]) -> Any:
        return self.engine.generate(**_engine_arguments(request))

    def _generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return self.engine.generate(**_engine_arguments(request), stream=True)

    def get_model_name(self) -> str:
        return self.engine.served_model_name

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _engine_arguments(request: dict[str, Any]) -> dict[str, Any]:
    """Native request fields -> Engine.generate keywords (the Engine calls the text `prompt`)."""
    arguments = dict(request)
    if "text" in arguments:
        arguments["prompt"] = arguments.pop("text")
    return arguments
