"""Read views for looking through the store page by page (the web viewer, `loom review`): memories by filter,
sessions and their timelines, a memory's links, the review queue, worker runs and the stats series. Every list is
filtered and paged in SQL, so a page costs the same at 1k or 100k memories."""

from __future__ import annotations

import json
import time
from typing import Any

from loomd.errors import BadRequest, NotFound
from loomd.search.views import event_view
from loomd.store.db import Store
from loomd.store.memories import memory_dict
from loomd.store.review import REVIEW_CHECKPOINT, UNREVIEWED

STATES = ("active", "archived", "superseded", "all")
_STATE_SQL = {
    "active": "archived_at IS NULL AND superseded_by IS NULL",
    "archived": "archived_at IS NOT NULL",
    "superseded": "superseded_by IS NOT NULL",
    "all": "1",
}
DAY = 86400.0
# Lists count their matches up to here: an exact count reads every matching row (a whole-table scan for the
# default filters, ~200 ms at 100k memories), and no one pages to the thousandth match.
COUNT_CAP = 1000
MAX_BLOCKS = 500  # of one session's injected blocks, on its page


async def capped_count(store: Store, table: str, where: str, params: list[Any]) -> dict[str, Any]:
    """How many rows match, exactly up to COUNT_CAP (`more`: there are more than that)."""
    n = await store.scalar(f"SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {where} LIMIT ?)",
                           [*params, COUNT_CAP + 1])
    return {"total": min(n, COUNT_CAP), "more": n > COUNT_CAP}


def _row_view(row: Any) -> dict[str, Any]:
    """A memory as lists show it: the reply shape plus what its `meta` says of review and edits."""
    item = memory_dict(row)
    meta = json.loads(row["meta"] or "{}")
    item["reviewed_at"] = meta.get("reviewed_at")
    item["edits"] = len(meta.get("edits", []))
    item["archive_reason"] = meta.get("archive_reason") if row["archived_at"] else None
    return item


