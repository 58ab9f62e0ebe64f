"""The library's layers import downward only, read from the source with `ast` (every import statement:
module level, inside functions, under TYPE_CHECKING).

- no import cycle in the library (core, kernels, server, adapters, testing) nor among the benchmark
  scripts, counting the imports under TYPE_CHECKING;
- the runtime's lower floors (models, layers, tokenizer) and kernels never import the engine's floors
  above them (the boundary, scheduler, memory, execution, distributed); constrained never imports models;
  layers (below the models) import no other runtime package but kernels; kernels import nothing of core;
- the runtime never imports the language (core.lang), the chat formats (core.chat), server, adapters or
  the top-level package (whose attributes lazily load the language); core.chat imports neither system;
- no library module imports the test fixtures (radixlm.testing);
- constrained decoding's floors import downward: automata, then tokens, then schema, then the package
  level (docs/constrained.md's Layout).

Rules are checked on what a module reaches through imports, not only on what it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "radixlm"
ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `radixlm`

RUNTIME = ("radixlm.core.runtime", "radixlm.core.runtime.constrained", "radixlm.kernels")
LOWER = ("radixlm.core.runtime.models", "radixlm.core.runtime.layers", "radixlm.core.runtime.tokenizer")
# the engine's floors above the models: every module of core.runtime but the lower floors and the cache folder
ENGINE = ("radixlm.core.runtime.scheduler", "radixlm.core.runtime.memory", "radixlm.core.runtime.execution",
          "radixlm.core.runtime.distributed",
          *(f"radixlm.core.runtime.{p.stem}" for p in (ROOT / "core" / "runtime").glob("*.py")
            if p.stem not in ("__init__", "cache")))
LANGUAGE = ("radixlm.core.lang", "radixlm.core.chat", "radixlm.server", "radixlm.adapters")
LIBRARY = ("radixlm.core", "radixlm.kernels", "radixlm.server", "radixlm.adapters")
# constrained decoding's floors, in the order a spec travels: automata, token tables, schema -> grammar, and
# the package level (the index, its cache, the per-request constraint, llguidance)
CONSTRAINED_FLOORS = [tuple(f"radixlm.core.runtime.constrained.{m}" for m in floor) for floor in (
    ("automata",), ("tokens",), ("schema",),
    ("pda", "accept_paths", "grammar_index_cache", "grammar_constraint", "llguidance_backend"))]
# (importers, what they must never reach)
RULES = [
    ((*LOWER, "radixlm.kernels"), ENGINE),
    (("radixlm.core.runtime.constrained",), ("radixlm.core.runtime.models",)),
    (("radixlm.core.runtime.layers",), ("radixlm.core.runtime.models", "radixlm.core.runtime.constrained",
                                        "radixlm.core.runtime.tokenizer")),
    (("radixlm.kernels",), ("radixlm.core",)),
    (RUNTIME, (*LANGUAGE, PACKAGE)),
    (("radixlm.core.chat",), ("radixlm.core.lang", "radixlm.core.runtime", "radixlm.core.runtime.constrained")),
    (LIBRARY, ("radixlm.testing",)),
    # each floor of constrained decoding imports none of the floors after it
    *((floor, tuple(m for upper in CONSTRAINED_FLOORS[i + 1:] for m in upper))
      for i, floor in enumerate(CONSTRAINED_FLOORS[:-1])),
]
# top-level folders that are no part of the package
NOT_PACKAGE = {"tests", "benchmarks", "examples", "scripts", "docs", "build"}


def _within(module: str, names: tuple[str, ...]) -> bool:
    """module is one of names or inside one of them; a top-level name (the package) means itself alone."""
    return any(module == n or ("." in n and module.startswith(n + ".")) for n in names)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package whose folder is `root`: its top-level folders (namespace portions, with
    no __init__.py) and, below them, the folders reached through __init__.py files."""
    modules: dict[str, Path] = {package: root / "__init__.py"}

    def walk(folder: Path, name: str) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_dir() and (path / "__init__.py").is_file():
                modules[f"{name}.{path.name}"] = path / "__init__.py"
                walk(path, f"{name}.{path.name}")
            elif path.suffix == ".py" and path.name != "__init__.py":
                modules[f"{name}.{path.stem}"] = path

    walk(root, package)
    for portion in sorted(root.iterdir()):
        if (portion.is_dir() and not portion.name.startswith(".") and portion.name not in NOT_PACKAGE
                and not (portion / "__init__.py").exists() and any(portion.rglob("*.py"))):
            walk(portion, f"{package}.{portion.name}")
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations alone)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def script_modules(folder: Path) -> dict[str, Path]:
    """The modules of a folder of scripts run from inside it (benchmarks/): each script by its name, and
    the packages beside them."""
    modules = {path.stem: path for path in sorted(folder.glob("*.py"))}
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        modules.update(package_modules(sub, sub.name))
    return modules


