"""SGLang's native endpoints, with SGLang's request and response shapes.

POST /generate takes `text` or `input_ids` (one prompt or a batch), `sampling_params` (one dict or one
per prompt), `rid`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`,
`return_text_in_logprobs` and `stream`. It answers the engine's output dict (a list for a batch); a
stream sends `data: {json}` events whose `text`, `output_ids` and logprob lists are cumulative, as
SGLang's are, with `index` telling the branches of a batch apart, and ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import radixlm
from radixlm.core.runtime.branches import branch_params, branch_rid
from radixlm.core.runtime.images import images_of, videos_of
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.server.body import parse_body
from radixlm.server.errors import APIError, bad_request, error_body
from radixlm.server.generation import (Branch, EngineClient, EventStreamResponse, MergedStream, as_list,
                                       failure_event, raise_if_failed, sse)

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    # Images (data URLs or base64) for a vision-language model: for one prompt one image or a list, for
    # a batch one entry (an image, a list, or null) per prompt.
    image_data: str | list[str | list[str] | None] | None = None
    # Videos (Qwen2-VL), each a list of frames (data URLs or base64): for one prompt a video or a list
    # of videos, for a batch one entry (or null) per prompt.
    video_data: list[Any] | None = None
    # Seconds the request may take (its deadline); default: the server's --request-timeout.
    timeout: float | None = Field(None, gt=0)


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    rid: str | None = None
    abort_all: bool = False


class NativeAPI:
    def __init__(self, engine: Any, client: EngineClient, server_info: dict[str, Any]) -> None:
        self.engine = engine
        self.client = client
        self.server_info = server_info
        # Why the server refuses work now (draining, the engine dead: server.lifecycle), which /health
        # answers with a 503 so that balancers stop sending; None while it serves.
        self.refusal: Callable[[], APIError | None] = lambda: None

    async def generate(self, request: Request) -> Response:
        req = await parse_body(request, GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", "text")
        logprob_args = {"return_logprob": req.return_logprob, "logprob_start_len": req.logprob_start_len,
                        "top_logprobs_num": req.top_logprobs_num, "timeout": req.timeout}
        if req.stream:
            branches = self._branches(req, logprob_args)
            stream = await self.client.open_stream(request, branches)
            return EventStreamResponse(self._events(req, stream, batch=len(branches) > 1), stream.close)
        result = await self.client.generate(request, prompt=req.text, input_ids=req.input_ids,
                                            sampling_params=req.sampling_params, rid=req.rid,
                                            image_data=req.image_data, video_data=req.video_data, **logprob_args)
        for out in as_list(result):
            raise_if_failed(out["meta_info"])
        if req.return_text_in_logprobs:
            for out in as_list(result):
                self._add_token_text(out["meta_info"])
        return JSONResponse(result)

    def _branches(self, req: GenerateRequest, logprob_args: dict[str, Any]) -> list[Branch]:
        """One single-output engine stream per (prompt, sample), rids and seeds as the engine names
        and seeds the samples of a request with n > 1."""
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            prompts: list[dict[str, Any]] = [{"prompt": t} for t in texts]
        else:
            flat = not req.input_ids or isinstance(req.input_ids[0], int)
            prompts = [{"input_ids": ids} for ids in ([req.input_ids] if flat else req.input_ids)]
        if not prompts:
            raise bad_request("the prompt list is empty", "text")
        params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise bad_request(f"{len(params)} sampling_params for {len(prompts)} prompts", "sampling_params")
        self.engine.check_fan_out(len(prompts))  # before any per-prompt work
        parsed = [SamplingParams.from_dict(sp) for sp in params]
        self.engine.check_fan_out(sum(sp.n for sp in parsed))
        rids = [req.rid] if isinstance(req.rid, str) else req.rid
        if rids is not None and len(rids) != len(prompts):
            raise bad_request("rid must be a string per prompt", "rid")
        single = isinstance(req.text, str) or (
            req.input_ids is not None and bool(req.input_ids) and isinstance(req.input_ids[0], int))
        images = images_of(req.image_data, len(prompts), single)
        videos = videos_of(req.video_data, len(prompts), single)
        branches = []
        for k, (prompt, sp) in enumerate(zip(prompts, parsed)):
            for i, one in enumerate(branch_params(sp)):
                rid = {} if rids is None else {"rid": branch_rid(rids[k], i, sp.n)}
                branches.append(Branch(one.to_dict(), **prompt, **rid, **logprob_args, image_data=images[k] or None,
                                       video_data=videos[k] or None))
        return branches

    async def _events(self, req: GenerateRequest, stream: MergedStream, batch: bool) -> AsyncIterator[bytes]:
        states: list[dict[str, Any]] = [{"text": "", "output_ids": []} for _ in stream.branches]
        async for i, chunk in stream:
            state = states[i]
            state["text"] += chunk["text"]
            state["output_ids"] += chunk["output_ids"]
            meta = dict(chunk["meta_info"])
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    state[key] = state.get(key, []) + list(meta[key])
                    meta[key] = state[key]
            if req.return_text_in_logprobs:
                self._add_token_text(meta)
            out: dict[str, Any] = {"text": state["text"], "output_ids": list(state["output_ids"]), "meta_info": meta}
            if batch:
                out["index"] = i
            yield sse(json.dumps(out))
            failure = failure_event(meta) if meta["finish_reason"] is not None else None
            if failure is not None:
                yield failure
        yield sse("[DONE]")

    def _add_token_text(self, meta: dict[str, Any]) -> None:
        """Fills the third slot of every (logprob, token_id, text) entry with the token's text."""
        decode = self.engine.tokenizer.decode

        def with_text(entry: Any) -> Any:
            return entry if entry is None else (entry[0], entry[1], decode([entry[1]]))

        for key in _LOGPROB_KEYS:
            if key in meta:
                meta[key] = [with_text(e) for e in meta[key]]
        for key in _TOP_KEYS:
            if key in meta:
                meta[key] = [None if top is None else [with_text(e) for e in top] for top in meta[key]]

    # ---- service endpoints ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        stalled = self.engine.stalled_for()
        if stalled > self.engine.options.stall_timeout:
            raise APIError(503, f"The engine has made no progress for {stalled:.0f} s with requests pending "
                                f"(stall_timeout {self.engine.options.stall_timeout:g} s)", code="engine_stalled")
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """Healthy only if the engine produces a token within a few seconds."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        try:
            await asyncio.wait_for(self.client.generate(
                request, input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}), timeout=20)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            raise APIError(503, f"The engine did not generate: {type(exc).__name__}") from None
        return Response(status_code=200)

    async def get_model_info(self, request: Request) -> Response:
        return JSONResponse({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.options.tokenizer_path or self.engine.model_path,
            "served_model_name": self.engine.served_model_name, "is_generation": True,
            "context_len": self.engine.context_len, "vocab_size": self.engine.vocab_size,
            "eos_token_ids": self.engine.eos_token_ids, **self._vision_info(),
        })

    def _vision_info(self) -> dict[str, Any]:
        """For a vision-language model: its image placeholder and the positions each image takes."""
        images = self.engine.images
        if images is None:
            return {}
        video = images.placeholder(self.engine.tokenizer, video=True)
        return {**({"video_token": video} if video else {}), "image_token": images.placeholder(self.engine.tokenizer),
                "image_token_id": images.image_token_id, "tokens_per_image": images.vision.tokens_per_image}

    async def get_server_info(self, request: Request) -> Response:
        stats = self.engine.stats_snapshot()
        host, port = request.scope.get("server") or (None, None)
        return JSONResponse({
            **self.server_info, "host": host, "port": port, **dataclasses.asdict(self.engine.options),
            "model_path": self.engine.model_path, "served_model_name": self.engine.served_model_name,
            "context_len": self.engine.context_len, "version": radixlm.__version__,
            "inflight_http_requests": self.client.inflight, "internal_states": [stats],
            # The scheduler's own process (scheduler_process), for an operator's tools; None: a thread here.
            "scheduler_pid": getattr(self.engine.frontend.scheduler, "pid", None),
        })

    async def flush_cache(self, request: Request) -> Response:
        if not await run_in_threadpool(self.engine.flush_cache):
            return JSONResponse(error_body(400, "Cache not flushed: requests are running; retry when idle",
                                           code="requests_running"), status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def abort_request(self, request: Request) -> Response:
        req = await parse_body(request, AbortRequest)
        if req.abort_all:
            self.client.abort_all()
        elif req.rid is not None:
            self.client.abort(req.rid)
        else:
            raise bad_request("give rid or abort_all", "rid")
        return Response(status_code=200)
