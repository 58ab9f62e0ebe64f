"""Study (not a runtime path): llama.cpp's own quantized products (ggml's `ggml_mul_mat` on Q4_0 / Q4_1 /
Q8_0 blocks: activations quantized to 8 bits a block of 32, integer dot products) called through ctypes on
llama-cpp-cffi's prebuilt CPU library (the one bench_cpu.py --llama-cpp-cffi runs), one prebuilt ggml
graph a layer, as an nn.Module. Used by cpu_int8_dynamic.py --mode ggml."""

from __future__ import annotations

import ctypes
import glob
import os
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

P = ctypes.c_void_p
GGML_F32, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 2, 3, 8
_LIB = None
_POOLS: dict[int, int] = {}


class _Params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _Plan(ctypes.Structure):  # ggml_cplan: the work buffer and threads of one graph's computation
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]  # use_ref: newer ggml only


class _PoolParams(ctypes.Structure):  # ggml_threadpool_params (GGML_MAX_N_THREADS 512)
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def ggml() -> SimpleNamespace:
    """The ggml functions, from GGML_LIB=DIR (libggml-python's wheel: DIR/libggml-base.so and
    DIR/libggml-cpu.so) or else llama-cpp-cffi's one library under LLAMA_CPP_CFFI (default /tmp/llamacffi).
    Loaded lazily (RTLD_LAZY): llama-cpp-cffi's names a GCC 14 runtime function (__cxa_call_terminate,
    called only where an exception leaves a noexcept function) that older libstdc++ lacks."""
    global _LIB
    if _LIB is None:
        if os.environ.get("GGML_LIB"):
            paths = [os.path.join(os.environ["GGML_LIB"], f"libggml-{part}.so") for part in ("base", "cpu")]
        else:
            paths = glob.glob(os.path.join(os.environ.get("LLAMA_CPP_CFFI", "/tmp/llamacffi"), "llama",
                                           "_llama_cpp_cpu.*.so"))[:1]
        libs = [ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_GLOBAL) for path in paths]
        lib = SimpleNamespace()
        for name, res, args in [("ggml_init", P, [_Params]), ("ggml_new_tensor_2d", P, [P, ctypes.c_int, ctypes.c_int64,
                                ctypes.c_int64]), ("ggml_mul_mat", P, [P, P, P]), ("ggml_new_graph", P, [P]),
                                ("ggml_build_forward_expand", None, [P, P]), ("ggml_get_data", P, [P]),
                                ("ggml_graph_plan", _Plan, [P, ctypes.c_int, P]),
                                ("ggml_graph_compute", ctypes.c_int, [P, ctypes.POINTER(_Plan)]),
                                ("ggml_threadpool_params_default", _PoolParams, [ctypes.c_int]),
                                ("ggml_threadpool_new", P, [ctypes.POINTER(_PoolParams)]), ("ggml_free", None, [P]),
                                ("ggml_cpu_init", None, [])]:
            function = next(getattr(one, name) for one in libs if hasattr(one, name))
            function.restype, function.argtypes = res, args
            setattr(lib, name, function)
        lib.ggml_cpu_init()
        _LIB = lib
    return _LIB


def blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[int, np.ndarray]:
    """(ggml type, raw blocks [rows, bytes]) of integer fields as gguf_dequant.integer_blocks gives them:
    Q8_0 (q int8), Q4_0 (m None) or Q4_1 (nibbles 0..15): d (fp16) [m (fp16)] then the 32 values, two a byte
    (value j low, j + 16 high)."""
    rows, cols = q.shape
    nb = cols // 32
    half = lambda t: t.to(torch.float16).view(torch.uint8).reshape(rows, nb, 2)  # noqa: E731
    if q.dtype == torch.int8:
        body, kind = q.view(torch.uint8).reshape(rows, nb, 32), GGML_Q8_0
        head = half(d)
    else:
        v = q.to(torch.uint8).reshape(rows, nb, 32)
        body = v[..., :16] | (v[..., 16:] << 4)
        head, kind = (half(d), GGML_Q4_0) if m is None else (torch.cat([half(d), half(m)], -1), GGML_Q4_1)
    return kind, torch.cat([head, body], -1).reshape(rows, -1).contiguous().numpy()


def pool(threads: int) -> int | None:
    """A threadpool kept for `threads` (GGML_POOL=persistent, the default; its workers sleep between
    graphs: poll 0), or None (GGML_POOL=per-call: ggml_graph_compute starts and joins its threads each call)."""
    if os.environ.get("GGML_POOL", "persistent") == "per-call":
        return None
    if threads not in _POOLS:
        params = ggml().ggml_threadpool_params_default(threads)
        assert params.n_threads == threads, "ggml_threadpool_params does not match this library's layout"
        params.poll = 0
        _POOLS[threads] = ggml().ggml_threadpool_new(ctypes.byref(params))
    return _POOLS[threads]


class _Graph:
    """x [rows, k] -> x @ W.T [rows, n] as one ggml graph, with its plan and work buffer made once (where
    ggml_graph_compute_with_ctx takes a new work buffer from the context at every call)."""

    def __init__(self, w: int, k: int, n: int, rows: int) -> None:
        lib = self.lib = ggml()
        self.ctx = lib.ggml_init(_Params(rows * (k + n) * 4 + (1 << 20), None, False))
        x = lib.ggml_new_tensor_2d(self.ctx, GGML_F32, k, rows)
        out = lib.ggml_mul_mat(self.ctx, w, x)
        self.graph = lib.ggml_new_graph(self.ctx)
        lib.ggml_build_forward_expand(self.graph, out)
        self.x = torch.frombuffer((ctypes.c_float * (rows * k)).from_address(lib.ggml_get_data(x)),
                                  dtype=torch.float32).view(rows, k)
        self.out = torch.frombuffer((ctypes.c_float * (rows * n)).from_address(lib.ggml_get_data(out)),
                                    dtype=torch.float32).view(rows, n)
        self.plans: dict[int, tuple[_Plan, np.ndarray]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        if threads not in self.plans:
            plan = self.lib.ggml_graph_plan(self.graph, threads, pool(threads))
            plan.use_ref = False  # a field older libraries neither have nor set
            work = np.empty(max(plan.work_size, 1), np.uint8)
            plan.work_data = work.ctypes.data
            self.plans[threads] = (plan, work)
        self.x.copy_(x)
        self.lib.ggml_graph_compute(self.graph, ctypes.byref(self.plans[threads][0]))
        return self.out.clone()

    def free(self) -> None:
        self.lib.ggml_free(self.ctx)


class GgmlLinear(nn.Module):
    """x @ W.T (+ bias) by ggml_mul_mat on the blocks; graphs of up to KEPT_ROWS rows (decode batches)
    kept, larger ones (prefills) built per call."""

    KEPT_ROWS = 64

    def __init__(self, kind: int, raw: np.ndarray, cols: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib, self.kind, self.bias = ggml(), kind, bias
        self.out_features, self.in_features = raw.shape[0], cols
        self.ctx = self.lib.ggml_init(_Params(raw.nbytes + (1 << 16), None, False))
        self.w = self.lib.ggml_new_tensor_2d(self.ctx, kind, cols, raw.shape[0])
        ctypes.memmove(self.lib.ggml_get_data(self.w), raw.ctypes.data, raw.nbytes)
        self.graphs: dict[int, _Graph] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        graph = self.graphs.get(rows) or _Graph(self.w, self.in_features, self.out_features, rows)
        out = graph(flat)
        if rows <= self.KEPT_ROWS:
            self.graphs[rows] = graph
        else:
            graph.free()
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
