"""Spool replay in a running daemon (loomd/ingest/spool.py): files the shim leaves while the daemon is away or busy are
ingested through the same idempotent path, corrupt ones are moved aside, and a file goes only after its commit.
The spool files are made by the real shim (a subprocess, daemon absent), then renamed into the live spool the way
the shim itself publishes them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import DaemonProcess, drop_dac_capabilities, serving
from secret_corpus import ANTHROPIC, GITHUB_PAT

from loomd.client import AsyncClient, Client
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.installer.doctor import run_checks

SHIM = Path(__file__).resolve().parents[1] / "shims" / "loom-hook"


def shim_spool(event: str, session_id: str, **more: object) -> bytes:
    """The exact bytes the shim spools for one hook event (it runs with no daemon, in a scratch LOOMD_HOME)."""
    with tempfile.TemporaryDirectory(prefix="ls", dir="/tmp") as scratch:
        payload = json.dumps({"session_id": session_id, "cwd": "/x", "hook_event_name": event, **more}).encode()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "LOOMD_HOME": scratch}
        done = subprocess.run([sys.executable, "-S", "-E", str(SHIM), "--agent", "claude", event], input=payload,
                              capture_output=True, env=env, timeout=30)
        assert (done.returncode, done.stdout) == (0, b"")
        [path] = Path(scratch, "spool").glob("*.msgpack")
        return path.read_bytes()


def publish(spool: Path, name: str, data: bytes) -> Path:
    """Write then rename, as the shim does: the watcher never sees a half-written file under its final name."""
    tmp = spool / f".tmp-{name}"
    tmp.write_bytes(data)
    final = spool / f"{name}.msgpack"
    tmp.rename(final)
    return final


async def until(predicate: object, within_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def kinds(client: AsyncClient, session_id: str) -> list[str]:
    return [e["kind"] for e in (await client.call("events", {"session_id": session_id, "limit": 50}))["events"]]


async def test_a_file_appearing_while_the_daemon_runs_is_ingested(
    daemon: Daemon, client: AsyncClient, home: Path
) -> None:
    spool = home / "spool"
    data = shim_spool("Stop", "sp-live", stop_hook_active=False, last_assistant_message="done")
    path = publish(spool, msgpack.unpackb(data)["eid"], data)
    await until(lambda: not path.exists())
    # the file is unlinked only after the commit, so the event is there the moment the file is gone
    assert await kinds(client, "sp-live") == ["Stop"]
    # the same event again (a shim that gave up waiting after the daemon had committed): stored once
    publish(spool, msgpack.unpackb(data)["eid"], data)
    await until(lambda: not path.exists())
    assert await kinds(client, "sp-live") == ["Stop"]
    assert daemon.spool is not None and daemon.spool.replayed == 2 and daemon.spool.moved_aside == 0


async def test_corrupt_files_are_moved_aside_and_the_rest_goes_on(
    daemon: Daemon, client: AsyncClient, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = home / "spool"
    good = shim_spool("SessionEnd", "sp-mixed", reason="other")
    bad = {
        "0-garbage": b"\xc1\xc1\xc1",
        "1-truncated": good[:-5],
        "2-not-a-map": msgpack.packb(["agent", "claude"]),
        "3-not-json": msgpack.packb({"agent": "claude", "event": "Stop", "raw": b"\xff not json", "eid": "e3"}),
    }
    half_written = spool / ".tmp-9-half"
    half_written.write_bytes(good[:10])  # a shim still writing: neither ingested nor moved
    for name, data in bad.items():
        publish(spool, name, data)
    publish(spool, "5-good", good)
    await until(lambda: not list(spool.glob("*.msgpack")))
    assert await kinds(client, "sp-mixed") == ["SessionEnd"]
    assert sorted(p.name for p in (spool / "rejected").iterdir()) == [f"{n}.msgpack" for n in sorted(bad)]
    assert half_written.exists()
    assert daemon.spool is not None and daemon.spool.moved_aside == len(bad)
    moved = [r.getMessage() for r in caplog.records if "moved corrupt spool file" in r.getMessage()]
    assert len(moved) == len(bad)


@pytest.fixture
def short_busy_timeout(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMD_BUSY_TIMEOUT_MS", "100")  # read when `daemon` starts, which comes after this


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=10, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
"""


