"""What loomd trusts on disk (loomd/trust.py), at the daemon's start: a folder or file of its own that another user
placed or may change (a shared or loose LOOMD_HOME, a symlink, another owner) and a home it cannot write stop it
with exit 3 and one line saying what and how to fix it, never a traceback; the fix line it gives works. The attacker
is a real second uid (`nobody`), planting what it can in a home made writable for it."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, drop_dac_capabilities

from loomd.client import Client
from loomd.config import load_config
from loomd.installer.doctor import run_checks

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
NOBODY = pwd.getpwnam("nobody")


def as_nobody(action: Callable[[], None]) -> None:
    """Run `action` in a forked child that became `nobody`, as another local user would."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's action failed"


def attempt(home: Path, preexec_fn: Callable[[], None] | None = None) -> tuple[int, str]:
    """Start `python -m loomd serve`: (its exit status, its stderr) if it stops by itself, else (0, "") once it
    answers (it is then stopped with SIGTERM)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_")}
    env.update(LOOMD_HOME=str(home), LOOMD_EMBEDDER="none", LOOMD_CODEX_HOME=str(home.parent / "codex-none"))
    proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)  # noqa: PLW1509
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                assert proc.stderr is not None
                return proc.returncode, proc.stderr.read()
            try:
                with Client(home / "loomd.sock", timeout=2) as client:
                    client.call("ping")
                proc.terminate()
                assert proc.wait(30) == 0
                return 0, ""
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        raise TimeoutError("the daemon neither started nor stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def refusal(code: int, stderr: str) -> tuple[str, str]:
    """(what is wrong, the fix line) of a refused start: exit 3, one message line, no traceback."""
    assert code == 3, (code, stderr)
    assert "Traceback" not in stderr, stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("loomd: ")]  # the rest is the log's copy
    assert "; fix: " in line, line
    detail, fix = line.removeprefix("loomd: ").split("; fix: ", 1)
    return detail, fix


def apply(fix: str) -> None:
    """Run a fix line as the user would (we are root already: `sudo` is dropped, it is not installed here)."""
    command = fix.split("  #", 1)[0].removeprefix("sudo ")
    subprocess.run(["sh", "-c", command], check=True, timeout=30)


def test_a_home_another_user_shares_is_refused_and_each_fix_line_works(home: Path, tmp_path: Path) -> None:
    """A LOOMD_HOME others may write used to start fine, and `nobody` could swap the socket and the spool folder
    for symlinks of its own. Now each such thing refuses the start (exit 3) until the user applies the fix line it
    names (doctor gives the same one); the symlinked spool folder's target is never used or chmodded."""
    os.chmod(home, 0o777)  # a shared or carelessly made home
    victim = tmp_path / "victim-dir"  # a folder of the user's that a followed symlink would hand to loomd
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)

    def plant() -> None:
        os.symlink(victim, home / "spool")
        os.symlink("/tmp/attacker-listens-here.sock", home / "loomd.sock")

    as_nobody(plant)
    env = {"LOOMD_HOME": str(home)}
    doctor = {f.name: f for f in run_checks(load_config(env), env)}
    problems = []
    for _ in range(5):
        code, stderr = attempt(home)
        if code == 0:
            break
        detail, fix = refusal(code, stderr)
        problems.append(detail)
        if len(problems) == 1:  # doctor names the same problem with the same fix
            assert doctor["permissions"].status == "FAIL" and doctor["permissions"].fix == fix
        apply(fix)
    else:
        raise AssertionError(f"still refused after: {problems}")
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"{home} is mode 777: other users can write to it"), problems
    assert problems[1].startswith(f"{home / 'spool'} is a symlink (to {victim})"), problems
    assert problems[2].startswith(f"{home / 'loomd.sock'} is a symlink"), problems
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and list(victim.iterdir()) == []
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and (home / "spool").is_dir()


def test_another_users_spool_folder_is_refused_and_the_chown_fix_works(home: Path) -> None:
    """A spool folder of another owner (made by a hook run under sudo, for a user daemon) crashed the start with
    a traceback and exit 1, which systemd retried every 2 s. Now: exit 3, the owner named, and the fix works."""
    spool = home / "spool"
    spool.mkdir(mode=0o700)
    os.chown(spool, NOBODY.pw_uid, NOBODY.pw_gid)
    detail, fix = refusal(*attempt(home))
    assert f"belongs to nobody (uid {NOBODY.pw_uid})" in detail and fix.startswith("sudo chown -R root ")
    apply(fix)
    assert attempt(home) == (0, "")
    assert spool.stat().st_uid == 0


def test_an_unwritable_home_exits_3_with_a_message(home: Path) -> None:
    """A home the daemon may not write: a message naming it and exit 3, not a traceback and exit 1."""
    os.chmod(home, 0o500)
    detail, fix = refusal(*attempt(home, drop_dac_capabilities))  # root, but bound by file modes like a user
    assert f"cannot use {home}" in detail and "Permission denied" in detail, detail
    apply(fix)
    assert attempt(home, drop_dac_capabilities) == (0, "")


def test_the_systemd_unit_does_not_restart_a_refused_start() -> None:
    unit = (REPO / "systemd" / "loomd.service").read_text()
    assert "RestartPreventExitStatus=3" in unit.splitlines()
