"""Where radixlm keeps what it builds once and reuses (token indexes, tokenizers built from GGUF files,
the tiny test model): $RADIXLM_CACHE, else ~/.cache/radixlm."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$RADIXLM_CACHE, else ~/.cache/radixlm."""
    return Path(os.environ.get("RADIXLM_CACHE") or Path.home() / ".cache" / "radixlm")
