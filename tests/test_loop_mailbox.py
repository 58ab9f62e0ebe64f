"""LoopMailbox: calls posted from another thread run on the loop in order, batched into one wake-up."""

import asyncio
import threading

from radixlm.core.runtime.loop_mailbox import LoopMailbox


def test_calls_posted_while_the_loop_is_busy_run_in_order_after_one_wake_up():
    async def main() -> tuple[list[int], int, list[int]]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        mailbox = LoopMailbox(loop)
        got: list[int] = []
        on_loop: list[int] = []

        def take(i: int) -> None:
            got.append(i)
            on_loop.append(threading.get_ident())

        poster = threading.Thread(target=lambda: [mailbox.post(take, i) for i in range(200)])
        poster.start()
        poster.join()  # the loop did not run meanwhile: all 200 wait for one wake-up
        for _ in range(10):
            await asyncio.sleep(0)
        return got, wakeups, on_loop

    got, wakeups, on_loop = asyncio.run(main())
    assert got == list(range(200))
    assert wakeups == 1
    assert set(on_loop) == {threading.get_ident()}


def test_a_failing_call_does_not_stop_the_others(caplog):
    async def main() -> list[int]:
        mailbox = LoopMailbox(asyncio.get_running_loop())
        got: list[int] = []

        def take(i: int) -> None:
            if i == 1:
                raise ValueError("receiver gone")
            got.append(i)

        for i in range(3):
            mailbox.post(take, i)
        await asyncio.sleep(0)
        mailbox.post(take, 3)  # after a batch ran, the next post wakes the loop again
        await asyncio.sleep(0)
        return got

    assert asyncio.run(main()) == [0, 2, 3]
    assert "a call posted to the event loop failed" in caplog.text
