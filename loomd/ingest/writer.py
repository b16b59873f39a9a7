"""Group commit: concurrent submitters share one transaction; each is acknowledged only once it is on disk.

Two kinds of submitters. Live ones (a hook, the `ingest` op, a spool replay) share group commits as they come. Bulk
ones (`loom import`'s files, the tailer's chunks: hundreds of events each, with capture rules to run on every one)
are committed in slices of a few milliseconds, one slice between two live commits, so that a hook waits behind at
most one slice instead of a whole file's worth of inserts and captures (a 500-event import batch held the writer
56 ms at the median, 320 ms at worst, on 2 CPUs).

Every commit here ends without waiting for the disk (synchronous NORMAL), so the writer is held for the statements
alone (the workers' and the back-fill's statements run while the disk works); its submitters are acknowledged after
an fsync of the log begun after it (`store.wal.WalSync`). A bulk submitter waits for the sync after its last slice,
which covers the earlier ones (the log is append-only)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

from loomd.errors import Busy, StorageError
from loomd.ignore import FILE_NAME as IGNORED_FILE
from loomd.ignore import IgnoredProjects, covers
from loomd.ingest.events import PROMPT_MARK, Event, paired_dedup
from loomd.ingest.parser import EventParser
from loomd.ingest.project import project_of
from loomd.offload import Offload
from loomd.store.db import Store
from loomd.store.trip import run_through
from loomd.store.turns import HOLDER

log = logging.getLogger(__name__)


# A processor runs inside the commit transaction with the freshly stored events (capture rules, a tailer's offset), on
# the writer's thread or, in a live commit, the event loop's (`store.trip.run_through`): it awaits nothing but the
# connection and touches nothing the event loop owns; what it has for the loop waits for a listener.
Processor = Callable[[aiosqlite.Connection, Sequence[Event]], Awaitable[None]]
# A listener runs after the commit, outside the transaction, on the loop (wake workers, start tailers).
Listener = Callable[[Sequence[Event]], None]


class ProcessorFailed(Exception):
    """A processor raised inside a commit (a bug it must not turn into a lost event)."""


@dataclass
class Batch:
    events: list[Event]
    future: asyncio.Future[list[Event]]
    also: Processor | None = None
    committed: int = 0  # a bulk batch's events committed so far (its slices)
    answered: bool = False  # its submitter did not wait for this commit (the hook journal holds the events)


# A bulk slice holds the writer about this long: what a hook arriving meanwhile waits for, besides its own commit.
SLICE_S = 0.004
SLICE_MIN, SLICE_FIRST = 4, 16  # events in a slice: at least; before the cost of an event is known


RECENT_ERRORS = 10

# Background work (the back-fill, the scheduled workers) yields while live events arrive: it waits until they have
# paused this long. An agent's hooks come in bursts (a tool call's Pre/PostToolUse, a prompt) between pauses of
# seconds (the model thinking); a burst of hooks, many agents at once or a spool replay is served first. A run begun
# in a pause yields too: its next transaction waits (`workers.base.WorkerContext`).
LIVE_QUIET_S = 0.5
# Held background work resumes this long after the pause's end, so that it finds the pause begun (`resume_in`).
RESUME_AFTER_S = 0.002
# ... but a stream of live events that never pauses holds it back at most YIELD_MAX_S; from then on background work
# gets a slice of BACKGROUND_SLICE_S in every BACKGROUND_EVERY_S, for as long as the stream lasts: it always progresses
# (a sixth of the time, as the 2 s turn in every 12 s before), and a hook never waits behind more than what one slice
# began. (A turn of 2 s let the observer and the back-fill run unchecked: ack p99 went from 7 to 53 ms.) Not the bulk
# slices above: those cut an import's commits, these give background work its time.
YIELD_MAX_S = 10.0
BACKGROUND_SLICE_S, BACKGROUND_EVERY_S = 0.05, 0.3
# While the agent works (a live event came in the last AGENT_ACTIVE_S), background work also paces itself: after each of
# its transactions it rests `background_rest_ratio` (2) times as long as the transaction held the writer (`ran`), so it
# runs about a third of the time (a background transaction already waiting for the writer when another ends still goes
# first; the scheduler's job rows and a transaction that gave way to a hook are not held). A hook's process starts and
# runs its interpreter (12-15 ms of CPU) before the daemon hears of it, and on 2 CPUs a back-fill or a catch-up writing
# back to back took half of the CPU that process ran on: under `bench/hooks.py --background-catchup` the slowest spawns
# waited 15-35 ms for a CPU the writer's thread held (`bench/schedtrace.py`, closing note of stop 65). Resting, it
# leaves that CPU free most of the time. Runs of 30 rounds of that bench (the observer's catch-up), a spawn's wait (its
# wall time less its own CPU time, which the machine's speed changes run to run), all ten kinds pooled, at p95 / p99:
# 15.2-17.5 / 22.6-32.4 ms in three runs unpaced, 9.7-12.9 / 14.5-19.4 ms in three runs paced; the interpreter floor's
# own spawns waited less too. One run resting four times the hold gave 8.7 / 17.2 ms, within the spread of those paced
# at two, and observed half as much. A catch-up while the agent works is slower (events observed during the rounds:
# 27.4k in each run unpaced, 20.2-25.4k paced); on a machine the agent has left (no hook for AGENT_ACTIVE_S) it runs
# unpaced.
AGENT_ACTIVE_S = 30.0
# A live event that came this long after the one before it came alone (an agent's hooks are processes started one after
# another, 10 ms and more apart; hooks that come together, from many agents or a replay, are under a millisecond
# apart): its commit syncs the log right where it ran (`Store.commit_on_thread`, `alone`).
ALONE_AFTER_S = 0.005


class LiveTraffic:
    """When live events last arrived, and whether background work should wait for them to pause (`busy`)."""

    def __init__(self) -> None:
        self.last = -math.inf  # monotonic time of the last live submission
        self.alone = False  # the last one came ALONE_AFTER_S or more after the one before it
        self._streak: float | None = None  # since when live events have arrived without a pause
        self._rest_until = -math.inf  # background work rests until then (`ran`)
        self.rests = 0  # rests taken so far, and their length in all (`status`'s `writer.paced`)
        self.rested_s = 0.0

    def arrived(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.alone, self.last = now - self.last >= ALONE_AFTER_S, now

    def ran(self, seconds: float, ratio: float, now: float | None = None) -> None:
        """A background transaction held the writer `seconds` (`WriteTurns`): while the agent works, background work
        rests `ratio` times that long before its next one (`busy`)."""
        now = time.monotonic() if now is None else now
        if ratio > 0 and now - self.last < AGENT_ACTIVE_S and (until := now + ratio * seconds) > self._rest_until:
            self.rests += 1  # counted as it lengthens the rest under way, if one is (two holds back to back)
            self.rested_s += until - max(self._rest_until, now)
            self._rest_until = until

    def busy(self, now: float | None = None) -> bool:
        """True while live events arrive (none has paused LIVE_QUIET_S), and while background work rests (`ran`);
        after YIELD_MAX_S of an unbroken stream, False for BACKGROUND_SLICE_S out of every BACKGROUND_EVERY_S (rests
        aside), so that the back-fill and the workers always progress."""
        now = time.monotonic() if now is None else now
        return self._streaming(now) or now < self._rest_until

    def _streaming(self, now: float) -> bool:
        if not self.quiet_in(now):
            self._streak = None
            return False
        if self._streak is None:
            self._streak = now
        streak = now - self._streak
        return streak < YIELD_MAX_S or (streak - YIELD_MAX_S) % BACKGROUND_EVERY_S >= BACKGROUND_SLICE_S

    def quiet_in(self, now: float | None = None) -> float:
        """Seconds until live events will have paused LIVE_QUIET_S, if none arrives meanwhile (0: they have)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self.last + LIVE_QUIET_S - now)

    def resume_in(self, now: float | None = None) -> float:
        """Seconds until background work held for live events (or resting) may resume, if none arrives meanwhile (0:
        now)."""
        now = time.monotonic() if now is None else now
        left = self.quiet_in(now)
        return max(left + RESUME_AFTER_S if left else 0.0, self._rest_until - now)


