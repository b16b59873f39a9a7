"""Shared syncs of the write-ahead log: a commit is made durable by an fsync begun after it, outside the writer's turn.

A commit with `synchronous = FULL` waits for the disk (2 ms at the median here, 27 ms at p99) while it holds the one
writer: every hook's commit and every worker's transaction queued behind waits for that fsync too, and nothing is
written meanwhile. A commit with `synchronous = NORMAL` ends when its frames are in the log (the operating system's
cache): a process crash keeps it, a power cut may undo it. Such a commit followed by an fsync of the log file begun
after it is as durable as a FULL one — the log is append-only, and in WAL mode SQLite syncs the log's header itself
when it starts reusing the file after a checkpoint. So the writer commits without waiting, passes the turn on, and
the committer waits for the next fsync here; the commits made while one fsync runs share the next (group commit on
the disk as well as in the transaction), and their statements run while the disk works.

A committer asks for a sync right after its COMMIT, on the thread that committed (`request`), and gets a number;
the sync thread takes every request made so far, runs one fsync and covers them all (`covered`); the committer
waits until `covered` reaches its number (`wait`). The committing thread asks itself, at the end of its trip: the
fsync begins without waiting for the event loop's turn, and the loop never hands the sync thread its work (a trip
through a thread pool and its futures on every commit, on the loop that frames every hook).

A hook's commit runs on the event loop's thread (`Store.commit_on_thread`, urgent) and asks there. A hook that came
alone (no other live event just before it) is synced right there, when no sync is running (`sync_here`): the sync
thread's wake-up and its call back to the loop are two of a hook's hand-offs between threads, each 0.2-0.3 ms on an
idle 2-CPU VM, about as long as the fsync itself (closing note, stop 41). Not while hooks arrive together: the loop,
waiting for the disk, would stop framing them, and every group commit became one event (the ingest bench, 8 clients,
2,100 -> 1,250 events/s). While the sync thread's fsync runs (a worker's or the back-fill's commit asked for it), the
hook's runs beside it, on a descriptor of its own (`_open_beside`): that fsync began before the hook's commit ended, so
it cannot cover it, and waiting for it and then for the next cost the hook two fsyncs and both hand-offs. During a
catch-up (48,000 imported events, a hook every 0.55 s), 14 of the first 50 hooks that came alone found one running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from loomd.errors import StorageError


class WalSync:
    """fsyncs of one database's log file, each shared by every commit that asked for one before it began."""

    def __init__(self, db: Path, synced: Callable[[], object] = lambda: None) -> None:
        self.db = db
        self.synced = synced  # told after each sync that covered a commit (the checkpoints: `store.checkpoint`)
        self.wal = db.with_name(db.name + "-wal")
        self.requested = 0  # requests made (each by a commit that had ended): the next one gets requested + 1
        self.covered = 0  # every request up to this number is on disk (a sync begun after it ended)
        self.syncs = 0  # fsyncs run here (`commits / syncs` is how many shared one)
        self._lock = threading.Lock()
        self._syncing = threading.Lock()  # held through each fsync (and the file's bookkeeping): one at a time
        # What the sync thread is asked: None for a sync, or a callable to run there first (`run_on_thread`).
        self._asks: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._failed: tuple[int, int, StorageError] | None = None  # the last failed sync: (after, up to, error)
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []  # (number, its waiter), on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._ino: int | None = None

    @property
    def pending(self) -> int:
        """Requests not covered by a completed sync yet."""
        return self.requested - self.covered

    def request(self) -> int:
        """Ask for an fsync of the log begun after now (the caller's commit has ended); from any thread. Returns the
        number `wait` takes."""
        with self._lock:
            self.requested += 1
            number = self.requested
            self._start()
        self._asks.put(None)
        return number

    def sync_here(self) -> int | None:
        """On the thread of a commit that has just ended (a hook's that came alone, on the event loop's: see
        `Store.commit_on_thread`): an fsync of the log right here, which covers that commit and every request made
        before it; returns its number, for which `wait` returns at once. While the sync thread's fsync runs, beside
        it (`_open_beside`). None, doing nothing, when the log is not the file last synced (then `request`: the sync
        thread syncs its directory entry too). A failed fsync is recorded as the sync thread records one: `wait`
        raises it."""
        if self._syncing.acquire(blocking=False):
            try:
                number = self._sync_covering(self._sync)
            finally:
                self._syncing.release()
        else:
            fd = self._open_beside()
            if fd is None:
                return None
            try:
                number = self._sync_covering(functools.partial(os.fdatasync, fd))
            finally:
                os.close(fd)
        with self._lock:  # after the cover: a waiter is either covered at its check in `wait` or listed by now
            others = bool(self._waiting)
        loop = self._loop
        if others and loop is not None:  # the requests this sync covered too have their waiters on the loop
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._deliver)
        return number

    async def wait(self, number: int) -> None:
        """Return once request `number` is on disk. StorageError if its fsync failed: the commit is in the file, but
        whether it reached the disk is unknown."""
        self._loop = asyncio.get_running_loop()  # before the check: a sync ending after it hands the loop `_deliver`
        with self._lock:
            if self.covered >= number:
                return
            failed = self._failed
            if failed is not None and failed[0] < number <= failed[1]:
                raise failed[2]
            future: asyncio.Future[None] = self._loop.create_future()  # its own: a cancelled waiter cancels only it
            self._waiting.append((number, future))
        await future

    async def after_commit(self) -> None:
        """Wait for an fsync of the log begun after now (the caller's commit has ended, on the loop)."""
        await self.wait(self.request())

    def run_on_thread(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the sync thread before its next fsync (what a slow disk does to the syncs, in a test)."""
        with self._lock:
            self._start()
        self._asks.put(fn)

    def _start(self) -> None:
        """The sync thread, started at the first ask (under the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="loomd-wal-sync", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        """After the last commit: wait for the syncs still owed, then end the thread and release the file."""
        with contextlib.suppress(StorageError):
            await self.wait(self.requested)
        thread = self._thread
        if thread is not None:
            self._asks.put(self._stop)
            await asyncio.to_thread(thread.join)
            self._thread = None
        self._close_fd()

    def _stop(self) -> None:
        raise _Stop

    def _serve(self) -> None:
        """The sync thread: take the requests made so far, one fsync for them all, tell the loop; again."""
        while True:
            asks = [self._asks.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    asks.append(self._asks.get_nowait())
            for ask in asks:
                if ask is not None:
                    try:
                        ask()
                    except _Stop:
                        return
            with self._syncing:
                with self._lock:
                    pending = self.requested > self.covered
                if not pending:
                    continue  # a sync on a committer's thread covered them (`sync_here`), and told the loop
                self._sync_covering(self._sync, request=False)
            loop = self._loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                    loop.call_soon_threadsafe(self._deliver)

    def _sync_covering(self, sync: Callable[[], None], *, request: bool = True) -> int:
        """One fsync (`sync`) for the requests made so far (and, `request`, one more made now: a committer's own),
        recorded as covering them, or as their failure (`wait` raises it); returns the last number it covers. Any
        fsync begun after a commit ended covers it, whichever ran before or beside it: `covered` only grows."""
        with self._lock:
            if request:
                self.requested += 1
            after, upto = self.covered, self.requested  # each of these commits ended before the fsync begins
        try:
            sync()
        except (OSError, RuntimeError) as exc:
            with self._lock:
                first, last = after, upto
                if self._failed is not None:  # one beside another that failed too: neither range is forgotten
                    first, last = min(first, self._failed[0]), max(last, self._failed[1])
                self._failed = (first, last, StorageError(
                    f"syncing the database log to disk failed: {exc}; nothing was acknowledged"))
        else:
            with self._lock:
                self.syncs += 1
                self.covered = max(self.covered, upto)
            self.synced()
        return upto

    def _open_beside(self) -> int | None:
        """A descriptor of its own on the log file the sync thread last synced, for an fsync beside that thread's
        (`sync_here`); None if the log is another file now (deleted and created again: its directory entry must be
        synced first, which the sync thread does) or gone."""
        ino = self._ino
        if ino is None:
            return None
        try:
            fd = os.open(self.wal, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            same = os.fstat(fd).st_ino == ino
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def _deliver(self) -> None:
        """On the loop: resolve the waiters the last syncs covered, fail those of a failed one."""
        with self._lock:
            covered, failed, waiting, self._waiting = self.covered, self._failed, self._waiting, []
            for number, future in waiting:
                if future.done():
                    continue
                if number <= covered:
                    future.set_result(None)
                elif failed is not None and failed[0] < number <= failed[1]:
                    future.set_exception(failed[2])
                else:
                    self._waiting.append((number, future))

    def _sync(self) -> None:
        """On the sync thread: fdatasync the log file (the same file SQLite writes: checked by inode every time, so
        a log deleted and created again is never missed); the database file itself when there is no log."""
        try:
            ino = os.stat(self.wal).st_ino
        except FileNotFoundError:
            fd = os.open(self.db, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        if self._fd is None or ino != self._ino:
            self._close_fd()
            self._fd = os.open(self.wal, os.O_RDONLY | os.O_CLOEXEC)
            # A log file new since we last looked: its directory entry must reach the disk too. Only then is it the
            # file a sync beside this thread's may use (`_open_beside`).
            dir_fd = os.open(self.wal.parent, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._ino = ino
        os.fdatasync(self._fd)

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class _Stop(Exception):
    """Asked of the sync thread by `close`: end."""
