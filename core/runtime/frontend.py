"""The one request front end: everything between a caller's request and the scheduler's messages.

It tokenizes prompts (the one place that does), validates sampling parameters, ids, the context and the
fan-out, splits `n` into requests (`{rid}-{i}`, seed + i), checks constraint specs, queues
`GenerateRequest`s, and turns the scheduler's `GenerateOutput`s back into output dicts: detokenizing
is its stage, on its drain thread. It streams single requests and answers batches and n > 1, sync and
async, and aborts a request with its n branches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.core.runtime.deadline import deadline_of
from radixlm.core.runtime.images import ImagePreparer, images_of, videos_of
from radixlm.core.runtime.messages import (
    Abort, Call, CallReply, CheckInvariants, ConstraintSpec, FlushCache, GenerateOutput, GenerateRequest,
    GetStats, ImageInput, StatsSnapshot,
)
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.errors import (
    EngineDeadError, EngineShutdownError, GrammarBudgetError, InvalidRequestError, QueueFullError, TooComplexError,
)

logger = logging.getLogger("radixlm")

Output = dict[str, Any]
Sink = Callable[[Any], None]  # takes an output dict, or the exception that ends the request

# Prompts up to this many characters (or token ids) in all are prepared on the event loop itself.
_SMALL_PROMPT = 4096


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


@dataclass(eq=False)
class _Pending:
    """A request in flight, as the front end keeps it: where its outputs go and its text so far."""

    req: GenerateRequest
    sink: Sink
    detok: IncrementalDetokenizer
    fed: int = 0  # output ids given to the detokenizer

    def text_of(self, out: GenerateOutput) -> str:
        """Feeds the new ids to the detokenizer as the scheduler fed its own (which found the stop), and
        returns the text this output carries: the new text for a stream, all of it otherwise."""
        p, detok = self.req.sampling_params, self.detok
        ids = out.output_ids
        if out.finish is not None and out.finish.type == "stop" and isinstance(out.finish.matched, int) \
                and ids and ids[-1] == out.finish.matched:
            ids = ids[:-1]  # a stop token ends the output without being part of its text
        if out.replaced:
            detok.replace_tail(out.replaced, ids)
            self.fed += len(ids) - out.replaced
        else:
            for token in ids:
                if detok.matched_stop is not None:
                    break
                self.fed += 1
                detok.add(token, check_stop=self.fed >= p.min_new_tokens)
        final = out.finish is not None
        if final:
            detok.flush()
        return detok.take_new_text(final) if self.req.stream else detok.text


class FrontEnd:
    def __init__(self, tokenizer: Any, opts: EngineOptions, vocab_size: int, context_len: int,
                 eos_token_ids: list[int], scheduler: Any, images: ImagePreparer | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's image preparation, else None
        self.options = opts
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler  # a LocalScheduler or SchedulerProcess (core.runtime.scheduler_client)
        if opts.json_schema_documents:  # refs request schemas may name (a bad directory fails the start)
            from radixlm.core.runtime.constrained.schema.schema_refs import register_documents  # imports `referencing`

            register_documents(opts.json_schema_documents)
        # A prompt longer than this many UTF-8 bytes has more tokens than the context holds whatever
        # they are: refused before it is tokenized.
        self.max_prompt_bytes = context_len * _longest_token_bytes(tokenizer)
        # Tokenizing and compiling constraints run here, off the caller's thread (the server's event
        # loop) and under a time budget; compiles have their own threads so that a slow one never
        # holds up plain prompts.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(opts.prepare_workers,
                                                                    thread_name_prefix="radixlm-tokenize")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(opts.prepare_workers,
                                                                   thread_name_prefix="radixlm-compile")
        if opts.grammar_backend == "radixlm" and opts.grammar_prepare_at_start:
            from radixlm.core.runtime.constrained.grammar_index_cache import prepare_in_background

            prepare_in_background(tokenizer, eos_token_ids)
        self._lock = threading.Lock()  # the tables below: callers' threads add, the drain thread removes
        self._pending: dict[str, _Pending] = {}
        self._branches: dict[str, list[str]] = {}  # rid given by the caller -> its n > 1 branch ids
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._closed = False
        self._drain = threading.Thread(target=self._drain_outbox, name="radixlm-detokenize", daemon=True)
        self._drain.start()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stops the scheduler (which ends what is in flight with an abort output), then the drain thread."""
        if self._closed:
            return
        self._closed = True
        for pool in (self._tokenize_pool, self._compile_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        was_alive = self.scheduler.alive()
        self.scheduler.stop()
        if was_alive:  # (a killed scheduler process may hold its outbox's write lock forever: no put then;
            self.scheduler.outbox.put(None)  # the drain thread sees it gone within a second)
        self._drain.join(timeout=30)

    def alive(self) -> bool:
        """Whether the engine takes requests: not shut down and its scheduler loop running."""
        return not self._closed and self.scheduler.alive()

    def fail_in_flight(self) -> None:
        """When the scheduler has died: every request in flight fails now (the drain thread does the same
        within a second of noticing, unless it is stuck reading a message the dead process half wrote)."""
        if not self.scheduler.alive():
            self._fail_all(EngineDeadError("the engine's scheduler died before the request finished"))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        if not self.scheduler.alive():
            raise EngineDeadError("the engine's scheduler has died")

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=0, stream=False, rid=None, image_data=None,
                 video_data=None, timeout=None):
        deadline = deadline_of(timeout, self.options.request_timeout)  # counted from the call
        reqs, single = self.prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                    top_logprobs_num, stream, rid, image_data, video_data)  # on the caller's own thread
        _set_deadline(reqs, deadline)
        kind = _constraint_kind(reqs)
        if kind is not None:
            self._within_budget(self._compile_pool.submit(self.check_constraints, reqs), kind)
        if stream:
            return self._stream_sync(reqs)
        boxes: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in reqs]
        self.submit(reqs, [box.put for box in boxes])
        outs = [self._wait(box) for box in boxes]
        return outs[0] if single else outs

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=0, stream=False, rid=None, image_data=None,
                             video_data=None, timeout=None):
        deadline = deadline_of(timeout, self.options.request_timeout)  # counted from the call
        args = (prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, stream, rid,
                image_data, video_data)
        # Microseconds of work: less than a hop to a worker, and keeps arrival order (images are decoded: not small).
        if _is_small(prompt, input_ids) and image_data is None and video_data is None:
            reqs, single = self.prepare(*args)
        else:
            reqs, single = await self.offload(self.prepare, *args)
        _set_deadline(reqs, deadline)
        kind = _constraint_kind(reqs)
        if kind is not None:
            await self._within_budget_async(self._compile_pool.submit(self.check_constraints, reqs), kind)
        if stream:
            return self._stream_async(reqs)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        self.submit(reqs, [lambda out, fut=fut: loop.call_soon_threadsafe(_set_result, fut, out) for fut in futures])
        try:
            outs = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for req in reqs:
                self.abort_request(req.rid)
            raise
        return outs[0] if single else outs

    def _stream_sync(self, reqs: list[GenerateRequest]) -> Iterator[Output]:
        chunks: queue.Queue = queue.Queue()
        self.submit(reqs, _indexed_sinks(chunks.put, len(reqs)))

        def iterate() -> Iterator[Output]:
            live = set(range(len(reqs)))
            try:
                while live:
                    chunk = self._wait(chunks)
                    yield _noted(chunk, live, len(reqs))
            finally:
                for i in live:  # the consumer stopped early: free the requests' memory
                    self.abort_request(reqs[i].rid)

        return iterate()

    async def _stream_async(self, reqs: list[GenerateRequest]) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        self.submit(reqs, _indexed_sinks(lambda item: loop.call_soon_threadsafe(chunks.put_nowait, item), len(reqs)))
        live = set(range(len(reqs)))
        try:
            while live:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield _noted(chunk, live, len(reqs))
        finally:
            for i in live:
                self.abort_request(reqs[i].rid)

    def abort_request(self, rid: str) -> None:
        """Aborts the request `rid`, or all n branches of the request the caller named `rid`."""
        if self._closed:
            return
        with self._lock:
            rids = [rid, *self._branches.get(rid, ())]
        for r in rids:
            self.scheduler.inbox.put(Abort(r))

    def abort_all(self) -> None:
        """Aborts every request in flight; each ends with finish reason "abort" (SGLang's abort_all)."""
        if self._closed:
            return
        with self._lock:
            rids = list(self._pending)
        for r in rids:
            self.scheduler.inbox.put(Abort(r))

    def _wait(self, box: queue.Queue) -> Output:
        while True:
            try:
                out = box.get(timeout=1.0)
            except queue.Empty:
                if not self._drain.is_alive():
                    raise EngineShutdownError("the engine stopped before the request finished") from None
                continue
            if isinstance(out, BaseException):
                raise out
            return out

    # ---- calls ---------------------------------------------------------------------------------

    def call(self, msg: Call) -> Any:
        """Sends a FlushCache, GetStats or CheckInvariants and waits for the scheduler's reply."""
        self._check_open()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            msg.call_id = next(self._call_ids)
            self._calls[msg.call_id] = future
        self.scheduler.inbox.put(msg)
        reply: CallReply = future.result()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def flush_cache(self) -> bool:
        return self.call(FlushCache())

    def get_stats(self) -> dict[str, Any]:
        return self.call(GetStats())

    def check_invariants(self) -> None:
        self.call(CheckInvariants())

    # ---- preparation ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a prompt's text (with the tokenizer's BOS where add_special_tokens)."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_prompt(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """`encode` after the size check: a prompt the context cannot hold is refused untokenized."""
        self.check_prompt_size(len(text.encode("utf-8", "surrogatepass")), param)
        return self.encode(text, add_special_tokens)

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

    def prepare(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, stream, rid, image_data=None, video_data=None) -> tuple[list[GenerateRequest], bool]:
        """Validates a generate call and turns it into requests (one per prompt and sample); True when
        the call answers with one output rather than a list."""
        self._check_open()
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt and input_ids", "prompt")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise InvalidRequestError("prompt must be a string or a list of strings", "prompt")
            self.check_fan_out(len(prompts))
            id_lists = [self.encode_prompt(p) for p in prompts]
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
        rids = self._rids(rid, len(id_lists))
        image_lists = images_of(image_data, len(id_lists), single)
        video_lists = videos_of(video_data, len(id_lists), single)
        reqs: list[GenerateRequest] = []
        for ids, sp, r, items, videos in zip(id_lists, params, rids, image_lists, video_lists):
            ids, images = self.prepare_images(ids, items, videos)
            sp = self.validate_ids(ids, sp)
            rope_positions, rope_delta = self.images.rope_positions(len(ids), images) if images else (None, 0)
            ids = ImagePreparer.pad(ids, images)
            constraint = ConstraintSpec.of(sp)
            for i, branch in enumerate(branch_params(sp)):
                reqs.append(GenerateRequest(
                    rid=branch_rid(r, i, sp.n), input_ids=list(ids), sampling_params=branch,
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, stream=stream, constraint=constraint,
                    images=tuple(images), rope_positions=rope_positions, rope_delta=rope_delta))
        return reqs, single and len(reqs) == 1

    def prepare_images(self, ids: list[int], items: list[Any], videos: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image and video placeholders widened (core.runtime.images), and its images
        (videos included)."""
        if not items and not videos:
            return ids, []
        if self.images is None:
            param = "image_data" if items else "video_data"
            raise InvalidRequestError("this model takes no images (it is not a vision-language model)", param)
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return ids, []  # validate_ids names the problem
        return self.images.expand(ids, items, videos)

    @staticmethod
    def _rids(rid, count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise InvalidRequestError("rid must be a string per prompt", "rid")
        return rids

    def validate_ids(self, ids: list[int], sp: SamplingParams) -> SamplingParams:
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

    def check_constraints(self, reqs: list[GenerateRequest]) -> None:
        """Compiles each distinct constraint spec once, on a compile thread, so that a bad pattern or
        schema fails before anything is queued; the scheduler's own build is then a cache hit."""
        from radixlm.core.runtime.constrained import GrammarBudget, build_constraint

        budget = GrammarBudget(max_compile_seconds=self.options.grammar_max_compile_seconds,
                               max_configs=self.options.grammar_max_configs,
                               warm_seconds=self.options.grammar_warm_seconds)
        for spec in dict.fromkeys(r.constraint for r in reqs if r.constraint is not None):
            try:
                build_constraint(spec.kind, spec.value(), self.tokenizer, eos_token_ids=self.eos_token_ids,
                                 backend=self.options.grammar_backend, budget=budget)
            except GrammarBudgetError as e:
                raise GrammarBudgetError(f"invalid {spec.kind}: {e}", spec.kind) from None
            except RecursionError:
                raise InvalidRequestError(f"invalid {spec.kind}: nested too deeply", spec.kind) from None
            except ValueError as e:
                raise InvalidRequestError(f"invalid {spec.kind}: {e}", spec.kind) from None

    def submit(self, reqs: list[GenerateRequest], sinks: list[Sink]) -> None:
        """Queues the requests; each one's outputs (dicts), or the exception that ends it, go to its sink
        on the drain thread."""
        bound = self.options.max_queued_requests
        rids = [r.rid for r in reqs]
        self._check_open()
        with self._lock:
            if bound is not None and len(self._pending) + len(reqs) > bound + self.options.max_running_requests:
                raise QueueFullError(f"the request queue is full ({bound} waiting); retry later")
            clash = next((r for r in rids if r in self._pending), None)
            if clash is None and len(set(rids)) < len(rids):
                clash = next(r for r in rids if rids.count(r) > 1)
            if clash is not None:
                raise InvalidRequestError(f"request id {clash!r} is already in use by a request in flight", "rid")
            for req, sink in zip(reqs, sinks):
                p = req.sampling_params
                lazy = not (req.stream or p.stop)  # decoded once at the end when nothing reads it earlier
                detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.no_stop_trim, lazy=lazy)
                self._pending[req.rid] = _Pending(req, sink, detok)
            for rid in rids:
                parent = _branch_parent(rid)
                if parent is not None:
                    self._branches.setdefault(parent, []).append(rid)
        for req in reqs:
            self.scheduler.inbox.put(req)

    # ---- the detokenizer stage: the scheduler's outbox, drained on one thread ----------------------

    def _drain_outbox(self) -> None:
        outbox = self.scheduler.outbox
        while True:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                if self.scheduler.alive():
                    continue
                break  # the scheduler died: fail what is left (below)
            if msg is None:
                break
            try:
                self._dispatch(msg)
            except Exception:  # one output's failure must not stop the others being delivered
                logger.exception("delivering a scheduler message failed")
        if self._closed:
            self._fail_all(EngineShutdownError("the engine stopped before the request finished"))
        else:
            self._fail_all(EngineDeadError("the engine's scheduler died before the request finished"))

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, GenerateOutput):
            self._deliver(msg)
        elif isinstance(msg, CallReply):
            with self._lock:
                future = self._calls.pop(msg.call_id, None)
            if future is not None:
                future.set_result(msg)
        elif isinstance(msg, StatsSnapshot):
            self.scheduler.observe(msg)

    def _deliver(self, out: GenerateOutput) -> None:
        with self._lock:
            pending = self._pending.get(out.rid)
            if pending is not None and out.finish is not None:
                del self._pending[out.rid]
                self._forget_branch(out.rid)
        if pending is None:
            return
        try:
            text = pending.text_of(out)
        except Exception:  # the output ends with what was decoded so far
            logger.exception("request %s: decoding its output failed", out.rid)
            text = pending.detok.text if not pending.req.stream else ""
        try:
            pending.sink(_output_dict(out, text, pending.req))
        except Exception:  # the receiver's failure is its own; nobody else's output may depend on it
            logger.exception("request %s: delivering its output failed", out.rid)

    def _forget_branch(self, rid: str) -> None:
        parent = _branch_parent(rid)
        branches = self._branches.get(parent) if parent is not None else None
        if branches is not None and rid in branches:
            branches.remove(rid)
            if not branches:
                del self._branches[parent]

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._branches.clear()
        for p in pending:
            try:
                p.sink(error)
            except Exception:
                logger.exception("request %s: delivering its failure failed", p.req.rid)
        for future in calls:
            future.set_exception(error)


