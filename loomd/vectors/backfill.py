"""The vector back-fill, one batch at a time: find memories whose vector is missing or stale, embed them, remix
their session neighbours, pair near-duplicates across sessions. Planned off the event loop on a private read
connection, then written in one short transaction, so ingest never waits on a model.

A vector is stale when its `model` is not the current provider's name or its `content_hash` is not the memory's
(the text changed). Texts are embedded once per content hash: a hash already embedded by this model is copied.

Recurrence: `memory_near` holds pairs (a, b) of memories of one project, in different sessions, whose raw vectors
have cosine >= RECURRENCE_MIN_COSINE (among the NEAR_CANDIDATES nearest by Hamming distance); a memory's
`recurrence` is the number of distinct other sessions among its pairs.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite
import numpy as np

from loomd.errors import EmbedderError
from loomd.vectors.embed import Embedder
from loomd.vectors.index import BitIndex, IndexRow, as_matrix, sign_bits

# Stored vector = normalise(own + MIX_ALPHA * sum of the vectors of up to MIX_WINDOW neighbours on each side).
MIX_ALPHA = 0.25
MIX_WINDOW = 2
# A memory recurs when another session holds a memory this close to it (cosine of the raw vectors).
RECURRENCE_MIN_COSINE = 0.7


def mix_vector(own: bytes, neighbours: Sequence[bytes], alpha: float = MIX_ALPHA) -> bytes:
    """normalise(own + alpha * sum(neighbours)): one memory's stored vector, from its raw one and its neighbours'."""
    matrix = as_matrix([own, *neighbours], len(own) // 4)
    mixed = matrix[0] + alpha * matrix[1:].sum(axis=0)
    norm = float(np.linalg.norm(mixed))
    if norm == 0.0:
        return own
    return (mixed / norm).astype("<f4").tobytes()


BATCH = 8  # per embedding call: shutdown waits for the one running, so it stays short
NEAR_CANDIDATES = 64

_STALE = (
    "SELECT m.id, m.text, m.content_hash, m.project, m.scope, m.session_id, m.created, m.kind,"
    " v.memory_id IS NOT NULL"
    " FROM memories m LEFT JOIN memory_vectors v ON v.memory_id = m.id"
    " WHERE (v.memory_id IS NULL OR v.model != ? OR v.content_hash != m.content_hash)"
)


@dataclass
class Stale:
    id: int
    text: str
    content_hash: str
    project: str
    scope: str
    session: str | None
    created: float
    kind: str
    had_vector: bool


@dataclass
class Plan:
    """What one batch writes, computed from a read snapshot; applied by `apply_plan`, then mirrored in the index."""

    model: str
    # (id, content hash, raw, mixed, bits of mixed, bits of raw) of each memory of the batch
    rows: list[tuple[int, str, bytes, bytes, bytes, bytes]] = field(default_factory=list)
    remixed: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # neighbours: id -> (mixed, bits)
    reembedded: list[int] = field(default_factory=list)
    old_pairs: list[tuple[int, int]] = field(default_factory=list)  # of the re-embedded memories
    pairs: dict[tuple[int, int], float] = field(default_factory=dict)
    recurrence: set[int] = field(default_factory=set)
    index_rows: list[IndexRow] = field(default_factory=list)
    embedded: int = 0
    copied: int = 0
    embed_seconds: float = 0.0


def _stale(row: Any) -> Stale:
    return Stale(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], bool(row[8]))


def scan(conn: sqlite3.Connection, model: str, dirty: Sequence[int], cursor: int) -> tuple[list[Stale], int]:
    """Up to BATCH stale memories: the dirty ids first, then ids above the cursor; and the cursor to go on from."""
    found: dict[int, Stale] = {}
    if dirty:
        for row in conn.execute(_STALE + " AND m.id IN (SELECT value FROM json_each(?))", (model, json.dumps(dirty))):
            found[row[0]] = _stale(row)
    rows = conn.execute(_STALE + " AND m.id > ? ORDER BY m.id LIMIT ?", (model, cursor, BATCH)).fetchall()
    for row in rows:
        found.setdefault(row[0], _stale(row))
    if len(rows) == BATCH:
        cursor = rows[-1][0]
    else:  # nothing stale up to the newest committed id; ids commit in order (one writer)
        cursor = max(cursor, conn.execute("SELECT coalesce(max(id), 0) FROM memories").fetchone()[0])
    return list(found.values()), cursor


class Backlog:
    """How many memories lie above the back-fill's cursor (`status`'s `pending`). Kept up by counting only the ids
    the cursor passed and the ids written since, not every id above the cursor after each batch: at 100k memories
    that recount was most of the back-fill thread's time with a fast embedder. A memory deleted inside the counted
    range is noticed at the next count from a cursor moved back (a full rescan)."""

    def __init__(self) -> None:
        self._low = -1  # the cursor the count is from (-1: nothing counted yet)
        self._high = 0  # the newest id counted
        self._count = 0

    def above(self, conn: sqlite3.Connection, cursor: int) -> int:
        newest = int(conn.execute("SELECT coalesce(max(id), 0) FROM memories").fetchone()[0])
        if self._low < 0 or not self._low <= cursor <= self._high:
            self._count = _ids_between(conn, cursor, newest)
        else:
            self._count += _ids_between(conn, self._high, newest) - _ids_between(conn, self._low, cursor)
        self._low, self._high = cursor, max(cursor, newest)
        return max(0, self._count)


def _ids_between(conn: sqlite3.Connection, low: int, high: int) -> int:
    """Memories with low < id <= high (a range of the table's own key)."""
    if high <= low:
        return 0
    return int(conn.execute("SELECT count(*) FROM memories WHERE id > ? AND id <= ?", (low, high)).fetchone()[0])


def _vectors(conn: sqlite3.Connection, model: str, ids: Sequence[int]) -> dict[int, bytes]:
    if not ids:
        return {}
    return dict(conn.execute(
        # `+model`: without it SQLite walks the (model, content_hash) index over every vector of the model.
        "SELECT memory_id, vec FROM memory_vectors WHERE +model = ? AND memory_id IN (SELECT value FROM json_each(?))",
        (model, json.dumps(list(ids)))))


def _window(conn: sqlite3.Connection, m: Stale, side: int) -> tuple[list[int], list[int]]:
    """A memory's session neighbours for mixing, of its own tier: evidence passages mix with the passages around
    them, distilled memories with distilled memories."""
    tier = int(m.kind == "evidence")
    earlier = [r[0] for r in conn.execute(
        "SELECT id FROM memories WHERE session_id = ? AND (created, id) < (?, ?) AND (kind = 'evidence') = ?"
        " ORDER BY created DESC, id DESC LIMIT ?", (m.session, m.created, m.id, tier, side))]
    later = [r[0] for r in conn.execute(
        "SELECT id FROM memories WHERE session_id = ? AND (created, id) > (?, ?) AND (kind = 'evidence') = ?"
        " ORDER BY created, id LIMIT ?", (m.session, m.created, m.id, tier, side))]
    return earlier[::-1], later


# An evidence passage is embedded by its opening (its header and first lines): the model's cost grows with the
# tokens it reads (about 0.15 ms a character here), the words of the whole passage are in the full-text index, and
# the next passage's opening overlaps this one's end.
EVIDENCE_EMBED_CHARS = 320


def embedded_text(m: Stale) -> str:
    return m.text[:EVIDENCE_EMBED_CHARS] if m.kind == "evidence" else m.text


def plan_batch(conn: sqlite3.Connection, embedder: Embedder, index: BitIndex | None, batch: Sequence[Stale]) -> Plan:
    """Embed (or copy) the batch's vectors and work out every row the batch changes. Blocking; off the loop."""
    model = embedder.name
    plan = Plan(model)
    hashes = sorted({m.content_hash for m in batch})
    known = dict(conn.execute(
        "SELECT content_hash, vec FROM memory_vectors WHERE model = ? AND content_hash IN"
        " (SELECT value FROM json_each(?)) GROUP BY content_hash", (model, json.dumps(hashes))))
    texts = {m.content_hash: embedded_text(m) for m in batch if m.content_hash not in known}
    started = time.perf_counter()
    fresh = embedder.embed(list(texts.values())) if texts else []
    plan.embed_seconds = time.perf_counter() - started
    plan.embedded, plan.copied = len(texts), len(batch) - len(texts)
    by_hash = {**known, **dict(zip(texts, fresh, strict=True))}
    raw = {m.id: by_hash[m.content_hash] for m in batch}
    dim = len(next(iter(raw.values()))) // 4
    if index is not None and index.dim != dim:
        raise EmbedderError(
            f"{model} returned {dim}-d vectors but the index holds {index.dim}-d ones: set embed_dim = {index.dim}"
            " or change the model name so every memory is embedded afresh")
    mixed: dict[int, bytes] = {}
    overlay = dict(raw)  # the batch's vectors are not in the database yet
    for m in batch:
        if m.session is None:
            mixed[m.id] = mix_vector(raw[m.id], [])
            continue
        earlier, later = _window(conn, m, 2 * MIX_WINDOW)
        order = [*earlier, m.id, *later]
        missing = [i for i in order if i not in overlay]
        overlay.update(_vectors(conn, model, missing))
        centre = len(earlier)
        for i in range(max(0, centre - MIX_WINDOW), min(len(order), centre + MIX_WINDOW + 1)):
            if order[i] not in overlay:
                continue  # not embedded yet: its own back-fill mixes it
            around = order[max(0, i - MIX_WINDOW) : i] + order[i + 1 : i + 1 + MIX_WINDOW]
            mixed[order[i]] = mix_vector(overlay[order[i]], [overlay[j] for j in around if j in overlay], MIX_ALPHA)
    batch_ids = {m.id for m in batch}
    for memory_id, vector in mixed.items():
        bits = sign_bits(np.frombuffer(vector, dtype="<f4"))[0]
        if memory_id not in batch_ids:
            plan.remixed[memory_id] = (vector, bits)
    for m in batch:
        raw_bits = sign_bits(np.frombuffer(raw[m.id], dtype="<f4"))[0]
        mix = mixed[m.id]
        bits = sign_bits(np.frombuffer(mix, dtype="<f4"))[0]
        plan.rows.append((m.id, m.content_hash, raw[m.id], mix, bits, raw_bits))
        plan.index_rows.append(IndexRow(m.id, mix, bits, raw_bits, m.project, m.scope, m.session, m.kind, m.created))
    _pair(conn, plan, index, batch, raw, dim)
    return plan


def _pair(
    conn: sqlite3.Connection, plan: Plan, index: BitIndex | None, batch: Sequence[Stale], raw: dict[int, bytes],
    dim: int,
) -> None:
    plan.reembedded = [m.id for m in batch if m.had_vector]
    plan.recurrence.update(m.id for m in batch)
    if plan.reembedded:
        plan.old_pairs = [(r[0], r[1]) for r in conn.execute(
            "SELECT a, b FROM memory_near WHERE a IN (SELECT value FROM json_each(?))", (json.dumps(plan.reembedded),))]
        plan.recurrence.update(b for _, b in plan.old_pairs)
    candidates: dict[int, list[int]] = {m.id: [] for m in batch}
    if index is not None:
        for project in dict.fromkeys(m.project for m in batch):
            mine = [m for m in batch if m.project == project]
            queries = [(index.words_of(sign_bits(np.frombuffer(raw[m.id], dtype="<f4"))[0]), m.id, m.session)
                       for m in mine]
            for m, found in zip(mine, index.near_candidates(queries, NEAR_CANDIDATES, project), strict=True):
                candidates[m.id] = found
    stored = _vectors(conn, plan.model, sorted({i for ids in candidates.values() for i in ids} - set(raw)))
    for m in batch:
        others = [o for o in batch if o.id != m.id and o.project == m.project
                  and (o.session is None or o.session != m.session)]
        ids = [i for i in candidates[m.id] if i in stored] + [o.id for o in others]
        if not ids:
            continue
        vectors = as_matrix([stored[i] if i in stored else raw[i] for i in ids], dim)
        cosines = vectors @ as_matrix([raw[m.id]], dim)[0]
        for other, cosine in zip(ids, cosines.tolist(), strict=True):
            if cosine >= RECURRENCE_MIN_COSINE:
                plan.pairs[(m.id, other)] = plan.pairs[(other, m.id)] = round(float(cosine), 4)
                plan.recurrence.add(other)


async def apply_plan(db: aiosqlite.Connection, plan: Plan) -> set[int]:
    """Write one planned batch inside the caller's transaction. The plan's memories deleted since it was read (a
    retention's GC) are left out, and returned: their rows would outlive them (a vector's foreign key refuses it,
    and with it the whole batch)."""
    ids = {r[0] for r in plan.rows} | plan.remixed.keys() | {i for pair in plan.pairs for i in pair}
    gone = {int(r[0]) for r in await db.execute_fetchall(
        "SELECT value FROM json_each(?) WHERE value NOT IN (SELECT id FROM memories)", (json.dumps(sorted(ids)),))}
    await db.executemany(
        "INSERT INTO memory_vectors (memory_id, model, content_hash, vec, mixed, bits, raw_bits) VALUES (?,?,?,?,?,?,?)"
        " ON CONFLICT(memory_id) DO UPDATE SET model = excluded.model, content_hash = excluded.content_hash,"
        " vec = excluded.vec, mixed = excluded.mixed, bits = excluded.bits, raw_bits = excluded.raw_bits",
        [(i, plan.model, h, raw, mix, bits, raw_bits) for i, h, raw, mix, bits, raw_bits in plan.rows
         if i not in gone])
    await db.executemany(
        "UPDATE memory_vectors SET mixed = ?, bits = ? WHERE memory_id = ? AND +model = ?",
        [(mix, bits, i, plan.model) for i, (mix, bits) in plan.remixed.items()])
    # Pairs are stored both ways round: a re-embedded memory's old pairs are (it, partner) and (partner, it).
    await db.executemany("DELETE FROM memory_near WHERE a = ? AND b = ?",
                         [pair for a, b in plan.old_pairs for pair in ((a, b), (b, a))])
    await db.executemany("INSERT OR REPLACE INTO memory_near (a, b, cosine) VALUES (?, ?, ?)",
                         [(a, b, c) for (a, b), c in plan.pairs.items() if a not in gone and b not in gone])
    return gone


async def update_recurrence(db: aiosqlite.Connection, ids: Sequence[int]) -> None:
    """Recount the distinct other sessions among these memories' pairs (after `apply_plan` committed)."""
    await db.execute(
        "UPDATE memory_vectors SET recurrence = (SELECT count(DISTINCT coalesce(m.session_id, '#' || m.id))"
        " FROM memory_near p JOIN memories m ON m.id = p.b WHERE p.a = memory_vectors.memory_id)"
        " WHERE memory_id IN (SELECT value FROM json_each(?))", (json.dumps(list(ids)),))


def load_index(conn: sqlite3.Connection, model: str, dim: int) -> BitIndex:
    """The in-memory index of every vector of `model`, read in one pass (blocking; off the loop)."""
    index = BitIndex(model, dim)
    rows: list[Any] = []
    for row in conn.execute(
        "SELECT v.memory_id, v.mixed, v.bits, v.raw_bits, m.project, m.scope, m.session_id, m.kind, m.created"
        " FROM memory_vectors v JOIN memories m ON m.id = v.memory_id WHERE v.model = ? AND v.mixed IS NOT NULL"
        " ORDER BY v.memory_id", (model,),
    ):
        rows.append(IndexRow(*row))
        if len(rows) == 10_000:
            index.upsert(rows)
            rows = []
    index.upsert(rows)
    return index
