"""The threads a request is prepared on, off the caller's thread (the server's event loop) and under
the `prepare_timeout` budget: tokenizing and templating on one pool, compiling constraints on another,
so that a slow compile never holds up plain prompts."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

from radixlm.core.errors import TooComplexError


class PrepareWorkers:
    def __init__(self, workers: int, timeout: float) -> None:
        self.timeout = timeout
        self._tokenize = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="radixlm-tokenize")
        self._compile = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="radixlm-compile")

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (tokenizing, templating) on a tokenize thread, awaited within the budget."""
        return await self._within_budget_async(self._tokenize.submit(fn, *args), "request")

    def compile(self, fn: Callable[..., Any], what: str, *args: Any) -> Any:
        """`fn(*args)` on a compile thread, waited for within the budget; `what` names the constraint
        kind in a too-complex error."""
        future = self._compile.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the work goes on in its thread, but nothing waits for it
            raise self._over_budget(what) from None

    async def compile_async(self, fn: Callable[..., Any], what: str, *args: Any) -> Any:
        return await self._within_budget_async(self._compile.submit(fn, *args), what)

    def close(self) -> None:
        for pool in (self._tokenize, self._compile):
            pool.shutdown(wait=False, cancel_futures=True)

    async def _within_budget_async(self, future: concurrent.futures.Future, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except asyncio.TimeoutError:
            raise self._over_budget(what) from None

    def _over_budget(self, what: str) -> TooComplexError:
        return TooComplexError(f"the {what} is too complex: preparing it took longer than the budget of "
                               f"{self.timeout:g} s (prepare_timeout)", what)
