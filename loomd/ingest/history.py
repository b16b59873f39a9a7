"""`loom import`: find the sessions a user had before loomd (Claude Code and Codex history), describe them, and
import them one file at a time through the tailer's own one-shot import.

Where: Claude Code keeps `<config>/projects/<folder>/<session>.jsonl` (config = `$CLAUDE_CONFIG_DIR` or
`~/.claude`), with subagent files under `<session>/subagents/` (2.1.x) or as `agent-*.jsonl` siblings (2.0.x);
Codex keeps `<home>/sessions/YYYY/MM/DD/rollout-*.jsonl` (home = `$CODEX_HOME` or `~/.codex`). The CLI resolves
those folders from its own environment and sends them: the daemon may run under a service manager with another one.

Why through `Tailer.import_file`: the same parsers and the same event keys as tailing, so a session hooks or the
tailer already captured is not stored twice, and a re-run stores nothing. A file whose import finished is recorded
in the checkpoint `import:<path>` ({size, mtime_ns, ino}) in the transaction of its last events, so a re-run after a
kill skips what is done and re-reads only the file it was in (whose events are already keyed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import aiosqlite

from loomd.errors import BadRequest, ChildDied
from loomd.ingest.events import Event
from loomd.ingest.sessionfile import read_session_file
from loomd.ingest.tailer import Tailer
from loomd.ingest.transcript import Format, loads, loads_object, sniff
from loomd.ingest.transcript import _ts as transcript_ts
from loomd.ingest.writer import Processor
from loomd.offload import Offload
from loomd.store.db import Store

log = logging.getLogger(__name__)

Agent = Literal["claude", "codex"]
SOURCES: tuple[Agent, ...] = ("claude", "codex")
HEAD_LINES = 50  # where a session states its folder, id and start
TAIL_BYTES = 64 << 10  # where it states its end
CHECKPOINT = "import:"
# After its last file, an import still counts as running this long: the CLI's next file follows at once.
ACTIVE_GRACE_S = 2.0
# Child processes that parse history files, one per core up to 4 (each holds ~37 MB while an import runs): they run
# only on CPU time nothing else wants (`ParserPool`), so the daemon's writes and hooks never wait for them, and
# parsing is most of an import's CPU (on 2 cores, one parser was the import's limit).
PARSERS = max(1, min(4, os.cpu_count() or 1))
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class HistoryFile:
    """One transcript file found, as `import_scan` describes it."""

    path: str
    agent: Agent
    format: Format
    session_id: str
    project: str  # the session's working folder when the file says, else the folder Claude filed it under
    subagent: bool
    bytes: int
    lines: int  # the estimate of its events: one per line, the usual case
    first_ts: float | None
    last_ts: float | None
    imported: bool  # a finished import of this very file (same size, time and inode) is on record


def history_sources(sources: Sequence[str], claude_dir: str | None, codex_dir: str | None) -> list[Path]:
    """The files named by `claude`, `codex` and paths (files, or folders searched for `*.jsonl`), sorted, once each."""
    found: set[Path] = set()
    for source in sources:
        try:
            found.update(_source_files(source, claude_dir, codex_dir))
        except OSError as exc:  # a name too long, a folder not readable: the caller's to fix, not a daemon fault
            raise BadRequest(f"{source!r}: cannot be listed: {exc.strerror or exc}") from exc
    return sorted(found)


def _source_files(source: str, claude_dir: str | None, codex_dir: str | None) -> set[Path]:
    if source == "claude":
        return set(_jsonl_under(_root(claude_dir or os.environ.get("CLAUDE_CONFIG_DIR"), "~/.claude") / "projects"))
    if source == "codex":
        return set(_jsonl_under(_root(codex_dir or os.environ.get("CODEX_HOME"), "~/.codex") / "sessions"))
    path = Path(source).expanduser()
    if not path.is_absolute():
        raise BadRequest(f"{source!r}: a path to import must be absolute (the daemon has its own folder)")
    if path.is_dir():
        return set(_jsonl_under(path))
    if path.is_file():
        return {path}
    raise BadRequest(f"{source!r} is neither 'claude', 'codex' nor an existing file or folder")


def _root(configured: str | None, default: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(configured or default)))


def _jsonl_under(folder: Path) -> Iterable[Path]:
    if not folder.is_dir():
        return []
    return (p for p in folder.rglob("*.jsonl") if p.is_file())


def describe(path: Path, done: dict[str, Any] | None) -> HistoryFile | None:
    """What one file holds, from its first lines and its last ones; None for a file that is no transcript."""
    fmt, sniffed = sniff(path)
    if fmt is None:
        return None
    st = path.stat()
    array = _array(path) if fmt == "claude_array" else None
    agent: Agent = "codex" if fmt == "codex" else "claude"
    session_id = cwd = ""
    first_ts = last_ts = None
    for obj in array if array is not None else _head(path, sniffed):
        raw_payload = obj.get("payload")
        payload: dict[str, Any] = raw_payload if isinstance(raw_payload, dict) else {}
        if not session_id:
            session_id = _text(obj.get("sessionId")) or (
                _text(payload.get("id")) if obj.get("type") == "session_meta" else "")
        cwd = cwd or _text(obj.get("cwd")) or _text(payload.get("cwd"))
        first_ts = first_ts or _ts(obj.get("timestamp"))
        if session_id and cwd and first_ts:
            break  # what the head can tell is known: the rest of it is not parsed
    for obj in reversed(array) if array is not None else _tail(path):
        last_ts = _ts(obj.get("timestamp"))
        if last_ts:
            break
    if not session_id:
        m = _UUID_RE.search(path.name)
        session_id = m.group(0) if m else path.stem
    subagent = agent == "claude" and path.name.startswith("agent-")
    folder = path.parent.parent.parent if path.parent.name == "subagents" else path.parent
    return HistoryFile(
        path=str(path), agent=agent, format=fmt, session_id=session_id, project=cwd or folder.name,
        subagent=subagent, bytes=st.st_size, lines=len(array) if array is not None else _count_lines(path),
        first_ts=first_ts, last_ts=last_ts or first_ts or st.st_mtime, imported=_same_file(done, st),
    )


def _array(path: Path) -> list[dict[str, Any]]:
    data = loads(path.read_bytes())  # detect_format has parsed it already: it is a list
    return [o for o in data if isinstance(o, dict)]


def _head(path: Path, sniffed: list[dict[str, Any] | None]) -> Iterator[dict[str, Any]]:
    """The objects of a JSONL file's first HEAD_LINES lines: those `sniff` decoded already (`sniffed`, one entry a
    line), then the rest, parsed as they are read (the scan decoded each file's head twice)."""
    kept = sniffed[:HEAD_LINES]
    yield from (obj for obj in kept if obj is not None)
    if len(kept) == HEAD_LINES:
        return
    with path.open("rb") as fh:
        for raw in itertools.islice(fh, len(kept), HEAD_LINES):
            obj = loads_object(raw)
            if obj is not None:
                yield obj


def _tail(path: Path) -> Iterator[dict[str, Any]]:
    """The objects of the lines in a file's last TAIL_BYTES, last first, parsed as they are asked for."""
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - TAIL_BYTES))
        lines = fh.read().split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first piece is the end of a line cut in the middle
    return (o for o in map(loads_object, reversed(lines)) if o is not None)


