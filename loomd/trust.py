"""What loomd trusts on disk: only what no other user could have placed or changed.

A folder or file of loomd's is trusted when it is what it claims to be (no symlink standing in for it, no file
where a folder belongs), belongs to the user running loomd, and no other user may write to it. The daemon refuses
to start over anything else (exit 3); `loom doctor` reports the same finding with the same fix line. The hook shim
repeats the socket and log checks in its own stdlib-only code.
"""

from __future__ import annotations

import os
import pwd
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path

from loomd.errors import LoomdError

OTHERS_WRITE = 0o022  # group- or world-writable: someone else could add, replace or remove what is inside
KINDS = {"directory": stat.S_ISDIR, "file": stat.S_ISREG, "socket": stat.S_ISSOCK}


class UntrustedPath(LoomdError):
    """A path of loomd's that another user could have placed or could change."""

    code = "untrusted_path"

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.detail}; fix: {problem.fix}")
        self.problem = problem


@dataclass(frozen=True)
class Problem:
    """Why a path is not trusted, and the shell line that makes it trusted (or lets loomd recreate it)."""

    path: Path
    detail: str
    fix: str


def user_name(uid: int | None = None) -> str:
    uid = os.geteuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def problem_with(path: Path, kind: str, *, forbidden_mode: int = OTHERS_WRITE) -> Problem | None:
    """What is wrong with `path` as loomd's own `kind` ("directory", "file", "socket"); None if trusted or absent.

    `forbidden_mode` are the permission bits others must not have: write by default (what the daemon refuses),
    0o077 for doctor's stricter "yours alone" check.
    """
    quoted = shlex.quote(str(path))
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        return Problem(path, f"{path} is a symlink (to {target}); loomd never follows one for its own {kind}",
                       f"rm {quoted}  # only the link; loomd creates a real {kind}")
    if not KINDS[kind](st.st_mode):
        return Problem(path, f"{path} is not a {kind}",
                       f"mv {quoted} {shlex.quote(str(path) + '.not-loomd')}  # out of the way; loomd recreates it")
    me = os.geteuid()
    if st.st_uid != me:
        recursive = "-R " if kind == "directory" else ""
        return Problem(path, f"{path} belongs to {user_name(st.st_uid)} (uid {st.st_uid}), not to {user_name(me)} "
                             f"(uid {me}): another user placed or can change it",
                       f"sudo chown {recursive}{shlex.quote(user_name(me))} {quoted}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & forbidden_mode:
        want = 0o700 if kind == "directory" else 0o600
        reach = "write to" if mode & forbidden_mode & OTHERS_WRITE else "reach"
        return Problem(path, f"{path} is mode {mode:o}: other users can {reach} it (want {want:o})",
                       f"chmod {want:o} {quoted}")
    return None


def require_trusted(path: Path, kind: str) -> None:
    """Raise UntrustedPath if `path` exists and is not trusted as loomd's own `kind`."""
    problem = problem_with(path, kind)
    if problem is not None:
        raise UntrustedPath(problem)


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) 0700, or check the existing one; never follows a symlink at `path`.

    Raises UntrustedPath for a folder another user placed or may write to, OSError when it cannot be created.
    """
    require_trusted(path, "directory")
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        require_trusted(path, "directory")  # lost a race with another creator: check what is there now
