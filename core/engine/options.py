"""Engine options, named as SGLang's server arguments where those exist. Unknown options are errors."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.engine.schedule_policy import POLICIES
from radixlm.core.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineOptions:
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str | None = None  # None: cuda if available, else cpu
    schedule_policy: str = "lpm"
    # A waiting request passed over this many times by better-matching ones goes first.
    schedule_fairness_bound: int = 32
    chunked_prefill_size: int = 8192  # max new tokens per prefill step; -1 disables chunking
    max_running_requests: int | None = None
    max_total_tokens: int | None = None  # KV pool size in tokens; default from mem_fraction_static
    mem_fraction_static: float = 0.9
    disable_radix_cache: bool = False
    disable_jump_forward: bool = False
    # Constrained decoding (docs/constrained.md): "grammar" (ours), "regex-dfa" (the whole-pattern DFA),
    # or "llguidance" (the optional PyPI package); per-constraint budgets past which a request gets 400.
    grammar_backend: str = "grammar"
    grammar_max_compile_seconds: float = 2.0
    grammar_max_configs: int = 200_000
    random_seed: int = 0
    log_level: str = "warning"
    served_model_name: str | None = None
    max_queued_requests: int | None = None  # bounded waiting queue (the server answers 503 beyond it)
    debug_check_invariants: bool = False  # verify the KV slot invariant after every step (slow)
    disable_cuda_graph: bool = False  # CUDA only: run decode eagerly instead of replaying captured graphs
    cuda_graph_max_bs: int | None = None  # largest decode batch captured; default min(max_running_requests, 512)
    # Extends of at most this many tokens (and min(cuda_graph_max_bs, 256) requests) replay captured
    # graphs: the short extends the radix cache and jump-forward leave; 0 runs every extend eagerly.
    cuda_graph_max_extend_tokens: int = 512
    load_format: str = "auto"  # "auto": safetensors from model_path; "dummy": random weights (benchmarks)
    tp_size: int = 1  # tensor-parallel ranks, one process each (docs/scale_out.md)
    dp_size: int = 1  # data-parallel engine workers behind one cache-aware router (docs/scale_out.md)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown Engine option(s) {unknown}; known: {sorted(known)}", unknown[0])
        opts = cls(**kwargs)
        opts._resolve()
        return opts

    def _resolve(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(_DTYPES)} or 'auto' (got {self.dtype!r})", "dtype")
        if self.schedule_policy not in POLICIES:
            raise InvalidRequestError(f"schedule_policy must be one of {POLICIES} (got {self.schedule_policy!r})",
                                      "schedule_policy")
        if self.max_running_requests is None:
            self.max_running_requests = 512 if self.device.startswith("cuda") else 64
        for name in ("max_running_requests", "schedule_fairness_bound", "tp_size", "dp_size"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", name)
        if self.tp_size > 1 and self.dp_size > 1:
            raise InvalidRequestError("tp_size > 1 and dp_size > 1 together are not supported yet", "dp_size")
        if self.cuda_graph_max_bs is None:
            self.cuda_graph_max_bs = min(self.max_running_requests, 512)
        if self.cuda_graph_max_bs < 1:
            raise InvalidRequestError("cuda_graph_max_bs must be >= 1", "cuda_graph_max_bs")
        if self.cuda_graph_max_extend_tokens < 0:
            raise InvalidRequestError("cuda_graph_max_extend_tokens must be >= 0", "cuda_graph_max_extend_tokens")
        if self.grammar_backend not in ("grammar", "regex-dfa", "llguidance"):
            raise InvalidRequestError("grammar_backend must be 'grammar', 'regex-dfa' or 'llguidance' "
                                      f"(got {self.grammar_backend!r})", "grammar_backend")
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError(f"load_format must be 'auto' or 'dummy' (got {self.load_format!r})", "load_format")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise InvalidRequestError("max_total_tokens must be >= 16", "max_total_tokens")
        if self.chunked_prefill_size is None or self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1
        elif self.chunked_prefill_size < 1:
            raise InvalidRequestError("chunked_prefill_size must be positive or -1", "chunked_prefill_size")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise InvalidRequestError("mem_fraction_static must be in (0, 1)", "mem_fraction_static")
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise InvalidRequestError(f"unknown log_level {self.log_level!r}", "log_level")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
