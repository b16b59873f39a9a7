"""The daemon and its protocol, end to end over a real socket and a real database file."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import need_test_data, query
from test_workers import PROJECT as PROJECT_W
from test_workers import ev, ingest, loomd

from loomd import protocol
from loomd.client import AsyncClient, Client, RemoteError
from loomd.daemon import Daemon
from loomd.ingest.events import prompt_dedup
from loomd.ingest.writer import ALONE_AFTER_S
from loomd.memory import MALLOC_ARENAS


def hook_payload(session: str = "s1", event: str = "PostToolUse", **extra: object) -> bytes:
    body = {"session_id": session, "transcript_path": f"/tmp/{session}.jsonl", "cwd": "/tmp",
            "hook_event_name": event, **extra}
    return json.dumps(body).encode()


async def raw_exchange(sock_path: Path, data: bytes, *, read_timeout: float = 5.0) -> list[dict]:
    """Send raw bytes, then read every reply frame until the daemon closes or goes quiet."""
    reader, writer = await asyncio.open_unix_connection(str(sock_path))
    writer.write(data)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    replies = []
    try:
        while True:
            header = await asyncio.wait_for(reader.readexactly(4), read_timeout)
            (n,) = struct.unpack(">I", header)
            replies.append(msgpack.unpackb(await reader.readexactly(n), raw=False))
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        pass
    writer.close()
    return replies


async def test_every_op_round_trips(client: AsyncClient, home: Path) -> None:
    assert (await client.call("ping"))["pong"] is True
    ingest = await client.call("ingest", raw=hook_payload(event="UserPromptSubmit", prompt="hello"), event="")
    assert ingest == {"accepted": 1, "stored": 1, "ids": [1]}
    hook = await client.call("hook", agent="claude", event="Stop", raw=hook_payload(event="Stop"), eid="e1")
    assert hook == {"stored": 1, "stdout": ""}
    stored = await client.call("store", text="we use uv, never pip, for this repo", kind="constraint", cwd="/tmp",
                               tags=["tooling"])
    assert stored["created"] is True and stored["project"] == "dir:/tmp"
    again = await client.call("store", text="We use uv,  never pip, for this repo", kind="constraint", cwd="/tmp")
    assert again == {"id": stored["id"], "created": False, "project": "dir:/tmp"}
    found = await client.call("search", query="pip", cwd="/tmp", mode="keyword", explain=True)
    assert [r["id"] for r in found["results"]] == [stored["id"]]
    assert found["results"][0]["explain"]["fts"]["rank"] == 1
    detail = await client.call("detail", id=stored["id"])
    assert detail["memories"][0]["tags"] == ["tooling"] and detail["memories"][0]["hits"] == 1
    assert (await client.call("forget", id=[stored["id"]]))["archived"] == 1
    assert (await client.call("search", query="pip", cwd="/tmp"))["results"] == []
    archived = await client.call("search", query="pip", cwd="/tmp", include_archived=True)
    assert archived["results"][0]["archived_at"] is not None
    assert (await client.call("detail", id=stored["id"]))["memories"][0]["archived_at"] is not None
    assert (await client.call("restore", id=stored["id"]))["restored"] == 1
    stats = await client.call("stats")
    assert stats["counts"]["events"] == 2 and stats["memories"]["constraint"] == {"active": 1, "archived": 0}
    status = await client.call("status")
    assert status["db"] == str(home / "loomd.db") and status["db_bytes"] > 0
    assert status["counts"] == {"events": 2, "sessions": 1, "memories": 1, "archived": 0}
    assert {"spool_backlog", "queue_depth", "uptime_s", "versions"} <= set(status)
    config = await client.call("config")
    assert config["max_frame_bytes"]["source"] == "default"
    events = await client.call("events", limit=5)
    assert [e["kind"] for e in events["events"]] == ["UserPromptSubmit", "Stop"]


@pytest.mark.parametrize(("op", "args", "code"), [
    ("nope", {}, "unknown_op"),
    ("store", {}, "bad_request"),
    ("store", {"text": 5}, "bad_request"),
    ("store", {"text": "x", "importance": "high"}, "bad_request"),
    ("store", {"text": "x", "kind": "gossip"}, "bad_request"),
    ("store", {"text": "x", "bogus": 1}, "bad_request"),
    ("search", {"query": "x", "limit": True}, "bad_request"),
    ("detail", {"id": "seven"}, "bad_request"),
    ("detail", {"id": 999}, "not_found"),
    ("forget", {"id": [999]}, "not_found"),
    ("ingest", {}, "bad_request"),
    ("ingest", {"raw": b"{not json"}, "bad_request"),
    ("ingest", {"raw": b"\xff\xfe"}, "bad_request"),
    ("ingest", {"raw": b"[1,2]"}, "bad_request"),
    ("ingest", {"raw": b'{"hook_event_name":"Stop"}'}, "bad_request"),
    ("ingest", {"events": [{"kind": "x"}]}, "bad_request"),
    ("ingest", {"events": [{"kind": "x", "session_id": 3}]}, "bad_request"),
    ("hook", {"raw": b"[" * 100000}, "bad_request"),
])
async def test_wrong_arguments_get_clear_errors(client: AsyncClient, op: str, args: dict, code: str) -> None:
    with pytest.raises(RemoteError) as err:
        await client.call(op, args)
    assert err.value.code == code and str(err.value)
    assert (await client.call("ping"))["pong"]


@pytest.mark.parametrize(("name", "data", "expect"), [
    ("garbage bytes", b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "bad_request"),
    ("truncated length", b"\x00\x00", "bad_frame"),
    ("truncated body", b"\x00\x00\x01\x00abc", "bad_frame"),
    ("non-map", protocol.HEADER.pack(3) + msgpack.packb([1, 2]), "bad_request"),
    ("oversize", protocol.HEADER.pack(64 * 1024 * 1024), "frame_too_large"),
    ("no op", protocol.encode_frame({"v": 1, "id": 7}), "bad_request"),
    ("wrong version", protocol.encode_frame({"v": 9, "id": 7, "op": "ping"}), "bad_version"),
    ("args not a map", protocol.encode_frame({"v": 1, "id": 7, "op": "ping", "args": [1]}), "bad_request"),
    ("id of wrong type", protocol.encode_frame({"v": 1, "id": [1], "op": "ping"}), "bad_request"),
    ("unknown op", protocol.encode_frame({"v": 1, "id": 7, "op": "drop_tables"}), "unknown_op"),
])
async def test_malformed_frames_never_hurt_the_daemon(
    daemon: Daemon, sock_path: Path, name: str, data: bytes, expect: str
) -> None:
    async with AsyncClient(sock_path) as other:  # an innocent client connected throughout
        replies = await raw_exchange(sock_path, data)
        assert replies, f"{name}: no reply"
        assert replies[0]["ok"] is False and replies[0]["error"]["code"] == expect, replies
        assert (await other.call("ping"))["pong"]
    async with AsyncClient(sock_path) as fresh:
        assert (await fresh.call("ping"))["pong"]


async def test_pipelined_requests_are_matched_by_id(daemon: Daemon, sock_path: Path) -> None:
    frames = b"".join(protocol.encode_frame({"v": 1, "id": i, "op": "ping"}) for i in range(20))
    replies = await raw_exchange(sock_path, frames, read_timeout=2)
    assert sorted(r["id"] for r in replies) == list(range(20))
    assert all(r["ok"] for r in replies)


async def test_fifty_concurrent_clients_lose_and_duplicate_nothing(client: AsyncClient, sock_path: Path) -> None:
    busy = 0

    async def send(c: AsyncClient, n: int, i: int) -> int:
        nonlocal busy
        while True:  # what the shim does on `busy` is spool; a script retries
            try:
                reply = await c.call("ingest", raw=hook_payload(f"s{n}", tool_use_id=f"t{n}-{i}", tool_name="Bash"),
                                     eid=f"c{n}-{i}")
                return int(reply["stored"])
            except RemoteError as exc:
                assert exc.code == "busy"
                busy += 1
                await asyncio.sleep(0.01)

    async def one_client(n: int) -> list[int]:
        async with AsyncClient(sock_path) as c:
            # Four in flight per connection: pipelined, as a batching script would send them.
            out: list[int] = []
            for start in range(0, 200, 4):
                out += await asyncio.gather(*(send(c, n, i) for i in range(start, start + 4)))
        return out

    results = await asyncio.gather(*(one_client(n) for n in range(50)))
    print(f"\n50 clients x 200 events: {sum(map(sum, results))} stored, {busy} busy replies retried")
    assert sum(map(sum, results)) == 50 * 200
    status = await client.call("status")
    assert status["counts"]["events"] == 10_000 and status["counts"]["sessions"] == 50


async def test_replayed_event_is_stored_once(client: AsyncClient) -> None:
    raw = hook_payload(event="Stop", last_assistant_message="done")
    first = await client.call("hook", raw=raw, eid="same-eid", event="Stop")
    await asyncio.sleep(2 * ALONE_AFTER_S)  # alone, as an agent's hooks come: the journal holds it too
    second = await client.call("hook", raw=raw, eid="same-eid", event="Stop")
    third = await client.call("ingest", raw=raw)  # no eid: the content is the key
    fourth = await client.call("ingest", raw=raw)
    # A hook's `stored` says it is durable (the journal holds it: whether it is new is known at its commit); the
    # `ingest` op is answered after its commit, and says whether it was new.
    assert (first["stored"], second["stored"], third["stored"], fourth["stored"]) == (1, 1, 1, 0)
    assert (await client.call("status"))["counts"]["events"] == 2


async def test_status_says_how_long_each_op_and_hook_kind_took_to_answer_and_to_arrive(client: AsyncClient) -> None:
    """`status`'s `service`: the daemon's own answer time per op (a hook by its kind) and a hook's arrival time (the
    shim's send time to the frame read), apart from what the client's process spent; client-named kinds are bounded."""
    sent = int(time.time() * 1000)
    await client.call("hook", raw=hook_payload(event="Stop", last_assistant_message="done"), eid="svc-1",
                      event="Stop", sent_at=sent)
    await client.call("ping")
    for n in range(200):  # kinds a client names: the daemon keeps a bounded number of them
        await client.call("hook", raw=hook_payload(event="Stop"), eid=f"svc-k{n}", event=f"Made{n}", sent_at=sent)
    service = (await client.call("status"))["service"]
    stop = service["answer"]["hook:Stop"]
    assert stop["n"] == 1 and 0 < stop["p50_ms"] <= stop["max_ms"], service
    assert service["answer"]["ping"]["n"] == 1 and "hook:Stop" in service["arrival"], service
    assert service["arrival"]["hook:Stop"]["max_ms"] >= 0, service
    assert len(service["answer"]) <= 129 and service["answer"]["other"]["n"] >= 200 - 128, sorted(service["answer"])


async def test_status_says_where_the_daemons_memory_is(client: AsyncClient) -> None:
    """`status`'s `memory` (loomd/memory.py): SQLite's allocations read from the copy of SQLite the daemon uses (its
    open connections hold page caches), inside malloc's bytes in use; the soak bench splits the RSS by them."""
    await client.call("store", text="the parser cache lives under .cache/parser", kind="fact", cwd="/x/mem")
    memory = (await client.call("status"))["memory"]
    assert memory["python_blocks"] > 10_000, memory
    if sys.platform.startswith("linux"):  # glibc's mallinfo2 and /proc/self/maps
        assert 0 < memory["sqlite_mb"] <= memory["sqlite_peak_mb"], memory
        assert memory["malloc_used_mb"] > memory["sqlite_mb"] and memory["malloc_kept_mb"] >= 0, memory
        assert memory["malloc_heaps"] >= 1, memory


