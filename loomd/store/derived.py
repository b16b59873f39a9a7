"""Data derived from a memory's text, written in the same transaction as the memory itself.

- `ctx`: the text of up to CONTEXT_WINDOW memories before and after it in its session (time order), indexed as
  a down-weighted FTS5 column, so a turn that answers "yes, last week!" is found by the question before it.
- the entity graph: zero-LLM entities (entities.py), a `mentions` edge memory -> entity, and `co_occurs` edges
  between the entities one memory names together (weight = how many memories did).

One call derives a whole batch in a fixed number of statements (a few per batch, one per session touched), not a
few per memory: each statement is a trip to the writer connection's thread, and each `ctx` rewrite rewrites the
row's whole full-text entry (the `memories_au` trigger). The result is the same whatever the batching: one memory
at a time or five hundred in a transaction leave the same entities, edges, weights and `ctx` text.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiosqlite

from loomd.store.entities import extract_entities

# Session neighbours on each side whose text fills a memory's `ctx` column.
CONTEXT_WINDOW = 2
# A long memory (a stack trace, a diff) can name hundreds of identifiers: the first ones carry the point.
MAX_ENTITIES = 32
MAX_CO_OCCURRING = 8
# The neighbour column is a hint, not a copy of the session: each neighbour contributes at most this much.
MAX_NEIGHBOUR_CHARS = 600


@dataclass(frozen=True)
class Written:
    """A memory whose derived data is being written."""

    id: int
    project: str
    text: str
    kind: str
    session_id: str | None
    created: float


async def written(db: aiosqlite.Connection, ids: Sequence[int]) -> list[Written]:
    """The memories of `ids` that exist, in the order given, each once."""
    unique = list(dict.fromkeys(ids))
    rows = await db.execute_fetchall(
        "SELECT id, project, text, kind, session_id, created FROM memories"
        " WHERE id IN (SELECT value FROM json_each(?))", (json.dumps(unique),))
    by_id = {r[0]: Written(*r) for r in rows}
    return [by_id[i] for i in unique if i in by_id]


def neighbour_context(texts: Sequence[str]) -> str:
    """The `ctx` text of a memory from its neighbours' texts (earlier ones first, nearest last; then later ones)."""
    return " ".join(t[:MAX_NEIGHBOUR_CHARS] for t in texts if t)


def contexts_in_order(ordered: Sequence[str], positions: Sequence[int], window: int = CONTEXT_WINDOW) -> dict[int, str]:
    """`ctx` for every position within `window` of one of `positions` in a session's time-ordered texts. Pure:
    the caller fetched at least 2 x `window` texts beyond the outermost positions, so each window is whole."""
    out: dict[int, str] = {}
    for p in positions:
        for i in range(max(0, p - window), min(len(ordered), p + window + 1)):
            if i not in out:
                out[i] = neighbour_context([*ordered[max(0, i - window) : i], *ordered[i + 1 : i + 1 + window]])
    return out


_SPAN = (
    "SELECT * FROM (SELECT id, created, text, ctx FROM memories WHERE session_id = :s AND (created, id) < (:c0, :i0)"
    "   AND kind != 'evidence' ORDER BY created DESC, id DESC LIMIT :margin)"
    " UNION ALL SELECT id, created, text, ctx FROM memories WHERE session_id = :s"
    "   AND (created, id) BETWEEN (:c0, :i0) AND (:c1, :i1) AND kind != 'evidence'"
    " UNION ALL SELECT * FROM (SELECT id, created, text, ctx FROM memories WHERE session_id = :s"
    "   AND (created, id) > (:c1, :i1) AND kind != 'evidence' ORDER BY created, id LIMIT :margin)"
)


async def update_context(db: aiosqlite.Connection, memories: Sequence[Written]) -> int:
    """Refresh `ctx` of these memories and of their session neighbours whose window now includes them; rows
    changed. Distilled memories only: an evidence passage's ctx is its neighbouring passages, written with it
    (workers/evidence.py), and passages are no distilled memory's neighbours (they would repeat the session)."""
    by_session: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for m in memories:
        if m.session_id is not None and m.kind != "evidence":
            by_session[m.session_id].append((m.created, m.id))
    updates: list[tuple[str, int]] = []
    for session_id, keys in by_session.items():
        (c0, i0), (c1, i1) = min(keys), max(keys)
        rows = await db.execute_fetchall(_SPAN, {"s": session_id, "c0": c0, "i0": i0, "c1": c1, "i1": i1,
                                                 "margin": 2 * CONTEXT_WINDOW})
        rows = sorted(rows, key=lambda r: (r[1], r[0]))
        mine = {i for _, i in keys}
        positions = [p for p, r in enumerate(rows) if r[0] in mine]
        for p, ctx in contexts_in_order([r[2] for r in rows], positions).items():
            if rows[p][3] != ctx:
                updates.append((ctx, rows[p][0]))
    if updates:
        await db.executemany("UPDATE memories SET ctx = ? WHERE id = ?", updates)
    return len(updates)


