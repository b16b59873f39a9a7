"""The SQLite store: one writer connection (aiosqlite over sqlean.py, sqlite-vec loaded), one reader."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from loomd.errors import ExtensionError, StorageError
from loomd.store.checkpoint import Checkpoints
from loomd.store.migrations import MIGRATIONS
from loomd.store.turns import HOLDER, Durations, WriteTurns
from loomd.store.wal import WalSync

log = logging.getLogger(__name__)

try:  # sqlean.py raises its own exception classes, not sqlite3's: every handler must name both
    import sqlean as _sqlean

    DB_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, _sqlean.Error)
    # Errors in loomd's own statements, not in the storage: they stay `internal` (logged with a traceback).
    DB_BUGS: tuple[type[Exception], ...] = (sqlite3.IntegrityError, sqlite3.ProgrammingError, _sqlean.IntegrityError,
                                            _sqlean.ProgrammingError)
except ImportError:  # connect_sync says what is missing
    DB_ERRORS = (sqlite3.Error,)
    DB_BUGS = (sqlite3.IntegrityError, sqlite3.ProgrammingError)
KEEP_IT = "loomd will not overwrite it; move it aside (or restore a backup) to start afresh"

EXTENSION_HELP = (
    "loomd needs an SQLite driver that can load extensions (for sqlite-vec). "
    "Install the project's dependencies (`pip install sqlean.py sqlite-vec`) into the interpreter that runs loomd."
)


# Prepared statements a connection keeps (the driver's default: 128). The writer runs more distinct texts than that
# (208 through `bench/hooks.py --background-catchup`'s import and catch-up: the workers' statements, IN-lists and
# multi-row INSERTs of each length), and the driver drops the least recently used: a hook's INSERT and session upsert,
# run once a hook, were prepared anew each time (a daemon answering a hook every 5 ms: 119 and 74 µs, against 34 and
# 20 kept). A statement kept costs 7-27 KB.
STATEMENTS_KEPT = 512


def connect_sync(path: Path | str, *, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open a connection through sqlean.py with sqlite-vec loaded; raise ExtensionError with the fix if we can't."""
    try:
        import sqlean
        import sqlite_vec
    except ImportError as exc:
        raise ExtensionError(f"cannot import the SQLite driver: {exc}. {EXTENSION_HELP}") from exc
    conn = sqlean.connect(str(path), timeout=busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False,
                          cached_statements=STATEMENTS_KEPT)
    try:
        conn.enable_load_extension(True)
        sqlite_vec.load(conn)
        conn.enable_load_extension(False)
    except (AttributeError, sqlite3.Error, sqlean.Error) as exc:
        conn.close()
        raise ExtensionError(f"cannot load the sqlite-vec extension: {exc}. {EXTENSION_HELP}") from exc
    conn.row_factory = sqlean.Row
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def ensure_private_file(path: Path) -> None:
    """Create the file owner-only before SQLite does, so the umask cannot widen it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class NewerSchema(StorageError):
    """The database was written by a newer loomd: an older one must not touch it."""


def check_schema_version(conn: sqlite3.Connection, path: Path | str) -> int:
    """The database's schema version; NewerSchema when it is past what this loomd knows (never written then)."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > len(MIGRATIONS):
        raise NewerSchema(
            f"database {path} has schema version {version}, newer than this loomd knows ({len(MIGRATIONS)}): a "
            "newer loomd wrote it. Run that newer loomd (upgrade this one); loomd will not open or write it")
    return version


def migrate(conn: sqlite3.Connection, path: Path | str) -> int:
    """Apply pending migrations, each in its own transaction; return the schema version."""
    version = check_schema_version(conn, path)
    for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            step(conn)
            conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        log.info("applied migration %d (%s)", number, step.__name__)
    return len(MIGRATIONS)


# FULL: an acknowledged event must survive a power cut, not only a crash; group commit pays for it. In WAL mode a
# FULL commit syncs the whole log: every transaction committed before it, however committed, is on disk after it.
# (The daemon's writer commits NORMAL and syncs the log after it, outside the writer's turn: `store.wal`, `Store`.)
SYNCHRONOUS = "FULL"


