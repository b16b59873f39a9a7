"""The hook journal: a hook is acknowledged once its event is on disk in an append-only file, and committed to the
store after its reply.

Why: a hook's answer waited for its SQLite commit, and the commit for the writer (a background transaction's hold,
BEGIN, the inserts and captures, COMMIT, the log's sync, the hand-back to the event loop), all of it longer on a
machine busy with a catch-up. A write at the end of a file the daemon keeps open, and its `fdatasync`, is the whole
of that durability: in the hooks bench with a catch-up running, the kinds with nothing to read were answered in
0.95-1.54 ms at the median instead of 1.68-2.06 (closing note, stop 62).

The file is preallocated and zeroed once, then written in place (`pwrite`), so a sync never changes its size or
extents (no metadata to flush with it). A record is a header (magic, epoch, sequence, body length, CRC-32 of the
body) and the hook's event as msgpack, as the store would keep it: parsed, cut and redacted (`event_fields`), never
the raw bytes. The records of one epoch run from offset 0, their sequence numbers 0, 1, 2, ...; a scan stops at the
first record whose magic, epoch, sequence or CRC does not follow (a torn write, or an older epoch's bytes).

Only a hook that comes alone is journaled (no other hook in flight, none in the 5 ms before it: as an agent's hooks
come): it is synced on the loop's thread, or on a thread while its context is read. Hooks that come together (many
agents, a replay) take the direct path, their group commit shared (`EventWriter`): there the commit is not waited for
alone, and a record and its own sync for each hook cost the daemon 0.3-0.5 ms of CPU per event (the ingest bench,
full daemon: 1,297 events/s with 8 clients against 1,897 with the journal off, the same run; stop 63).

Each journaled event's commit also writes `(epoch, seq)` into `journal_done` (`Entry.mark`, in the same
transaction), and an entry is settled once that commit is durable. At the daemon's start the events of the records of
the file's epoch not noted are committed through the writer's dedup (event keys), so the replay is idempotent and an
event forgotten or purged after its commit is never brought back; then a new epoch begins at offset 0. The file goes
back to offset 0 (a new epoch) while running too, once every record is settled and it is half full. A record that does
not fit, and every hook while the journal is off or broken, takes the direct path too: answered after its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
import msgpack

from loomd.errors import Busy
from loomd.ingest.events import Event
from loomd.ingest.writer import EventWriter, Processor

log = logging.getLogger(__name__)

MAGIC = b"LJR1"
HEADER = struct.Struct(">4sIQII")  # magic, epoch, seq, body length, crc32(body)
CHUNK = 1 << 20  # the file is zeroed this much at a time
MAX_RECORD_SHARE = 4  # a record larger than a quarter of the file takes the direct path
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # a failed commit of a journaled hook is tried again after these
REPLAY_AT_ONCE = 64  # records replayed in one go: a quarter of the writer's default queue


@dataclass
class Record:
    """One journaled hook: its event's fields, as parsed, cut and redacted (`event_fields`)."""

    epoch: int
    seq: int
    fields: dict[str, Any]


@dataclass
class Entry:
    """A record appended: `synced` resolves once it is on disk; `mark` (an `EventWriter` `also`) notes its commit."""

    epoch: int
    seq: int
    synced: asyncio.Future[None]
    mark: Processor = field(repr=False)


# What an event's row is made of (`writer.insert_events`): the journal keeps the event as it would be stored, parsed,
# cut and redacted, never the hook's raw bytes (no secret reaches the disk the store would not keep).
# The payload goes as msgpack with the rest (its JSON text, the row's, is made at the commit, after the reply).
EVENT_FIELDS = ("key", "agent", "session_id", "kind", "source", "ts", "payload", "cwd", "project", "transcript_path",
                "tool_name", "tool_use_id", "dedup")


def event_fields(event: Event) -> dict[str, Any]:
    return {name: getattr(event, name) for name in EVENT_FIELDS}


def event_of(fields: dict[str, Any]) -> Event:
    """The event a record holds (KeyError or TypeError: not a record of an event)."""
    if not isinstance(fields.get("payload"), dict):
        raise TypeError("an event's payload is a map")
    return Event(**{name: fields[name] for name in EVENT_FIELDS})