async def test_status_names_the_daemons_threads_by_what_they_do(client: AsyncClient) -> None:
    """`status`'s `threads`: each thread's Linux id and its name, the store's connections named for their use (not
    aiosqlite's "Thread-N"), so that a scheduler trace or `top -H`, which show ids, can say whose a busy thread is
    (`bench/schedtrace.py`)."""
    threads = (await client.call("status"))["threads"]
    assert threads[str(threading.main_thread().native_id)] == "MainThread"
    names = set(threads.values())
    assert {"loomd-writer", "loomd-reader", "loomd-workers-reader", "loomd-wal-sync"} <= names, names


def test_the_daemon_spreads_its_threads_over_a_few_malloc_heaps(daemon_process) -> None:
    """`loomd serve` limits malloc's heaps (`memory.limit_heaps`) before its first thread: a heap per thread (glibc's
    default, up to 8 a CPU) each kept its own freed bytes, and a long-running daemon's RSS crept with them. After
    work on every thread (events, memories, searches, the workers), `status` counts the heaps.

    It also takes what startup made out of Python's full collections (`memory.freeze_startup`: each walked it all,
    the event loop stopped 33-44 ms) and times the collections it runs."""
    proc = daemon_process().start()
    with Client(proc.sock, timeout=30) as c:
        for i in range(40):
            c.call("store", text=f"Fact {i}: the build cache for module {i} lives under .cache/m{i}", kind="fact",
                   cwd="/x/heaps")
            c.call("search", query=f"build cache module {i}", cwd="/x/heaps", limit=5)
        for name in ("observer", "reflector", "gc"):
            c.call("workers_run", name=name)
        memory = c.call("status")["memory"]
    assert proc.stop(signal.SIGTERM) == 0
    heaps, collector = memory.get("malloc_heaps"), memory["collector"]
    assert collector["frozen"] > 10_000, collector  # every module, class and function loaded at startup, and more
    assert collector["collections"][0] > 0 and collector["max_ms"][0] > 0, collector
    if sys.platform.startswith("linux"):  # glibc's malloc_info
        assert heaps is not None and 1 <= heaps <= MALLOC_ARENAS, heaps


