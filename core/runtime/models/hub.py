"""Model paths as SGLang and vLLM users give them: a local folder or `.gguf` file, or a Hugging Face
hub id (`org/name`, or `org/name/file.gguf` for one file of a GGUF repository) resolved through
`huggingface_hub`: the local cache first, a download only where the network is allowed."""

from __future__ import annotations

import os

from radixlm.core.errors import ModelNotFoundError

# What an HF-format checkpoint needs; a repository's other files (pytorch_model.bin, onnx, original/,
# gguf variants) are not downloaded.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def locate_model(model_path: str | None) -> tuple[str, str]:
    """(local path, the name it is served under by default) for what the user gave: nothing (the
    embedded default model), a local path or a hub id."""
    if model_path is None:
        from radixlm.core.runtime.models.default_model import DEFAULT_MODEL_NAME, default_model_path

        return default_model_path(), DEFAULT_MODEL_NAME
    name = model_path.rstrip("/").split("/")[-1].removesuffix(".gguf")
    return resolve_model_path(model_path), name


def resolve_model_path(path_or_id: str, revision: str | None = None) -> str:
    """A local path for `path_or_id`: itself when it exists here, else the hub snapshot of that id.
    Raises ModelNotFoundError with one line saying what was tried and how to fix it."""
    expanded = os.path.expanduser(path_or_id)
    if os.path.exists(expanded):
        return expanded
    if not _looks_like_hub_id(path_or_id):
        raise ModelNotFoundError(f"model path {path_or_id!r} does not exist")
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    parts = path_or_id.split("/")
    repo_id, filename = ("/".join(parts[:2]), "/".join(parts[2:])) if len(parts) > 2 else (path_or_id, None)

    def fetch(local_only: bool) -> str:
        if filename is not None:
            return hf_hub_download(repo_id, filename, revision=revision, local_files_only=local_only)
        return snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS,
                                 local_files_only=local_only)

    try:
        return fetch(local_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    except HFValidationError as exc:
        raise ModelNotFoundError(f"model path {path_or_id!r} is neither a local path nor a hub id ({exc})") from None
    where = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {path_or_id!r} is not a local path and {where}, and HF_HUB_OFFLINE is set: download "
            f"it once with network access or pass a local path"
        )
    try:
        return fetch(local_only=False)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model {path_or_id!r} is not a local path, {where}, and could not be downloaded ({reason})"
        ) from None


def find_gguf(path: str) -> str | None:
    """The GGUF file that `path` names: path itself if it is a .gguf file, else the one .gguf in the
    folder `path` when the folder is not an HF checkpoint (no config.json); None if it is not a GGUF
    checkpoint. A folder with several .gguf files is ambiguous: ValueError naming them."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(files)}); pass the path of the one to load")
    return os.path.join(path, files[0]) if files else None


def _looks_like_hub_id(text: str) -> bool:
    """`org/name`, `name` or `org/name/file`: no leading slash, dot or tilde, no empty parts."""
    if text.startswith(("/", ".", "~")) or "\\" in text:
        return False
    return all(text.split("/"))
