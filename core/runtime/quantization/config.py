"""Which quantization a model runs: the `quantization` option and the checkpoint's own
`quantization_config` (config.json), reconciled into one QuantConfig, or a clear error."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from radixlm.core.errors import UnsupportedModelError
from radixlm.kernels.quant_reference import INT4_BLOCK

# The `quantization` option's values (vLLM's and SGLang's names).
METHODS = ("fp8", "gguf", "awq", "gptq")
# Methods that only a checkpoint of their own format can give (no quantization at load).
CHECKPOINT_ONLY = ("awq", "gptq")


@dataclass(frozen=True)
class QuantConfig:
    """method: the linear layers' scheme ("fp8": e4m3 weights with one scale per output feature,
    activations quantized per token as they come; "gguf": a GGUF file's Q4_0/Q4_1/Q8_0 blocks kept). checkpoint_format: how the checkpoint stores them
    (None: in bf16/fp16/fp32, quantized at load; "fp8": `quant_method: fp8` (per-tensor `weight_scale`,
    or `weight_scale_inv` blocks with `weight_block_size`); "compressed-tensors": float8 weights with
    `weight_scale` per tensor or per channel; "awq", "gptq": 4-bit, core.runtime.quantization.int4_checkpoint).
    block_size: (rows, cols) of a scale block, if any."""

    method: str
    checkpoint_format: str | None = None
    block_size: tuple[int, int] | None = None
    group_size: int | None = None  # awq, gptq: input columns per scale and zero
    zero_offset: int = 0  # gptq's original format stores zero - 1


def quant_config(quantization: str | None, model_path: str, dummy: bool = False) -> QuantConfig | None:
    """The QuantConfig for a model: the checkpoint's quantization_config where it has one (the option
    must then be unset or name the same method), else the option's (a bf16 checkpoint quantized at
    load), else None. With `dummy` (random weights, benchmarks) awq and gptq quantize them.)"""
    if quantization is not None and quantization not in METHODS:
        raise UnsupportedModelError(f"quantization={quantization!r} is not supported; supported: {list(METHODS)}")
    stored = _checkpoint_config(model_path)
    if stored is None:
        if quantization in CHECKPOINT_ONLY and not dummy:
            raise UnsupportedModelError(f"quantization={quantization!r} needs a checkpoint quantized with it "
                                        f"({model_path} has no quantization_config)")
        return QuantConfig(quantization) if quantization else None
    found = _from_checkpoint(stored, model_path)
    if quantization is not None and quantization != found.method:
        raise UnsupportedModelError(f"{model_path} holds {found.method} weights ({found.checkpoint_format}); "
                                    f"quantization={quantization!r} cannot be applied to them")
    return found


def _checkpoint_config(model_path: str) -> dict[str, Any] | None:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or {}
    return cfg.get("quantization_config") or text.get("quantization_config")


def _from_checkpoint(q: dict[str, Any], path: str) -> QuantConfig:
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise UnsupportedModelError(f"{path}: fp8 activation_scheme {q.get('activation_scheme')!r}")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise UnsupportedModelError(f"{path}: fp8 weight_block_size {block!r} is not [rows, cols]")
        return QuantConfig("fp8", "fp8", tuple(block) if block else None)
    if method in ("awq", "gptq"):
        return _int4_config(method, q, path)
    if method == "compressed-tensors":
        _check_compressed_tensors(q, path)
        return QuantConfig("fp8", "compressed-tensors")
    raise UnsupportedModelError(f"{path}: quantization_config.quant_method {method!r} is not supported "
                                f"(supported: fp8, compressed-tensors float8, awq, gptq)")


def _int4_config(method: str, q: dict[str, Any], path: str) -> QuantConfig:
    """AWQ ("gemm" packing, zero points) and GPTQ (no act-order) checkpoints of 4-bit weights."""
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4 or not isinstance(group, int) or group <= 0 or group % INT4_BLOCK:
        raise UnsupportedModelError(f"{path}: {method} with bits={bits}, group_size={group}; 4-bit weights in groups "
                                    f"of a multiple of {INT4_BLOCK} columns (such as 128) are supported")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or not q.get("zero_point", True):
            raise UnsupportedModelError(f"{path}: AWQ version {version!r}, zero_point {q.get('zero_point')}; the "
                                        "GEMM packing with zero points is supported")
        return QuantConfig("awq", "awq", group_size=group)
    if q.get("desc_act"):
        raise UnsupportedModelError(f"{path}: GPTQ desc_act=true (act-order) is not supported: use a checkpoint "
                                    "quantized with desc_act=false")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"{path}: GPTQ checkpoint_format {fmt!r}; gptq and gptq_v2 are supported")
    return QuantConfig("gptq", "gptq", group_size=group, zero_offset=1 if fmt == "gptq" else 0)


def _check_compressed_tensors(q: dict[str, Any], path: str) -> None:
    """compressed-tensors checkpoints of 8-bit float weights, symmetric, per tensor or per channel."""
    groups = q.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError(f"{path}: compressed-tensors config has no config_groups")
    for name, group in groups.items():
        w = group.get("weights") or {}
        kind = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True))
        if kind[:2] != (8, "float") or kind[2] not in ("tensor", "channel") or not kind[3]:
            raise UnsupportedModelError(
                f"{path}: compressed-tensors group {name!r} has weights {kind[0]}-bit {kind[1]} "
                f"(strategy {kind[2]!r}, symmetric {kind[3]}); supported: 8-bit float, symmetric, per tensor "
                f"or per channel")