COUNT_BLOCK = 64 << 10  # `_count_lines` reads into one buffer this big, which stays in the CPU's cache


def _count_lines(path: Path) -> int:
    # A scan reads every byte of the history here: into one small buffer, not a fresh megabyte a read (its pages
    # faulted in each time): 15 % less CPU (61 against 72 ms for 118 MB).
    n, last = 0, b"\n"
    buf = bytearray(COUNT_BLOCK)
    with path.open("rb", buffering=0) as fh:
        while got := fh.readinto(buf):
            n += (buf if got == COUNT_BLOCK else buf[:got]).count(b"\n")
            last = bytes(buf[got - 1:got])
    return n + (last != b"\n")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _ts(value: Any) -> float | None:
    return transcript_ts(value) or None  # the stored events' own reading of a timestamp


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _same_file(done: dict[str, Any] | None, st: os.stat_result) -> bool:
    return done is not None and {k: done.get(k) for k in ("size", "mtime_ns", "ino")} == _fingerprint(st)


def select(files: Iterable[HistoryFile], *, since: float | None, project: str | None) -> list[HistoryFile]:
    """`--since` keeps sessions active on or after that time; `--project` those whose folder contains the text."""
    return [f for f in files
            if (since is None or (f.last_ts or 0) >= since)
            and (not project or project in f.project or project in f.path)]


