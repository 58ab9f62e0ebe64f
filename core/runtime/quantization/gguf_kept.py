"""GGUF weights kept quantized (quantization="gguf", vLLM's name): each projection and the LM
head whose GGUF type is Q4_0, Q4_1 or Q8_0 multiplies its stored integers, so a batch-1 step reads about
a quarter of the bytes of the dequantized fp32 model.

- Q4_0 / Q4_1: torch's packed int4 CPU product (`_weight_int4pack_mm_for_cpu`, groups of 32), whose
  weight is (q - 8) * scale + zero: scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0): the file's values.
- Q8_0: torch's int8 product with one scale per row (`_weight_int8pack_mm`), once per group of 32
  columns (each with its own per-row scales d), summed in fp32.
Both kernels are fast only on bf16 activations (their fp32 and fp16 paths are 10x slower): activations,
scales and zeros go to bf16 for the product (2^-9 relative rounding, against Q4's own ~2^-4), the output
back to the model dtype. Tensors of other types (Q4_K, Q6_K, F16, ...) stay dequantized, as before.
On CUDA, Q4_0 / Q4_1 run as AWQ layers (int4_layer: the 4-bit Triton GEMM and GEMV); Q8_0 stays dequantized.
gguf_kernel="ggml" (CPU, opt-in): every kept product runs ggml's own product instead, on the file's blocks
(ggml_product.py).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.gguf_checkpoint import GGUFCheckpoint, hf_tensor_name
from radixlm.core.runtime.models.registry import ModelSpec
from radixlm.core.runtime.quantization.fp8 import PROJECTIONS
from radixlm.core.runtime.quantization.int4 import Int4Linear
from radixlm.kernels.quant_reference import pack_int4

logger = logging.getLogger("radixlm")
GROUP = 32  # GGUF's block of Q8_0, Q4_0 and Q4_1
_KEPT = ("Q4_0", "Q4_1", "Q8_0")


class Int4GroupLinear(nn.Module):
    """x @ W.T for W = (q - 8) * scale + zero, q in 0..15, one scale and zero per row and 32 columns."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.weight = nn.Parameter(torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1),
                                   requires_grad=False)
        self.scale_zero = nn.Parameter(torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous(),
                                       requires_grad=False)  # [K / 32, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the model's [tokens, features] as it is
        out = torch._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.weight, GROUP, self.scale_zero)
        out = out.to(x.dtype) if self.bias is None else out.to(x.dtype) + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


