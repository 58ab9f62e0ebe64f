"""Garbage-collection pauses of a serving engine, with its startup heap frozen (gc_freeze, the default) and not.

    python benchmarks/gc_pauses.py [--model PATH] [--schemas 200] [--batch 16]

Each variant runs in a process of its own: an engine (the embedded default model unless --model) serves
JSON-constrained requests, each with a schema of its own (random property names and types, as a server
meeting new tools would), `--batch` at a time. Printed per variant: the collections per generation that
ran while it served and their CPU time (the collecting thread's: robust to other jobs on the machine), the
longest, the objects the collector still traverses, and a full collection timed at the end (the pause any
full collection costs this process now; best of 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import threading
import time

TYPES = ({"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "boolean"},
         {"enum": ["red", "green", "blue"]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 3})


def schema(rng: random.Random) -> dict:
    names = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(3, 12)))
             for _ in range(rng.randint(2, 6))]
    props = {n: dict(rng.choice(TYPES)) for n in names}
    return {"type": "object", "properties": props, "required": names[: rng.randint(1, len(names))]}


def serve(model: str | None, freeze: bool, count: int, batch: int) -> dict:
    import radixlm

    engine = radixlm.Engine(model, gc_freeze=freeze, max_running_requests=batch, gc_warning_threshold_ms=0)
    for thread in threading.enumerate():  # the engine's vocabulary preparation, which then freezes (gc_freeze)
        if thread.name == "radixlm-prepare-vocab":
            thread.join()
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses.append((info["generation"], (time.thread_time() - started[0]) * 1e3))

    rng = random.Random(0)
    schemas = [json.dumps(schema(rng)) for _ in range(count)]
    gc.callbacks.append(timed)
    wall = time.perf_counter()
    for i in range(0, count, batch):
        group = schemas[i:i + batch]
        engine.generate(["Write a JSON object."] * len(group),
                        [{"max_new_tokens": 32, "temperature": 1.0, "json_schema": s} for s in group])
    wall = time.perf_counter() - wall
    gc.callbacks.remove(timed)
    full = []
    for _ in range(3):
        start = time.thread_time()
        gc.collect()
        full.append((time.thread_time() - start) * 1e3)
    out = {"freeze": freeze, "requests": count, "serve_s": round(wall, 1), "tracked": len(gc.get_objects()),
           "frozen": gc.get_freeze_count(), "full_collection_ms": round(min(full), 1)}
    for g in range(3):
        times = [ms for gen, ms in pauses if gen == g]
        out[f"gen{g}"] = {"collections": len(times), "cpu_ms": round(sum(times), 1),
                          "longest_ms": round(max(times, default=0.0), 1)}
    engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--variant", choices=("freeze", "no-freeze"), help=argparse.SUPPRESS)  # one child's
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(serve(args.model, args.variant == "freeze", args.schemas, args.batch)))
        return
    for variant in ("no-freeze", "freeze"):
        cmd = [sys.executable, __file__, "--variant", variant, "--schemas", str(args.schemas), "--batch", str(args.batch)]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
