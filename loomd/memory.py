"""Where this process's memory is: SQLite's allocations (its page caches, statements), malloc's heap (in use, and freed
but kept), Python's objects. For `status` and the soak bench, which must tell a cache filling up to its bound from
growth: the RSS alone says neither which part grew nor whether it stops.

Read through the C libraries the process has already loaded, so the numbers are the ones of the copy in use: the
SQLite the store's driver carries (a second copy would count only its own allocations), glibc's `mallinfo2`. Where
either cannot be found (another C library), its part is left out. `release_memory` hands the freed heap back.
"""

from __future__ import annotations

import ctypes
import sys
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


def release_memory() -> None:
    """Hand freed heap back to the system: without a trim each thread's heap keeps its high-water mark (onnxruntime's
    run buffers, a parsed file and its pickled events) and the process's RSS stays there while it idles."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def usage() -> dict[str, float]:
    """By part, in MB: `sqlite_mb` (and its peak, `sqlite_peak_mb`), `malloc_used_mb` (every malloc'd byte in use,
    SQLite's and Python's large objects among them), `malloc_kept_mb` (freed but kept in the heap: what a trim could
    hand back); and `python_blocks` (Python's allocated objects, a count)."""
    out: dict[str, float] = {"python_blocks": sys.getallocatedblocks()}
    if _SQLITE is not None:
        out["sqlite_mb"] = round(_SQLITE.sqlite3_memory_used() / MB, 2)
        out["sqlite_peak_mb"] = round(_SQLITE.sqlite3_memory_highwater(0) / MB, 2)
    if _MALLINFO is not None:
        info = _MALLINFO()
        out["malloc_used_mb"] = round((info.uordblks + info.hblkhd) / MB, 2)
        out["malloc_kept_mb"] = round(info.fordblks / MB, 2)
    return out
