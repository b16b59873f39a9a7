"""Follow session transcripts and ingest what hooks do not carry: assistant text, tool results, summaries.

Which files: a Claude transcript only once a hook named it (`transcript_path`; ~/.claude is never scanned, so only
sessions whose hooks reached us are read), its subagent files (`transcript.subagent_files`, and the
`agent_transcript_path` of SubagentStop), and Codex rollouts under `$CODEX_HOME/sessions`. `tail_transcripts =
false` turns all of it off; `import_file` still works.

How: one watchfiles watcher over the folders of the followed files (restarted when that set changes) wakes the loop,
and a poll every POLL_S seconds covers missed notifications (new folders, a watcher restart, network disks). Reading
and parsing run in a thread. A file's byte offset advances only in the transaction that commits its events
(`EventWriter.submit(also=...)`); event keys and the `dedup` column make any re-read harmless.

Offsets: checkpoint `tail:<path>` = {offset, ino, session_id, role, agent_id, fmt, codex} for every file, keyed by
path so it stays right when a session changes files; a main transcript also mirrors its offset into
`sessions.transcript_offset`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import json
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, cast

import aiosqlite
import watchfiles

from loomd.config import Config
from loomd.errors import Busy, LoomdError
from loomd.ingest.events import Event
from loomd.ingest.sessionfile import parse_line, read_session_file, to_event
from loomd.ingest.transcript import (
    CodexState,
    Format,
    TranscriptItem,
    codex_state_for,
    detect_format,
    loads,
    parse_claude_line,
    read_lines,
    read_subagent_meta,
    subagent_files,
)
from loomd.ingest.writer import EventWriter, Processor
from loomd.store.db import Store

log = logging.getLogger(__name__)

Role = Literal["main", "subagent", "codex"]
# Reads a whole session file into its events (`read_session_file`, wherever it runs).
Parse = Callable[[Path], Awaitable[tuple[Format, list[Event]]]]

POLL_S = 2.0
MIN_GAP_S = 0.1  # a busy watched folder (say /tmp) must not turn the loop into a spin
DISCOVER_S = 10.0  # subagent files and today's Codex folder
FULL_SCAN_S = 300.0  # every Codex rollout: `codex resume` appends to files in old date folders
RESUME_DAYS = 7.0
IDLE_RETIRE_S = 3600.0  # a hook or a rescan brings a retired file back the moment it matters again
MISSING_GRACE_S = 600.0  # hooks name the transcript before the agent creates it
GONE_GRACE_S = 60.0  # a rotated file can reappear under the same name
# A session that ended (its SessionEnd hook) writes nothing more but a last flush: its files are let go once read to
# the end and this long unchanged (a never-made one: this long after it was named). Kept to IDLE_RETIRE_S, the
# files of every session of the last hour (every one named in MISSING_GRACE_S, made or not) were stat'ed each pass
# and held in memory. A later hook of the session (a resume) follows them again from their checkpoints.
ENDED_IDLE_S = 60.0
BATCH_EVENTS = 500
READ_BYTES = 256 << 10
PASS_BYTES = 8 << 20  # per file per pass, so one large backlog does not starve the others
SUFFIXES = (".jsonl", ".json")


@dataclass
class Follower:
    """One followed file and where its reading stands."""

    key: str  # the path as named (absolute); also the checkpoint name suffix
    session_id: str  # events are stored under this session; "" means: the session the Codex file declares
    role: Role
    hint: str  # agent to assume when the content does not say
    cwd: str | None = None
    agent_id: str | None = None  # subagent files: their items are sidechains of `session_id`
    meta: dict[str, str] = field(default_factory=dict)
    fmt: Format | None = None
    offset: int = 0
    ino: int | None = None
    codex: CodexState = field(default_factory=CodexState)
    size: int = 0
    seen: bool = False
    missing_since: float | None = None
    active: float = field(default_factory=time.monotonic)  # last time the size changed
    error: str | None = None
    events: int = 0
    ended: bool = False  # its session's SessionEnd hook came (a main transcript); a later hook clears it

    @property
    def path(self) -> Path:
        return Path(self.key)

    def state(self) -> str:
        if self.error:
            return "error"
        if self.missing_since is not None:
            return "gone" if self.seen else "waiting"
        return "live" if self.seen else "waiting"


@dataclass
class Chunk:
    """What one read produced; applied to the follower only after its commit."""

    events: list[Event]
    offset: int
    ino: int
    fmt: Format | None
    codex: CodexState
    more: bool = False


@dataclass
class Request:
    key: str
    session_id: str
    role: Role
    hint: str
    cwd: str | None = None
    agent_id: str | None = None


class _Stopper:
    """Ends a watcher when the daemon stops or the watched folders change; watchfiles polls `is_set` from its thread."""

    def __init__(self, *events: asyncio.Event) -> None:
        self._events = events
        self._set = False

    def is_set(self) -> bool:
        return self._set or any(e.is_set() for e in self._events)

    def set(self) -> None:
        self._set = True


def _sniff(path: Path, hint: str) -> Format | None:
    with path.open("rb") as fh:
        first = fh.read(4096).lstrip()[:1]
    if not first:
        return None
    if first == b"[":
        return "claude_array"
    return detect_format(path) or ("codex" if hint == "codex" else "claude")


def _takes_over(known: Follower, session_id: str, role: Role) -> bool:
    """Whether a hook naming an already followed file changes whose file it is (a Codex rollout, a moved session)."""
    if role != "main" or known.role == "subagent" or not session_id:
        return False
    return known.role != "main" or known.session_id != session_id


def _normalise(path: str) -> str:
    return os.path.normpath(path)


def _stat_all(paths: list[str]) -> dict[str, os.stat_result | OSError]:
    out: dict[str, os.stat_result | OSError] = {}
    for p in paths:
        try:
            out[p] = os.stat(p)
        except OSError as exc:
            out[p] = exc
    return out


class Tailer:
    """Follows transcript files and feeds their items to the event writer; see the module docstring."""

    def __init__(self, config: Config, store: Store, writer: EventWriter) -> None:
        self.config = config
        self.store = store
        self.writer = writer
        self.enabled = config.tail_transcripts
        home = config.codex_home or os.environ.get("CODEX_HOME") or "~/.codex"
        self.codex_root = Path(os.path.abspath(os.path.expanduser(home))) / "sessions"
        self.followers: dict[str, Follower] = {}
        self.poll_s = POLL_S
        self.idle_retire_s = IDLE_RETIRE_S
        self.missing_grace_s = MISSING_GRACE_S
        self.gone_grace_s = GONE_GRACE_S
        self.ended_idle_s = ENDED_IDLE_S
        self.submitted = 0
        self.stored = 0
        self.dropped = 0
        self.passes = 0
        self.last_error: str | None = None
        self._requests: list[Request] = []
        self._wake = asyncio.Event()
        self._dirs_changed = asyncio.Event()
        self._watch_target: set[str] = set()
        self._watching: set[str] = set()
        self._discover_now = False
        self._last_discover: float | None = None
        self._last_full_scan: float | None = None
        self._logged_gone: set[str] = set()

    # --- intake ----------------------------------------------------------------------------------------------

    def listener(self, events: Sequence[Event]) -> None:
        """After each commit: start following every transcript a hook names. Runs in the writer task; stays cheap."""
        if not self.enabled:
            return
        for e in events:
            if e.source != "hook":
                continue
            if e.transcript_path:
                key = self._request(e.transcript_path, e.session_id, "main", e.agent, e.cwd, None)
                if (main := self.followers.get(key or "")) is not None and main.session_id == e.session_id:
                    main.ended = e.kind == "SessionEnd"
            sub = e.payload.get("agent_transcript_path")
            if isinstance(sub, str) and sub:
                agent_id = e.payload.get("agent_id")
                self._request(sub, e.session_id, "subagent", e.agent, e.cwd, str(agent_id) if agent_id else None)

    def _request(self, raw: str, session_id: str, role: Role, hint: str, cwd: str | None,
                 agent_id: str | None) -> str | None:
        """Follow the file (if not already); its key, None when the path cannot be resolved."""
        path = os.path.expanduser(raw)
        if not os.path.isabs(path):
            if not cwd:
                return None
            path = os.path.join(cwd, path)
        key = _normalise(path)
        known = self.followers.get(key)
        if known is not None and not _takes_over(known, session_id, role):
            if known.cwd is None:
                known.cwd = cwd
            return key
        self._requests.append(Request(key, session_id, role, hint, cwd, agent_id))
        self._wake.set()
        return key

    async def _add(self, req: Request) -> None:
        known = self.followers.get(req.key)
        if known is not None:
            if _takes_over(known, req.session_id, req.role):
                log.info("%s now belongs to session %s (was %s, %s)", req.key, req.session_id,
                         known.session_id or "?", known.role)
                known.session_id, known.role = req.session_id, "main"
            return
        if not req.key.endswith(SUFFIXES):
            if req.key not in self._logged_gone:
                self._logged_gone.add(req.key)
                log.warning("not following %s: a transcript ends in .jsonl or .json", req.key)
            return
        f = Follower(key=req.key, session_id=req.session_id, role=req.role, hint=req.hint, cwd=req.cwd,
                     agent_id=req.agent_id)
        f.codex = codex_state_for(f.path)
        row = await self.store.fetchone("SELECT value FROM checkpoints WHERE name = ?", (f"tail:{f.key}",))
        if row is not None:
            self._apply_checkpoint(f, row[0])
        elif f.role == "main":
            offset = await self.store.scalar(
                "SELECT transcript_offset FROM sessions WHERE id = ? AND transcript_path = ?", (f.session_id, f.key))
            f.offset = int(offset or 0)
        if f.role == "subagent":
            if f.agent_id is None and f.path.name.startswith("agent-"):
                f.agent_id = f.path.stem.removeprefix("agent-")
            meta = await asyncio.to_thread(read_subagent_meta, f.path)
            f.meta = {k: v for k, v in meta.items() if k in ("agentType", "description") and isinstance(v, str)}
        self.followers[f.key] = f
        if f.role == "main":
            self._discover_now = True  # its subagent files may already exist
        log.debug("following %s (%s, session %s, offset %d)", f.key, f.role, f.session_id or "?", f.offset)

    def _apply_checkpoint(self, f: Follower, value: str) -> None:
        try:
            data = json.loads(value)
            f.offset = int(data.get("offset", 0))
            f.ino = data.get("ino")
            if data.get("fmt") in ("claude", "codex", "claude_array"):
                f.fmt = data["fmt"]
            codex = data.get("codex")
            if isinstance(codex, dict):
                recent = dict(codex.get("recent") or {})
                f.codex = CodexState(str(codex.get("session_id") or ""), codex.get("cwd"), recent)
            if not f.session_id:
                f.session_id = str(data.get("session_id") or "")
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring a corrupt checkpoint for %s (%s); reading it from the start", f.key, exc)
            f.offset, f.ino = 0, None

    async def _resume(self) -> None:
        """Pick up where the last run stopped: recent checkpoints, then sessions (the Codex scan follows)."""
        since = time.time() - RESUME_DAYS * 86400
        for name, value in await self.store.fetchall(
                "SELECT name, value FROM checkpoints WHERE name LIKE 'tail:%' AND updated > ?", (since,)):
            try:
                data = json.loads(value)
                role: Role = data["role"] if data.get("role") in ("main", "subagent", "codex") else "main"
                req = Request(name[len("tail:"):], str(data.get("session_id") or ""), role,
                              str(data.get("hint") or "claude"), data.get("cwd"), data.get("agent_id"))
            except (ValueError, TypeError, KeyError, AttributeError):
                req = Request(name[len("tail:"):], "", "main", "claude")
            await self._add(req)
        for sid, agent, cwd, path in await self.store.fetchall(
                "SELECT id, agent, cwd, transcript_path FROM sessions WHERE transcript_path IS NOT NULL"
                " AND last_seen > ?", (since,)):
            await self._add(Request(_normalise(path), sid, "main", agent, cwd))
        if self.followers:
            log.info("resuming %d transcript file(s)", len(self.followers))

    # --- the loop ----------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until `stop` is set; started by the daemon as a background task."""
        if not self.enabled:
            log.info("transcript tailing is off (tail_transcripts = false)")
            return
        await self._resume()
        watcher = asyncio.create_task(self._watch(stop), name="tailer-watch")
        try:
            while not stop.is_set():
                self._wake.clear()
                while self._requests:
                    await self._add(self._requests.pop(0))
                await self._sync()
                await asyncio.sleep(MIN_GAP_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _sync(self) -> None:
        now = time.monotonic()
        last = self._last_discover
        if last is None or now - last > DISCOVER_S or (self._discover_now and now - last > 1.0):
            await self._discover(now)
        followers = list(self.followers.values())
        stats = await asyncio.to_thread(_stat_all, [f.key for f in followers])
        for f in followers:
            st = stats[f.key]
            if isinstance(st, FileNotFoundError | NotADirectoryError):
                self._missing(f, now)
                continue
            if isinstance(st, OSError):
                self._fail(f, f"cannot stat {f.key}: {st.strerror or st}")
                continue
            if not stat.S_ISREG(st.st_mode):
                self._fail(f, f"cannot read {f.key}: not a regular file")
                continue
            if f.missing_since is not None:
                if f.seen:
                    log.info("%s is back; reading it again", f.key)
                f.missing_since = None
            f.seen = True
            if st.st_size != f.size:
                f.size, f.active = st.st_size, now
            if st.st_size != f.offset or (f.ino is not None and st.st_ino != f.ino):
                try:
                    await self._pump(f)
                except Busy:
                    log.debug("event writer busy; %s waits for the next pass", f.key)
                    break
                except Exception as exc:  # noqa: BLE001 - one odd file must not stop every other follower
                    log.exception("unexpected failure following %s", f.key)
                    self._fail(f, f"unexpected failure following {f.key}: {exc!r}")
        self._retire_idle(now)
        await self._update_watch_target()
        self.passes += 1

    async def _pump(self, f: Follower) -> None:
        budget = PASS_BYTES
        while budget > 0:
            start = f.offset
            try:
                chunk = await asyncio.to_thread(self._read_chunk, f)
            except FileNotFoundError:
                self._missing(f, time.monotonic())
                return
            except OSError as exc:
                self._fail(f, f"cannot read {f.key}: {exc.strerror or exc}")
                return
            except (ValueError, RecursionError) as exc:
                self._fail(f, f"cannot parse {f.key}: {exc}")
                return
            if chunk.offset == f.offset and chunk.ino == f.ino and not chunk.events:
                f.fmt = chunk.fmt
                return
            try:
                await self._commit(f, chunk)
            except Busy:
                raise
            except (LoomdError, sqlite3.Error) as exc:
                self._fail(f, f"cannot store events from {f.key}: {exc}")
                return
            f.error = None
            budget -= max(0, chunk.offset - start)
            if not chunk.more:
                return

    def _read_chunk(self, f: Follower) -> Chunk:
        """In a thread: the next batch of events after `f.offset`. Does not touch `f`."""
        st = os.stat(f.key)
        if not stat.S_ISREG(st.st_mode):
            # A folder or a FIFO under a transcript's name: opening a FIFO would block a worker thread for good.
            raise OSError(errno.EINVAL, "not a regular file")
        offset, state, fmt = f.offset, copy.deepcopy(f.codex), f.fmt
        if (f.ino is not None and st.st_ino != f.ino) or st.st_size < offset:
            log.info("%s was replaced or truncated; reading it again from the start", f.key)
            offset = 0
            state = codex_state_for(f.path)
        chunk = Chunk([], offset, st.st_ino, fmt, state)
        if st.st_size == offset:
            return chunk
        if fmt is None:
            fmt = chunk.fmt = _sniff(f.path, f.hint)
            if fmt is None:
                return chunk
        if fmt == "claude_array":
            # A session turned into one array when it stopped: not appendable, so import it whole when it changes.
            try:
                data = loads(f.path.read_bytes())
            except ValueError:
                return chunk  # still being written; the next change brings it back
            objs = [o for o in data if isinstance(o, dict)] if isinstance(data, list) else []
            limit = self.config.max_tool_output_chars
            chunk.events = self._convert(f, [i for o in objs for i in parse_claude_line(o, max_chars=limit)])
            chunk.offset = st.st_size
            return chunk
        read_to = offset
        while len(chunk.events) < BATCH_EVENTS and read_to - offset < PASS_BYTES:
            objs, after = read_lines(f.path, read_to, max_bytes=READ_BYTES)
            if after <= read_to:
                break
            chunk.events.extend(self._convert(
                f, [i for o in objs for i in parse_line(o, fmt, state, self.config.max_tool_output_chars)]))
            read_to = after
        else:
            chunk.more = True
        chunk.offset = read_to
        return chunk

    def _convert(self, f: Follower, items: list[TranscriptItem]) -> list[Event]:
        limit = self.config.max_tool_output_chars
        subagent = (f.agent_id or "") if f.role == "subagent" else None
        return [
            to_event(item, session_id=f.session_id or item.session_id, cwd=f.cwd, max_chars=limit,
                     # Only a file no hook named may set the session's path; a hook's path always wins.
                     transcript_path=f.key if f.role == "codex" else None, subagent=subagent, meta=f.meta)
            for item in items
        ]

    async def _commit(self, f: Follower, chunk: Chunk) -> None:
        events = chunk.events
        parts = [events[i:i + BATCH_EVENTS] for i in range(0, len(events), BATCH_EVENTS)] or [[]]
        for n, part in enumerate(parts):
            # Only the last part carries the offset: a crash between parts re-reads, and dedupe absorbs it.
            await self.writer.submit(part, also=self._saver(f, chunk) if n == len(parts) - 1 else None, bulk=True)
            self.submitted += len(part)
            self.stored += sum(e.stored for e in part)
        f.offset, f.ino, f.fmt, f.codex = chunk.offset, chunk.ino, chunk.fmt, chunk.codex
        f.events += len(events)
        if not f.session_id and chunk.codex.session_id:
            f.session_id = chunk.codex.session_id

    def _saver(self, f: Follower, chunk: Chunk) -> Processor:
        value = json.dumps({
            "offset": chunk.offset, "ino": chunk.ino, "fmt": chunk.fmt, "role": f.role, "hint": f.hint,
            "session_id": f.session_id or chunk.codex.session_id, "agent_id": f.agent_id, "cwd": f.cwd,
            "codex": asdict(chunk.codex) if chunk.fmt == "codex" else None,
        })

        async def save(db: aiosqlite.Connection, _events: Sequence[Event]) -> None:
            await db.execute(
                "INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET"
                " value = excluded.value, updated = excluded.updated", (f"tail:{f.key}", value, time.time()))
            if f.role == "main":
                # Guarded by path: once a session moves to another file, this file's offset must not overwrite it.
                await db.execute("UPDATE sessions SET transcript_offset = ? WHERE id = ? AND transcript_path = ?",
                                 (chunk.offset, f.session_id, f.key))

        return save

    def _missing(self, f: Follower, now: float) -> None:
        if f.missing_since is None:
            f.missing_since = now
            if f.seen and f.key not in self._logged_gone:
                self._logged_gone.add(f.key)
                log.warning("%s was deleted; no longer following it", f.key)
        if now - f.missing_since > (self.gone_grace_s if f.seen else self.missing_grace_s):
            self._drop(f)

    def _fail(self, f: Follower, message: str) -> None:
        if f.error != message:
            log.warning("%s", message)
        f.error = message
        self.last_error = message

    def _drop(self, f: Follower) -> None:
        if self.followers.pop(f.key, None) is not None:
            self.dropped += 1

    def _retire_idle(self, now: float) -> None:
        ended = {f.session_id for f in self.followers.values() if f.role == "main" and f.ended}

        def idle(f: Follower) -> bool:
            if f.session_id in ended:
                return now - f.active > self.ended_idle_s and (not f.seen or f.offset >= f.size)
            return now - f.active > self.idle_retire_s

        subagents: dict[str, list[Follower]] = {}
        for f in self.followers.values():
            if f.role == "subagent":
                subagents.setdefault(f.session_id, []).append(f)
        mains = {f.session_id for f in self.followers.values() if f.role == "main"}
        for f in list(self.followers.values()):
            if f.role == "main":
                # A session and its subagent files go together, or discovery would bring the subagents straight back.
                group = [f, *subagents.get(f.session_id, [])]
                if all(idle(g) for g in group):
                    for g in group:
                        self.followers.pop(g.key, None)
            elif idle(f) and (f.role == "codex" or f.session_id not in mains):
                self.followers.pop(f.key, None)

    # --- discovery and watching ----------------------------------------------------------------------------

    async def _discover(self, now: float) -> None:
        self._discover_now = False
        self._last_discover = now
        full = self._last_full_scan is None or now - self._last_full_scan > FULL_SCAN_S
        # At startup, rollouts of the last days; later, only files written since a follower could have retired.
        window = RESUME_DAYS * 86400 if self._last_full_scan is None else self.idle_retire_s
        if full:
            self._last_full_scan = now
        mains = [(f.key, f.session_id, f.cwd) for f in self.followers.values()
                 if f.role == "main" and f.fmt in (None, "claude")]
        known = frozenset(self.followers)
        for req in await asyncio.to_thread(self._find, mains, known, full, time.time() - window):
            await self._add(req)

    def _find(self, mains: list[tuple[str, str, str | None]], known: frozenset[str], full: bool,
              since: float) -> list[Request]:
        """In a thread: subagent files of the followed sessions, and Codex rollouts written since `since`."""
        found: list[Request] = []
        for key, session_id, cwd in mains:
            for p in subagent_files(Path(key)):
                if str(p) not in known:
                    found.append(Request(str(p), session_id, "subagent", "claude", cwd))
        if not self.codex_root.is_dir():
            return found
        if full:
            candidates: Iterable[Path] = self.codex_root.rglob("rollout-*.jsonl")
        else:
            candidates = (p for d in self._codex_recent_dirs() for p in d.glob("rollout-*.jsonl"))
        for p in candidates:
            with contextlib.suppress(OSError):
                if str(p) not in known and p.stat().st_mtime >= since:
                    found.append(Request(str(p), "", "codex", "codex"))
        return found

    def _codex_recent_dirs(self) -> list[Path]:
        days: set[tuple[int, int, int]] = set()
        for now in (datetime.now(), datetime.now(UTC)):
            for back in (0, 1):
                d = now - timedelta(days=back)
                days.add((d.year, d.month, d.day))
        return [self.codex_root, *(self.codex_root / f"{y:04d}" / f"{m:02d}" / f"{d:02d}" for y, m, d in days)]

    def _wanted_dirs(self) -> set[str]:
        dirs: set[str] = set()
        for f in self.followers.values():
            dirs.add(os.path.dirname(f.key))
            if f.role == "main":
                session_dir = f.path.with_suffix("")
                dirs.update((str(session_dir), str(session_dir / "subagents")))
        if self.enabled:
            dirs.update(str(d) for d in self._codex_recent_dirs())
        return dirs

    async def _update_watch_target(self) -> None:
        wanted = self._wanted_dirs()
        existing = await asyncio.to_thread(lambda: {d for d in wanted if os.path.isdir(d)})
        if existing != self._watch_target:
            self._watch_target = existing
            self._dirs_changed.set()
            self._discover_now = True  # a folder that just appeared may already hold files no watcher saw arrive

    async def _watch(self, stop: asyncio.Event) -> None:
        """Wake the loop on any change in a watched folder; the poll is the safety net, so errors only pause this."""
        while not stop.is_set():
            dirs = sorted(self._watch_target)
            self._dirs_changed.clear()
            if not dirs:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirs_changed.wait(), self.poll_s)
                continue
            self._watching = set(dirs)
            # Duck-typed: awatch only calls `is_set` (its annotation names trio's Event too once trio is installed).
            stopper = cast(asyncio.Event, _Stopper(stop, self._dirs_changed))
            try:
                async for changes in watchfiles.awatch(*dirs, watch_filter=None, recursive=False, debounce=50, step=50,
                                                       stop_event=stopper):
                    for _change, raw in changes:
                        # Only names that can be new subagent files or rollouts; a project folder is busy.
                        if raw not in self.followers and os.path.basename(raw).startswith(("agent-", "rollout-")):
                            self._discover_now = True
                    self._wake.set()
            except (OSError, RuntimeError) as exc:
                # A folder can vanish between the check and the watch; the poll covers the gap.
                log.debug("transcript watcher restarting: %s", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirs_changed.wait(), self.poll_s)
            finally:
                self._watching = set()

    # --- one-shot import and status --------------------------------------------------------------------------

    async def import_file(self, path: str | Path, *, session_id: str | None = None, cwd: str | None = None,
                          also: Processor | None = None, parse: Parse | None = None) -> dict[str, Any]:
        """Ingest a whole session file once (a chat.json array, or a finished JSONL); repeating it stores nothing.

        `also` commits with the file's last events (`loom import` records the file as done there); `parse` reads
        the file instead of a thread of this process (`loom import` parses in child processes)."""
        p = Path(path)
        if parse is None:
            fmt, events = await asyncio.to_thread(self._import_events, p, session_id, cwd)
        else:
            fmt, events = await parse(p)
        stored = 0
        parts = [events[i:i + BATCH_EVENTS] for i in range(0, len(events), BATCH_EVENTS)] or [[]]
        for n, part in enumerate(parts):
            await self.writer.submit(part, also=also if n == len(parts) - 1 else None, bulk=True)
            stored += sum(e.stored for e in part)
        return {"path": str(p), "format": fmt, "events": len(events), "stored": stored,
                "sessions": sorted({e.session_id for e in events})}

    def _import_events(self, p: Path, session_id: str | None, cwd: str | None) -> tuple[Format, list[Event]]:
        return read_session_file(p, session_id, cwd, self.config.max_tool_output_chars)

    def status(self) -> dict[str, Any]:
        """For `status` and `doctor`: what is followed, how far behind, the last error."""
        followers = list(self.followers.values())
        states = [f.state() for f in followers]
        behind = sorted(followers, key=lambda f: f.size - f.offset, reverse=True)
        return {
            "enabled": self.enabled,
            "files": len(followers),
            "live": states.count("live"), "waiting": states.count("waiting"), "gone": states.count("gone"),
            "errors": states.count("error"),
            "bytes_behind": sum(max(0, f.size - f.offset) for f in followers if f.seen and f.missing_since is None),
            "events_submitted": self.submitted, "events_stored": self.stored, "dropped": self.dropped,
            "passes": self.passes,
            "watching": len(self._watching), "codex_sessions": str(self.codex_root),
            "last_error": self.last_error,
            "followed": [
                {"path": f.key, "session_id": f.session_id, "role": f.role, "format": f.fmt, "state": f.state(),
                 "offset": f.offset, "size": f.size, "events": f.events, "error": f.error}
                for f in behind[:50]
            ],
        }
