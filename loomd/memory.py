"""Where this process's memory is: SQLite's allocations (its page caches, statements), malloc's heap (in use, and freed
but kept), Python's objects. For `status` and the soak bench, which must tell a cache filling up to its bound from
growth: the RSS alone says neither which part grew nor whether it stops.

Read through the C libraries the process has already loaded, so the numbers are the ones of the copy in use: the
SQLite the store's driver carries (a second copy would count only its own allocations), glibc's `mallinfo2`. Where
either cannot be found (another C library), its part is left out. `release_memory` hands the freed heap back, and
`limit_heaps` (the daemon, at start) keeps malloc from giving every thread a heap of its own. `freeze_startup` (the
daemon, once it serves) takes what startup made out of the cyclic collector's walks, and `CollectorPauses` times them.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from typing import Any

MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _store_sqlite() -> Any:
    """The SQLite the store runs on: the one built into sqlean.py's module (the only driver `connect_sync` opens),
    or None without it (then there is no store either)."""
    try:
        import sqlean._sqlite3 as driver  # type: ignore[import-untyped]

        lib = ctypes.CDLL(driver.__file__)  # already loaded: the same copy, with its counters
        lib.sqlite3_memory_used.restype = lib.sqlite3_memory_highwater.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.argtypes = [ctypes.c_int]
    except (ImportError, OSError, AttributeError):
        return None
    return lib


def _glibc(name: str) -> Any:
    try:  # glibc only (Linux); elsewhere there is nothing to read or trim
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc, or too old for `mallinfo2` (2.33)
        return None


_SQLITE = _store_sqlite()
_MALLINFO = _glibc("mallinfo2")
if _MALLINFO is not None:
    _MALLINFO.restype = _MallInfo2
_MALLOC_TRIM = _glibc("malloc_trim")
if _MALLOC_TRIM is not None:
    _MALLOC_TRIM.argtypes = [ctypes.c_size_t]
_MALLOPT = _glibc("mallopt")
if _MALLOPT is not None:
    _MALLOPT.argtypes = [ctypes.c_int, ctypes.c_int]
M_ARENA_MAX = -8  # malloc.h
_MALLOC_INFO, _MEMSTREAM, _FCLOSE, _FREE = (_glibc(n) for n in ("malloc_info", "open_memstream", "fclose", "free"))
if None not in (_MALLOC_INFO, _MEMSTREAM, _FCLOSE, _FREE):
    _MEMSTREAM.restype = ctypes.c_void_p
    _MEMSTREAM.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    _MALLOC_INFO.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _FCLOSE.argtypes = [ctypes.c_void_p]
    _FREE.argtypes = [ctypes.c_void_p]

# The heaps malloc spreads the daemon's threads over. glibc gives each thread that allocates a heap of its own, up to
# 8 a CPU, and each keeps its own freed bytes and high-water mark: the daemon's dozen threads (the store's connections,
# the log's syncs, the executors) made 10 heaps, and a fixed-size soak's RSS climbed +1.1 MB a minute, through its
# last third too (3 runs). With two, +0.5 to +0.7, level in the last third in two of three runs: the threads mostly
# take turns on the interpreter lock anyway, and the ingest bench's rate did not move (closing note, stop 38).
MALLOC_ARENAS = 2


def release_memory() -> None:
    """Hand freed heap back to the system: without a trim each thread's heap keeps its high-water mark (onnxruntime's
    run buffers, a parsed file and its pickled events) and the process's RSS stays there while it idles."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def limit_heaps(count: int = MALLOC_ARENAS) -> None:
    """At most `count` malloc heaps for this process: before its threads start (a thread keeps the heap it got)."""
    if _MALLOPT is not None:
        _MALLOPT(M_ARENA_MAX, count)


class CollectorPauses:
    """How long Python's cyclic collector held the interpreter lock, by generation (a collection, whichever thread's
    allocation set it off, stops every thread of the process: the event loop too): how many, the longest, the last
    full one. Read by `status` (`usage`), for the hooks and soak benches."""

    def __init__(self) -> None:
        self._began = 0.0
        self.count = [0, 0, 0]
        self.max_ms = [0.0, 0.0, 0.0]
        self.last_full_ms: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._began) * 1000
        generation = info["generation"]
        self.count[generation] += 1
        self.max_ms[generation] = max(self.max_ms[generation], ms)
        if generation == 2:
            self.last_full_ms = ms

    def summary(self) -> dict[str, Any]:
        return {"collections": list(self.count), "max_ms": [round(ms, 2) for ms in self.max_ms],
                "last_full_ms": None if self.last_full_ms is None else round(self.last_full_ms, 2),
                "frozen": gc.get_freeze_count()}


PAUSES: CollectorPauses | None = None  # this process's collections, timed from `freeze_startup` on


def freeze_startup() -> None:
    """Collect once, then move every object alive now out of the cyclic collector's sight (`gc.freeze`), and time the
    collections from then on (`PAUSES`: what runs before the daemon serves, nobody waits for): what startup
    made (modules, classes, compiled patterns, the services) lives as long as the process, yet each full collection
    walked it all again. In a catch-up (`bench/hooks.py --background-catchup`) a full collection held the daemon, event
    loop and all, 33-44 ms (3 in 8 minutes): a hook in flight waited for it, the slowest of its kind. With the 47,000
    objects of startup frozen: 5-11 ms (closing note, stop 41). Objects made later are collected as before; a frozen
    one freed by its reference count is freed as before (only a frozen cycle stays: startup's are collected first)."""
    global PAUSES
    gc.collect()
    gc.freeze()
    if PAUSES is None:
        PAUSES = CollectorPauses()
        gc.callbacks.append(PAUSES)


def _heaps() -> int | None:
    """How many malloc heaps the process has, from `malloc_info`'s report (XML, a `<heap nr=...>` each) in memory."""
    if None in (_MALLOC_INFO, _MEMSTREAM, _FCLOSE, _FREE):
        return None
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = _MEMSTREAM(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    try:
        _MALLOC_INFO(0, stream)
    finally:
        _FCLOSE(stream)  # sets buf and size
    try:
        return ctypes.string_at(buf, size.value).count(b"<heap nr=")
    finally:
        _FREE(buf)


def usage() -> dict[str, Any]:
    """By part, in MB: `sqlite_mb` (and its peak, `sqlite_peak_mb`), `malloc_used_mb` (every malloc'd byte in use,
    SQLite's and Python's large objects among them), `malloc_kept_mb` (freed but kept in the heap: what a trim could
    hand back), `malloc_heaps` (how many heaps malloc spread them over: `limit_heaps`); and `python_blocks` (Python's
    allocated objects, a count); once the collections are timed, `collector` (`CollectorPauses.summary`)."""
    out: dict[str, Any] = {"python_blocks": sys.getallocatedblocks()}
    if PAUSES is not None:
        out["collector"] = PAUSES.summary()
    if _SQLITE is not None:
        out["sqlite_mb"] = round(_SQLITE.sqlite3_memory_used() / MB, 2)
        out["sqlite_peak_mb"] = round(_SQLITE.sqlite3_memory_highwater(0) / MB, 2)
    if _MALLINFO is not None:
        info = _MALLINFO()
        out["malloc_used_mb"] = round((info.uordblks + info.hblkhd) / MB, 2)
        out["malloc_kept_mb"] = round(info.fordblks / MB, 2)
    heaps = _heaps()
    if heaps is not None:
        out["malloc_heaps"] = heaps
    return out
