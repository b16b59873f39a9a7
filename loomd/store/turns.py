"""Whose turn it is on the one writer connection: first come, first served, except that a live hook's commit goes
before every waiter that is not one (a worker's output, the back-fill's vectors, an import's slice)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class WriteTurns:
    """An asyncio lock with two queues. `hold(urgent=True)` waits only behind the holder and other urgent waiters:
    a hook's ack waits for the transaction that runs, not for every worker transaction queued behind it too (after an
    import, the catch-up queued observer chunks of 46 ms each ahead of the hooks)."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._normal: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in (*self._urgent, *self._normal))

    def locked(self) -> bool:
        return self._held

    @asynccontextmanager
    async def hold(self, urgent: bool = False) -> AsyncIterator[None]:
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: bool) -> None:
        if not self._held and not self.waiting:
            self._held = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._urgent if urgent else self._normal
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed the turn as it was cancelled: pass it on
            else:
                queue.remove(turn)
            raise

    def _release(self) -> None:
        # The turn passes straight to the next waiter (it stays held), so nobody can slip in between.
        for queue in (self._urgent, self._normal):
            while queue:
                turn = queue.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self._held = False
