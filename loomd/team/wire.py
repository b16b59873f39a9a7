"""A thread with an event loop of its own, where sync's server connection lives and its round trips run.

A push batch is ~170 KB on the wire (a hundred rows, each with its 384-d vector). On the daemon's event loop,
writing it to the server's socket (on loopback, the kernel's whole TCP path runs inside `send`), sending the rows to
the offload process and asyncpg's encoding of them held the loop ~2.7 ms a batch, time a hook waiting behind it
felt. Here the loop only hands a batch over and is woken with the result: the socket and pipe writes run on this
thread without the interpreter lock, and the encoding holds it in pieces far shorter than that.

asyncpg binds a connection to the loop that opened it: every use of one opened here (connect, push, pull, close)
goes through `run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Wire:
    """The thread, started on first use; `run(fn, *args)` awaits `fn(*args)` on its loop from any other loop."""

    def __init__(self, name: str = "loomd-sync") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                # A daemon thread: a daemon that exits without `stop` (a crash) is not held open by it.
                self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`fn(*args)` on the thread's loop. Cancelling the caller cancels it there too (run_coroutine_threadsafe
        chains the two futures)."""
        loop = self._started()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_call(fn, args), loop))

    def stop(self) -> None:
        """End the thread (after the connection is closed through `run`); a later `run` starts a fresh one."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        # Anything still running there (a daemon stopping mid-cycle) is cancelled, and its caller with it, rather
        # than left waiting on a loop that no longer runs.
        asyncio.run_coroutine_threadsafe(_drain(), loop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()


async def _call(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)


async def _drain() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()
