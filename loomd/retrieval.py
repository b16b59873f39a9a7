"""Search over memories: filters, signals and their fusion."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest
from .memories import memory_dict
from .store import Store

MODES = ("keyword", "semantic", "hybrid")
_WORD = re.compile(r"\w+", re.UNICODE)


def fts_query(text: str) -> str:
    """OR of quoted terms: user text never becomes FTS5 syntax (NOT, NEAR, quotes, columns stay plain words)."""
    terms = [t for t in _WORD.findall(text.lower()) if len(t) > 1 or t.isdigit()]
    return " OR ".join(f'"{t}"' for t in dict.fromkeys(terms))


@dataclass
class SearchContext:
    store: Store


def _filters(
    project: str | None, scope: str | None, kind: str | list[str] | None, since: float | None, until: float | None,
    session_id: str | None, include_archived: bool,
) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    if project:
        # User-scope memories follow the user into every project.
        clauses.append("(m.project = ? OR m.scope = 'user')")
        params.append(project)
    if scope:
        clauses.append("m.scope = ?")
        params.append(scope)
    if kind:
        kinds = [kind] if isinstance(kind, str) else kind
        if not all(isinstance(k, str) for k in kinds):
            raise BadRequest("'kind' must be a string or a list of strings")
        clauses.append(f"m.kind IN ({','.join('?' * len(kinds))})")
        params.extend(kinds)
    if since is not None:
        clauses.append("m.created >= ?")
        params.append(since)
    if until is not None:
        clauses.append("m.created <= ?")
        params.append(until)
    if session_id:
        clauses.append("m.session_id = ?")
        params.append(session_id)
    if not include_archived:
        clauses.append("m.archived_at IS NULL")
    return (" AND ".join(clauses) or "1"), params


async def search_memories(
    ctx: SearchContext, *, query: str, limit: int = 10, mode: str = "hybrid", project: str | None = None,
    scope: str | None = None, kind: str | list[str] | None = None, since: float | None = None,
    until: float | None = None, session_id: str | None = None, include_archived: bool = False, explain: bool = False,
) -> list[dict[str, Any]]:
    if mode not in MODES:
        raise BadRequest(f"unknown mode '{mode}'; one of: {', '.join(MODES)}")
    where, params = _filters(project, scope, kind, since, until, session_id, include_archived)
    match = fts_query(query)
    if not match:
        return []
    rows = await ctx.store.fetchall(
        f"SELECT m.*, bm25(memories_fts) AS score FROM memories_fts JOIN memories m ON m.id = memories_fts.rowid"
        f" WHERE memories_fts MATCH ? AND {where} ORDER BY score, m.id LIMIT ?",
        [match, *params, limit],
    )
    results = []
    for rank, row in enumerate(rows, start=1):
        item = memory_dict(row)
        item["score"] = -row["score"]
        if explain:
            item["explain"] = {"fts": {"rank": rank, "score": -row["score"]}}
        results.append(item)
    return results
