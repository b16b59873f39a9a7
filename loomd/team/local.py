"""The local side of sync: what to push (the outbox), marking it pushed, and applying pulled versions to SQLite.

Every function runs inside the caller's short transaction. The outbox is filled by triggers (store migration
m007): a local change queues its memory; applying a pulled version moves `shared_changed`/`shared_by`, which the
triggers read as "not a local change", so a pull never echoes back as a push.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import aiosqlite
import numpy as np
from pgvector import Vector

from loomd.redact import redact_text
from loomd.store.db import on_thread
from loomd.store.memories import MemoryWriter, content_hash, estimate_tokens, insert_memory, supersedes_edges
from loomd.store.migrations import SHARED_KINDS
from loomd.team.rows import Shared, uuid7

_KINDS = ",".join(f"'{k}'" for k in SHARED_KINDS)
# A memory the outbox may send: durable kind, project or user scope, and (checked in Python) not private.
SHAREABLE = f"m.kind IN ({_KINDS}) AND m.scope != 'session'"
# What the outbox sends: a shareable memory's change, or the archive or restore of an evidence passage the server
# already holds (store migration m011 queues only those; a passage's first push is `evidence_outgoing`'s).
QUEUED = f"({SHAREABLE} OR m.kind = 'evidence')"


@dataclass(frozen=True)
class Identity:
    """Who pushes: the team the rows belong to, this device, and the person (their role unless named)."""

    team: str
    device: str
    person: str


@dataclass
class Outgoing:
    memory_id: int
    changed: float
    row: Shared


def _private_clause(private: Collection[str]) -> tuple[str, list[str]]:
    if not private:
        return "", []
    return f" AND m.project NOT IN ({','.join('?' * len(private))})", sorted(private)


def assign_gids(conn: sqlite3.Connection, private: Collection[str], limit: int) -> int:
    """Give a global id to queued memories that have none, committed before any push: a push cut short and
    replayed sends the same ids, so the server never sees one memory twice. On the writer's thread (`on_thread`),
    inside the caller's transaction."""
    clause, params = _private_clause(private)
    return _give_gids(conn, f"SELECT m.id, m.created FROM shared_outbox o JOIN memories m ON m.id = o.memory_id"
                            f" WHERE m.gid IS NULL AND {SHAREABLE}{clause} ORDER BY o.changed LIMIT ?",
                      (*params, limit))


def assign_evidence_gids(conn: sqlite3.Connection, project: str, limit: int) -> int:
    """The same for a project's evidence passages not yet pushed (an opted-in project, `evidence_outgoing`)."""
    return _give_gids(conn, f"SELECT m.id, m.created FROM memories m WHERE {_UNSHARED_EVIDENCE} AND m.gid IS NULL"
                            " ORDER BY m.id LIMIT ?", (project, limit))


