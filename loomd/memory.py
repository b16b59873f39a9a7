"""Where this process's memory is: SQLite's allocations (its page caches, statements), malloc's heap (in use, and freed
but kept), Python's objects. For `status` and the soak bench, which must tell a cache filling up to its bound from
growth: the RSS alone says neither which part grew nor whether it stops.

Read through the C libraries the process has already loaded, so the numbers are the ones of the copy in use: the
SQLite the store's driver carries (a second copy would count only its own allocations), glibc's `mallinfo2`. Where
either cannot be found (another C library), its part is left out.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _loaded_sqlite() -> Any:
    """The SQLite the store runs on: the one built into sqlean.py's module (the store's driver, loomd/store/db.py),
    else the library the standard `_sqlite3` linked (Linux: named in /proc/self/maps); None if neither is found."""
    try:
        import sqlean._sqlite3 as driver  # type: ignore[import-untyped]

        path: str | None = driver.__file__
    except ImportError:
        import sqlite3  # noqa: F401 - maps the library before the lookup

        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
        paths = {p for line in maps.splitlines() if "libsqlite3" in line and (p := line.split()[-1]).startswith("/")}
        path = paths.pop() if len(paths) == 1 else None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same copy, with its counters
        lib.sqlite3_memory_used.restype = lib.sqlite3_memory_highwater.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


def _mallinfo() -> Any:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_SQLITE = _loaded_sqlite() if sys.platform.startswith("linux") else None
_MALLINFO = _mallinfo() if sys.platform.startswith("linux") else None


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
