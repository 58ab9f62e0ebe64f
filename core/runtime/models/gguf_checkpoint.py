"""GGUF checkpoints (llama.cpp's single-file format), loaded as they are: the model config from the
file's metadata and every weight dequantized by the `gguf` package and named as in an HF checkpoint (the
tokenizer, with its chat template, is transformers' build from the file: core.runtime.tokenizer.loader).

The header is parsed here with `struct`, not with `gguf.GGUFReader`: the reader makes a numpy view of
every vocabulary string, merge and token type (2.4 s for SmolLM2-135M's 147k entries on a 2-core
machine, half of the startup budget), while this parse steps over those arrays in about 30 ms. The
vocabulary itself is read once, by transformers, when it builds the tokenizer.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from math import prod
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models import gguf_dequant

# llama.cpp architecture -> the HF architecture our Llama-family model implements it as. llama.cpp's
# converter writes Mistral (and other Llama look-alikes) as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp tensor names -> HF names (the suffix, .weight or .bias, is kept).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Tensors that configure the model rather than hold its weights.
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling, as the divisor of each rotary frequency

# Values dequantized in one run at most (16 MiB of float32): few ops, bounded memory.
_RUN_VALUES = 1 << 22

_V = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
    _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores the fastest-moving dimension first)
    qtype: gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class GGUFCheckpoint:
    """One GGUF file: its scalar metadata (arrays such as the vocabulary are skipped), its tensors, and
    the model config and HF-named weights they describe."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                # Copy-on-write: numpy views of it are writable (torch wants that); the file is never touched.
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.metadata, self.tensors = _parse_header(self._buf)
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise UnsupportedModelError(f"{path} is not a readable GGUF file: {e}") from e
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} ({path}) is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        self.arch = arch
        for name in self.tensors:
            if name != _ROPE_FREQS:
                hf_tensor_name(name)  # fail now, before any loading, on a tensor the model has no place for

    def _key(self, name: str, default: Any = ...) -> Any:
        value = self.metadata.get(f"{self.arch}.{name}", default)
        if value is ...:
            raise UnsupportedModelError(f"{self.path} lacks the metadata key {self.arch}.{name}")
        return value

    def config_fields(self) -> dict[str, Any]:
        """The fields of the ModelConfig (core.runtime.models.config) that the file's metadata describes."""
        hidden = self._key("embedding_length")
        num_heads = self._key("attention.head_count")
        head_dim = self._key("attention.key_length", hidden // num_heads)
        rotary_dim = self._key("rope.dimension_count", head_dim)
        if rotary_dim != head_dim or self._key("attention.value_length", head_dim) != head_dim:
            raise UnsupportedModelError(
                f"{self.path}: rotary dim {rotary_dim} or value head dim differs from the head dim {head_dim}"
            )
        context_len = self._key("context_length")
        meta = self.metadata
        eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in meta]
        return dict(
            architecture=ARCHITECTURES[self.arch],
            vocab_size=self.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=self._key("feed_forward_length"),
            num_layers=self._key("block_count"),
            num_heads=num_heads,
            num_kv_heads=self._key("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=self._key("attention.layer_norm_rms_epsilon"),
            rope_theta=float(self._key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(head_dim),
            max_position_embeddings=context_len,
            # llama.cpp writes no output matrix when the model reuses its embedding
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            context_len=context_len,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
        )

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        if _ROPE_FREQS in self.tensors:
            factors = self._dequantize(self.tensors[_ROPE_FREQS]).flatten().tolist()
            if len(factors) != head_dim // 2:
                raise UnsupportedModelError(
                    f"{self.path}: {_ROPE_FREQS} holds {len(factors)} factors, not {head_dim // 2}"
                )
            return {"rope_type": "freq_factors", "factors": factors}
        kind = self._key("rope.scaling.type", "none")
        factor = self._key("rope.scaling.factor", None)
        if kind == "none" and self._key("rope.scale_linear", None) is not None:  # the older key
            kind, factor = "linear", self._key("rope.scale_linear")
        if kind == "none" or (kind == "linear" and factor == 1.0):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        raise UnsupportedModelError(
            f"{self.path}: rope scaling type {kind!r} is not supported (none, linear, or a rope_freqs tensor)"
        )

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF layout) of every tensor, dequantized as it is asked for, with a
        progress bar: the tensors of each type core.runtime.models.gguf_dequant handles in runs of up to
        _RUN_VALUES values (a few ops for many tensors), any other one alone by `gguf`. A tensor is
        valid until the next one is asked for: runs are dequantized into one buffer, reused, whose
        memory the first run has paged in (fresh memory for every run cost a third of the time)."""
        infos = [info for name, info in self.tensors.items() if name != _ROPE_FREQS]
        for qtype in {info.qtype for info in infos}:
            _check_dequantizable(qtype, self.path)
        buffer = torch.empty(_RUN_VALUES)
        with tqdm(total=len(infos), desc="Loading GGUF weights", unit="tensor") as bar:
            for run in _runs(infos):
                fits = sum(prod(info.shape) for info in run) <= _RUN_VALUES
                for info, w in zip(run, self._dequantize_run(run, buffer if fits else None)):
                    name = hf_tensor_name(info.name)
                    heads = self._permuted_heads(name)
                    yield name, w if heads is None else _unpermute_rows(w, heads)
                    bar.update(1)

    def integer_weight(self, name: str) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(HF name, integers, scales, mins) of a Q8_0/Q4_0/Q4_1 tensor as stored (gguf_dequant.
        integer_blocks), rows in HF order as `weights` gives them; ValueError for any other type."""
        info = self.tensors[name]
        fields = gguf_dequant.integer_blocks(self.blocks(name), info.qtype, info.shape)
        hf_name = hf_tensor_name(name)
        heads = self._permuted_heads(hf_name)
        if heads is not None:
            fields = tuple(None if f is None else _unpermute_rows(f, heads) for f in fields)
        return (hf_name, *fields)

    def row_blocks(self, name: str) -> torch.Tensor:
        """A 2-D tensor's bytes as stored, one row of blocks a weight row ([rows, bytes a row]), rows in HF
        order as `weights` gives them (the blocks of a row are the row's alone, so rows move whole)."""
        rows = self.tensors[name].shape[0]
        raw = self.blocks(name).view(rows, -1)
        heads = self._permuted_heads(hf_tensor_name(name))
        return raw if heads is None else _unpermute_rows(raw, heads)

    def _permuted_heads(self, hf_name: str) -> int | None:
        """The head count of a Llama Q or K projection, whose rows llama.cpp's converter reorders; else None."""
        if self.arch != "llama" or not (".q_proj." in hf_name or ".k_proj." in hf_name):
            return None
        heads = self._key("attention.head_count")
        return heads if ".q_proj." in hf_name else self._key("attention.head_count_kv", heads)

    def blocks(self, name: str) -> torch.Tensor:
        """A tensor's bytes as the file stores them (uint8, a view of the mapped file; rows in GGUF order)."""
        info = self.tensors[name]
        return torch.from_numpy(np.frombuffer(self._buf, np.uint8, count=info.nbytes, offset=info.offset))

    def _dequantize(self, info: TensorInfo) -> torch.Tensor:
        return self._dequantize_run([info])[0]

    def _dequantize_run(self, run: list[TensorInfo], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The run's tensors, in `out` where given and gguf_dequant handles their type."""
        raws = [np.frombuffer(self._buf, np.uint8, count=info.nbytes, offset=info.offset) for info in run]
        if gguf_dequant.dequantizes(run[0].qtype):
            return gguf_dequant.dequantize([torch.from_numpy(r) for r in raws], run[0].qtype,
                                           [info.shape for info in run], out)
        (raw,), (info,) = raws, run
        rows = prod(info.shape[:-1])
        return [torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), info.qtype)).reshape(info.shape)]


