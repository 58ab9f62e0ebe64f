"""Shared fixtures: tiny HF-format checkpoints, built once per test session into a temporary dir.

llama_ckpt, sharded_ckpt and llama3_rope_ckpt use the same seed and shapes, so they hold identical
weights: sharded_ckpt differs only in how the files are split, llama3_rope_ckpt only in its rope.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from radixlm.testing.checkpoints import build_checkpoint, build_tokenizer

# Llama 3.1's rope scaling, with original_max_position_embeddings small enough (256) that the
# 16-dim heads of the tiny models have rotary frequencies in all three regimes: kept (wavelength
# < 64), interpolated (64..256) and scaled down by `factor` (> 256).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="session", autouse=True)
def _session_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the default-model cache out of ~, and torch's threads to the cores this process may use: 2 on
    the shared 2-core machine, split between pytest-xdist's workers (threads beyond the cores spin)."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, 2 // workers))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXLM_CACHE", str(tmp_path_factory.mktemp("radixlm-cache")))
        yield


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tokenizer_path(ckpt_root: str) -> str:
    """A directory holding only the tokenizer files."""
    path = os.path.join(ckpt_root, "tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_root: str) -> str:
    """Llama, untied embeddings, 4 heads / 2 KV heads."""
    return build_checkpoint(os.path.join(ckpt_root, "llama"), "llama")


@pytest.fixture(scope="session")
def llama_tied_ckpt(ckpt_root: str) -> str:
    """Llama with tied embeddings (no lm_head.weight in the files)."""
    return build_checkpoint(os.path.join(ckpt_root, "llama-tied"), "llama", tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def qwen2_ckpt(ckpt_root: str) -> str:
    """Qwen2: tied embeddings, biases on q/k/v projections."""
    return build_checkpoint(os.path.join(ckpt_root, "qwen2"), "qwen2", tie_word_embeddings=True, seed=2)


@pytest.fixture(scope="session")
def mistral_ckpt(ckpt_root: str) -> str:
    """Mistral with grouped-query attention: 8 heads of dim 8 sharing 2 KV heads."""
    return build_checkpoint(
        os.path.join(ckpt_root, "mistral"), "mistral", seed=3, num_attention_heads=8, num_key_value_heads=2
    )


@pytest.fixture(scope="session")
def llama3_rope_ckpt(ckpt_root: str) -> str:
    """Llama with Llama 3.1 rope scaling (see LLAMA3_ROPE_SCALING); same weights as llama_ckpt."""
    return build_checkpoint(os.path.join(ckpt_root, "llama3-rope"), "llama", rope_scaling=LLAMA3_ROPE_SCALING)


@pytest.fixture(scope="session")
def sharded_ckpt(ckpt_root: str) -> str:
    """llama_ckpt's weights split over several safetensors files plus model.safetensors.index.json."""
    return build_checkpoint(os.path.join(ckpt_root, "llama-sharded"), "llama", shard=True)
