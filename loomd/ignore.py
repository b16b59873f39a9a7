"""Projects the user keeps out of memory or private (`loom project ignore|private|include`).

Ignored: project folders, one absolute path per line in `<data dir>/ignored-projects`. Nothing under such a folder is
stored: the hook shim reads the same file and stops at once (it keeps its own copy
of `covers`, since it may not import loomd), and the daemon drops any event from there that still arrives (from a
transcript, the spool, an older shim). The file is the user's own (0600), rewritten whole and atomically.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

FILE_NAME = "ignored-projects"
# Private: project keys, one per line in `<data dir>/private-projects`. Their memories are stored and used here, but
# nothing of them leaves the machine: no model request, no remote embedding of their text or of a query in them, no
# push to the team's shared server (loomd/team/).
PRIVATE_FILE = "private-projects"


def covers(roots: tuple[str, ...] | list[str], cwd: str | None) -> bool:
    """Whether `cwd` is one of the folders or inside one."""
    if not cwd or not roots:
        return False
    where = os.path.normpath(cwd)
    return any(where == root or where.startswith(root.rstrip("/") + "/") for root in roots)


def read_roots(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip().startswith("/")]


def read_keys(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def write_roots(path: Path, roots: list[str]) -> None:
    """Replace the list (temp file, fsync, rename), owner-only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, "".join(f"{root}\n" for root in dict.fromkeys(roots)).encode("utf-8", "surrogateescape"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class WatchedList:
    """One of these files as the daemon reads it: its lines (`read`), re-read only when the file changes (a stat per
    look)."""

    def __init__(self, path: Path, read: Callable[[Path], list[str]]) -> None:
        self.path, self.read = path, read
        self._seen: tuple[int, int] | None = None
        self._lines: tuple[str, ...] = ()

    def lines(self) -> tuple[str, ...]:
        try:
            st = self.path.stat()
            seen = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = (0, 0)
        if seen != self._seen:
            self._seen, self._lines = seen, tuple(self.read(self.path))
        return self._lines


class IgnoredProjects:
    """The ignored folders as the daemon reads them."""

    def __init__(self, path: Path) -> None:
        self.list = WatchedList(path, read_roots)

    def roots(self) -> tuple[str, ...]:
        """The folders, re-read if the file changed since the last look (a stat: once a batch, not an event)."""
        return self.list.lines()


class PrivateProjects:
    """The private keys as the daemon reads them."""

    def __init__(self, path: Path) -> None:
        self.list = WatchedList(path, read_keys)

    def __contains__(self, project: object) -> bool:
        return project in self.current()

    def current(self) -> frozenset[str]:
        """The keys, re-read if the file changed since the last look."""
        return frozenset(self.list.lines())
