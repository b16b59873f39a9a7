"""The shim's spool: one msgpack file per event written while the daemon was away, replayed idempotently.

The one place where secrets sit unredacted: the shim imports nothing and cannot run `redact.py`, so a spool file
holds the agent's raw hook bytes (as its own transcript file does). It is bounded instead: 0600 in a 0700 folder,
unlinked as soon as its (redacted) event is committed, and a file the daemon refuses is kept redacted in `rejected/`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import watchfiles

from loomd.errors import BadRequest, LoomdError
from loomd.redact import redact_text, redact_value

log = logging.getLogger(__name__)

SUFFIX = ".msgpack"
RETRY_S = 5.0
BATCH = 32
# What a spool file can do wrong: it stays in spool/rejected (redacted) instead of blocking the rest.
REJECT = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, BadRequest)


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


class Spool:
    """Replays `<dir>/*.msgpack` through `ingest`; a file is unlinked only after its event is committed."""

    def __init__(self, directory: Path, ingest: Callable[[dict[str, Any]], Awaitable[Any]], batch: int = BATCH) -> None:
        self.dir = directory
        self.batch = max(1, batch)
        self.rejected = directory / "rejected"
        self.ingest = ingest
        self.replayed = 0
        self.moved_aside = 0
        self._lock = asyncio.Lock()

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)

    def pending(self) -> list[Path]:
        try:
            return sorted(p for p in self.dir.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def backlog(self) -> int:
        return len(self.pending())

    async def replay(self) -> int:
        """Ingest every complete spool file; stop early (and retry later) if the store is struggling.

        Files go in concurrent groups of BATCH, so the event writer commits each group in one transaction; a file
        is unlinked only after its own event is committed.
        """
        done = 0
        async with self._lock:
            pending = self.pending()
            for start in range(0, len(pending), self.batch):
                loaded: list[tuple[Path, bytes]] = []
                for path in pending[start:start + self.batch]:
                    try:
                        loaded.append((path, await asyncio.to_thread(path.read_bytes)))
                    except FileNotFoundError:
                        continue
                results = await asyncio.gather(*(self._ingest_one(data) for _, data in loaded),
                                               return_exceptions=True)
                paused: BaseException | None = None
                for (path, data), result in zip(loaded, results, strict=True):
                    if result is None:
                        path.unlink(missing_ok=True)
                        done += 1
                    elif isinstance(result, REJECT):
                        self._move_aside(path, str(result), data)
                    elif isinstance(result, LoomdError):
                        paused = paused or result  # the file stays for the next pass
                    elif isinstance(result, Exception):  # a bug, not the file's fault: keep it, never stall the rest
                        log.error("spool file %s failed with %s", path.name, type(result).__name__)
                        self._move_aside(path, f"{type(result).__name__}: {result}", data)
                    else:
                        raise result
                if paused is not None:
                    log.warning("spool replay paused: %s", redact_text(str(paused))[:300])
                    break
        if done:
            self.replayed += done
            log.info("replayed %d spooled event(s)", done)
        return done

    async def _ingest_one(self, data: bytes) -> None:
        args = msgpack.unpackb(data, raw=False)
        if not isinstance(args, dict):
            raise BadRequest("spool file does not hold a map")
        args.pop("context", None)
        args.pop("deadline_ms", None)
        await self.ingest(args)

    def _move_aside(self, path: Path, why: str, data: bytes) -> None:
        """Keep a file the daemon cannot ingest for inspection, redacted: the shim spooled the agent's raw bytes."""
        self.rejected.mkdir(exist_ok=True, mode=0o700)
        (self.rejected / path.name).write_bytes(redacted_copy(data))
        path.unlink(missing_ok=True)
        self.moved_aside += 1
        log.warning("moved corrupt spool file %s aside to %s: %s", path.name, self.rejected, redact_text(why)[:200])

    async def watch(self, stop: asyncio.Event) -> None:
        """Replay at start, on every new file, and every few seconds while a backlog remains."""
        await self.replay()
        watcher = watchfiles.awatch(self.dir, stop_event=stop, debounce=50, step=20, rust_timeout=int(RETRY_S * 1000),
                                    yield_on_timeout=True, recursive=False)
        async for _changes in watcher:
            # Keep going while each pass makes progress (a busy writer pauses a pass, it does not stop it);
            # a pass that ingests nothing (a locked or full disk) waits for the next file or tick.
            while self.backlog():
                if not await self.replay():
                    break
                await asyncio.sleep(0.05)  # live hooks first
