"""Corrections a person makes: edit a memory's text (the old text kept in an audit trail), merge memories, mark one
as superseding others, and approve what the review queue shows. Inside the caller's transaction; the caller runs
`MemoryWriter.derive` on what `edit` returns so entities, neighbour context and vectors follow the new text."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import aiosqlite

from loomd.errors import BadRequest, NotFound
from loomd.redact import redact_text
from loomd.store.memories import MAX_MEMORY_CHARS, check_kind, rewrite, set_archived, supersede

# The checkpoint holding when the review queue was last worked (an approve, an edit, a merge): "since the last
# review" is what was written after it.
REVIEW_CHECKPOINT = "review:last"
# What the queue shows: what the workers and capture rules wrote. Evidence passages are verbatim copies of the
# session, not claims (far too many to review one by one); a person's own `store` needs no review. The same terms
# as the partial index `memories_unreviewed` (migration m006), word for word, so the planner uses it.
UNREVIEWED = ("archived_at IS NULL AND superseded_by IS NULL AND kind != 'evidence' AND origin != 'store'"
              " AND json_extract(meta, '$.reviewed_at') IS NULL")


async def _row(db: aiosqlite.Connection, memory_id: int) -> aiosqlite.Row:
    async with db.execute("SELECT * FROM memories WHERE id = ?", (memory_id,)) as cur:
        row = await cur.fetchone()
    if row is None:
        raise NotFound(f"no memory with id {memory_id}")
    return row


async def _reviewed(db: aiosqlite.Connection, ids: Sequence[int], now: float) -> None:
    marks = ",".join("?" * len(ids))
    await db.execute(f"UPDATE memories SET meta = json_set(meta, '$.reviewed_at', ?) WHERE id IN ({marks})",
                     (now, *ids))
    await db.execute("INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, ?) ON CONFLICT(name)"
                     " DO UPDATE SET value = excluded.value, updated = excluded.updated",
                     (REVIEW_CHECKPOINT, json.dumps(now), now))


async def edit(db: aiosqlite.Connection, memory_id: int, text: str | None = None, kind: str | None = None,
               reason: str = "edit") -> bool:
    """Replace a memory's text and/or kind; the previous ones go to `meta.edits` (when, what, why). Its entity
    mentions are dropped so the caller's `derive` links those of the new text. Returns whether anything changed."""
    row = await _row(db, memory_id)
    new_text = row["text"] if text is None else redact_text(text.strip())[:MAX_MEMORY_CHARS]
    if not new_text:
        raise BadRequest("memory text is empty")
    new_kind = row["kind"] if kind is None else check_kind(kind)
    now = time.time()
    if new_text == row["text"] and new_kind == row["kind"]:
        await _reviewed(db, [memory_id], now)
        return False
    meta = json.loads(row["meta"] or "{}")
    meta.setdefault("edits", []).append({"at": now, "text": row["text"], "kind": row["kind"], "reason": reason})
    meta["reviewed_at"] = now
    await rewrite(db, memory_id, new_text, new_kind, meta)
    await _reviewed(db, [memory_id], now)
    return True


async def merge(db: aiosqlite.Connection, keep: int, others: Sequence[int], text: str | None = None) -> dict[str, Any]:
    """Fold `others` into `keep`: their source events and hits join it, each is superseded by it (the chain stays
    visible) and archived; `text` replaces the kept memory's text (an edit, kept in its audit trail)."""
    others = [o for o in dict.fromkeys(others) if o != keep]
    if not others:
        raise BadRequest("merge needs another memory than the one kept")
    await _row(db, keep)
    for other in others:
        await _row(db, other)
    edited = await edit(db, keep, text, reason="merge") if text is not None else False
    marks = ",".join("?" * len(others))
    await db.execute(f"INSERT OR IGNORE INTO memory_sources (memory_id, event_id) SELECT ?, event_id"
                     f" FROM memory_sources WHERE memory_id IN ({marks})", (keep, *others))
    await db.execute(
        f"UPDATE memories SET hits = hits + (SELECT coalesce(sum(hits), 0) FROM memories WHERE id IN ({marks})),"
        f" importance = max(importance, (SELECT max(importance) FROM memories WHERE id IN ({marks})))"
        " WHERE id = ?", (*others, *others, keep))
    row = await _row(db, keep)
    meta = json.loads(row["meta"] or "{}")
    meta["merged_from"] = sorted({*meta.get("merged_from", []), *others})
    await db.execute("UPDATE memories SET meta = ? WHERE id = ?", (json.dumps(meta), keep))
    superseded = await supersede(db, keep, others)
    archived = await set_archived(db, others, True, f"merged into #{keep}")
    await _reviewed(db, [keep], time.time())
    return {"id": keep, "merged": others, "superseded": superseded, "archived": archived, "edited": edited}


async def mark_superseding(db: aiosqlite.Connection, new_id: int, old_ids: Sequence[int]) -> list[int]:
    """`new_id` replaces `old_ids` (they stay, out of date, in its chain); the ones it changed."""
    if new_id in old_ids:
        raise BadRequest("a memory cannot supersede itself")
    for memory_id in (new_id, *old_ids):
        await _row(db, memory_id)
    changed = await supersede(db, new_id, old_ids)
    await _reviewed(db, [new_id], time.time())
    return changed


async def approve(db: aiosqlite.Connection, ids: Sequence[int]) -> int:
    """Mark memories reviewed: they leave the queue as they are."""
    marks = ",".join("?" * len(ids))
    async with db.execute(f"SELECT count(*) FROM memories WHERE id IN ({marks})", ids) as cur:
        found = await cur.fetchone()
    if found is None or found[0] != len(set(ids)):
        raise NotFound(f"some of the ids {list(ids)} do not exist")
    await _reviewed(db, ids, time.time())
    return len(set(ids))
