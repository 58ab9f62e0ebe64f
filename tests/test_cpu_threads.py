"""The CPU forward's intra-op thread count (ModelRunner, option cpu_one_thread_max_rows): forwards of at most
that many tokens run on one thread, larger ones on the
calling thread's count, which each forward leaves as it found it."""

from __future__ import annotations

import pytest
import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.options import EngineOptions


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def _threads_seen(ckpt: str, **options) -> list[tuple[int, int]]:
    """(tokens, torch's thread count inside the model) for a 6-token prefill, then two batch-1 decodes,
    then a 3-token prefill of a second request."""
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 256, **options})
    runner = ModelRunner(ckpt, ModelConfig.from_dir(ckpt), opts)
    seen = []
    forward = runner.model.forward

    def recording(fb):
        seen.append((fb.input_ids.numel(), torch.get_num_threads()))
        return forward(fb)

    runner.model.forward = recording
    runner.req_to_token.write(0, 0, list(range(1, 9)))
    runner.forward(BatchInput(False, [5, 6, 7, 8, 9, 10], list(range(6)), list(range(1, 7)), [0], [6], [6], [5]))
    for pos in (6, 7):
        runner.forward(BatchInput(True, [11], [pos], [pos + 1], [0], [pos + 1], [1], [0]))
    runner.req_to_token.write(1, 0, [20, 21, 22])
    runner.forward(BatchInput(False, [5, 6, 7], [0, 1, 2], [20, 21, 22], [1], [3], [3], [2]))
    assert torch.get_num_threads() == 2
    return seen


def test_batch_one_decode_runs_on_one_thread(llama_tied_ckpt, two_threads):
    assert _threads_seen(llama_tied_ckpt) == [(6, 2), (1, 1), (1, 1), (3, 2)]
    assert _threads_seen(llama_tied_ckpt, cpu_one_thread_max_rows=3) == [(6, 2), (1, 1), (1, 1), (3, 1)]
    assert _threads_seen(llama_tied_ckpt, cpu_one_thread_max_rows=0) == [(6, 2), (1, 2), (1, 2), (3, 2)]


def test_option_is_validated():
    with pytest.raises(Exception, match="cpu_one_thread_max_rows"):
        EngineOptions.from_kwargs({"cpu_one_thread_max_rows": -1})