class Int8GroupLinear(nn.Module):
    """x @ W.T for W = q * scale, q int8, one scale per row and 32 columns: one int8 product per group."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        groups = self.in_features // GROUP
        self.weight = nn.Parameter(q.view(self.out_features, groups, GROUP).transpose(0, 1).contiguous(),
                                   requires_grad=False)  # [K / 32, N, 32]
        self.scale = nn.Parameter(scale.t().to(torch.bfloat16).contiguous(), requires_grad=False)  # [K / 32, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.zeros(flat.shape[0], self.out_features, dtype=torch.float32)
        for g in range(self.weight.shape[0]):
            out += torch._weight_int8pack_mm(flat[:, g * GROUP:(g + 1) * GROUP].contiguous(), self.weight[g],
                                             self.scale[g]).float()
        out = out.to(x.dtype)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def int4_layer(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None,
               ops: ModuleType) -> Int4Linear:
    """A Q4_0 / Q4_1 weight (d * q + m, or d * (q - 8)) as the AWQ/GPTQ layer the GPU runs, (q - zero) *
    scale in groups of 32: scale = d, zero = 8 (Q4_0) or -m / d (Q4_1). A Q4_1 block whose d is 0 holds
    m alone: there q = 0, scale = 1, zero = -m."""
    scale = d.float()
    if m is None:
        zero = torch.full_like(scale, 8.0)
    else:
        flat = scale == 0
        zero = torch.where(flat, -m.float(), -m.float() / torch.where(flat, 1.0, scale))
        scale = torch.where(flat, 1.0, scale)
        q = q.masked_fill(flat.repeat_interleave(GROUP, 1), 0)
    return Int4Linear(pack_int4(q), scale, zero, bias, ops)


def keep_gguf_quantized(model: nn.Module, gguf_path: str, spec: ModelSpec, tied: bool, ops: ModuleType,
                        kernel: str = "torch", threads: int = 1) -> int:
    """Swaps every projection (and the LM head) whose GGUF tensors are all of one kept type for its
    quantized layer, built from the file's blocks; returns how many. The model holds the dequantized
    weights (loaded as usual): those of the swapped layers are dropped. On CUDA only Q4_0 / Q4_1 are
    kept (through the 4-bit kernels of AWQ/GPTQ); Q8_0 layers there stay dequantized. kernel "ggml"
    (CPU): every swapped layer runs ggml's product on the file's blocks, all on one ggml threadpool of
    `threads` threads (ggml_product.py)."""
    cuda = next(model.parameters()).is_cuda
    pool = None
    if kernel == "ggml":
        from radixlm.core.runtime.quantization.ggml_product import GgmlLinear, GgmlThreads  # the optional libggml

        pool = GgmlThreads(threads)
    ckpt = GGUFCheckpoint(gguf_path)
    parts: dict[str, dict[int, str]] = {}  # our module -> {block: GGUF tensor}
    for name, info in ckpt.tensors.items():
        if info.qtype.name not in _KEPT or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        if name == "token_embd.weight":
            if not tied:
                continue
            module, block = "lm_head", None
        else:
            mapped = spec.parameter_for(hf_tensor_name(name))
            if mapped is None:
                continue
            module, block = mapped[0].removesuffix(".weight"), mapped[1]
        if module.rpartition(".")[2] in (*PROJECTIONS, "lm_head"):
            parts.setdefault(module, {})[0 if block is None else block] = name
    swapped = 0
    for module, blocks in parts.items():
        dense = model.get_submodule(module)
        expected = len(spec.fused_blocks(f"{module}.weight") or (None,))
        names = [blocks[i] for i in sorted(blocks)]
        if len(names) != expected or len({ckpt.tensors[n].qtype for n in names}) != 1:
            logger.info("%s stays dequantized (its GGUF tensors are of mixed types)", module)
            continue
        qtype = ckpt.tensors[names[0]].qtype.name
        if cuda and qtype == "Q8_0":
            logger.info("%s stays dequantized (Q8_0 is kept quantized on the CPU only)", module)
            continue
        bias = getattr(dense, "bias", None)
        # ggml's 4-bit product (the wheel's AVX2 build) is 2x slower than torch's from 4 rows: there a ggml
        # layer hands inputs of more rows to torch's. Its 8-bit one beats torch's per-group loop at any count.
        layer = None if pool is not None and qtype == "Q8_0" else _torch_layer(
            [ckpt.integer_weight(n)[1:] for n in names], bias, cuda, ops)
        if pool is not None:
            rows = torch.cat([ckpt.row_blocks(n) for n in names])  # a fused module's blocks, one after another
            layer = GgmlLinear(qtype, rows, (rows.shape[0], ckpt.tensors[names[0]].shape[1]), bias, pool, layer)
        owner, _, attr = module.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, layer)
        swapped += 1
    return swapped


def _torch_layer(fields: list[tuple], bias: torch.Tensor | None, cuda: bool, ops: ModuleType) -> nn.Module:
    """The layer of one module's (fused) GGUF tensors from their integer fields (integer_weight)."""
    q, d = torch.cat([f[0] for f in fields]), torch.cat([f[1] for f in fields])
    m = None if fields[0][2] is None else torch.cat([f[2] for f in fields])  # Q4_1's mins
    if cuda:
        return int4_layer(q, d, m, bias, ops)
    if q.dtype == torch.int8:
        return Int8GroupLinear(q, d, bias)
    return Int4GroupLinear(q, d, torch.zeros_like(d) if m is None else m + 8 * d, bias)


def check_gguf_device(device: torch.device, gguf_path: str | None, tensor_parallel: bool) -> None:
    if gguf_path is None:
        raise UnsupportedModelError("quantization='gguf' keeps a GGUF file's weights quantized; this model is "
                                    "not a GGUF file")
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedModelError(f"quantization='gguf' (GGUF weights kept quantized) runs on the CPU and CUDA; "
                                    f"on {device} leave quantization unset: the weights are dequantized at load")
    if tensor_parallel:
        raise UnsupportedModelError("quantization='gguf' runs without tensor parallelism; leave quantization "
                                    "unset to shard the dequantized weights")
