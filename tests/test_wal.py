"""The log's shared syncs: a durable commit returns after an fsync begun after it, and the writer is free meanwhile."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

from loomd.store.db import Store


def insert(value: str) -> object:
    def body(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO wal_probe (key, value) VALUES (?, ?)", (value, value))
    return body


async def test_durable_commit_waits_for_the_logs_sync_without_holding_the_writer(store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    gate = threading.Event()
    # The sync thread busy (a slow disk, say): the next fsync of the log cannot begin until the gate opens.
    store.wal.run_on_thread(gate.wait)
    durable = asyncio.create_task(store.commit_on_thread(insert("durable")))
    for _ in range(1000):
        if store.wal.pending:  # committed, waiting for its sync
            break
        await asyncio.sleep(0.005)
    assert not durable.done()
    _, mark = await asyncio.wait_for(store.commit_on_thread(insert("meanwhile"), durable=False), 30)
    assert not durable.done()  # the writer was free for another transaction while the first waited for the disk
    assert store.durable_commits <= mark  # the second is not on disk yet: no sync has begun since it
    gate.set()
    await asyncio.wait_for(durable, 30)
    await store.commit_on_thread(insert("after"))  # its sync began after the second commit: that one is on disk now
    assert store.durable_commits > mark and store.wal.syncs >= 2
    rows = await store.fetchall("SELECT key FROM wal_probe ORDER BY key")
    assert [r[0] for r in rows] == ["after", "durable", "meanwhile"]


async def test_an_atomic_transaction_returns_after_a_sync_of_every_commit_before_it(store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    _, mark = await store.commit_on_thread(insert("quick"), durable=False)
    async with store.atomic() as db:  # it returns after a sync of the log begun after its COMMIT
        await db.execute("INSERT INTO wal_probe (key, value) VALUES ('full', 'full')")
    assert store.durable_commits > mark


async def test_an_atomic_transaction_waits_for_the_logs_sync_without_holding_the_writer(store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    gate = threading.Event()
    # The sync thread busy: the fsync after the transaction's COMMIT cannot begin until the gate opens.
    store.wal.run_on_thread(gate.wait)

    async def write() -> None:
        async with store.atomic() as db:
            await db.execute("INSERT INTO wal_probe (key, value) VALUES ('atomic', 'atomic')")

    atomic = asyncio.create_task(write())
    try:
        for _ in range(1000):
            if store.wal.pending:  # committed, waiting for its sync
                break
            await asyncio.sleep(0.005)
        assert not atomic.done()
        # A FULL commit held the writer for its fsync; now another transaction commits while the first waits.
        await asyncio.wait_for(store.commit_on_thread(insert("meanwhile"), durable=False), 30)
        assert not atomic.done()
    finally:
        gate.set()
    await asyncio.wait_for(atomic, 30)
    rows = await store.fetchall("SELECT key FROM wal_probe ORDER BY key")
    assert [r[0] for r in rows] == ["atomic", "meanwhile"]



async def test_the_writers_thread_asks_for_the_sync_so_it_begins_while_the_loop_is_busy(store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    _, mark = await store.commit_on_thread(insert("asked"), durable=False, sync=True)
    deadline = time.monotonic() + 30
    while store.durable_commits <= mark and time.monotonic() < deadline:
        time.sleep(0.005)  # noqa: ASYNC251 - the event loop blocked: nothing it hands the sync thread can start
    assert store.durable_commits > mark  # the fsync ran all the same: the writer's thread asked for it itself
    await store.wal.wait(mark + 1)


async def test_a_hooks_commit_runs_on_the_event_loops_thread_and_the_sync_thread_makes_it_durable(
        store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    threads: list[int] = []

    def hook(conn: sqlite3.Connection) -> None:
        threads.append(threading.get_ident())
        conn.execute("INSERT INTO wal_probe (key, value) VALUES ('hook', 'hook')")

    _, mark = await store.commit_on_thread(hook, durable=False, sync=True, urgent=True)
    assert threads == [threading.get_ident()]  # the loop's own thread: no trip to the writer's
    await asyncio.wait_for(store.wal.wait(mark + 1), 30)  # the sync it asked for ran on the sync thread
    assert [t for t in threading.enumerate() if t.name == "loomd-wal-sync"]
    assert [r[0] for r in await store.fetchall("SELECT key FROM wal_probe")] == ["hook"]


async def test_a_hook_that_came_alone_is_synced_where_it_committed_and_comes_back_durable(store: Store) -> None:
    create = "CREATE TABLE IF NOT EXISTS wal_probe (key, value)"
    for body in (lambda conn: conn.execute(create), insert("hook")):
        _, mark = await store.commit_on_thread(body, durable=False, sync=True, urgent=True, alone=True)
        assert store.durable_commits > mark  # on disk as it comes back: no wait for a sync thread's call
    # ... and no sync thread was ever woken for them (asked to sync, the store starts one).
    assert not [t for t in threading.enumerate() if t.name == "loomd-wal-sync"]
    assert store.wal.syncs == 2
    await store.wal.wait(mark + 1)


async def test_a_hook_that_came_alone_while_a_sync_runs_is_synced_beside_it_and_comes_back_durable(
        store: Store) -> None:
    """A sync running on the sync thread (a worker's commit asked for it) began before the hook's commit ended, so it
    cannot cover it: the hook's own fsync runs beside it, and the hook waits for no other."""
    create = "CREATE TABLE IF NOT EXISTS wal_probe (key, value)"
    await store.commit_on_thread(lambda conn: conn.execute(create), durable=False, sync=True, urgent=True, alone=True)
    running, release = threading.Event(), threading.Event()

    def fsync_running() -> None:
        with store.wal._syncing:  # noqa: SLF001 - held as the sync thread holds it through an fsync (a slow disk's)
            running.set()
            release.wait(30)

    holder = threading.Thread(target=fsync_running)
    holder.start()
    try:
        assert await asyncio.to_thread(running.wait, 30)
        _, mark = await store.commit_on_thread(insert("hook"), durable=False, sync=True, urgent=True, alone=True)
        assert store.durable_commits > mark  # on disk as it comes back, while the other sync still runs
    finally:
        release.set()
        await asyncio.to_thread(holder.join)
    assert store.wal.syncs == 2
    assert [r[0] for r in await store.fetchall("SELECT key FROM wal_probe")] == ["hook"]


async def test_a_cancelled_transaction_ends_on_the_writers_thread_before_a_hooks_commit_runs(store: Store) -> None:
    """The writer is passed on only once the writer's thread is done with what its holder queued there: a hook's
    commit, on the loop's thread, must never run inside (or beside) a transaction still open on the other."""
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    inside, gate = threading.Event(), threading.Event()

    def slow(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO wal_probe (key, value) VALUES ('cancelled', 'a')")
        inside.set()
        gate.wait(30)  # still inside its transaction when its caller is cancelled
        conn.execute("INSERT INTO wal_probe (key, value) VALUES ('cancelled', 'b')")

    background = asyncio.create_task(store.commit_on_thread(slow))
    try:
        assert await asyncio.to_thread(inside.wait, 30)
        background.cancel()
        hook = asyncio.create_task(store.commit_on_thread(insert("hook"), durable=False, sync=True, urgent=True))
        await asyncio.sleep(0.3)
        assert not hook.done()  # the cancelled transaction is still open on the writer's thread
    finally:
        gate.set()
    await asyncio.wait_for(hook, 30)  # after its ROLLBACK: BEGIN on the loop's thread found no transaction open
    with pytest.raises(asyncio.CancelledError):
        await background
    assert [r[0] for r in await store.fetchall("SELECT key FROM wal_probe")] == ["hook"]


async def test_an_atomic_transaction_cancelled_twice_rolls_back_before_a_hooks_commit_runs(store: Store) -> None:
    """A second cancellation while its ROLLBACK waits behind a slow statement: the writer still is not passed on
    before that ROLLBACK has run (`asyncio.shield` returned at once, and a hook's commit met the open transaction)."""
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    inside, gate = threading.Event(), threading.Event()

    def slow() -> int:
        inside.set()
        gate.wait(30)
        return 1

    store.writer._conn.create_function("slow", 0, slow)  # noqa: SLF001 - a statement that runs as long as the test wants

    async def atomic() -> None:
        async with store.atomic() as db:
            await db.execute("INSERT INTO wal_probe (key, value) VALUES ('atomic', slow())")

    task = asyncio.create_task(atomic())
    try:
        assert await asyncio.to_thread(inside.wait, 30)
        task.cancel()  # its ROLLBACK queues behind the slow INSERT
        await asyncio.sleep(0.05)
        task.cancel()  # and it is cancelled again while it waits for it
        hook = asyncio.create_task(store.commit_on_thread(insert("hook"), durable=False, sync=True, urgent=True))
        await asyncio.sleep(0.3)
        assert not hook.done()
    finally:
        gate.set()
    await asyncio.wait_for(hook, 30)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r[0] for r in await store.fetchall("SELECT key FROM wal_probe")] == ["hook"]


async def test_no_commit_checkpoints_the_log_the_checkpoint_thread_does_after_the_syncs(store: Store) -> None:
    """SQLite's own checkpoint runs inside the commit that takes the log past 1,000 pages: on the event loop's thread
    for a hook's commit, which it would stop for the whole copy. The writer never runs one; the checkpoint thread
    copies the log into the database file once the commits' sync has run."""
    db, wal = store.path, store.path.with_name(store.path.name + "-wal")
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    for _ in range(3000):  # the checkpoint its sync asked for
        if store.checkpoints.runs:
            break
        await asyncio.sleep(0.01)
    gate = threading.Event()
    store.wal.run_on_thread(gate.wait)  # the sync thread held: no sync, so no checkpoint is asked for yet
    try:
        size = db.stat().st_size
        blob = b"x" * 3000  # a page of the log each: 2,000 pages, twice the line SQLite checkpoints at by itself
        for n in range(2000):
            await store.commit_on_thread(lambda conn, n=n: conn.execute(
                "INSERT INTO wal_probe (key, value) VALUES (?, ?)", (str(n), blob)), durable=False, sync=True,
                urgent=True)
        assert wal.stat().st_size > 2000 * 3000 and db.stat().st_size == size  # no commit copied anything
    finally:
        gate.set()
    for _ in range(3000):
        if db.stat().st_size > 2000 * 3000:
            break
        await asyncio.sleep(0.01)
    assert db.stat().st_size > 2000 * 3000  # after the sync, the checkpoint thread copied the log into the file
    assert [t for t in threading.enumerate() if t.name == "loomd-wal-checkpoint"]
    for _ in range(3000):
        if store.checkpoints.status()["frames_left"] == 0:
            break
        await asyncio.sleep(0.01)
    assert store.checkpoints.status()["frames_left"] == 0 and store.checkpoints.failed == 0


def log_restarts(store: Store) -> int:
    """How many times the log was started over: its header's checkpoint sequence number (SQLite's WAL format)."""
    with open(f"{store.path}-wal", "rb") as f:
        return int.from_bytes(f.read(16)[12:16], "big")


async def test_a_copied_log_is_started_over_in_a_pause_of_the_hooks_not_by_the_next_hooks_commit(store: Store) -> None:
    """Once a checkpoint has copied all of the log, the next write transaction starts it over: SQLite writes its new
    header and waits for its fsync inside that COMMIT. The store does that write itself, once live hooks have paused,
    so the hook that comes next commits into a log already started over."""
    quiet_at = [time.monotonic() + 1.5]  # hooks arrived: they will have paused in 1.5 s
    store.resume_in = lambda: max(0.0, quiet_at[0] - time.monotonic())
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    before = log_restarts(store)
    for _ in range(3000):  # the checkpoint the commit's sync asked for copies all of the log
        if store.checkpoints.runs and store.checkpoints.status()["frames_left"] == 0:
            break
        await asyncio.sleep(0.005)
    assert store.checkpoints.status()["log_frames"] > 0 and time.monotonic() < quiet_at[0]
    await asyncio.sleep(0.1)
    assert store.restarts == 0 and log_restarts(store) == before  # not while hooks arrive
    for _ in range(3000):
        if store.restarts:
            break
        await asyncio.sleep(0.005)
    assert store.restarts == 1 and time.monotonic() >= quiet_at[0]  # in the pause, not before it
    assert log_restarts(store) == before + 1
    await store.commit_on_thread(insert("a hook"), urgent=True)  # the next live commit: into the log started over
    assert log_restarts(store) == before + 1
    rows = await store.fetchall("SELECT key FROM wal_probe")
    assert [r[0] for r in rows] == ["a hook"]
