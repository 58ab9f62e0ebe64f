"""The HF transformers peer: an engine-shaped driver that runs the programs' calls with `generate`.

`HFEngine` has the part of `radixlm.Engine`'s interface that the program model and SGLangLM use
(`generate`, `tokenizer`, names, `flush_cache`, `get_stats`), so the very same programs run on it:
the interpreter renders each call into a prompt and calls `generate`, and programs with dependent
calls run step by step (a call is made once the text it continues exists). The driver is simple, as
a user would write it around transformers:
- Calls arriving together (from the threads of run_batch, of forks, of DSPy's batch) are collected
  until none has come for `window_s`, then run as static batches: left-padded `generate` over at most
  `max_batch` prompts and `max_batch_tokens` padded tokens, longest prompts first; a batch runs until
  its longest generation ends. No KV is kept between calls: every prompt is computed in full.
- Per-row ends (max_new_tokens, EOS unless ignore_eos, stop token ids, stop strings, the end of a
  regex) are checked by a stopping criterion; regex/JSON-schema gens use radixlm's own token masks in
  a logits processor (no jump-forward).
- A scoring call (max_new_tokens 0 with logprobs: how select ranks choices) is one forward pass over
  the padded batch, with logits taken only at the scored positions. A prefill-only call without
  logprobs (a prefix-cache hint) does nothing: there is no cache to fill.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from radixlm.core.runtime.constrained import apply_token_masks, build_constraint
from radixlm.core.runtime.sampling_params import SamplingParams

from .common import TokenizerEncoding, generate_inputs


@dataclass
class _Job:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    constraint: Any = None
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class HFEngine(TokenizerEncoding):
    def __init__(self, model: Any, tokenizer: Any, device: torch.device, *, model_path: str, context_len: int,
                 eos_token_ids: list[int], max_batch: int, max_batch_tokens: int, window_s: float = 0.01) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = model_path
        self.served_model_name = "hf-transformers"
        self.context_len = context_len
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.window_s = window_s
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stats = {"batches": 0, "prompt_tokens": 0, "padded_tokens": 0, "generated_tokens": 0,
                      "generate_steps": 0}
        self._inbox: "queue.Queue[_Job | None]" = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="hf-driver", daemon=True)
        self._worker.start()

    # ---- the engine-shaped interface ----------------------------------------------------------------

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                 stream: bool = False, rid: Any = None) -> Any:
        if stream or top_logprobs_num:
            raise NotImplementedError("the HF driver does not stream or return top logprobs")
        single, id_lists, params = generate_inputs(self.tokenizer, prompt, input_ids, sampling_params)
        jobs = []
        for ids, sp in zip(id_lists, params):
            p = SamplingParams.from_dict(sp)
            if p.n != 1 or (return_logprob and p.max_new_tokens > 0):
                raise NotImplementedError("the HF driver takes n=1, and logprobs only for scoring")
            kind = next((k for k in ("regex", "json_schema", "choices") if getattr(p, k) is not None), None)
            constraint = None if kind is None else build_constraint(kind, getattr(p, kind), self.tokenizer,
                                                                    eos_token_ids=self.eos_token_ids)
            jobs.append(_Job(list(ids), p, return_logprob, logprob_start_len or 0, constraint))
        for job in jobs:
            if job.params.max_new_tokens == 0 and not job.return_logprob:
                job.result = _output(job, [], "length")  # a cache hint: nothing to compute here
                job.done.set()
            else:
                self._inbox.put(job)
        for job in jobs:
            job.done.wait()
            if job.error is not None:
                raise job.error
        outs = [job.result for job in jobs]
        return outs[0] if single else outs

    def flush_cache(self) -> bool:
        return True

    def get_stats(self) -> dict[str, Any]:
        return dict(self.stats)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._worker.join(timeout=30)

    # ---- batching ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            jobs = [job]
            while True:  # collect what arrives together
                try:
                    job = self._inbox.get(timeout=self.window_s)
                except queue.Empty:
                    break
                if job is None:
                    self._inbox.put(None)
                    break
                jobs.append(job)
            try:
                self._run(jobs)
            except BaseException as error:  # every caller hears of it; the driver keeps serving
                for job in jobs:
                    if not job.done.is_set():
                        job.error = error
                        job.done.set()

    def _run(self, jobs: list[_Job]) -> None:
        scoring = [j for j in jobs if j.params.max_new_tokens == 0]
        generating = [j for j in jobs if j.params.max_new_tokens > 0]
        for chunk in self._chunks(scoring, new_tokens=lambda j: 0):
            self._score(chunk)
        groups: dict[tuple, list[_Job]] = {}
        for job in generating:  # one generate call samples all its rows alike
            p = job.params
            groups.setdefault((p.is_greedy, p.temperature, p.top_p, p.top_k), []).append(job)
        for group in groups.values():
            for chunk in self._chunks(group, new_tokens=lambda j: j.params.max_new_tokens):
                self._generate(chunk)

    def _chunks(self, jobs: list[_Job], new_tokens: Any) -> list[list[_Job]]:
        """Longest prompts first, as many rows as fit the row and padded-token limits."""
        chunks: list[list[_Job]] = []
        current: list[_Job] = []
        for job in sorted(jobs, key=lambda j: -len(j.input_ids)):
            rows = current + [job]
            width = max(len(j.input_ids) for j in rows) + max(new_tokens(j) for j in rows)
            if current and (len(rows) > self.max_batch or len(rows) * width > self.max_batch_tokens):
                chunks.append(current)
                rows = [job]
            current = rows
        if current:
            chunks.append(current)
        return chunks

    def _padded(self, jobs: list[_Job], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(j.input_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(jobs), width, dtype=torch.long)
        for i, job in enumerate(jobs):
            n = len(job.input_ids)
            cols = slice(width - n, width) if left else slice(0, n)
            ids[i, cols] = torch.tensor(job.input_ids)
            mask[i, cols] = 1
        self.stats["batches"] += 1
        self.stats["prompt_tokens"] += sum(len(j.input_ids) for j in jobs)
        self.stats["padded_tokens"] += ids.numel()
        return ids.to(self.device), mask.to(self.device)

    # ---- the work ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _score(self, jobs: list[_Job]) -> None:
        """Input logprobs from each job's logprob_start_len on: one forward, logits at those rows only."""
        ids, mask = self._padded(jobs, left=False)
        hidden = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        rows, cols, targets = [], [], []
        for i, job in enumerate(jobs):
            first = max(job.logprob_start_len, 1)
            for pos in range(first, len(job.input_ids)):  # logits after pos - 1 give token pos
                rows.append(i)
                cols.append(pos - 1)
                targets.append(job.input_ids[pos])
        logprobs = torch.log_softmax(self.model.lm_head(hidden[rows, cols]).float(), dim=-1)
        picked = logprobs[torch.arange(len(targets)), torch.tensor(targets)].tolist()
        k = 0
        for job in jobs:
            first = max(job.logprob_start_len, 1)
            entries = [(None, job.input_ids[0], None)] if job.logprob_start_len == 0 else []
            for pos in range(first, len(job.input_ids)):
                entries.append((picked[k], job.input_ids[pos], None))
                k += 1
            job.result = _output(job, [], "length")
            job.result["meta_info"].update(input_token_logprobs=entries, output_token_logprobs=[])
            job.done.set()

    @torch.inference_mode()
    def _generate(self, jobs: list[_Job]) -> None:
        ids, mask = self._padded(jobs, left=True)
        p = jobs[0].params
        tracker = _RowTracker(jobs, ids.shape[1], self.tokenizer, self.eos_token_ids)
        config = GenerationConfig(max_new_tokens=max(j.params.max_new_tokens for j in jobs),
                                  do_sample=not p.is_greedy, temperature=p.temperature if not p.is_greedy else None,
                                  top_p=p.top_p if not p.is_greedy else None,
                                  top_k=(p.top_k if p.top_k > 0 else None) if not p.is_greedy else None,
                                  pad_token_id=self.pad_id, eos_token_id=None, bos_token_id=None)
        processors = LogitsProcessorList([_ConstraintMasks(tracker)] if any(j.constraint for j in jobs) else [])
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                  logits_processor=processors, stopping_criteria=StoppingCriteriaList([tracker]))
        new = out[:, ids.shape[1]:].tolist()
        self.stats["generate_steps"] += len(new[0]) if new else 0
        for i, job in enumerate(jobs):
            length, reason = tracker.ends[i] or (len(new[i]), "length")
            output_ids = new[i][:length]
            self.stats["generated_tokens"] += len(output_ids)
            job.result = _output(job, output_ids, reason, self.tokenizer)
            job.done.set()