def record_bytes(epoch: int, seq: int, fields: dict[str, Any]) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    return HEADER.pack(MAGIC, epoch, seq, len(body), zlib.crc32(body)) + body


def scan(data: bytes | memoryview) -> tuple[int | None, list[Record]]:
    """The epoch that starts at offset 0 and its records in order, up to the first that does not follow."""
    records: list[Record] = []
    epoch: int | None = None
    at = 0
    while at + HEADER.size <= len(data):
        magic, rec_epoch, seq, length, crc = HEADER.unpack_from(data, at)
        if magic != MAGIC or (epoch is not None and rec_epoch != epoch) or seq != len(records):
            break
        body = bytes(data[at + HEADER.size : at + HEADER.size + length])
        if len(body) != length or zlib.crc32(body) != crc:
            break
        try:
            fields = msgpack.unpackb(body, raw=False)
        except Exception:  # noqa: BLE001 - a body that passed its CRC but does not decode ends the scan all the same
            break
        if not isinstance(fields, dict):
            break
        epoch = rec_epoch
        records.append(Record(rec_epoch, seq, fields))
        at += HEADER.size + length
    return epoch, records


def to_replay(file_epoch: int | None, records: list[Record], done_epoch: int | None, done: set[int]) -> list[Record]:
    """The records whose commit is not known: every record of an epoch newer than any commit noted, those not noted
    of the epoch of the latest notes, none of an older one (an epoch begins only once the one before is settled)."""
    if file_epoch is None:
        return []
    if done_epoch is None or file_epoch > done_epoch:
        return records
    if file_epoch < done_epoch:
        return []
    return [r for r in records if r.seq not in done]


