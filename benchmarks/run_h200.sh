#!/usr/bin/env bash
# One H200 run of issue 3: the GPU check, the engine benchmarks (Llama-3-8B shape, HF as the peer),
# then the constrained-decoding benchmark. Logs and JSON go to $OUT (the device tool brings them back).
#
#   bash benchmarks/run_h200.sh                  # through the device tool, carrying .gpu_carry
#   OUT=/tmp/out bash benchmarks/run_h200.sh     # anywhere else with a GPU
#   GPU_CHECK_ARGS="--tune" RUN_CONSTRAINED=0 bash benchmarks/run_h200.sh   # the second run of 2026-11-29
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_WORKLOADS=1 \
#     CONSTRAINED_ARGS="--model llama3-8b-shape --batch 1 64 --max-new-tokens 128" bash benchmarks/run_h200.sh
#                                   # the fourth run: constrained e2e on the 8B shape + the paper workloads
#
# Each step has its own time limit (seconds, overridable) so that one hang cannot eat the others.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/radixlm-h200}
mkdir -p "$OUT"
# The repository root is the package radixlm: make it importable without installing.
mkdir -p /tmp/p && ln -sfn "$PWD" /tmp/p/radixlm
export PYTHONPATH=/tmp/p${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Pre-built tokenizer files the constrained benchmark would otherwise build from packages absent there.
if [ -d .gpu_carry ]; then export RADIXLM_CACHE=$PWD/.gpu_carry; fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  nproc
} 2>&1 | tee "$OUT/env.txt"

if [ "${RUN_GPU_CHECK:-1}" = 1 ]; then
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout "${GPU_CHECK_S:-210}" python3 benchmarks/gpu_check.py ${GPU_CHECK_ARGS:---sweep --tune} --out "$OUT/gpu_check.json" \
  2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi

if [ "${RUN_ENGINE_BENCH:-1}" = 1 ]; then
timeout "${BENCH_S:-300}" python3 benchmarks/bench_engine.py --model llama3-8b-shape --out "$OUT/bench_engine.json" \
  2>&1 | tee "$OUT/bench_engine.log"
echo "bench_engine exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi

if [ "${RUN_CONSTRAINED:-1}" = 1 ] && [ -f benchmarks/bench_constrained.py ]; then
  # shellcheck disable=SC2086  # CONSTRAINED_ARGS is a list of flags
  timeout "${CONSTRAINED_S:-75}" python3 benchmarks/bench_constrained.py --repeats 3 --e2e \
    ${CONSTRAINED_ARGS:---batch 1 16 --max-new-tokens 128} 2>&1 | tee "$OUT/bench_constrained.log"
  echo "bench_constrained exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_WORKLOADS:-0}" = 1 ]; then
  timeout "${WORKLOADS_S:-400}" python3 benchmarks/bench_workloads.py --model llama3-8b-shape \
    --time-limit-s "${WORKLOADS_LIMIT_S:-300}" --out "$OUT/workloads.json" --markdown "$OUT/workloads.md" \
    --plot-dir "$OUT" 2>&1 | tee "$OUT/workloads.log"
  echo "bench_workloads exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/env.txt"