def import_graph(root: Path, package: str, type_checking: bool = True,
                 modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from a import b` counts as importing a.b where that
    is a module (else a); relative imports are resolved. type_checking False leaves out the imports made
    for annotations alone, which never run."""
    modules = package_modules(root, package) if modules is None else modules
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        skipped = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]], among: tuple[str, ...]) -> list[list[str]]:
    """The import cycles among the modules under `among` (strongly connected components of more than one
    module; Tarjan's algorithm), each sorted."""
    nodes = [m for m in graph if _within(m, among)]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if not _within(w, among):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(found)


def violations(graph: dict[str, set[str]], rules: list[tuple[tuple[str, ...], tuple[str, ...]]]) -> list[str]:
    """'importer -> ... -> forbidden' for every module of a rule's importers that reaches a module it must
    not (through any chain of imports), with the shortest such chain."""
    found = []
    for importers, forbidden in rules:
        for start in sorted(m for m in graph if _within(m, importers)):
            paths = {start: [start]}
            queue = [start]
            while queue:
                v = queue.pop(0)
                if _within(v, forbidden) and not _within(start, forbidden):
                    found.append(" -> ".join(paths[v]))
                    break
                for w in sorted(graph[v]):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        queue.append(w)
    return found


def test_library_forms_no_import_cycle():
    """No cycle anywhere in the library, neither among the imports that run (module level and inside
    functions) nor counting those made for annotations alone (under TYPE_CHECKING): a module that needs
    another's type only names it by what it offers (a Protocol) or takes the type from a lower module."""
    assert cycles(import_graph(ROOT, PACKAGE), LIBRARY + ("radixlm.testing",)) == []
    assert cycles(import_graph(ROOT, PACKAGE, type_checking=False), LIBRARY + ("radixlm.testing",)) == []


def test_benchmarks_form_no_import_cycle():
    """The benchmark scripts import each other (a script's helpers, its workloads): downward too."""
    modules = script_modules(ROOT / "benchmarks")
    assert cycles(import_graph(ROOT, "", modules=modules), tuple(modules)) == []


def test_layers_import_downward_only():
    assert violations(import_graph(ROOT, PACKAGE), RULES) == []


def test_graph_sees_the_package():
    """The checks above read the real tree: the known downward imports are there."""
    graph = import_graph(ROOT, PACKAGE)
    assert "radixlm.core.runtime.layers.forward_batch" in graph["radixlm.core.runtime.models.llama"]
    assert "radixlm.core.runtime.tokenizer.fast_path" in graph["radixlm.core.runtime.constrained.grammar_constraint"]
    assert "radixlm.kernels.registry" in graph["radixlm.core.runtime.execution.model_runner"]
    assert "radixlm.testing.checkpoints" in graph["radixlm.testing.vision"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_cycles_and_upward_imports(tmp_path):
    """A synthetic package with one violation of each kind, hidden as a real tree would hide them."""
    _write(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/engine/__init__.py": "",
        "core/engine/runner.py": "from pkg.core.models import llama\nfrom pkg.core.engine import batch\n",
        "core/engine/batch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import runner\n",
        "core/models/__init__.py": "",
        # upward, inside a function and relative: models -> engine (and so a cycle runner <-> llama)
        "core/models/llama.py": "def forward():\n    from ..engine import runner\n",
        "core/models/hub.py": "",
        # transitively upward: constrained -> tokenizer -> models
        "core/constrained/__init__.py": "",
        "core/constrained/fsm.py": "import pkg.core.tokenizer.load\n",
        "core/tokenizer/__init__.py": "",
        "core/tokenizer/load.py": "from pkg.core.models.hub import find\n",
        # runtime -> frontend under TYPE_CHECKING
        "core/program/__init__.py": "",
        "core/engine/options.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.core import program\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.core.models.llama"] == {"pkg.core.engine.runner"}
    assert graph["pkg.core.engine.options"] == {"pkg.core.program"}
    runtime = ("pkg.core.engine", "pkg.core.models", "pkg.core.constrained", "pkg.core.tokenizer")
    assert cycles(graph, runtime) == [["pkg.core.engine.batch", "pkg.core.engine.runner", "pkg.core.models.llama"]]
    # batch <-> runner only for annotations: no cycle once those are left out
    assert cycles(import_graph(tmp_path, "pkg", type_checking=False), runtime) == [
        ["pkg.core.engine.runner", "pkg.core.models.llama"]]
    rules = [(("pkg.core.models",), ("pkg.core.engine",)), (("pkg.core.constrained",), ("pkg.core.models",)),
             (runtime, ("pkg.core.program",))]
    assert violations(graph, rules) == [
        "pkg.core.models.llama -> pkg.core.engine.runner",
        "pkg.core.constrained.fsm -> pkg.core.tokenizer.load -> pkg.core.models.hub",
        "pkg.core.engine.options -> pkg.core.program",
    ]
    # a folder of scripts: a cycle through a lazy import and a relative one inside its package
    _write(tmp_path / "bench", {"a.py": "import b\n", "b.py": "def f():\n    from a import x\n",
                                "c.py": "from work import load\n", "work/__init__.py": "from .load import go\n",
                                "work/load.py": "from work import helper\n", "work/helper.py": ""})
    scripts = script_modules(tmp_path / "bench")
    graph = import_graph(tmp_path, "", modules=scripts)
    assert graph["c"] == {"work.load"} and graph["work"] == {"work.load"}
    assert cycles(graph, tuple(scripts)) == [["a", "b"]]
    # and a clean tree passes
    _write(tmp_path, {"core/models/llama.py": "", "core/tokenizer/load.py": "", "core/engine/options.py": ""})
    graph = import_graph(tmp_path, "pkg", type_checking=False)
    assert cycles(graph, runtime) == [] and violations(graph, rules) == []
