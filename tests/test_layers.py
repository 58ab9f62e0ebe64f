"""The runtime's layers import downward only, read from the source with `ast` (every import statement:
module level, inside functions, under TYPE_CHECKING).

- no import cycles among runtime modules (core.engine, core.models, core.constrained, core.layers,
  core.tokenizer, kernels);
- models, kernels, layers and tokenizer never import core.engine; constrained never imports models;
  layers (below the models) import no other runtime package but kernels; kernels import nothing of core;
- the runtime never imports the frontend (core.program, core.backends), server, adapters or the
  top-level package (whose attributes lazily load the frontend).

Rules are checked on what a module reaches through imports, not only on what it names.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

PACKAGE = "radixlm"
ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `radixlm`

RUNTIME = ("radixlm.core.engine", "radixlm.core.models", "radixlm.core.constrained", "radixlm.core.layers",
           "radixlm.core.tokenizer", "radixlm.kernels")
FRONTEND = ("radixlm.core.program", "radixlm.core.backends", "radixlm.server", "radixlm.adapters")
# (importers, what they must never reach)
RULES = [
    (("radixlm.core.models", "radixlm.kernels", "radixlm.core.layers", "radixlm.core.tokenizer"),
     ("radixlm.core.engine",)),
    (("radixlm.core.constrained",), ("radixlm.core.models",)),
    (("radixlm.core.layers",), ("radixlm.core.models", "radixlm.core.constrained", "radixlm.core.tokenizer")),
    (("radixlm.kernels",), ("radixlm.core",)),
    (RUNTIME, (*FRONTEND, PACKAGE)),
]


def _within(module: str, names: tuple[str, ...]) -> bool:
    """module is one of names or inside one of them; a top-level name (the package) means itself alone."""
    return any(module == n or ("." in n and module.startswith(n + ".")) for n in names)


def namespace_portions(root: Path, package: str) -> set[str]:
    """The top-level folders pyproject.toml lists as the package's subpackages: namespace portions, with no
    __init__.py (docs/layers.md says why)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return set()
    listed = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]
    return {name.split(".")[1] for name in listed if name.count(".") == 1 and name.startswith(package + ".")}


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package whose folder is `root`: the folders reached through __init__.py files,
    and the top-level namespace portions (which hold no __init__.py of their own)."""
    modules: dict[str, Path] = {}
    portions = namespace_portions(root, package)

    def walk(folder: Path, name: str) -> None:
        if (folder / "__init__.py").is_file():
            modules[name] = folder / "__init__.py"
        for path in sorted(folder.iterdir()):
            if path.is_dir() and ((path / "__init__.py").is_file() or (folder == root and path.name in portions)):
                walk(path, f"{name}.{path.name}")
            elif path.suffix == ".py" and path.name != "__init__.py":
                modules[f"{name}.{path.stem}"] = path

    walk(root, package)
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations alone)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def import_graph(root: Path, package: str, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from a import b` counts as importing a.b where that
    is a module (else a); relative imports are resolved. type_checking False leaves out the imports made
    for annotations alone, which never run."""
    modules = package_modules(root, package)
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


def test_runtime_modules_form_no_import_cycle():
    """Imports that run (module level and inside functions). Annotation-only imports (under
    TYPE_CHECKING) never run, so they make no cycle; the layering rules below count them too."""
    assert cycles(import_graph(ROOT, PACKAGE, type_checking=False), RUNTIME) == []


def test_layers_import_downward_only():
    assert violations(import_graph(ROOT, PACKAGE), RULES) == []


def test_graph_sees_the_package():
    """The checks above read the real tree: the known downward imports are there."""
    graph = import_graph(ROOT, PACKAGE)
    assert "radixlm.core.layers.forward_batch" in graph["radixlm.core.models.llama"]
    assert "radixlm.core.tokenizer.fast_path" in graph["radixlm.core.constrained.fsm"]
    assert "radixlm.kernels.registry" in graph["radixlm.core.engine.model_runner"]


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
    # and a clean tree passes
    _write(tmp_path, {"core/models/llama.py": "", "core/tokenizer/load.py": "", "core/engine/options.py": ""})
    graph = import_graph(tmp_path, "pkg", type_checking=False)
    assert cycles(graph, runtime) == [] and violations(graph, rules) == []
