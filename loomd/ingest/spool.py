"""The shim's spool: one msgpack file per event written while the daemon was away, replayed idempotently.

The one place where secrets sit unredacted: the shim imports nothing and cannot run `redact.py`, so a spool file
holds the agent's raw hook bytes (as its own transcript file does). It is bounded instead: 0600 in a 0700 folder,
unlinked as soon as its (redacted) event is committed, and a file the daemon refuses is kept redacted in `rejected/`.

A file is the file's own problem, never the whole spool's: one loomd cannot read, or that is not a regular file of
its own user (a hook once run under `sudo`, a symlink), is moved as it is into `quarantine/`; one that is no valid
event goes redacted to `rejected/`. What is not the file's fault (out of file descriptors, a busy store) pauses the
pass until the next tick. A `.tmp-*` file older than ORPHAN_AGE_S was left by a shim killed while spooling: it is
replayed like the others (ingested if complete, else kept redacted in `rejected/`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import watchfiles

from loomd.errors import BadRequest, LoomdError
from loomd.redact import redact_text, redact_value
from loomd.trust import make_private_dir

log = logging.getLogger(__name__)

SUFFIX = ".msgpack"
TEMP_PREFIX = ".tmp-"  # the shim writes <spool>/.tmp-<eid>, then renames it to <eid>.msgpack
ORPHAN_AGE_S = 60.0  # no live shim takes this long to write its file (its own watchdog ends it within seconds)
RETRY_S = 5.0
BATCH = 32
# What a spool file can do wrong: it stays in spool/rejected (redacted) instead of blocking the rest.
REJECT = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, BadRequest)
# Errors of the process, not of the file: the pass stops and the file waits for the next one.
NOT_THE_FILES_FAULT = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EINTR, errno.EAGAIN}


class SpoolReplaced(LoomdError):
    """The spool folder went away or was swapped for another while the watcher ran."""

    code = "spool_replaced"


class Unreadable(Exception):
    """A spool file loomd cannot or must not read; it is quarantined as it is."""


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(_text(k)): _text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text(v) for v in value]
    return value


def redacted_copy(data: bytes) -> bytes:
    """The spool file's map with every secret redacted (raw bytes as text), or its bytes as redacted text."""
    try:
        value: Any = _text(msgpack.unpackb(data, raw=False, strict_map_key=False))
    except (ValueError, TypeError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        value = data.decode("utf-8", "replace")
    try:
        return msgpack.packb(redact_value(value), use_bin_type=True)
    except (ValueError, TypeError, RecursionError):
        return msgpack.packb(redact_text(repr(value)), use_bin_type=True)


def read_own_file(path: Path) -> bytes:
    """The bytes of `path` if it is a regular file of this user, never following a symlink; else Unreadable.

    FileNotFoundError (another pass took it) and the process's own limits (EMFILE, …) are raised as they are.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in NOT_THE_FILES_FAULT:
            raise
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise Unreadable(f"cannot open: {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not a regular file")
        if st.st_uid != os.geteuid():
            raise Unreadable(f"belongs to uid {st.st_uid}, not {os.geteuid()}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        if exc.errno in NOT_THE_FILES_FAULT:
            raise
        raise Unreadable(f"cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)


class Spool:
    """Replays `<dir>/*.msgpack` through `ingest`; a file is unlinked only after its event is committed."""

    def __init__(self, directory: Path, ingest: Callable[[dict[str, Any]], Awaitable[Any]], batch: int = BATCH) -> None:
        self.dir = directory
        self.batch = max(1, batch)
        self.rejected = directory / "rejected"
        self.quarantine = directory / "quarantine"
        self.ingest = ingest
        self.replayed = 0
        self.moved_aside = 0
        self.quarantined = 0
        self.temp_reaped = 0
        self.last_error: str | None = None
        self._last_backlog = 0
        self._stuck: set[str] = set()  # files that could be neither read nor moved: skipped, reported
        self._identity: tuple[int, int, int] | None = None
        self._lock = asyncio.Lock()

    def prepare(self) -> None:
        """Create the folder 0700, or check the one there (UntrustedPath for a symlink or another user's folder)."""
        make_private_dir(self.dir)
        self._identity = self._identify()

    def _identify(self) -> tuple[int, int, int]:
        st = os.lstat(self.dir)
        return st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)  # the type too: a freed inode is soon reused

    def pending(self) -> list[Path]:
        """Complete spool files and orphaned temporary ones, oldest name first; [] (and last_error) if unlistable."""
        now = time.time()
        stuck: set[str] = set()
        try:
            with os.scandir(self.dir) as entries:
                found = []
                for entry in entries:
                    if entry.name in self._stuck:
                        stuck.add(entry.name)
                        continue
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                        found.append(Path(entry.path))
                    elif entry.name.startswith(TEMP_PREFIX) and self._orphaned(entry, now):
                        found.append(Path(entry.path))
        except FileNotFoundError:
            return []
        except OSError as exc:  # EMFILE under a flood of connections, a folder made unreadable: retry next tick
            self._failed(f"cannot list {self.dir}: {exc.strerror or exc}")
            return []
        self._stuck = stuck  # one the user removed is no longer waiting; the rest are retried after a restart
        self._last_backlog = len(found) + len(stuck)
        return sorted(found, key=lambda p: p.name.removeprefix(TEMP_PREFIX))

    @staticmethod
    def _orphaned(entry: os.DirEntry[str], now: float) -> bool:
        try:
            return now - entry.stat(follow_symlinks=False).st_mtime > ORPHAN_AGE_S
        except OSError:
            return False

    def backlog(self) -> int:
        self.pending()
        return self._last_backlog

    def status(self) -> dict[str, Any]:
        """What `status` shows of the spool: waiting files, where the others went, and the last trouble."""
        oldest = None
        for path in self.pending():
            try:
                oldest = min(oldest or time.time(), path.lstat().st_mtime)
            except OSError:
                continue
        return {"backlog": self._last_backlog, "replayed": self.replayed, "rejected": self.moved_aside,
                "quarantined": self.quarantined, "temp_reaped": self.temp_reaped, "stuck": sorted(self._stuck),
                "oldest_waiting_s": None if oldest is None else round(time.time() - oldest, 1),
                "last_error": self.last_error}

    def _failed(self, message: str) -> None:
        if message != self.last_error:
            log.warning("spool: %s", message)
        self.last_error = message

    async def replay(self) -> int:
        """Ingest every complete spool file; stop early (and retry later) if the store or the process is struggling.

        Files go in concurrent groups of BATCH, so the event writer commits each group in one transaction; a file
        is unlinked only after its own event is committed. Returns how many files left the spool.
        """
        done = progress = 0
        async with self._lock:
            pending = self.pending()
            for start in range(0, len(pending), self.batch):
                loaded: list[tuple[Path, bytes]] = []
                paused: BaseException | None = None
                for path in pending[start:start + self.batch]:
                    try:
                        loaded.append((path, await asyncio.to_thread(read_own_file, path)))
                    except FileNotFoundError:
                        continue
                    except Unreadable as exc:
                        progress += self._quarantine(path, str(exc))
                    except OSError as exc:  # out of descriptors or memory: the file is fine, try again later
                        paused = exc
                        break
                results = await asyncio.gather(*(self._ingest_one(data) for _, data in loaded),
                                               return_exceptions=True)
                for (path, data), result in zip(loaded, results, strict=True):
                    if result is None:
                        path.unlink(missing_ok=True)
                        done += 1
                        self.temp_reaped += path.name.startswith(TEMP_PREFIX)
                    elif isinstance(result, REJECT):
                        progress += self._move_aside(path, str(result), data)
                    elif isinstance(result, LoomdError):
                        paused = paused or result  # the file stays for the next pass
                    elif isinstance(result, Exception):  # a bug, not the file's fault: keep it, never stall the rest
                        log.error("spool file %s failed with %s", path.name, type(result).__name__)
                        progress += self._move_aside(path, f"{type(result).__name__}: {result}", data)
                    else:
                        raise result
                if paused is not None:
                    self._failed(f"replay paused: {redact_text(str(paused))[:300]}")
                    break
            else:
                self.last_error = None
        if done:
            self.replayed += done
            log.info("replayed %d spooled event(s)", done)
        return done + progress

    async def _ingest_one(self, data: bytes) -> None:
        args = msgpack.unpackb(data, raw=False)
        if not isinstance(args, dict):
            raise BadRequest("spool file does not hold a map")
        args.pop("context", None)
        args.pop("deadline_ms", None)
        await self.ingest(args)

    @staticmethod
    def _kept_name(path: Path) -> str:
        name = path.name
        return name[len(TEMP_PREFIX):] + SUFFIX if name.startswith(TEMP_PREFIX) else name

    def _move_aside(self, path: Path, why: str, data: bytes) -> int:
        """Keep a file the daemon cannot ingest for inspection, redacted: the shim spooled the agent's raw bytes."""
        make_private_dir(self.rejected)
        (self.rejected / self._kept_name(path)).write_bytes(redacted_copy(data))
        path.unlink(missing_ok=True)
        self.moved_aside += 1
        self.temp_reaped += path.name.startswith(TEMP_PREFIX)
        log.warning("moved corrupt spool file %s aside to %s: %s", path.name, self.rejected, redact_text(why)[:200])
        return 1

    def _quarantine(self, path: Path, why: str) -> int:
        """Move a file loomd cannot read (or must not) into quarantine/ as it is; if even that fails, skip it."""
        try:
            make_private_dir(self.quarantine)
            target = self.quarantine / self._kept_name(path)
            if target.exists() or target.is_symlink():
                target = target.with_name(f"{target.name}.{time.time_ns()}")
            os.rename(path, target)
        except (OSError, LoomdError) as exc:
            self._stuck.add(path.name)
            self._failed(f"cannot read or move {path} ({why}; {exc}): skipped, see `loom doctor`")
            return 0
        self.quarantined += 1
        self.temp_reaped += path.name.startswith(TEMP_PREFIX)
        log.warning("quarantined spool file %s in %s: %s", path.name, self.quarantine, why)
        return 1

    def _check_folder(self, changes: set[tuple[watchfiles.Change, str]]) -> None:
        """Raise SpoolReplaced if the folder being watched is gone or is another one now."""
        try:
            identity = self._identify()
        except FileNotFoundError:
            raise SpoolReplaced(f"{self.dir} is gone") from None
        if identity != self._identity or (watchfiles.Change.deleted, str(self.dir)) in changes:
            raise SpoolReplaced(f"{self.dir} was replaced while loomd watched it")

    async def watch(self, stop: asyncio.Event) -> None:
        """Replay at start, on every new file, and every few seconds while a backlog remains.

        Runs under the daemon's supervisor: it (re)creates or checks the folder first, and ends with SpoolReplaced
        when the folder it watches is swapped, so the next run watches the new one (or refuses it).
        """
        self.prepare()
        await self.replay()
        watcher = watchfiles.awatch(self.dir, stop_event=stop, debounce=50, step=20, rust_timeout=int(RETRY_S * 1000),
                                    yield_on_timeout=True, recursive=False)
        async for changes in watcher:
            self._check_folder(changes)
            # Keep going while each pass makes progress (a busy writer pauses a pass, it does not stop it);
            # a pass that ingests nothing (a locked or full disk) waits for the next file or tick.
            while self.backlog():
                if not await self.replay():
                    break
                await asyncio.sleep(0.05)  # live hooks first
