"""Shared syncs of the write-ahead log: a commit is made durable by an fsync begun after it, outside the writer's turn.

A commit with `synchronous = FULL` waits for the disk (2 ms at the median here, 27 ms at p99) while it holds the one
writer: every hook's commit and every worker's transaction queued behind waits for that fsync too, and nothing is
written meanwhile. A commit with `synchronous = NORMAL` ends when its frames are in the log (the operating system's
cache): a process crash keeps it, a power cut may undo it. Such a commit followed by an fsync of the log file begun
after it is as durable as a FULL one — the log is append-only, and in WAL mode SQLite syncs the log's header itself
when it starts reusing the file after a checkpoint. So the writer commits without waiting, passes the turn on, and
the committer waits for the next fsync here; the commits made while one fsync runs share the next (group commit on
the disk as well as in the transaction), and their statements run while the disk works.

`done` counts completed syncs by ticket: a commit that ended when `started` was n is on disk once `done` > n.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loomd.errors import StorageError


class WalSync:
    """fsyncs of one database's log file, each shared by every commit that ended before it began."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.wal = db.with_name(db.name + "-wal")
        self.started = 0  # syncs begun
        self.done = 0  # the highest ticket of a completed sync
        self.syncs = 0  # fsyncs run here (`commits / syncs` is how many shared one)
        self._waiting: list[asyncio.Future[int]] = []  # commits that ended since the running sync began
        self._task: asyncio.Task[None] | None = None
        self._fd: int | None = None
        self._ino: int | None = None
        # One thread of its own: an fsync never queues behind other work handed to threads.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loomd-wal-sync")

    def begin(self) -> int:
        """A sync begins now: its ticket."""
        self.started += 1
        return self.started

    def finished(self, ticket: int) -> None:
        self.done = max(self.done, ticket)

    async def after_commit(self) -> int:
        """Wait for an fsync of the log begun after now (the caller's commit has ended); its ticket. StorageError if
        the fsync fails: the commit is in the file, but whether it reached the disk is unknown."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="wal-sync")
        return await asyncio.shield(future)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                # Taken before the fsync begins: each of these commits ended before it, so it covers them all.
                waiting, self._waiting = self._waiting, []
                ticket = self.begin()
                try:
                    await loop.run_in_executor(self._pool, self._sync)
                except (OSError, RuntimeError) as exc:  # RuntimeError: a commit after `close` (a bug)
                    error = StorageError(f"syncing the database log to disk failed: {exc}; nothing was acknowledged")
                    for future in waiting:
                        if not future.done():
                            future.set_exception(error)
                    continue
                self.syncs += 1
                self.finished(ticket)
                for future in waiting:
                    if not future.done():
                        future.set_result(ticket)
        finally:
            self._task = None

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
            self._fd, self._ino = os.open(self.wal, os.O_RDONLY | os.O_CLOEXEC), ino
            # A log file new since we last looked: its directory entry must reach the disk too.
            dir_fd = os.open(self.wal.parent, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        os.fdatasync(self._fd)

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    async def close(self) -> None:
        """After the last commit: wait for the syncs still owed, then release the thread and the file."""
        while self._task is not None:
            await asyncio.shield(self._task)
        self._pool.shutdown(wait=True)
        self._close_fd()
