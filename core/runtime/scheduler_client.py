"""Where the scheduler loop runs: on a thread of this process (`LocalScheduler`), or in a process of
its own (`SchedulerProcess`, the `scheduler_process` option). Either way the front end only puts
messages (core.runtime.messages) on `inbox` and reads them from `outbox`."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from typing import Any, Callable, Iterator

from radixlm.core.runtime.gc_heap import freeze_heap
from radixlm.core.runtime.messages import Ready, StatsSnapshot
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.errors import EngineShutdownError
from radixlm.core.runtime.models.config import ModelConfig

logger = logging.getLogger("radixlm")

# How often a scheduler process publishes its statistics (what /metrics and /health read), seconds.
PUBLISH_INTERVAL_S = 0.25


def eos_token_ids_of(cfg: ModelConfig, tokenizer: Any) -> list[int]:
    """The model's end-of-sequence ids and the tokenizer's, in that order."""
    eos = list(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


class LocalScheduler:
    """The scheduler loop (a Scheduler, or the data-parallel router) on a thread of this process."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.inbox, self.outbox = scheduler.inbox, scheduler.outbox
        self._thread = threading.Thread(target=scheduler.run_forever, name="radixlm-scheduler", daemon=True)
        self._thread.start()

    @property
    def snapshot(self) -> dict[str, Any]:
        return self.scheduler.snapshot

    @property
    def last_progress(self) -> float:
        return self.scheduler.last_progress

    def observe(self, msg: StatsSnapshot) -> None:
        """A thread's scheduler publishes through its attributes, never on the outbox."""

    def run_paused(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(scheduler)` on this thread while the loop waits between two iterations: for benchmarks that
        time steps or the forward alone (a scheduler in its own process has no such door)."""
        with self.scheduler.paused():
            return fn(self.scheduler)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30) -> None:
        self.scheduler.stop()
        self._thread.join(timeout=timeout)


class SchedulerProcess:
    """The scheduler loop, the model runner and the radix cache in a child process ("spawn"): the model
    loads there, and the two queues carry only messages. The child exits when its parent does."""

    def __init__(self, model_path: str, opts: EngineOptions) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.snapshot: dict[str, Any] = {}
        self.last_progress = time.monotonic()
        self.kv_pool_size = 0
        # The child computes with as many threads as this process would (the same sums, the same logits).
        import torch

        args = (model_path, opts, self.inbox, self.outbox, os.getpid(), torch.get_num_threads())
        self._proc = ctx.Process(target=_scheduler_main, args=args, name="radixlm-scheduler", daemon=True)
        # OpenMP threads that spin between parallel regions made the child's CPU steps 10-50x slower
        # (measured: attention 3 ms instead of 45 us a call on 2 cores); passive ones sleep. The child
        # takes the environment as it starts, before it imports torch. A user's own setting wins.
        with _environment(OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")):
            self._proc.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def wait_ready(self) -> int:
        """Waits for the child to load the model; returns its KV pool size (tokens)."""
        while True:
            try:
                msg = self.outbox.get(timeout=1.0)
            except Exception:  # queue.Empty
                if not self._proc.is_alive():
                    raise EngineShutdownError(f"the scheduler process exited while starting "
                                              f"(exit code {self._proc.exitcode})") from None
                continue
            if isinstance(msg, Ready):
                if msg.error is not None:
                    self.stop()
                    raise msg.error
                self.kv_pool_size = msg.kv_pool_size
                return msg.kv_pool_size

    def observe(self, msg: StatsSnapshot) -> None:
        self.snapshot, self.last_progress = msg.stats, msg.last_progress

    def alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self, timeout: float = 30) -> None:
        if not self._proc.is_alive():  # killed: exiting must not wait on a queue's pipe it left behind
            self.inbox.cancel_join_thread()
            self.outbox.cancel_join_thread()
            return
        if self._proc.is_alive():
            self.inbox.put(None)
            self._proc.join(timeout=timeout)
        if self._proc.is_alive():
            logger.warning("the scheduler process did not stop in %g s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(timeout=5)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ with `values` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _scheduler_main(model_path: str, opts: EngineOptions, inbox: Any, outbox: Any, parent_pid: int,
                    num_threads: int) -> None:
    """The child process: loads the model and runs the loop on the given queues."""
    import torch

    torch.set_num_threads(num_threads)
    from radixlm.core.runtime.execution.model_runner import ModelRunner
    from radixlm.core.runtime.scheduler import Scheduler
    from radixlm.core.runtime.tokenizer.loader import load_tokenizer

    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="radixlm-parent-watch", daemon=True).start()
    try:
        cfg = ModelConfig.from_dir(model_path)
        tokenizer = load_tokenizer(opts.tokenizer_path or model_path, trust_remote_code=opts.trust_remote_code)
        runner = ModelRunner(model_path, cfg, opts)
        scheduler = Scheduler(runner, opts, tokenizer, eos_token_ids_of(cfg, tokenizer))
        if opts.gc_freeze:
            freeze_heap()
    except BaseException as exc:
        outbox.put(Ready(error=exc))
        return
    scheduler.inbox, scheduler.outbox = inbox, outbox
    scheduler.publish_interval = PUBLISH_INTERVAL_S
    outbox.put(Ready(runner.num_slots))
    scheduler.run_forever()
    runner.release()


def _exit_with_parent(parent_pid: int) -> None:
    """No orphans: when the parent is gone (killed, say) the child goes too."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)
