"""Turns on the one writer connection (`store/turns.py`): a live hook's commit goes before the transactions that were
already waiting (workers, the back-fill), never before the one that runs; the others keep their order."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from typing import Any

import aiosqlite
from conftest import caught_up

from loomd.client import AsyncClient
from loomd.daemon import Daemon
from loomd.ingest.writer import (
    AGENT_ACTIVE_S,
    ALONE_AFTER_S,
    BACKGROUND_EVERY_S,
    BACKGROUND_SLICE_S,
    LIVE_QUIET_S,
    YIELD_MAX_S,
    LiveTraffic,
)
from loomd.store.trip import commit_in_one_trip
from loomd.store.turns import HOLDER, HOLDS_KEPT, Durations, WriteTurns, next_look


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
        assert seen == []  # (the hook may be answered already: the journal holds it)
    finally:
        release.set()  # a failure above must not leave the writer held: the daemon could never stop
    assert (await hook)["stored"] == 1
    await asyncio.gather(held, *workers)
    assert seen == [("first", 1), ("second", 1)]


def stop_hook(session_id: str, said: str) -> bytes:
    return json.dumps({"session_id": session_id, "cwd": "/tmp", "hook_event_name": "Stop", "stop_hook_active": False,
                       "last_assistant_message": said}).encode()


async def test_a_yielding_transaction_gives_way_to_a_hooks_commit_once(daemon: Daemon, client: AsyncClient) -> None:
    """A background transaction that `yields` (the observer's) stops at its next statement when a hook's commit comes
    to wait behind it, rolls back, and runs again after the hook's commit; that second run goes to its end even when
    another hook comes meanwhile. Without `yields`, the hooks wait for it (the same steps, the other order)."""
    await caught_up(client)
    store = daemon.store
    for yields in (True, False):
        session = f"give-way-{yields}"
        stopped = [threading.Event(), threading.Event()]  # a run of the body is blocked in its middle
        going = [threading.Event(), threading.Event()]  # ... and may go on
        seen: list[int] = []  # the hooks' events each run saw stored

        async def body(db: aiosqlite.Connection, session: str = session, stopped: list[threading.Event] = stopped,
                       going: list[threading.Event] = going, seen: list[int] = seen) -> int:
            run = len(seen)
            seen.append(-1)
            await db.execute("INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, 0) ON CONFLICT(name)"
                             " DO UPDATE SET value = value || excluded.value", (session, str(run)))
            if run < len(stopped):
                stopped[run].set()
                going[run].wait(30)  # on the writer's thread, holding the writer, between two statements
            rows = await db.execute_fetchall("SELECT count(*) FROM events WHERE session_id = ?", (session,))
            seen[run] = rows[0][0]
            return run

        async def hook_waits(stop: threading.Event, said: str,
                             session: str = session) -> asyncio.Task[dict[str, object]]:
            await until(stop.is_set, "the body to hold the writer")
            raw = stop_hook(session, said)
            hook = asyncio.create_task(client.call("hook", event="Stop", agent="claude", raw=raw))
            await until(lambda: store.write_waiting == 1, "the hook's commit to wait")
            return hook

        given = store.gave_way
        write = asyncio.create_task(commit_in_one_trip(store, body, yields=yields))
        try:
            first = await hook_waits(stopped[0], "first")
            assert store.give_way.is_set() is yields
            going[0].set()
            if yields:  # the first run gave way: the hook's commit went first; the second run comes
                assert (await first)["stored"] == 1
                second = await hook_waits(stopped[1], "second")
                assert not store.give_way.is_set()  # not asked twice
                going[1].set()
                assert await write == 1 and seen == [-1, 1]
                assert (await second)["stored"] == 1
            else:  # the hook waited for it
                assert await write == 0 and seen == [0]
                assert (await first)["stored"] == 1
        finally:
            for event in going:
                event.set()  # a failure above must not leave the writer held: the daemon could never stop
        value = await store.scalar("SELECT value FROM checkpoints WHERE name = ?", (session,))
        assert value == ("1" if yields else "0")  # the run that gave way left nothing
        assert store.gave_way == given + yields
        assert (await client.call("status"))["writer"]["gave_way"] == store.gave_way
        assert await store.scalar("SELECT count(*) FROM events WHERE session_id = ?", (session,)) == 1 + yields


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


OBSERVED = "SELECT count(*) FROM memories WHERE session_id = 'yield' AND kind = 'observation'"


RULE = "From now on never use print for logging, use the logging module."


def transcript_events(session: str, project: str, said: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """A session's messages (kind, text) as the `ingest` op takes them: a live submission."""
    return [{"agent": "claude", "session_id": session, "kind": kind, "payload": {"text": text},
             "ts": 1_700_000_000 + i, "project": project, "source": "transcript", "key": f"t:{session}:{i}"}
            for i, (kind, text) in enumerate(said)]


async def test_a_scheduled_worker_run_writes_nothing_while_hooks_stream(quiet: tuple[Daemon, AsyncClient]) -> None:
    """A run the scheduler started in a pause of the hooks (here: woken by an event) waits before each transaction
    while they stream: it did not write on, chunk after chunk, behind every hook's commit. A manual run is never
    held (the rest of the suite runs them while hooks come)."""
    d, client = quiet
    await client.call("ingest", events=transcript_events("yield", "proj-y", [
        ("user_message", RULE), ("assistant_message", "Noted, logging it is."),
        ("user_message", "Now add retries to the uploader.")]))
    streaming, hooks = True, 0

    async def stream() -> None:  # back to back: never the pause (LIVE_QUIET_S) that lets background work run
        nonlocal hooks
        while streaming:
            raw = json.dumps({"session_id": "live", "cwd": "/tmp", "hook_event_name": "Stop", "n": hooks})
            await client.call("hook", event="Stop", agent="claude", raw=raw.encode())
            hooks += 1

    hooker = asyncio.create_task(stream())
    try:
        await until(lambda: hooks >= 3, "the hooks to stream")
        run = asyncio.create_task(d.scheduler.run("observer", session_id="yield", trigger="event"))
        # Well within YIELD_MAX_S: the stream holds it back for good until then.
        for _ in range(40):
            await asyncio.sleep(0.05)
            if run.done():
                break
        written = await d.store.scalar(OBSERVED)
        held = not run.done()
    finally:
        streaming = False
        await hooker
    assert held and written == 0, (run.done() and run.result(), written)
    result = await run  # the hooks paused: it goes on
    assert result["outcome"] == "ok" and result["items_out"] > 0, result
    assert await d.store.scalar(OBSERVED) > 0


def test_an_unbroken_stream_of_hooks_gives_background_work_short_slices_after_a_while() -> None:
    """Background work waits while live events stream; a stream that never pauses lets it run after YIELD_MAX_S,
    in slices of BACKGROUND_SLICE_S, never a long turn during which hooks wait behind it."""
    live, t0, step = LiveTraffic(), 1000.0, 0.005
    free: list[float] = []
    for i in range(int((YIELD_MAX_S + 3.0) / step)):
        now = t0 + i * step
        live.arrived(now)
        if not live.busy(now):
            free.append(now - t0)
    assert free and min(free) >= YIELD_MAX_S
    runs, start, last = [], free[0], free[0]
    for t in free[1:]:
        if t - last > 1.5 * step:
            runs.append(last - start)
            start = t
        last = t
    runs.append(last - start)
    # Many short slices, no long turn.
    assert len(runs) >= int(3.0 / BACKGROUND_EVERY_S) and max(runs) <= BACKGROUND_SLICE_S
    assert not live.busy(last_event := t0 + 20.0) and not live.busy(last_event + 0.1)  # quiet: free at once


def test_background_work_rests_after_each_transaction_while_the_agent_works() -> None:
    """A background transaction that held the writer h seconds while the agent works (a live event came in the last
    AGENT_ACTIVE_S) holds background work back `ratio` * h after it, and says when it may go on (`resume_in`);
    on a machine the agent has left, it runs unpaced."""
    live, t0, ratio = LiveTraffic(), 1000.0, 2.0
    live.ran(0.004, ratio, t0)  # no live event yet: nothing to leave the CPU to
    assert not live.busy(t0) and live.resume_in(t0) == 0 and live.rests == 0
    live.arrived(t0)
    after = t0 + LIVE_QUIET_S + 0.01  # the hooks have paused: background work may run
    assert not live.busy(after)
    live.ran(0.004, ratio, after)
    rest = ratio * 0.004
    assert live.busy(after) and live.busy(after + rest * 0.9) and not live.busy(after + rest * 1.1)
    assert abs(live.resume_in(after) - rest) < 1e-9
    assert live.rests == 1 and abs(live.rested_s - rest) < 1e-9
    live.ran(0.001, ratio, after + 0.001)  # a shorter one meanwhile neither cuts the rest short nor counts
    assert live.busy(after + rest * 0.9) and live.rests == 1
    live.ran(0.004, ratio, after + 0.002)  # a longer one lengthens it: only what it adds counts
    assert live.rests == 2 and abs(live.rested_s - (rest + 0.002)) < 1e-9 and live.busy(after + rest + 0.001)
    left = t0 + AGENT_ACTIVE_S + 1.0  # the agent has gone quiet: no rest
    live.ran(0.004, ratio, left)
    assert not live.busy(left) and live.rests == 2
    live.ran(0.004, 0.0, after + 1.0)  # a ratio of 0: never rests
    assert not live.busy(after + 1.0) and live.rests == 2


def test_held_background_work_looks_again_when_its_hold_should_end() -> None:
    """`next_look`: until the hold's known end (a millisecond at least, so that a hold that just ended is not slept
    on for a whole poll), never longer than the poll, the poll when the end is not known (an import)."""
    assert next_look(0.004, 0.02) == 0.004 and next_look(0.5, 0.02) == 0.02
    assert next_look(0.0, 0.02) == 0.001 and next_look(-0.003, 0.05) == 0.001 and next_look(None, 0.05) == 0.05


async def test_the_writer_tells_how_long_each_background_transaction_held_it() -> None:
    """`WriteTurns.background_held` hears of a worker's and the back-fill's turns, with how long each lasted, and of
    no one else's (a hook's commit, an import's slice, a checkpoint)."""
    turns, heard = WriteTurns(), list[float]()
    turns.background_held = heard.append
    for holder, seconds in (("worker:observer", 0.02), ("events:live", 0.01), ("backfill", 0.01),
                            ("events:bulk", 0.01), ("checkpoint", 0.0), ("other", 0.0)):
        token = HOLDER.set(holder)
        try:
            async with turns.hold():
                await asyncio.sleep(seconds)
        finally:
            HOLDER.reset(token)
    assert len(heard) == 2 and heard[0] >= 0.02 and heard[1] >= 0.01, heard


async def test_a_scheduled_run_rests_after_each_of_its_transactions(quiet: tuple[Daemon, AsyncClient]) -> None:
    """A run the scheduler started while the agent works rests after every transaction it commits (the writer tells
    `LiveTraffic.ran`), and `status` counts the rests."""
    d, client = quiet
    said = [("user_message", RULE), ("assistant_message", "Noted.")] * 40
    await client.call("ingest", events=transcript_events("rest", "proj-r", [
        (kind, f"{text} ({i})") for i, (kind, text) in enumerate(said)]))  # live: the agent works
    await asyncio.sleep(LIVE_QUIET_S + 0.05)  # ... and has paused, so that the run is not held for its hooks

    def background_holds(status: dict[str, Any]) -> int:
        return sum(v["n"] for k, v in status["writer"]["holds"].items() if k == "backfill" or k.startswith("worker:"))

    before = await client.call("status")
    result = await d.scheduler.run("observer", session_id="rest", trigger="event")
    after = await client.call("status")
    assert result["outcome"] == "ok" and result["items_out"] > 0, result
    held = background_holds(after) - background_holds(before)
    paced = {k: after["writer"]["paced"][k] - before["writer"]["paced"][k] for k in ("rests", "rested_s")}
    # A rest for each: the job row's last update, right after the run's last transaction, may end within its rest.
    assert held >= 2 and held - 1 <= paced["rests"] <= held and paced["rested_s"] > 0, (held, paced)
    # And the rest is waited out: a worker's transaction that held the writer 50 ms keeps the next one (its
    # `turn`, with the scheduler's hold, as a scheduled run has) from starting for twice that after it.
    token = HOLDER.set("worker:test")
    try:
        began = time.monotonic()
        async with d.store.atomic():
            await asyncio.sleep(0.05)
        await replace(d.scheduler.ctx, hold=d.scheduler.hold, resume_in=d.scheduler.resume_in).turn()
        took = time.monotonic() - began
    finally:
        HOLDER.reset(token)
    assert took >= 3 * 0.05 * 0.95, took  # the hold, then twice as long resting (a timer may fire a little early)


async def test_the_workers_never_read_on_the_hooks_reader(quiet: tuple[Daemon, AsyncClient]) -> None:
    """Every worker's scheduled run reads on the workers' own connection, never on the hooks' reader: with that one
    held busy, each runs to its end. (The digest's, the dropper's and the reflector's choice of projects scanned the
    memories there, 3-15 ms each at 15k memories, and a prompt's recall queued behind them.)"""
    d, client = quiet
    for n in range(3):
        await client.call("ingest", events=transcript_events(f"reads-{n}", "proj-reads", [
            ("user_message", f"{RULE} ({n})"), ("assistant_message", f"Noted. ({n})")]))
    for n in range(3):
        await d.scheduler.run("observer", session_id=f"reads-{n}")  # observations for the others to read
    busy, free = threading.Event(), threading.Event()

    def hold_reader(_conn: object) -> None:
        busy.set()
        free.wait(60)

    holding = asyncio.create_task(d.store.read(hold_reader))
    try:
        await until(busy.is_set, "the hooks' reader to be held")
        for name in ("observer", "reflector", "dropper", "digest", "gc"):
            result = await asyncio.wait_for(d.scheduler.run(name, trigger="interval"), 20)
            assert result["outcome"] in ("ok", "noop"), (name, result)
    finally:
        free.set()
    await holding


def test_a_live_event_comes_alone_only_well_after_the_one_before_it() -> None:
    """An agent's hooks, each a process started after the last one ended, come alone (their commits sync where they
    ran); events that come together, from many agents or a replay, do not (the sync thread syncs them)."""
    live, now = LiveTraffic(), 1000.0
    live.arrived(now)
    assert live.alone  # the first one
    for gap, alone in ((0.012, True), (0.0004, False), (0.0009, False), (ALONE_AFTER_S + 1e-4, True), (0.001, False)):
        now += gap
        live.arrived(now)
        assert live.alone is alone, gap


def test_durations_keep_the_last_values_of_each_key_in_a_fixed_ring() -> None:
    """Each key's percentiles are over its last HOLDS_KEPT values (older ones overwritten as the ring wraps), its
    count and worst over all of them; past `max_keys`, new keys share "other"."""
    kept = Durations(max_keys=2)
    for ms in range(HOLDS_KEPT + 100):  # 0 .. HOLDS_KEPT+99: the first 100 are overwritten
        kept.record("hook:Stop", float(ms))
    kept.record("search", 7.0)
    kept.record("status", 1.0)
    summary = kept.summary()
    stop = summary["hook:Stop"]
    assert stop["n"] == HOLDS_KEPT + 100 and stop["max_ms"] == HOLDS_KEPT + 99
    assert stop["p50_ms"] == 100 + HOLDS_KEPT // 2 - 1 and stop["p99_ms"] < HOLDS_KEPT + 99
    assert summary["search"] == {"n": 1, "p50_ms": 7.0, "p90_ms": 7.0, "p99_ms": 7.0, "max_ms": 7.0}
    assert summary["other"]["n"] == 1 and "status" not in summary
