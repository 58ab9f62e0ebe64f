"""The SGLang paper's workloads as radixlm programs, with synthetic data (fixed seeds, no downloads).

Each module reproduces the token-sharing structure of one or two workloads; `WORKLOADS` lists them in
the order of the paper's figures. `benchmarks/bench_workloads.py` runs them on radixlm (and its
ablations) and on HF transformers; see
benchmarks/results/2026-11-29-paper-workloads.md.
"""

from __future__ import annotations

from .agents import GENERATIVE_AGENTS, REACT
from .branching import LLM_JUDGE, SKELETON_OF_THOUGHT, TREE_OF_THOUGHT
from .chat import CHAT_LONG, CHAT_SHORT
from .common import Workload
from .control import CONTROL
from .dspy_rag import DSPY_RAG
from .few_shot import HELLASWAG, MMLU
from .json_decoding import JSON_DECODING
from .prefix_pressure import PREFIX_PRESSURE

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    MMLU, HELLASWAG, REACT, GENERATIVE_AGENTS, TREE_OF_THOUGHT, SKELETON_OF_THOUGHT, LLM_JUDGE,
    JSON_DECODING, CHAT_SHORT, CHAT_LONG, DSPY_RAG, CONTROL, PREFIX_PRESSURE)}

__all__ = ["WORKLOADS", "Workload"]
