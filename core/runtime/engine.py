"""`radixlm.Engine`: the request front end (core.runtime.frontend) composed with the scheduler loop,
on a thread or in its own process (core.runtime.scheduler_client), with the shape of SGLang's offline
engine."""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterator

from radixlm.core.runtime.constraint_compiler import ConstraintCompiler
from radixlm.core.runtime.frontend import FrontEnd, Output
from radixlm.core.runtime.gc_heap import freeze_heap, unfreeze_heap
from radixlm.core.runtime.images import ImagePreparer
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.scheduler import Scheduler
from radixlm.core.runtime.scheduler_client import LocalScheduler, SchedulerProcess, eos_token_ids_of
from radixlm.core.errors import EngineShutdownError, InvalidRequestError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.hub import locate_model
from radixlm.core.runtime.tokenizer.loader import load_tokenizer

logger = logging.getLogger("radixlm")


class Engine:
    """An in-process inference engine.

    >>> with Engine() as engine:  # no model path: the embedded default model (SmolLM2-135M-Instruct)
    ...     out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    """

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        start = time.perf_counter()
        self.options = EngineOptions.from_kwargs(options)
        _configure_logging(self.options.log_level)
        model_path, default_name = locate_model(model_path)
        self.model_path = model_path
        self.served_model_name = self.options.served_model_name or default_name
        self.model_config = ModelConfig.from_dir(model_path)
        self.vocab_size = self.model_config.vocab_size
        self.context_len = self.model_config.context_len
        if self.options.context_length is not None:
            if self.options.context_length > self.context_len:
                raise InvalidRequestError(f"context_length {self.options.context_length} exceeds the model's "
                                          f"{self.context_len} tokens", "context_length")
            self.context_len = self.options.context_length
        self._frontend: FrontEnd | None = None
        process = SchedulerProcess(model_path, self.options) if self.options.scheduler_process else None
        try:
            # The tokenizer loads on a thread while the weights load: it is mostly imports, which hold the
            # GIL, and they mostly dequantize and copy, which release it; on two cores the two overlap.
            with ThreadPoolExecutor(1, thread_name_prefix="radixlm-tokenizer") as pool:
                tokenizer = pool.submit(_timed, load_tokenizer, self.options.tokenizer_path or model_path,
                                        trust_remote_code=self.options.trust_remote_code)
                if process is None and self.options.tp_size == 1 and self.options.dp_size == 1:
                    self._runner = ModelRunner(model_path, self.model_config, self.options)
                self.tokenizer, tokenizer_seconds = tokenizer.result()
            if self.options.chat_template is not None:
                self.tokenizer.chat_template = _chat_template_text(self.options.chat_template)
            self.eos_token_ids = eos_token_ids_of(self.model_config, self.tokenizer)
            if process is not None:
                self.kv_pool_size = process.wait_ready()
            scheduler: Any = process
        except BaseException:
            if process is not None:  # no child left behind when the engine does not start
                process.stop(timeout=5)
            raise
        if process is None and (self.options.tp_size > 1 or self.options.dp_size > 1):
            # Tensor-parallel ranks or data-parallel workers behind the same inbox (docs/scale_out.md).
            from radixlm.core.runtime.distributed.dp_router import build_scheduler

            loop, self.kv_pool_size = build_scheduler(model_path, self.model_config, self.options,
                                                      self.tokenizer, self.eos_token_ids)
            scheduler = LocalScheduler(loop)
        constraints = None
        if process is None and self.options.tp_size == 1 and self.options.dp_size == 1:
            # One compiler for the front end and the loop on its thread: documents registered and grammar
            # tables prepared once, and the loop's build of a spec the front end checked is a cache hit.
            constraints = ConstraintCompiler(self.tokenizer, self.eos_token_ids, self.options)
            scheduler = LocalScheduler(Scheduler(self._runner, self.options, self.tokenizer, self.eos_token_ids,
                                                 constraints))
            self.kv_pool_size = self._runner.num_slots
        # What one request may use in all: the model's context, or less when the KV pool holds less, so
        # that nothing is admitted that could never finish (also /v1/models' max_model_len).
        self.context_len = min(self.context_len, self.kv_pool_size)
        images = None
        if self.model_config.vision is not None:
            images = ImagePreparer(model_path, self.model_config.vision, self.vocab_size,
                                   self.options.max_image_bytes, self.options.max_image_pixels,
                                   self.options.max_video_frames)
        self._frontend = FrontEnd(self.tokenizer, self.options, self.vocab_size, self.context_len,
                                  self.eos_token_ids, scheduler, images, constraints)
        self.max_prompt_bytes = self._frontend.builder.max_prompt_bytes
        if self.options.gc_freeze:  # the heap that lives as long as the engine, out of the collector's way
            freeze_heap()
        # Wall seconds of the constructor and its stages (the tokenizer's overlap the weights'), for
        # `python benchmarks/bench_cpu.py --startup` and the log.
        runner = getattr(self, "_runner", None)
        self.startup_seconds = {"tokenizer (on a thread)": tokenizer_seconds,
                                **(runner.load_seconds if runner is not None else {}),
                                "total": time.perf_counter() - start}
        logger.info("engine ready: %s on %s (%s); context %d tokens (model %d, KV pool %d)%s; started in %s",
                    self.served_model_name, self.options.device, self.options.dtype, self.context_len,
                    self.model_config.context_len, self.kv_pool_size,
                    "; scheduler in its own process" if process is not None else "",
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_seconds.items()))

    @property
    def frontend(self) -> FrontEnd:
        """The request front end (its parts: core.runtime.frontend). Callers use the Engine's methods."""
        return self._frontend

    @property
    def images(self) -> ImagePreparer | None:
        """A vision-language model's image preparation (its placeholders, positions per image), else None."""
        return self._open().builder.images

    # ---- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        frontend, self._frontend = self._frontend, None
        if frontend is None:
            return
        frontend.close()
        if self.options.gc_freeze:
            unfreeze_heap()
        runner = getattr(self, "_runner", None)
        if runner is not None and not frontend.scheduler.alive():
            runner.release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- generation (SGLang's Engine API; outputs are dicts of its shape) -----------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        video_data: Any = None,
        timeout: float | None = None,
    ) -> Output | list[Output] | Iterator[Output]:
        return self._open().generate(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                     top_logprobs_num, stream, rid, image_data, video_data, timeout)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        video_data: Any = None,
        timeout: float | None = None,
    ) -> Output | list[Output] | AsyncIterator[Output]:
        return await self._open().async_generate(prompt, sampling_params, input_ids, return_logprob,
                                                 logprob_start_len, top_logprobs_num, stream, rid, image_data,
                                                 video_data, timeout)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Aborts the request `rid` (with all its n > 1 samples; nothing when it has finished), or with
        `abort_all` every request in flight. Aborted requests end with finish reason "abort"."""
        if self._frontend is None:
            return
        if abort_all:
            self._frontend.abort_all()
        else:
            self._frontend.abort_request(rid)

    def alive(self) -> bool:
        """Whether the engine takes requests: started, not shut down, and its scheduler loop running
        (False once that loop died or its process was killed)."""
        return self._frontend is not None and self._frontend.alive()

    def fail_in_flight(self) -> None:
        """Once the scheduler has died: fails every request still waiting on it (nothing otherwise)."""
        if self._frontend is not None:
            self._frontend.fail_in_flight()

    # ---- cache, stats, checks ------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drops every cached prefix. Returns False (and drops nothing) while requests are in flight."""
        return self._open().flush_cache()

    def get_stats(self) -> dict[str, Any]:
        """Exact statistics, read between two scheduler steps (waits for the current step)."""
        frontend = self._open()
        stats = frontend.get_stats()
        stats["in_flight"] = frontend.in_flight
        return stats

    def stats_snapshot(self) -> dict[str, Any]:
        """The statistics the scheduler loop published after its latest iteration; never waits for it
        (what /metrics and /get_server_info read, so that they answer while a step runs long)."""
        frontend = self._open()
        published = frontend.scheduler.snapshot
        if not published:  # the loop has not published yet (just started)
            return self.get_stats()
        stats = dict(published)
        stats["in_flight"] = frontend.in_flight
        return stats

    def stalled_for(self) -> float:
        """Seconds the scheduler loop has gone without progress while requests are in flight (0 when it
        is idle or keeping up). /health answers 503 past `stall_timeout`."""
        frontend = self._open()
        if frontend.in_flight == 0:
            return 0.0
        return max(0.0, time.monotonic() - frontend.scheduler.last_progress)

    def check_invariants(self) -> None:
        """Debug check: every KV slot is exactly one of free, cached-evictable, cached-locked, owned."""
        self._open().check_invariants()

    # ---- request preparation, for callers that prepare their own (server, backends, adapters) -------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a prompt's text (with the tokenizer's BOS where add_special_tokens)."""
        return self._open().builder.encode(text, add_special_tokens)

    def encode_prompt(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """`encode` after the size check: a prompt the context cannot hold is refused untokenized."""
        return self._open().builder.encode_prompt(text, param, add_special_tokens)

    async def offload(self, fn: Any, *args: Any) -> Any:
        """Runs `fn(*args)` (tokenizing, templating) on the engine's worker threads under the
        `prepare_timeout` budget, so that an event loop keeps serving meanwhile."""
        return await self._open().workers.offload(fn, *args)

    def check_prompt_size(self, size_bytes: int, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a prompt of more UTF-8 bytes than the context can hold as tokens."""
        self._open().builder.check_prompt_size(size_bytes, param)

    def check_fan_out(self, count: int) -> None:
        """Refuses a call that would make more engine requests (prompts x n) than max_requests_per_call."""
        self._open().builder.check_fan_out(count)

    def _open(self) -> FrontEnd:
        if self._frontend is None:
            raise EngineShutdownError("the engine has been shut down")
        return self._frontend


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(fn's result, its wall seconds)."""
    start = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - start


def _chat_template_text(template: str) -> str:
    """--chat-template is a file holding a Jinja template, or the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise InvalidRequestError(f"chat_template {template!r} is neither a file nor a Jinja template", "chat_template")


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes (a test runner swaps it, and closes the one it
    swapped in), not as it was when the first engine started."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def _configure_logging(level: str) -> None:
    root = logging.getLogger("radixlm")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s radixlm %(levelname)s %(message)s"))
        root.addHandler(handler)
