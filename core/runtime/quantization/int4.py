"""4-bit weight-only linear layers (AWQ and GPTQ checkpoints): the weight is (q - zero) * scale with q in
0..15 packed eight an int32 word ([N, K / 8], quant_reference.pack_int4's layout) and one fp32 scale and
zero per row and group of columns;
products through the kernel set's `int4_linear` (on CUDA a Triton GEMM that dequantizes in registers; on
the CPU its pure-torch twin). Checkpoints load through core.runtime.quantization.int4_checkpoint into the
projections' own weights (the integers, exact in any float dtype) and two side parameters, then
`quantize_int4_linears` packs them."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.quantization.fp8 import PROJECTIONS
from radixlm.kernels.quant_reference import pack_int4, quantize_int4_rows

SCALE, ZERO = "weight_scale", "weight_zero"


class Int4Linear(nn.Module):
    """nn.Linear's forward on a packed 4-bit weight with per-group scales and zeros."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 ops: ModuleType) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 8
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.weight_scale = nn.Parameter(scales, requires_grad=False)
        self.weight_zero = nn.Parameter(zeros, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ops.int4_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale,
                                   self.weight_zero, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"group {self.in_features // self.weight_scale.shape[1]}")


def add_int4_parameters(model: nn.Module, group: int) -> None:
    """Gives every projection SCALE and ZERO parameters [out_features, in_features / group] for a 4-bit
    checkpoint's to load into (meta device; marked `quant_scale`: fp32, NaN until loaded, optional)."""
    for module in model.modules():
        for name, child in module.named_children():
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                if child.in_features % group:
                    raise UnsupportedModelError(f"{name}: {child.in_features} input features are not a multiple "
                                                f"of the checkpoint's group size {group}")
                for attr in (SCALE, ZERO):
                    param = nn.Parameter(torch.empty(child.out_features, child.in_features // group),
                                         requires_grad=False)
                    param.quant_scale = True
                    setattr(child, attr, param)


@torch.no_grad()
def quantize_random_int4(model: nn.Module, ops: ModuleType, group: int = 128) -> int:
    """load_format "dummy" with awq/gptq (benchmarks): every projection's random weight quantized to 4 bits
    in groups of `group` (min-max, with zeros), as a checkpoint of that shape would hold it."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                setattr(parent, name, Int4Linear(*quantize_int4_rows(child.weight, group), child.bias, ops))
                swapped += 1
    return swapped


@torch.no_grad()
def quantize_int4_linears(model: nn.Module, ops: ModuleType) -> int:
    """Swaps every projection that loaded 4-bit fields for an Int4Linear (those the checkpoint left
    unquantized, all NaN, stay as they are); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in PROJECTIONS or not isinstance(child, nn.Linear) or not hasattr(child, SCALE):
                continue
            scales, zeros = getattr(child, SCALE), getattr(child, ZERO)
            missing = torch.isnan(scales)
            if bool(missing.all()):
                delattr(child, SCALE), delattr(child, ZERO)
                continue
            if bool(missing.any()):
                raise UnsupportedModelError(
                    f"{name}: the checkpoint quantized some of the matrices fused into it and not others")
            packed = pack_int4(child.weight.to(torch.uint8))
            setattr(parent, name, Int4Linear(packed, scales.detach().clone(), zeros.detach().clone(), child.bias, ops))
            swapped += 1
    return swapped