@dataclass
class Losses:
    """Events this daemon could not store, so that no loss is silent (`status`, `loom doctor`)."""

    failed: int = 0  # accepted, then the commit failed (disk full, I/O error): the submitter got the error
    busy: int = 0  # refused at once, the queue being full: the submitter got `busy`
    recent: deque[dict[str, float | str]] = field(default_factory=lambda: deque(maxlen=RECENT_ERRORS))

    def record(self, events: int, error: BaseException) -> None:
        self.failed += events
        self.recent.append({"time": time.time(), "events": events, "message": str(error)[:500]})


class EventWriter:
    """Group commit: concurrent submitters share one transaction; each gets its ack only after COMMIT."""

    def __init__(self, store: Store, *, max_pending: int = 256, max_batch: int = 512,
                 offload: Offload | None = None) -> None:
        self.store = store
        self.max_batch = max_batch
        self._queue: asyncio.Queue[Batch] = asyncio.Queue(max_pending)
        self._bulk: asyncio.Queue[Batch] = asyncio.Queue(max_pending)
        self._ready = asyncio.Event()  # set while either queue holds a batch
        self._event_s = 0.0  # a bulk event's cost in the writer (insert and captures), a moving average
        self._task: asyncio.Task[None] | None = None
        self._bulk_acks: set[asyncio.Task[None]] = set()  # bulk submitters waiting for the log's sync
        self.processors: list[Processor] = []
        self.listeners: list[Listener] = []
        self.committed = 0
        self.commits = 0  # group commits: `committed / commits` is how many events shared one
        self.parser = EventParser(offload)
        self.losses = Losses()
        self.ignored = IgnoredProjects(store.path.parent / IGNORED_FILE)  # `loom project ignore`
        self.live = LiveTraffic()

    @property
    def depth(self) -> int:
        return self._queue.qsize() + self._bulk.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-writer")

    async def stop(self) -> None:
        """Commit what was already accepted, then stop."""
        if self._task and not self._task.done():
            await self._queue.join()
            await self._bulk.join()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, events: list[Event], also: Processor | None = None, *, bulk: bool = False) -> list[Event]:
        """Resolve projects, queue, and wait for the commit. A full queue answers Busy at once.

        `also` runs inside the same transaction (a tailer's offset, a worker's watermark), so it commits
        together with the events or not at all; for a `bulk` submitter (committed in slices, see above), together
        with its last events.
        """
        return await asyncio.shield(await self.enqueue(events, also, bulk=bulk))

    async def enqueue(self, events: list[Event], also: Processor | None = None, *, bulk: bool = False,
                      here: bool = False, answered: bool = False) -> asyncio.Future[list[Event]]:
        """`submit` without the wait: the future of the commit that will hold the events (resolved after it, with the
        events; or failed). For a caller with more to do meanwhile (a hook's context), without a task of its own.

        `here` (a hook with nothing to read while it commits): if the events came alone and no live commit is queued,
        they are committed in the caller's task, and the future returned is resolved already (`_commit_here`).
        `answered` (a hook the journal holds, answered without waiting for this commit): its log's sync runs on the
        sync thread, never on the event loop's, where it would hold up the hooks that do wait (`_commit_live`)."""
        if bulk:
            events = outside(self.ignored.roots(), events)  # a live submitter's: at its group commit (`_commit_live`)
        else:
            self.live.arrived()
        for event in events:
            if not event.project:
                event.project = await project_of(event.cwd)
        future: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()
        batch = Batch(events, future, also, answered=answered)
        if here and not bulk and self.live.alone and self._queue.empty():
            await self._commit_here(batch)
            return future
        try:
            (self._bulk if bulk else self._queue).put_nowait(batch)
            self._ready.set()
        except asyncio.QueueFull:
            self.losses.busy += len(events)
            raise Busy("the daemon is overloaded; spool the event and retry") from None
        return future

    async def submit_args(self, args: dict[str, Any], *, max_chars: int) -> list[Event]:
        """The `ingest` op, and the spool's replay of what the shim wrote: parse, then commit; acked after COMMIT."""
        events = await self.parser.events_from_args(args, max_chars=max_chars)
        await self.submit(events)
        return events

    async def _run(self) -> None:
        bulk: Batch | None = None  # the bulk batch being committed, slice by slice
        while True:
            if self._queue.empty() and bulk is None and self._bulk.empty():
                self._ready.clear()
                await self._ready.wait()
            if not self._queue.empty():
                await self._commit_live(self._take_live(), self._queue)
            # One bulk slice between two live commits: live events wait behind one slice at most, and a stream of
            # hooks never starves an import.
            if bulk is None and not self._bulk.empty():
                bulk = self._bulk.get_nowait()
            if bulk is not None and await self._commit_slice(bulk):
                bulk = None  # its last slice committed (acknowledged after the log's sync) or failed

    async def _commit_here(self, item: Batch) -> None:
        """A live submitter that came alone, committed in its own task, as the writer's task would have committed it
        alone (`_commit_live`): without the two hand-offs between tasks (to the writer's task, and its result back),
        about 0.2 ms of a quiet hook's 2 ms answer. A hook arriving meanwhile queues for the writer's task, which waits
        for the write lock as a bulk slice or a worker would. The daemon's shutdown waits for these commits with the
        requests they belong to (`Server.drain`), before the writer stops."""
        holder = HOLDER.set("events:live")
        try:
            await self._commit_live([item], None)
        finally:
            HOLDER.reset(holder)

    async def _commit_live(self, batch: list[Batch], queue: asyncio.Queue[Batch] | None) -> None:
        """One group commit of live submitters: taken from the live `queue` (`_take_live`), or (None) one committed
        in its own task (`_commit_here`)."""
        size = sum(len(item.events) for item in batch)
        # The ignored folders are looked at (a stat) once a group commit, not once a hook: each stat gave up the
        # interpreter lock on the event loop (the ingest bench at 8 clients: daemon CPU 0.48 -> 0.46 ms an event,
        # closing note, stop 40). Still before the commit: a folder ignored before an event is committed keeps it out.
        roots = self.ignored.roots()
        for item in batch:
            item.events = outside(roots, item.events)
        failed: dict[int, Exception] = {}
        number: int | None = None  # the log's sync that makes the group commit durable
        try:
            number = await self._commit(batch, alone=size == 1 and self.live.alone and not batch[0].answered)
        except Exception as exc:  # noqa: BLE001 - every waiter must hear about a failed commit
            failed = await self._commit_apart(batch, exc)
        await self._acknowledge(batch, failed, queue,
                                [e for item in batch if id(item) not in failed for e in item.events], number)

    def _take_live(self) -> list[Batch]:
        """The live queue's submitters, up to `max_batch` events (one submitter at least)."""
        batch = [self._queue.get_nowait()]
        size = len(batch[0].events)
        while not self._queue.empty() and size < self.max_batch:
            item = self._queue.get_nowait()
            batch.append(item)
            size += len(item.events)
        return batch

    async def _commit_slice(self, item: Batch) -> bool:
        """Commit the next slice of a bulk batch; True when the batch is done (acknowledged or failed)."""
        per_event = self._event_s
        n = max(SLICE_MIN, min(self.max_batch, int(SLICE_S / per_event))) if per_event else SLICE_FIRST
        start, end = item.committed, min(len(item.events), item.committed + n)
        last = end == len(item.events)
        part = item.events[start:end]
        began = time.perf_counter()
        try:
            try:
                number = await self._commit([item], part, final=last, urgent=False)
            except ProcessorFailed as exc:
                log.error("%d event(s) stored without their captures: a processor failed on them", len(part),
                          exc_info=exc.__cause__)
                number = await self._commit([item], part, derive=False, final=last, urgent=False)
        except Exception as exc:  # noqa: BLE001 - reported to this submitter only
            log.error("could not commit %d event(s); they were not acknowledged: %s", len(item.events) - start, exc)
            self.losses.record(len(item.events) - start, exc)
            if not item.future.done():
                item.future.set_exception(exc)
            self._bulk.task_done()
            return True
        spent = (time.perf_counter() - began) / max(1, len(part))
        self._event_s = spent if not self._event_s else 0.7 * self._event_s + 0.3 * spent
        item.committed = end
        if last:  # the log's sync after this slice covers the earlier ones too (the log is append-only)
            # Waited for apart: the next live commit does not wait behind an import's fsync.
            task = asyncio.create_task(self._acknowledge([item], {}, self._bulk, part, number))
            self._bulk_acks.add(task)
            task.add_done_callback(self._bulk_acks.discard)
        else:
            self._notify(part)
        return last

    async def _acknowledge(self, batch: list[Batch], failed: dict[int, Exception],
                           queue: asyncio.Queue[Batch] | None, done: list[Event], number: int | None = None) -> None:
        """Resolve each submitter of a commit once an fsync of the log begun after it has ended (`WalSync`). The
        writer waits for it before its next commit, as it waited for a FULL commit: what arrives meanwhile makes
        the next batch (on 2 busy CPUs, committing during the fsync made smaller batches and cost more CPU an
        event); but the writer is free for the workers' and the back-fill's statements meanwhile. (A bulk
        submitter's wait runs apart: live commits go on meanwhile.)"""
        unsynced: Exception | None = None
        if len(failed) < len(batch):
            try:
                # The sync its commit asked for (`number`); after a commit apart, one asked for now.
                await (self.store.wal.after_commit() if number is None else self.store.wal.wait(number))
            except StorageError as exc:
                log.error("%d event(s) committed, but the log's sync failed; none of them was acknowledged: %s",
                          len(done), exc)
                unsynced = exc
        for item in batch:
            error = failed.get(id(item)) or unsynced
            if unsynced is not None and error is unsynced:
                self.losses.record(len(item.events), error)
            if not item.future.done():
                if error is not None:
                    item.future.set_exception(error)
                else:
                    item.future.set_result(item.events)
            if queue is not None:
                queue.task_done()
        self._notify(done)

    def _notify(self, done: list[Event]) -> None:
        for listener in self.listeners:
            try:
                listener(done)
            except Exception:  # noqa: BLE001 - a listener must never stop ingest
                log.exception("event listener failed")

    async def _commit_apart(self, batch: list[Batch], first: Exception) -> dict[int, Exception]:
        """After a failed group commit, each submitter's events alone, so that one bad event fails only its own
        submitter; events whose processors (capture) fail are stored without what they would derive — the
        event itself is what must not be lost. Returns the submitters that failed all the same (by id)."""
        if not isinstance(first, ProcessorFailed):
            log.warning("a group commit of %d submitter(s) failed (%s); committing each alone", len(batch), first)
        failed: dict[int, Exception] = {}
        for item in batch:
            try:
                try:
                    await self._commit([item])
                except ProcessorFailed as exc:
                    log.error("%d event(s) stored without their captures: a processor failed on them",
                              len(item.events), exc_info=exc.__cause__)
                    await self._commit([item], derive=False)
            except Exception as exc:  # noqa: BLE001 - reported to this submitter only
                log.error("could not commit %d event(s); none of them was acknowledged: %s", len(item.events), exc)
                self.losses.record(len(item.events), exc)
                failed[id(item)] = exc
        return failed

    async def _commit(self, batch: list[Batch], events: list[Event] | None = None, *, derive: bool = True,
                      final: bool = True, urgent: bool = True, alone: bool = False) -> int:
        """`events` (default: the batch's) in one transaction, with each submitter's `also` when `final`; `urgent`
        (live submitters) before the workers' and the back-fill's waiting transactions. Committed without waiting
        for the disk: the submitters are acknowledged after the log's sync (`_acknowledge`).

        BEGIN to COMMIT without a pause (`Store.commit_on_thread`: a live commit on the event loop's thread, a bulk
        slice in one trip to the writer's thread): the inserts, the processors and the `also`s. A trip per step
        (BEGIN, the inserts, each capture statement, COMMIT) waited each time for the event loop's turn, busy parsing
        the next hooks, while the commit held the writer. Returns the number of the log's sync that makes it durable
        (`WalSync.wait`). `alone`: a live event that came alone, synced where it was committed (`ALONE_AFTER_S`)."""
        if events is None:
            events = [e for item in batch for e in item.events]
        HOLDER.set("events:live" if urgent else "events:bulk")  # the writer task's own context
        after = [(item.also, item.events) for item in batch if item.also is not None] if final else []
        body = functools.partial(write_events, events=events, now=time.time(),
                                 processors=self.processors if derive else [], after=after)
        # A commit whose submitters are acknowledged after it (a live one, a bulk batch's last slice) asks for the
        # log's sync right after its COMMIT; the others are covered by a later one (the log is append-only).
        stored, mark = await self.store.commit_on_thread(body, durable=False, sync=final, urgent=urgent, alone=alone)
        self.committed += len(stored)
        self.commits += 1
        return mark + 1