def _branch_parent(rid: str) -> str | None:
    """The id a caller gave a request with n > 1 (what abort_request takes), for the id of one of its
    samples (`{rid}-{i}`); None for other ids."""
    parent, _, index = rid.rpartition("-")
    return parent if parent and index.isdigit() else None


def _indexed_sinks(put: Callable[[Any], None], count: int) -> list[Sink]:
    """Sinks that put each output (or the request's exception) on one queue, tagged with the request's
    index when there are several."""
    if count == 1:
        return [put]

    def sink_for(i: int) -> Sink:
        return lambda out: put(out if isinstance(out, BaseException) else {**out, "index": i})

    return [sink_for(i) for i in range(count)]


def _noted(chunk: Output, live: set[int], count: int) -> Output:
    """Marks the chunk's request finished in `live` when the chunk is its last."""
    if chunk["meta_info"]["finish_reason"] is not None:
        live.discard(chunk["index"] if count > 1 else 0)
    return chunk


def _output_dict(out: GenerateOutput, text: str, req: GenerateRequest) -> Output:
    """The output in the shape of SGLang's Engine.generate (what users of radixlm.Engine read)."""
    finish = out.finish
    meta: dict[str, Any] = {
        "id": out.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": None if finish is None else {"type": finish.type, "matched": finish.matched},
    }
    if finish is not None and finish.status_code is not None:
        meta["finish_reason"]["status_code"] = finish.status_code
    if req.return_logprob:
        meta["input_token_logprobs"] = out.input_token_logprobs
        meta["input_top_logprobs"] = out.input_top_logprobs
        meta["output_token_logprobs"] = out.output_token_logprobs
        meta["output_top_logprobs"] = out.output_top_logprobs
    if out.e2e_latency is not None:
        meta["e2e_latency"] = out.e2e_latency
        meta["ttft"] = out.ttft
    if out.queue_time is not None:
        meta["queue_time"] = out.queue_time
    if finish is not None and finish.error is not None:
        meta["error"] = finish.error
    if out.replaced:
        meta["replaced_ids"] = out.replaced  # a stream chunk whose ids replace that many sent ones
    if out.dp_rank is not None:
        meta["dp_rank"] = out.dp_rank
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


def _is_small(prompt: Any, input_ids: Any) -> bool:
    if isinstance(prompt, str):
        return len(prompt) <= _SMALL_PROMPT
    if isinstance(prompt, list):
        return len(prompt) <= _SMALL_PROMPT and sum(len(p) if isinstance(p, str) else 1 for p in prompt) <= _SMALL_PROMPT
    if isinstance(input_ids, list):
        return len(input_ids) <= _SMALL_PROMPT and sum(
            len(ids) if isinstance(ids, list) else 1 for ids in input_ids) <= _SMALL_PROMPT
    return True


def _constraint_kind(reqs: list[GenerateRequest]) -> str | None:
    """The first constraint kind among the requests (what a too-complex error names), or None."""
    return next((r.constraint.kind for r in reqs if r.constraint is not None), None)


def _longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: its longest vocabulary entry (byte-level
    and SentencePiece entries spell each byte with one character of at least one byte)."""
    return max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())


def _set_deadline(reqs: list[GenerateRequest], deadline: float | None) -> None:
    for req in reqs:
        req.deadline = deadline


def _set_result(fut: asyncio.Future, out: Any) -> None:
    if fut.done():
        return
    if isinstance(out, BaseException):
        fut.set_exception(out)
    else:
        fut.set_result(out)
