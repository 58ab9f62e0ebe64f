"""`radixlm.Engine`: the request front end. It tokenizes and validates, hands plain messages to the
scheduler thread, and streams results back, with the shape of SGLang's offline engine."""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterator

from radixlm.core.engine.model_runner import ModelRunner
from radixlm.core.engine.options import EngineOptions
from radixlm.core.engine.request import GenerateInput
from radixlm.core.engine.sampling_params import SamplingParams
from radixlm.core.engine.scheduler import AbortMsg, CallMsg, Scheduler
from radixlm.core.errors import (
    EngineShutdownError, GrammarBudgetError, InvalidRequestError, QueueFullError, TooComplexError,
)
from radixlm.core.models.config import ModelConfig
from radixlm.core.models.hub import locate_model
from radixlm.core.tokenizer.loader import load_tokenizer

logger = logging.getLogger("radixlm")

Output = dict[str, Any]


class Engine:
    """An in-process inference engine.

    >>> with Engine() as engine:  # no model path: the embedded default model (SmolLM2-135M-Instruct)
    ...     out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    """

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
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
        # The tokenizer loads on a thread while the weights load: it is mostly imports, which hold the
        # GIL, and they mostly dequantize and copy, which release it; on two cores the two overlap.
        with ThreadPoolExecutor(1, thread_name_prefix="radixlm-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, self.options.tokenizer_path or model_path,
                                    trust_remote_code=self.options.trust_remote_code)
            if self.options.tp_size == 1 and self.options.dp_size == 1:
                self._runner = ModelRunner(model_path, self.model_config, self.options)
            self.tokenizer = tokenizer.result()
        if self.options.chat_template is not None:
            self.tokenizer.chat_template = _chat_template_text(self.options.chat_template)
        eos = list(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        if self.options.tp_size > 1 or self.options.dp_size > 1:
            # Tensor-parallel ranks or data-parallel workers behind the same inbox (docs/scale_out.md).
            from radixlm.core.engine.dp_router import build_scheduler

            self._scheduler, self.kv_pool_size = build_scheduler(model_path, self.model_config, self.options,
                                                                 self.tokenizer, eos)
        else:
            self._scheduler = Scheduler(self._runner, self.options, self.tokenizer, eos)
            self.kv_pool_size = self._runner.num_slots
        # What one request may use in all: the model's context, or less when the KV pool holds less, so
        # that nothing is admitted that could never finish (also /v1/models' max_model_len).
        self.context_len = min(self.context_len, self.kv_pool_size)
        # A prompt longer than this many UTF-8 bytes has more tokens than the context holds whatever
        # they are: refused before it is tokenized.
        self.max_prompt_bytes = self.context_len * _longest_token_bytes(self.tokenizer)
        # Tokenizing and compiling constraints run here, off the caller's thread (the server's event
        # loop) and under a time budget; compiles have their own threads so that a slow one never
        # holds up plain prompts.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(self.options.prepare_workers,
                                                                    thread_name_prefix="radixlm-tokenize")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(self.options.prepare_workers,
                                                                   thread_name_prefix="radixlm-compile")
        self._thread = threading.Thread(target=self._scheduler.run_forever, name="radixlm-scheduler", daemon=True)
        self._thread.start()
        self._in_flight = 0
        self._live_rids: set[str] = set()  # ids of requests submitted and not finished (under the lock)
        self._in_flight_lock = threading.Lock()
        self._closed = False
        logger.info("engine ready: %s on %s (%s); context %d tokens (model %d, KV pool %d)",
                    self.served_model_name, self.options.device, self.options.dtype, self.context_len,
                    self.model_config.context_len, self.kv_pool_size)

    # ---- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._scheduler.stop()
        for pool in (self._tokenize_pool, self._compile_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=30)
        runner = getattr(self, "_runner", None)
        if runner is not None and not self._thread.is_alive():
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

    # ---- generation ------------------------------------------------------------------------

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
    ) -> Output | list[Output] | Iterator[Output]:
        args = (prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, stream, rid)
        inputs, single = self._prepare(*args)  # on the caller's own thread
        kind = _constraint_kind(inputs)
        if kind is not None:
            self._within_budget(self._compile_pool.submit(self._attach_constraints, inputs), kind)
        if stream:
            return self._stream_sync(inputs[0])
        results: list[queue.Queue] = []
        for inp in inputs:
            box: queue.Queue = queue.Queue(maxsize=1)
            inp.sink = box.put
            results.append(box)
        self._submit(inputs)
        outs = [self._wait(box) for box in results]
        return outs[0] if single else outs

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
    ) -> Output | list[Output] | AsyncIterator[Output]:
        args = (prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, stream, rid)
        if _is_small(prompt, input_ids):  # microseconds of work: less than a hop to a worker, and keeps arrival order
            inputs, single = self._prepare(*args)
        else:
            inputs, single = await self.offload(self._prepare, *args)
        kind = _constraint_kind(inputs)
        if kind is not None:
            await self._within_budget_async(self._compile_pool.submit(self._attach_constraints, inputs), kind)
        if stream:
            return self._stream_async(inputs[0])
        loop = asyncio.get_running_loop()
        futures = []
        for inp in inputs:
            fut = loop.create_future()
            inp.sink = lambda out, fut=fut: loop.call_soon_threadsafe(_set_result, fut, out)
            futures.append(fut)
        self._submit(inputs)
        try:
            outs = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for inp in inputs:
                self.abort_request(inp.rid)
            raise
        return outs[0] if single else outs

    def _stream_sync(self, inp: GenerateInput) -> Iterator[Output]:
        chunks: queue.Queue = queue.Queue()
        inp.sink = chunks.put
        self._submit([inp])

        def iterate() -> Iterator[Output]:
            done = False
            try:
                while not done:
                    chunk = self._wait(chunks)
                    done = chunk["meta_info"]["finish_reason"] is not None
                    yield chunk
            finally:
                if not done:  # the consumer stopped early: free the request's memory
                    self.abort_request(inp.rid)

        return iterate()

    async def _stream_async(self, inp: GenerateInput) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        inp.sink = lambda out: loop.call_soon_threadsafe(chunks.put_nowait, out)
        self._submit([inp])
        done = False
        try:
            while not done:
                chunk = await chunks.get()
                done = chunk["meta_info"]["finish_reason"] is not None
                yield chunk
        finally:
            if not done:
                self.abort_request(inp.rid)

    def abort_request(self, rid: str) -> None:
        if not self._closed:
            self._scheduler.inbox.put(AbortMsg(rid))

    # ---- cache, stats, checks ------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drops every cached prefix. Returns False (and drops nothing) while requests are in flight."""
        return self._call(lambda s: s.flush_cache())

    def get_stats(self) -> dict[str, Any]:
        """Exact statistics, read on the scheduler thread (waits for the current step)."""
        stats = self._call(lambda s: s.get_stats())
        stats["in_flight"] = self._in_flight
        return stats

    def stats_snapshot(self) -> dict[str, Any]:
        """The statistics the scheduler loop published after its latest iteration; never waits for it
        (what /metrics and /get_server_info read, so that they answer while a step runs long)."""
        published = self._scheduler.snapshot
        if not published:  # the loop has not published yet (just started)
            return self.get_stats()
        stats = dict(published)
        stats["in_flight"] = self._in_flight
        return stats

    def stalled_for(self) -> float:
        """Seconds the scheduler loop has gone without progress while requests are in flight (0 when it
        is idle or keeping up). /health answers 503 past `stall_timeout`."""
        if self._in_flight == 0:
            return 0.0
        return max(0.0, time.monotonic() - self._scheduler.last_progress)

    def check_invariants(self) -> None:
        """Debug check: every KV slot is exactly one of free, cached-evictable, cached-locked, owned."""
        self._call(lambda s: s.check_invariants())

    def _call(self, fn: Any) -> Any:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        msg = CallMsg(fn)
        self._scheduler.inbox.put(msg)
        ok, value = msg.reply.get()
        if not ok:
            raise value
        return value

    # ---- input handling ------------------------------------------------------------------------

    async def offload(self, fn: Any, *args: Any) -> Any:
        """Runs `fn(*args)` (tokenizing, templating: preparation of a request) on the engine's worker
        threads under the `prepare_timeout` budget, so that an event loop keeps serving meanwhile."""
        return await self._within_budget_async(self._tokenize_pool.submit(fn, *args), "request")

    def _within_budget(self, future: concurrent.futures.Future, what: str) -> Any:
        """The future's result, or TooComplexError once `prepare_timeout` is spent (the work goes on in
        its thread, but nothing waits for it)."""
        try:
            return future.result(timeout=self.options.prepare_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._over_budget(what) from None

    async def _within_budget_async(self, future: concurrent.futures.Future, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.options.prepare_timeout)
        except asyncio.TimeoutError:
            raise self._over_budget(what) from None

    def _over_budget(self, what: str) -> TooComplexError:
        return TooComplexError(f"the {what} is too complex: preparing it took longer than the budget of "
                               f"{self.options.prepare_timeout:g} s (prepare_timeout)", what)

    def check_prompt_size(self, size_bytes: int, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a prompt of more UTF-8 bytes than the context can hold as tokens."""
        if size_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"the prompt is {size_bytes} bytes: more tokens than this model's context of {self.context_len} "
                f"could hold (the limit is {self.max_prompt_bytes} bytes)", param)

    def check_fan_out(self, count: int) -> None:
        """Refuses a call that would make more engine requests (prompts x n) than max_requests_per_call."""
        if count > self.options.max_requests_per_call:
            raise InvalidRequestError(
                f"the request makes {count} generations (prompts x n); the limit is "
                f"{self.options.max_requests_per_call} (max_requests_per_call)", "n")

    def _prepare(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                 top_logprobs_num, stream, rid) -> tuple[list[GenerateInput], bool]:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt and input_ids", "prompt")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise InvalidRequestError("prompt must be a string or a list of strings", "prompt")
            self.check_fan_out(len(prompts))
            for p in prompts:
                self.check_prompt_size(len(p.encode("utf-8", "surrogatepass")))
            id_lists = [self.tokenizer(p)["input_ids"] for p in prompts]
        else:
            single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
            id_lists = [input_ids] if single else input_ids
            if not isinstance(id_lists, list) or not all(isinstance(ids, list) for ids in id_lists):
                raise InvalidRequestError("input_ids must be a list of ints or a list of lists of ints", "input_ids")
            self.check_fan_out(len(id_lists))
        if not id_lists:
            raise InvalidRequestError("the prompt list is empty", "prompt")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(id_lists):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling_params for {len(id_lists)} prompts", "sampling_params")
            params = [SamplingParams.from_dict(sp) for sp in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
        self.check_fan_out(sum(sp.n for sp in params))
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num must be an integer in [0, 20]", "top_logprobs_num")
        if logprob_start_len is not None and (not isinstance(logprob_start_len, int) or logprob_start_len < -1):
            raise InvalidRequestError("logprob_start_len must be an integer >= -1", "logprob_start_len")
        if logprob_start_len == -1:
            logprob_start_len = None
        rids = self._rids(rid, len(id_lists), single)
        inputs: list[GenerateInput] = []
        for ids, sp, r in zip(id_lists, params, rids):
            sp = self._validate_ids(ids, sp)
            for i in range(sp.n):
                copy = sp
                if sp.n > 1:
                    copy = SamplingParams.from_dict({**sp.to_dict(), "n": 1,
                                                     "seed": None if sp.seed is None else sp.seed + i})
                inputs.append(GenerateInput(
                    rid=r if sp.n == 1 else f"{r}-{i}", input_ids=list(ids), sampling_params=copy,
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, stream=stream))
        if stream and len(inputs) != 1:
            raise InvalidRequestError("stream=True takes a single prompt with n=1", "stream")
        return inputs, single and len(inputs) == 1

    def _rids(self, rid, count: int, single: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise InvalidRequestError("rid must be a string per prompt", "rid")
        return rids

    def _validate_ids(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
        """Checks a prompt against the vocabulary and the context; returns sp with an unset
        max_new_tokens resolved to the rest of the context."""
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"input_ids must be token ids in [0, {self.vocab_size})", "input_ids")
        if sp.max_new_tokens is None:
            sp = dataclasses.replace(sp, max_new_tokens=max(self.context_len - len(ids), 0))
        needed = len(ids) + (1 if sp.max_new_tokens > 0 else 0)
        if needed > self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this server's context is {self.context_len} tokens", "prompt")
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {sp.max_new_tokens}: more than this "
                f"server's context of {self.context_len} tokens", "max_new_tokens")
        sp.check_vocab(self.vocab_size)
        return sp

    def _attach_constraints(self, inputs: list[GenerateInput]) -> None:
        """Gives each constrained input its own constraint (core.constrained), on a compile thread, so that
        a bad pattern or schema fails before anything is queued and index building never stalls the
        scheduler (the index is built once and cached; the n samples of a request share it)."""
        from radixlm.core.constrained import GrammarBudget, build_constraint

        budget = GrammarBudget(max_compile_seconds=self.options.grammar_max_compile_seconds,
                               max_configs=self.options.grammar_max_configs)
        for inp in inputs:
            sp = inp.sampling_params
            kind = next((k for k in _CONSTRAINT_KINDS if getattr(sp, k) is not None), None)
            if kind is None:
                continue
            try:
                inp.constraint = build_constraint(kind, getattr(sp, kind), self.tokenizer,
                                                  eos_token_ids=self.eos_token_ids,
                                                  backend=self.options.grammar_backend, budget=budget)
            except GrammarBudgetError as e:
                raise GrammarBudgetError(f"invalid {kind}: {e}", kind) from None
            except RecursionError:
                raise InvalidRequestError(f"invalid {kind}: nested too deeply", kind) from None
            except ValueError as e:
                raise InvalidRequestError(f"invalid {kind}: {e}", kind) from None

    def _submit(self, inputs: list[GenerateInput]) -> None:
        bound = self.options.max_queued_requests
        rids = [inp.rid for inp in inputs]
        with self._in_flight_lock:
            if bound is not None and self._in_flight + len(inputs) > bound + self.options.max_running_requests:
                raise QueueFullError(f"the request queue is full ({bound} waiting); retry later")
            clash = next((r for r in rids if r in self._live_rids), None)
            if clash is None and len(set(rids)) < len(rids):
                clash = next(r for r in rids if rids.count(r) > 1)
            if clash is not None:
                raise InvalidRequestError(f"request id {clash!r} is already in use by a request in flight", "rid")
            self._in_flight += len(inputs)
            self._live_rids.update(rids)
        for inp in inputs:
            inp.sink = _counting_sink(inp.sink, lambda rid=inp.rid: self._request_done(rid))
            self._scheduler.inbox.put(inp)

    def _request_done(self, rid: str) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
            self._live_rids.discard(rid)

    def _wait(self, box: queue.Queue) -> Output:
        while True:
            try:
                return box.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise EngineShutdownError("the engine stopped before the request finished") from None


_CONSTRAINT_KINDS = ("regex", "json_schema", "choices")
# Prompts up to this many characters (or token ids) in all are prepared on the event loop itself.
_SMALL_PROMPT = 4096


def _is_small(prompt: Any, input_ids: Any) -> bool:
    if isinstance(prompt, str):
        return len(prompt) <= _SMALL_PROMPT
    if isinstance(prompt, list):
        return len(prompt) <= _SMALL_PROMPT and sum(len(p) if isinstance(p, str) else 1 for p in prompt) <= _SMALL_PROMPT
    if isinstance(input_ids, list):
        return len(input_ids) <= _SMALL_PROMPT and sum(
            len(ids) if isinstance(ids, list) else 1 for ids in input_ids) <= _SMALL_PROMPT
    return True


def _constraint_kind(inputs: list[GenerateInput]) -> str | None:
    """The first constraint kind among the inputs (what a too-complex error names), or None."""
    return next((k for inp in inputs for k in _CONSTRAINT_KINDS if getattr(inp.sampling_params, k) is not None), None)


def _longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: its longest vocabulary entry (byte-level
    and SentencePiece entries spell each byte with one character of at least one byte)."""
    return max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())


def _counting_sink(sink, on_final):
    def wrapped(out: Output) -> None:
        if out["meta_info"]["finish_reason"] is not None:
            on_final()
        sink(out)

    return wrapped


def _set_result(fut: asyncio.Future, out: Output) -> None:
    if not fut.done():
        fut.set_result(out)


def _chat_template_text(template: str) -> str:
    """--chat-template is a file holding a Jinja template, or the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise InvalidRequestError(f"chat_template {template!r} is neither a file nor a Jinja template", "chat_template")


def _configure_logging(level: str) -> None:
    root = logging.getLogger("radixlm")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s radixlm %(levelname)s %(message)s"))
        root.addHandler(handler)
