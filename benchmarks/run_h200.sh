#!/usr/bin/env bash
# One H200 run of issue 3: the GPU check, the engine benchmarks (Llama-3-8B shape, HF as the peer),
# then the constrained-decoding benchmark. Logs and JSON go to $OUT (the device tool brings them back).
#
#   bash benchmarks/run_h200.sh                  # through the device tool, carrying .gpu_carry
#   OUT=/tmp/out bash benchmarks/run_h200.sh     # anywhere else with a GPU
#   GPU_CHECK_ARGS="--tune" RUN_CONSTRAINED=0 bash benchmarks/run_h200.sh   # the second run of 2026-11-29
#   GPU_CHECK_ARGS="" ...                        # the checks alone, without timing launch shapes
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_WORKLOADS=1 \
#     CONSTRAINED_ARGS="--model llama3-8b-shape --batch 1 64 --max-new-tokens 128" bash benchmarks/run_h200.sh
#                                   # the fourth run: constrained e2e on the 8B shape + the paper workloads
#   the grammar engine beside llguidance in one process (issue 17; needs `pip install llguidance` there):
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 CONSTRAINED_S=500 CONSTRAINED_ARGS="--model llama3-8b-shape \
#     --batch 1 64 --max-new-tokens 128 --grammar-backends radixlm llguidance" bash benchmarks/run_h200.sh
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_WORKLOADS=1 bash benchmarks/run_h200.sh
#                                   # the paper workloads alone, under 8 minutes (carry .whl for dspy_rag)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_SCHEDULER=1 RUN_WORKLOADS=1 \
#     WORKLOADS_ARGS="--workloads hellaswag llm_judge mmlu generative_agents skeleton_of_thought prefix_pressure \
#     --systems radixlm fcfs dfs_weight --repeats 3" bash benchmarks/run_h200.sh
#                                   # issue 22: the policies on the paper workloads and the order-sensitive
#                                   # one (~5 minutes), after the scheduler's host time per step at 256+ waiting
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_HICACHE=1 bash benchmarks/run_h200.sh
#                                   # the host tier of the radix cache, off vs on (bench_hicache.py)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_FUSION_ABLATION=1 bash benchmarks/run_h200.sh
#                                   # batch-1 decode with the fused rotary + KV store and without (issue 19)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_OVERLAP=1 bash benchmarks/run_h200.sh
#                                   # batch-1 decode and the 1,000-request workload, overlap off then on (issue 19)
#   GPU_CHECK_ARGS="--skip-kernels --checks overlap" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_THROUGHPUT_VARIANTS=1 bash benchmarks/run_h200.sh
#                                   # overlap's equality check, then engine variants side by side (issue 19)
#   GPU_CHECK_ARGS="--skip-kernels --checks fp8_kv" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_FP8_KV=1 \
#     bash benchmarks/run_h200.sh
#                                   # the fp8 KV cache: gpu_check's fp8 step, then the 1,000-request workload
#                                   # and decode steps with kv_cache_dtype auto vs fp8_e4m3 (issue 19)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_GEMV=1 bash benchmarks/run_h200.sh
#                                   # the decode GEMVs against cuBLAS, then batch-1 decode with them off/on (issue 19)
#   GPU_CHECK_ARGS="--skip-kernels --checks fused_gemv" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 bash benchmarks/run_h200.sh
#                                   # their engine check: fused vs not, greedy tokens (issue 19)
#   GPU_CHECK_S=200 GPU_CHECK_ARGS="--skip-kernels --checks overlap" RUN_ENGINE_BENCH=0 CONSTRAINED_S=360 \
#     CONSTRAINED_ARGS="--model llama3-8b-shape --batch 1 64 --max-new-tokens 128 --overlap all" bash benchmarks/run_h200.sh
#                                   # overlap's check (chained extend steps counted), then JSON jump-forward with
#                                   # overlap off, on without chaining across extend steps, and on (issue 19)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 BASE_TAR=.gpu_carry/base.tar ROUNDS=2 \
#     WORKLOADS_ARGS="--workloads mmlu skeleton_of_thought --repeats 1" bash benchmarks/run_h200.sh
#                                   # the paper workloads on this tree and an older commit's, alternated (issue 19)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_IMAGES=1 bash benchmarks/run_h200.sh
#                                   # image QA on the LLaVA-1.5-7B shape, shared vs distinct images (issue 21)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_QWEN2VL=1 bash benchmarks/run_h200.sh
#                                   # image QA on the Qwen2-VL-2B shape (M-RoPE), shared vs distinct images (issue 21)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_QUANT=1 bash benchmarks/run_h200.sh
#                                   # bf16 beside fp8 and AWQ 4-bit on the 8B shape (issue 35, ~8 minutes)
#   GPU_CHECK_S=200 GPU_CHECK_ARGS="--skip-kernels --checks fp8_weights" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_QUANT=1 QUANT_S=380 QUANT_ARGS="--sweep-gemv --engine --parts latency prefill --variants awq" \
#     bash benchmarks/run_h200.sh       # the 4-bit kernels against their twin (GEMV 1-4 rows, GEMM, prefill;
#                                   # groups of 128 and 32) and the fused 4-bit decode against the unfused in the
#                                   # engine, then the fp8 and 4-bit GEMV sweeps (8B shapes; SmolLM2's at groups
#                                   # of 32), then batch-1 decode and 16 x 1024 prefill, bf16 beside AWQ (~9 minutes)
#   GPU_CHECK_S=150 GPU_CHECK_ARGS="--skip-kernels --checks fp8_weights" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_QUANT=1 QUANT_S=420 QUANT_ARGS="--sweep-gemv --engine --parts latency --variants fp8 awq" \
#     bash benchmarks/run_h200.sh       # issue 35, the one-row 4-bit GEMV in its weight tile's layout: the 4-bit
#                                   # kernels against their twin, then the GEMV sweep (every candidate's time
#                                   # printed; SiLU inside against silu_and_mul first) and batch-1 decode, bf16
#                                   # beside fp8 and AWQ (~8 minutes)
#   GPU_CHECK_S=150 GPU_CHECK_ARGS="--skip-kernels --checks fp8_weights" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_QUANT=1 QUANT_S=330 QUANT_ARGS="--sweep-gemv --engine --int4-paths --parts latency --variants awq" \
#     bash benchmarks/run_h200.sh       # issue 35, the packed (fp16x2) one-row 4-bit GEMV: it and the 4-bit
#                                   # kernels against their twin (large and small activation rows), the fused
#                                   # decode on each path; the sweep (fp32 path at its shape, packed at each
#                                   # candidate), then batch-1 decode, bf16 beside AWQ on each path (~8 minutes)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_SPEC=1 bash benchmarks/run_h200.sh
#                                   # speculative decoding's verify-step cost, batch-1 tokens/s with a draft model, greedy equality (issue 36)
#   RUN_GPU_CHECK=0 RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 RUN_NCU_GEMV=1 RUN_QUANT=1 QUANT_S=330 \
#     QUANT_ARGS="--sweep-gemv --engine --parts latency --variants awq" bash benchmarks/run_h200.sh
#                                   # issue 35, second round: Nsight Compute on the 4-bit and fp8 GEMVs (where the
#                                   # 4-bit one stalls), then the 4-bit sweep's smaller programs and bf16 / AWQ decode
#   GPU_CHECK_S=200 GPU_CHECK_ARGS="--skip-kernels --checks spec_graphs" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_SPEC=1 SPEC_S=380 bash benchmarks/run_h200.sh   # within one 600 s device call
#                                   # verify steps on the decode CUDA graphs: logits and greedy tokens against eager
#                                   # (tiny fp32/bf16, 8B bf16), then the verify cost with graphs and eager (issue 36)
#   GPU_CHECK_S=180 GPU_CHECK_ARGS="--skip-kernels --checks eagle_graphs" RUN_ENGINE_BENCH=0 RUN_CONSTRAINED=0 \
#     RUN_SPEC=1 SPEC_S=390 SPEC_ARGS="--eagle-only" bash benchmarks/run_h200.sh   # within one 600 s device call
#                                   # EAGLE on CUDA graphs: eagle/eagle3 greedy tokens and the head's inputs, graphs
#                                   # on vs off (tiny fp32/bf16), then 8B batch-1 tok/s plain and eagle with graphs
#                                   # and without, with the head's and the verify step's costs (issue 36)
#
# Each step has its own time limit (seconds, overridable) so that one hang cannot eat the others.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/radixlm-h200}
mkdir -p "$OUT"
# The repository root is the package radixlm: make it importable without installing.
mkdir -p /tmp/p && ln -sfn "$PWD" /tmp/p/radixlm
export PYTHONPATH=/tmp/p${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Python packages the image lacks (referencing with attrs and rpds-py, a core dependency for JSON schemas'
# $ref; DSPy and the dependencies it imports, for the dspy_rag workload), carried as wheels for its
# Python 3.12 in .whl (benchmarks/results/2026-11-29-paper-workloads.md says which): installed to
# /tmp/site, which PYTHONPATH puts before the image's site-packages.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# Pre-built tokenizer files the constrained benchmark would otherwise build from packages absent there.
if [ -d .gpu_carry ]; then export RADIXLM_CACHE=$PWD/.gpu_carry; fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  python3 -c 'import dspy; print("dspy", dspy.__version__, "from", dspy.__file__)' || echo "no dspy: dspy_rag is skipped"
  nproc
} 2>&1 | tee "$OUT/env.txt"

if [ "${RUN_GPU_CHECK:-1}" = 1 ]; then
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout "${GPU_CHECK_S:-330}" python3 benchmarks/gpu_check.py ${GPU_CHECK_ARGS---sweep --tune} --out "$OUT/gpu_check.json" \
  2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi

if [ "${RUN_ENGINE_BENCH:-1}" = 1 ]; then
timeout "${BENCH_S:-300}" python3 benchmarks/bench_engine.py --model llama3-8b-shape --out "$OUT/bench_engine.json" \
  2>&1 | tee "$OUT/bench_engine.log"
echo "bench_engine exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi

if [ "${RUN_FUSION_ABLATION:-0}" = 1 ]; then
  # Issue 19: the fused rotary + KV store against the unfused pair (RADIXLM_UNFUSED_ROTARY_STORE=1), back
  # to back on the 8B shape without the HF peer; read "latency ms/token (B=1)" and "decode step B=1: ...
  # GPU (graph) ... eager kernels ... launches" of each. One log for both (the device returns 8 files).
  for unfused in 0 1; do
    echo "== RADIXLM_UNFUSED_ROTARY_STORE=$unfused" | tee -a "$OUT/bench_fusion.log"
    RADIXLM_UNFUSED_ROTARY_STORE=$unfused timeout "${FUSION_S:-150}" python3 benchmarks/bench_engine.py \
      --model llama3-8b-shape --no-hf --requests 32 --repeats 5 2>&1 | tee -a "$OUT/bench_fusion.log"
    echo "bench_engine (RADIXLM_UNFUSED_ROTARY_STORE=$unfused) exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  done
fi

if [ "${RUN_FP8_KV:-0}" = 1 ]; then
  # Issue 19: the KV cache in the model's bf16 against fp8_e4m3 (half the KV bytes read per decode step,
  # twice the pool), both with overlap and admissions of 64 (the best variant so far), through the
  # variants below; then fp8 with the decode kernel stepping 128 keys at a time (a block of fp8 keys is
  # half the bytes of a bf16 one).
  RUN_THROUGHPUT_VARIANTS=1
  THROUGHPUT_VARIANTS=${THROUGHPUT_VARIANTS:-"kv_auto||--overlap --parts throughput decode_step --engine-option schedule_admission_batch=64
kv_fp8_e4m3||--overlap --parts throughput decode_step --engine-option schedule_admission_batch=64 --engine-option kv_cache_dtype=fp8_e4m3
kv_fp8_e4m3_attn_128_4_3|RADIXLM_DECODE_ATTN_CONFIG=128,4,3|--overlap --parts throughput decode_step --engine-option schedule_admission_batch=64 --engine-option kv_cache_dtype=fp8_e4m3"}
fi

if [ "${RUN_THROUGHPUT_VARIANTS:-0}" = 1 ]; then
  # Issue 19: engine variants on the 8B shape, back to back, one line each in THROUGHPUT_VARIANTS:
  # "name|environment|bench_engine flags". Default: overlap off and on (with batch-1 decode), then the
  # 1,000-request workload alone with larger admissions and with the decode kernel's (0, 64, 4, 3).
  THROUGHPUT_VARIANTS=${THROUGHPUT_VARIANTS:-"off||--parts latency throughput
on||--overlap --parts latency throughput
on_admit64||--overlap --parts throughput --engine-option schedule_admission_batch=64
on_admit128||--overlap --parts throughput --engine-option schedule_admission_batch=128
on_attn_64_4_3|RADIXLM_DECODE_ATTN_CONFIG=64,4,3|--overlap --parts throughput"}
  while IFS='|' read -r name env flags; do
    [ -z "$name" ] && continue
    echo "== $name ($env $flags)" | tee -a "$OUT/bench_variants.log"
    # shellcheck disable=SC2086  # env and flags are lists
    env $env timeout "${VARIANT_S:-150}" python3 benchmarks/bench_engine.py --model llama3-8b-shape --no-hf $flags \
      --out "$OUT/bench_variant_$name.json" 2>&1 | tee -a "$OUT/bench_variants.log"
    echo "bench_engine ($name) exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  done <<< "$THROUGHPUT_VARIANTS"
fi

if [ "${RUN_GEMV:-0}" = 1 ]; then
  # Issue 19: the decode GEMVs on the 8B shapes (cuBLAS vs the Triton GEMV's launch shapes, the fused
  # norm and SiLU prologues vs their launch sequences), then batch-1 decode with decode_fused_gemv off and
  # on, overlap on, back to back: "latency ms/token (B=1)" and the decode step's GPU time and launches.
  # The engine runs take the best launch shapes bench_gemv found (RADIXLM_GEMV_CONFIGS), where it got
  # that far; the kernel's guesses otherwise. About 8 minutes in all.
  # shellcheck disable=SC2086  # GEMV_ARGS is a list of flags
  timeout "${GEMV_S:-200}" python3 benchmarks/bench_gemv.py ${GEMV_ARGS:-} --out "$OUT/bench_gemv.json" \
    --configs-out "$OUT/gemv_configs.json" 2>&1 | tee "$OUT/bench_gemv.log"
  echo "bench_gemv exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  configs=""; [ -s "$OUT/gemv_configs.json" ] && configs="RADIXLM_GEMV_CONFIGS=$OUT/gemv_configs.json"
  for rows in ${GEMV_ROWS:-0 1}; do
    echo "== decode_fused_gemv=$rows $configs" | tee -a "$OUT/bench_fused_gemv.log"
    # shellcheck disable=SC2086  # configs is empty or one assignment
    env $configs timeout "${FUSED_GEMV_S:-130}" python3 benchmarks/bench_engine.py --model llama3-8b-shape \
      --no-hf --overlap --parts latency decode_step --engine-option "decode_fused_gemv=$rows" \
      --out "$OUT/bench_fused_gemv_$rows.json" 2>&1 | tee -a "$OUT/bench_fused_gemv.log"
    echo "bench_engine (decode_fused_gemv=$rows) exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  done
fi

if [ "${RUN_OVERLAP:-0}" = 1 ]; then
  # Issue 19: overlap scheduling off, then on (enable_overlap_schedule), back to back on the 8B shape
  # without the HF peer: batch-1 decode ("latency ms/token (B=1)") and the full 1,000-request offline
  # workload ("throughput"). One log, one JSON per setting.
  for overlap in off on; do
    flag=""; [ "$overlap" = on ] && flag="--overlap"
    echo "== overlap $overlap" | tee -a "$OUT/bench_overlap.log"
    # shellcheck disable=SC2086  # flag is empty or one flag
    timeout "${OVERLAP_S:-240}" python3 benchmarks/bench_engine.py --model llama3-8b-shape --no-hf $flag \
      --out "$OUT/bench_overlap_$overlap.json" 2>&1 | tee -a "$OUT/bench_overlap.log"
    echo "bench_engine (overlap $overlap) exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  done
fi

if [ "${RUN_CONSTRAINED:-1}" = 1 ] && [ -f benchmarks/bench_constrained.py ]; then
  # shellcheck disable=SC2086  # CONSTRAINED_ARGS is a list of flags
  timeout "${CONSTRAINED_S:-75}" python3 benchmarks/bench_constrained.py --repeats 3 --e2e \
    ${CONSTRAINED_ARGS:---batch 1 16 --max-new-tokens 128} 2>&1 | tee "$OUT/bench_constrained.log"
  echo "bench_constrained exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_PROFILE_STEPS:-0}" = 1 ]; then
  # Issue 19: where a constrained batch's time goes, step by step (kinds, medians, totals, the timeline).
  # shellcheck disable=SC2086  # PROFILE_STEPS_ARGS is a list of flags
  timeout "${PROFILE_STEPS_S:-150}" python3 benchmarks/profile_steps.py \
    ${PROFILE_STEPS_ARGS:---model llama3-8b-shape --batch 64 --cases json json_jump --timeline} 2>&1 \
    | tee "$OUT/profile_steps.log"
  echo "profile_steps exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi

if [ "${RUN_SCHEDULER:-0}" = 1 ]; then
  # The scheduler's host time per step with a null model runner, 1024 requests of which 64 run at once
  # (960 down to 0 waiting), 16 shared prefixes: each policy's cost of ordering a long queue.
  for policy in lpm fcfs dfs-weight; do
    timeout "${SCHEDULER_S:-60}" python3 benchmarks/bench_scheduler.py --batch 1024 --max-running 64 \
      --shared-prefixes 16 --prompt-len 1024 --new-tokens 8 --repeats 3 --policy "$policy"
  done 2>&1 | tee "$OUT/bench_scheduler.log"
fi
if [ "${RUN_WORKLOADS:-0}" = 1 ]; then
  # The preset stops starting measurements 455 s after the script starts (WORKLOADS_LIMIT_S overrides)
  # and rewrites workloads.json and .md after each, so the hard stop at WORKLOADS_S loses at most the
  # measurement in progress and the charts.
  # shellcheck disable=SC2086  # WORKLOADS_ARGS is a list of flags
  timeout "${WORKLOADS_S:-480}" python3 benchmarks/bench_workloads.py --model llama3-8b-shape \
    ${WORKLOADS_LIMIT_S:+--time-limit-s "$WORKLOADS_LIMIT_S"} ${WORKLOADS_ARGS:-} --out "$OUT/workloads.json" \
    --markdown "$OUT/workloads.md" --plot-dir "$OUT" 2>&1 | tee "$OUT/workloads.log"
  echo "bench_workloads exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ -n "${BASE_TAR:-}" ]; then
  # Issue 19: the paper workloads on this tree and on an older commit's, alternated ROUNDS times in one
  # call (calls on machines of the same kind differ by up to 27 %, so only one call's ratios compare).
  # BASE_TAR is made here with `git archive --prefix=radixlm/ COMMIT > .gpu_carry/base.tar` and carried.
  mkdir -p /tmp/base && tar -xf "$BASE_TAR" -C /tmp/base
  for round in $(seq "${ROUNDS:-1}"); do
    for tree in base head; do
      root=$PWD; path=$PYTHONPATH
      if [ $tree = base ]; then root=/tmp/base/radixlm; path=${PYTHONPATH//\/tmp\/p/\/tmp\/base}; fi
      # shellcheck disable=SC2086  # WORKLOADS_ARGS is a list of flags
      PYTHONPATH=$path timeout "${AB_S:-170}" python3 "$root/benchmarks/bench_workloads.py" --model llama3-8b-shape \
        ${WORKLOADS_ARGS:-} --systems radixlm --out "$OUT/ab_${tree}_$round.json" \
        --markdown "$OUT/ab_${tree}_$round.md" 2>&1 | tee -a "$OUT/ab_workloads.log"
      echo "bench_workloads ($tree, round $round) exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
    done
  done
fi
if [ "${RUN_HICACHE:-0}" = 1 ]; then
  # The host tier (issue 20): multi-turn chat spilling 6x past a 40k-token device pool, tier off vs on
  # (both write policies), then the same workload on the default pool, where it fits (no slower).
  # shellcheck disable=SC2086  # HICACHE_ARGS is a list of flags
  timeout "${HICACHE_S:-540}" python3 benchmarks/bench_hicache.py --preset h200 \
    ${HICACHE_ARGS:---write-policies write_back write_through --also-fits} \
    --out "$OUT/hicache.json" 2>&1 | tee "$OUT/hicache.log"
  echo "bench_hicache exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_IMAGES:-0}" = 1 ]; then
  # Issue 21: image QA on the LLaVA-1.5-7B shape (576 image tokens, dummy bf16 weights), 256 requests
  # about 4 shared images, then 256 requests with distinct images: the radix cache's image-prefix reuse.
  # shellcheck disable=SC2086  # IMAGES_ARGS is a list of flags
  timeout "${IMAGES_S:-420}" python3 benchmarks/bench_images.py --model llava-7b-shape ${IMAGES_ARGS:-} \
    --out "$OUT/images.json" 2>&1 | tee "$OUT/images.log"
  echo "bench_images exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_QWEN2VL:-0}" = 1 ]; then
  # Issue 21: the same image QA on the Qwen2-VL-2B shape (640x480 images: 391 positions each, dummy bf16
  # weights): dynamic-resolution tower, M-RoPE extends (eager) and decodes (CUDA graphs).
  # shellcheck disable=SC2086  # QWEN2VL_ARGS is a list of flags
  timeout "${QWEN2VL_S:-420}" python3 benchmarks/bench_images.py --model qwen2vl-2b-shape ${QWEN2VL_ARGS:-} \
    --out "$OUT/qwen2vl.json" 2>&1 | tee "$OUT/qwen2vl.log"
  echo "bench_images qwen2vl exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_QUANT:-0}" = 1 ]; then
  # Issue 35: bf16 beside fp8 (W8A8) and AWQ 4-bit on the 8B shape in one call: batch-1 decode, prefill
  # TFLOP/s, the 1,000-request offline set (bench_quant.py writes one JSON per variant and a summary).
  # shellcheck disable=SC2086  # QUANT_ARGS is a list of flags
  timeout "${QUANT_S:-540}" python3 benchmarks/bench_quant.py \
    ${QUANT_ARGS:---sweep-gemv --engine --variants fp8 awq:latency,prefill} --out-dir "$OUT" 2>&1 | tee "$OUT/bench_quant.log"
  echo "bench_quant exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
