"""radixlm.kernels.triton: the Triton kernel set, name for name and signature for signature the same as
radixlm.kernels.reference (see radixlm.kernels.OP_NAMES). Importing it needs the `triton` package.
"""

from radixlm.kernels.reference import pack_token_mask
from radixlm.kernels.triton.attention import SHORT_EXTEND_TOKENS, decode_attention, extend_attention
from radixlm.kernels.triton.decode_gemv import gemv, residual_gemv, rms_scaled_gemv, rotary_qkv_gemv
from radixlm.kernels.triton.fp8_gemm import fp8_linear
from radixlm.kernels.triton.int4_gemm import int4_linear
from radixlm.kernels.triton.elementwise import (
    apply_rotary,
    apply_rotary_store_kv,
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
    store_kv,
)
from radixlm.kernels.triton.sampling import apply_token_bitmask, seeded_exponential