def outside(roots: tuple[str, ...], events: list[Event]) -> list[Event]:
    """`events` less those from the folders the user keeps out of memory (`loom project ignore`): acknowledged and
    dropped, their `stored` stays False."""
    return [event for event in events if not covers(roots, event.cwd)] if roots else events


def write_events(conn: sqlite3.Connection, events: Sequence[Event], now: float, processors: Sequence[Processor],
                 after: Sequence[tuple[Processor, Sequence[Event]]]) -> list[Event]:
    """One commit's body, inside its transaction (`Store.commit_on_thread`): the events (`insert_events`), the
    processors on those stored now (a processor's failure raises ProcessorFailed), then each submitter's `also`."""
    stored = insert_events(conn, events, now)
    for processor in processors:
        try:
            run_through(functools.partial(_call, processor, events=stored), conn)
        except Exception as exc:
            raise ProcessorFailed(str(exc)) from exc
    for also, own in after:
        run_through(functools.partial(_call, also, events=own), conn)
    return stored


def _call(processor: Processor, db: aiosqlite.Connection, events: Sequence[Event]) -> Awaitable[None]:
    return processor(db, events)


def insert_events(conn: sqlite3.Connection, events: Sequence[Event], now: float) -> list[Event]:
    """Insert the events not stored yet and upsert their sessions (inside the caller's transaction); returns those
    stored now, each with its id.

    In few statements, not two or three an event: on the writer's thread (a bulk slice's, and before stop 49 a live
    commit's) each statement hands the interpreter lock back and waits to take it again, and while the event loop parses
    the next hooks every such wait is long (the ingest bench, 8 clients: 140 µs of CPU and 230 of wall time an event in
    here, against 80 with nothing else running). So the events go a run at a time (`_insert_run`: an INSERT of many rows
    that leaves out the copies itself); a prompt, which pairs with one copy at most (`is_prompt_copy`), goes alone, in
    its place.

    The sessions' rows are upserted in one statement, each with what its events would have left there one by one (an
    import's slice is hundreds of events of one session, a group commit of 8 hooks up to 8 sessions). A live group
    commit is then four statements (BEGIN, this INSERT, this upsert, COMMIT): it was eight for four hooks of four
    sessions (a lookup of the copies, an upsert a session), and `bench/ingest.py` went from 1,960 to 2,150 events/s
    (three runs each, 8 clients)."""
    kept: list[Event] = []  # the events that are not copies, in order: stored now, or stored before (same key)
    run: list[Event] = []
    for event in events:
        event.stored = False
        if event.dedup is None or not event.dedup.startswith(PROMPT_MARK):
            run.append(event)
            continue
        kept += _insert_run(conn, run, now)
        run = []
        if not is_prompt_copy(conn, event):
            _insert_rows(conn, [event], now)
            kept.append(event)
    kept += _insert_run(conn, run, now)
    sessions: dict[str, list[Any]] = {}  # id -> [agent, project, cwd, transcript_path, started, last_seen, ended]
    for event in kept:
        ended = event.ts if event.kind == "SessionEnd" else None
        row = sessions.get(event.session_id)
        if row is None:
            sessions[event.session_id] = [event.agent, event.project, event.cwd, event.transcript_path, event.ts,
                                          event.ts, ended]
            continue
        # As the upsert below would have merged this event into the row the earlier ones left.
        if row[1] == "unknown":
            row[1] = event.project
        if row[2] is None:
            row[2] = event.cwd
        if event.transcript_path is not None:
            row[3] = event.transcript_path
        row[5] = max(row[5], event.ts)
        if ended is not None:
            row[6] = ended
    rows = [(session_id, *row) for session_id, row in sessions.items()]
    for start in range(0, len(rows), ROWS_PER_INSERT):
        part = rows[start : start + ROWS_PER_INSERT]
        conn.execute(_sessions_sql(len(part)), [v for r in part for v in r])
    return [event for event in kept if event.stored]