def _give_gids(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> int:
    rows = conn.execute(sql, params).fetchall()
    conn.executemany("UPDATE memories SET gid = ? WHERE id = ?", [(uuid7(r[1]), r[0]) for r in rows])
    return len(rows)


# What a pushed row is read with: the memory, the vector when it is computed, how many source events it has.
_ROW = ("m.*, v.model AS vmodel, v.vec AS vec,"
        " (SELECT count(*) FROM memory_sources ms WHERE ms.memory_id = m.id) AS nsources")
_VECTOR = " LEFT JOIN memory_vectors v ON v.memory_id = m.id AND v.content_hash = m.content_hash"
# This machine's evidence passages of one project that the server does not hold yet (store migration m010's index);
# pulled ones (`device` set) came from the server.
_UNSHARED_EVIDENCE = "m.project = ? AND m.kind = 'evidence' AND m.shared_changed IS NULL AND m.device IS NULL"


async def outgoing(db: aiosqlite.Connection, private: Collection[str], limit: int) -> list[dict[str, Any]]:
    """The oldest queued changes, as plain rows for `to_push`, with a provenance summary (never the evidence
    itself) and the vector when it is computed."""
    clause, params = _private_clause(private)
    return await _plain_rows(db,
        f"SELECT {_ROW}, o.changed AS queued,"
        # The link as this machine knows it: a local one by its target's global id, else one still waiting for
        # its target (pulled before it): a local edit of such a memory must not drop the server's link.
        f" CASE WHEN m.superseded_by IS NULL THEN m.superseded_gid ELSE s.gid END AS superseded_target"
        f" FROM shared_outbox o JOIN memories m ON m.id = o.memory_id"
        f" LEFT JOIN memories s ON s.id = m.superseded_by{_VECTOR}"
        f" WHERE m.gid IS NOT NULL AND {QUEUED}{clause} ORDER BY o.changed LIMIT ?", (*params, limit))


async def evidence_outgoing(db: aiosqlite.Connection, project: str, limit: int) -> list[dict[str, Any]]:
    """A project's evidence passages not yet on the server, oldest first, as plain rows for `to_push`: their text
    is re-redacted like a memory's, never the raw events they cite (the provenance counts them). Sent once: a
    passage is never edited, and `mark_pushed` records the version the server holds."""
    return await _plain_rows(db,
        f"SELECT {_ROW}, m.updated AS queued, NULL AS superseded_target FROM memories m{_VECTOR}"
        f" WHERE {_UNSHARED_EVIDENCE} AND m.gid IS NOT NULL ORDER BY m.id LIMIT ?", (project, limit))


async def _plain_rows(db: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows as dicts, made on the connection's thread in one trip: they are sent to the offload process."""
    return await on_thread(db, lambda conn: [dict(r) for r in conn.execute(sql, params).fetchall()])


def to_push(rows: Sequence[dict[str, Any]], who: Identity) -> list[Outgoing]:
    """Server rows, their text and tags re-redacted (the redactor may have learnt since they were stored). Run in
    the offload process: redaction is CPU work (tens of milliseconds a batch for long passages) that, on a thread
    of the daemon, would hold the interpreter lock the event loop needs to answer hooks."""
    out = []
    for r in rows:
        provenance = {"origin": r["origin"], "agent": r["agent"], "sources": r["nsources"], "hits": r["hits"]}
        row = Shared(
            gid=r["gid"], team=who.team, project=r["project"], kind=r["kind"], scope=r["scope"],
            text=redact_text(r["text"]), tags=redact_text(r["tags"]), importance=float(r["importance"]),
            created_at=float(r["created"]), changed_at=float(r["queued"]), changed_by=who.device,
            archived_at=r["archived_at"], superseded_by=r["superseded_target"], device=r["device"] or who.device,
            person=r["person"] or who.person, provenance=provenance,
            embed_model=r["vmodel"] if r["vec"] is not None else None,
            # pgvector's own type, made here: the connection's codec then only packs it, on the event loop.
            embedding=Vector(np.frombuffer(r["vec"], dtype="<f4")) if r["vec"] is not None else None)
        out.append(Outgoing(r["id"], float(r["queued"]), row))
    return out


def mark_pushed(conn: sqlite3.Connection, done: Sequence[Outgoing]) -> None:
    """Dequeue what the server now holds, unless it changed again meanwhile (then its newer change stays queued),
    and remember the version agreed. On the writer's thread, inside the caller's transaction."""
    conn.executemany("DELETE FROM shared_outbox WHERE memory_id = ? AND changed = ?",
                     [(o.memory_id, o.changed) for o in done])
    conn.executemany("UPDATE memories SET shared_changed = ?, shared_by = ? WHERE id = ?",
                     [(o.row.changed_at, o.row.changed_by, o.memory_id) for o in done])


async def apply(db: aiosqlite.Connection, memories: MemoryWriter, rows: Sequence[Shared]) -> dict[str, int]:
    """Write pulled versions into the local store, marked with their origin (device, person).

    New ids are inserted through the one memory-write path (the same text already here without a global id takes
    that id instead: one memory, not two). A version is skipped when the local row has a change still queued (the
    next push settles that conflict on the server and brings back the winner) or already holds it. Supersession
    links resolve once the whole batch is in, since a memory and the one replacing it often arrive together; a
    link whose target is not here yet waits in `superseded_gid` and resolves in the pull that brings the target.
    """
    counts = {"inserted": 0, "updated": 0, "skipped": 0}
    chosen: list[tuple[int, Shared]] = []
    for row in rows:
        local = await _one(db, "SELECT m.id, m.shared_changed, m.shared_by, o.memory_id IS NOT NULL AS queued"
                               " FROM memories m LEFT JOIN shared_outbox o ON o.memory_id = m.id WHERE m.gid = ?",
                           (row.gid,))
        if local is not None:
            if local["queued"] or (local["shared_changed"], local["shared_by"] or "") >= row.version:
                counts["skipped"] += 1
                continue
            chosen.append((int(local["id"]), row))
            counts["updated"] += 1
            continue
        same = await _one(db, "SELECT id, gid FROM memories WHERE project = ? AND content_hash = ? AND kind = ?"
                              " AND archived_at IS NULL LIMIT 1", (row.project, content_hash(row.text), row.kind))
        if same is not None and same["gid"] is not None:
            counts["skipped"] += 1
            continue
        if same is not None:
            memory_id = int(same["id"])
        else:
            memory_id, _ = await insert_memory(
                db, kind=row.kind, text=row.text, project=row.project, scope=row.scope, tags=row.tags.split(),
                importance=row.importance, created=row.created_at, origin="shared",
                meta={"provenance": row.provenance})
        await db.execute("UPDATE memories SET gid = ?, device = ?, person = ? WHERE id = ?",
                         (row.gid, row.device, row.person, memory_id))
        await db.execute("DELETE FROM shared_outbox WHERE memory_id = ?", (memory_id,))
        chosen.append((memory_id, row))
        counts["inserted"] += 1
    # One UPDATE per row carrying the new version: it moves shared_changed, so the triggers queue nothing.
    await db.executemany(
        "UPDATE memories SET text = ?, content_hash = ?, tokens = ?, kind = ?, scope = ?, tags = ?, importance = ?,"
        " archived_at = ?, superseded_by = NULL, superseded_gid = ?, shared_changed = ?, shared_by = ?,"
        " updated = max(updated, ?) WHERE id = ?",
        [(text, content_hash(text), estimate_tokens(text), row.kind, row.scope, row.tags, row.importance,
          row.archived_at, row.superseded_by, row.changed_at, row.changed_by, row.changed_at, memory_id)
         for memory_id, row in chosen for text in (redact_text(row.text),)])
    if chosen:
        await resolve_links(db)
        await memories.derive(db, [memory_id for memory_id, _ in chosen])
    return counts


async def resolve_links(db: aiosqlite.Connection) -> None:
    """Point every waiting supersession link whose target is now here at that memory (this batch's links and
    those of earlier batches alike), with the `supersedes` edge a local supersession writes. A link changed here
    meanwhile (`superseded_by` set) is kept: it is queued to push and wins or loses on the server. Moving
    `superseded_gid` marks the write as sync's: nothing queued."""
    resolved = [(int(r[0]), int(r[1])) for r in await db.execute_fetchall(
        "SELECT s.id, m.id FROM memories m JOIN memories s ON s.gid = m.superseded_gid"
        " WHERE m.superseded_gid IS NOT NULL AND m.superseded_by IS NULL AND s.id != m.id")]
    await db.execute(
        "UPDATE memories SET superseded_by = coalesce(superseded_by, (SELECT s.id FROM memories s"
        " WHERE s.gid = memories.superseded_gid)), superseded_gid = NULL WHERE superseded_gid IS NOT NULL"
        " AND EXISTS (SELECT 1 FROM memories s WHERE s.gid = memories.superseded_gid)")
    await supersedes_edges(db, resolved)


async def _one(db: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> Any:
    rows = list(await db.execute_fetchall(sql, params))
    return rows[0] if rows else None


async def backlog(db: aiosqlite.Connection, private: Collection[str]) -> tuple[int, float | None]:
    """(changes queued to push, time of the oldest): the push lag."""
    clause, params = _private_clause(private)
    rows = list(await db.execute_fetchall(
        f"SELECT count(*), min(o.changed) FROM shared_outbox o JOIN memories m ON m.id = o.memory_id"
        f" WHERE {QUEUED}{clause}", params))
    return int(rows[0][0]), rows[0][1]

