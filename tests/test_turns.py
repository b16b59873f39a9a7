"""Turns on the one writer connection (`store/turns.py`): a live hook's commit goes before the transactions that were
already waiting (workers, the back-fill), never before the one that runs; the others keep their order."""

from __future__ import annotations

import asyncio
import json

from conftest import caught_up

from loomd.client import AsyncClient
from loomd.daemon import Daemon
from loomd.store.turns import WriteTurns


async def until(cond: object, what: str, within: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_a_hooks_commit_goes_before_waiting_worker_transactions(daemon: Daemon, client: AsyncClient) -> None:
    await caught_up(client)
    store = daemon.store
    running, release = asyncio.Event(), asyncio.Event()
    seen: list[tuple[str, int]] = []

    async def holder() -> None:  # the transaction that runs when the hook comes: the hook waits for it
        async with store.atomic():
            running.set()
            await release.wait()

    async def worker(name: str) -> None:  # waiting already when the hook comes: it goes after the hook's commit
        async with store.atomic() as db:
            async with db.execute("SELECT count(*) FROM events WHERE session_id = 'turns'") as cur:
                row = await cur.fetchone()
            assert row is not None
            seen.append((name, int(row[0])))

    held = asyncio.create_task(holder())
    await running.wait()
    workers = [asyncio.create_task(worker(name)) for name in ("first", "second")]
    try:
        await until(lambda: store.write_waiting == 2, "the workers to wait")
        raw = json.dumps({"session_id": "turns", "cwd": "/tmp", "hook_event_name": "Stop", "stop_hook_active": False})
        hook = asyncio.create_task(client.call("hook", event="Stop", agent="claude", raw=raw.encode()))
        await until(lambda: store.write_waiting == 3, "the hook's commit to wait")
        assert seen == [] and not hook.done()
    finally:
        release.set()  # a failure above must not leave the writer held: the daemon could never stop
    assert (await hook)["stored"] == 1
    await asyncio.gather(held, *workers)
    assert seen == [("first", 1), ("second", 1)]


async def test_a_waiter_cancelled_as_the_turn_passes_over_it_leaves_the_writer_free() -> None:
    """A waiter's task cancelled (its client gave up) while the holder releases, before the waiter's own handler runs:
    the release passed over its cancelled turn already. The waiter ends cancelled, nothing else, and the next comer
    takes the writer at once."""
    turns = WriteTurns()
    async with turns.hold():
        waiter = asyncio.create_task(turns.hold().__aenter__())
        await asyncio.sleep(0)  # it waits for its turn
        waiter.cancel()  # cancels its turn now; its handler runs on the next pass of the loop
    # released here, in the same pass: the cancelled turn is skipped and taken off its queue
    done, _ = await asyncio.wait([waiter], timeout=5)
    assert done and waiter.cancelled(), waiter
    assert not turns.locked() and turns.waiting == 0
    async with asyncio.timeout(5):
        async with turns.hold(urgent=True):
            assert turns.locked()
