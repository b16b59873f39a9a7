"""Purge: remove text from the database file for good, unlike `forget`, which only archives.

What is chosen goes from every place it lives: the memories (and their vectors, neighbour pairs, edges, sources
and FTS entries), the raw events, the sessions' frozen blocks, the entities only it named, the workers' job notes.
A text match (`match`) also finds the copies inside other rows — a neighbour's `ctx` column, an event's JSON
payload, a job's detail — and the memories built from purged events go with them. Then the file itself is cleaned:
`secure_delete` zeroes the freed pages, the FTS index is rebuilt (its old segments hold the terms), the WAL is
checkpointed and truncated, and VACUUM rewrites the file, so the text is in neither `loomd.db` nor `-wal`/`-shm`.

The vector back-fill's in-memory index may still hold a purged memory's (quantised) vector until the daemon
restarts; search never returns it, since every hit is read back from the table.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

from loomd.errors import BadRequest
from loomd.store.db import Store
from loomd.store.derived import update_context, written

SAMPLE = 5  # memories and events named in the plan a person confirms


@dataclass
class Selection:
    """What a purge removes: memory and event ids, whole sessions, and the texts whose copies go too."""

    memories: set[int] = field(default_factory=set)
    events: set[int] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    needles: list[str] = field(default_factory=list)


def _needles(match: str | None) -> list[str]:
    """The text as written and as it reads inside a JSON payload (quotes, backslashes and newlines escaped)."""
    if match is None:
        return []
    if len(match.strip()) < 4:
        raise BadRequest("'match' must be at least 4 characters: a shorter text would match nearly everything")
    # Lower-cased, as every column is read (SQLite's lower() folds ASCII letters: the FTS index and the entity names
    # keep words lower-cased).
    return list(dict.fromkeys(n.lower() for n in (match, json.dumps(match, ensure_ascii=False)[1:-1])))


def _ids(values: Collection[int]) -> str:
    return json.dumps(sorted(values))


async def _column(db: aiosqlite.Connection, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    async with db.execute(sql, params) as cur:
        return [row[0] for row in await cur.fetchall()]


async def select(db: aiosqlite.Connection, *, ids: Sequence[int] = (), session_id: str | None = None,
                 project: str | None = None, match: str | None = None) -> Selection:
    """What `purge` would remove for these criteria (any combination; at least one)."""
    if not (ids or session_id or project or match):
        raise BadRequest("purge needs memory ids, a session_id, a project or a match")
    chosen = Selection(needles=_needles(match))
    if ids:
        found = set(await _column(db, "SELECT id FROM memories WHERE id IN (SELECT value FROM json_each(?))",
                                  [_ids(ids)]))
        missing = sorted(set(ids) - found)
        if missing:
            raise BadRequest(f"no memory with id {', '.join(map(str, missing))}")
        chosen.memories |= found
    for column, value in (("session_id", session_id), ("project", project)):
        if value:
            chosen.memories |= set(await _column(db, f"SELECT id FROM memories WHERE {column} = ?", [value]))
            chosen.events |= set(await _column(db, f"SELECT id FROM events WHERE {column} = ?", [value]))
            chosen.sessions |= set(await _column(
                db, f"SELECT id FROM sessions WHERE {'id' if column == 'session_id' else 'project'} = ?", [value]))
    for needle in chosen.needles:
        chosen.memories |= set(await _column(
            db, "SELECT id FROM memories WHERE instr(lower(text), ?) OR instr(lower(tags), ?)"
                " OR instr(lower(meta), ?)",
            [needle] * 3))
        chosen.events |= set(await _column(db, "SELECT id FROM events WHERE instr(lower(payload), ?)", [needle]))
    if chosen.events:
        # What was made from purged events alone goes too: an observation or a passage repeats their text.
        chosen.memories |= set(await _column(
            db, "SELECT s.memory_id FROM memory_sources s WHERE s.event_id IN (SELECT value FROM json_each(?))"
            " AND NOT EXISTS (SELECT 1 FROM memory_sources o WHERE o.memory_id = s.memory_id"
            " AND o.event_id NOT IN (SELECT value FROM json_each(?)))", [_ids(chosen.events)] * 2))
    return chosen


async def describe(db: aiosqlite.Connection, chosen: Selection) -> dict[str, Any]:
    """The plan a person confirms: how much goes, and a few of the memories and events."""
    memories = await (await db.execute(
        "SELECT id, kind, project, substr(text, 1, 120) FROM memories WHERE id IN (SELECT value FROM json_each(?))"
        " ORDER BY id LIMIT ?", [_ids(chosen.memories), SAMPLE])).fetchall()
    events = await (await db.execute(
        "SELECT id, kind, session_id, substr(payload, 1, 120) FROM events WHERE id IN (SELECT value FROM json_each(?))"
        " ORDER BY id LIMIT ?", [_ids(chosen.events), SAMPLE])).fetchall()
    return {
        "memories": len(chosen.memories), "events": len(chosen.events), "sessions": sorted(chosen.sessions),
        "match": bool(chosen.needles),
        "sample": {"memories": [{"id": r[0], "kind": r[1], "project": r[2], "text": r[3]} for r in memories],
                   "events": [{"id": r[0], "kind": r[1], "session_id": r[2], "payload": r[3]} for r in events]},
    }


async def remove(db: aiosqlite.Connection, chosen: Selection, *, rebuild_fts: bool = True) -> dict[str, int]:
    """Delete the selection and every copy a match finds, inside the caller's transaction; rows changed by table.

    `rebuild_fts`: the full-text index is rebuilt, so its old segments no longer hold the removed terms (a purge);
    GC's retention, which deletes for room and not for secrecy, leaves that to SQLite's own merges."""
    mem, ev = _ids(chosen.memories), _ids(chosen.events)
    changed: dict[str, int] = {}

    async def run(name: str, sql: str, params: Sequence[Any] = ()) -> None:
        cur = await db.execute(sql, params)
        changed[name] = changed.get(name, 0) + max(cur.rowcount, 0)

    in_mem = "IN (SELECT value FROM json_each(?))"
    # Session neighbours whose `ctx` column quotes a purged memory: refreshed once it is gone.
    neighbours = await _column(
        db, f"SELECT DISTINCT n.id FROM memories m JOIN memories n ON n.session_id = m.session_id WHERE m.id {in_mem}"
        f" AND n.id NOT {in_mem}", [mem, mem])
    await run("memory_sources", f"DELETE FROM memory_sources WHERE memory_id {in_mem} OR event_id {in_mem}", [mem, ev])
    await run("memory_vectors", f"DELETE FROM memory_vectors WHERE memory_id {in_mem}", [mem])
    await run("memory_near", f"DELETE FROM memory_near WHERE a {in_mem} OR b {in_mem}", [mem, mem])
    await run("edges", f"DELETE FROM edges WHERE (src_type = 'memory' AND src_id {in_mem})"
                       f" OR (dst_type = 'memory' AND dst_id {in_mem})", [mem, mem])
    await run("superseded", f"UPDATE memories SET superseded_by = NULL WHERE superseded_by {in_mem}", [mem])
    await run("shared_outbox", f"DELETE FROM shared_outbox WHERE memory_id {in_mem}", [mem])
    await run("memories", f"DELETE FROM memories WHERE id {in_mem}", [mem])  # the FTS trigger drops its entries
    await run("events", f"DELETE FROM events WHERE id {in_mem}", [ev])
    sessions = json.dumps(sorted(chosen.sessions))
    await run("sessions", f"DELETE FROM sessions WHERE id {in_mem}", [sessions])
    await run("injections", f"DELETE FROM injections WHERE session_id {in_mem}", [sessions])
    await run("checkpoints", "DELETE FROM checkpoints WHERE name IN (SELECT 'observer:' || value FROM json_each(?))",
              [sessions])
    # Blocks frozen for other sessions that showed a purged memory: a resumed session gets a new one.
    await run("sessions", "UPDATE sessions SET start_block = NULL, compact_block = NULL WHERE EXISTS"
                          f" (SELECT 1 FROM json_each(sessions.injected) WHERE value {in_mem})", [mem])
    # Blocks injected that showed one (each line of a block closes with " #id").
    await run("injections", "DELETE FROM injections WHERE EXISTS (SELECT 1 FROM json_each(?)"
                            " WHERE instr(injections.text, ' #' || value || char(10)))", [mem])
    if neighbours:
        changed["ctx"] = changed.get("ctx", 0) + await update_context(db, await written(db, neighbours))
    for needle in chosen.needles:
        # Copies the selection did not hold: an evidence passage's neighbour text, blocks frozen for a session,
        # the names of entities, the workers' notes.
        await run("ctx", "UPDATE memories SET ctx = '' WHERE instr(lower(ctx), ?)", [needle])
        for block in ("start_block", "compact_block"):
            await run("sessions", f"UPDATE sessions SET {block} = NULL WHERE instr(lower({block}), ?)", [needle])
        await run("injections", "DELETE FROM injections WHERE instr(lower(text), ?)", [needle])
        named = "(SELECT id FROM entities WHERE instr(lower(name), ?))"
        await run("edges", f"DELETE FROM edges WHERE (src_type = 'entity' AND src_id IN {named})"
                           f" OR (dst_type = 'entity' AND dst_id IN {named})", [needle, needle])
        await run("jobs", "UPDATE jobs SET detail = '{}' WHERE instr(lower(detail), ?)", [needle])
        await run("jobs", "UPDATE jobs SET error = '(purged)' WHERE instr(lower(error), ?)", [needle])
        await run("checkpoints", "DELETE FROM checkpoints WHERE instr(lower(value), ?)", [needle])
    # Entities no memory mentions any more (their names came from the purged text), with their co-occurrences.
    orphans = json.dumps(await _column(
        db, "SELECT id FROM entities WHERE NOT EXISTS (SELECT 1 FROM edges WHERE dst_type = 'entity'"
            " AND dst_id = entities.id AND type = 'mentions')"))
    await run("edges", f"DELETE FROM edges WHERE (src_type = 'entity' AND src_id {in_mem})"
                       f" OR (dst_type = 'entity' AND dst_id {in_mem})", [orphans, orphans])
    await run("entities", "DELETE FROM entities WHERE NOT EXISTS (SELECT 1 FROM edges WHERE dst_type = 'entity'"
                          " AND dst_id = entities.id) AND NOT EXISTS (SELECT 1 FROM edges WHERE src_type = 'entity'"
                          " AND src_id = entities.id)")
    if rebuild_fts:
        await run("memories_fts", "INSERT INTO memories_fts(memories_fts) VALUES ('rebuild')")
    return {name: n for name, n in changed.items() if n}


async def purge(store: Store, gone: Callable[[Sequence[int]], None] = lambda ids: None,
                **criteria: Any) -> dict[str, Any]:
    """Select (as `select`) and remove, then clean the file: zeroed pages, a rebuilt FTS index, the WAL folded in,
    VACUUM. What went (`describe`) and the rows changed per table. `gone` hears the memory ids once removed (the
    daemon's copies of them, the vector index's, go too)."""
    async with store.exclusive() as db:
        await db.execute("PRAGMA secure_delete = ON")
        try:
            await db.execute("BEGIN IMMEDIATE")
            try:
                chosen = await select(db, **criteria)
                plan = await describe(db, chosen)
                changed = await remove(db, chosen)
                await db.execute("COMMIT")
            except BaseException:
                await db.execute("ROLLBACK")
                raise
            gone(sorted(chosen.memories))
            await _checkpoint(db)
            await db.execute("VACUUM")
            truncated = await _checkpoint(db)
        finally:
            await db.execute("PRAGMA secure_delete = OFF")
    return {"plan": plan, "removed": changed, "wal_truncated": truncated}


async def _checkpoint(db: aiosqlite.Connection, tries: int = 50) -> bool:
    """Fold the WAL into the file and truncate it; a reader in the middle of a query (the back-fill's) holds it
    back for a moment, so it is retried for up to about 5 s. Whether it got done."""
    for _ in range(tries):
        row = await (await db.execute("PRAGMA wal_checkpoint(TRUNCATE)")).fetchone()
        if row is not None and not row[0]:
            return True
        await asyncio.sleep(0.1)
    return False