def memory_filter(project: str | None, kind: str | None, scope: str | None, state: str) -> tuple[str, list[Any]]:
    """The WHERE clause of a memories list. No kind: the distilled memories (evidence passages only when asked)."""
    if state not in STATES:
        raise BadRequest(f"unknown state '{state}'; one of: {', '.join(STATES)}")
    where, params = [_STATE_SQL[state]], []
    if kind:
        where.append("kind = ?")
        params.append(kind)
    else:
        where.append("kind != 'evidence'")
    # `+project` keeps SQLite off `memories_hash` (every memory of the project, then a sort: 0.7 s at 100k) unless
    # `memories_project` (project, kind, archived_at) gives the page in id order; else the id order or m006's
    # partial indexes stop at the page.
    indexed = kind is not None and state == "active"
    for column, value in (("project" if indexed else "+project", project), ("scope", scope)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    return " AND ".join(where), params


async def list_memories(store: Store, *, project: str | None = None, kind: str | None = None,
                        scope: str | None = None, state: str = "active", limit: int = 50,
                        offset: int = 0) -> dict[str, Any]:
    """One page of memories, newest first, and how many match."""
    where, params = memory_filter(project, kind, scope, state)
    rows = await store.fetchall(f"SELECT * FROM memories WHERE {where} ORDER BY id DESC LIMIT ? OFFSET ?",
                                [*params, limit, offset])
    return {"memories": [_row_view(r) for r in rows], **await capped_count(store, "memories", where, params),
            "offset": offset, "limit": limit}


async def review_queue(store: Store, *, project: str | None = None, limit: int = 50,
                       offset: int = 0) -> dict[str, Any]:
    """What the workers and capture rules wrote that no one has reviewed yet (newest first); `new` of them were
    written after the last review."""
    where = UNREVIEWED
    params: list[Any] = []
    if project:
        where += " AND +project = ?"  # the partial index `memories_unreviewed`, not every memory of the project
        params.append(project)
    raw = await store.scalar("SELECT value FROM checkpoints WHERE name = ?", (REVIEW_CHECKPOINT,))
    last = json.loads(raw) if raw else None
    new = await capped_count(store, "memories", f"{where} AND +created > ?", [*params, last or 0])
    rows = await store.fetchall(f"SELECT * FROM memories WHERE {where} ORDER BY id DESC LIMIT ? OFFSET ?",
                                [*params, limit, offset])
    return {"memories": [_row_view(r) for r in rows], **await capped_count(store, "memories", where, params),
            "new": new["total"], "new_more": new["more"], "last_review": last, "offset": offset, "limit": limit}


# What the session's injected blocks cost (a session from before blocks were recorded: its frozen start block).
_BLOCK_TOKENS = ("coalesce((SELECT (sum(length(i.text)) + 3) / 4 FROM injections i WHERE i.session_id = s.id),"
                 " (length(coalesce(s.start_block, '')) + 3) / 4)")
_SESSION_COLUMNS = (
    "s.id, s.agent, s.project, s.cwd, s.started, s.last_seen, s.ended,"
    " (SELECT count(*) FROM events e WHERE e.session_id = s.id) AS events,"
    " (SELECT count(*) FROM memories m WHERE m.session_id = s.id AND m.kind != 'evidence') AS memories,"
    " json_array_length(s.injected) AS injected,"
    f" {_BLOCK_TOKENS} AS block_tokens"
)


async def list_sessions(store: Store, *, project: str | None = None, limit: int = 50,
                        offset: int = 0) -> dict[str, Any]:
    """One page of sessions, last seen first, each with its counts and the tokens of its frozen blocks."""
    where, params = ("WHERE project = ?", [project]) if project else ("", [])
    total = await store.scalar(f"SELECT count(*) FROM sessions {where}", params)
    # The page first, then its counts: SQLite would run the correlated counts for every session before the LIMIT.
    rows = await store.fetchall(
        f"SELECT {_SESSION_COLUMNS} FROM (SELECT * FROM sessions {where} ORDER BY last_seen DESC LIMIT ? OFFSET ?) s"
        " ORDER BY s.last_seen DESC", [*params, limit, offset])
    return {"sessions": [dict(r) for r in rows], "total": total, "more": False, "offset": offset, "limit": limit}


async def _memories_where(store: Store, where: str, params: list[Any], limit: int = 200) -> list[dict[str, Any]]:
    rows = await store.fetchall(f"SELECT * FROM memories WHERE {where} ORDER BY created, id LIMIT ?",
                                [*params, limit])
    return [_row_view(r) for r in rows]


async def session_view(store: Store, session_id: str, *, limit: int = 100, offset: int = 0,
                       max_chars: int = 4000) -> dict[str, Any]:
    """A session: a page of its events in order (each with its text), its observations and other memories, its
    blocks injected into it as the agent got them (start, per prompt, follow-up, after compaction), each with its
    token cost, and every memory injected into it."""
    row = await store.fetchone(f"SELECT {_SESSION_COLUMNS}, s.start_block, s.compact_block, s.injected AS injected_ids"
                               " FROM sessions s WHERE s.id = ?", (session_id,))
    if row is None:
        raise NotFound(f"no session '{session_id}'")
    session = dict(row)
    injected_ids = json.loads(session.pop("injected_ids") or "[]")
    events = await store.fetchall("SELECT * FROM events WHERE session_id = ? ORDER BY id LIMIT ? OFFSET ?",
                                  (session_id, limit, offset))
    injected = await _memories_where(store, "id IN (SELECT value FROM json_each(?))", [json.dumps(injected_ids)])
    return {
        "session": session,
        "events": [event_view(e, max_chars) | {"source": e["source"], "tokens": e["tokens"]} for e in events],
        "offset": offset, "limit": limit,
        "observations": await _memories_where(store, "session_id = ? AND kind = 'observation'", [session_id]),
        "memories": await _memories_where(store, "session_id = ? AND kind NOT IN ('observation', 'evidence')",
                                          [session_id]),
        "injected": injected,
        "injected_tokens": sum(m["tokens"] for m in injected),
        "blocks": [{"ts": r[0], "kind": r[1], "text": r[2], "tokens": (len(r[2]) + 3) // 4} for r in
                   await store.fetchall("SELECT ts, kind, text FROM injections WHERE session_id = ? ORDER BY id"
                                        " LIMIT ?", (session_id, MAX_BLOCKS))],
    }


async def _chain(store: Store, memory_id: int) -> list[dict[str, Any]]:
    """The supersession chain through a memory: what it replaced (oldest first), itself, what replaced it."""
    older: list[int] = []
    frontier = [memory_id]
    while frontier and len(older) < 50:
        marks = ",".join("?" * len(frontier))
        frontier = [r[0] for r in await store.fetchall(
            f"SELECT id FROM memories WHERE superseded_by IN ({marks}) ORDER BY id", frontier)]
        older = frontier + older
    newer: list[int] = []
    current = await store.scalar("SELECT superseded_by FROM memories WHERE id = ?", (memory_id,))
    while current is not None and current not in newer and len(newer) < 50:
        newer.append(current)
        current = await store.scalar("SELECT superseded_by FROM memories WHERE id = ?", (current,))
    ids = [*older, memory_id, *newer]
    if len(ids) == 1:
        return []
    rows = {r["id"]: _row_view(r) for r in await store.fetchall(
        "SELECT * FROM memories WHERE id IN (SELECT value FROM json_each(?))", (json.dumps(ids),))}
    return [rows[i] for i in ids if i in rows]


async def memory_links(store: Store, memory_id: int) -> dict[str, Any]:
    """What connects a memory: its edges (to memories and entities, both ways), its supersession chain, the
    sessions it was injected into, its edit trail and what was merged into it."""
    row = await store.fetchone("SELECT * FROM memories WHERE id = ?", (memory_id,))
    if row is None:
        raise NotFound(f"no memory with id {memory_id}")
    meta = json.loads(row["meta"] or "{}")
    edges = []
    for direction, mine, theirs in (("out", "src", "dst"), ("in", "dst", "src")):
        for e in await store.fetchall(
                f"SELECT e.type, e.weight, e.{theirs}_type AS node, e.{theirs}_id AS node_id,"
                " coalesce(m.text, n.name) AS label, coalesce(m.kind, n.kind) AS node_kind"
                f" FROM edges e LEFT JOIN memories m ON e.{theirs}_type = 'memory' AND m.id = e.{theirs}_id"
                f" LEFT JOIN entities n ON e.{theirs}_type = 'entity' AND n.id = e.{theirs}_id"
                f" WHERE e.{mine}_type = 'memory' AND e.{mine}_id = ? ORDER BY e.type, e.weight DESC LIMIT 100",
                (memory_id,)):
            edges.append({"direction": direction, **dict(e)})
    sessions = await store.fetchall(
        "SELECT id, agent, project, started, last_seen FROM sessions"
        " WHERE EXISTS (SELECT 1 FROM json_each(injected) WHERE value = ?) ORDER BY started DESC LIMIT 100",
        (memory_id,))
    return {
        "id": memory_id, "hits": row["hits"], "last_hit": row["last_hit"], "edges": edges,
        "chain": await _chain(store, memory_id), "injected_into": [dict(s) for s in sessions],
        "edits": meta.get("edits", []), "merged_from": meta.get("merged_from", []),
        "reviewed_at": meta.get("reviewed_at"), "archive_reason": meta.get("archive_reason"),
    }


async def list_jobs(store: Store, *, worker: str | None = None, outcome: str | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    """The newest worker runs, each with its outcome, error and detail."""
    where, params = [], []
    for column, value in (("worker", worker), ("outcome", outcome)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    sql = "SELECT * FROM jobs" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id DESC LIMIT ?"
    return [dict(r) | {"detail": json.loads(r["detail"] or "{}")} for r in await store.fetchall(sql, [*params, limit])]


async def stats_series(store: Store, *, project: str | None = None, days: int = 60,
                       sessions: int = 30) -> dict[str, Any]:
    """The stats page's series: distilled memories written per day by kind over the `days` up to the newest one
    (an imported history may end long ago), the tokens injected into each recent session (frozen blocks and every
    memory shown), the most recalled memories, and the store's growth."""
    project_sql, params = ("AND project = ?", [project]) if project else ("", [])
    newest = await store.scalar(f"SELECT max(created) FROM memories WHERE 1 {project_sql}", params)
    since = (newest or time.time()) - days * DAY
    by_kind = await store.fetchall(
        "SELECT CAST(created / 86400 AS INTEGER) AS day, kind, count(*) FROM memories"
        f" WHERE created >= ? AND kind != 'evidence' {project_sql} GROUP BY day, kind ORDER BY day",
        [since, *params])
    injected = await store.fetchall(
        f"SELECT s.id, s.started, {_BLOCK_TOKENS} AS block_tokens, (SELECT coalesce(sum(m.tokens), 0)"
        " FROM json_each(s.injected) j"
        " JOIN memories m ON m.id = j.value) AS memory_tokens"
        f" FROM sessions s WHERE 1 {project_sql.replace('project', 's.project')} ORDER BY s.started DESC LIMIT ?",
        [*params, sessions])
    top = await store.fetchall(
        f"SELECT id, kind, text, hits FROM memories WHERE hits > 0 {project_sql} ORDER BY hits DESC LIMIT 10",
        params)
    growth = await store.fetchall(
        "SELECT CAST(created / 86400 AS INTEGER) AS day, count(*) FROM memories"
        f" WHERE 1 {project_sql} GROUP BY day ORDER BY day", params)
    total, cumulative = 0, []
    for day, n in growth:
        total += n
        cumulative.append({"day": day * DAY, "memories": total})
    return {
        "by_kind": [{"day": d * DAY, "kind": k, "count": n} for d, k, n in by_kind],
        "injected": [{"session_id": r[0], "started": r[1], "block_tokens": r[2], "memory_tokens": r[3]}
                     for r in reversed(injected)],
        "top_hits": [dict(r) for r in top],
        "growth": cumulative[-days:],
    }
