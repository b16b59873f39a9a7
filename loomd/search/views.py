"""Views over stored memories: the timeline around a memory or an entity, and a memory's evidence (its source
events, with their text)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from loomd.errors import NotFound
from loomd.ingest.events import Event, event_text
from loomd.search.retrieval import memory_filters
from loomd.store.db import Store
from loomd.store.memories import memory_dict


async def timeline(
    store: Store, *, memory_id: int | None = None, entity: str | None = None, before: int = 5, after: int = 5,
    limit: int = 20, project: str | None = None, scope: str | None = None, kind: str | list[str] | None = None,
    since: float | None = None, until: float | None = None, session_id: str | None = None,
    include_archived: bool = False,
) -> dict[str, Any]:
    """Memories in time order: around one memory (`before`/`after` it), or those naming an entity (the newest
    `limit`), or simply the newest `limit`; every filter of search applies."""
    anchor = None
    if memory_id is not None:
        anchor = await store.fetchone("SELECT * FROM memories WHERE id = ?", (memory_id,))
        if anchor is None:
            raise NotFound(f"no memory with id {memory_id}")
        project = project or anchor["project"]
    where, params = memory_filters(project, scope, kind, since, until, session_id, include_archived)
    if anchor is not None:
        created, aid = anchor["created"], anchor["id"]
        earlier = await store.fetchall(
            f"SELECT m.* FROM memories m WHERE {where} AND (m.created, m.id) < (?, ?)"
            " ORDER BY m.created DESC, m.id DESC LIMIT ?", [*params, created, aid, before])
        later = await store.fetchall(
            f"SELECT m.* FROM memories m WHERE {where} AND (m.created, m.id) > (?, ?)"
            " ORDER BY m.created, m.id LIMIT ?", [*params, created, aid, after])
        rows = [*reversed(earlier), anchor, *later]
    elif entity is not None:
        name = entity.strip().lower()
        rows = list(reversed(await store.fetchall(
            "SELECT DISTINCT m.* FROM entities n JOIN edges e ON e.dst_type = 'entity' AND e.dst_id = n.id"
            " AND e.type = 'mentions' AND e.src_type = 'memory' JOIN memories m ON m.id = e.src_id"
            f" WHERE n.name = ? AND {where} ORDER BY m.created DESC, m.id DESC LIMIT ?", [name, *params, limit])))
    else:
        rows = list(reversed(await store.fetchall(
            f"SELECT m.* FROM memories m WHERE {where} ORDER BY m.created DESC, m.id DESC LIMIT ?", [*params, limit])))
    items = []
    for row in rows:
        item = memory_dict(row)
        if anchor is not None and row["id"] == anchor["id"]:
            item["anchor"] = True
        items.append(item)
    return {"memories": items, "count": len(items), "anchor": memory_id, "entity": entity}


async def evidence(store: Store, ids: Sequence[int], *, max_chars: int = 600, limit: int = 20) -> list[dict[str, Any]]:
    """Each memory with the source events it was made from: their kind, time and text, cut at `max_chars`."""
    marks = ",".join("?" * len(ids))
    found = {r["id"]: r for r in await store.fetchall(f"SELECT * FROM memories WHERE id IN ({marks})", ids)}
    missing = [i for i in ids if i not in found]
    if missing:
        raise NotFound(f"no memory with id {', '.join(map(str, missing))}")
    out = []
    for memory_id in ids:
        row = found[memory_id]
        events = await store.fetchall(
            "SELECT e.* FROM memory_sources s JOIN events e ON e.id = s.event_id WHERE s.memory_id = ?"
            " ORDER BY e.ts, e.id LIMIT ?", (memory_id, limit))
        total = await store.scalar("SELECT count(*) FROM memory_sources WHERE memory_id = ?", (memory_id,))
        item = {k: row[k] for k in ("id", "kind", "text", "project", "session_id", "created", "archived_at")}
        item["events"] = [event_view(e, max_chars) for e in events]
        item["events_total"] = int(total or 0)
        out.append(item)
    return out


def event_view(row: Any, max_chars: int) -> dict[str, Any]:
    try:
        payload = json.loads(row["payload"])
    except ValueError:
        payload = {"text": row["payload"]}
    if not isinstance(payload, dict):
        payload = {"text": json.dumps(payload)}
    event = Event(key=row["key"], agent=row["agent"], session_id=row["session_id"], kind=row["kind"],
                  source=row["source"], ts=row["ts"], payload=payload, tool_name=row["tool_name"])
    text = event_text(event) or json.dumps(payload, ensure_ascii=False)
    return {
        "id": row["id"], "kind": row["kind"], "agent": row["agent"], "session_id": row["session_id"],
        "ts": row["ts"], "tool_name": row["tool_name"], "text": text[:max_chars],
        "truncated": len(text) > max_chars, "chars": len(text),
    }

