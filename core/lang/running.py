"""How a program's runs start: run()'s keywords split into sampling defaults and the program's
arguments, and a batch of runs on a thread pool (shared by SglFunction and CompiledFunction)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from radixlm.core.lang.ir import GenParams

if TYPE_CHECKING:
    from radixlm.core.lang.state import ProgramState

# The sampling parameters that run()/run_batch() accept as defaults for every gen (SGLang's names);
# every other keyword is an argument of the program.
RUN_SAMPLING_NAMES = frozenset({
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs",
})


def split_run_kwargs(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    """(the run's default GenParams, the program's own keyword arguments)."""
    sampling = {k: v for k, v in kwargs.items() if k in RUN_SAMPLING_NAMES}
    program = {k: v for k, v in kwargs.items() if k not in RUN_SAMPLING_NAMES}
    return GenParams.run_defaults(**sampling), program


def batch_threads(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        num_threads = max(64, multiprocessing.cpu_count() * 16)
    return max(1, min(int(num_threads), batch_size))


def run_threaded(run_one: Callable[[Any], ProgramState], items: list[Any], num_threads: int | str,
                 progress_bar: bool) -> list[ProgramState]:
    threads = batch_threads(num_threads, len(items))
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(run_one, item) for item in items]
        if progress_bar:
            import tqdm
            with tqdm.tqdm(total=len(futures)) as bar:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
                return [f.result() for f in futures]
        return [f.result() for f in futures]
