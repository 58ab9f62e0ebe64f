"""The frontend's one piece of global state (SGLang's `sgl.global_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    # Where programs run when neither run(backend=...) nor the program says otherwise.
    default_backend: Any = None
    # run_batch sends the batch's common prefix (found by tracing) once before running the batch.
    enable_precache_with_tracing: bool = True


global_config = GlobalConfig()
