"""Speculative decoding, end to end at batch 1: tokens/s with speculation off and on, on a workload
that repeats its prompt (JSON extraction of fields from a long document, a summary quoting its
source) and on plain chat, in one run, off and on alternating prompt by prompt.

    python benchmarks/bench_spec.py --out spec.json                  # the default model (SmolLM2-135M), CPU
    python benchmarks/bench_spec.py --model tiny --max-new-tokens 32 # the test model, seconds (CI)
    python benchmarks/bench_spec.py --draft-tokens 4 8               # one spec engine per draft length
    python benchmarks/bench_spec.py --draft-tokens 8 --breadth 1 3   # ngram chains against trees of 3 continuations

Every prompt is run once on each engine to cache it (and warm up), then `--repeats` times on each,
alternating; a run's time is from submission to the last token (the prompt is cached, so this is the
decode phase plus one token's prefill). Greedy outputs of the two engines must be equal (checked).
A round runs every prompt of a workload once on each engine; the report per workload: the medians over
`--repeats` rounds of output tokens/s off and on and of their ratio (each round's too), and the accepted
tokens per verify step (meta_info's spec_accept_length, weighted by verify steps) and the draft tokens
checked per verify step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import cpu_name  # noqa: E402

import radixlm  # noqa: E402

_PEOPLE = [("Maria Alvarez", "chief executive officer"), ("Tomasz Nowak", "chief financial officer"),
           ("Aiko Tanaka", "head of research"), ("Samuel Okafor", "head of manufacturing")]


def _document() -> str:
    """A company report of about 900 tokens with the fields the extraction asks for spelled out in it."""
    paras = [
        "Northwind Solar Systems was founded on 14 March 2009 in Porto, Portugal, by a group of engineers "
        "from the University of Porto. Its headquarters are at Rua das Flores 118, 4050-262 Porto. The "
        "company designs and builds rooftop solar inverters and battery storage units for small businesses.",
    ]
    for name, role in _PEOPLE:
        paras.append(f"{name} serves as the {role} of Northwind Solar Systems. Before joining the company, "
                     f"{name.split()[0]} worked for twelve years in the energy sector, leading teams in Lisbon, "
                     f"Madrid and Rotterdam. {name.split()[0]} is known inside the company for a careful, "
                     f"data-driven approach to planning and for mentoring young engineers.")
    paras += [
        "In the fiscal year 2023 Northwind Solar Systems reported revenue of 48.2 million euros, an increase of "
        "17 percent over the previous year, and an operating profit of 5.9 million euros. The company employed "
        "412 people at the end of the year, of whom 160 work in the Porto factory.",
        "The main products are the NW-5000 hybrid inverter, the NW-Store 10 kWh battery, and the NW-Cloud "
        "monitoring service, which more than 21,000 customers in nine countries use to follow the output of "
        "their installations in real time.",
        "The company plans to open a second factory in Braga in 2025 and to double its research staff by 2026. "
        "Its largest customers are regional supermarket chains, hotels and agricultural cooperatives.",
    ]
    return "\n\n".join(paras)


def _article() -> str:
    return ("The city council of Ravenshollow voted on Tuesday to convert the old railway depot on Mill Street "
            "into a public library and community center. The project, which will cost an estimated 6.4 million "
            "pounds, is expected to open in the autumn of 2026. Council leader Harriet Bloom said the building "
            "had stood empty for more than a decade and that the new library would give the north of the city "
            "a place to read, study and meet. The plan includes a children's reading room, a makerspace with 3D "
            "printers, and a cafe run by a local charity. Opponents argued that the money should instead be "
            "spent on repairing roads, but the motion passed by 31 votes to 9. Construction will begin in "
            "March, and the railway depot's original brick facade and clock tower will be preserved. "
            "Local historian Peter Quayle welcomed the decision, saying that the depot was one of the last "
            "Victorian railway buildings left in the county and deserved to be used again.")


def workloads() -> dict[str, list[str]]:
    doc, article = _document(), _article()
    fields = "company, founded, city, address, ceo, cfo, revenue_2023, employees, products"
    return {
        "extraction": [
            f"Read the report below and extract these fields as a JSON object: {fields}. Copy every value "
            f"exactly as the report writes it.\n\nReport:\n{doc}",
            f"Summarize the following article in a few sentences. Quote its most important sentences word "
            f"for word.\n\nArticle:\n{article}",
            f"List every person named in the report below with their role, one per line as 'name: role', "
            f"using the report's exact words, then repeat the report's first paragraph.\n\nReport:\n{doc}",
        ],
        "chat": [
            "What are three good habits for staying healthy? Explain each briefly.",
            "Write a short story about a cat who learns to play the piano.",
            "Why is the sky blue? Give a simple explanation for a child.",
        ],
    }


def _chat_prompt(engine: radixlm.Engine, text: str) -> list[int]:
    template = getattr(engine.tokenizer, "chat_template", None)
    if not template:
        return engine.tokenizer.encode(text)
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def _timed(engine: radixlm.Engine, ids: list[int], params: dict[str, Any]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    return out, time.perf_counter() - start


def run(model: str | None, draft_tokens: int, max_new_tokens: int, repeats: int, extra: dict[str, Any],
        breadth: int = 1, adaptive: bool = True, radix: bool = True) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    spec_opts = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": draft_tokens,
                 "speculative_ngram_max_bfs_breadth": breadth, "speculative_adaptive": adaptive,
                 "speculative_ngram_radix_cache": radix}
    with radixlm.Engine(model, **extra) as off, radixlm.Engine(model, **spec_opts, **extra) as on:
        report: dict[str, Any] = {}
        for name, texts in workloads().items():
            prompts = [_chat_prompt(off, text) for text in texts]
            bases = [off.generate(input_ids=ids, sampling_params=params) for ids in prompts]  # caches, warms up
            for ids in prompts:
                on.generate(input_ids=ids, sampling_params=params)
            rounds, verify_ct, accepted, mismatches = [], 0, 0, 0
            drafted_before = on.get_stats()["spec_draft_tokens_total"]
            for _ in range(repeats):  # a round: every prompt once on each engine, alternating
                tokens = {"off": 0, "on": 0}
                seconds = {"off": 0.0, "on": 0.0}
                for ids, base in zip(prompts, bases):
                    for key, engine in (("off", off), ("on", on)):
                        out, dt = _timed(engine, ids, params)
                        tokens[key] += out["meta_info"]["completion_tokens"]
                        seconds[key] += dt
                        if key == "on":
                            mismatches += out["output_ids"] != base["output_ids"]
                            verify_ct += out["meta_info"]["spec_verify_ct"]
                            accepted += out["meta_info"]["spec_accepted_tokens"]
                rate = {k: tokens[k] / seconds[k] for k in tokens}
                rounds.append({"tokens_per_s_off": rate["off"], "tokens_per_s_on": rate["on"],
                               "speedup": rate["on"] / rate["off"]})
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            drafted = on.get_stats()["spec_draft_tokens_total"] - drafted_before
            report[name] = {**med, "rounds": rounds, "accept_length": 1 + accepted / verify_ct if verify_ct else 0.0,
                            "verify_steps": verify_ct, "drafted_per_verify": drafted / verify_ct if verify_ct else 0.0,
                            "greedy_mismatches": mismatches}
            print(f"draft {draft_tokens} breadth {breadth}  {name:10s}  off {med['tokens_per_s_off']:6.1f} tok/s  on "
                  f"{med['tokens_per_s_on']:6.1f} tok/s  x{med['speedup']:.2f} (rounds: "
                  f"{', '.join(format(r['speedup'], '.2f') for r in rounds)})  accept length "
                  f"{report[name]['accept_length']:.2f}  drafted/verify {report[name]['drafted_per_verify']:.2f}  "
                  f"verify steps {verify_ct}  greedy mismatches {mismatches}", flush=True)
        return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct; "
                    "'tiny': the 2-layer test checkpoint")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[4])
    ap.add_argument("--breadth", type=int, nargs="+", default=[1],
                    help="speculative_ngram_max_bfs_breadth values (1: chains; more: trees), one engine each")
    ap.add_argument("--no-radix-drafts", action="store_true", help="speculative_ngram_radix_cache=False: the "
                    "timed runs repeat their prompts, whose first answers the radix cache then drafts whole; "
                    "this measures the request's own n-grams alone")
    ap.add_argument("--no-adaptive", action="store_true", help="speculative_adaptive=False: every step drafts "
                    "the most that fits (acceptance without the policy's choices)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, extra = args.model, {"device": "cpu"}
    if model == "tiny":
        from radixlm.testing.checkpoints import build_checkpoint

        model = build_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"))
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_name(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "model": args.model or "SmolLM2-135M-Instruct",
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "adaptive": not args.no_adaptive,
               "radix_drafts": not args.no_radix_drafts, "runs": {}}
    for k in args.draft_tokens:
        for b in args.breadth:
            key = str(k) if b == 1 else f"{k}x{b}"
            results["runs"][key] = run(model, k, args.max_new_tokens, args.repeats, extra, b, not args.no_adaptive,
                                       not args.no_radix_drafts)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
