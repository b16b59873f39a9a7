"""Spool replay in a running daemon (loomd/ingest/spool.py): files the shim leaves while the daemon is away or busy are
ingested through the same idempotent path, corrupt ones are moved aside, and a file goes only after its commit.
The spool files are made by the real shim (a subprocess, daemon absent), then renamed into the live spool the way
the shim itself publishes them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from loomd.client import AsyncClient
from loomd.daemon import Daemon

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