if [ "${RUN_NCU_GEMV:-0}" = 1 ]; then
  # Issue 35: Nsight Compute on one launch each of the 4-bit and the fp8 decode GEMV (the fused RMS-scaled
  # product on 28672 x 4096): stall reasons, occupancy, issue rate, shared-memory bank conflicts.
  timeout "${NCU_S:-300}" ncu --profile-from-start off --set full --force-overwrite --export "$OUT/ncu_gemv" \
    python3 benchmarks/bench_quant.py --ncu-gemv --out-dir /tmp/ncu-gemv 2>&1 | tail -40 | tee "$OUT/ncu_gemv.log"
  echo "ncu exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
  ncu --import "$OUT/ncu_gemv.ncu-rep" --page details > "$OUT/ncu_gemv_details.txt" 2>&1
fi
if [ "${RUN_SPEC:-0}" = 1 ]; then
  # Issue 36: a verify step of 8 drafts against a decode step at batch 1, 8, 64; end-to-end batch-1 tokens/s
  # on the 8B shape plain, with a 1B-shape draft (fixed and adaptive) and with the target as its own draft;
  # then greedy equality with speculation on and off (bench_spec_gpu.py, about 4 minutes on an H100).
  # shellcheck disable=SC2086  # SPEC_ARGS is a list of flags
  timeout "${SPEC_S:-420}" python3 benchmarks/bench_spec_gpu.py ${SPEC_ARGS:-} --out "$OUT/bench_spec_gpu.json" \
    2>&1 | tee "$OUT/bench_spec_gpu.log"
  echo "bench_spec_gpu exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/env.txt"
