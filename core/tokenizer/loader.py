"""Loads the tokenizer of a local checkpoint: an HF folder's files, or the fast tokenizer transformers
builds from a GGUF file's vocabulary (core.models.hub.find_gguf tells which)."""

from __future__ import annotations

import logging
import os
from typing import Any

from radixlm.core.models.hub import find_gguf

logger = logging.getLogger("radixlm")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the checkpoint folder or GGUF file at path (a warning when it is not a fast one)."""
    from transformers import AutoTokenizer

    gguf_path = find_gguf(path)
    if gguf_path is not None:
        tok = load_gguf_tokenizer(gguf_path)
    else:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not getattr(tok, "is_fast", False):
        logger.warning("tokenizer at %s is not a fast tokenizer; detokenization will be slower", path)
    return tok


def load_gguf_tokenizer(path: str) -> Any:
    """The fast tokenizer transformers builds from the file's vocabulary, merges, special token ids
    and chat template (PreTrainedTokenizerFast directly: AutoTokenizer would first rebuild the whole
    model config through gguf's slow reader)."""
    from transformers import PreTrainedTokenizerFast

    directory, name = os.path.split(os.path.abspath(path))
    return PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
