"""radixlm.adapters.native: the SGLang frontend language. Everything here is re-exported at the top,
so `import radixlm as sgl` runs SGLang frontend programs unchanged."""

from radixlm.adapters.native.api import (
    SglFunction, assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int,
    gen_string, get_server_info, global_config, image, select, set_default_backend, system,
    system_begin, system_end, user, user_begin, user_end, video,
)
from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.backends.local_engine import EngineBackend
from radixlm.core.lang.backends.openai_backend import OpenAI, TokenUsage
from radixlm.core.lang.backends.runtime_endpoint import Runtime, RuntimeEndpoint
from radixlm.core.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.core.lang.choices import (
    ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.core.lang.errors import ProgramError, TracingError
from radixlm.core.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "SglFunction", "gen", "gen_int", "gen_string", "select", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "flush_cache", "get_server_info",
    "global_config", "RuntimeEndpoint", "Runtime", "OpenAI", "TokenUsage", "BaseBackend", "EngineBackend",
    "ChatTemplate", "get_chat_template", "ChoicesDecision", "ChoicesSamplingMethod",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "ProgramError", "TracingError", "ProgramState", "ProgramStateGroup",
]
