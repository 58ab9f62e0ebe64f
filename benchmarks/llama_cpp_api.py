"""llama.cpp's C API for bench_cpu.py's llama.cpp column, from either of two Python bindings:

- llama-cpp-python (`import llama_cpp`: ctypes over a source build, benchmarks/build_llama_cpp.sh);
- llama-cpp-cffi's prebuilt CPU library (a wheel: no llama.cpp build; `pip install --no-deps --target DIR
  llama-cpp-cffi cffi pycparser`, then bench_cpu.py --llama-cpp-cffi DIR). Only its `_llama_cpp_cpu`
  extension is loaded, not its package (which imports transformers and picks CUDA when it sees a GPU).
  It was built with GCC 14: on an older libstdc++ its one missing symbol, `__cxa_call_terminate`, is
  given by a two-line library compiled here with the system's `cc` (it aborts, as the real one does).

Both give the same three things: the functions (`lib`), a step's logits as a numpy array, and the clearing
of every sequence's KV cache, whose name changed between llama.cpp versions.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass
class LlamaApi:
    lib: Any
    logits: Callable[[Any, int, int], np.ndarray]  # (ctx, batch index, vocabulary size)
    clear: Callable[[Any], None]  # forget every sequence's KV cache
    name: str  # the binding and its version
    system_info: str  # llama.cpp's report of the CPU features it was built with (AVX2, FMA, ...)
    keep: Any = None  # what must outlive the calls (cffi's log callback)


def python_binding() -> LlamaApi:
    import llama_cpp

    def clear(ctx: Any) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

    def logits(ctx: Any, i: int, vocab: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))

    return LlamaApi(llama_cpp, logits, clear, f"llama-cpp-python {llama_cpp.__version__}",
                    llama_cpp.llama_print_system_info().decode())


def cffi_binding(folder: str) -> LlamaApi:
    found = glob.glob(os.path.join(folder, "llama", "_llama_cpp_cpu.*.so"))
    if not found:
        raise FileNotFoundError(f"no llama/_llama_cpp_cpu.*.so under {folder} (pip install --no-deps --target "
                                f"{folder} llama-cpp-cffi cffi pycparser)")
    sys.path.append(folder)  # its cffi, when this environment has none
    try:
        module = _load_extension(found[0])
    except ImportError as e:
        if "__cxa_call_terminate" not in str(e):
            raise
        ctypes.CDLL(_terminate_shim(), mode=ctypes.RTLD_GLOBAL)
        module = _load_extension(found[0])
    lib, ffi = module.lib, module.ffi
    quiet = ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda *args: None)
    lib.llama_log_set(quiet, ffi.NULL)  # its default logger writes every load line to stderr

    def logits(ctx: Any, i: int, vocab: int) -> np.ndarray:
        return np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, i), 4 * vocab), dtype=np.float32)

    version = os.path.basename(glob.glob(os.path.join(folder, "llama_cpp_cffi-*.dist-info"))[0])
    return LlamaApi(lib, logits, lib.llama_kv_self_clear, version.removesuffix(".dist-info"),
                    ffi.string(lib.llama_print_system_info()).decode(), keep=quiet)


def _load_extension(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _terminate_shim() -> str:
    folder = tempfile.mkdtemp(prefix="llama-shim-")
    source, library = os.path.join(folder, "shim.c"), os.path.join(folder, "libshim.so")
    with open(source, "w") as f:
        f.write("#include <stdlib.h>\nvoid __cxa_call_terminate(void *e) { (void)e; abort(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", library, source], check=True)
    return library
