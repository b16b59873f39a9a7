"""The log's shared syncs: a durable commit returns after an fsync begun after it, and the writer is free meanwhile."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

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


async def test_a_lone_live_commit_is_synced_on_the_writers_thread_and_comes_back_durable(store: Store) -> None:
    create = "CREATE TABLE IF NOT EXISTS wal_probe (key, value)"
    for body in (lambda conn: conn.execute(create), insert("hook")):
        _, mark = await store.commit_on_thread(body, durable=False, sync=True, urgent=True)
        assert store.durable_commits > mark  # on disk as it comes back: no wait for a sync thread's call
    # ... and no sync thread was ever woken for them (asked to sync, the store starts one).
    assert not [t for t in threading.enumerate() if t.name == "loomd-wal-sync"]
    assert store.wal.syncs == 2
    await store.wal.wait(mark + 1)


async def test_a_sync_on_the_writers_thread_also_resolves_the_commits_waiting_before_it(store: Store) -> None:
    await store.commit_on_thread(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS wal_probe (key, value)"))
    gate = threading.Event()
    store.wal.run_on_thread(gate.wait)  # the sync thread held up: it syncs nothing until the gate opens
    try:
        waiting = asyncio.create_task(store.commit_on_thread(insert("worker")))  # durable: waits for a sync
        for _ in range(1000):
            if store.wal.pending:
                break
            await asyncio.sleep(0.005)
        assert not waiting.done()
        # A hook's commit with no sync running syncs the log itself; that fsync began after the first COMMIT too.
        await asyncio.wait_for(store.commit_on_thread(insert("hook"), durable=False, sync=True, urgent=True), 30)
        await asyncio.wait_for(waiting, 30)  # resolved although the sync thread still waits at the gate
        assert not gate.is_set()
    finally:
        gate.set()
    rows = await store.fetchall("SELECT key FROM wal_probe ORDER BY key")
    assert [r[0] for r in rows] == ["hook", "worker"]
