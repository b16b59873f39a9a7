"""The log's checkpoints (its frames copied back into the database file) on a thread and connection of their own.

SQLite checkpoints by itself inside the COMMIT that takes the log past `wal_autocheckpoint` pages (1,000): that
commit copies every page written since the last checkpoint into the database file and fsyncs both files before it
returns, holding the writer. A hook's commit runs on the event loop's thread (`Store.commit_on_thread`, urgent), so
the hook that happened to cross the line stopped the loop for the whole copy, and every hook then arriving waited
too (`bench/ingest.py`, full daemon, one client: ack p99 2.3-2.4 ms with it, 1.6-2.1 without). So the writer never
checkpoints (`wal_autocheckpoint = 0`), and this thread does, on a connection of its own, PASSIVE: it takes no lock
a writer or reader waits for, and copies what no reader still needs; the writer goes on committing meanwhile, and
starts the log over once a checkpoint has copied all of it.

When: after a commit's sync (`due`, called by `WalSync`), at most once every `every_s` seconds, so the pages a busy
second rewrites many times are copied once.

Once a checkpoint has copied all of the log, the next write transaction starts the log over, and SQLite then writes
the log's new header and fsyncs it inside that COMMIT (the new header must be on disk before any new frame, or a
crash could bring back frames already copied). That fsync was the next hook's to wait for: a hook coming alone after
a pause found the log copied nearly every time (a Stop's COMMIT 0.62 ms at the median with it, 0.07 without, three
waits for the disk in 58 of 60). So `copied` is told, and the store starts the log over with a write of its own
while no hook arrives (`Store.restart_log`). The connection is the same library's as the writer's (sqlean.py):
two SQLite libraries in one process do not see each other's POSIX locks, and closing a file in one drops the
other's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

EVERY_S = 1.0  # at most one checkpoint in this many seconds


class Checkpoints:
    """A thread that checkpoints the log (PASSIVE) after commits, at most once every `every_s` seconds."""

    def __init__(self, connect: Callable[[], sqlite3.Connection], every_s: float = EVERY_S,
                 copied: Callable[[], None] | None = None) -> None:
        self.connect = connect
        self.every_s = every_s
        self.copied = copied  # told on this thread when a checkpoint copied all of a log that held frames
        self.runs = 0  # checkpoints run
        self.frames = 0  # the log's frames at the last one ...
        self.left = 0  # ... and those it could not copy yet (a reader still needed them)
        self.failed = 0
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def due(self) -> None:
        """A commit added frames to the log: checkpoint soon. From any thread; cheap (the loop's, too)."""
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stopping.is_set():
                    self._thread = threading.Thread(target=self._serve, name="loomd-wal-checkpoint", daemon=True)
                    self._thread.start()
        self._due.set()

    def status(self) -> dict[str, int]:
        return {"runs": self.runs, "log_frames": self.frames, "frames_left": self.left, "failed": self.failed}

    def close(self) -> None:
        """End the thread after the checkpoint it may be running (blocking: call it on a thread, not the loop)."""
        with self._lock:
            self._stopping.set()
            thread = self._thread
        self._due.set()
        if thread is not None:
            thread.join()

    def _serve(self) -> None:
        conn: sqlite3.Connection | None = None
        last = -math.inf  # the first checkpoint runs at once
        try:
            while True:
                self._due.wait()
                if self._stopping.wait(max(0.0, last + self.every_s - time.monotonic())):
                    return
                self._due.clear()  # commits from now on ask for the next one
                last = time.monotonic()
                try:
                    if conn is None:
                        conn = self.connect()
                    row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except Exception as exc:  # sqlean's errors are not sqlite3's; a failed open or copy alike:
                    # the log still holds every commit, and the next checkpoint tries again, on a new connection.
                    self.failed += 1
                    log.warning("checkpointing the database log failed: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                        conn = None
                    continue
                self.runs += 1
                if row is not None and row[1] >= 0:  # (busy, the log's frames, those copied so far); -1: no log
                    self.frames, self.left = int(row[1]), int(row[1]) - int(row[2])
                    if self.frames and not self.left and self.copied is not None:
                        self.copied()
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