class HookJournal:
    """The file, its next offset and sequence, and the entries not settled yet. Appends run on the event loop's
    thread, and so do most syncs: a write of a few KB and a data sync of a preallocated file."""

    def __init__(self, path: Path, size: int, writer: EventWriter) -> None:
        self.path = path
        self.writer = writer
        self.size = size
        self.fd: int | None = None
        self.epoch = 0
        self.seq = 0
        self.offset = 0
        self.broken: str | None = None  # why the journal stopped taking records (an I/O error); None: it works
        self.unsettled: dict[int, asyncio.Future[Any]] = {}  # seq -> its commit, this epoch
        self._pending: list[asyncio.Future[None]] = []  # appended, waiting for its sync (one at most: `append`)
        self._running: asyncio.Future[None] | None = None  # the sync running on a thread
        self._prune_below: int | None = None  # the epoch whose start drops the older notes
        self._retrying: dict[int, asyncio.TimerHandle] = {}  # seq -> the next try of a failed commit
        self._tasks: set[asyncio.Task[None]] = set()
        self.retries = 0  # commits tried again
        self.appended = 0
        self.syncs = 0
        self.replayed = 0
        self.direct = 0  # hooks that took the direct path (no room, too large, journal off or broken)
        self.together = 0  # hooks that took the direct path, having come with others (in flight, or just before)

    # --- start ------------------------------------------------------------------------------------------------

    def open(self) -> tuple[int | None, list[Record]]:
        """Open and scan the file, creating and zeroing it when new or not of `size` (the setting changed: its
        records are returned first, for the replay). On a thread: the zeroing writes `size` bytes and syncs them
        once. A file that cannot be opened or made leaves the journal broken (`append` then says None: every hook
        takes the direct path); a file this could not make is removed, not left taking the room of a full disk."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._break(exc)
            return None, []
        try:
            found = os.fstat(fd).st_size
            with os.fdopen(os.dup(fd), "rb") as f:
                epoch, records = scan(f.read()) if found else (None, [])
            if found != self.size:
                os.ftruncate(fd, 0)
                zeros = bytes(min(CHUNK, self.size))
                for at in range(0, self.size, CHUNK):
                    os.pwrite(fd, zeros[: min(CHUNK, self.size - at)], at)
                os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._break(exc)
            return None, []
        self.fd = fd
        return epoch, records

    def begin(self, epoch: int) -> None:
        """Start `epoch` at offset 0: every record before it is settled. The notes of older epochs go with the
        first commit of this one."""
        self.epoch, self.seq, self.offset = epoch, 0, 0
        self._prune_below = epoch

    # --- the hook path --------------------------------------------------------------------------------------

    def append(self, event: Event, *, together: bool = False) -> Entry | None:
        """Write a hook's record, to be synced next (`sync_here` or `sync_soon`). None: the hook takes the direct
        path, as it came `together` with other hooks in flight (or while a record waits for its sync), or as the
        journal is off, broken or has no room for it."""
        if self.fd is None or self.broken is not None:
            self.direct += 1
            return None
        if together or self._running is not None or self._pending:
            self.together += 1
            return None
        fields = event_fields(event)
        try:
            record = record_bytes(self.epoch, self.seq, fields)
        except (OverflowError, TypeError, ValueError):  # what msgpack cannot hold (an integer past 64 bits)
            self.direct += 1
            return None
        if len(record) > self.size // MAX_RECORD_SHARE:
            self.direct += 1
            return None
        if self.offset + len(record) > self.size or self.offset > self.size // 2:
            if self.unsettled:
                if self.offset + len(record) > self.size:
                    self.direct += 1  # full of records whose commit is not durable yet (or failed: replayed at start)
                    return None
            else:
                self.begin(self.epoch + 1)
                record = record_bytes(self.epoch, self.seq, fields)
        try:
            os.pwrite(self.fd, record, self.offset)
        except OSError as exc:
            self._break(exc)
            self.direct += 1
            return None
        loop = asyncio.get_running_loop()
        entry = Entry(self.epoch, self.seq, loop.create_future(), self.marker(self.epoch, self.seq))
        # Unsettled until its commit is known (`commit`): the file never goes back to offset 0 past it.
        self.unsettled[entry.seq] = entry.synced
        self.offset += len(record)
        self.seq += 1
        self.appended += 1
        self._pending.append(entry.synced)
        return entry

    def sync_soon(self) -> None:
        """Sync the record appended on a thread, while the loop's thread goes on (reading the hook's context)."""
        if self._running is None and self._pending:
            waiting, self._pending = self._pending, []
            self._running = asyncio.get_running_loop().run_in_executor(None, self._fdatasync)
            self._running.add_done_callback(functools.partial(self._synced, waiting))

    def sync_here(self) -> None:
        """Sync the record appended now, on the loop's thread: its future is then done, and its hook answered without
        a hand-off to the sync's thread and back (the hook came alone: no other hook's framing waits meanwhile)."""
        if self._running is not None or not self._pending:
            self.sync_soon()  # what `append` leaves no room for; never a record left unsynced all the same
            return
        waiting, self._pending = self._pending, []
        try:
            self._fdatasync()
        except OSError as exc:
            self._resolve(waiting, exc)
        else:
            self._resolve(waiting, None)

    def _fdatasync(self) -> None:
        assert self.fd is not None
        os.fdatasync(self.fd)

    def _synced(self, waiting: list[asyncio.Future[None]], done: asyncio.Future[None]) -> None:
        self._running = None
        error = OSError("the journal's sync was cancelled") if done.cancelled() else done.exception()
        self._resolve(waiting, error if isinstance(error, OSError) else OSError(str(error)) if error else None)
        self.sync_soon()  # a record appended while it ran (`append` takes none then; never one left unsynced)

    def _resolve(self, waiting: list[asyncio.Future[None]], error: OSError | None) -> None:
        if error is None:
            self.syncs += 1
        else:
            self._break(error)
        for future in waiting:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    async def commit(self, entry: Entry, events: list[Event]) -> asyncio.Future[list[Event]]:
        """Queue the entry's events for a commit that notes it done (awaiting nothing when their project is known),
        and keep it unsettled until that commit is durable. A commit that fails (disk full, I/O error), or that the
        writer's full queue refuses (Busy), is tried again, after RETRY_FIRST_S and then up to every RETRY_MAX_S: the
        hook is answered, its event the journal's; a start replays it if the daemon stops first."""
        written = await self._enqueue(entry, events)
        self._until_settled(entry, events, written, 0)
        return written

    async def _enqueue(self, entry: Entry, events: list[Event]) -> asyncio.Future[list[Event]]:
        try:
            return await self.writer.enqueue(events, also=entry.mark, answered=True)
        except Busy as exc:
            refused: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()
            refused.set_exception(exc)
            return refused

    def _until_settled(self, entry: Entry, events: list[Event], written: asyncio.Future[Any], tries: int) -> None:
        self.unsettled[entry.seq] = written

        def settled(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                self.unsettled.pop(entry.seq, None)
                return
            if self.fd is None:
                return  # closing: the next start replays it
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2**tries)
            self.retries += 1
            (log.error if tries == 0 else log.info)(
                "journaled hook %d.%d not committed (%s); trying again in %.1f s", entry.epoch, entry.seq,
                "cancelled" if done.cancelled() else done.exception(), delay)
            handle = asyncio.get_running_loop().call_later(delay, self._again, entry, events, tries + 1)
            self._retrying[entry.seq] = handle

        written.add_done_callback(settled)

    def _again(self, entry: Entry, events: list[Event], tries: int) -> None:
        self._retrying.pop(entry.seq, None)
        task = asyncio.ensure_future(self._resubmit(entry, events, tries))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resubmit(self, entry: Entry, events: list[Event], tries: int) -> None:
        self._until_settled(entry, events, await self._enqueue(entry, events), tries)

    def marker(self, epoch: int, seq: int) -> Processor:
        """The `also` of a record's event: its commit notes the record done."""
        return functools.partial(self._mark_done, epoch=epoch, seq=seq)

    async def _mark_done(self, db: aiosqlite.Connection, events: Sequence[Event], *, epoch: int, seq: int) -> None:
        """Inside the event's commit: note the record done, so that no later start replays it."""
        if self._prune_below is not None and epoch >= self._prune_below:
            await db.execute("DELETE FROM journal_done WHERE epoch < ?", (self._prune_below,))
            self._prune_below = None
        await db.execute("INSERT OR IGNORE INTO journal_done (epoch, seq) VALUES (?, ?)", (epoch, seq))

    async def settled(self) -> None:
        """Wait for the commits of the hooks already answered (a reader sees the events it sent)."""
        waiting = [f for f in self.unsettled.values() if not f.done()]
        if waiting:
            await asyncio.wait(waiting)

    def _break(self, exc: OSError) -> None:
        if self.broken is None:
            log.error("the hook journal %s failed (%s): hooks are answered after their commit", self.path, exc)
        self.broken = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        """After the writer stopped (every request answered: no sync runs). What is still unsettled (a commit
        failing, its next try pending) stays in the file for the next start."""
        for handle in self._retrying.values():
            handle.cancel()
        for task in self._tasks:
            task.cancel()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def status(self) -> dict[str, Any]:
        return {"on": self.fd is not None and self.broken is None, "size": self.size, "epoch": self.epoch,
                "offset": self.offset, "appended": self.appended, "syncs": self.syncs,
                "unsettled": len(self.unsettled), "replayed": self.replayed, "direct": self.direct,
                "together": self.together, "retries": self.retries,
                "broken": self.broken}


