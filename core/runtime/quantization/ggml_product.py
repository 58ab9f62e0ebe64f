"""gguf_kernel="ggml": a GGUF model's kept products (every Q8_0, Q4_0 or Q4_1 projection and LM head)
multiplied on the CPU by ggml's own product, the one llama.cpp runs: the activations quantized to 8 bits a
block of 32, integer dot products with the file's blocks as stored, on a threadpool of ggml's kept for the
model. Against torch's int8 kernel (gguf_kept.py) it is faster at 1 and 16 rows (the default model's
49152 x 576 Q8_0 head ~2.5 against ~5.5 CPU ms a token); against torch's int4 kernel as fast at one row
and 2x slower from 4 (this AVX2 build), so gguf_kept gives 4-bit layers torch's for more rows
(`many_rows`). At batch 1 it gains from a second core, where torch's per-op parallel regions do not
(benchmarks/results/2026-12-07-quantization.md).

ggml comes from the optional package libggml-python (`pip install "radixlm[ggml]"`: prebuilt CPU
libraries, no dependencies), pinned exactly: its C structs, read here through ctypes, change between
ggml releases (ggml_cplan has gained fields), so any other version is refused at load.

Graphs: one per row count up to KEPT_ROWS (decode batches) kept with its plan and work buffer; larger
ones (prefills) are built per call. All of a model's products share one GgmlThreads: ggml's threadpool,
kept between graphs with its workers polling for the next one (a batch-1 step was ~120 small graphs: a
pool made per graph costs more than the second core saves, workers woken from sleep each graph ~14%
more a step than polling ones). At one row a Llama layer's norms, adds and SwiGLU join its products in
GgmlDecoderLayer's graphs, one per layer boundary (31 graphs and the head a step for the default model).
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


class _PoolParams(ctypes.Structure):  # ggml_threadpool_params
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


class _Plan(ctypes.Structure):  # ggml_cplan: a graph's work buffer and threads
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", _P), ("n_threads", ctypes.c_int),
                ("threadpool", _P), ("abort_callback", _P), ("abort_callback_data", _P), ("use_ref", ctypes.c_bool)]


_FUNCTIONS = [("ggml_init", _P, [_InitParams]), ("ggml_free", None, [_P]),
              ("ggml_new_tensor_2d", _P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
              ("ggml_get_data", _P, [_P]), ("ggml_mul_mat", _P, [_P, _P, _P]), ("ggml_new_graph", _P, [_P]),
              ("ggml_build_forward_expand", None, [_P, _P]), ("ggml_cpu_init", None, []),
              ("ggml_graph_plan", _Plan, [_P, ctypes.c_int, _P]),
              ("ggml_graph_compute", ctypes.c_int, [_P, ctypes.POINTER(_Plan)]),
              ("ggml_threadpool_params_default", _PoolParams, [ctypes.c_int]),
              ("ggml_threadpool_new", _P, [ctypes.POINTER(_PoolParams)]), ("ggml_threadpool_free", None, [_P]),
              ("ggml_threadpool_pause", None, [_P]),
              ("ggml_new_tensor_1d", _P, [_P, ctypes.c_int, ctypes.c_int64]),
              ("ggml_rms_norm", _P, [_P, _P, ctypes.c_float]), ("ggml_mul", _P, [_P, _P, _P]),
              ("ggml_add", _P, [_P, _P, _P]), ("ggml_swiglu", _P, [_P, _P])]


def library() -> SimpleNamespace:
    """ggml's functions from the pinned libggml-python; UnsupportedModelError naming the fix when it is
    missing or another version."""
    global _LIB
    if _LIB is not None:
        return _LIB
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise UnsupportedModelError(f"gguf_kernel='ggml' needs the {PACKAGE} package: pip install "
                                    f"'radixlm[ggml]' (or '{PACKAGE}=={VERSION}')") from None
    if version != VERSION:
        raise UnsupportedModelError(f"gguf_kernel='ggml' needs {PACKAGE}=={VERSION} (installed: {version}): "
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


class GgmlThreads:
    """The threadpool a model's ggml products run on: `threads` threads (the calling one and workers),
    made at the first product, so on the thread that runs the forwards. Between graphs the workers poll
    for the next one (ggml's poll level 50: ~0.17 s of spinning after the last graph, then they sleep);
    pause() puts them to sleep at once (the engine calls it when it goes idle), and the next graph wakes
    them."""

    def __init__(self, threads: int) -> None:
        self.lib = library()
        self.threads = threads
        self.pool: int | None = None

    def handle(self) -> int:
        if self.pool is None:
            params = self.lib.ggml_threadpool_params_default(self.threads)
            self.pool = self.lib.ggml_threadpool_new(ctypes.byref(params))
            if not self.pool:
                raise RuntimeError(f"ggml_threadpool_new failed ({self.threads} threads)")
        return self.pool

    def pause(self) -> None:
        if self.pool is not None:
            self.lib.ggml_threadpool_pause(self.pool)

    def __del__(self) -> None:  # its graphs' plans point at the pool: the layers hold this object
        if getattr(self, "pool", None) is not None:
            self.lib.ggml_threadpool_free(self.pool)


class _Graph:
    """A kept ggml graph in a context of its own (its inputs, intermediates and outputs), with its plan
    and work buffer made once (ggml_graph_compute_with_ctx would take a new work buffer from the context
    at every call). `inputs`: the f32 inputs' (rows, cols); build(ctx, *inputs) returns the outputs as
    (tensor, rows, cols); calling it with the inputs returns views of the outputs, valid until the next call."""

    def __init__(self, lib: SimpleNamespace, threads: GgmlThreads, mem_size: int, inputs: list[tuple[int, int]],
                 build) -> None:
        self.lib = lib
        self.ctx = lib.ggml_init(_InitParams(mem_size + (1 << 20), None, False))
        tensors = [lib.ggml_new_tensor_2d(self.ctx, _F32, cols, rows) for rows, cols in inputs]
        outputs = build(self.ctx, *tensors)
        self.graph = lib.ggml_new_graph(self.ctx)
        for out, _, _ in outputs:
            lib.ggml_build_forward_expand(self.graph, out)
        self.inputs = [_floats(lib.ggml_get_data(t), rows, cols) for t, (rows, cols) in zip(tensors, inputs)]
        self.outputs = [_floats(lib.ggml_get_data(out), rows, cols) for out, rows, cols in outputs]
        self.plan = lib.ggml_graph_plan(self.graph, threads.threads, threads.handle())
        self.plan.use_ref = False
        self.work = np.empty(max(self.plan.work_size, 1), np.uint8)  # kept alive beside the plan that points at it
        self.plan.work_data = self.work.ctypes.data
        self.plan_ref = ctypes.byref(self.plan)

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        for view, x in zip(self.inputs, xs):
            view.copy_(x.view(view.shape))
        if self.lib.ggml_graph_compute(self.graph, self.plan_ref) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        return self.outputs

    def free(self) -> None:
        self.lib.ggml_free(self.ctx)


def _floats(address: int, rows: int, cols: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * (rows * cols)).from_address(address), dtype=torch.float32).view(rows, cols)


class GgmlLinear(nn.Module):
    """x @ W.T (+ bias) for a weight of GGUF blocks (`qtype` Q8_0, Q4_0 or Q4_1; `blocks` the tensor's
    bytes as the file stores them, ggml's own layout, rows in the model's order), by ggml_mul_mat on
    `threads`; fp32 products, output in x's dtype. `many_rows`: a layer of the same weight that takes
    inputs of more rows (gguf_kept: torch's int4 kernel, 2x ggml's from 4 rows on an AVX-512 CPU)."""

    def __init__(self, qtype: str, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None,
                 threads: GgmlThreads, many_rows: nn.Module | None = None) -> None:
        super().__init__()
        self.lib = library()
        self.threads = threads
        self.many_rows = many_rows  # the same product for inputs of more than one row, where given
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ctx = self.lib.ggml_init(_InitParams(blocks.numel() + (1 << 16), None, False))
        self.weight = self.lib.ggml_new_tensor_2d(self.ctx, GGML_TYPES[qtype], self.in_features, self.out_features)
        ctypes.memmove(self.lib.ggml_get_data(self.weight), blocks.contiguous().data_ptr(), blocks.numel())
        self.graphs: dict[int, _Graph] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows > 1 and self.many_rows is not None:
            return self.many_rows(x)
        graph = self.graphs.get(rows)
        if graph is None:
            graph = _Graph(self.lib, self.threads, rows * (self.in_features + self.out_features) * 4,
                           [(rows, self.in_features)], lambda ctx, x: [(self.lib.ggml_mul_mat(ctx, self.weight, x),
                                                                       rows, self.out_features)])
            if rows <= KEPT_ROWS:
                self.graphs[rows] = graph
        out = graph(flat)[0].clone()
        if rows > KEPT_ROWS:
            graph.free()
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def __del__(self) -> None:  # ggml's memory is outside torch's: the weight's blocks and the kept graphs
        if not hasattr(self, "graphs"):  # __init__ did not finish
            return
        for graph in self.graphs.values():
            graph.free()
        self.lib.ggml_free(self.ctx)


class GgmlDecoderLayer:
    """A Llama decoder layer at one row (batch-1 decode) as ggml graphs on its projections' threads, so
    that its norms, adds and SwiGLU run inside ggml's graphs instead of as torch ops between ~4 small
    graphs (a 2-thread batch-1 step spent ~6.6 ms outside the products, on one core). Torch's attention
    (rotary, KV store) runs between two graphs: before it the input RMSNorm and the qkv projection; after
    it o_proj, the residual add, the post-attention RMSNorm, gate_up, SwiGLU, down, the second residual
    add and, given `next_layer` (the next layer's qkv projection and input norm weight), that layer's
    RMSNorm and qkv projection too: one graph per layer boundary, the first only in the first layer
    (`first`). The projections are the layer's GgmlLinears (their biases added inside the graphs);
    `norms` the two RMSNorm weights."""

    def __init__(self, qkv: GgmlLinear, o: GgmlLinear, gate_up: GgmlLinear, down: GgmlLinear,
                 norms: tuple[torch.Tensor, torch.Tensor], eps: float, first: bool,
                 next_layer: tuple[GgmlLinear, torch.Tensor] | None) -> None:
        lib = self.lib = library()
        self.projections = (qkv, o, gate_up, down) + (next_layer[:1] if next_layer else ())  # the graphs' weights
        hidden, threads = qkv.in_features, qkv.threads
        vectors = [*norms, *next_layer[1:]] if next_layer else [*norms]
        vectors += [p.bias for p in self.projections if p.bias is not None]
        self.ctx = lib.ggml_init(_InitParams(sum(4 * v.numel() + 512 for v in vectors) + (1 << 16), None, False))
        stored = {}  # id(torch vector) -> its f32 copy in ggml

        def vector(v: torch.Tensor) -> int:
            if id(v) not in stored:
                t = lib.ggml_new_tensor_1d(self.ctx, _F32, v.numel())
                _floats(lib.ggml_get_data(t), 1, v.numel()).copy_(v.detach().float().view(1, -1))
                stored[id(v)] = t
            return stored[id(v)]

        def product(ctx: int, linear: GgmlLinear, x: int) -> int:
            out = lib.ggml_mul_mat(ctx, linear.weight, x)
            return out if linear.bias is None else lib.ggml_add(ctx, out, vector(linear.bias))

        def norm(ctx: int, x: int, weight: torch.Tensor) -> int:
            return lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, eps), vector(weight))

        def qkv_of(ctx: int, x: int, projection: GgmlLinear, weight: torch.Tensor) -> tuple[int, int, int]:
            return product(ctx, projection, norm(ctx, x, weight)), 1, projection.out_features

        def second(ctx: int, attended: int, h: int) -> list:
            h = lib.ggml_add(ctx, product(ctx, o, attended), h)
            gate_up_out = product(ctx, gate_up, norm(ctx, h, norms[1]))
            h = lib.ggml_add(ctx, product(ctx, down, lib.ggml_swiglu(ctx, gate_up_out)), h)
            return [(h, 1, hidden)] + ([qkv_of(ctx, h, *next_layer)] if next_layer else [])

        self.first = _Graph(lib, threads, 4 * (3 * hidden + 2 * qkv.out_features), [(1, hidden)],
                            lambda ctx, x: [qkv_of(ctx, x, qkv, norms[0])]) if first else None
        floats = 4 * (o.in_features + 12 * hidden + 4 * gate_up.out_features + 2 * qkv.out_features)
        self.second = _Graph(lib, threads, floats, [(1, o.in_features), (1, hidden)], second)

    def __call__(self, h: torch.Tensor, qkv: torch.Tensor | None, attend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream [1, hidden] and this layer's qkv (None: the first layer's graph makes it),
        attend(qkv) -> [1, q_size]: the next layer's residual stream and qkv (None after the last layer;
        a view of the graph's output, valid until this layer runs again)."""
        if qkv is None:
            qkv = self.first(h)[0]
        out = self.second(attend(qkv.to(h.dtype)), h)
        return out[0].to(h.dtype, copy=True), out[1] if len(out) > 1 else None

    def __del__(self) -> None:
        for graph in (getattr(self, "first", None), getattr(self, "second", None)):
            if graph is not None:
                graph.free()
        if hasattr(self, "ctx"):
            self.lib.ggml_free(self.ctx)
