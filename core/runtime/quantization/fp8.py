"""FP8 W8A8 linear layers: e4m3 weights with one fp32 scale per output feature, activations quantized to
e4m3 a token at a time (dynamic scales), products through the kernel set's `fp8_linear` (on CUDA one
cuBLASLt fp8 GEMM; on the CPU its pure-torch twin, so CPU tests run the same model code). Batch-1
decode streams the fp8 weight through the fused decode GEMVs instead (core.runtime.models.llama reads
`weight` and `weight_scale`), with activations left in bf16.

`quantize_linears` swaps a loaded model's projections for Fp8Linear: from their bf16 weights
(quantization="fp8") or from the fp8 values and scales an fp8 checkpoint gave them
(core.runtime.quantization.fp8_checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from radixlm.core.errors import UnsupportedModelError
from radixlm.kernels.quant_reference import FP8, quantize_fp8_rows

# The decoder layers' projections (our fused names); embeddings, the LM head and vision towers stay in the
# model dtype, as vLLM and SGLang keep them.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The parameter an fp8 checkpoint's per-row scales load into, on each projection, before quantize_linears.
SCALE = "weight_scale"


class Fp8Linear(nn.Module):
    """nn.Linear's forward on an e4m3 weight [N, K] with per-row scales [N] (fp32); `reduce` runs on the
    output (a row-parallel layer's all-reduce)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ops = ops
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.ops.fp8_linear(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.bias)
        out = out.reshape(*shape[:-1], self.out_features)
        return out if self.reduce is None else self.reduce(out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3, per-channel scales"


def check_fp8_device(device: torch.device) -> None:
    """UnsupportedModelError where the device cannot run fp8 GEMMs (CUDA below compute capability 8.9)."""
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < (8, 9):
            raise UnsupportedModelError(
                f"fp8 quantization needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {cc[0]}.{cc[1]}")


def quantize_weight(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 per-row scale) of a weight: with `scale`, the weight already holds e4m3 values
    (loaded from an fp8 checkpoint) and is only cast; else each row's largest magnitude maps to 448."""
    if scale is None:
        return quantize_fp8_rows(weight)
    return weight.to(FP8), scale.float()


@torch.no_grad()
def quantize_linears(model: nn.Module, ops: ModuleType, from_checkpoint: bool) -> int:
    """Swaps every projection (PROJECTIONS) for an Fp8Linear and returns how many; `from_checkpoint`:
    their weights hold e4m3 values with per-row scales in their SCALE parameter (NaN where the checkpoint
    left a layer unquantized, which then stays as it is)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in PROJECTIONS or not isinstance(child, nn.Linear):
                continue
            scale = getattr(child, SCALE, None) if from_checkpoint else None
            if scale is not None:
                missing = torch.isnan(scale)
                if bool(missing.all()):  # left in the model dtype: the GEMVs must not see a scale
                    delattr(child, SCALE)
                    continue
                if bool(missing.any()):
                    raise UnsupportedModelError(
                        f"{name}: the checkpoint quantized some of the matrices fused into it and not others")
            weight, weight_scale = quantize_weight(child.weight, scale)
            reduce = child.tp.all_reduce if hasattr(child, "tp") else None  # row-parallel layers
            setattr(parent, name, Fp8Linear(weight, weight_scale, child.bias, ops, reduce))
            swapped += 1
    return swapped


def add_scale_parameters(model: nn.Module) -> None:
    """Gives every projection a SCALE parameter [out_features] for an fp8 checkpoint's scales to load into;
    call on the meta device. Marked `quant_scale`: the loader makes it fp32, NaN until loaded, optional."""
    for module in model.modules():
        for name, child in module.named_children():
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                param = nn.Parameter(torch.empty(child.out_features), requires_grad=False)
                param.quant_scale = True
                setattr(child, SCALE, param)
