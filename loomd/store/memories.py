"""The memories table: insert (deduplicated by content hash), fetch, archive and restore. Never deletes.

Every memory write goes the same way (`MemoryWriter`): insert inside a transaction, write what is derived from the
text in that same transaction (entities, edges, neighbour context; its vectors marked stale), and once it has
committed, wake whoever waits for new memories (the vector back-fill).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiosqlite

from loomd.errors import BadRequest, NotFound
from loomd.redact import redact_text
from loomd.store.db import Store
from loomd.store.derived import Mentions, write_derived
from loomd.store.migrations import MEMORY_KINDS

SCOPES = ("user", "project", "session")
KIND_LETTERS = {
    "decision": "D", "error": "E", "procedure": "P", "fact": "F", "constraint": "C", "preference": "C",
    "insight": "I", "handoff": "H", "task": "T", "observation": "O", "reflection": "R", "digest": "G",
    "evidence": "V",
}
MAX_MEMORY_CHARS = 4000
# The live memory of a project with the same text and kind. `+kind`, `+archived_at`: without them SQLite takes
# `memories_project` (three equalities against two) and walks every live memory of the project and kind, a cost
# that grew with the store on every insert; this way it reads one entry of `memories_hash`.
_SAME_TEXT = ("SELECT id FROM memories WHERE project = ? AND content_hash = ? AND +kind = ? AND +archived_at IS NULL"
              " LIMIT 1")


def content_hash(text: str) -> str:
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8", "surrogatepass")).hexdigest()


def estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def check_kind(kind: str) -> str:
    if kind not in MEMORY_KINDS:
        raise BadRequest(f"unknown memory kind '{kind}'; one of: {', '.join(MEMORY_KINDS)}")
    return kind


async def insert_memory(
    db: aiosqlite.Connection,
    *,
    kind: str,
    text: str,
    project: str,
    scope: str = "project",
    session_id: str | None = None,
    agent: str | None = None,
    importance: float = 0.5,
    tags: Iterable[str] = (),
    created: float | None = None,
    expires: float | None = None,
    origin: str = "store",
    meta: dict[str, Any] | None = None,
    sources: Iterable[int] = (),
    context: str = "",
    redacted: bool = False,
) -> tuple[int, bool]:
    """Insert inside the caller's transaction; the same text in the same project bumps the existing row. `context`
    fills the down-weighted `ctx` column at once (evidence: its neighbours in the step); else `derive` fills it.
    `redacted`: the caller ran `redact_text` on text and context already (the observer, in the offload process)."""
    check_kind(kind)
    if scope not in SCOPES:
        raise BadRequest(f"unknown scope '{scope}'; one of: {', '.join(SCOPES)}")
    text = (text.strip() if redacted else redact_text(text.strip()))[:MAX_MEMORY_CHARS]
    if not text:
        raise BadRequest("memory text is empty")
    now = time.time()
    digest = content_hash(text)
    # One statement (one trip to the connection's thread) for a new memory: insert unless the same text is
    # there; a duplicate then bumps the row it found.
    inserted = list(await db.execute_fetchall(
        "INSERT INTO memories (kind, text, project, scope, session_id, agent, importance, tags, created, updated,"
        " expires, content_hash, tokens, origin, meta, ctx) SELECT ?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?"
        f" WHERE NOT EXISTS ({_SAME_TEXT}) RETURNING id",
        (kind, text, project, scope, session_id, agent, float(importance), " ".join(sorted(set(tags))),
         created or now, now, expires, digest, estimate_tokens(text), origin, json.dumps(meta or {}),
         context if redacted else redact_text(context), project, digest, kind)))
    if inserted:
        memory_id, is_new = int(inserted[0][0]), True
    else:
        bumped = list(await db.execute_fetchall(
            "UPDATE memories SET hits = hits + 1, updated = ?, importance = max(importance, ?)"
            f" WHERE id = ({_SAME_TEXT}) RETURNING id", (now, importance, project, digest, kind)))
        memory_id, is_new = int(bumped[0][0]), False
    links = [(memory_id, event_id) for event_id in sources]
    if links:  # each statement is a trip to the connection's thread
        await db.executemany("INSERT OR IGNORE INTO memory_sources (memory_id, event_id) VALUES (?, ?)", links)
    return memory_id, is_new


def memory_dict(row: Any) -> dict[str, Any]:
    """The reply shape of one memory."""
    return {
        "id": row["id"], "kind": row["kind"], "text": row["text"], "project": row["project"], "scope": row["scope"],
        "session_id": row["session_id"], "agent": row["agent"], "importance": row["importance"],
        "tags": row["tags"].split() if row["tags"] else [], "created": row["created"], "updated": row["updated"],
        "expires": row["expires"], "archived_at": row["archived_at"], "hits": row["hits"],
        "superseded_by": row["superseded_by"], "tokens": row["tokens"], "origin": row["origin"],
        # Pulled from the team's shared server (loomd/team/): where it came from. Absent for this machine's own.
        **({"from": {"gid": row["gid"], "device": row["device"], "person": row["person"]}} if row["device"] else {}),
    }


async def fetch_memories(store: Store, ids: Sequence[int]) -> list[dict[str, Any]]:
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    rows = await store.fetchall(f"SELECT * FROM memories WHERE id IN ({marks})", ids)
    by_id = {row["id"]: memory_dict(row) for row in rows}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise NotFound(f"no memory with id {', '.join(map(str, missing))}")
    return [by_id[i] for i in ids]


async def rewrite(db: aiosqlite.Connection, memory_id: int, text: str, kind: str, meta: dict[str, Any]) -> None:
    """Replace a memory's text (redacted already) and kind in place, with its `meta`, inside the caller's
    transaction. What the old text named is no longer what the memory says: its entity mentions go (`mentions`
    counts stay true), and the caller's `write_derived` (or `MemoryWriter.derive`) links those of the new text."""
    await db.execute(
        "UPDATE memories SET text = ?, kind = ?, content_hash = ?, tokens = ?, updated = ?, meta = ? WHERE id = ?",
        (text, kind, content_hash(text), estimate_tokens(text), time.time(), json.dumps(meta), memory_id))
    stale = [r[0] for r in await db.execute_fetchall(
        "SELECT dst_id FROM edges WHERE src_type = 'memory' AND src_id = ? AND dst_type = 'entity'"
        " AND type = 'mentions'", (memory_id,))]
    await db.executemany("UPDATE entities SET mentions = max(0, mentions - 1) WHERE id = ?", [(e,) for e in stale])
    await db.execute("DELETE FROM edges WHERE src_type = 'memory' AND src_id = ? AND dst_type = 'entity'"
                     " AND type = 'mentions'", (memory_id,))


