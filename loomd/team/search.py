"""`search` with `scope: "shared"`: the team's memories, queried on the server itself.

Two signals computed by PostgreSQL — full text (`ts_rank_cd` over the generated tsvector, a BM25-like ranking) and
vector KNN (pgvector's HNSW index, cosine) — fused by the same weighted RRF as local search (`search/fusion.py`).
Row-level security decides which rows the query may see; loomd adds no team filter of its own for that.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import numpy as np

from loomd.config import Config
from loomd.errors import SharedError
from loomd.search.fusion import CANDIDATES, DEFAULT_WEIGHTS, query_terms, weighted_rrf
from loomd.team import remote

_WORD = re.compile(r"\w+")
# The server's HNSW search breadth: recall against latency (pgvector's default is 40).
EF_SEARCH = 100


def tsquery(query: str) -> str:
    """The OR of the query's terms as `to_tsquery` text; only word characters, so user text is never syntax."""
    return " | ".join(t for t in query_terms(query) if _WORD.fullmatch(t))


class SharedSearch:
    """A connection of its own (a search never waits behind a sync batch), opened on first use."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self.config = config
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    async def search(self, query: str, vector: np.ndarray | None, model: str | None, *, limit: int,
                     project: str | None, kind: str | list[str] | None, include_archived: bool) -> dict[str, Any]:
        async with self._lock:
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = await remote.connect(self.config())
                    await remote.check_schema(self._conn)
                    # Custom plans: a generic plan cannot see the query's terms and scans every row instead of
                    # the GIN index.
                    await self._conn.execute(
                        f"SET hnsw.ef_search = {EF_SEARCH}; SET plan_cache_mode = force_custom_plan")
                return await _search(self._conn, query, vector, model, limit=limit, project=project, kind=kind,
                                     include_archived=include_archived)
            except remote.CONNECTION_ERRORS as exc:
                await self.close()
                raise SharedError(f"shared search failed: {remote.describe(exc)}") from None

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()


async def _search(conn: asyncpg.Connection, query: str, vector: np.ndarray | None, model: str | None, *,
                  limit: int, project: str | None, kind: str | list[str] | None,
                  include_archived: bool) -> dict[str, Any]:
    kinds = [kind] if isinstance(kind, str) else kind
    # $1 and $2 are the filters of every query; each signal's own parameters follow.
    where = ["($1::text IS NULL OR project = $1 OR scope = 'user')", "($2::text[] IS NULL OR kind = ANY($2))"]
    params: list[Any] = [project, kinds or None]
    if not include_archived:
        where.append("archived_at IS NULL")
    clause = " AND ".join(where)
    timings: dict[str, float] = {}
    rankings: dict[str, list[int]] = {}
    rows: dict[str, asyncpg.Record] = {}
    keys: dict[str, int] = {}

    def ranked(records: list[asyncpg.Record]) -> list[int]:
        out = []
        for r in records:
            gid = str(r["gid"])
            rows.setdefault(gid, r)
            out.append(keys.setdefault(gid, len(keys)))
        return out

    columns = "gid, project, kind, scope, text, tags, device, person, created_at, changed_at, archived_at"
    terms = tsquery(query)
    if terms:
        started = time.perf_counter()
        # Ids in rank order from the owner's function (schema m002: an index under RLS), then their rows read under
        # RLS by primary key (a join would let the planner hash the whole table).
        ids = [r[0] for r in await conn.fetch(
            "SELECT gid FROM loomd.fts(to_tsquery('english', $1), $2, $3, $4, $5)", terms, *params[:2],
            include_archived, CANDIDATES)]
        found = {r["gid"]: r for r in await conn.fetch(
            f"SELECT {columns} FROM loomd.memories WHERE gid = ANY($1::uuid[])", ids)}
        rankings["fts"] = ranked([found[i] for i in ids if i in found])
        timings["fts_ms"] = round((time.perf_counter() - started) * 1000, 3)
    if vector is not None and model:
        started = time.perf_counter()
        rankings["vec"] = ranked(await conn.fetch(
            f"SELECT {columns} FROM loomd.memories WHERE embed_model = $3 AND embedding IS NOT NULL AND {clause}"
            " ORDER BY embedding <=> $4 LIMIT $5", *params, model, vector, CANDIDATES))
        timings["vec_ms"] = round((time.perf_counter() - started) * 1000, 3)
    fused = weighted_rrf(rankings, {s: DEFAULT_WEIGHTS[s] for s in rankings})[:limit]
    by_key = {k: gid for gid, k in keys.items()}
    results = []
    for key, score, explain in fused:
        r = rows[by_key[key]]
        results.append({
            "gid": by_key[key], "project": r["project"], "kind": r["kind"], "scope": r["scope"], "text": r["text"],
            "tags": r["tags"].split(), "device": r["device"], "person": r["person"], "created": r["created_at"],
            "updated": r["changed_at"], "archived_at": r["archived_at"], "score": round(score, 6),
            "signals": {s: rank for s, (rank, _) in explain.items()}})
    return {"results": results, "count": len(results), "project": project, "scope": "shared",
            "signals": sorted(rankings), "timings": timings}