def _runs(infos: list[TensorInfo]) -> Iterator[list[TensorInfo]]:
    """The tensors of each type that gguf_dequant handles, in file order, in runs of up to _RUN_VALUES
    values (so that the float32 copy of a large model is never made at once); every other one alone."""
    by_type: dict[gguf.GGMLQuantizationType, list[TensorInfo]] = {}
    for info in infos:
        if not gguf_dequant.dequantizes(info.qtype):
            yield [info]
        else:
            by_type.setdefault(info.qtype, []).append(info)
    for same_type in by_type.values():
        run: list[TensorInfo] = []
        values = 0
        for info in same_type:
            if run and values + prod(info.shape) > _RUN_VALUES:
                yield run
                run, values = [], 0
            run.append(info)
            values += prod(info.shape)
        yield run


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp's converter gives Llama's Q and K projections: within each head it
    interleaves the two rotary halves (its rope rotates adjacent pairs; HF's rotates the halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in radixlm's Llama-family model")


def _check_dequantizable(qtype: gguf.GGMLQuantizationType, path: str) -> None:
    """gguf dequantizes a type if it can dequantize one block of it (it has no public list)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{path}: quantization type {qtype.name} cannot be dequantized by the installed gguf "
            f"package ({version('gguf')}); a newer gguf may support it"
        ) from None


def _parse_header(buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata with its scalar and string values, tensors by name) of a little-endian GGUF v2/v3."""
    magic, file_version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != gguf.GGUF_MAGIC:
        raise ValueError("no GGUF magic number")
    if file_version not in (2, 3):
        raise ValueError(f"GGUF version {file_version} (v2 and v3 are read)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        value, pos = _read_value(buf, pos + 4, vtype)
        if value is not ...:
            metadata[key] = value
    raw_tensors = []
    for _ in range(n_tensors):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        qtype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        raw_tensors.append((name, tuple(reversed(dims)), qtype, offset))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in raw_tensors:
        try:
            qtype = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise ValueError(f"tensor {name!r} has ggml type {qtype}, unknown to gguf {version('gguf')}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = prod(shape) // block_size * type_size
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated download?)")
        tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, nbytes)
    return metadata, tensors


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    """(value, position after it); arrays are stepped over and read as `...` (the config needs none)."""
    if vtype == _V.STRING:
        return _read_string(buf, pos)
    if vtype != _V.ARRAY:
        fmt = _SCALAR_FORMATS[_V(vtype)]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type == _V.STRING:
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
    elif item_type == _V.ARRAY:
        for _ in range(count):
            _, pos = _read_value(buf, pos, _V.ARRAY)
    else:
        pos += count * struct.calcsize(_SCALAR_FORMATS[_V(item_type)])
    return ..., pos

