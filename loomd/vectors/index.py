"""Vector KNN: an in-memory index over the stored vectors; SQLite stays the truth.

`memory_vectors` (one row per memory) holds the model's raw vector (`vec`), the vector KNN searches (`mixed` =
normalise(raw + MIX_ALPHA x the raw vectors of up to MIX_WINDOW session neighbours on each side)), both vectors'
sign bits (`bits`, `raw_bits`) and `recurrence` (from `memory_near`, see backfill.py). This index keeps, per memory:
the sign bits of both vectors, the mixed vector in int8 (one scale per row), and the attributes search filters on
that never change (project, user scope, session, kind, time). A search masks by those, takes the PREFILTER nearest
by Hamming distance, re-ranks them with the int8 vectors, and the caller (`service.exact_rerank`) re-ranks the best
of those exactly in SQLite, with sqlite-vec's `vec_distance_cosine` over the float vectors, while it checks the
filters that can change (archived).

sqlite-vec's part is that exact re-rank, not the KNN. Why not a sqlite-vec `vec0` table: measured here at 100k
384-d rows, sqlite-vec 0.1.9's `bit[384]` KNN takes 17 ms for k=100 and 87 ms for k=400 (30-200 ms with a
partition key or metadata filters); a numpy popcount over the same 4.8 MB of bits takes 2 ms, any k, any filter.
Nor does sqlite-vec replace the int8 step: one `vec_distance_cosine` query over all PREFILTER candidates (which would
let this index drop its int8 copy) took 5.5 ms p50 at 9.4k memories and 7.2 ms at 94k, against 1-2 ms for the int8
re-rank plus the SQL re-rank of its best 2k. Memory: 48 + 48 + 384 + 30 bytes a memory (41 MB at 100k).

The stored vectors are float32 little-endian blobs and the bits are `vec_quantize_binary` of them, so a script can
run vector SQL on the database with sqlite-vec loaded (loomd's `connect_sync` loads it; with another driver:
`conn.enable_load_extension(True); sqlite_vec.load(conn)`), the query embedded by the same model:

    from loomd.store.db import connect_sync
    from loomd.vectors.embed import LocalEmbedder
    conn = connect_sync(path_to_loomd_db)
    query = LocalEmbedder().embed(["where does the cache live"])[0]  # or vec_f32('[0.01, ...]') in SQL
    conn.execute("SELECT m.id, 1 - vec_distance_cosine(v.mixed, ?) AS cosine, m.text FROM memory_vectors v"
                 " JOIN memories m ON m.id = v.memory_id ORDER BY cosine DESC LIMIT 10", (query,)).fetchall()

(`vec` is the memory's own vector, `mixed` the one search ranks by; a full scan like this one is exact and takes
tens of milliseconds per 10k memories, fine for a script, not for the daemon's per-prompt search.)
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# How many 1-bit candidates get a vector re-rank: measured on MiniLM vectors, the top 1000 by Hamming distance
# hold 99% of the exact top 100 among 19k vectors.
PREFILTER = 1000


def sign_bits(matrix: np.ndarray) -> list[bytes]:
    """One bit per dimension (set when > 0, least significant bit first), as sqlite-vec's vec_quantize_binary."""
    packed = np.packbits(np.asarray(matrix) > 0, axis=-1, bitorder="little")
    return [row.tobytes() for row in np.atleast_2d(packed)]


