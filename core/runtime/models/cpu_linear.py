"""Linear layers on prepacked weights for CPU runs (kernels.cpu.prepack_linear_weight).

After loading, `prepack_linears` replaces each plain linear layer of a model (every projection and the
LM head) by a `PrepackedLinear` holding its weight in oneDNN's blocked layout. Products of at most
`plain_max_rows` rows (a batch-1 decode step) run on the plain weight through F.linear instead, which
is faster there: MKL's matrix-vector product has less set-up per call than oneDNN's packed kernel (about
15% of a batch-1 step at one thread) and stays on one thread, where each packed call opens a parallel
region (which on a loaded machine waits for the other core: up to 10x). So the plain weights are kept
beside the packed ones (twice the linear weights' RAM) unless `plain_max_rows` is 0. A layer whose
weight cannot be packed (no oneDNN, a dtype it lacks on this CPU) stays as it is.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu


class PrepackedLinear(nn.Module):
    """nn.Linear's forward on a prepacked weight (`weight`: opaque, the plain weight's shape and dtype), or
    on the plain weight (`plain`, when kept) for inputs of at most `plain_max_rows` rows."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, plain: torch.Tensor | None = None,
                 plain_max_rows: int = 0) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.plain = None if plain is None or plain_max_rows <= 0 else plain.detach()
        self.plain_max_rows = plain_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.shape[0] <= self.plain_max_rows:
            return F.linear(x, self.plain, self.bias)
        return cpu.prepacked_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, batch_hint: int = 16, plain_max_rows: int = 1,
                    workers: int = 1) -> int:
    """Swaps every module that runs nn.Linear's own forward (subclasses with another forward, such as
    tensor parallelism's row-parallel layers, are left alone) for a PrepackedLinear, which keeps the
    plain weight for products of at most `plain_max_rows` rows (0: drops it); returns how many.
    The weights are packed on `workers` threads of one torch thread each: every packing is a parallel
    region of its own on torch's threads, which waits for all of them (on a busy machine, for a core
    that another process holds), where threads packing separate weights never wait for each other."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and type(child).forward is nn.Linear.forward]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="radixlm-prepack",
                            initializer=torch.set_num_threads, initargs=(1,)) as pool:
        packed = list(pool.map(lambda linear: cpu.prepack_linear_weight(linear[2].weight, batch_hint), linears))
    swapped = 0
    for (parent, name, child), weight in zip(linears, packed):
        if weight is not None:
            setattr(parent, name, PrepackedLinear(weight, child.bias, child.weight, plain_max_rows))
            swapped += 1
    return swapped