@functools.cache
def _sessions_sql(rows: int) -> str:
    return (
        "INSERT INTO sessions (id, agent, project, cwd, transcript_path, started, last_seen, ended)"
        " VALUES " + ",".join(["(?,?,?,?,?,?,?,?)"] * rows) + " ON CONFLICT(id) DO UPDATE SET"
        " last_seen = max(last_seen, excluded.last_seen),"
        # A session first seen through a line without a cwd takes its project from the next event.
        " project = CASE WHEN sessions.project = 'unknown' THEN excluded.project ELSE sessions.project END,"
        " cwd = coalesce(sessions.cwd, excluded.cwd),"
        " transcript_path = coalesce(excluded.transcript_path, sessions.transcript_path),"
        " ended = CASE WHEN excluded.ended IS NOT NULL THEN excluded.ended ELSE sessions.ended END")


ROWS_PER_INSERT = 32  # rows one INSERT statement carries: 32 statements' texts at most, each prepared once
EVENT_ROW = "(?,?,?,?,?,?,?,?,?,?,?,?,?)"


@functools.cache
def _insert_sql(rows: int, unless_copied: bool) -> str:
    head = ("INSERT OR IGNORE INTO events (key, agent, session_id, project, kind, source, ts, received, tool_name,"
            " tool_use_id, dedup, tokens, payload) ")
    values = "VALUES " + ",".join([EVENT_ROW] * rows)
    if not unless_copied:
        return head + values
    # column3 is session_id, column11 dedup: a row whose (session, dedup) a stored event has is a copy, left out by
    # the INSERT itself (the caller's rows have distinct pairs: which of them is looked up first does not matter).
    return (head + "SELECT * FROM (" + values + ") AS v WHERE v.column11 IS NULL OR NOT EXISTS"
            " (SELECT 1 FROM events AS e WHERE e.session_id = v.column3 AND e.dedup = v.column11"
            " AND e.dedup IS NOT NULL)")


