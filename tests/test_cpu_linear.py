"""Linear layers on prepacked weights (kernels.cpu.prepacked_linear, core.runtime.models.cpu_linear) against
their twin, F.linear on the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.cpu_linear import PrepackedLinear, prepack_linears
from radixlm.core.runtime.models.parallel import RowParallelLinear
from radixlm.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.prepack_linear_weight(torch.ones(2, 2)) is None,
                                reason="this torch build has no oneDNN linear")

# SmolLM2-135M's layers (out, in): fused q|k|v, o, fused gate|up, down, and the 49,152-token LM head.
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
BF16_SUPPORTED = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("shape", SMOLLM2_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_prepacked_linear_equals_f_linear_on_smollm2_shapes(shape):
    torch.manual_seed(0)
    out_f, in_f = shape
    weight = torch.randn(out_f, in_f) * 0.05
    bias = torch.randn(out_f) if out_f == 960 else None  # Qwen2's q/k/v carry a bias
    packed = cpu.prepack_linear_weight(weight)
    assert packed.shape == weight.shape and packed.dtype == weight.dtype
    for rows in (1, 5, 16, 67):  # a decode step of 1 and 16 requests, odd counts, a prefill
        x = torch.randn(rows, in_f)
        torch.testing.assert_close(cpu.prepacked_linear(x, packed, bias), F.linear(x, weight, bias),
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not BF16_SUPPORTED, reason="no bf16 oneDNN linear on this CPU")
def test_prepacked_linear_bf16_equals_f_linear():
    torch.manual_seed(0)
    weight = (torch.randn(3072, 576) * 0.05).bfloat16()
    x = torch.randn(16, 576).bfloat16()
    out = cpu.prepacked_linear(x, cpu.prepack_linear_weight(weight), None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-2, rtol=1.6e-2)


def test_prepack_is_skipped_where_unsupported(monkeypatch):
    """fp16 needs AVX512-FP16 in oneDNN: without it, as without oneDNN at all, layers keep F.linear."""
    layer = nn.Linear(8, 4)
    model = nn.Sequential(layer)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert cpu.prepack_linear_weight(layer.weight) is None
    assert prepack_linears(model) == 0 and model[0] is layer
    monkeypatch.undo()
    half = nn.Sequential(nn.Linear(8, 4).half())
    if cpu.prepack_linear_weight(half[0].weight) is None:
        assert prepack_linears(half) == 0 and type(half[0]) is nn.Linear


def test_prepack_linears_swaps_plain_linears_only():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "proj": nn.Linear(16, 24),
        "head": nn.Linear(24, 10, bias=False),
        "row": RowParallelLinear(0, 16, 8, tp=None),  # its own forward (an all-reduce): left alone
    })
    x = torch.randn(3, 16)
    expected = model["head"](model["proj"](x))
    assert prepack_linears(model) == 2
    assert isinstance(model["proj"], PrepackedLinear) and isinstance(model["head"], PrepackedLinear)
    assert type(model["row"]) is RowParallelLinear
    torch.testing.assert_close(model["head"](model["proj"](x)), expected)


def _runner(ckpt: str, **options) -> ModelRunner:
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 256, **options})
    return ModelRunner(ckpt, ModelConfig.from_dir(ckpt), opts)


def test_runner_prepacks_every_projection_and_keeps_the_tied_embedding(llama_tied_ckpt):
    plain = _runner(llama_tied_ckpt, disable_cpu_prepack=True).model
    packed = _runner(llama_tied_ckpt).model
    layers = [m for m in packed.modules() if isinstance(m, (nn.Linear, PrepackedLinear))]
    assert layers and all(isinstance(m, PrepackedLinear) for m in layers)
    assert len(layers) == 4 * len(packed.layers) + 1  # qkv, o, gate_up, down per layer; the LM head
    # The embedding keeps its plain weight (the LM head's packed copy is a separate tensor).
    torch.testing.assert_close(packed.embed_tokens.weight, plain.embed_tokens.weight, atol=0, rtol=0)
    hidden = torch.randn(7, packed.config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), atol=2e-5, rtol=1e-5)


def test_one_row_products_run_on_the_kept_plain_weight():
    """Batch-1 decode (1 row) goes to F.linear on the plain weight, which is kept; more rows to the packed
    copy; plain_max_rows=0 keeps no plain weight."""
    torch.manual_seed(0)
    layer = nn.Linear(576, 3072)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = nn.Sequential(layer)
    assert prepack_linears(model, plain_max_rows=1) == 1
    packed = model[0]
    assert packed.plain is not None and packed.plain.data_ptr() == layer.weight.data_ptr()  # kept, not copied
    x = torch.randn(1, 576)
    assert torch.equal(packed(x), F.linear(x, weight, bias))
    xs = torch.randn(4, 576)
    assert torch.equal(packed(xs), cpu.prepacked_linear(xs, packed.weight, packed.bias))
    torch.testing.assert_close(packed(xs), F.linear(xs, weight, bias), atol=2e-5, rtol=1e-5)
    dropped = nn.Sequential(nn.Linear(576, 3072))
    prepack_linears(dropped, plain_max_rows=0)
    assert dropped[0].plain is None
    assert torch.equal(dropped[0](x), cpu.prepacked_linear(x, dropped[0].weight, dropped[0].bias))


def test_engine_option_sets_the_plain_rows(llama_tied_ckpt):
    kept = _runner(llama_tied_ckpt).model
    dropped = _runner(llama_tied_ckpt, cpu_plain_linear_max_rows=0).model
    assert all(m.plain is not None for m in kept.modules() if isinstance(m, PrepackedLinear))
    assert all(m.plain is None for m in dropped.modules() if isinstance(m, PrepackedLinear))
    with pytest.raises(Exception, match="cpu_plain_linear_max_rows"):
        EngineOptions.from_kwargs({"cpu_plain_linear_max_rows": -1})