# `mentioned` of texts, by text.
Mentions = Mapping[str, list[tuple[str, str]]]


def mentioned(text: str) -> list[tuple[str, str]]:
    """The entities a memory links to: the first MAX_ENTITIES found, each (name, type) once."""
    return list(dict.fromkeys(extract_entities(text)[:MAX_ENTITIES]))


async def link_entities(db: aiosqlite.Connection, memories: Sequence[Written], given: Mentions | None = None) -> int:
    """Entities of the texts, `mentions` edges to them, `co_occurs` edges between the entities one memory names
    together; new mentions. Entities are created in the memories' order (so their ids do not depend on the
    batching); a memory seen again (it already mentions its entities) adds no mention and no co-occurrence.

    `given`: `mentioned` of some texts, worked out before the transaction (the observer's, in the offload process):
    the extraction is CPU work that would otherwise hold the event loop, and the write lock with it."""
    found = [(m, names) for m in memories
             if (names := given[m.text] if given is not None and m.text in given else mentioned(m.text))]
    if not found:
        return 0
    now = time.time()
    await db.executemany("INSERT OR IGNORE INTO entities (project, name, kind) VALUES (?, ?, ?)",
                         [(m.project, name, kind) for m, names in found for name, kind in names])
    ids: dict[tuple[str, str], int] = {}
    for project in dict.fromkeys(m.project for m, _ in found):
        wanted = json.dumps(list(dict.fromkeys(name for m, ns in found if m.project == project for name, _ in ns)))
        for entity_id, name in await db.execute_fetchall(
                "SELECT id, name FROM entities WHERE project = ? AND name IN (SELECT value FROM json_each(?))",
                (project, wanted)):
            ids[(project, name)] = entity_id
    known: dict[int, set[int]] = defaultdict(set)
    for src, dst in await db.execute_fetchall(
            "SELECT src_id, dst_id FROM edges WHERE src_type = 'memory' AND src_id IN (SELECT value FROM json_each(?))"
            " AND dst_type = 'entity' AND type = 'mentions'", (json.dumps([m.id for m, _ in found]),)):
        known[src].add(dst)
    mentions: list[tuple[int, int, float]] = []
    counts: Counter[int] = Counter()
    pairs: Counter[tuple[int, int]] = Counter()
    for m, names in found:
        entity_ids = list(dict.fromkeys(ids[(m.project, n)] for n, _ in names if (m.project, n) in ids))
        fresh = [e for e in entity_ids if e not in known[m.id]]
        if not fresh:
            continue
        mentions += [(m.id, e, now) for e in fresh]
        counts.update(fresh)
        # An evidence passage links what it mentions (the graph signal finds it), but what a raw log names
        # together says little: only distilled memories add co-occurrence.
        if m.kind != "evidence":
            head = sorted(entity_ids[:MAX_CO_OCCURRING])
            pairs.update((a, b) for i, a in enumerate(head) for b in head[i + 1 :])
    await db.executemany(
        "INSERT OR IGNORE INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
        " VALUES ('memory', ?, 'entity', ?, 'mentions', 1.0, ?)", mentions)
    await db.executemany("UPDATE entities SET mentions = mentions + ? WHERE id = ?",
                         [(n, e) for e, n in counts.items()])
    if pairs:
        await db.executemany(
            "INSERT INTO edges (src_type, src_id, dst_type, dst_id, type, weight, created)"
            " VALUES ('entity', ?, 'entity', ?, 'co_occurs', ?, ?)"
            " ON CONFLICT (src_type, src_id, dst_type, dst_id, type) DO UPDATE SET weight = weight + excluded.weight",
            [(a, b, float(n), now) for (a, b), n in pairs.items()])
    return len(mentions)


async def write_derived(db: aiosqlite.Connection, ids: Sequence[int], mentions: Mentions | None = None) -> None:
    """Everything derived from these memories' text, inside the caller's transaction (`link_entities` for
    `mentions`)."""
    memories = await written(db, ids)
    await link_entities(db, memories, mentions)
    await update_context(db, memories)
