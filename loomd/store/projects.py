"""The projects the store knows: their keys, what each holds, when each was last active."""

from __future__ import annotations

from typing import Any

from loomd.store.db import Store


async def list_projects(store: Store) -> list[dict[str, Any]]:
    """Every project key with its sessions, active memories (distilled, and evidence passages apart), the folder
    it was last worked in and its last activity (a session seen or a memory written), most recent first."""
    found: dict[str, dict[str, Any]] = {}

    def entry(key: str) -> dict[str, Any]:
        return found.setdefault(key, {"project": key, "sessions": 0, "memories": 0, "evidence": 0, "archived": 0,
                                      "last_active": None, "path": None})

    for key, sessions, last_seen in await store.fetchall(
            "SELECT project, count(*), max(last_seen) FROM sessions WHERE project IS NOT NULL GROUP BY project"):
        item = entry(key)
        item["sessions"], item["last_active"] = sessions, last_seen
    for key, kind, active, archived, updated in await store.fetchall(
            "SELECT project, kind, sum(archived_at IS NULL), sum(archived_at IS NOT NULL), max(updated) FROM memories"
            " GROUP BY project, kind"):
        item = entry(key)
        item["evidence" if kind == "evidence" else "memories"] += active
        item["archived"] += archived
        item["last_active"] = max(item["last_active"] or 0, updated or 0) or None
    for key, cwd in await store.fetchall(
            "SELECT project, cwd FROM sessions s WHERE cwd IS NOT NULL AND last_seen ="
            " (SELECT max(last_seen) FROM sessions WHERE project = s.project AND cwd IS NOT NULL)"):
        entry(key)["path"] = cwd
    return sorted(found.values(), key=lambda p: (-(p["last_active"] or 0), p["project"]))
