"""What a backend answers for the interpreter: continue a state's text (gen), score choices
(select), and, where it has a prefix cache, pre-fill prefixes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol

from radixlm.core.lang.chat_template import ChatTemplate, get_chat_template

if TYPE_CHECKING:
    from radixlm.core.lang.choices import ChoicesDecision, ChoicesSamplingMethod
    from radixlm.core.lang.ir import GenParams


class StreamState(Protocol):
    """What a backend reads of a program state's stream (the interpreter's StreamExecutor, which sits
    above the backends and so is named here by what it offers, not imported)."""

    backend: "BaseBackend"
    text_: str
    messages_: list[dict[str, Any]]
    images_: list[tuple[str, Any]]  # (label, base64 data): an image's, or a list of a video's frames
    cur_role: str | None
    cur_role_begin_pos: int | None
    num_api_spec_tokens: int | None


class BaseBackend:
    # Chat models take a list of messages, not text (OpenAI chat API).
    is_chat_model = False
    # API backends, which cannot reuse KV across calls, save calls by speculative execution.
    supports_api_speculation = False
    supports_vision = False
    supports_video = False  # sgl.video: frames for a video model (Qwen2-VL) on the local or native backends

    def __init__(self) -> None:
        self.chat_template: ChatTemplate = get_chat_template("default")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        raise NotImplementedError

    def generate(self, s: "StreamState", params: "GenParams") -> tuple[str, dict[str, Any]]:
        """The continuation of s's text: (text, meta_info)."""
        raise NotImplementedError

    def generate_stream(self, s: "StreamState", params: "GenParams") -> Iterator[tuple[str, dict[str, Any]]]:
        """The continuation as (new text, meta_info) chunks."""
        raise NotImplementedError

    def select(self, s: "StreamState", choices: list[str], temperature: float,
               choices_method: "ChoicesSamplingMethod") -> "ChoicesDecision":
        raise NotImplementedError

    def commit_lazy_operations(self, s: "StreamState", extra_text: str = "") -> None:
        """Pre-fills s's text (+ extra_text) into the cache; used before forks. No-op without a cache."""

    def cache_prefix(self, prefix: str) -> None:
        """Pre-fills a prefix into the cache. No-op without a cache."""

    def end_program(self, s: "StreamState") -> None:
        """The state will append nothing more."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass
