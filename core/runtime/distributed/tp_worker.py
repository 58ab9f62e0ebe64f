"""Tensor-parallel ranks: launching them, and keeping every rank in step with rank 0.

Rank 0 lives in the Engine's process and runs the only scheduler, radix tree and slot allocator, so the
paper's "identical tree operations on every rank" hold by construction: every rank executes rank 0's
decisions. Before each forward, rank 0 broadcasts over a gloo group what the other ranks need to run
the same step: the request-to-token table writes the scheduler made since the previous step, and the
BatchInput. Both are plain data. Every rank then runs the identical forward on its shard of the model
and of the KV pool (the same slot numbers, its own KV heads); the model's collectives (NCCL on CUDA,
gloo on CPU) leave the full logits on every rank, and rank 0 samples. No other synchronization exists.

Launch. On one machine the Engine spawns ranks 1..tp-1 itself (torch.multiprocessing, rendezvous
through a TCPStore on a free port). Under torchrun (RANK and WORLD_SIZE set, e.g. across machines)
every process already is a rank: rank 0 builds the Engine (or runs `radixlm serve`), the others call
`run_launched_rank`, which `radixlm serve` does for them. Across machines without torchrun (SGLang's
nnodes / node_rank / dist_init_addr), machine 0's Engine listens at dist_init_addr and spawns its own
ranks; every other machine runs `run_node`, which starts its share of the ranks, and they all meet there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixlm.core.runtime.launcher import launched_rank  # noqa: F401  (part of this module's API)
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.scheduler import Scheduler
from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.hub import locate_model
from radixlm.core.runtime.models.parallel import TensorParallel

logger = logging.getLogger("radixlm")

# Ranks 1.. wait on rank 0's next broadcast for as long as the engine sits idle.
_IDLE_TIMEOUT = timedelta(days=365)
# How long rank 0 waits for the spawned ranks to start (importing torch on a busy machine is slow).
_START_TIMEOUT_S = 300.0


def rank_device(device: str, index: int) -> str:
    """The device of rank (or data-parallel worker) `index`: cuda -> cuda:index, counted from an explicit
    index (cuda:2 -> cuda:2+index); a CPU device is shared."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + index}"


def device_scope(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Makes a CUDA device the calling thread's current one for a while (Triton launches its kernels on
    the current device, which every new thread starts at cuda:0); nothing for a CPU device."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ---- rank 0 (the Engine's process) -------------------------------------------------------------


def start_tensor_parallel(model_path: str, cfg: ModelConfig, opts: EngineOptions, tokenizer: Any,
                          eos_token_ids: list[int]) -> "TensorParallelScheduler":
    """Starts (or, under torchrun, joins) the other ranks and returns rank 0's scheduler."""
    size = opts.tp_size
    TensorParallel(0, size, cfg)  # checks the model splits tp ways before anything starts
    if dist.is_initialized():
        raise InvalidRequestError("this process already belongs to a torch.distributed group; a tensor-parallel "
                                  "engine needs its own (one per process)", "tp_size")
    procs: list[Any] = []
    if launched_rank() is None:
        # One machine: a store on a free loopback port. Several (nnodes): machine 0 listens at
        # dist_init_addr, where the other machines' ranks connect (run_node).
        host, port = ("127.0.0.1", 0) if opts.nnodes == 1 else _host_port(opts.dist_init_addr)
        store = dist.TCPStore(host, port, size, True, wait_for_workers=False,
                              timeout=timedelta(seconds=_START_TIMEOUT_S))
        procs = _spawn_ranks(range(1, size // opts.nnodes), size, host, store.port, model_path, opts)
        init: dict[str, Any] = {"store": store}
    else:
        if launched_rank() != 0 or int(os.environ["WORLD_SIZE"]) != size:
            raise InvalidRequestError(f"under torchrun, tp_size ({size}) must equal WORLD_SIZE "
                                      f"({os.environ['WORLD_SIZE']}) and the Engine must be built on rank 0", "tp_size")
        init = {"init_method": "env://"}
    try:
        if procs:
            _wait_until_started(init["store"], procs)
        tp, rank_opts = _join_group(0, size, cfg, opts, **init)
        with device_scope(rank_opts.device):
            runner = ModelRunner(model_path, tp.local_config(), rank_opts, tp)
    except BaseException:
        if dist.is_initialized():  # closing our end lets the ranks waiting on us fail and exit
            dist.destroy_process_group()
        _stop(procs, wait_s=0)  # they may be blocked on rank 0 for good: no use waiting
        raise
    logger.info("tensor parallel: %d ranks (%s)", size, dist.get_backend())
    return TensorParallelScheduler(_Rank0Runner(runner, tp, procs), rank_opts, tokenizer, eos_token_ids)


class TensorParallelScheduler(Scheduler):
    """Rank 0's scheduler. When its loop ends (Engine.shutdown) the other ranks stop too."""

    def run_forever(self) -> None:
        try:
            with device_scope(self.runner.device):
                super().run_forever()
        finally:
            self.runner.close()


class _RecordingTable:
    """Rank 0's request-to-token table: every write also goes into the log sent with the next step."""

    def __init__(self, table: Any) -> None:
        self._table = table
        self.log: list[tuple[int, int, list[int]]] = []

    def write(self, row: int, start: int, slots: list[int]) -> None:
        self._table.write(row, start, slots)
        if slots:
            self.log.append((row, start, list(slots)))  # a copy: the caller's list keeps growing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)


class _Rank0Runner:
    """Rank 0's model runner as the scheduler sees it: each forward first sends the step to the other
    ranks. Everything else is the local ModelRunner's."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel, procs: list[Any]) -> None:
        self._runner = runner
        self._tp = tp
        self._procs = procs
        self.req_to_token = _RecordingTable(runner.req_to_token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward(self, batch: BatchInput) -> torch.Tensor:
        writes, self.req_to_token.log = self.req_to_token.log, []
        dist.broadcast_object_list([(writes, batch)], src=0, group=self._tp.cpu_group)
        return self._runner.forward(batch)

    def close(self) -> None:
        try:
            dist.broadcast_object_list([None], src=0, group=self._tp.cpu_group)
        except Exception:  # a rank already gone: nothing to tell it
            logger.warning("could not tell the tensor-parallel ranks to stop", exc_info=True)
        # Our end of the group goes first: tearing an NCCL communicator down may wait on the peers doing
        # the same, so waiting for the ranks to exit before it could stall until _stop terminates them.
        dist.destroy_process_group()
        _stop(self._procs)


def _wait_until_started(store: Any, procs: list[Any]) -> None:
    """Waits for each spawned rank's sign of life, failing early (not at the timeout) if one dies."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    for rank, p in enumerate(procs, start=1):
        while not store.check([f"radixlm-rank{rank}"]):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.exitcode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank {rank} did not start in {_START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)


def _stop(procs: list[Any], wait_s: float = 30) -> None:
    """Waits up to wait_s for each rank process to exit, then terminates it."""
    for p in procs:
        p.join(timeout=wait_s)
        if p.is_alive():
            if wait_s:
                logger.warning("tensor-parallel process %s did not exit; terminating it", p.name)
            p.terminate()
            p.join(timeout=5)


# ---- every rank ----------------------------------------------------------------------------------


def _join_group(rank: int, size: int, cfg: ModelConfig, opts: EngineOptions,
                **init: Any) -> tuple[TensorParallel, EngineOptions]:
    """Joins the process group: NCCL on CUDA (one GPU per rank), gloo on CPU; plus a gloo group for the
    per-step broadcast, which waits as long as the engine is idle."""
    local_rank = int(os.environ.get("LOCAL_RANK", _local_rank(rank, size, opts)))
    rank_opts = dataclasses.replace(opts, device=rank_device(opts.device, local_rank))
    backend = "nccl" if torch.device(rank_opts.device).type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=size, **init)
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank, size, cfg, group=None, cpu_group=cpu_group), rank_opts


def _follow_rank0(rank: int, size: int, model_path: str, opts: EngineOptions, **init: Any) -> None:
    """Ranks 1..: load this rank's shard, then run every step rank 0 broadcasts until it says stop."""
    cfg = ModelConfig.from_dir(model_path)
    tp, rank_opts = _join_group(rank, size, cfg, opts, **init)
    try:
        with device_scope(rank_opts.device):
            runner = ModelRunner(model_path, tp.local_config(), rank_opts, tp)
            while True:
                msg: list[Any] = [None]
                dist.broadcast_object_list(msg, src=0, group=tp.cpu_group)
                if msg[0] is None:
                    break
                writes, batch = msg[0]
                for row, start, slots in writes:
                    runner.req_to_token.write(row, start, slots)
                runner.forward(batch)
    finally:
        dist.destroy_process_group()


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")  # checked by EngineOptions
    return host.strip("[]"), int(port)


def _local_rank(rank: int, size: int, opts: EngineOptions) -> int:
    """The rank's index on its machine (its GPU): ranks fill machines in order, tp_size / nnodes each."""
    return rank % (size // opts.nnodes)


def _spawn_ranks(ranks: range, size: int, host: str, port: int, model_path: str, opts: EngineOptions) -> list[Any]:
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=_spawned_rank_main, args=(r, size, host, port, model_path, opts),
                        name=f"radixlm-tp{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def _spawned_rank_main(rank: int, size: int, host: str, port: int, model_path: str, opts: EngineOptions) -> None:
    _share_cores(size // opts.nnodes, opts)
    store = dist.TCPStore(host, port, size, False, timeout=timedelta(seconds=_START_TIMEOUT_S))
    store.set(f"radixlm-rank{rank}", "started")
    _follow_rank0(rank, size, model_path, opts, store=store)


def _share_cores(local_ranks: int, opts: EngineOptions) -> None:
    if torch.device(opts.device).type == "cpu":  # the machine's ranks share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def run_node(model_path: str | None = None, **options: Any) -> None:
    """The body of machines 1.. of a multi-machine tensor-parallel engine (nnodes > 1, node_rank > 0,
    SGLang's flags): runs this machine's tp_size / nnodes ranks (the first in this process, the others
    spawned), which join machine 0 at dist_init_addr and follow its engine until it shuts down."""
    opts = EngineOptions.from_kwargs(options)
    if opts.nnodes == 1 or opts.node_rank == 0:
        raise InvalidRequestError("run_node is for machines 1.. of nnodes > 1 (machine 0 builds the Engine)",
                                  "node_rank")
    model_path, _ = locate_model(model_path)
    size, local = opts.tp_size, opts.tp_size // opts.nnodes
    first = opts.node_rank * local
    host, port = _host_port(opts.dist_init_addr)
    procs = _spawn_ranks(range(first + 1, first + local), size, host, port, model_path, opts)
    try:
        _share_cores(local, opts)
        store = dist.TCPStore(host, port, size, False, timeout=timedelta(seconds=_START_TIMEOUT_S))
        _follow_rank0(first, size, model_path, opts, store=store)
    finally:
        _stop(procs)


def run_launched_rank(model_path: str | None = None, **options: Any) -> None:
    """The body of every process but rank 0 under torchrun: loads this rank's shard and follows rank 0's
    engine until it shuts down. Takes the same model path and options as rank 0's Engine."""
    rank = launched_rank()
    if rank is None or rank == 0:
        raise RuntimeError("run_launched_rank is for ranks 1.. of a torchrun launch (RANK, WORLD_SIZE)")
    opts = EngineOptions.from_kwargs(options)
    size = int(os.environ["WORLD_SIZE"])
    if opts.tp_size != size:
        raise InvalidRequestError(f"tp_size ({opts.tp_size}) must equal WORLD_SIZE ({size})", "tp_size")
    model_path, _ = locate_model(model_path)
    _follow_rank0(rank, size, model_path, opts, init_method="env://")
