"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5) over the paged KV pool.

One implementation serves all three: they differ only in config (GQA ratio, qkv bias, tied
embeddings, rope scaling). Q/K/V and gate/up projections are fused into single matmuls at load time
(core.runtime.models.registry maps the checkpoint's names onto them).
Kernels come from an `ops` namespace (kernels.cpu on CPU, Triton on CUDA), attention from an
attention backend that knows the batch layout.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from radixlm.kernels.reference import GEMV_MAX_ROWS
from radixlm.core.runtime.layers.forward_batch import ForwardBatch, ImageBatch
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.quantization.fp8 import Fp8Linear
from radixlm.core.runtime.quantization.ggml_product import GgmlDecoderLayer, GgmlLinear
from radixlm.core.runtime.quantization.int4 import Int4Linear

_FUSED_GEMV_OPS = ("gemv", "residual_gemv", "rms_scaled_gemv")


def _quant(projection: nn.Module) -> dict[str, torch.Tensor | None]:
    """A projection's quantization fields for the GEMVs, which stream its weight as stored: an fp8 one's
    per-row scales, a 4-bit one's per-group scales and zeros; none for a plain one."""
    return {"weight_scale": getattr(projection, "weight_scale", None),
            "weight_zero": getattr(projection, "weight_zero", None)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ModuleType) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), fb))

    def attend(self, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Attention of the projected [T, q + 2 kv] tokens; returns [T, q_size], o_proj's input."""
        # split_with_sizes: Tensor.split's Python wrapper costs more than the split at one token
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # The backend applies the rotary embedding: on CUDA in one launch with the KV store.
        return fb.attn_backend.forward(q, k, v, self.layer_id, fb).reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ops: ModuleType) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_gemv(self, h: torch.Tensor, normed: torch.Tensor | None, sums: torch.Tensor | None,
                     fb: ForwardBatch, next_norm: RMSNorm):
        """The same layer on a few rows with Triton GEMVs for its projections (faster than cuBLAS at one
        row on the H200), each RMSNorm split between the projection before it (the residual add, the
        weight, the sums of squares: `residual_gemv`) and the one after it (the scale: `rms_scaled_gemv`),
        so that it costs no launch of its own; SiLU-and-mul goes into the down projection. `h` is the
        residual stream, `normed` and `sums` its input norm's two halves (None at the first layer, whose
        norm runs apart); returns the same three for the next layer, whose input norm is `next_norm`."""
        ops, attn, mlp = self.ops, self.self_attn, self.mlp
        norm = self.input_layernorm
        if sums is None:
            normed = norm(h)
        w, b, wq = attn.qkv_proj.weight, attn.qkv_proj.bias, _quant(attn.qkv_proj)
        if fb.attn_backend.fuses_rotary_into_qkv:
            # The rotary and the KV store in the projection's epilogue: attention reads q only.
            q = ops.rotary_qkv_gemv(normed, sums, norm.eps, w, b, fb.rotary_positions, fb.cos_sin_cache,
                                    fb.kv_pool.k_buffers[attn.layer_id], fb.kv_pool.v_buffers[attn.layer_id],
                                    fb.out_cache_loc, attn.num_heads, attn.num_kv_heads, **wq)
            attended = fb.attn_backend.attend(q, attn.layer_id, fb).reshape(-1, attn.q_size)
        else:
            qkv = (ops.gemv(normed, w, b, **wq) if sums is None
                   else ops.rms_scaled_gemv(normed, sums, norm.eps, w, b, **wq))
            attended = attn.attend(qkv, fb)
        norm = self.post_attention_layernorm
        h, normed, sums = ops.residual_gemv(attended, attn.o_proj.weight, h, norm.weight, **_quant(attn.o_proj))
        gate_up = ops.rms_scaled_gemv(normed, sums, norm.eps, mlp.gate_up_proj.weight, **_quant(mlp.gate_up_proj))
        return ops.residual_gemv(gate_up, mlp.down_proj.weight, h, next_norm.weight, silu=True,
                                 **_quant(mlp.down_proj))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.config = cfg
        # Given an uninitialised weight: Embedding's own N(0, 1) init, run on the meta device where the
        # loader builds models, imports torch._dynamo (1.5-4 s of startup) and is overwritten anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Forwards of at most this many tokens take the fused GEMV path (enable_fused_gemv).
        self.fused_gemv_rows = 0
        # gguf_kernel="ggml" (enable_fused_gemv): each layer at one row as ggml graphs; empty: off.
        self.ggml_layers: list[GgmlDecoderLayer] = []
        # EAGLE-3 (core.runtime.models.eagle): each forward leaves the residual stream entering these layers
        # in aux_hidden, concatenated in this order, [tokens, len(aux_layers) * hidden].
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def enable_fused_gemv(self, max_rows: int) -> bool:
        """Forwards of at most `max_rows` tokens (decode) run each layer's projections as the kernel set's
        fused GEMVs (0: never). On the CPU with every projection on ggml (gguf_kernel="ggml"), forwards of
        one token instead run each layer as ggml graphs (GgmlDecoderLayer). False, changing nothing, where
        the set lacks GEMVs (the CPU set otherwise) or a projection is neither a plain nn.Linear nor an fp8
        or 4-bit one (tensor-parallel shards)."""
        if max_rows > GEMV_MAX_ROWS:
            raise ValueError(f"fused GEMV rows must be at most {GEMV_MAX_ROWS} (got {max_rows})")
        ops = self.layers[0].ops
        projections = [self.lm_head] + [p for layer in self.layers for p in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if max_rows and all(type(p) is GgmlLinear for p in projections[1:]):
            self.ggml_layers = [GgmlDecoderLayer(
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                (layer.input_layernorm.weight, layer.post_attention_layernorm.weight), layer.input_layernorm.eps,
                first=i == 0, next_layer=None if after is None else (after.self_attn.qkv_proj,
                                                                     after.input_layernorm.weight))
                for i, (layer, after) in enumerate(zip(self.layers, [*self.layers[1:], None]))]
            return True
        if not all(hasattr(ops, name) for name in _FUSED_GEMV_OPS) or any(
                type(p) not in (nn.Linear, Fp8Linear, Int4Linear) or getattr(p, "reduce", None) for p in projections):
            return False
        if any(layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None
               for layer in self.layers):
            return False  # residual_gemv has no bias
        self.fused_gemv_rows = max_rows
        return True

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token in the batch."""
        x = self.embed_input(fb)
        aux: list[torch.Tensor] = []
        if x.shape[0] <= self.fused_gemv_rows:
            normed = sums = None
            for i, (layer, after) in enumerate(zip(self.layers, [*self.layers[1:], None])):
                if i in self.aux_layers:
                    aux.append(x)  # the residual stream itself on this path
                x, normed, sums = layer.forward_gemv(x, normed, sums, fb,
                                                     self.norm if after is None else after.input_layernorm)
            self.aux_hidden = torch.cat(aux, dim=-1) if aux else None
            return self.norm(x)
        if x.shape[0] == 1 and self.ggml_layers:
            qkv = None  # each layer's graph makes the next one's
            for i, (layer, graphs) in enumerate(zip(self.layers, self.ggml_layers)):
                if i in self.aux_layers:
                    aux.append(x)  # the residual stream itself on this path
                x, qkv = graphs(x, qkv, lambda q, attn=layer.self_attn: attn.attend(q, fb))
            self.aux_hidden = torch.cat(aux, dim=-1) if aux else None
            return self.norm(x)
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x if residual is None else x + residual)
            x, residual = layer(x, residual, fb)
        self.aux_hidden = torch.cat(aux, dim=-1) if aux else None
        x, _ = self.norm(x, residual)
        return x

    def embed_input(self, fb: ForwardBatch) -> torch.Tensor:
        """The input embeddings of the batch's new tokens, with the step's image features (vision models'
        `image_features`: one row per image position, in `feature_index` order) at their positions."""
        images = fb.images
        if images is None:
            return self.embed_tokens(fb.input_ids)
        # Image positions carry ids derived from the image's hash (radix cache keys), not vocabulary ids.
        x = self.embed_tokens(fb.input_ids.index_fill(0, images.token_index, 0))
        x[images.token_index] = self.image_features(images)[images.feature_index].to(x.dtype)
        return x

    def image_features(self, images: ImageBatch) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} takes no images")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] <= self.fused_gemv_rows:
            return self.layers[0].ops.gemv(hidden, self.lm_head.weight, None, **_quant(self.lm_head)).float()
        return self.lm_head(hidden).float()

