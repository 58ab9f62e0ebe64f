"""langchain-tests' standard suites (pinned in pyproject's dev extra) against ChatSGLang: the unit suite,
and the integration suite twice, on the embedded default model (SmolLM2-135M-Instruct) in-process and
through radixlm's server on a loopback port (the same engine behind both).

Greedy, with room for a forced tool call or a two-field JSON object (max_tokens=64) and JSON strings
bounded to 32 characters (max_string_length: a small model's greedy strings can loop), forced tool
choices limited to one call (parallel_tool_calls=False). The tests a 135M model cannot pass are run as
expected failures with the reason; docs/langchain.md lists them.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from radixlm.adapters.langchain import ChatSGLang
from server_harness import shared_server

# The integration suite mixes sync and async tests; pytest-asyncio runs the async ones (strict mode).
pytestmark = pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio'")

TOO_SMALL = "SmolLM2-135M-Instruct is too small to follow this prompt: "
XFAIL_REASONS = {
    "test_tool_calling": TOO_SMALL + "the call of magic_function is forced, but the model writes 1, 100 or 123 "
                         "as its argument instead of copying the 3 the question asks about",
    "test_tool_calling_async": TOO_SMALL + "as test_tool_calling (the argument must be 3)",
    "test_agent_loop": TOO_SMALL + "with tool_choice 'auto' it answers the weather question in prose instead "
                       "of calling get_weather",
    "test_json_mode": TOO_SMALL + "json_mode enforces a JSON object, but the keys 'setup' and 'punchline' must "
                      "come from following the instructions, and the model nests them",
}


def too_small(test: Any) -> Any:
    """Runs a standard test as an expected failure (langchain-tests accepts an override with an xfail reason)."""
    return pytest.mark.xfail(reason=XFAIL_REASONS[test.__name__], strict=False)(test)


def skipped(reason: str) -> Any:
    """Skips a standard test. langchain-tests accepts an overridden standard test only when it carries an
    xfail reason; the skip mark makes pytest skip it rather than run it (reported as skipped, with the reason)."""
    def mark(test: Any) -> Any:
        return pytest.mark.skip(reason=reason)(pytest.mark.xfail(reason=reason)(test))
    return mark


def live() -> Any:
    """The default model's engine, served on a free loopback port; shared by the langchain tests."""
    return shared_server(None)


class TestUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSGLang]:
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Nothing listens there: construction, binding and tracing metadata must not connect.
        return {"base_url": "http://127.0.0.1:9", "model": "SmolLM2-135M-Instruct"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return ({"RADIXLM_BASE_URL": "http://127.0.0.1:9", "RADIXLM_API_KEY": "sekret"}, {},
                {"base_url": "http://127.0.0.1:9", "api_key": "sekret"})

    @skipped("langchain-core 1.8's load(allowed_objects='all') revives only the classes on its built-in allowlist, "
             "which holds no third-party chat model; test_langchain_chat.py round-trips ChatSGLang through "
             "dumpd/load with an explicit allowlist instead")
    def test_serdes(self, model: Any, snapshot: Any) -> None:
        """Not run: see the skip reason."""


class _Integration(ChatModelIntegrationTests):
    """What both integration runs share; subclasses say where the model is."""

    @property
    def chat_model_class(self) -> type[ChatSGLang]:
        return ChatSGLang

    @property
    def target(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {**self.target, "temperature": 0, "max_tokens": 64, "max_string_length": 32,
                "parallel_tool_calls": False}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        # An engine serves one model: a per-call `model` must name it (another name is refused).
        return live().engine.served_model_name

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = self.chat_model_class(**{**self.chat_model_params, "max_tokens": 8})
        prompt = "Summarize the radix attention paper. " * 8
        llm.invoke(prompt)  # the second call finds the prompt in the radix cache
        if not stream:
            return llm.invoke(prompt)
        full = None
        for chunk in llm.stream(prompt):
            full = chunk if full is None else full + chunk
        return full

    @too_small
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @too_small
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @too_small
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @too_small
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)


@pytest.mark.asyncio
class TestInProcess(_Integration):
    @property
    def target(self) -> dict[str, Any]:
        return {"engine": live().engine}


@pytest.mark.asyncio
class TestThroughServer(_Integration):
    @property
    def target(self) -> dict[str, Any]:
        return {"base_url": live().url}
