"""Which kernel set a device gets. Triton kernels live in kernels.triton, each with a pure-torch reference
twin in kernels.reference.

`get_ops(device)` returns the kernel set for a device; every set has the same function names and
signatures (OP_NAMES), so the engine never asks which one it holds. CUDA devices get the Triton set
when the `triton` package is installed, unless RADIXLM_DISABLE_TRITON=1; everything else gets
kernels.cpu (pure torch, batched attention; the references' other ops). The references themselves are
the oracle both sets are tested against.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

from radixlm.kernels import cpu

OP_NAMES = (
    "apply_rotary",
    "apply_token_bitmask",
    "decode_attention",
    "extend_attention",
    "fused_add_rms_norm",
    "pack_token_mask",
    "rms_norm",
    "seeded_exponential",
    "silu_and_mul",
    "store_kv",
)
# Fusions a set may add (same signature as the reference's); where a set lacks one, its callers compose
# the unfused ops it stands for (core.runtime.layers.attention_backend, core.runtime.models.llama). The GEMV ops take at
# most GEMV_MAX_ROWS rows (decode).
OPTIONAL_OP_NAMES = ("apply_rotary_store_kv", "gemv", "residual_gemv", "rms_scaled_gemv", "rotary_qkv_gemv")
# Quantized-weight products (core.runtime.quantization); every set has them, their twins are in
# kernels.quant_reference.
QUANT_OP_NAMES = ("fp8_linear", "int4_linear")


def triton_enabled(device: torch.device | str) -> bool:
    """Whether get_ops(device) hands out the Triton kernels."""
    device = torch.device(device)
    return (
        device.type == "cuda"
        and os.environ.get("RADIXLM_DISABLE_TRITON", "0") != "1"
        and torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
    )


def get_ops(device: torch.device | str) -> ModuleType:
    if triton_enabled(device):
        # Imported only here: the kernels are decorated at import, and CPU-only runs never need them.
        from radixlm.kernels import triton as triton_ops

        return triton_ops
    return cpu
