"""FP8 checkpoints' tensors, read from their public formats and handed to the loader in one form: each
quantized projection's e4m3 values as its `.weight` and one fp32 scale per row as its `.weight_scale`
(core.runtime.quantization.fp8.SCALE), so that the loader's name mapping, fused blocks and tensor
parallelism treat them as any weight.

- `quant_method: fp8` (transformers' FineGrainedFP8 and vLLM's fp8 serialisation): `weight` e4m3 with a
  per-tensor `weight_scale`, or with `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] block scales
  (`weight_block_size` [bn, bk]; real weight = value * scale of its block). Block scales become per-row
  scales: the block is dequantized in fp32 and requantized a row at a time (one more rounding to e4m3).
- `compressed-tensors` float8: `weight` e4m3 with `weight_scale` [N, 1] (channel) or [1] (tensor).
Static activation scales (`input_scale`) are checked and dropped: activations are quantized per token,
dynamically. Any other fp8 tensor (a quantized LM head) is dequantized to fp32 here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.quantization.config import QuantConfig
from radixlm.core.runtime.quantization.fp8 import SCALE
from radixlm.kernels.quant_reference import FP8, quantize_fp8_rows

_SIDE_TENSORS = (".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point", ".input_zero_point")
# The checkpoint's module names of the projections (fused into core.runtime.quantization.fp8.PROJECTIONS).
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_weights(names: list[str], get: Callable[[str], torch.Tensor], qc: QuantConfig,
                path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint whose tensors are `names`, read through `get`, in the form above."""
    present = set(names)
    for name in names:
        if name.endswith(_SIDE_TENSORS):
            _check_side_tensor(name, get, path)
            continue
        w = get(name)
        if w.dtype != FP8:
            if w.dtype.is_floating_point and w.element_size() == 1:
                raise UnsupportedModelError(f"{path}: tensor {name!r} is {w.dtype}; fp8 checkpoints hold e4m3fn")
            yield name, w
            continue
        base = name.removesuffix(".weight")
        values, scale = _values_and_row_scales(name, w, base, present, get, qc, path)
        if base.rpartition(".")[2] in _PROJECTIONS:
            yield name, values
            yield f"{base}.{SCALE}", scale
        else:
            yield name, values.float() * scale[:, None]


def _values_and_row_scales(name: str, w: torch.Tensor, base: str, present: set[str],
                           get: Callable[[str], torch.Tensor], qc: QuantConfig,
                           path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale per row) of the quantized weight `name`."""
    if w.dim() != 2:
        raise UnsupportedModelError(f"{path}: fp8 tensor {name!r} has shape {tuple(w.shape)}; 2-D weights only")
    rows, cols = w.shape
    if f"{base}.weight_scale_inv" in present:
        if qc.block_size is None:
            raise UnsupportedModelError(f"{path}: {base}.weight_scale_inv without weight_block_size in the config")
        bn, bk = qc.block_size
        blocks = get(f"{base}.weight_scale_inv").float()
        if blocks.shape != (-(-rows // bn), -(-cols // bk)):
            raise UnsupportedModelError(f"{path}: {base}.weight_scale_inv has shape {tuple(blocks.shape)}, not the "
                                        f"[{-(-rows // bn)}, {-(-cols // bk)}] blocks of {bn}x{bk} over {name}")
        full = blocks.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
        return quantize_fp8_rows(w.float() * full)
    if f"{base}.weight_scale" not in present:
        raise UnsupportedModelError(f"{path}: fp8 tensor {name!r} has no {base}.weight_scale or weight_scale_inv")
    scale = get(f"{base}.weight_scale").float().reshape(-1)
    if scale.numel() not in (1, rows):
        raise UnsupportedModelError(f"{path}: {base}.weight_scale holds {scale.numel()} values; per-tensor (1) "
                                    f"or per-row ({rows}) scales are supported")
    return w, scale.expand(rows).contiguous()


def _check_side_tensor(name: str, get: Callable[[str], torch.Tensor], path: str) -> None:
    """Zero points must be zero (symmetric formats); static input scales must be one number each."""
    if name.endswith("_zero_point") and bool(get(name).ne(0).any()):
        raise UnsupportedModelError(f"{path}: {name} is not zero; asymmetric fp8 is not supported")
    if name.endswith(".input_scale") and get(name).numel() != 1:
        raise UnsupportedModelError(f"{path}: {name} holds {get(name).numel()} values; one per tensor expected")
