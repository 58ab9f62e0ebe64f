"""gguf_lm_head_kernel="ggml": a GGUF model's kept LM head (Q8_0, Q4_0 or Q4_1) multiplied on the CPU by
ggml's own product, the one llama.cpp runs: the activations quantized to 8 bits a block of 32, integer
dot products with the file's blocks as stored. Torch's int8 product (gguf_kept.Int8GroupLinear) takes
bf16 activations and one call per block of columns: on the default model's 49152 x 576 Q8_0 head, ~2.5
against ~5.5 CPU ms a token (benchmarks/results/2026-12-07-quantization.md). The projections stay
torch's: ggml's 4-bit product is no faster there and its 8-bit activations move the logits more.

ggml comes from the optional package libggml-python (`pip install "radixlm[ggml]"`: prebuilt CPU
libraries, no dependencies), pinned exactly: its C structs, read here through ctypes, change between
ggml releases (ggml_cplan has gained fields), so any other version is refused at load.

Graphs: one per row count up to KEPT_ROWS (decode batches) kept with its plan and work buffer; larger
ones (prefills) are built per call. ggml computes on as many threads as torch has, with a threadpool
made per call (the head is one call a step, so kept workers would save little and would need one pool
per calling thread).
"""

from __future__ import annotations

import ctypes
import glob
import os
from importlib import metadata
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from radixlm.core.errors import UnsupportedModelError

PACKAGE, VERSION = "libggml-python", "0.20.2.post1"
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # enum ggml_type
_F32 = 0
KEPT_ROWS = 64
_LIB: SimpleNamespace | None = None
_P = ctypes.c_void_p


class _InitParams(ctypes.Structure):  # ggml_init_params
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class _Plan(ctypes.Structure):  # ggml_cplan: a graph's work buffer and threads
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", _P), ("n_threads", ctypes.c_int),
                ("threadpool", _P), ("abort_callback", _P), ("abort_callback_data", _P), ("use_ref", ctypes.c_bool)]


_FUNCTIONS = [("ggml_init", _P, [_InitParams]), ("ggml_free", None, [_P]),
              ("ggml_new_tensor_2d", _P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
              ("ggml_get_data", _P, [_P]), ("ggml_mul_mat", _P, [_P, _P, _P]), ("ggml_new_graph", _P, [_P]),
              ("ggml_build_forward_expand", None, [_P, _P]), ("ggml_cpu_init", None, []),
              ("ggml_graph_plan", _Plan, [_P, ctypes.c_int, _P]),
              ("ggml_graph_compute", ctypes.c_int, [_P, ctypes.POINTER(_Plan)])]


def library() -> SimpleNamespace:
    """ggml's functions from the pinned libggml-python; UnsupportedModelError naming the fix when it is
    missing or another version."""
    global _LIB
    if _LIB is not None:
        return _LIB
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise UnsupportedModelError(f"gguf_lm_head_kernel='ggml' needs the {PACKAGE} package: pip install "
                                    f"'radixlm[ggml]' (or '{PACKAGE}=={VERSION}')") from None
    if version != VERSION:
        raise UnsupportedModelError(f"gguf_lm_head_kernel='ggml' needs {PACKAGE}=={VERSION} (installed: {version}): "
                                    f"radixlm reads ggml's C structs, which change between releases; pip install "
                                    f"'{PACKAGE}=={VERSION}'")
    import libggml

    folder = os.path.dirname(libggml.__file__)
    paths = [next(iter(sorted(glob.glob(os.path.join(folder, "lib*", f"libggml-{part}.so")) +
                              glob.glob(os.path.join(folder, "lib*", f"libggml-{part}.dylib")))), None)
             for part in ("base", "cpu")]
    if None in paths:
        raise UnsupportedModelError(f"{PACKAGE} {version} at {folder} has no libggml-base / libggml-cpu library")
    libs = [ctypes.CDLL(path, mode=os.RTLD_GLOBAL) for path in paths]  # base first: cpu links to it
    lib = SimpleNamespace()
    for name, restype, argtypes in _FUNCTIONS:
        function = next(getattr(one, name) for one in libs if hasattr(one, name))
        function.restype, function.argtypes = restype, argtypes
        setattr(lib, name, function)
    lib.ggml_cpu_init()
    _LIB = lib
    return lib


class _Graph:
    """x [rows, k] -> x @ W.T [rows, n] as one ggml graph in a context of its own (input and output
    tensors), with a plan and work buffer per thread count, made once (ggml_graph_compute_with_ctx would
    take a new work buffer from the context at every call)."""

    def __init__(self, lib: SimpleNamespace, weight: int, k: int, n: int, rows: int) -> None:
        self.lib = lib
        self.ctx = lib.ggml_init(_InitParams(rows * (k + n) * 4 + (1 << 20), None, False))
        x = lib.ggml_new_tensor_2d(self.ctx, _F32, k, rows)
        out = lib.ggml_mul_mat(self.ctx, weight, x)
        self.graph = lib.ggml_new_graph(self.ctx)
        lib.ggml_build_forward_expand(self.graph, out)
        self.x = _floats(lib.ggml_get_data(x), rows, k)
        self.out = _floats(lib.ggml_get_data(out), rows, n)
        self.plans: dict[int, tuple[_Plan, np.ndarray]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        if threads not in self.plans:
            plan = self.lib.ggml_graph_plan(self.graph, threads, None)
            plan.use_ref = False
            work = np.empty(max(plan.work_size, 1), np.uint8)  # kept alive beside the plan that points at it
            plan.work_data = work.ctypes.data
            self.plans[threads] = (plan, work)
        self.x.copy_(x)
        if self.lib.ggml_graph_compute(self.graph, ctypes.byref(self.plans[threads][0])) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        return self.out.clone()

    def free(self) -> None:
        self.lib.ggml_free(self.ctx)


def _floats(address: int, rows: int, cols: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * (rows * cols)).from_address(address), dtype=torch.float32).view(rows, cols)


class GgmlLinear(nn.Module):
    """x @ W.T (+ bias) for a weight of GGUF blocks (`qtype` Q8_0, Q4_0 or Q4_1; `blocks` the tensor's
    bytes as the file stores them, ggml's own layout), by ggml_mul_mat; fp32 products, output in x's dtype."""

    def __init__(self, qtype: str, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = library()
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ctx = self.lib.ggml_init(_InitParams(blocks.numel() + (1 << 16), None, False))
        self.weight = self.lib.ggml_new_tensor_2d(self.ctx, GGML_TYPES[qtype], self.in_features, self.out_features)
        ctypes.memmove(self.lib.ggml_get_data(self.weight), blocks.contiguous().data_ptr(), blocks.numel())
        self.graphs: dict[int, _Graph] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        graph = self.graphs.get(rows) or _Graph(self.lib, self.weight, self.in_features, self.out_features, rows)
        out = graph(flat)
        if rows <= KEPT_ROWS:
            self.graphs[rows] = graph
        else:
            graph.free()
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def __del__(self) -> None:  # ggml's memory is outside torch's: the head's blocks and the kept graphs
        if not hasattr(self, "graphs"):  # __init__ did not finish
            return
        for graph in self.graphs.values():
            graph.free()
        self.lib.ggml_free(self.ctx)
