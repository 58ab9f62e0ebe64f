#!/usr/bin/env bash
# Builds llama-cpp-python from source into its own venv, for bench_cpu.py's llama.cpp column only (never
# a dependency of radixlm, never CI's). Takes 40 to 90 minutes on the 2-core development VM at nice 19 with
# one compile job (so that others' work goes on). Usage:
#   bash benchmarks/build_llama_cpp.sh [VENV_DIR]        # default /tmp/llama-cpp-venv
#   python benchmarks/bench_cpu.py --llama-cpp-path VENV_DIR/lib/python3.X/site-packages
set -euo pipefail
VENV=${1:-/tmp/llama-cpp-venv}
python3 -m venv "$VENV"
WORK=$(mktemp -d)
"$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$WORK" llama-cpp-python==0.3.36
# The development VM's CPU advertises AMX it cannot run; the -mno-amx flags keep -march=native from using it.
export CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CMAKE_BUILD_PARALLEL_LEVEL=1
# Only the library the bindings load: no llava/mtmd, tests, examples, tools or server (140 objects, not 193).
export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
nice -n 19 "$VENV/bin/pip" wheel -q --no-deps -w "$WORK/wheels" "$WORK"/llama_cpp_python-*.tar.gz
# --no-deps: numpy, jinja2 and typing_extensions come from radixlm's environment (searched first).
"$VENV/bin/pip" install -q --no-deps "$WORK"/wheels/llama_cpp_python-*.whl diskcache
"$VENV/bin/python" -c "import sys; print(next(p for p in sys.path if p.endswith('site-packages')))"