def as_matrix(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Float32 blobs -> an (n, dim) array; a blob of another size is an error, never silently mixed in."""
    if not blobs:
        return np.zeros((0, dim), dtype=np.float32)
    joined = b"".join(blobs)
    if len(joined) != len(blobs) * dim * 4:
        raise ValueError(f"vectors of {sorted({len(b) // 4 for b in blobs})} dimensions, the index has {dim}")
    return np.frombuffer(joined, dtype="<f4").reshape(len(blobs), dim)


def session_code(session: str) -> int:
    """A session's number in the index: a stable 62-bit hash of its id, not an entry of `BitIndex._codes` (the index
    would keep one for every session it ever saw, the deleted ones' too). Non-negative: a memory without a session
    is a session of its own, `-1 - id`; two sessions share a number with odds of 2**-62."""
    return int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest(), "big") >> 2


class _Scratch(threading.local):
    """A search thread's reusable buffers for the ranking's two large temporaries (the bits XOR the query, the
    candidates' vectors as float32): fresh, each is a few hundred KB to MBs that glibc maps and the kernel faults in
    page by page on every query (allocations above the mmap threshold, vectors/embed.py), 0.3 ms a search at 10k."""

    # Candidate rows a float buffer keeps (6 MB at 384-d): a larger prefilter (a tuning) allocates as before.
    MAX_ROWS = 4 * PREFILTER

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, rows: int, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        """An uninitialised (rows, *shape) array of `dtype`, a view of this thread's buffer `name`."""
        buf = self.buffers.get(name)
        if buf is None or len(buf) < rows or buf.shape[1:] != shape or buf.dtype != dtype:
            buf = self.buffers[name] = np.empty((max(rows, len(buf) if buf is not None else 0) * 5 // 4 + 64, *shape),
                                                dtype=dtype)
        return buf[:rows]


_SCRATCH = _Scratch()


@dataclass(frozen=True)
class IndexRow:
    id: int
    mixed: bytes  # float32 blob
    bits: bytes
    raw_bits: bytes
    project: str
    scope: str
    session: str | None
    kind: str
    created: float


@dataclass(frozen=True)
class Filters:
    """What a search keeps; `project` also keeps user-scope memories (they follow the user everywhere)."""

    project: str | None = None
    scope: str | None = None
    kinds: tuple[str, ...] | None = None
    since: float | None = None
    until: float | None = None
    session: str | None = None
    include_archived: bool = False


class BitIndex:
    """One model's vectors in numpy arrays, for masked Hamming prefiltering and int8 re-ranking.

    Writers (the back-fill, after its commit) and readers (searches, in a worker thread) share it under a lock.
    """

    def __init__(self, model: str, dim: int) -> None:
        self.model = model
        self.dim = dim
        self.words = (dim + 63) // 64
        self._lock = threading.Lock()
        self._n = 0
        self._pos: dict[int, int] = {}
        self._codes: dict[str, int] = {}
        self._arrays: dict[str, np.ndarray] = {
            "id": np.zeros(0, np.int64), "bits": np.zeros((0, self.words), np.uint64),
            "raw": np.zeros((0, self.words), np.uint64), "vec": np.zeros((0, dim), np.int8),
            "scale": np.zeros(0, np.float32), "project": np.zeros(0, np.int32), "scope": np.zeros(0, np.int32),
            "session": np.zeros(0, np.int64), "kind": np.zeros(0, np.int32), "created": np.zeros(0, np.float64),
        }

    def __len__(self) -> int:
        return self._n

    def __contains__(self, memory_id: int) -> bool:
        return memory_id in self._pos

    def _code(self, name: str) -> int:
        return self._codes.setdefault(name, len(self._codes))

    def words_of(self, bits: bytes) -> np.ndarray:
        padded = bits.ljust(self.words * 8, b"\0")
        if len(padded) != self.words * 8:
            raise ValueError(f"{len(bits) * 8} bits do not fit a {self.dim}-d index")
        return np.frombuffer(padded, dtype=np.uint64)

    def query_words(self, vector: np.ndarray) -> np.ndarray:
        return self.words_of(sign_bits(vector)[0])

    def _quantise(self, mixed: bytes) -> tuple[np.ndarray, float]:
        vector = as_matrix([mixed], self.dim)[0]
        peak = float(np.abs(vector).max()) or 1.0
        return np.round(vector * (127.0 / peak)).astype(np.int8), peak / 127.0

    def _grow(self, need: int) -> None:
        size = max(need, 1024, int(len(self._arrays["id"]) * 1.5))
        for name, old in self._arrays.items():
            new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
            new[: self._n] = old[: self._n]
            self._arrays[name] = new

    def upsert(self, rows: Iterable[IndexRow]) -> None:
        with self._lock:
            a = self._arrays
            for row in rows:
                at = self._pos.get(row.id)
                if at is None:
                    if self._n == len(a["id"]):
                        self._grow(self._n + 1)
                        a = self._arrays
                    at = self._n
                    self._n += 1
                    self._pos[row.id] = at
                    a["id"][at] = row.id
                a["bits"][at] = self.words_of(row.bits)
                a["raw"][at] = self.words_of(row.raw_bits)
                a["vec"][at], a["scale"][at] = self._quantise(row.mixed)
                a["project"][at] = self._code("p:" + row.project)
                a["scope"][at] = self._code("s:" + row.scope)
                # A memory without a session is a session of its own (for recurrence).
                a["session"][at] = session_code(row.session) if row.session is not None else -1 - row.id
                a["kind"][at] = self._code("k:" + row.kind)
                a["created"][at] = row.created

    def remove(self, ids: Iterable[int]) -> None:
        """Drop these memories' rows (ids not indexed are ignored): the last row moves into each hole, so the
        arrays stay dense (a search scans live rows only) and the next upserts reuse the room."""
        with self._lock:
            a = self._arrays
            for memory_id in ids:
                at = self._pos.pop(memory_id, None)
                if at is None:
                    continue
                last = self._n - 1
                if at != last:
                    for column in a.values():
                        column[at] = column[last]
                    self._pos[int(a["id"][at])] = at
                self._n = last

    def set_mixed(self, updates: Iterable[tuple[int, bytes, bytes]]) -> None:
        """New mixed vectors (and their bits) for memories already indexed: their session neighbours changed."""
        with self._lock:
            a = self._arrays
            for memory_id, mixed, bits in updates:
                at = self._pos.get(memory_id)
                if at is not None:
                    a["bits"][at] = self.words_of(bits)
                    a["vec"][at], a["scale"][at] = self._quantise(mixed)

    def _mask(self, f: Filters) -> np.ndarray | None:
        a, n, codes = self._arrays, self._n, self._codes
        mask: np.ndarray | None = None

        def both(part: np.ndarray) -> None:
            nonlocal mask
            mask = part if mask is None else mask & part

        if f.project is not None:
            user = codes.get("s:user", -1)
            both((a["project"][:n] == codes.get("p:" + f.project, -1)) | (a["scope"][:n] == user))
        if f.scope is not None:
            both(a["scope"][:n] == codes.get("s:" + f.scope, -1))
        if f.kinds is not None:
            both(np.isin(a["kind"][:n], [codes[k] for k in ("k:" + x for x in f.kinds) if k in codes]))
        if f.session is not None:
            both(a["session"][:n] == session_code(f.session))
        if f.since is not None:
            both(a["created"][:n] >= f.since)
        if f.until is not None:
            both(a["created"][:n] <= f.until)
        return mask

    def search(
        self, vector: np.ndarray, filters: Filters, prefilter: int = PREFILTER, raw: bool = False,
    ) -> tuple[list[int], list[float], int]:
        """Candidates best first with their approximate cosines (int8; None-free), and how many rows qualified.

        With `raw` the ranking stops at Hamming distance over the raw vectors' bits (the caller re-ranks)."""
        query = self.query_words(vector)
        with self._lock:
            a, n = self._arrays, self._n
            mask = self._mask(filters)
            rows = np.flatnonzero(mask) if mask is not None else np.arange(n)
            eligible = len(rows)
            if eligible > prefilter:
                bits = a["raw"] if raw else a["bits"]
                # Every row qualifies (a store of one project): the index's own rows, not a copy of them.
                table = bits[:n] if eligible == n else bits[rows]
                xor = np.bitwise_xor(table, query, out=_SCRATCH.take("xor", len(table), table.shape[1:], np.uint64))
                distance = np.bitwise_count(xor).sum(axis=1, dtype=np.int32)
                rows = rows[np.argpartition(distance, prefilter)[:prefilter]]
            ids = a["id"][rows]
            if raw:
                return sorted(ids.tolist()), [], eligible
            if len(rows) <= _Scratch.MAX_ROWS:
                # `clip`: the rows are the index's own; "raise" would gather into a fresh buffer first.
                small = np.take(a["vec"], rows, axis=0, mode="clip",
                                out=_SCRATCH.take("int8", len(rows), (self.dim,), np.int8))
                floats = _SCRATCH.take("floats", len(rows), (self.dim,), np.float32)
                floats[...] = small  # int8 to float32: exact, as astype
            else:
                floats = a["vec"][rows].astype(np.float32)
            cosines = (floats @ vector) * a["scale"][rows]
        order = np.lexsort((ids, -cosines))
        return ids[order].tolist(), cosines[order].tolist(), eligible

    def near_candidates(
        self, queries: Sequence[tuple[np.ndarray, int, str | None]], k: int, project: str
    ) -> list[list[int]]:
        """Raw-vector neighbours by Hamming distance in `project` and another session (recurrence), for each query
        (raw bits as words, memory id, session). One pass over the project's rows serves the whole batch: a copy
        of the index per query made the back-fill's cost per memory grow with the store."""
        with self._lock:
            a, n = self._arrays, self._n
            if "p:" + project not in self._codes:
                return [[] for _ in queries]
            # Copies (fancy indexing): searches need not wait while the distances are computed.
            in_project = np.flatnonzero(a["project"][:n] == self._codes["p:" + project])
            ids, raw, sessions = a["id"][in_project], a["raw"][in_project], a["session"][in_project]
            owns = [session_code(session) if session is not None else -1 - memory_id
                    for _, memory_id, session in queries]
        out = []
        for (query, _, _), own in zip(queries, owns, strict=True):
            keep = sessions != own
            others = ids[keep]
            distance = np.bitwise_count(raw ^ query).sum(axis=1, dtype=np.int32)[keep]
            if len(others) > k:
                top = np.argpartition(distance, k)[:k]
                others, distance = others[top], distance[top]
            out.append(others[np.lexsort((others, distance))].tolist())
        return out
