"""radixlm.kernels: Triton kernels, each with a pure-torch reference twin (kernels.reference).

`get_ops(device)` returns the kernel set for a device; every set has the same function names and
signatures, so the engine never asks which one it holds.
"""

from __future__ import annotations

from types import ModuleType

import torch

from radixlm.kernels import reference


def get_ops(device: torch.device | str) -> ModuleType:
    return reference