def summarize(files: Sequence[HistoryFile]) -> dict[str, Any]:
    """What `loom import` shows before it asks: projects, sessions, events, dates; and what is already done."""
    todo = [f for f in files if not f.imported]
    stamps = [t for f in files for t in (f.first_ts, f.last_ts) if t]
    projects: dict[str, dict[str, int]] = {}
    for f in files:
        p = projects.setdefault(f.project, {"sessions": 0, "files": 0, "events": 0})
        p["files"] += 1
        p["events"] += f.lines
        p["sessions"] += not f.subagent
    return {
        "files": len(files), "sessions": len({(f.agent, f.session_id) for f in files}),
        "projects": len(projects), "events_estimate": sum(f.lines for f in files),
        "bytes": sum(f.bytes for f in files), "first_ts": min(stamps, default=None),
        "last_ts": max(stamps, default=None),
        "agents": {a: sum(1 for f in files if f.agent == a and not f.subagent) for a in SOURCES},
        "imported_files": len(files) - len(todo), "todo_files": len(todo),
        "todo_events_estimate": sum(f.lines for f in todo), "todo_bytes": sum(f.bytes for f in todo),
        "by_project": dict(sorted(projects.items(), key=lambda kv: -kv[1]["events"])),
    }


class ParserPool:
    """Child processes that read, parse and redact whole history files for `loom import` (`read_session_file`).

    Redaction is most of an import's CPU; in the daemon's process it would hold the event loop's interpreter lock
    and run on one core. Here it runs beside the daemon, which only writes, and only on CPU time nothing else wants
    (SCHED_IDLE on Linux, `offload.idle_priority`): at the daemon's own priority, a parser took a core from the hooks
    at every wake-up (on 2 CPUs, hooks during an import were 6-20 ms slower at the median, up to 150 ms at p99).
    The price is the import's speed on a machine busy with other work, which takes the CPU first (niceness alone
    could not arbitrate: a niced parser starved and a daemon run niced as a whole still waited). The children start
    with the first file and stop when no file came for `idle_s` (the `import_idle_s` setting), so an idle daemon
    holds none. A child that dies fails nothing: that file is parsed in a thread of the daemon instead, and the next
    file starts a fresh child."""

    def __init__(self, size: int, idle_s: float) -> None:
        self.children = [Offload(nice=0, idle=True, trim=True) for _ in range(max(1, size))]
        self.idle_s = idle_s
        self.busy = [0] * len(self.children)
        self.files = 0
        self.fallbacks = 0
        self._last = time.monotonic()
        self._closer: asyncio.TimerHandle | None = None
        self._closing: asyncio.Future[None] | None = None  # idle children being stopped

    async def parse(self, path: Path, max_chars: int) -> tuple[Format, list[Event]]:
        while self._closing is not None:
            # A call sent to a child told to stop would die with it (and the file be parsed in the daemon): the next
            # file waits for the stop, then starts fresh children.
            await asyncio.wait([self._closing])
        n = min(range(len(self.children)), key=self.busy.__getitem__)  # the least busy child
        child = self.children[n]
        self.busy[n] += 1
        self.files += 1
        try:
            await asyncio.to_thread(child.ensure_started)
            return await child.call("parse", read_session_file, path, None, None, max_chars)
        except ChildDied as exc:
            log.warning("an import parser died (%s); parsing %s in the daemon", exc, path)
            self.fallbacks += 1
            return await asyncio.to_thread(read_session_file, path, None, None, max_chars)
        finally:
            self.busy[n] -= 1
            self._last = time.monotonic()
            self._schedule_close()

    def _schedule_close(self) -> None:
        if self._closer is None:
            self._closer = asyncio.get_running_loop().call_later(self.idle_s, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._closer = None
        idle = time.monotonic() - self._last
        if any(self.busy) or idle < self.idle_s:
            self._closer = asyncio.get_running_loop().call_later(
                self.idle_s - idle if idle < self.idle_s else self.idle_s, self._close_if_idle)
            return
        self._closing = closing = asyncio.get_running_loop().run_in_executor(None, self.close)
        closing.add_done_callback(self._closed)

    def _closed(self, _closing: asyncio.Future[None]) -> None:
        self._closing = None

    async def shutdown(self) -> None:
        """The daemon stops: the children with it."""
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the children (blocking); the next file starts them again."""
        for child in self.children:
            child.close()

    def status(self) -> dict[str, Any]:
        return {"processes": [c.pid for c in self.children if c.pid], "starts": sum(c.starts for c in self.children),
                "files": self.files,
                "in_flight": sum(self.busy), "fallbacks": self.fallbacks}


class HistoryImporter:
    """The daemon's side of `loom import`: the scan, and each file's import (the CLI sends a few at a time; the
    parser pool reads them, the writer commits them in batches shared with live hooks)."""

    def __init__(self, store: Store, tailer: Tailer, idle_s: float, parsers: int = PARSERS) -> None:
        self.store = store
        self.tailer = tailer
        self.pool = ParserPool(parsers, idle_s)
        self.in_flight = 0  # files being imported now
        # Files read or being committed at once: one a parser, and the one the writer commits. More (the CLI keeps 4
        # in flight) would only hold more parsed events in the daemon's memory while they wait for the writer.
        self._slots = asyncio.Semaphore(len(self.pool.children) + 1)
        self._last_done = -ACTIVE_GRACE_S

    @property
    def active(self) -> bool:
        """Whether an import runs (a file in flight, or one finished a moment ago): the back-fill waits for it."""
        return self.in_flight > 0 or time.monotonic() - self._last_done < ACTIVE_GRACE_S

    async def close(self) -> None:
        await self.pool.shutdown()

    async def scan(self, sources: Sequence[str], *, claude_dir: str | None = None, codex_dir: str | None = None,
                   since: float | None = None, project: str | None = None) -> dict[str, Any]:
        done = await self._done()
        # Unnamed folders: the daemon's own (the CLI names the user's); Codex's as the tailer resolved it.
        codex_dir = codex_dir or str(self.tailer.codex_root.parent)
        files, others = await asyncio.to_thread(self._scan, list(sources), claude_dir, codex_dir, done)
        chosen = select(files, since=since, project=project)
        return {"summary": {**summarize(chosen), "not_transcripts": others}, "files": [asdict(f) for f in chosen]}

    def _scan(self, sources: list[str], claude_dir: str | None, codex_dir: str | None,
              done: dict[str, dict[str, Any]]) -> tuple[list[HistoryFile], int]:
        """In a thread: every transcript file named, and how many other files (hook logs, metadata) were passed."""
        out, others = [], 0
        for path in history_sources(sources, claude_dir, codex_dir):
            try:
                found = describe(path, done.get(str(path)))
            except (OSError, ValueError):
                found = None  # vanished or unreadable since the listing
            if found is None:
                others += 1
            else:
                out.append(found)
        # A subagent works in a folder of its own (a worktree, say); it counts in its session's project.
        mains = {(f.agent, f.session_id): f.project for f in out if not f.subagent}
        for f in out:
            if f.subagent:
                f.project = mains.get((f.agent, f.session_id), f.project)
        return out, others

    async def _done(self) -> dict[str, dict[str, Any]]:
        rows = await self.store.fetchall("SELECT name, value FROM checkpoints WHERE name LIKE 'import:%'")
        out: dict[str, dict[str, Any]] = {}
        for name, value in rows:
            try:
                data = json.loads(value)
            except ValueError:
                continue  # a damaged record only costs a re-read, which stores nothing new
            if isinstance(data, dict):
                out[name[len(CHECKPOINT):]] = data
        return out

    async def import_path(self, path: str, *, force: bool = False) -> dict[str, Any]:
        """Import one file, unless a finished import of it is on record (`force` re-reads it anyway)."""
        p = Path(path)
        if not p.is_absolute():
            raise BadRequest(f"{path!r}: a path to import must be absolute")
        try:
            st = await asyncio.to_thread(os.stat, p)
        except OSError as exc:
            raise BadRequest(f"cannot read {p}: {exc.strerror or exc}") from exc
        if not force:
            value = await self.store.scalar("SELECT value FROM checkpoints WHERE name = ?", (CHECKPOINT + str(p),))
            done = loads_object(value.encode()) if isinstance(value, str) else None
            if _same_file(done, st):
                return {"path": str(p), "skipped": True, "events": 0, "stored": 0, "sessions": []}
        started = time.monotonic()
        # Recorded as of the stat before reading: a file that grew meanwhile is read again next time.
        limit = self.tailer.config.max_tool_output_chars
        self.in_flight += 1
        try:
            async with self._slots:
                result = await self.tailer.import_file(p, also=_recorder(str(p), _fingerprint(st)),
                                                       parse=lambda path: self.pool.parse(path, limit))
        finally:
            self.in_flight -= 1
            self._last_done = time.monotonic()
        return {**result, "skipped": False, "seconds": round(time.monotonic() - started, 3)}


def _recorder(path: str, fingerprint: dict[str, int]) -> Processor:
    value = json.dumps(fingerprint)

    async def record(db: aiosqlite.Connection, _events: Sequence[Event]) -> None:
        await db.execute(
            "INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET"
            " value = excluded.value, updated = excluded.updated", (CHECKPOINT + path, value, time.time()))

    return record
