"""Whose turn it is on the one writer connection: first come, first served, except that a live hook's commit goes
before every waiter that is not one (a worker's output, the back-fill's vectors, an import's slice), and that a
holder which `yields` gives the turn up to one (`WriteTurns.give_way`)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

# Who is holding the writer, for `WriteTurns.holds`: a task sets it once for what it writes (a worker's run, the
# back-fill, the event writer); anything else is "other".
HOLDER: ContextVar[str] = ContextVar("writer_holder", default="other")
HOLDS_KEPT = 4096  # per key: the last this many durations make its percentiles


def is_background_holder(holder: str) -> bool:
    """Whether a holder is background work (a worker's run, the back-fill), which paces itself by its holds
    (`WriteTurns.background_held`)."""
    return holder == "backfill" or holder.startswith("worker:")


def next_look(left: float | None, poll: float) -> float:
    """How long background work held back (`ingest.writer.LiveTraffic`) sleeps before it looks at its hold again:
    until the hold should end (`left` seconds; a millisecond at least, as it may have ended just now), or `poll` when
    that is not known or later."""
    return poll if left is None else min(poll, max(left, 0.001))


class Durations:
    """Durations in milliseconds by key, for `status`: how long each holder kept the writer, turn taken to turn
    passed on (what a hook's commit can wait behind; `writer`), and how long the daemon took to answer each op
    (`service`)."""

    def __init__(self, max_keys: int | None = None) -> None:
        # Per key, a ring of HOLDS_KEPT doubles (32 KB), whole from the key's first value: a deque of floats grew by
        # 32 bytes a value (an object and its pointer) until full, minutes into a busy daemon's life, and a
        # long-running process's memory must not climb for its own bookkeeping.
        self._ms: dict[str, array[float]] = {}
        self._count: dict[str, int] = {}
        self._max: dict[str, float] = {}
        self.max_keys = max_keys  # keys named by clients (an op, a hook's event): past this many, one "other"

    def record(self, holder: str, ms: float) -> None:
        if self.max_keys is not None and holder not in self._ms and len(self._ms) >= self.max_keys:
            holder = "other"
        ring = self._ms.get(holder)
        if ring is None:
            ring = self._ms[holder] = array("d", bytes(8 * HOLDS_KEPT))
        count = self._count.get(holder, 0)
        ring[count % HOLDS_KEPT] = ms
        self._count[holder] = count + 1
        self._max[holder] = max(self._max.get(holder, 0.0), ms)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per key: how many so far and the worst; p50/p90/p99 of the last HOLDS_KEPT (milliseconds)."""
        out: dict[str, dict[str, Any]] = {}
        for holder, ring in sorted(self._ms.items()):
            xs = sorted(ring[:min(self._count[holder], HOLDS_KEPT)])
            at = {q: round(xs[max(0, math.ceil(q * len(xs)) - 1)], 2) for q in (0.5, 0.9, 0.99)}
            out[holder] = {"n": self._count[holder], "p50_ms": at[0.5], "p90_ms": at[0.9], "p99_ms": at[0.99],
                           "max_ms": round(self._max[holder], 2)}
        return out


class WriteTurns:
    """An asyncio lock with two queues. `hold(urgent=True)` waits only behind the holder and other urgent waiters:
    a hook's ack waits for the transaction that runs, not for every worker transaction queued behind it too (after an
    import, the catch-up queued observer chunks of 46 ms each ahead of the hooks).

    And not even for that one, when its holder `yields`: an urgent waiter then sets `give_way`, which the holder's
    statements look at on the writer's thread (`store.trip`); its transaction rolls back, the turn passes to the
    waiter, and the holder takes it again and redoes the transaction (`Store.commit_on_thread`). During a catch-up
    a hook's commit waited for the writer 1.5 ms on average (4.9 at p90), most of it behind observer transactions;
    with the observer's yielding, 0.4 (1.2 at p90) (closing note, stop 47)."""

    def __init__(self) -> None:
        self._held = False
        self._yields = False  # the holder gives way to an urgent waiter
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._normal: deque[asyncio.Future[None]] = deque()
        self.holds = Durations()
        # Set on the loop, read on the writer's thread between two statements of a yielding holder's transaction.
        self.give_way = threading.Event()
        # Told how long each background holder's turn lasted (seconds): the daemon's `LiveTraffic.ran`.
        self.background_held: Callable[[float], None] = lambda seconds: None

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in (*self._urgent, *self._normal))

    def locked(self) -> bool:
        return self._held

    @asynccontextmanager
    async def hold(self, urgent: bool = False, yields: bool = False) -> AsyncIterator[None]:
        """The turn; `yields`: this holder's transaction gives way to an urgent waiter (see above)."""
        await self._acquire(urgent)
        self.give_way.clear()  # whatever an earlier holder was asked
        self._yields = yields
        began = time.perf_counter()
        try:
            yield
        finally:
            self._yields = False
            held, holder = time.perf_counter() - began, HOLDER.get()
            self.holds.record(holder, held * 1000)
            self._release()
            if is_background_holder(holder):
                self.background_held(held)

    async def _acquire(self, urgent: bool) -> None:
        if not self._held and not self.waiting:
            self._held = True
            return
        if urgent and self._yields:
            self.give_way.set()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._urgent if urgent else self._normal
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed the turn as it was cancelled: pass it on
            elif turn in queue:
                # Not there when a release ran between the cancel and this handler: it passed over the cancelled
                # turn already (a soak's hook whose client gave up saw ValueError here instead of its cancel).
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