def open_checked(path: Path, *, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open, check integrity and migrate; a corrupt file raises StorageError and is left exactly as it was."""
    existed = path.exists() and path.stat().st_size > 0
    if not existed:
        ensure_private_file(path)
    conn = connect_sync(path, busy_timeout_ms=busy_timeout_ms)
    try:
        if existed:
            check_schema_version(conn, path)
            problems = integrity_problems(conn)
            damaged = damaged_fts(problems)
            if damaged:
                # The full-text index is derived from the memories table: rebuilt, it is as good as new.
                log.warning("the full-text index of %s is damaged (%s); rebuilding it from the tables", path,
                            "; ".join(problems)[:300])
                rebuild_fts(conn, damaged)
                problems = integrity_problems(conn)
            if problems:
                detail = " ".join(" ".join(problems).split())[:300]
                raise StorageError(f"database {path} failed its integrity check ({detail}); {KEEP_IT}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")
        migrate(conn, path)
    except DB_ERRORS as exc:
        conn.close()
        raise StorageError(f"database {path} cannot be used ({exc}); {KEEP_IT}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


_FTS_PROBLEM = re.compile(r"\bFTS5 table (?:main\.)?(\w+)")


def integrity_problems(conn: sqlite3.Connection) -> list[str]:
    """What `PRAGMA quick_check` finds wrong (it checks the FTS5 indexes too); empty when the file is sound."""
    rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
    return [] if rows == ["ok"] else rows


def damaged_fts(problems: list[str]) -> list[str]:
    """The FTS5 tables to rebuild when they are all that is wrong; empty when anything else is damaged too."""
    tables = [m.group(1) if (m := _FTS_PROBLEM.search(p)) else None for p in problems]
    if not tables or None in tables:
        return []
    return sorted({t for t in tables if t})


def rebuild_fts(conn: sqlite3.Connection, tables: list[str]) -> None:
    """Rebuild external-content FTS5 indexes from their tables, in one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table in tables:
            if not re.fullmatch(r"\w+", table):
                raise ValueError(f"not a table name: {table!r}")
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('rebuild')")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


_HINTS = {"SQLITE_IOERR": "is the disk full, or a file-size limit reached?", "SQLITE_FULL": "the disk is full",
          "SQLITE_BUSY": "another process holds the database lock", "SQLITE_READONLY": "the file is not writable"}


def describe(exc: BaseException) -> str:
    """`database is locked [SQLITE_BUSY: another process holds the database lock]`: message, error name, hint."""
    name = getattr(exc, "sqlite_errorname", None)
    if not name:
        return str(exc)
    hint = next((h for prefix, h in _HINTS.items() if name.startswith(prefix)), "")
    return f"{exc} [{name}{': ' + hint if hint else ''}]"


def name_thread(name: str) -> None:
    """Name the calling thread for what it does (`status`'s `threads`, py-spy), not aiosqlite's "Thread-N"."""
    threading.current_thread().name = name


async def open_reader(path: Path, *, busy_timeout_ms: int, name: str = "loomd-reader") -> aiosqlite.Connection:
    """A read-only aiosqlite connection on a thread of its own, named `name`."""
    reader = aiosqlite.Connection(lambda: connect_sync(path, busy_timeout_ms=busy_timeout_ms), 64)
    try:
        await reader
        await reader.execute("PRAGMA query_only = ON")
        await on_thread(reader, lambda _conn: name_thread(name))
    except BaseException:
        # Cancelled (the daemon stopping while it starts) or failed: close it here, as nothing else can; its
        # thread is not a daemon thread, and left running it would keep the process from exiting.
        await reader.close()
        raise
    return reader


T = TypeVar("T")


async def on_thread(db: aiosqlite.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run `fn` with the connection's sqlite3 handle on the connection's own thread, in one trip: many statements
    (each otherwise a trip through aiosqlite's queue and a wake-up of the loop) for the price of one."""
    conn = db._conn  # noqa: SLF001 - aiosqlite's own handle, used only on its own thread (below)
    result: T = await db._execute(fn, conn)  # noqa: SLF001 - aiosqlite's way to queue a call on that thread
    return result


async def to_its_end(work: Awaitable[T]) -> T:
    """`work` run to its end even if the caller is cancelled meanwhile; the cancellation is raised after it. For
    what must be over before the writer is passed on (a ROLLBACK on the writer's thread, see `Store.commit_on_thread`
    on why), where `asyncio.shield` would return at the cancellation and leave it running."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # unlike awaiting it, a cancellation of this wait leaves the task running
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


class Store:
    """Owns the database. Writes go through `atomic()` (serialised); reads use a second connection."""

    def __init__(self, path: Path, writer: aiosqlite.Connection, reader: aiosqlite.Connection,
                 background: aiosqlite.Connection, here: sqlite3.Connection, *, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms  # the writer's wait for another process's lock (`commit_on_thread`)
        self.writer = writer
        self.reader = reader
        # The workers' reads (the observer's chunks of full payloads) on a connection and thread of their own: on the
        # shared reader a hook's recall queued behind them (a UserPromptSubmit answered in 100 ms during a catch-up).
        self.background = background
        self._here = here
        self._write_lock = WriteTurns()
        self.gave_way = 0  # transactions that gave way to a hook's commit so far, each run again after it (`status`)
        # The log's checkpoints, off the writer (which never runs one: `open`), after the commits' syncs.
        self.checkpoints = Checkpoints(functools.partial(connect_sync, path, busy_timeout_ms=busy_timeout_ms),
                                       copied=self._log_copied)
        # Seconds until work held for live hooks may resume (the daemon wires `LiveTraffic.resume_in`, which also
        # waits out background work's rest): the log is started over in the hooks' pause (`restart_log`).
        self.resume_in: Callable[[], float] = lambda: 0.0
        self.restarts = 0  # logs started over by `restart_log` (`status`)
        self._loop = asyncio.get_running_loop()
        self._restart: asyncio.Task[None] | None = None
        self._closing = False
        self.wal = WalSync(path, synced=self.checkpoints.due)  # the log's fsyncs, shared by the commits waiting

    @classmethod
    async def open(cls, path: Path, *, busy_timeout_ms: int = 5000) -> Store:
        # Open and check on a plain thread: a refused file then leaves no aiosqlite worker thread behind.
        conn = await asyncio.to_thread(open_checked, path, busy_timeout_ms=busy_timeout_ms)
        # Each commit is made durable by a sync of the log after it, outside the writer's turn (`store.wal`): the
        # COMMIT itself does not wait for the disk (a PRAGMA each way around every transaction cost two statements).
        conn.execute("PRAGMA synchronous = NORMAL")
        # Its checkpoints run on a thread of their own (`store.checkpoint`), never inside a commit: a hook's commit
        # runs on the event loop's thread, which a checkpoint there would stop for the whole copy.
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        writer = aiosqlite.Connection(lambda: conn, 64)
        try:
            await writer
            await on_thread(writer, lambda _conn: name_thread("loomd-writer"))
            reader = await open_reader(path, busy_timeout_ms=busy_timeout_ms)
        except BaseException:
            await writer.close()
            raise
        try:
            background = await open_reader(path, busy_timeout_ms=busy_timeout_ms, name="loomd-workers-reader")
        except BaseException:
            await reader.close()
            await writer.close()
            raise
        try:
            here = await asyncio.to_thread(connect_sync, path, busy_timeout_ms=0)
        except BaseException:
            await background.close()
            await reader.close()
            await writer.close()
            raise
        here.execute("PRAGMA query_only = ON")
        return cls(path, writer, reader, background, here, busy_timeout_ms=busy_timeout_ms)

    @property
    def holds(self) -> Durations:
        """How long each holder kept the writer (`status`)."""
        return self._write_lock.holds

    @property
    def durable_commits(self) -> int:
        """The syncs of the log requested so far that are on disk, by number: see `commit_on_thread`."""
        return self.wal.covered

    @property
    def give_way(self) -> threading.Event:
        """Set while a hook's commit waits behind a transaction that `yields` (`commit_on_thread`)."""
        return self._write_lock.give_way

    def pace_background(self, held: Callable[[float], None]) -> None:
        """Tell `held` how long each background transaction (a worker's, the back-fill's) held the writer, as it
        ends (`LiveTraffic.ran`)."""
        self._write_lock.background_held = held

    @property
    def write_waiting(self) -> int:
        """Transactions waiting for their turn on the writer."""
        return self._write_lock.waiting

    def _log_copied(self) -> None:
        """On the checkpoint thread: the log is all in the database file; start it over soon (`restart_log`)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing more is written
            self._loop.call_soon_threadsafe(self._restart_soon)

    def _restart_soon(self) -> None:
        if not self._closing and (self._restart is None or self._restart.done()):
            self._restart = self._loop.create_task(self.restart_log(), name="wal-restart")

    async def restart_log(self) -> None:
        """Start the log over, once it is all copied into the database file (`store.checkpoint`), in a pause of the
        live hooks: with a write of nothing (the database's own `user_version`, set to what it is), whose COMMIT
        writes the log's new header and waits for its fsync, which the next hook's COMMIT would otherwise wait for.
        Skipped when another process holds the write lock: then whoever writes next starts the log over, as before."""
        while (left := self.resume_in()) > 0:  # noqa: ASYNC110 - a predicate of time (the hooks pausing)
            await asyncio.sleep(left)
        holder = HOLDER.set("checkpoint")
        try:
            async with self._write_lock.hold():
                restarted = await to_its_end(on_thread(self.writer, functools.partial(_restart_log,
                                                                                      self.busy_timeout_ms)))
        except DB_ERRORS as exc:
            if isinstance(exc, DB_BUGS):
                raise
            log.warning("could not start the database log over: %s", describe(exc))
            return
        finally:
            HOLDER.reset(holder)
        self.restarts += restarted

    async def close(self) -> None:
        self._closing = True  # a checkpoint that ends meanwhile asks for no restart
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        async with self._write_lock.hold():
            await asyncio.to_thread(self.checkpoints.close)
            await self.background.close()
            await self.reader.close()
            self._here.close()
            await self.writer.close()
        await self.wal.close()  # the syncs owed to the last commits

    @asynccontextmanager
    async def atomic(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction at a time, durable: it returns after an fsync of the log begun after its COMMIT,
        with the writer passed on already (`WalSync`); rolled back on any exception, cancellation included. (What
        commits without waiting for the disk, or before the waiting transactions, goes through `commit_on_thread`.)"""
        async with self._write_lock.hold():
            try:
                # BEGIN inside the try: a caller cancelled while BEGIN runs on the connection's thread (a context
                # deadline) must not leave the one writer connection inside a transaction for good. The ROLLBACK
                # queues behind whatever statement is still running, so it always undoes the right thing.
                await self.writer.execute("BEGIN IMMEDIATE")
                yield self.writer
                await self.writer.execute("COMMIT")
            except BaseException as exc:
                # Nothing to roll back (BEGIN failed) or SQLite already did (a full disk, an I/O error): noise.
                with contextlib.suppress(*DB_ERRORS):
                    await to_its_end(self.writer.execute("ROLLBACK"))
                if isinstance(exc, DB_ERRORS) and not isinstance(exc, DB_BUGS):
                    raise StorageError(f"the database write failed: {describe(exc)}; nothing was written") from exc
                raise
        await self.wal.after_commit()

    async def commit_on_thread(self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True,
                               sync: bool = False, urgent: bool = False, yields: bool = False,
                               alone: bool = False) -> tuple[T, int]:
        """`fn` in a write transaction of its own, BEGIN to COMMIT in one trip to the writer's thread: its
        writer-lock hold, which hooks wait behind, is the statements alone (a trip per statement also waits for the
        event loop's turn each time). Rolled back if `fn` raises, or if the caller is cancelled before its COMMIT
        (as `atomic`: a worker's run cancelled at shutdown keeps nothing of the transaction it had open; the
        statements run on to that point, as the connection's thread cannot be interrupted).

        The COMMIT does not wait for the disk (synchronous NORMAL): a crash of the process keeps it, a power cut may
        undo it until the log is synced. `durable` (the default): then wait, with the writer passed on already, for
        an fsync of the log begun after the COMMIT (`WalSync`, shared with the commits made meanwhile) — as durable
        as a FULL commit, without holding the writer for the disk. `durable=False` returns at once: for what a
        replay redoes (sync marking what the server holds), and a bulk ingest's slices but its last (`EventWriter`).
        `sync` with `durable=False`: the sync is asked for all the same, but not waited for (`EventWriter` waits for
        it apart, `wal.wait(mark + 1)`). Either way the committing thread asks for it right after the COMMIT, so the
        fsync begins without waiting for the event loop's turn.
        `urgent`: the transaction goes before the waiting ones that are not (a live hook's commit, `WriteTurns`), and
        runs right here, on the event loop's thread, BEGIN to COMMIT without a pause (the sync is the sync thread's, as
        ever). On the writer's thread each statement gave the interpreter lock back and waited to take it again from the
        event loop, busy parsing the next hooks meanwhile; a live commit's statements are short, and the loop would only
        wait for them (`bench/ingest.py`, full daemon, 8 clients, five alternating pairs: 1,871-2,181 -> 2,102-2,343
        events/s, the daemon's CPU 0.42-0.48 -> 0.41-0.44 ms an event). Safe because the writer's thread is idle
        whenever the writer is free: every way out of a turn waits for what it queued there to end (`to_its_end`). Its
        BEGIN does not wait for another process's lock (`_begin_now`): while one is held, it goes to the writer's
        thread, which waits there (`busy_timeout_ms`) while the loop goes on answering.
        `alone` (urgent, a hook that came alone): its sync runs right here too when none is running
        (`WalSync.sync_here`), and the result comes back already durable, without the sync thread's two hand-offs.
        `yields` (background work): if a live hook's commit comes to wait behind this transaction, `fn` stops at its
        next statement by raising `GaveWay` (`store.trip` does, for `give_way`), the transaction rolls back, the hook's
        commit takes the writer, and `fn` runs again after it, to its end this time: whatever the traffic, a
        transaction gives way once at most, and a hook waits for one statement instead of a transaction. `fn` must
        then be pure statements, as it runs twice.
        Returns fn's result and a mark: once `durable_commits` has passed the mark, the transaction is on disk."""
        abandoned = threading.Event()
        wal = self.wal if durable or sync else None
        while True:
            async with self._write_lock.hold(urgent, yields):
                try:
                    conn = self.writer._conn  # noqa: SLF001 - see on_thread; here the writer's thread is idle
                    # No await from BEGIN to COMMIT: nothing else runs on the connection meanwhile.
                    if urgent and _begin_now(conn, self.busy_timeout_ms):
                        result, number = _transaction(fn, abandoned, wal, conn, alone, begun=True)
                    else:
                        result, number = await on_thread(self.writer, functools.partial(_transaction, fn, abandoned,
                                                                                        wal))
                except GaveWay:
                    self.gave_way += 1
                    yields = False  # its second run goes to its end
                    continue  # out of the turn first: the hook's commit has it next
                except asyncio.CancelledError:
                    abandoned.set()  # the thread rolls back instead of committing, unless it has committed already
                    # Its end (and the thread's) before the writer is passed on: a hook's commit runs on this thread.
                    await to_its_end(on_thread(self.writer, _nothing))
                    raise
                except DB_ERRORS as exc:
                    if isinstance(exc, DB_BUGS):
                        raise
                    raise StorageError(f"the database write failed: {describe(exc)}; nothing was written") from exc
            break
        # Asked for: the sync that covers request `number` covers the commit. Otherwise any request made from now on.
        mark = number - 1 if wal is not None else self.wal.requested
        if wal is None:
            self.checkpoints.due()  # no sync tells it of these frames
        if durable:
            await self.wal.wait(number)
        return result, mark

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[aiosqlite.Connection]:
        """The writer with no transaction open, no other write running: for what cannot run inside one (VACUUM, a
        WAL checkpoint, a PRAGMA for what follows). The caller begins and ends its own transactions."""
        async with self._write_lock.hold():
            # Its commits wait for the disk themselves (purge's, VACUUM's): nothing syncs the log after them here.
            await self.writer.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")
            try:
                yield self.writer
            finally:
                await to_its_end(self.writer.execute("PRAGMA synchronous = NORMAL"))

    async def fetchall(self, sql: str, params: Iterable[Any] = (), *, background: bool = False) -> list[sqlite3.Row]:
        """The query's rows; `background`: on the workers' own reader (`background`), not the hooks' one."""
        # One trip to the reader's thread (execute, fetch and close there), not three: on the hook path each trip
        # costs about as much as a small query.
        return list(await (self.background if background else self.reader).execute_fetchall(sql, tuple(params)))

    def read_here(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` over a read-only connection of the event loop's own thread, right away: a hook's one small read when
        a trip to the reader's thread and back would cost it more than the read (a start block answered before its
        commit: `StartRead.read_here`). It never waits for a lock (a busy read raises): the loop must not block."""
        return fn(self._here)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` over the hooks' reader's sqlite3 handle, on its thread, in one trip: for a hook's reads that follow
        one another (each trip is two thread wake-ups, and on a machine busy with a catch-up each cost more than its
        query). `fn` only reads, and touches nothing the event loop owns."""
        return await on_thread(self.reader, fn)

    async def fetchone(self, sql: str, params: Iterable[Any] = (), *,
                       background: bool = False) -> sqlite3.Row | None:
        """The first row of a query that yields one (a lookup by key, an aggregate)."""
        rows = await self.fetchall(sql, params, background=background)
        return rows[0] if rows else None

    async def scalar(self, sql: str, params: Iterable[Any] = ()) -> Any:
        row = await self.fetchone(sql, params)
        return None if row is None else row[0]

    async def versions(self) -> dict[str, str]:
        row = await self.fetchone("SELECT sqlite_version(), vec_version()")
        assert row is not None
        return {"sqlite": row[0], "sqlite_vec": row[1]}


def _begin_now(conn: sqlite3.Connection, busy_timeout_ms: int) -> bool:
    """BEGIN IMMEDIATE without waiting for a lock another process holds: False, with no transaction begun, if one
    does (SQLite's busy handler would have waited up to `busy_timeout_ms`, on the caller's thread)."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except DB_ERRORS as exc:
        if str(getattr(exc, "sqlite_errorname", "")).startswith("SQLITE_BUSY"):
            return False
        raise
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    return True


def _restart_log(busy_timeout_ms: int, conn: sqlite3.Connection) -> bool:
    """`Store.restart_log`'s write, on the writer's thread: False if another process holds the write lock."""
    if not _begin_now(conn, busy_timeout_ms):
        return False
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    _transaction(lambda c: c.execute(f"PRAGMA user_version = {version}"), threading.Event(), None, conn, begun=True)
    return True


def _nothing(_conn: sqlite3.Connection) -> None:
    """Queued on the writer's thread, it ends after all that was queued before it (`Store.commit_on_thread`)."""


class GaveWay(Exception):
    """A transaction that yields stopped before a statement: a hook's commit waits (`Store.commit_on_thread`)."""


class Abandoned(Exception):
    """The caller of `Store.commit_on_thread` was cancelled before the COMMIT: the transaction is rolled back."""


def _transaction(fn: Callable[[sqlite3.Connection], T], abandoned: threading.Event, wal: WalSync | None,
                 conn: sqlite3.Connection, here: bool = False, *, begun: bool = False) -> tuple[T, int]:
    """`Store.commit_on_thread`'s transaction, on the writer's thread or (urgent) the event loop's: runs to its end
    (COMMIT, or ROLLBACK if the caller was cancelled meanwhile), so the connection always leaves its transaction.
    With a `wal`, asks for the log's sync after the COMMIT, or (`here`, when no sync runs) runs it, and returns its
    number with fn's result (0 without). `begun`: its BEGIN ran already (`_begin_now`)."""
    if not begun:
        conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
        if abandoned.is_set():
            raise Abandoned
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(*DB_ERRORS):
            conn.execute("ROLLBACK")
        raise
    if wal is None:
        return result, 0
    number = wal.sync_here() if here else None
    return result, wal.request() if number is None else number
