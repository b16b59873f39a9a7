"""The shim's spool: one msgpack file per event written while the daemon was away, replayed idempotently."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import watchfiles

from .errors import BadRequest, LoomdError
from .redact import redact_text, redact_value

log = logging.getLogger(__name__)

SUFFIX = ".msgpack"
RETRY_S = 5.0


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

    def __init__(self, directory: Path, ingest: Callable[[dict[str, Any]], Awaitable[Any]]) -> None:
        self.dir = directory
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
        """Ingest every complete spool file; stop early (and retry later) if the store is struggling."""
        done = 0
        async with self._lock:
            for path in self.pending():
                try:
                    data = await asyncio.to_thread(path.read_bytes)
                except FileNotFoundError:
                    continue
                try:
                    args = msgpack.unpackb(data, raw=False)
                    if not isinstance(args, dict):
                        raise BadRequest("spool file does not hold a map")
                    args.pop("context", None)
                    args.pop("deadline_ms", None)
                    args.pop("sent_at", None)
                    await self.ingest(args)
                except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
                        BadRequest) as exc:
                    self._move_aside(path, str(exc), data)
                    continue
                except LoomdError as exc:
                    log.warning("spool replay paused at %s: %s", path.name, exc)
                    break
                path.unlink(missing_ok=True)
                done += 1
        if done:
            self.replayed += done
            log.info("replayed %d spooled event(s)", done)
        return done

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
            if self.backlog():
                await self.replay()
