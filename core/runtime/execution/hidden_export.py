"""Which hidden states a model runner's steps export to its `hidden_sink` (an EAGLE proposer's input): the
final ones (EAGLE-1/2, and an EAGLE head's own outputs) or the residual stream entering some layers,
concatenated (EAGLE-3). The one owner of that choice: the eager path hands these states to the sink, and
the decode CUDA graphs copy the same states into a static buffer that the sink reads after a replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.runtime.models.eagle import eagle3_aux_layers
from radixlm.core.runtime.options import EngineOptions


@dataclass(frozen=True)
class HiddenExport:
    """`aux_layers`: the layers whose input is exported ((): the final hidden states)."""

    aux_layers: tuple[int, ...] = ()

    def width(self, hidden_size: int) -> int:
        """Columns of an exported row."""
        return hidden_size * max(1, len(self.aux_layers))

    def prepare(self, model: Any) -> None:
        """Makes the model keep the aux layers' inputs of each forward (in model.aux_hidden)."""
        if self.aux_layers:
            model.aux_layers = self.aux_layers

    def of(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        """The exported states [tokens, width] of the forward that returned `hidden`."""
        return model.aux_hidden if self.aux_layers else hidden


def target_export(opts: EngineOptions, num_layers: int) -> HiddenExport | None:
    """What a target model's steps export for the speculative proposer the options ask for (None: nothing,
    and no cost)."""
    if opts.speculative_algorithm == "eagle":
        return HiddenExport()
    if opts.speculative_algorithm == "eagle3":
        return HiddenExport(eagle3_aux_layers(num_layers))
    return None
