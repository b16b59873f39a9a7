"""Issue #15, the daemon/ingest half: one test per defect, each on a real daemon fed by the real shim.

4  repeated prompts are kept (dedup by identity: a hook copy pairs with its transcript copy);
5  a payload of 200k keys is cut to a bounded row with a visible marker, parsed off the loop;
6  a full disk (a real tmpfs) loses no event silently: counted, shown by `status` and `loom doctor`;
8  a database of a newer schema is refused (exit 3), never written;
10 an invalid UTF-8 byte keeps the event; a long list keeps a marker item; a damaged FTS index is rebuilt (at
   start and by `loom doctor --repair`) instead of stopping the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlean
from conftest import REPO, DaemonProcess, query, serving
from test_tailer import caught_up, wait_until

from loomd.client import AsyncClient, Client, RemoteError
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.store.db import open_checked

SHIM = REPO / "shims" / "loom-hook"
CWD = "/tmp/loomd-hardening-test"


def shim_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LOOMD_HOME": str(home)}


async def shim(home: Path, event: str, body: dict[str, Any] | bytes) -> None:
    """Run the real shim as Claude Code does (payload on stdin), off the loop the in-process daemon serves on."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-S", "-E", str(SHIM), "claude", event], input=raw, env=shim_env(home),
        capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def transcript_lines(sid: str, times: list[float]) -> bytes:
    """Claude transcript lines: per turn a "continue" prompt, a tool call and its result, at the given times."""
    out = []
    for i, ts in enumerate(times):
        out.append({"type": "user", "sessionId": sid, "uuid": f"u{i}", "timestamp": iso(ts), "cwd": CWD,
                    "message": {"role": "user", "content": "continue"}})
        out.append({"type": "assistant", "sessionId": sid, "uuid": f"a{i}", "timestamp": iso(ts + 0.2), "cwd": CWD,
                    "message": {"id": f"m{i}", "role": "assistant", "content": [
                        {"type": "tool_use", "id": f"T{i}", "name": "Bash", "input": {"command": f"ls {i}"}}]}})
        out.append({"type": "user", "sessionId": sid, "uuid": f"r{i}", "timestamp": iso(ts + 0.4), "cwd": CWD,
                    "message": {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": f"T{i}", "content": f"file{i}"}]}})
    return b"".join(json.dumps(o).encode() + b"\n" for o in out)


async def hooks_of_a_turn(home: Path, sid: str, path: Path, i: int) -> None:
    base = {"session_id": sid, "transcript_path": str(path), "cwd": CWD}
    tool = {"tool_name": "Bash", "tool_input": {"command": f"ls {i}"}, "tool_use_id": f"T{i}"}
    await shim(home, "UserPromptSubmit", {**base, "hook_event_name": "UserPromptSubmit", "prompt": "continue"})
    await shim(home, "PreToolUse", {**base, "hook_event_name": "PreToolUse", **tool})
    await shim(home, "PostToolUse", {**base, "hook_event_name": "PostToolUse", **tool,
                                     "tool_response": {"stdout": f"file{i}"}})


# --- defect 4 -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["hooks_first", "transcript_first"])
async def test_repeated_prompts_are_all_kept(order: str, daemon: Daemon, home: Path, tmp_path: Path) -> None:
    """"continue" three times, tool calls between, from the shim and the transcript: 3 prompt events, not 1, not 6."""
    sid = f"repeat-{order}"
    path = tmp_path / f"{sid}.jsonl"
    path.write_bytes(b"")
    start = time.time()
    times = [start + 2 * i for i in range(3)]
    if order == "hooks_first":
        for i in range(3):
            await hooks_of_a_turn(home, sid, path, i)
        path.write_bytes(transcript_lines(sid, times))
    else:
        path.write_bytes(transcript_lines(sid, times))
        await shim(home, "SessionStart", {"session_id": sid, "transcript_path": str(path), "cwd": CWD,
                                          "hook_event_name": "SessionStart", "source": "startup"})
        await wait_until(caught_up(daemon, path), "the transcript")
        for i in range(3):
            await hooks_of_a_turn(home, sid, path, i)
    await wait_until(caught_up(daemon, path), "the transcript")
    async with AsyncClient(home / "loomd.sock") as client:
        await client.call("stats")  # answered after the commits of the hooks answered before it
    prompts = query(home, "SELECT source, dedup FROM events WHERE session_id = ? AND kind IN"
                          " ('UserPromptSubmit', 'user_message') ORDER BY id", (sid,))
    assert len(prompts) == 3, prompts
    # Every hook copy found its transcript copy: three pairs, each stored once.
    assert all(dedup.endswith(":both") for _source, dedup in prompts), prompts
    tools = query(home, "SELECT dedup, count(*) FROM events WHERE session_id = ? AND (dedup LIKE 'tu:%' OR"
                        " dedup LIKE 'tr:%') GROUP BY dedup", (sid,))
    assert sorted(tools) == sorted([(f"{p}:T{i}", 1) for i in range(3) for p in ("tu", "tr")])


# --- defect 5 -----------------------------------------------------------------------------------------------------


async def stored_payload(client: AsyncClient, home: Path, sid: str, within: float = 60.0) -> dict[str, Any]:
    """The stored payload of the session's one event, once it is there (the shim may have spooled it)."""
    await wait_until(lambda: bool(query(home, "SELECT 1 FROM events WHERE session_id = ?", (sid,))),
                     f"the event of {sid}", within)
    ((payload,),) = query(home, "SELECT payload FROM events WHERE session_id = ?", (sid,))
    return json.loads(payload)


async def test_a_sessions_row_holds_what_its_events_of_one_commit_left_there_in_turn(client: AsyncClient,
                                                                                      home: Path) -> None:
    """One batch is one commit, which upserts a session's row once: with what its events, one by one, would have
    left there. The project is the first known one, the folder the first given, the transcript the last named, the
    start the first event's time, last seen the latest, the end the last SessionEnd's."""
    def event(n: int, kind: str, ts: float, **extra: Any) -> dict[str, Any]:
        return {"agent": "claude", "session_id": "merged", "kind": kind, "payload": {"text": f"step {n}"}, "ts": ts,
                "source": "transcript", "key": f"t:merged:{n}", **extra}

    batch = [event(1, "user_message", 1_700_000_010.0),  # no folder yet: project 'unknown'
             event(2, "assistant_message", 1_700_000_030.0, cwd="/w/first", project="dir:/w/first",
                   transcript_path="/t/a.jsonl"),
             event(3, "SessionEnd", 1_700_000_020.0, cwd="/w/second", project="dir:/w/second"),
             event(4, "user_message", 1_700_000_025.0, transcript_path="/t/b.jsonl"),
             event(5, "assistant_message", 1_700_000_040.0)]
    assert (await client.call("ingest", events=batch))["stored"] == 5
    row = query(home, "SELECT agent, project, cwd, transcript_path, started, last_seen, ended FROM sessions"
                      " WHERE id = 'merged'")
    assert row == [("claude", "dir:/w/first", "/w/first", "/t/b.jsonl", 1_700_000_010.0, 1_700_000_040.0,
                    1_700_000_020.0)]
    await client.call("ingest", events=[event(6, "user_message", 1_700_000_035.0, cwd="/w/third",
                                              project="dir:/w/third", transcript_path=None)])
    row = query(home, "SELECT project, cwd, transcript_path, last_seen, ended FROM sessions WHERE id = 'merged'")
    assert row == [("dir:/w/first", "/w/first", "/t/b.jsonl", 1_700_000_040.0, 1_700_000_020.0)]


async def test_a_payload_of_200k_keys_is_cut_with_a_marker(client: AsyncClient, home: Path) -> None:
    keys = 200_000
    body = {"session_id": "hostile", "cwd": CWD, "hook_event_name": "PostToolUse", "tool_name": "Bash",
            "tool_use_id": "toolu_h", "tool_input": {f"key{i:07d}": f"v{i}" for i in range(keys)},
            "tool_response": {"stdout": "ok"}}
    await shim(home, "PostToolUse", body)
    payload = await stored_payload(client, home, "hostile")
    tool_input = payload["tool_input"]
    marker = re.fullmatch(r"…\[truncated: (\d+) more keys\]", tool_input["…"])
    assert marker, tool_input.get("…")
    assert len(tool_input) - 1 + int(marker.group(1)) == keys  # kept + counted = all of them
    assert payload["tool_response"] == {"stdout": "ok"}  # the keys after it keep their share
    ((size,),) = query(home, "SELECT length(payload) FROM events WHERE session_id = 'hostile'")
    assert size < 1_500_000  # the row is bounded (it was the whole 4.9 MB)
    # It was parsed in the child process, not on the event loop.
    assert (await client.call("status"))["storage"]["parsed_in_child"] >= 1


async def test_normalised_events_are_cut_too_and_giant_msgpack_containers_refused(client: AsyncClient,
                                                                                   home: Path) -> None:
    """The `ingest` op's msgpack path: a map under the frame limit is cut like a hook payload; one over 20k
    entries is refused before it is built, with a clear error, and the daemon serves on."""
    wide = {f"k{i}": i for i in range(15_000)}
    reply = await client.call("ingest", item={"session_id": "wide", "kind": "note", "payload": {"wide": wide}})
    assert reply["stored"] == 1
    payload = await stored_payload(client, home, "wide", within=20.0)
    assert payload["wide"]["…"] == f"…[truncated: {15_000 - (len(payload['wide']) - 1)} more keys]"
    with pytest.raises(RemoteError) as refused:
        await client.call("ingest", item={"session_id": "wider", "kind": "note",
                                          "payload": {f"k{i}": i for i in range(30_000)}})
    assert refused.value.code == "bad_request" and "exceeds max_map_len" in str(refused.value)
    assert (await client.call("ping"))["pong"]


# --- defect 10: bad UTF-8, long lists, a damaged full-text index ----------------------------------------------------


async def test_invalid_utf8_keeps_the_event_and_long_lists_say_what_was_cut(client: AsyncClient, home: Path) -> None:
    body = json.dumps({"session_id": "utf8", "cwd": CWD, "hook_event_name": "PostToolUse", "tool_name": "Glob",
                       "tool_use_id": "toolu_u", "tool_input": {"pattern": "**/*"},
                       "tool_response": {"files": [f"f{i}.py" for i in range(1500)], "stdout": "caf@ ok"}}).encode()
    raw = body.replace(b"caf@", b"caf\xe9")  # Latin-1 bytes in a tool's output: not UTF-8
    await shim(home, "PostToolUse", raw)
    payload = await stored_payload(client, home, "utf8", within=20.0)
    assert payload["tool_response"]["stdout"] == "caf\ufffd ok"
    files = payload["tool_response"]["files"]
    assert len(files) == 1001 and files[:2] == ["f0.py", "f1.py"]
    assert files[-1] == "…[truncated: 500 more items]"


def damage_fts(db: Path) -> None:
    conn = sqlean.connect(str(db), isolation_level=None)
    try:
        conn.execute("UPDATE memories_fts_data SET block = zeroblob(length(block)) WHERE id > 10")
    finally:
        conn.close()


def test_a_damaged_fts_index_is_rebuilt(home: Path, daemon_process: Any) -> None:
    from loomd.installer.doctor import run_checks

    first: DaemonProcess = daemon_process({"LOOMD_EMBEDDER": "none"}).start()
    with Client(first.sock, timeout=30) as c:
        for i in range(30):
            c.call("store", {"text": f"note {i}: the postgres migration needs a lock timeout", "project": "p"})
    assert first.stop() == 0
    db = home / "loomd.db"

    damage_fts(db)  # the daemon, finding it so at start, rebuilds it rather than refusing to start
    second: DaemonProcess = daemon_process({"LOOMD_EMBEDDER": "none"}).start()
    with Client(second.sock, timeout=30) as c:
        hits = c.call("search", {"query": "postgres lock timeout", "project": "p", "mode": "keyword", "limit": 50})
    assert hits["count"] == 30
    assert second.stop() == 0
    assert "rebuilding it from the tables" in second.log.read_text()

    damage_fts(db)  # and doctor names it, with the fix that works
    database = next(f for f in run_checks(load_config()) if f.name == "database")
    assert database.status == "FAIL" and "full-text index is damaged" in database.detail, database
    assert "loom doctor --repair" in database.fix
    findings = {f.name: f for f in run_checks(load_config(), repair=True)}
    assert findings["repair"].status == "OK" and "rebuilt memories_fts" in findings["repair"].detail
    assert findings["database"].status == "OK", findings["database"]


# --- defect 8 -----------------------------------------------------------------------------------------------------


def files_of(db: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.glob(db.name + "*")
            if p.stat().st_size}


def test_a_newer_schema_is_refused_and_left_unwritten(home: Path, daemon_process: Any) -> None:
    db = home / "loomd.db"
    open_checked(db).close()  # today's schema, then marked as a newer loomd's
    conn = sqlean.connect(str(db), isolation_level=None)
    conn.execute("PRAGMA user_version = 99")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = files_of(db)
    proc = daemon_process({"LOOMD_EMBEDDER": "none"}).start(wait=False)
    assert proc.proc.wait(30) == 3
    log = proc.log.read_text()
    assert "schema version 99, newer than this loomd knows" in log, log
    assert files_of(db) == before


# --- defect 6 -----------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(home: Path) -> Iterator[Path]:
    """LOOMD_HOME on a real 6 MB tmpfs (we run as root, as CI does), so the disk really fills up."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(home)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


def fill(path: Path) -> None:
    # Suppress outermost: closing the file flushes what the last write left in its buffer, and raises ENOSPC too.
    with contextlib.suppress(OSError), path.open("wb") as fh:
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()
            os.fsync(fh.fileno())


# A hook with context to read is committed by the writer's task, one without in its own (`EventWriter.enqueue`, `here`):
# both ways count what they could not store.
FULL_DISK_HOOKS: dict[str, Callable[[int], dict[str, Any]]] = {
    "UserPromptSubmit": lambda i: {"session_id": "full", "cwd": CWD, "hook_event_name": "UserPromptSubmit",
                                   "prompt": f"prompt {i} " + "x" * 15_000},
    "Stop": lambda i: {"session_id": "full", "cwd": CWD, "hook_event_name": "Stop",
                       "last_assistant_message": f"answer {i} " + "x" * 15_000},
}


@pytest.mark.parametrize("kind", list(FULL_DISK_HOOKS))
async def test_a_full_disk_loses_nothing_silently(tiny_disk: Path, monkeypatch: pytest.MonkeyPatch,
                                                  kind: str) -> None:
    from loomd.installer.doctor import run_checks

    monkeypatch.setenv("LOOMD_EMBEDDER", "none")
    home = tiny_disk
    async with serving(home / "loomd.sock"), AsyncClient(home / "loomd.sock") as client:
        fill(home / "filler")
        sent = 12
        for i in range(sent):
            await shim(home, kind, FULL_DISK_HOOKS[kind](i))
        status = (await client.call("status"))["storage"]
        stored = (await client.call("stats"))["counts"]["events"]
        # Every event not stored is counted (the shim's spool is on the same full disk: it could not save them).
        assert stored < sent
        assert status["commit_failed"] == sent - stored
        last = status["recent_errors"][-1]
        assert "full" in last["message"] and abs(last["time"] - time.time()) < 120
        assert status["free_bytes"] < 1_000_000
        shown = await asyncio.to_thread(subprocess.run, [str(Path(sys.executable).with_name("loom")), "status"],
                                        capture_output=True, text=True, timeout=60)
        assert f"{sent - stored} event(s) failed to commit" in shown.stdout, shown
        assert "database or disk is full" in shown.stdout
        storage = next(f for f in await asyncio.to_thread(run_checks, load_config()) if f.name == "storage")
        assert storage.status == "FAIL" and f"{sent - stored} event(s) could not be committed" in storage.detail
        assert "df -h" in storage.fix
        (home / "filler").unlink()
        await shim(home, "UserPromptSubmit", {"session_id": "full", "cwd": CWD, "hook_event_name":
                                              "UserPromptSubmit", "prompt": "after the disk has room again"})
        assert (await client.call("stats"))["counts"]["events"] == stored + 1
    shutil.rmtree(home / "spool", ignore_errors=True)
