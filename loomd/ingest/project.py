"""Project identity: the git repository (remote, else root commit; worktree-aware), else the directory."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

_GIT_TIMEOUT_S = 2.0
_cache: dict[str, str] = {}
# Project key -> the name of the folder it was last seen in: a repository without a remote is keyed by its root
# commit, which names nothing a person would recognise.
_folders: dict[str, str] = {}


def normalise_remote(url: str) -> str:
    """`git@github.com:org/repo.git` and `https://user@github.com/org/repo` name the same project."""
    url = url.strip()
    url = re.sub(r"^[a-z+]+://", "", url)
    url = re.sub(r"^[^@/]+@", "", url)  # user (and any password) before the host
    url = url.replace(":", "/", 1) if re.match(r"^[^/]+:[^/]", url) else url
    url = re.sub(r"\.git/?$", "", url).rstrip("/")
    return url.lower()


async def _git(cwd: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "git", "-C", cwd, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), _GIT_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return ""
    return out.decode(errors="replace").strip() if proc.returncode == 0 else ""


async def project_of(cwd: str | None) -> str:
    """A stable project key for a working directory; cached, since the hook path asks on every event."""
    if not cwd:
        return "unknown"
    if cwd in _cache:
        return _cache[cwd]
    key = f"dir:{os.path.normpath(cwd)}"  # noqa: ASYNC240 - pure string work
    common = ""
    if await asyncio.to_thread(os.path.isdir, cwd):
        try:
            # --git-common-dir makes every worktree of one repository resolve to the same project.
            common = await _git(cwd, "rev-parse", "--path-format=absolute", "--git-common-dir")
            if common:
                remote = await _git(cwd, "config", "--get", "remote.origin.url")
                if remote:
                    key = f"git:{normalise_remote(remote)}"
                else:
                    roots = (await _git(cwd, "rev-list", "--max-parents=0", "HEAD")).split()
                    key = f"git:{sorted(roots)[0][:16]}" if roots else f"dir:{Path(common).parent}"
        except OSError:
            pass  # no git binary: the directory is the identity
    _cache[cwd] = key
    _folders[key] = Path(common).parent.name if key.startswith("git:") and common else Path(cwd).name
    return key


def project_folder(key: str) -> str | None:
    """The folder name a project key was last resolved from in this process (None if never)."""
    return _folders.get(key)
