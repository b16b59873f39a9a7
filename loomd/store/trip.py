"""Write code written against aiosqlite (`insert_memory`, `write_derived`, a worker's checkpoint), run to its end on
the writer connection's own thread in one trip.

Inside a transaction every `await db.execute(...)` is a trip: queued to the connection's thread, run, and handed
back to the event loop, which resumes the caller when it gets round to it. A worker's chunk is a hundred or more
statements, and while the loop serves hooks, the back-fill and the other workers, each trip waits for it: an
observer chunk held the writer 46 ms at the median, up to 480 ms, after an import, and every hook's commit waited
behind it. `in_one_trip` runs the same coroutine on the connection's thread over the plain sqlite3 handle, where
every await completes at once: the writer is held for the statements alone.

A transaction that `yields` looks, before each statement, whether a hook's commit waits for the writer
(`WriteTurns.give_way`): then it stops there (`GaveWay`), rolls back and is run again after the hook.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from typing import Any, Generic, TypeVar, cast

import aiosqlite

from loomd.store.db import GaveWay, Store, on_thread

T = TypeVar("T")


class _Now(Generic[T]):
    """An awaitable that is done already: awaiting it never suspends."""

    def __init__(self, value: T) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, T]:
        return self.value
        yield  # a generator that returns at once


class _Cursor:
    """A sqlite3 cursor with aiosqlite's cursor interface (what loomd's write code uses of it)."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()


class _Executed(_Now[_Cursor]):
    """What `execute` returns: awaited, the cursor; or used with `async with`, as aiosqlite's result is."""

    async def __aenter__(self) -> _Cursor:
        return self.value

    async def __aexit__(self, *exc: object) -> None:
        self.value._cursor.close()  # noqa: SLF001 - its own wrapper's cursor


class _OnThread:
    """The writer's sqlite3 handle behind aiosqlite's connection interface, for code run by `in_one_trip`; with
    `give_way`, each statement first looks whether it is asked to (`GaveWay`)."""

    def __init__(self, conn: sqlite3.Connection, give_way: threading.Event | None = None) -> None:
        self._conn = conn
        self._give_way = give_way

    def _check(self) -> None:
        if self._give_way is not None and self._give_way.is_set():
            raise GaveWay

    def execute(self, sql: str, parameters: Any = ()) -> _Executed:
        self._check()
        return _Executed(_Cursor(self._conn.execute(sql, parameters)))

    async def executemany(self, sql: str, parameters: Iterable[Any]) -> _Cursor:
        self._check()
        return _Cursor(self._conn.executemany(sql, parameters))

    async def execute_fetchall(self, sql: str, parameters: Any = ()) -> list[Any]:
        self._check()
        return self._conn.execute(sql, parameters).fetchall()


def plain(db: aiosqlite.Connection) -> sqlite3.Connection:
    """The sqlite3 handle under the connection given to code run in one trip (`run_through`), for synchronous code
    over it (a reader's function, run inside a write transaction)."""
    if not isinstance(db, _OnThread):
        raise TypeError("not a connection run in one trip")
    return db._conn  # noqa: SLF001 - its own wrapper's handle, on the thread running it


class Suspended(RuntimeError):
    """Code run by `in_one_trip` awaited something other than the connection (a sleep, another task)."""


def run_through(body: Callable[[aiosqlite.Connection], Awaitable[T]], conn: sqlite3.Connection, *,
                give_way: threading.Event | None = None) -> T:
    """`body` over `conn`, on the calling thread, to its end (the writer's thread: see `in_one_trip`), or to the
    first statement after `give_way` is set (`GaveWay`)."""
    # The interface its code uses, on the plain handle.
    coro = body(cast(aiosqlite.Connection, _OnThread(conn, give_way)))
    if not isinstance(coro, Coroutine):
        raise TypeError(f"not a coroutine: {coro!r}")
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise Suspended("a write run in one trip awaited something other than the connection")


async def in_one_trip(db: aiosqlite.Connection, body: Callable[[aiosqlite.Connection], Awaitable[T]]) -> T:
    """Run `body` (async write code over the connection, inside the caller's transaction) on the writer's thread in
    one trip. It must await nothing but the connection, and touch nothing the event loop owns (the caller does that
    with what it returns). A caller cancelled meanwhile leaves it to finish there; its transaction's ROLLBACK
    queues behind it, as behind any statement."""
    return await on_thread(db, functools.partial(run_through, body))


async def commit_in_one_trip(store: Store, body: Callable[[aiosqlite.Connection], Awaitable[T]], *,
                             yields: bool = False) -> T:
    """`body` in a write transaction of its own, BEGIN, body and COMMIT in one trip to the writer's thread
    (`Store.commit_on_thread`): the writer is held for its statements alone. `yields`: the transaction gives way
    to a hook's commit, and is run again after it; `body` must then do nothing but its statements (it may run
    twice, the first time rolled back)."""
    # `give_way` is set only while a holder that yields has a hook's commit behind it: a transaction that does not
    # yield never sees it set.
    result, _ = await store.commit_on_thread(functools.partial(run_through, body, give_way=store.give_way),
                                             yields=yields)
    return result
