"""`n` samples of one prompt as n requests of one sample each: their sampling parameters (seeds
seed + i), their ids (`{rid}-{i}`), and the way back from a sample's id to the id the caller gave."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixlm.core.runtime.sampling_params import SamplingParams


def branch_params(sp: SamplingParams) -> list[SamplingParams]:
    """The n samples of one prompt as n requests of n = 1: seeds seed, seed + 1, ... (None stays None)."""
    if sp.n == 1:
        return [sp]
    return [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


def branch_dicts(params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """`branch_params` for sampling params as dicts (what HTTP handlers hold), validated."""
    return [sp.to_dict() for sp in branch_params(SamplingParams.from_dict(params))]


def branch_rid(rid: str, i: int, n: int) -> str:
    """The request id of sample i of n of request `rid`."""
    return rid if n == 1 else f"{rid}-{i}"


def branch_parent(rid: str) -> str | None:
    """The id a caller gave a request with n > 1 (what abort_request takes), for the id of one of its
    samples (`{rid}-{i}`); None for other ids."""
    parent, _, index = rid.rpartition("-")
    return parent if parent and index.isdigit() else None