async def set_archived(db: aiosqlite.Connection, ids: Sequence[int], archived: bool, reason: str = "") -> int:
    """Archive (or restore) by flag only; the rows stay fetchable forever."""
    if not ids:
        return 0
    marks = ",".join("?" * len(ids))
    async with db.execute(f"SELECT count(*) FROM memories WHERE id IN ({marks})", ids) as cur:
        row = await cur.fetchone()
    if row is None or row[0] != len(set(ids)):
        raise NotFound(f"some of the ids {list(ids)} do not exist")
    if archived:
        cur = await db.execute(
            f"UPDATE memories SET archived_at = ?, meta = json_set(meta, '$.archive_reason', ?)"
            f" WHERE id IN ({marks}) AND archived_at IS NULL",
            (time.time(), reason or "forget", *ids),
        )
    else:
        cur = await db.execute(
            f"UPDATE memories SET archived_at = NULL WHERE id IN ({marks}) AND archived_at IS NOT NULL", ids
        )
    return cur.rowcount


async def supersede(db: aiosqlite.Connection, new_id: int, old_ids: Iterable[int]) -> list[int]:
    """`new_id` makes `old_ids` out of date: each still current one gets `superseded_by` and a `supersedes` edge
    (kept, so the chain stays visible); returns those it changed."""
    changed: list[int] = []
    for old in old_ids:
        cur = await db.execute(
            "UPDATE memories SET superseded_by = ? WHERE id = ? AND id != ? AND superseded_by IS NULL",
            (new_id, old, new_id))
        if cur.rowcount:
            changed.append(old)
    await supersedes_edges(db, [(new_id, old) for old in changed])
    return changed


async def supersedes_edges(db: aiosqlite.Connection, pairs: Sequence[tuple[int, int]]) -> None:
    """The `supersedes` edge of each (new, old) pair whose `superseded_by` was just set: a local supersession's
    (`supersede`) and a pulled one's (`team/local.py`) alike."""
    now = time.time()
    await db.executemany(
        "INSERT OR IGNORE INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
        " VALUES ('memory', ?, 'memory', ?, 'supersedes', 1.0, ?)", [(new, old, now) for new, old in pairs])


class MemoryWriter:
    """The one memory-write path's side effects. Listeners are registered by whoever owns them (the daemon wires
    the vector service): `stale` gets the ids whose vectors must be (re)computed, `committed` is called after a
    transaction that wrote memories has committed, `deleted` gets the ids a committed transaction deleted (a
    retention: GC's `store.purge.remove`)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.stale: list[Callable[[Sequence[int]], None]] = []
        self.committed: list[Callable[[], None]] = []
        self.deleted: list[Callable[[Sequence[int]], None]] = []

    async def derive(self, db: aiosqlite.Connection, ids: Sequence[int], mentions: Mentions | None = None) -> None:
        """Derived data (entities, edges, neighbour context) in the same transaction as the memories; `mentions`:
        the entities of texts already worked out (`derived.link_entities`)."""
        await write_derived(db, ids, mentions)
        self.mark_stale(ids)

    def mark_stale(self, ids: Sequence[int]) -> None:
        """Their vectors must be (re)computed: for a caller that wrote the derived data itself (`write_derived`,
        run on the writer's thread by `store.trip`, which must not call the loop's listeners)."""
        for listener in self.stale:
            listener(ids)

    def changed(self) -> None:
        """Memories were committed (written, archived or restored)."""
        for listener in self.committed:
            listener()

    def gone(self, ids: Sequence[int]) -> None:
        """These memories were deleted, and that has committed: whoever keeps a copy of them drops it."""
        for listener in self.deleted:
            listener(ids)

    @asynccontextmanager
    async def atomic(self) -> AsyncIterator[aiosqlite.Connection]:
        """A write transaction over memories; `changed()` once it has committed."""
        async with self.store.atomic() as db:
            yield db
        self.changed()
