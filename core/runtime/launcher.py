"""What a process launcher (torchrun) told this process, read without importing torch."""

from __future__ import annotations

import os


def launched_rank() -> int | None:
    """This process's rank when a launcher such as torchrun started several processes, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None
