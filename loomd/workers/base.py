"""What every worker shares: the run request and report, checkpoints (watermarks), edges and the write path.

A worker writes its output and advances its watermark in one transaction (`WorkerContext.write`), so a crash or a
cancellation leaves either both or neither. A dry run goes through the very same code and rolls back at the end:
what it reports is exactly what it would have written.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiosqlite

from loomd.config import Config
from loomd.offload import Offload
from loomd.redact import redact_text
from loomd.store.db import Store
from loomd.store.entities import extract_entities
from loomd.store.memories import MemoryWriter, content_hash, estimate_tokens
from loomd.store.trip import commit_in_one_trip, in_one_trip
from loomd.store.turns import next_look
from loomd.team.sync import SyncEngine
from loomd.workers.steps import Observation

# Kinds the reflector writes and merges into (capture and `store` write them too: one pool, one truth).
REFLECTION_KINDS = ("constraint", "preference", "decision", "procedure", "insight", "fact", "reflection", "handoff")
MAX_OUTPUT_LISTED = 200
# While a scheduled run is held (live hooks stream, an import runs), its next transaction looks again this often: a
# slice of background time (`ingest.writer.LiveTraffic`, 50 ms) is not missed.
HOLD_POLL_S = 0.02
T = TypeVar("T")


class _Rollback(Exception):
    """Raised at the end of a dry run's transaction so that nothing it wrote is kept."""


class WatermarkMoved(Exception):
    """Another run committed past the watermark this run started from; its output is dropped, not doubled."""


@dataclass
class RunRequest:
    worker: str
    session_id: str | None = None
    project: str | None = None
    dry_run: bool = False
    final: bool | None = None
    trigger: str = "manual"
    keys: frozenset[str] = frozenset()  # sessions or projects an event trigger asked for


@dataclass
class RunReport:
    job_id: int | None = None
    items_in: int = 0
    items_out: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def wrote(self, action: str, **item: Any) -> None:
        self.items_out += 1
        if len(self.output) < MAX_OUTPUT_LISTED:
            self.output.append({"action": action, **item})

    def note(self, key: str, value: Any) -> None:
        self.detail.setdefault(key, [])
        if value not in self.detail[key] and len(self.detail[key]) < 50:
            self.detail[key].append(value)


@dataclass
class WorkerContext:
    store: Store
    config: Callable[[], Config]
    memories: MemoryWriter
    wake: Callable[[str, str], None] = lambda name, key: None
    offload: Offload | None = None  # where the text work runs (None: on the loop, as tests that need no child do)
    sync: SyncEngine | None = None  # shared memory (loomd/team/), when configured
    # True while the run must wait before its next transaction (a scheduled run's: the scheduler's `hold`). A run
    # begun in a pause of the hooks would otherwise write on, chunk after chunk, while they stream: every ack waited
    # behind its transactions and its CPU (ack p99 7 -> 53 ms with 8 clients after a 4,000-event session).
    hold: Callable[[], bool] = lambda: False
    # Seconds until the hold ends if no hook comes meanwhile, when known (the hooks' pause, a rest after a
    # background transaction: `LiveTraffic.resume_in`); None: an import holds it.
    resume_in: Callable[[], float | None] = lambda: None

    async def turn(self) -> None:
        """Wait until the run may take the writer (`hold`): looking again when the hold should end, or HOLD_POLL_S
        later, whichever comes first."""
        while self.hold():  # noqa: ASYNC110 - a predicate of time (hooks pausing, a slice coming): no event marks it
            await asyncio.sleep(next_look(self.resume_in(), HOLD_POLL_S))

    @asynccontextmanager
    async def write(self, dry_run: bool) -> AsyncIterator[aiosqlite.Connection]:
        """The output transaction, once the run may take the writer (`turn`); a dry run rolls it back once the body
        has done everything it would do."""
        await self.turn()
        try:
            async with self.store.atomic() as db:
                yield db
                if dry_run:
                    raise _Rollback
        except _Rollback:
            pass

    async def commit(self, dry_run: bool, body: Callable[[aiosqlite.Connection], Awaitable[T]], *,
                     yields: bool = False) -> T:
        """`body` (output and watermark, awaiting only the connection) as one output transaction in one trip to the
        writer's thread (`store.trip`): the writer is held for its statements alone. A dry run's is rolled back.
        `yields`: it gives way to a hook's commit and runs again after it (`Store.commit_on_thread`)."""
        await self.turn()
        if dry_run:
            async with self.write(dry_run) as db:
                return await in_one_trip(db, body)
        return await commit_in_one_trip(self.store, body, yields=yields)


