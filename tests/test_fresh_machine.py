"""A checkout must not hide installed packages: Python started from the repository root puts the root first
on sys.path, where our top-level folders sit beside same-named distributions on PyPI (Hugging Face's
`kernels`, which transformers imports; AdapterHub's `adapters`; ...). The folders are namespace portions
(no __init__.py), so a regular installed package of the same name wins (docs/layers.md). Each check runs
in a subprocess from the root, as `python -m pytest`, `python -m radixlm.server` and scripts do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from radixlm.testing.servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def run_from_root(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def importable_top_level_names() -> list[str]:
    names = [p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier() and not p.name.startswith("__")]
    return sorted(names)


def test_the_root_holds_no_module_file_and_no_package_marker():
    # A module file (cli.py) or a folder with __init__.py at the root would answer `import <name>` before
    # any installed distribution of that name.
    modules = [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    regular = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert modules == [] and regular == []


def test_installed_packages_win_over_every_top_level_folder(tmp_path):
    names = importable_top_level_names()
    assert {"core", "kernels", "server", "adapters", "tests"} <= set(names)
    for name in names:  # a stand-in for an installed distribution of the same name
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("INSTALLED = True\n")
    out = run_from_root("-c", "import importlib, json, sys; "
                        f"print(json.dumps({{n: getattr(importlib.import_module(n), 'INSTALLED', False) for n in {names!r}}})); "
                        "import radixlm.kernels.registry, radixlm.server.args",
                        env={"PYTHONPATH": str(tmp_path)})
    assert json.loads(out) == {name: True for name in names}


def test_transformers_from_the_root_imports_hugging_faces_kernels():
    # transformers imports `kernels` whenever it is installed (a dev dependency here, so the case is real).
    out = run_from_root("-c", "from transformers import LlamaForCausalLM; import kernels; print(kernels.__file__)")
    path = Path(out.strip())
    assert path.name == "__init__.py" and path.parent.parent.name in ("site-packages", "dist-packages"), path


def test_pytest_from_the_root_runs_a_transformers_oracle_test(tmp_path):
    test = "tests/test_tiny_checkpoint.py::test_checkpoint_loads_in_transformers_and_greedy_depends_on_prompt"
    out = run_from_root("-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", test,
                        env={"RADIXLM_CACHE": str(tmp_path)})  # exit status 0 asserted there
    assert re.search(r"\b[1-9]\d* passed", out), out


@pytest.fixture
def root_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_server_module_from_the_root_serves_a_checkpoint(root_cwd, llama_ckpt):
    server = ServerProcess("--model-path", llama_ckpt, "--device", "cpu")
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as reply:
            assert reply.status == 200
    finally:
        assert server.signal() == 0


def test_an_hf_checkpoint_serves_without_the_gguf_package(llama_ckpt):
    # The GPU image has no `gguf`: it may be imported only where a GGUF file is loaded.
    code = ("import sys, importlib.abc\n"
            "class NoGGUF(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'gguf':\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoGGUF())\n"
            "import radixlm\n"
            f"with radixlm.Engine(model_path={llama_ckpt!r}, device='cpu') as engine:\n"
            "    out = engine.generate('Hello', {'max_new_tokens': 4, 'temperature': 0})\n"
            "print(out['meta_info']['completion_tokens'])\n")
    assert run_from_root("-c", code).strip().splitlines()[-1] == "4"
