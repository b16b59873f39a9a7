"""The one step vocabulary of every install and uninstall (agents and services alike): each step is readable as
shell (`--print`) and runnable, in order. A user file is backed up as `<name>.loomd-bak-<time>` before it changes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from loomd.errors import LoomdError

CLIENT_TIMEOUT_S = 120


class InstallError(LoomdError):
    code = "install"


class Step(Protocol):
    def script(self) -> str: ...
    def run(self) -> str: ...


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.loomd-tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)


@dataclass
class Write:
    path: Path
    data: bytes
    mode: int = 0o644
    backup: bool = False  # keep a differing file that is already there (`backup_path`)

    def script(self) -> str:
        body = self.data.decode().rstrip("\n")
        return f"mkdir -p {shlex.quote(str(self.path.parent))}\ncat > {shlex.quote(str(self.path))} <<'LOOMD_EOF'\n" \
               f"{body}\nLOOMD_EOF"

    def run(self) -> str:
        if self.path.exists() and self.path.read_bytes() == self.data:
            return f"unchanged {self.path}"
        saved = None
        if self.backup and self.path.exists():
            saved = backup_path(self.path)
            shutil.copy2(self.path, saved)
        _atomic_write(self.path, self.data, self.path.stat().st_mode & 0o777 if self.path.exists() else self.mode)
        return f"wrote {self.path}" + (f" (previous version saved as {saved.name})" if saved else "")


@dataclass
class Copy:
    source: Path
    path: Path
    mode: int

    def script(self) -> str:
        return f"install -D -m {self.mode:o} {shlex.quote(str(self.source))} {shlex.quote(str(self.path))}"

    def run(self) -> str:
        _atomic_write(self.path, self.source.read_bytes(), self.mode)
        return f"copied {self.source.name} to {self.path.parent}"


def backup_path(path: Path) -> Path:
    """Where a user file is copied before loomd (or a client CLI on loomd's behalf) changes it; never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.loomd-bak-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.loomd-bak-{stamp}-{n}")
        n += 1
    return target


@dataclass
class Backup:
    path: Path
    to: Path

    def script(self) -> str:
        return f"cp -p {shlex.quote(str(self.path))} {shlex.quote(str(self.to))}"

    def run(self) -> str:
        if not self.path.exists():
            return f"nothing to back up at {self.path}"
        data = self.path.read_bytes()
        older = sorted(self.path.parent.glob(f"{self.path.name}.loomd-bak-*"), key=lambda p: p.stat().st_mtime_ns)
        if older and older[-1].read_bytes() == data:
            return f"already backed up: {older[-1]}"  # a re-run does not pile up identical copies
        shutil.copy2(self.path, self.to)
        return f"saved {self.path} as {self.to}"


@dataclass
class MakeDirs:
    paths: tuple[Path, ...]

    def script(self) -> str:
        return "mkdir -p -m 700 " + " ".join(shlex.quote(str(d)) for d in self.paths)

    def run(self) -> str:
        for directory in self.paths:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        return "made " + ", ".join(str(d) for d in self.paths)


@dataclass
class Remove:
    path: Path

    def script(self) -> str:
        return f"rm -rf {shlex.quote(str(self.path))}"

    def run(self) -> str:
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path)
        elif self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        else:
            return f"nothing to remove at {self.path}"
        return f"removed {self.path}"


@dataclass
class Run:
    argv: list[str]
    env: Mapping[str, str] | None = None  # None: this process's environment
    may_fail: bool = False  # e.g. stopping something that is not running
    missing: str = ""  # what to say when the program is not on this machine

    def script(self) -> str:
        return shlex.join(self.argv) + (" || true" if self.may_fail else "")

    def run(self) -> str:
        try:
            done = subprocess.run(self.argv, env=None if self.env is None else dict(self.env), capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL, timeout=CLIENT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if self.may_fail:
                return f"skipped `{self.script()}`: {exc}"
            if isinstance(exc, FileNotFoundError) and self.missing:
                raise InstallError(f"`{self.argv[0]}` is not on this machine ({self.missing})") from exc
            raise InstallError(f"`{shlex.join(self.argv)}` failed: {exc}") from exc
        if done.returncode and not self.may_fail:
            detail = (done.stderr or done.stdout).strip()[-800:]
            raise InstallError(f"`{shlex.join(self.argv)}` exited {done.returncode}: {detail}")
        return f"ran `{shlex.join(self.argv)}`" + (f" (exit {done.returncode})" if done.returncode else "")


@dataclass
class Edit:
    """A change computed when it runs, because an earlier step (a client CLI) changes the same file."""

    path: Path
    change: Callable[[bytes], bytes | None]  # new content, or None to delete the file
    shell: str  # what a user would do instead, for --print

    def script(self) -> str:
        return self.shell

    def run(self) -> str:
        if not self.path.exists():
            return f"nothing to tidy at {self.path}"
        new = self.change(self.path.read_bytes())
        if new is None:
            self.path.unlink()
            return f"removed {self.path}"
        if new == self.path.read_bytes():
            return f"unchanged {self.path}"
        _atomic_write(self.path, new, self.path.stat().st_mode & 0o777)
        return f"tidied {self.path}"


@dataclass
class Actions:
    """What `loom install|uninstall <target>` does, in order."""

    title: str
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def script(self) -> str:
        lines = [f"# {self.title}", *(f"# {n}" for n in self.notes), *(s.script() for s in self.steps)]
        return "\n".join(lines) + "\n"

    def apply(self) -> list[str]:
        return [step.run() for step in self.steps] + [f"note: {n}" for n in self.notes]
