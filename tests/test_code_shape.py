"""The library's shape, read from the source with `ast`: every module of the package (each .py outside
tests/, benchmarks/, examples/ and scripts/) is at most 500 lines, every function at most 80, and no
module imports another module's private (`_name`) names: what modules share is public, in a module
named for it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_layers import PACKAGE, ROOT, package_modules

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _library_files(root: Path, package: str) -> list[Path]:
    return sorted(set(package_modules(root, package).values()))


def long_files(files: list[Path], limit: int = MAX_FILE_LINES) -> list[str]:
    return [f"{path}: {n} lines" for path in files if (n := len(path.read_text().splitlines())) > limit]


def long_functions(files: list[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # decorators aside, docstring included
                if length > limit:
                    found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


# Python's own regex parser, read on purpose so that a regex constraint means exactly what Python's `re`
# means (automata/regex_dfa.py); the only private names the library takes from outside it.
STDLIB_PARSER = {("re", "_parser"), ("re", "_constants")}


def private_imports(files: list[Path]) -> list[str]:
    """`from m import _name` of any module (relative imports too); dunder names are not private."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and (
                            node.level or (node.module, alias.name) not in STDLIB_PARSER):
                        found.append(f"{path}:{node.lineno} imports {alias.name} from {'.' * node.level}{node.module or ''}")
    return found


@pytest.fixture(scope="module")
def library() -> list[Path]:
    files = _library_files(ROOT, PACKAGE)
    assert ROOT / "core" / "runtime" / "engine.py" in files and ROOT / "kernels" / "registry.py" in files
    assert not any(part in ("tests", "benchmarks", "examples", "scripts") for f in files
                   for part in f.relative_to(ROOT).parts[:1])
    return files


def test_no_library_file_is_over_500_lines(library):
    assert long_files(library) == []


def test_no_library_function_is_over_80_lines(library):
    assert long_functions(library) == []


def test_no_module_imports_a_private_name(library):
    assert private_imports(library) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """A file of each kind of fault, and a clean one."""
    long_file = tmp_path / "long.py"
    long_file.write_text("x = 1\n" * 501)
    long_function = tmp_path / "function.py"
    long_function.write_text("def f():\n" + "    x = 1\n" * 80 + "\n\nasync def g():\n    pass\n")
    private = tmp_path / "private.py"
    private.write_text("from a.b import public, _hidden\nfrom . import __version__\nfrom .c import _d as e\n")
    clean = tmp_path / "clean.py"
    clean.write_text("from a import b\n\n\ndef f():\n" + "    x = 1\n" * 79)
    files = [long_file, long_function, private, clean]
    assert long_files(files) == [f"{long_file}: 501 lines"]
    assert long_functions(files) == [f"{long_function}:1 f: 81 lines"]
    assert private_imports(files) == [f"{private}:1 imports _hidden from a.b", f"{private}:3 imports _d from .c"]
