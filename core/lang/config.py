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
    # A fork sends the state's text once (a prefill-only request) before its branches start.
    # Together with the switch above, these are the frontend's prefix hints; off only for ablations.
    enable_fork_precache: bool = True


global_config = GlobalConfig()
