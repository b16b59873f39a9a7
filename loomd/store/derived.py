"""Data derived from a memory's text, written in the same transaction as the memory itself.

- `ctx`: the text of up to CONTEXT_WINDOW memories before and after it in its session (time order), indexed as
  a down-weighted FTS5 column, so a turn that answers "yes, last week!" is found by the question before it.
- the entity graph: zero-LLM entities (entities.py), a `mentions` edge memory -> entity, and `co_occurs` edges
  between the entities one memory names together (weight = how many memories did).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import aiosqlite

from loomd.store.entities import extract_entities

# Session neighbours on each side whose text fills a memory's `ctx` column.
CONTEXT_WINDOW = 2
# A long memory (a stack trace, a diff) can name hundreds of identifiers: the first ones carry the point.
MAX_ENTITIES = 32
MAX_CO_OCCURRING = 8
# The neighbour column is a hint, not a copy of the session: each neighbour contributes at most this much.
MAX_NEIGHBOUR_CHARS = 600


async def session_window(
    db: aiosqlite.Connection, session_id: str, created: float, memory_id: int, before: int, after: int,
) -> tuple[list[Any], list[Any]]:
    """Up to `before` distilled memories preceding and `after` following one memory in its session, nearest first
    (evidence passages are not neighbours of distilled memories: they would only repeat the session's text)."""
    async with db.execute(
        "SELECT id, text FROM memories WHERE session_id = ? AND (created, id) < (?, ?) AND kind != 'evidence'"
        " ORDER BY created DESC, id DESC LIMIT ?", (session_id, created, memory_id, before),
    ) as cur:
        earlier = list(await cur.fetchall())
    async with db.execute(
        "SELECT id, text FROM memories WHERE session_id = ? AND (created, id) > (?, ?) AND kind != 'evidence'"
        " ORDER BY created, id LIMIT ?", (session_id, created, memory_id, after),
    ) as cur:
        later = list(await cur.fetchall())
    return earlier, later


def _context(texts: Sequence[str]) -> str:
    return " ".join(t[:MAX_NEIGHBOUR_CHARS] for t in texts if t)


async def update_context(db: aiosqlite.Connection, memory_id: int) -> int:
    """Refresh `ctx` of a memory and of its session neighbours whose window now includes it; rows changed."""
    async with db.execute("SELECT session_id, created, kind FROM memories WHERE id = ?", (memory_id,)) as cur:
        row = await cur.fetchone()
    if row is None or row[0] is None or row[2] == "evidence":
        return 0  # an evidence passage's ctx is its neighbouring passages, written with it (workers/evidence.py)
    w = CONTEXT_WINDOW
    earlier, later = await session_window(db, row[0], row[1], memory_id, 2 * w, 2 * w)
    async with db.execute("SELECT id, text FROM memories WHERE id = ?", (memory_id,)) as cur:
        me = await cur.fetchone()
    # Time order, this memory at `centre`; with 2w fetched on each side every changed row sees its whole window.
    ordered = [*reversed(earlier), me, *later]
    centre = len(earlier)
    changed = 0
    for i in range(max(0, centre - w), min(len(ordered), centre + w + 1)):
        around = [r[1] for r in ordered[max(0, i - w) : i]] + [r[1] for r in ordered[i + 1 : i + 1 + w]]
        cur = await db.execute("UPDATE memories SET ctx = ? WHERE id = ? AND ctx != ?",
                               (_context(around), ordered[i][0], _context(around)))
        changed += cur.rowcount
    return changed


async def link_entities(db: aiosqlite.Connection, memory_id: int, project: str, text: str,
                        co_occurrence: bool = True) -> int:
    """Entities of the text, `mentions` edges to them, `co_occurs` edges between them; new mentions. A handful of
    statements whatever the number of entities (each is a trip to the connection's thread)."""
    found = list(dict.fromkeys(extract_entities(text)[:MAX_ENTITIES]))
    if not found:
        return 0
    now = time.time()
    await db.executemany("INSERT OR IGNORE INTO entities (project, name, kind) VALUES (?, ?, ?)",
                         [(project, name, kind) for name, kind in found])
    names = json.dumps([name for name, _ in found])
    ids = {r[1]: r[0] for r in await db.execute_fetchall(
        "SELECT id, name FROM entities WHERE project = ? AND name IN (SELECT value FROM json_each(?))",
        (project, names))}
    entity_ids = list(dict.fromkeys(ids[name] for name, _ in found if name in ids))
    marks = ",".join("?" * len(entity_ids))
    known = {r[0] for r in await db.execute_fetchall(
        f"SELECT dst_id FROM edges WHERE src_type = 'memory' AND src_id = ? AND dst_type = 'entity'"
        f" AND type = 'mentions' AND dst_id IN ({marks})", (memory_id, *entity_ids))}
    fresh = [e for e in entity_ids if e not in known]
    if not fresh:
        return 0  # a memory seen again (same text) adds no mention and no co-occurrence
    await db.executemany(
        "INSERT OR IGNORE INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
        " VALUES ('memory', ?, 'entity', ?, 'mentions', 1.0, ?)", [(memory_id, e, now) for e in fresh])
    await db.execute(f"UPDATE entities SET mentions = mentions + 1 WHERE id IN ({','.join('?' * len(fresh))})",
                     fresh)
    if co_occurrence:
        head = sorted(entity_ids[:MAX_CO_OCCURRING])
        await db.executemany(
            "INSERT INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
            " VALUES ('entity', ?, 'entity', ?, 'co_occurs', 1.0, ?)"
            " ON CONFLICT (src_type, src_id, dst_type, dst_id, type) DO UPDATE SET weight = weight + 1",
            [(a, b, now) for i, a in enumerate(head) for b in head[i + 1 :]],
        )
    return len(fresh)


async def write_derived(db: aiosqlite.Connection, ids: Sequence[int]) -> None:
    """Everything derived from these memories' text, inside the caller's transaction."""
    for memory_id in dict.fromkeys(ids):
        async with db.execute("SELECT project, text, kind FROM memories WHERE id = ?", (memory_id,)) as cur:
            row = await cur.fetchone()
        if row is None:
            continue
        # An evidence passage links what it mentions (the graph signal finds it), but what a raw log names
        # together says little: only distilled memories add co-occurrence.
        await link_entities(db, memory_id, row[0], row[1], co_occurrence=row[2] != "evidence")
        await update_context(db, memory_id)
