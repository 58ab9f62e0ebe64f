"""DSPy on radixlm: SGLangLM (module calls run as one fork/join program) against plain
`dspy.LM("openai/<model>", api_base=<radixlm server>/v1)` on the same DSPy program.

    python benchmarks/bench_dspy.py                      # embedded tiny model on CPU, a few seconds a run
    python benchmarks/bench_dspy.py --model-path DIR --examples 64 --max-field-chars 0

The program: a few-shot dspy.ChainOfThought ("question -> answer") with ChatAdapter, run with
Module.batch over --examples questions. One engine serves everything: in-process for SGLangLM(engine=)
and behind radixlm's HTTP server (uvicorn on loopback, same process) for the others. Variants:

- `SGLangLM(engine=)`: in-process, the batch's calls become one program (shared prefix pre-filled once);
- `SGLangLM(base_url=)`: the same program over the server's native /generate;
- `dspy.LM + regex`: plain dspy.LM (LiteLLM, /v1/chat/completions) given the same reply-format regex
  through the server's `regex` extra, so its replies parse too: the runtime comparison;
- `dspy.LM`: plain dspy.LM as it comes; a model that does not follow ChatAdapter's format (like the
  random-weight one) makes DSPy retry each call with JSONAdapter, and such replies may still fail.

Each variant: one warm-up run (token indexes for its constraint get built), then --repeats runs, each
after flushing the radix cache. Engine counters (delta per run) tell the cost: requests, prompt tokens,
prompt tokens served from the cache, tokens actually computed by prefill, generated tokens.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import threading
import time
import warnings
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for LiteLLM's price list
warnings.filterwarnings("ignore", message="Implementing custom LMs", category=DeprecationWarning)

import dspy  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

import radixlm  # noqa: E402
from radixlm.adapters.dspy import SGLangLM, chat_regex  # noqa: E402
from radixlm.server.app import create_app  # noqa: E402
from radixlm.server.args import ServerArgs  # noqa: E402
from machine_info import cpu_name  # noqa: E402

DEMOS = [
    dspy.Example(question="What is the boiling point of water at sea level in Celsius?",
                 reasoning="Water boils at 100 degrees Celsius at one atmosphere.", answer="100"),
    dspy.Example(question="How many continents are there?",
                 reasoning="The usual count is Africa, Antarctica, Asia, Australia, Europe, North and South America.",
                 answer="7"),
    dspy.Example(question="Which planet is closest to the sun?",
                 reasoning="Mercury has the smallest orbit of the planets.", answer="Mercury"),
    dspy.Example(question="What gas do plants take in for photosynthesis?",
                 reasoning="Plants absorb carbon dioxide and release oxygen.", answer="carbon dioxide"),
]
COUNTER_NAMES = ("requests_total", "prompt_tokens_total", "cached_tokens_total", "prefill_tokens_total",
                 "generated_tokens_total")


class Server:
    """radixlm's HTTP server on a free loopback port, in a thread of this process."""

    def __init__(self, engine: Any) -> None:
        config = uvicorn.Config(create_app(engine, ServerArgs(port=0)), host="127.0.0.1", port=0,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def program(num_demos: int) -> dspy.Module:
    module = dspy.ChainOfThought("question -> answer")
    module.predict.demos = DEMOS[:num_demos]
    return module


def counters(engine: Any) -> dict[str, int]:
    stats = engine.get_stats()
    return {name: stats[name] for name in COUNTER_NAMES}


def run_once(engine: Any, lm: Any, module: dspy.Module, questions: list[str]) -> dict[str, Any]:
    while not engine.flush_cache():  # nothing may be running between runs
        time.sleep(0.05)
    examples = [dspy.Example(question=q).with_inputs("question") for q in questions]
    before = counters(engine)
    start = time.perf_counter()
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        results = module.batch(examples, num_threads=len(examples), max_errors=len(examples) + 1,
                               disable_progress_bar=True)
    wall = time.perf_counter() - start
    after = counters(engine)
    parsed = sum(r is not None and bool(str(r.answer).strip()) for r in results)
    return {"wall": wall, "parsed": parsed, **{k: after[k] - before[k] for k in COUNTER_NAMES}}


def measure(engine: Any, lm: Any, module: dspy.Module, questions: list[str], repeats: int) -> dict[str, Any]:
    run_once(engine, lm, module, questions[:2])  # warm-up
    runs = [run_once(engine, lm, module, questions) for _ in range(repeats)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["wall_min"] = min(r["wall"] for r in runs)
    return out


def machine() -> str:
    cpu = cpu_name()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (f"{os.cpu_count()} x {cpu}, {device}, torch {torch.__version__}, dspy {dspy.__version__}, "
            f"load average {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="HF checkpoint (default: embedded tiny model)")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--demos", type=int, default=4, choices=range(len(DEMOS) + 1))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-field-chars", type=int, default=None,
                        help="bound free-text fields (default: 24 on the embedded model; 0: unbounded)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-plain", action="store_true", help="leave out dspy.LM without a regex")
    args = parser.parse_args()
    bound = args.max_field_chars if args.max_field_chars is not None else (24 if args.model_path is None else 0)
    bound = bound or None
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    logging.getLogger("dspy").setLevel(logging.CRITICAL)  # failed examples are counted, not logged

    engine = radixlm.Engine(args.model_path)
    server = Server(engine)
    module = program(args.demos)
    questions = [f"Question {i}: what is {i} plus {2 * i + 1}?" for i in range(args.examples)]
    regex = chat_regex(module.predict.signature, bound)
    common = dict(temperature=0.0, max_tokens=args.max_tokens)
    openai = dict(api_base=server.url + "/v1", api_key="unused", cache=False, num_retries=0, **common)
    variants = {
        "SGLangLM(engine=)": SGLangLM(engine=engine, max_field_chars=bound, **common),
        "SGLangLM(base_url=)": SGLangLM(base_url=server.url, max_field_chars=bound, **common),
        "dspy.LM + regex": dspy.LM(f"openai/{engine.served_model_name}", extra_body={"regex": regex}, **openai),
    }
    if not args.skip_plain:
        variants["dspy.LM"] = dspy.LM(f"openai/{engine.served_model_name}", **openai)
    try:
        results = {name: measure(engine, lm, module, questions, args.repeats) for name, lm in variants.items()}
    finally:
        server.stop()
        engine.shutdown()

    print(f"Date: {datetime.date.today().isoformat()}. Machine: {machine()}.")
    print(f"Program: ChainOfThought with {args.demos} demos, ChatAdapter, Module.batch of {args.examples}, "
          f"max_tokens {args.max_tokens}, max_field_chars {bound}; median of {args.repeats} runs.\n")
    print("| variant | wall (median / min) | replies parsed | engine requests | prompt tokens | "
          "from cache | computed by prefill | generated |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall']:.2f} s / {r['wall_min']:.2f} s | {r['parsed']:.0f} / {args.examples} | "
              f"{r['requests_total']:.0f} | {r['prompt_tokens_total']:.0f} | {r['cached_tokens_total']:.0f} | "
              f"{r['prefill_tokens_total']:.0f} | {r['generated_tokens_total']:.0f} |")


if __name__ == "__main__":
    main()
