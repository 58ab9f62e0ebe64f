"""Loads a local checkpoint's model: an HF-format directory (config, safetensors weights single or
sharded) or a GGUF file (core.runtime.models.gguf_checkpoint). Both yield (HF name, tensor) pairs to one loop."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.hub import find_gguf
from radixlm.core.runtime.models.registry import model_spec
from radixlm.core.runtime.quantization.config import QuantConfig, quant_config
from radixlm.core.runtime.quantization.fp8 import add_scale_parameters, check_fp8_device, quantize_linears
from radixlm.core.runtime.quantization.int4 import add_int4_parameters, quantize_int4_linears, quantize_random_int4

if TYPE_CHECKING:
    from radixlm.core.runtime.models.parallel import TensorParallel


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors weights in {path} (only safetensors checkpoints load)")
    return files


def checkpoint_weights(path: str, qc: QuantConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight of the checkpoint at path, with a progress bar: the tensors
    of its safetensors shards, or a GGUF file's tensors dequantized (float32) and renamed; those of a
    quantized checkpoint (qc.checkpoint_format) in the form core.runtime.quantization.fp8_checkpoint gives."""
    gguf_path = find_gguf(path)
    if gguf_path is not None:
        from radixlm.core.runtime.models.gguf_checkpoint import GGUFCheckpoint  # `gguf` only where a GGUF is loaded

        yield from GGUFCheckpoint(gguf_path).weights()
        return
    from safetensors import safe_open  # not for a GGUF file

    files = _weight_files(path)
    if qc is not None and qc.checkpoint_format is not None:
        yield from _quantized_weights(files, qc, path)
        return
    with tqdm(total=len(files), desc="Loading weights", unit="shard") as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            bar.update(1)


def _quantized_weights(files: list[str], qc: QuantConfig, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a quantized safetensors checkpoint, each read where fp8_checkpoint asks for it
    (a weight's scales may lie in another shard)."""
    from safetensors import safe_open

    from radixlm.core.runtime.quantization.fp8_checkpoint import fp8_weights
    from radixlm.core.runtime.quantization.int4_checkpoint import int4_weights

    read = fp8_weights if qc.method == "fp8" else int4_weights
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(file, framework="pt", device="cpu")) for file in files]
        where = {name: f for f in handles for name in f.keys()}
        yield from tqdm(read(list(where), lambda name: where[name].get_tensor(name), qc, path),
                        desc=f"Loading {qc.method} weights", unit="tensor")


def load_model(
    path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, ops: ModuleType,
    load_format: str = "auto", tp: "TensorParallel | None" = None, quantization: str | None = None,
    gguf_kernel: str = "torch", gguf_threads: int = 1,
) -> nn.Module:
    """Builds the model of cfg's architecture (core.runtime.models.registry) on the meta device, then fills each
    parameter straight from the checkpoint's weights, converted to `dtype` as they are copied
    (load_format "auto"), or with random values made on the device ("dummy": no files read).
    With `tp` (cfg is then tp.local_config()), the model holds this rank's share of every layer.
    A quantized checkpoint, or `quantization` ("fp8"), makes the projections quantized layers
    (core.runtime.quantization) once the weights are in; gguf_kernel, gguf_threads: quantization "gguf"'s
    product kernel and, for "ggml", its thread count (gguf_kept.keep_gguf_quantized)."""
    spec = model_spec(cfg.architecture)
    qc = quant_config(quantization, path, dummy=load_format == "dummy")
    if qc is not None and qc.method == "fp8":
        check_fp8_device(device)
    if qc is not None and qc.method == "gguf":
        from radixlm.core.runtime.quantization.gguf_kept import check_gguf_device  # `gguf` only for GGUF files
        check_gguf_device(device, find_gguf(path), tp is not None)
    from_checkpoint = qc is not None and qc.checkpoint_format is not None and load_format != "dummy"
    if qc is not None and qc.method in ("awq", "gptq") and tp is not None:
        raise UnsupportedModelError(f"{qc.method} checkpoints run without tensor parallelism")
    with torch.device("meta"):
        model = spec.model_class(cfg, ops)
        if tp is not None:
            tp.shard_model(model, spec)
        if from_checkpoint and qc.method == "fp8":
            add_scale_parameters(model)
        elif from_checkpoint:
            add_int4_parameters(model, qc.group_size)
    optional = {name for name, p in model.named_parameters() if getattr(p, "quant_scale", False)}
    _materialize(model, dtype, device)
    tied = spec.tied if cfg.tie_word_embeddings else {}
    for name, source in tied.items():
        _set_parameter(model, name, model.get_parameter(source))
    if load_format == "dummy":
        _init_dummy(model)
        return _quantized(model, qc, ops, from_checkpoint, path, gguf_kernel, gguf_threads).eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, w in checkpoint_weights(path, qc):
        mapped = spec.parameter_for(hf_name)
        if mapped is None:
            continue
        name, shard = mapped
        if name not in params:
            if name in tied:
                continue
            raise UnsupportedModelError(f"unexpected weight {hf_name!r} in {path}")
        if tp is not None:
            tp.load_weight(model, name, shard, w)
        else:
            _copy_into(params[name], w, None if shard is None else spec.block_rows(name, shard, cfg))
        loaded.add(name if shard is None else f"{name}#{shard}")
    expected = set()
    for name in params:
        if name in tied or name in optional:
            continue
        blocks = spec.fused_blocks(name)
        expected.update([name] if blocks is None else (f"{name}#{i}" for i in range(len(blocks))))
    missing = sorted(expected - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint {path} lacks weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return _quantized(model, qc, ops, from_checkpoint, path, gguf_kernel, gguf_threads).eval()


def _quantized(model: nn.Module, qc: QuantConfig | None, ops: ModuleType, from_checkpoint: bool,
               path: str, gguf_kernel: str = "torch", gguf_threads: int = 1) -> nn.Module:
    """The model with its projections quantized as qc says (unchanged without qc); the memory of the
    weights they replace goes back to the device."""
    if qc is None:
        return model
    if qc.method == "gguf":
        from radixlm.core.runtime.quantization.gguf_kept import keep_gguf_quantized  # `gguf` only for GGUF files
        cfg = model.config
        keep_gguf_quantized(model, find_gguf(path), model_spec(cfg.architecture), cfg.tie_word_embeddings, ops,
                            gguf_kernel, gguf_threads)
        return model
    if qc.method in ("awq", "gptq"):
        quantize_int4_linears(model, ops) if from_checkpoint else quantize_random_int4(model, ops)
    else:
        quantize_linears(model, ops, from_checkpoint)
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()
    return model


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, param)


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Gives every meta parameter uninitialised storage on `device`, in `dtype` (so the device holds the
    weights once, in their final dtype). Module.to_empty would do it through torch's Python reference
    of empty_like, whose first call imports sympy: a second of start-up."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "quant_scale", False):  # core.runtime.quantization.fp8.add_scale_parameters
                empty = torch.full(param.shape, float("nan"), device=device)
            else:
                empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))


def _init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights in the scale of a trained model: N(0, 0.02) matrices, unit norms, zero biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:  # RMS and layer norms
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)


def _copy_into(param: torch.Tensor, w: torch.Tensor, rows: slice | None) -> None:
    """Copies checkpoint tensor w into param, or into its `rows` when w is one block of a fused param."""
    with torch.no_grad():
        (param if rows is None else param[rows]).copy_(w)