@pytest.fixture
def locked_db(short_busy_timeout: None, daemon: Daemon, home: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the database's write lock (POSIX locks do not conflict inside one process): every
    commit of the daemon fails until it lets go."""
    proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(home / "loomd.db")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()


async def test_a_file_stays_until_its_event_is_committed(
    locked_db: subprocess.Popen[str], daemon: Daemon, client: AsyncClient, home: Path
) -> None:
    data = shim_spool("PreCompact", "sp-locked", trigger="auto", custom_instructions="")
    path = publish(home / "spool", "held", data)
    await asyncio.sleep(1.5)  # the watcher fired and the replay tried: the commit failed, the file stays
    assert path.exists()
    assert await kinds(client, "sp-locked") == []
    assert locked_db.stdin is not None
    locked_db.stdin.close()  # the other writer goes away; the next periodic retry gets through
    locked_db.wait(10)
    await until(lambda: not path.exists(), within_s=20)
    assert await kinds(client, "sp-locked") == ["PreCompact"]
    assert not (home / "spool" / "rejected").exists()


async def test_a_stuck_spool_is_a_doctor_fail(
    locked_db: subprocess.Popen[str], daemon: Daemon, client: AsyncClient, home: Path
) -> None:
    """A backlog that does not shrink while the daemon runs used to read "OK spool N waiting"."""
    path = publish(home / "spool", "stuck", shim_spool("PreCompact", "sp-stuck", trigger="auto"))
    await asyncio.sleep(1.5)  # a pass tried to commit it and paused
    ten_minutes_ago = time.time() - 600
    os.utime(path, (ten_minutes_ago, ten_minutes_ago))
    env = {**os.environ, "LOOMD_HOME": str(home)}
    found = {f.name: f for f in await asyncio.to_thread(run_checks, load_config(env), env)}
    finding = found["spool"]
    assert finding.status == "FAIL" and "stuck: 1 events wait" in finding.detail, finding
    assert "the oldest for 10 min" in finding.detail and "replay paused" in finding.detail, finding
    assert "systemctl --user restart loomd" in finding.fix or "launchctl kickstart" in finding.fix, finding
    spool_status = (await client.call("status"))["spool"]
    assert spool_status["oldest_waiting_s"] >= 600 and "replay paused" in spool_status["last_error"], spool_status


@pytest.fixture
def spool_before_start(home: Path) -> Iterator[list[Path]]:
    spool = home / "spool"
    spool.mkdir(mode=0o700)
    files = [publish(spool, f"boot-{i}", shim_spool("Stop", f"sp-boot-{i}")) for i in range(3)]
    yield files


async def test_the_spool_left_while_down_is_ingested_at_startup(
    spool_before_start: list[Path], daemon: Daemon, client: AsyncClient
) -> None:
    await until(lambda: not any(p.exists() for p in spool_before_start))
    for i in range(3):
        assert await kinds(client, f"sp-boot-{i}") == ["Stop"]


# ---------------------------------------------------------------- one file is never the whole spool's problem


NOBODY = 65534


def wait_until(what: str, check: Callable[[], bool], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def call(proc: DaemonProcess, op: str, **args: Any) -> Any:
    with Client(proc.sock, timeout=10) as c:
        return c.call(op, **args)


def stored_kinds(proc: DaemonProcess, session_id: str) -> list[str]:
    return [e["kind"] for e in call(proc, "events", session_id=session_id, limit=50)["events"]]


def quiet_daemon(daemon_process: Callable[..., DaemonProcess], home: Path,
                 preexec_fn: Callable[[], None] | None = None) -> DaemonProcess:
    env = {"LOOMD_EMBEDDER": "none", "LOOMD_CODEX_HOME": str(home / "codex")}
    return daemon_process(env, preexec_fn)  # type: ignore[no-any-return]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid and to drop the override of modes")
def test_unreadable_and_foreign_files_are_quarantined_and_the_spool_goes_on(
    daemon_process: Callable[..., DaemonProcess], home: Path
) -> None:
    """A file the daemon cannot read (a hook once run under sudo wrote it) used to kill the watcher for good, also
    across restarts. Now it, and whatever is not a regular file of the daemon's user, is moved into quarantine/ as it
    is (never read, never followed), counted in `status`, and every other file goes in, then and later."""
    spool = home / "spool"
    spool.mkdir(mode=0o700)
    elsewhere = home / "elsewhere.msgpack"  # a valid event outside the spool: following the link would ingest it
    elsewhere.write_bytes(shim_spool("Stop", "sp-q-link"))
    unreadable = publish(spool, "0-unreadable", shim_spool("Stop", "sp-q-unreadable"))
    os.chmod(unreadable, 0)
    foreign = publish(spool, "0-foreign", shim_spool("Stop", "sp-q-foreign"))
    os.chown(foreign, NOBODY, NOBODY)  # readable by its owner only: the daemon's user cannot open it
    foreign_bytes = foreign.read_bytes()
    (spool / "0-link.msgpack").symlink_to(elsewhere)
    (spool / "0-folder.msgpack").mkdir()
    good = [publish(spool, f"{i}-good", shim_spool("Stop", f"sp-q-{i}")) for i in (1, 2)]
    # root, without its override of file modes: it meets the 0000 and the other user's 0600 file as a user would
    proc = quiet_daemon(daemon_process, home, drop_dac_capabilities).start()
    wait_until("the good files", lambda: not any(p.exists() for p in good))
    late = publish(spool, "9-late", shim_spool("Stop", "sp-q-9"))
    wait_until("a file published later", lambda: not late.exists())
    for session in ("sp-q-1", "sp-q-2", "sp-q-9"):
        assert stored_kinds(proc, session) == ["Stop"]
    for session in ("sp-q-link", "sp-q-unreadable", "sp-q-foreign"):
        assert stored_kinds(proc, session) == []
    status = call(proc, "status")
    assert status["spool"]["quarantined"] == 4 and status["spool"]["backlog"] == 0, status["spool"]
    assert status["tasks"]["spool"]["state"] == "running" and status["tasks"]["spool"]["failures"] == 0
    quarantine = spool / "quarantine"
    assert sorted(p.name for p in quarantine.iterdir()) == sorted(
        ["0-unreadable.msgpack", "0-foreign.msgpack", "0-link.msgpack", "0-folder.msgpack"])
    assert (quarantine / "0-foreign.msgpack").read_bytes() == foreign_bytes  # moved as it is
    assert (quarantine / "0-link.msgpack").is_symlink() and elsewhere.exists()
    assert "quarantined spool file 0-foreign.msgpack" in proc.log.read_text()
    assert proc.stop() == 0


def open_connections(sock: Path, pid: int, limit: int) -> list[socket.socket]:
    """Idle clients until the daemon holds `limit` descriptors (then a few more, waiting in the listen backlog)."""
    clients: list[socket.socket] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (open_fds(pid) < limit or len(clients) < limit + 8):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(0.5)
        try:
            client.connect(str(sock))
        except OSError:  # the backlog is full (EAGAIN): let the daemon accept what waits
            client.close()
            time.sleep(0.05)
            if open_fds(pid) >= limit:
                break
            continue
        clients.append(client)
    return clients


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the daemon's descriptors in /proc")
def test_the_spool_survives_running_out_of_file_descriptors(
    daemon_process: Callable[..., DaemonProcess], home: Path
) -> None:
    """Idle connections up to the descriptor limit made `iterdir` fail with EMFILE, which killed the watcher: no
    spooled event was ingested again. Now the pass waits for the next tick and the file goes in once there is room."""
    limit = 256

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = quiet_daemon(daemon_process, home, low_fd_limit).start()
    assert proc.proc is not None
    pid = proc.proc.pid
    spool = home / "spool"
    clients: list[socket.socket] = []
    try:
        clients = open_connections(proc.sock, pid, limit)
        wait_until("the daemon at its descriptor limit", lambda: open_fds(pid) >= limit - 1)
        path = publish(spool, "emfile", shim_spool("Stop", "sp-emfile"))
        wait_until("the watcher meeting EMFILE",
                   lambda: re.search(r"spool.*Too many open files", proc.log.read_text()) is not None, 20)
        assert path.exists()
    finally:
        for client in clients:
            client.close()
    wait_until("the file ingested once descriptors are free", lambda: not path.exists(), 30)
    assert stored_kinds(proc, "sp-emfile") == ["Stop"]
    task = call(proc, "status")["tasks"]["spool"]
    assert task["state"] == "running" and task["failures"] == 0, task
    assert proc.stop() == 0


async def test_temp_files_left_by_a_killed_shim_are_reaped_redacted(home: Path, sock_path: Path) -> None:
    """A shim killed between writing `.tmp-<eid>` and renaming it left the agent's raw bytes (secrets included)
    there for good. Now one older than a minute is ingested (redacted, like any event) if complete, else kept
    redacted in rejected/; a young one may still be a live shim's and is left alone; `status` counts them."""
    spool = home / "spool"
    spool.mkdir(mode=0o700)
    complete = shim_spool("UserPromptSubmit", "sp-orphan", prompt=f"deploy with {GITHUB_PAT}")
    eid = msgpack.unpackb(complete)["eid"]
    cut = shim_spool("UserPromptSubmit", "sp-orphan-cut", prompt=f"and the key {ANTHROPIC} too")
    cut_eid = msgpack.unpackb(cut)["eid"]
    orphans = [spool / f".tmp-{eid}", spool / f".tmp-{cut_eid}"]
    orphans[0].write_bytes(complete)
    orphans[1].write_bytes(cut[:-6])  # killed mid-write: the map is incomplete
    young = spool / ".tmp-0000000000000000-00000001-00000001"
    young.write_bytes(cut[:-6])
    two_minutes_ago = time.time() - 120
    for path in orphans:
        os.utime(path, (two_minutes_ago, two_minutes_ago))
    async with serving(sock_path) as daemon:
        await until(lambda: not any(p.exists() for p in orphans))
        async with AsyncClient(sock_path) as client:
            assert await kinds(client, "sp-orphan") == ["UserPromptSubmit"]
            assert await kinds(client, "sp-orphan-cut") == []
            spool_status = (await client.call("status"))["spool"]
        assert spool_status["temp_reaped"] == 2 and spool_status["rejected"] == 1, spool_status
        assert daemon.spool is not None
    kept = spool / "rejected" / f"{cut_eid}.msgpack"
    assert kept.exists() and ANTHROPIC.encode() not in kept.read_bytes()
    assert young.exists()
    stored = b"".join(p.read_bytes() for p in home.glob("loomd.db*"))  # noqa: ASYNC240 - the daemon has stopped
    assert GITHUB_PAT.encode() not in stored and ANTHROPIC.encode() not in stored