def test_sigterm_exits_zero_and_removes_the_socket(daemon_process, home: Path) -> None:
    proc = daemon_process().start()
    assert proc.sock.exists()
    assert oct(proc.sock.stat().st_mode & 0o777) == "0o600"
    assert oct(home.stat().st_mode & 0o777) == "0o700"
    assert proc.stop(signal.SIGTERM) == 0
    assert not proc.sock.exists()
    assert "shutting down" in proc.log.read_text()


def test_second_daemon_exits_3_with_a_message(daemon_process, home: Path) -> None:
    first = daemon_process().start()
    second = subprocess.run([sys.executable, "-m", "loomd", "serve"], env=first.env, capture_output=True,
                            text=True, timeout=30)
    assert second.returncode == 3
    assert "another loomd" in second.stderr
    assert first.proc.poll() is None and first.sock.exists()
    assert first.stop() == 0


def test_stale_socket_is_cleaned_up(daemon_process, home: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(home / "loomd.sock"))
    stale.close()  # the file stays, nobody listens
    proc = daemon_process().start()
    assert proc.stop() == 0


def test_missing_extension_support_exits_3(home: Path, tmp_path: Path) -> None:
    # A stand-in `sqlean` module that has no extension loading, first on the path: the daemon must refuse to start.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sqlean.py").write_text("from sqlite3 import *\nfrom sqlite3 import connect, Error, Row\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}"}
    result = subprocess.run([sys.executable, "-m", "loomd", "serve"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 3
    assert "cannot load the sqlite-vec extension" in result.stderr and "pip install" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client under another uid")
def test_other_uid_is_refused(daemon_process, home: Path) -> None:
    proc = daemon_process().start()
    # Open the filesystem gates on purpose: the daemon's own peer-uid check must still refuse.
    os.chmod(home, 0o711)
    os.chmod(proc.sock, 0o666)
    nobody = pwd.getpwnam("nobody")
    # A forked child drops to `nobody` and speaks the protocol: no interpreter path needs to be readable by it.
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(str(proc.sock))
            try:
                s.sendall(protocol.encode_frame({"v": 1, "id": 1, "op": "status"}))
            except BrokenPipeError:
                pass  # the daemon may refuse (answer and close) before our request lands
            data = s.recv(65536)
            os.write(write_end, data or b"closed")
        except BaseException as exc:  # noqa: B036 - report anything to the parent
            os.write(write_end, f"child error {exc!r}".encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    answer = os.read(read_end, 65536)
    os.close(read_end)
    assert not answer.startswith(b"child error"), answer
    reply = msgpack.unpackb(answer[4:], raw=False)
    assert reply["ok"] is False and reply["error"]["code"] == "forbidden"
    assert proc.stop() == 0
    assert f"refused a connection from uid {nobody.pw_uid}" in proc.log.read_text()


async def test_secrets_never_reach_the_database_file(client: AsyncClient, home: Path) -> None:
    from secret_corpus import SECRET_SAMPLES

    assert len(SECRET_SAMPLES) >= 20
    for i, (text, _secret) in enumerate(SECRET_SAMPLES):
        await client.call("hook", event="PostToolUse", eid=f"sec{i}", raw=hook_payload(
            "sec", tool_name="Bash", tool_use_id=f"t{i}", tool_input={"command": text},
            tool_response={"stdout": text, "stderr": ""}))
        await client.call("hook", event="UserPromptSubmit", eid=f"secp{i}",
                          raw=hook_payload("sec", event="UserPromptSubmit", prompt=f"remember {text}"))
        await client.call("store", text=f"note: {text}", cwd="/tmp")
    await client.call("ping")
    blob = b"".join(p.read_bytes() for p in sorted(home.glob("loomd.db*")))  # noqa: ASYNC240 - test-side read
    for text, secret in SECRET_SAMPLES:
        assert secret.encode() not in blob, f"secret from {text!r} reached the database"


async def test_lone_surrogates_in_a_hook_are_stored_as_replacement_characters(client: AsyncClient, home: Path) -> None:
    """"\\ud800" is valid JSON and has no UTF-8 form: found by the fuzz test as an internal error."""
    odd = "x\ud800y"
    for i, (event, extra) in enumerate([
        ("UserPromptSubmit", {"prompt": f"remember {odd} please"}),
        ("PostToolUse", {"tool_name": odd, "tool_use_id": odd, "tool_input": {odd: odd}, "tool_response": odd}),
        ("SessionStart", {"source": odd, "cwd": f"/tmp/{odd}"}),
    ]):
        reply = await client.call("hook", event=event, eid=f"sur{i}", raw=hook_payload(f"s-{odd}", event, **extra))
        assert isinstance(reply, dict), reply
    await client.call("stats")  # answered after the commits of the hooks answered before it: the rows are in the file
    rows = query(home, "SELECT session_id, kind, tool_name, tool_use_id, payload FROM events ORDER BY id")
    assert [r[:4] for r in rows] == [("s-x\ufffdy", "UserPromptSubmit", None, None),
                                     ("s-x\ufffdy", "PostToolUse", "x\ufffdy", "x\ufffdy"),
                                     ("s-x\ufffdy", "SessionStart", None, None)]
    assert json.loads(rows[0][4])["prompt"] == "remember x\ufffdy please"
    assert json.loads(rows[1][4])["tool_input"] == {"x\ufffdy": "x\ufffdy"}


HOOK_FILES = ("pre_tool_use", "post_tool_use", "user_prompt_submit", "session_start", "session_end", "stop",
              "subagent_stop", "notification", "pre_compact")


async def test_real_hook_payload_files_are_all_accepted(client: AsyncClient) -> None:
    root = need_test_data("transcripts")
    counts: dict[str, int] = {}
    distinct: set[str] = set()
    total = 0
    for path in sorted(root.rglob("*.json")):
        if path.stem not in HOOK_FILES:
            continue
        records = json.loads(path.read_text())
        for record in records:
            reply = await client.call("ingest", raw=json.dumps(record).encode(), event=record["hook_event_name"])
            assert reply["accepted"] == 1
            counts[record["hook_event_name"]] = counts.get(record["hook_event_name"], 0) + 1
            distinct.add(json.dumps(record, sort_keys=True))
            total += 1
    stats = await client.call("stats")
    stored = sum(e["count"] for e in stats["events"])
    print(f"\nreal hook payloads: {total} sent, {len(distinct)} distinct, {stored} stored; by event: {counts}")
    # The logs hold some records twice, byte for byte (logged twice upstream): those merge, nothing else may.
    assert total >= 150 and stored == len(distinct)
    kinds = {e["kind"] for e in stats["events"]}
    assert {"PreToolUse", "PostToolUse", "UserPromptSubmit", "SessionStart", "Stop", "PreCompact"} <= kinds


SLOW_COUNT = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000000)"
              " SELECT count(*) FROM c")


async def test_the_workers_read_on_a_connection_of_their_own_so_a_recall_never_queues_behind_them(
        quiet: tuple[Daemon, AsyncClient]) -> None:
    """The observer's reads (chunks of full payloads) run on the store's `background` reader, the hooks' recalls on
    `reader`: while either is busy with a long query, the other side's work is done at once."""
    daemon, client = quiet
    await client.call("store", text="Decision: the flaky upload test retries on a 502 from the proxy",
                      kind="decision", project="/x/proj")
    await client.call("ingest", raw=hook_payload(event="UserPromptSubmit", prompt="why is the upload test flaky?"),
                      event="")
    slow = asyncio.create_task(daemon.store.fetchall(SLOW_COUNT, background=True))
    await asyncio.sleep(0.05)  # the count is on the workers' reader's thread
    found = await client.call("search", query="flaky upload test", project="/x/proj")
    assert found["results"] and not slow.done(), found
    assert (await slow)[0][0] == 20000000
    slow = asyncio.create_task(daemon.store.fetchall(SLOW_COUNT))
    await asyncio.sleep(0.05)  # now on the hooks' reader's thread
    run = await client.call("workers_run", name="observer", session_id="s1")
    assert run["outcome"] == "ok" and run["items_in"] == 1 and not slow.done(), run
    assert (await slow)[0][0] == 20000000


def many_copies() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Events stored first (one a commit), then a batch of 120 that repeats and copies them and itself: tool calls
    and results from the transcript and their hook copies (by id), the same line twice (by key), prompts typed
    twice with their hook copies (paired one to one), a session first seen without its project, a session's end."""
    def call(sid: str, n: int, source: str, key: str | None = None) -> list[dict[str, Any]]:
        kinds = ("tool_use", "tool_result") if source == "transcript" else ("PreToolUse", "PostToolUse")
        return [ev(sid, kind, {"text": f"{kind} {n}"}, 1_700_000_000 + n + half / 2, source=source,
                   tool_use_id=f"toolu_{sid}_{n}", dedup=f"{mark}:toolu_{sid}_{n}",
                   **({"key": f"{key}:{mark}"} if key else {}))
                for half, (kind, mark) in enumerate(zip(kinds, ("tu", "tr"), strict=True))]

    def prompt(sid: str, text: str, ts: float, source: str) -> dict[str, Any]:
        kind = "user_message" if source == "transcript" else "UserPromptSubmit"
        return ev(sid, kind, {"text": text, "prompt": text}, ts, source=source, dedup=prompt_dedup(text))

    said = ev("s-b", "assistant_message", {"text": "stored before"}, 1_699_999_998.0)
    before = [said, *(e for n in range(3) for e in call("s-a", n, "transcript"))]
    batch: list[dict[str, Any]] = [
        {**ev("s-c", "assistant_message", {"text": "first, no cwd"}, 1_699_999_999.0), "project": "unknown"}]
    for n in range(40):
        if n == 20:
            batch.append(dict(said))  # a line stored before, again: its INSERT row is ignored among new ones
        sid = ("s-a", "s-b", "s-c")[n % 3]
        batch += call(sid, n, "transcript", key=f"line:{sid}:{n}")
        if n % 4 == 0:
            batch += call(sid, n, "hook")  # the hook copies of a call: not stored
        if n % 5 == 0:
            batch.append(dict(batch[-1]))  # the same line again: its key is stored already
        if n % 7 == 0:
            batch += [prompt(sid, "continue", 1_700_000_000 + n, "transcript"),
                      prompt(sid, "continue", 1_700_000_000 + n + 0.1, "hook")]
        if n % 11 == 0:
            batch.append(prompt(sid, "continue", 1_700_000_000 + n + 0.2, "transcript"))
    batch.append(ev("s-b", "SessionEnd", {"reason": "other"}, 1_700_000_100.0))
    # The hook copies of a call stored before, last and late by their own clock: a copy leaves the session's row
    # as it was (its last_seen is its last stored event's).
    batch += [{**e, "ts": 1_700_000_200.0} for e in call("s-a", 1, "hook")]
    return before, batch


async def test_a_group_commit_stores_what_one_commit_an_event_stores(monkeypatch, home) -> None:
    """The writer inserts a commit's events a run at a time (an INSERT of many rows that leaves out the copies):
    the same rows, ids, copies skipped and session rows as committing the events one by one."""
    before, batch = many_copies()
    assert len(batch) > 100
    seen: dict[str, tuple[list[Any], list[Any], list[Any]]] = {}
    for name in ("batch", "one_by_one"):
        (home / name).mkdir(mode=0o700)
        monkeypatch.setenv("LOOMD_HOME", str(home / name))
        async with loomd(monkeypatch, home / name) as (d, client):
            for event in before:
                await ingest(client, [event])
            if name == "batch":
                ids = await ingest(client, batch)
            else:
                ids = [i for event in batch for i in await ingest(client, [event])]
            rows = [tuple(r) for r in await d.store.fetchall(
                "SELECT id, key, session_id, kind, source, dedup, ts FROM events ORDER BY id")]
            sessions = [tuple(r) for r in await d.store.fetchall(
                "SELECT id, project, started, last_seen, ended FROM sessions ORDER BY id")]
            seen[name] = (ids, rows, sessions)
    assert seen["batch"] == seen["one_by_one"]
    ids, rows, sessions = seen["batch"]
    kinds = [r[3] for r in rows]
    # s-a's first call was stored before; every hook copy pairs with a transcript one (the third "continue" of s-a
    # at n=0 is another prompt, kept); each repeated line is stored once.
    assert (kinds.count("tool_use"), kinds.count("tool_result"), kinds.count("PostToolUse")) == (42, 42, 0)
    assert (kinds.count("user_message"), kinds.count("UserPromptSubmit")) == (10, 0)
    assert kinds.count("assistant_message") == 2 and len(rows) == 97 == len({r[1] for r in rows})
    assert len(ids) == len(batch) and sum(i is not None for i in ids) == len(rows) - len(before)
    assert [s[1] for s in sessions] == [PROJECT_W] * 3  # s-c first seen as "unknown"
    assert [s[3] for s in sessions] == [max(r[6] for r in rows if r[2] == s[0]) for s in sessions]
    assert [s[0] for s in sessions if s[4] is not None] == ["s-b"]
    assert len(rows) == len(set(r[1] for r in rows))
    assert [s[1] for s in sessions] == [PROJECT_W, PROJECT_W, PROJECT_W]
    assert sum(s[4] is not None for s in sessions) == 1