async def requested_projects(ctx: WorkerContext, req: RunRequest) -> list[str] | None:
    """The projects a run was asked for (one project, or those a session's observations belong to); None: the
    worker picks the due ones itself."""
    if req.project:
        return [req.project]
    if req.session_id:
        rows = await ctx.store.fetchall("SELECT DISTINCT project FROM memories WHERE session_id = ?"
                                        " AND kind = 'observation'", (req.session_id,), background=True)
        return [r[0] for r in rows]
    return None


async def progress(db: aiosqlite.Connection, report: RunReport, items_in: int, items_out: int) -> None:
    """Count a chunk's items on the job row in the chunk's own transaction: a crash keeps honest counts."""
    if report.job_id is not None:
        await db.execute("UPDATE jobs SET items_in = items_in + ?, items_out = items_out + ? WHERE id = ?",
                         (items_in, items_out, report.job_id))


# --- checkpoints ------------------------------------------------------------------------------------------------

async def get_checkpoint(db: aiosqlite.Connection, name: str) -> str | None:
    async with db.execute("SELECT value FROM checkpoints WHERE name = ?", (name,)) as cur:
        row = await cur.fetchone()
    return None if row is None else str(row[0])


async def get_int_checkpoint(db: aiosqlite.Connection, name: str) -> int:
    value = await get_checkpoint(db, name)
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


async def set_checkpoint(db: aiosqlite.Connection, name: str, value: Any) -> None:
    text = value if isinstance(value, str) else json.dumps(value)
    await db.execute(
        "INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET"
        " value = excluded.value, updated = excluded.updated", (name, text, time.time()))


# --- edges ------------------------------------------------------------------------------------------------------

async def add_edge(db: aiosqlite.Connection, src: int, dst: int, kind: str, weight: float = 1.0) -> bool:
    """A memory -> memory edge; False when it was already there (a re-run adds nothing)."""
    cur = await db.execute(
        "INSERT OR IGNORE INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
        " VALUES ('memory', ?, 'memory', ?, ?, ?, ?)", (src, dst, kind, weight, time.time()))
    return cur.rowcount == 1


async def add_sources(db: aiosqlite.Connection, memory_id: int, event_ids: Iterable[int]) -> None:
    await db.executemany("INSERT OR IGNORE INTO memory_sources (memory_id, event_id) VALUES (?, ?)",
                         [(memory_id, e) for e in event_ids])


async def sources_of(db: aiosqlite.Connection, memory_ids: Sequence[int]) -> list[int]:
    if not memory_ids:
        return []
    marks = ",".join("?" * len(memory_ids))
    async with db.execute(f"SELECT DISTINCT event_id FROM memory_sources WHERE memory_id IN ({marks})",
                          list(memory_ids)) as cur:
        return [int(r[0]) for r in await cur.fetchall()]


# --- observations -----------------------------------------------------------------------------------------------

def entity_names(text: str, limit: int = 12) -> list[str]:
    return [name for name, _kind in extract_entities(text)[:limit]]


async def write_observation(
    db: aiosqlite.Connection, obs: Observation, *, project: str, session_id: str, agent: str | None, origin: str,
) -> tuple[int, bool]:
    """Insert one observation; the same text twice in one session is one row (hits, sources merge).

    Observations are per session on purpose: the same rule stated in three sessions is three observations,
    and the reflector turns them into one memory with three supports.
    """
    text = redact_text(obs.text.strip())
    digest = content_hash(text)
    async with db.execute(
        "SELECT id FROM memories WHERE session_id = ? AND kind = 'observation' AND content_hash = ?"
        " AND archived_at IS NULL LIMIT 1", (session_id, digest)) as cur:
        row = await cur.fetchone()
    now = time.time()
    if row is not None:
        memory_id = int(row[0])
        await db.execute("UPDATE memories SET hits = hits + 1, updated = ?, meta = json_set(meta, '$.runs',"
                         " coalesce(json_extract(meta, '$.runs'), 1) + ?) WHERE id = ?",
                         (now, int(obs.meta.get("runs", 1)), memory_id))
        await add_sources(db, memory_id, obs.sources)
        return memory_id, False
    meta = {"type": obs.type, "entities": entity_names(text), **obs.meta}
    cur = await db.execute(
        "INSERT INTO memories (kind, text, project, scope, session_id, agent, importance, tags, created, updated,"
        " content_hash, tokens, origin, meta) VALUES ('observation', ?, ?, 'session', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (text, project, session_id, agent, obs.importance, obs.type, obs.ts or now, now, digest,
         estimate_tokens(text), origin, json.dumps(meta, ensure_ascii=False)),
    )
    memory_id = int(cur.lastrowid or 0)
    await add_sources(db, memory_id, obs.sources)
    return memory_id, True


def meta_of(row: Any) -> dict[str, Any]:
    try:
        meta = json.loads(row["meta"] or "{}")
    except (TypeError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