def done_notes(conn: sqlite3.Connection) -> tuple[int | None, dict[int, set[int]]]:
    """The newest epoch with a commit noted, and the notes of each epoch (on the reader's thread)."""
    notes: dict[int, set[int]] = {}
    for epoch, seq in conn.execute("SELECT epoch, seq FROM journal_done"):
        notes.setdefault(epoch, set()).add(seq)
    return (max(notes) if notes else None), notes


async def replay(journal: HookJournal, records: list[Record]) -> int:
    """Commit the events of `records` (their commit unknown: `to_replay`) through the writer's dedup (event keys), each
    noted done in its commit; returns how many were new. A record that holds no event is logged and left: the next
    epoch drops it."""
    stored = 0
    for at in range(0, len(records), REPLAY_AT_ONCE):
        waiting: list[asyncio.Future[list[Event]]] = []
        for record in records[at : at + REPLAY_AT_ONCE]:
            try:
                event = event_of(record.fields)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("journaled hook %d.%d not replayed: %r", record.epoch, record.seq, exc)
                continue
            waiting.append(await journal.writer.enqueue([event], also=journal.marker(record.epoch, record.seq)))
        for events in await asyncio.gather(*waiting):
            stored += sum(e.stored for e in events)
    journal.replayed += len(records)
    return stored