class _RowTracker(StoppingCriteria):
    """A stopping criterion that follows every row: feeds its constraint, and marks where it ends."""

    def __init__(self, jobs: list[_Job], prompt_width: int, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.jobs = jobs
        self.width = prompt_width
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.ends: list[tuple[int, str] | None] = [None] * len(jobs)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n = input_ids.shape[1] - self.width  # tokens generated so far
        last = input_ids[:, -1].tolist()
        for i, job in enumerate(self.jobs):
            if self.ends[i] is None:
                self.ends[i] = self._end(job, input_ids[i], last[i], n)
        return torch.tensor([e is not None for e in self.ends], device=input_ids.device)

    def _end(self, job: _Job, row: torch.Tensor, token: int, n: int) -> tuple[int, str] | None:
        p = job.params
        if job.constraint is not None:
            job.constraint.advance(token)
            if job.constraint.is_finished():
                return n, "stop"
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
                return n, "stop"
            if p.stop:
                text = self.tokenizer.decode(row[self.width:].tolist(), skip_special_tokens=p.skip_special_tokens)
                if any(s in text for s in p.stop):
                    return n, "stop"
        return (n, "length") if n >= p.max_new_tokens else None


class _ConstraintMasks(LogitsProcessor):
    """Masks each constrained row's logits to the tokens its constraint allows now."""

    def __init__(self, tracker: _RowTracker) -> None:
        self.tracker = tracker

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = self.tracker
        masks = [None if job.constraint is None or t.ends[i] is not None else
                 job.constraint.allowed_token_mask(scores.shape[-1]) for i, job in enumerate(t.jobs)]
        return apply_token_masks(scores, masks)


def _output(job: _Job, output_ids: list[int], reason: str, tokenizer: Any = None) -> dict[str, Any]:
    text = tokenizer.decode(output_ids, skip_special_tokens=job.params.skip_special_tokens) if output_ids else ""
    for stop in job.params.stop:
        if stop in text and not job.params.no_stop_trim:
            text = text[: text.index(stop)]
    return {"text": text, "output_ids": output_ids,
            "meta_info": {"prompt_tokens": len(job.input_ids), "completion_tokens": len(output_ids),
                          "cached_tokens": 0, "finish_reason": {"type": reason, "matched": None}}}

