"""Linear layers on prepacked weights for CPU runs (kernels.cpu.prepack_linear_weight).

After loading, `prepack_linears` replaces each plain linear layer of a model (every projection and the
LM head) by a `PrepackedLinear` holding its weight in oneDNN's blocked layout; the plain weight is
dropped, except where another module shares it (the embedding of a tied LM head keeps its own).
A layer whose weight cannot be packed (no oneDNN, a dtype it lacks on this CPU) stays as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.kernels import cpu


class PrepackedLinear(nn.Module):
    """nn.Linear's forward on a prepacked weight (`weight`: opaque, the plain weight's shape and dtype)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu.prepacked_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, batch_hint: int = 16) -> int:
    """Swaps every module that runs nn.Linear's own forward (subclasses with another forward, such as
    tensor parallelism's row-parallel layers, are left alone) for a PrepackedLinear; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or type(child).forward is not nn.Linear.forward:
                continue
            packed = cpu.prepack_linear_weight(child.weight, batch_hint)
            if packed is None:
                continue
            setattr(parent, name, PrepackedLinear(packed, child.bias))
            swapped += 1
    return swapped