def _stored_copies(conn: sqlite3.Connection, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which (session, dedup) pairs a stored event has, in one query (one statement text for any number of pairs).
    Only a commit where some row was not stored asks (`_insert_run`)."""
    rows = conn.execute(
        "SELECT e.session_id, e.dedup FROM json_each(?) AS j JOIN events AS e"
        " ON e.session_id = j.value ->> 0 AND e.dedup = j.value ->> 1 AND e.dedup IS NOT NULL",
        (json.dumps(pairs),)).fetchall()
    return {(row[0], row[1]) for row in rows}


def _insert_run(conn: sqlite3.Connection, run: list[Event], now: float) -> list[Event]:
    """Insert `run` (events whose copies, if any, are found by identity: a tool call's id) as one event after
    another would be, less the statements: a copy within the run is the later one, and the rows go ROWS_PER_INSERT
    to an INSERT that leaves out the copies already stored. Returns the events that are not copies, in order, each
    `stored` with its id unless a row had its key already (a spool replay, a re-read line).

    A commit that stores every row it inserts (the usual one) ran that INSERT alone: each statement on the writer's
    thread hands the interpreter lock back and waits to take it again. Only when some row was not stored does one
    more query tell a copy (a stored event has its pair) from a key stored before."""
    if not run:
        return []
    kept: list[Event] = []  # not copies of one another, in order
    pairs: set[tuple[str, str]] = set()
    keys: set[str] = set()
    fresh: list[Event] = []  # a row each, in order: the first event of each key
    for event in run:
        if event.dedup is not None:
            pair = (event.session_id, event.dedup)
            if pair in pairs:
                continue  # a later one in the run is a copy of this one
            pairs.add(pair)
        kept.append(event)
        if event.key not in keys:
            keys.add(event.key)
            fresh.append(event)
    _insert_rows(conn, fresh, now, unless_copied=True)
    unstored = [(e.session_id, e.dedup) for e in fresh if not e.stored and e.dedup is not None]
    if not unstored:
        return kept
    copies = _stored_copies(conn, unstored)
    return [e for e in kept if e.stored or e.dedup is None or (e.session_id, e.dedup) not in copies]


def _insert_rows(conn: sqlite3.Connection, events: list[Event], now: float, *, unless_copied: bool = False) -> None:
    """A row for each of `events` (of distinct keys), ROWS_PER_INSERT to a statement; each event whose key no row
    had yet (and, `unless_copied`, whose pair no stored event had) is `stored`, with its id."""
    for start in range(0, len(events), ROWS_PER_INSERT):
        rows = events[start : start + ROWS_PER_INSERT]
        cur = conn.execute(_insert_sql(len(rows), unless_copied), [
            value for e in rows for value in (
                e.key, e.agent, e.session_id, e.project, e.kind, e.source, e.ts, now, e.tool_name, e.tool_use_id,
                e.dedup, e.tokens, e.payload_json)])
        inserted, last = cur.rowcount, cur.lastrowid
        if inserted <= 0 or last is None:
            continue
        # One statement's rows take consecutive ids, in order (an INTEGER PRIMARY KEY is the largest one plus one).
        if inserted == len(rows):
            for event_id, event in enumerate(rows, last - inserted + 1):
                event.id, event.stored = event_id, True
            continue
        # Some were left out (a key stored before, a copy): which rows are new, by their ids.
        ids: dict[str, int] = dict(conn.execute("SELECT key, id FROM events WHERE id BETWEEN ? AND ?",
                                                (last - inserted + 1, last)).fetchall())
        for event in rows:
            if (new_id := ids.get(event.key)) is not None:
                event.id, event.stored = new_id, True


def is_prompt_copy(conn: sqlite3.Connection, event: Event) -> bool:
    """Whether the prompt `event` is another copy of a stored one: a hook's prompt and its transcript line are
    stored once. (A tool call's copies are found by its id, a run at a time: `_insert_run`.)

    A prompt has only its text, and "continue" typed three times is three prompts: so each copy pairs with one copy
    from the other source (the nearest in time not yet paired), and the pair is marked (`paired_dedup`). Three hook
    copies and three transcript copies make three rows, whichever arrives first; a copy that never arrives (a lost
    hook) costs nothing but its pairing.
    """
    assert event.dedup is not None and event.dedup.startswith(PROMPT_MARK)
    if conn.execute("SELECT 1 FROM events WHERE key = ?", (event.key,)).fetchone() is not None:
        return True  # this very copy again (a spool replay, a re-read line): it must not take another's pair
    other = conn.execute(
        "SELECT id FROM events WHERE session_id = ? AND dedup = ? AND source != ? ORDER BY abs(ts - ?), id LIMIT 1",
        (event.session_id, event.dedup, event.source, event.ts)).fetchone()
    if other is None:
        return False
    conn.execute("UPDATE events SET dedup = ? WHERE id = ?", (paired_dedup(event.dedup), other[0]))
    return True
