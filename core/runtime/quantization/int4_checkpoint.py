"""AWQ and GPTQ checkpoints' tensors, read from their public formats and handed to the loader as each
projection's integers (`.weight`, [N, K], values 0..15) with per-group fp32 scales and zeros
(`.weight_scale`, `.weight_zero`, [N, K / group]), in the model's [out, in] orientation, so that fused
blocks and names map as for any weight (core.runtime.quantization.int4 packs them after loading).

- AWQ (AutoAWQ "gemm"): `qweight` int32 [K, N / 8], eight 4-bit values a word along N in the order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i, bits 4i, holds column 8c + order[i]); `qzeros` int32 [K / g, N / 8]
  packed the same way; `scales` fp16 [K / g, N]. Weight = (q - zero) * scale.
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K / 8, N], eight values a word along K (nibble j of
  row i is input k = 8i + j); `qzeros` int32 [K / g, N / 8], along N in order, storing zero - 1 in the
  original format (`checkpoint_format` "gptq"; "gptq_v2" stores the zero); `scales` fp16 [K / g, N];
  `g_idx` int32 [K], each input's group (k // g unless desc_act, which is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.quantization.config import QuantConfig
from radixlm.core.runtime.quantization.int4 import SCALE, ZERO

_SIDE = (".qzeros", ".scales", ".g_idx")
_AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # position p of a word's columns is nibble _AWQ_UNDO[p]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8]: nibble i (bits 4i) of every word, as uint8."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def int4_weights(names: list[str], get: Callable[[str], torch.Tensor], qc: QuantConfig,
                 path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        if name.endswith(_SIDE):
            continue
        if not name.endswith(".qweight"):
            yield name, get(name)
            continue
        base = name.removesuffix(".qweight")
        for side in (".qzeros", ".scales"):
            if f"{base}{side}" not in names:
                raise UnsupportedModelError(f"{path}: {name} has no {base}{side}")
        words, qzeros, scales = get(name), get(f"{base}.qzeros"), get(f"{base}.scales").float()
        if words.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise UnsupportedModelError(f"{path}: {name} and {base}.qzeros must be int32 (got {words.dtype}, "
                                        f"{qzeros.dtype})")
        groups, n = scales.shape
        if qc.method == "awq":
            q = _nibbles(words)[..., _AWQ_UNDO].reshape(words.shape[0], -1).t()
            zeros = _nibbles(qzeros)[..., _AWQ_UNDO].reshape(groups, -1)
        else:
            q = _nibbles(words).transpose(1, 2).reshape(-1, words.shape[1]).t()
            zeros = _nibbles(qzeros).reshape(groups, -1).float() + qc.zero_offset
            _check_g_idx(base, names, get, q.shape[1], groups, path)
        if q.shape[0] != n or zeros.shape[1] != n or q.shape[1] % groups:
            raise UnsupportedModelError(f"{path}: {base}: qweight {tuple(words.shape)}, qzeros {tuple(qzeros.shape)}"
                                        f" and scales {tuple(scales.shape)} do not describe one {qc.method} matrix")
        yield f"{base}.weight", q.contiguous()
        yield f"{base}.{SCALE}", scales.t().contiguous()
        yield f"{base}.{ZERO}", zeros.float().t().contiguous()


def _check_g_idx(base: str, names: list[str], get: Callable[[str], torch.Tensor], k: int, groups: int,
                 path: str) -> None:
    if f"{base}.g_idx" not in names:
        return
    expected = torch.arange(k) // (k // groups)
    if not torch.equal(get(f"{base}.g_idx").long(), expected):
        raise UnsupportedModelError(f"{path}: {base}.g_idx orders the inputs' groups (GPTQ desc_act); act-order "
                                    "checkpoints are not supported: use one quantized with desc_act=false")
