"""Loads the tokenizer of a local checkpoint: an HF folder's files, or the fast tokenizer transformers
builds from a GGUF file's vocabulary (core.runtime.models.hub.find_gguf tells which).

Building it from a GGUF file costs 1 to 4 CPU seconds (gguf's reader makes a numpy view of every one of
the vocabulary's strings, merges and token types), most of the default model's start-up, so the first
build is saved in transformers' own format under the radixlm cache (core.runtime.cache), keyed by the file's
path, size and modification time and transformers' version, and later loads read that through the
`tokenizers` library alone (core.runtime.tokenizer.light: 0.4 s, where importing transformers would add 1 to 2).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from radixlm.core.runtime.cache import cache_dir
from radixlm.core.runtime.models.hub import find_gguf, resolve_model_path
from radixlm.core.runtime.tokenizer.light import MANIFEST, LightTokenizer, checkpoint_manifest, write_manifest

logger = logging.getLogger("radixlm")

# Part of the cache key: entries saved before the light tokenizer's manifest existed are built again.
_CACHE_FORMAT = 2


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the checkpoint folder or GGUF file at path (a warning when it is not a fast one)."""
    gguf_path = find_gguf(path)
    if gguf_path is not None:
        tok = load_gguf_tokenizer(gguf_path)
    else:
        from transformers import AutoTokenizer  # its import alone is about a CPU second: not for GGUF

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not getattr(tok, "is_fast", False):
        logger.warning("tokenizer at %s is not a fast tokenizer; detokenization will be slower", path)
    return tok


def load_gguf_tokenizer(path: str) -> Any:
    """The fast tokenizer transformers builds from the file's vocabulary, merges, special token ids
    and chat template (PreTrainedTokenizerFast directly: AutoTokenizer would first rebuild the whole
    model config through gguf's slow reader). Built once and saved in the cache, whence later loads
    read it without transformers (core.runtime.tokenizer.light), or with it where the light tokenizer cannot
    stand in for it."""
    path = os.path.abspath(path)
    cached = _cache_entry(path)
    if cached.is_dir():
        try:
            if (cached / MANIFEST).is_file():
                return LightTokenizer(str(cached))
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(cached))
        except (OSError, ValueError, KeyError) as e:  # a damaged entry: build again, and replace it
            logger.warning("ignoring the cached tokenizer %s: %s", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import PreTrainedTokenizerFast

    directory, name = os.path.split(path)
    tok = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
    _save(tok, cached)
    if (cached / MANIFEST).is_file():  # the same kind of tokenizer as every later start gets
        return LightTokenizer(str(cached))
    return tok


def _cache_entry(gguf_path: str) -> Path:
    """Where the tokenizer built from the GGUF file is saved."""
    stat = os.stat(gguf_path)
    # transformers' version by its metadata: importing it is what the cache saves
    key = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{version('transformers')}\0{_CACHE_FORMAT}"
    return cache_dir() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_light_tokenizer(path: str) -> LightTokenizer:
    """The tokenizer of a checkpoint folder, GGUF file or hub id, read by the `tokenizers` library alone:
    never imports transformers (nor torch), for processes that only encode and render chat templates
    (the router). A GGUF file's is the one the first engine start on this machine saved in the cache;
    a folder's (or a hub snapshot's) is its tokenizer.json with its tokenizer_config.json
    (light.checkpoint_manifest). ValueError (or ModelNotFoundError) where there is none to read."""
    path = resolve_model_path(path)
    gguf_path = find_gguf(path)
    if gguf_path is None:
        return LightTokenizer(path, checkpoint_manifest(path), transformers_ok=False)
    cached = _cache_entry(os.path.abspath(gguf_path))
    if not (cached / MANIFEST).is_file():
        raise ValueError(f"no tokenizer of {gguf_path} in the cache {cached.parent} (it is saved there when "
                         f"`radixlm serve` first loads the file on this machine), and building it needs "
                         f"transformers; pass an HF checkpoint folder or hub id of the same tokenizer")
    return LightTokenizer(str(cached), transformers_ok=False)


def _save(tok: Any, target: Any) -> None:
    """Saves tok into the directory `target`, which appears whole (built beside it, then renamed) or not at
    all; a cache that cannot be written (read-only home, full disk) costs the next start time, no more."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            tok.save_pretrained(tmp)
            write_manifest(tok, tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # left only when the rename failed
    except OSError as e:
        logger.debug("could not cache the tokenizer in %s: %s", target, e)
