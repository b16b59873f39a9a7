"""The hook journal (loomd/ingest/journal.py): a hook is answered once its record is synced, committed after.

Real daemon processes on real files; a commit is held back by another process holding the database's write lock (as
a slow disk or a long checkpoint would), so that a kill -9 lands between a hook's answer and its commit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, query
from secret_corpus import GITHUB_PAT

from loomd.client import Client
from loomd.ingest.journal import HEADER, Record, record_bytes, scan, to_replay
from loomd.ingest.writer import ALONE_AFTER_S

LOCKER = r"""
import sys, time, sqlite3
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


@contextmanager
def write_lock(db: Path) -> Iterator[None]:
    """Another process holds the database's write lock until the block ends: the daemon's commits wait for it."""
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert locker.stdout is not None and locker.stdin is not None
    try:
        assert locker.stdout.readline().strip() == b"locked"
        yield
    finally:
        locker.stdin.close()
        locker.wait(10)
        locker.stdout.close()


def raw(session: str, n: int, kind: str = "PostToolUse") -> bytes:
    return json.dumps({"session_id": session, "hook_event_name": kind, "cwd": "/tmp/journal-test",
                       "tool_name": "Bash", "tool_use_id": f"{session}-{n}",
                       "tool_input": {"command": f"echo {n}"}, "tool_response": {"stdout": f"out {n}"}}).encode()


def hook(sock: Path, session: str, n: int) -> dict[str, Any]:
    """One hook as an agent sends it: well after the one before (a hook that comes with others skips the journal)."""
    time.sleep(2 * ALONE_AFTER_S)
    with Client(sock, timeout=5) as c:
        return c.call("hook", agent="claude", event="PostToolUse", raw=raw(session, n), eid=f"{session}-e{n}")


def stored(db: Path, session: str) -> list[str]:
    """The session's event keys, read from the file itself (whether a daemon runs or not)."""
    return [k for (k,) in query(db.parent, "SELECT key FROM events WHERE session_id = ? ORDER BY id", (session,))]


def journal_status(sock: Path) -> dict[str, Any]:
    with Client(sock) as c:
        return c.call("status")["journal"]


def kill_9(proc: DaemonProcess) -> None:
    assert proc.stop(signal.SIGKILL) == -signal.SIGKILL


# ---------------------------------------------------------------- the file's format


def test_a_scan_stops_at_the_first_record_that_does_not_follow() -> None:
    good = [record_bytes(7, n, {"n": n}) for n in range(3)]
    data = b"".join(good)
    epoch, records = scan(data + bytes(100))
    assert epoch == 7 and [r.fields["n"] for r in records] == [0, 1, 2]
    # A torn write: the next record's header and half of its body.
    torn = record_bytes(7, 3, {"n": 3, "pad": "x" * 200})
    assert len(scan(data + torn[: HEADER.size + 50])[1]) == 3
    # A body whose bytes changed after its CRC: that record and everything after it are not records.
    bad = bytearray(data)
    bad[len(good[0]) + HEADER.size + 2] ^= 0xFF
    assert [r.seq for r in scan(bytes(bad))[1]] == [0]
    # An older epoch's bytes after the newest epoch's records (the file went back to offset 0), a gap in sequence.
    assert len(scan(data + record_bytes(6, 3, {"n": 3}))[1]) == 3
    assert len(scan(data + record_bytes(7, 4, {"n": 4}))[1]) == 3
    assert scan(bytes(4096)) == (None, [])


def test_what_a_start_replays() -> None:
    records = [Record(5, n, {}) for n in range(4)]
    assert to_replay(None, [], 3, set()) == []
    assert to_replay(5, records, None, set()) == records  # nothing ever noted
    assert to_replay(5, records, 4, {0, 1}) == records  # an epoch newer than any note: none committed
    assert [r.seq for r in to_replay(5, records, 5, {0, 2})] == [1, 3]
    assert to_replay(5, records, 6, set()) == []  # an older epoch: settled before the newer began


# ---------------------------------------------------------------- a real daemon


@pytest.fixture
def daemon_up(daemon_process: Callable[..., DaemonProcess]) -> Callable[..., DaemonProcess]:
    def start(**env: str) -> DaemonProcess:
        return daemon_process({"LOOMD_BUSY_TIMEOUT_MS": "30000", **env}).start()

    return start


def test_a_hook_is_answered_before_its_commit_and_a_kill_9_then_loses_nothing(
        daemon_up: Callable[..., DaemonProcess], home: Path) -> None:
    proc = daemon_up()
    db = home / "loomd.db"
    assert hook(proc.sock, "warm", 0)["stored"] == 1
    assert journal_status(proc.sock)["on"]
    with write_lock(db):
        # Answered while their commits wait for the lock (30 s of busy timeout): durable in the journal alone.
        assert [hook(proc.sock, "held", n)["stored"] for n in range(3)] == [1, 1, 1]
        kill_9(proc)
    assert stored(db, "held") == []
    proc.start()
    assert stored(db, "held") == ["eid:held-e0", "eid:held-e1", "eid:held-e2"]
    status = journal_status(proc.sock)
    assert status["replayed"] == 3 and status["unsettled"] == 0, status
    # A replay is idempotent, and a second start replays nothing.
    kill_9(proc)
    proc.start()
    assert journal_status(proc.sock)["replayed"] == 0
    assert stored(db, "held") == ["eid:held-e0", "eid:held-e1", "eid:held-e2"]
    assert "Traceback" not in proc.log.read_text()


def test_a_reader_sees_the_events_of_the_hooks_it_was_answered_for(daemon_up: Callable[..., DaemonProcess]) -> None:
    proc = daemon_up()
    with Client(proc.sock) as c:
        for n in range(20):
            time.sleep(2 * ALONE_AFTER_S)
            c.call("hook", agent="claude", event="PostToolUse", raw=raw("rw", n))
            # The next op waits for the commits of the hooks answered before it (`Ops.handlers`).
            assert len(c.call("events", session_id="rw", limit=100)["events"]) == n + 1
        assert c.call("status")["journal"]["appended"] >= 20


def test_an_event_purged_after_its_commit_is_not_replayed(daemon_up: Callable[..., DaemonProcess],
                                                          home: Path) -> None:
    proc = daemon_up()
    for n in range(2):
        hook(proc.sock, "gone", n)
    hook(proc.sock, "kept", 0)
    with Client(proc.sock) as c:
        assert c.call("purge", session_id="gone", confirm=True)["purged"]
    assert stored(home / "loomd.db", "gone") == []
    kill_9(proc)  # the journal still holds the purged session's records
    proc.start()
    assert journal_status(proc.sock)["replayed"] == 0
    assert stored(home / "loomd.db", "gone") == [] and stored(home / "loomd.db", "kept") == ["eid:kept-e0"]


def test_a_torn_record_after_the_last_answered_one_is_ignored(daemon_up: Callable[..., DaemonProcess],
                                                              home: Path) -> None:
    proc = daemon_up()
    with write_lock(home / "loomd.db"):
        hook(proc.sock, "torn", 0)
        hook(proc.sock, "torn", 1)
        kill_9(proc)
    journal = home / "hooks.journal"
    epoch, records = scan(journal.read_bytes())
    assert epoch is not None and [r.seq for r in records] == [0, 1]
    end = sum(len(record_bytes(r.epoch, r.seq, r.fields)) for r in records)
    torn = record_bytes(epoch, 2, {**records[1].fields, "key": "eid:torn-e2"})
    with open(journal, "r+b") as f:  # a write the crash cut short: never synced, never answered
        f.seek(end)
        f.write(torn[: len(torn) // 2])
    proc.start()
    assert stored(home / "loomd.db", "torn") == ["eid:torn-e0", "eid:torn-e1"]
    assert hook(proc.sock, "torn", 3)["stored"] == 1  # and the journal goes on, from a new epoch
    with Client(proc.sock) as c:
        assert len(c.call("events", session_id="torn")["events"]) == 3
        assert c.call("status")["journal"]["epoch"] > epoch


def test_a_commit_that_fails_after_the_answer_is_tried_again(daemon_up: Callable[..., DaemonProcess],
                                                             home: Path) -> None:
    """The write lock outlasts the daemon's busy timeout: the commit fails, the hook was answered, and the event is
    committed by a later try once the lock is gone."""
    proc = daemon_up(LOOMD_BUSY_TIMEOUT_MS="200")
    with write_lock(home / "loomd.db"):
        assert hook(proc.sock, "retry", 0)["stored"] == 1
        time.sleep(1.0)
    deadline = time.monotonic() + 30
    while stored(home / "loomd.db", "retry") == [] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stored(home / "loomd.db", "retry") == ["eid:retry-e0"]
    status = journal_status(proc.sock)
    assert status["retries"] >= 1 and status["unsettled"] == 0, status
    assert "trying again" in proc.log.read_text()
    shown = subprocess.run([str(Path(sys.executable).with_name("loom")), "status"], capture_output=True, text=True,
                           env=proc.env, timeout=60)
    assert f"hook journal: {status['retries']} failed commit(s) of answered hooks tried again, 0 not committed yet" \
        in shown.stdout, shown


def test_off_every_hook_is_answered_after_its_commit(daemon_up: Callable[..., DaemonProcess], home: Path) -> None:
    proc = daemon_up(LOOMD_HOOK_JOURNAL_BYTES="0")
    assert hook(proc.sock, "off", 0)["stored"] == 1
    assert hook(proc.sock, "off", 0)["stored"] == 0  # the same event again: known at its commit
    assert stored(home / "loomd.db", "off") == ["eid:off-e0"]
    assert journal_status(proc.sock) == {"on": False}
    assert not (home / "hooks.journal").exists()


def test_a_new_sessions_start_block_is_answered_before_its_commit(daemon_up: Callable[..., DaemonProcess],
                                                                   home: Path) -> None:
    """The start block is read on the event loop's thread (`StartRead.read_here`), not inside the event's commit:
    the hook gets it while another process holds the write lock; the session's event is there after a kill -9."""
    proc = daemon_up()
    with Client(proc.sock) as c:
        c.call("store", text="Always run the linter before a commit", kind="constraint", cwd="/tmp/journal-test")
    start = json.dumps({"session_id": "started", "hook_event_name": "SessionStart", "source": "startup",
                        "cwd": "/tmp/journal-test"}).encode()
    with write_lock(home / "loomd.db"):
        with Client(proc.sock, timeout=5) as c:
            reply = c.call("hook", agent="claude", event="SessionStart", raw=start, eid="started-0", context=True,
                           deadline_ms=5000)
        kill_9(proc)
    assert reply["stored"] == 1
    assert "Always run the linter before a commit" in json.loads(reply["stdout"])["hookSpecificOutput"][
        "additionalContext"]
    assert stored(home / "loomd.db", "started") == []
    proc.start()
    assert stored(home / "loomd.db", "started") == ["eid:started-0"]


def test_the_journal_keeps_the_event_redacted_never_the_raw_bytes(daemon_up: Callable[..., DaemonProcess],
                                                                  home: Path) -> None:
    proc = daemon_up()
    body = json.dumps({"session_id": "secret", "hook_event_name": "PostToolUse", "cwd": "/tmp/journal-test",
                       "tool_name": "Bash", "tool_use_id": "s-1", "tool_input": {"command": "cat .env"},
                       "tool_response": {"stdout": f"GITHUB_TOKEN={GITHUB_PAT}"}}).encode()
    with write_lock(home / "loomd.db"):  # the event is in the journal alone
        with Client(proc.sock, timeout=5) as c:
            assert c.call("hook", agent="claude", event="PostToolUse", raw=body, eid="secret-0")["stored"] == 1
        kill_9(proc)
    journal = (home / "hooks.journal").read_bytes()
    _, records = scan(journal)
    assert [r.fields["key"] for r in records] == ["eid:secret-0"]
    assert GITHUB_PAT.encode() not in journal and b"cat .env" in journal
    proc.start()
    ((payload,),) = query(home, "SELECT payload FROM events WHERE key = 'eid:secret-0'")
    assert GITHUB_PAT not in payload and "cat .env" in payload


def test_a_payload_msgpack_cannot_hold_takes_the_direct_path(daemon_up: Callable[..., DaemonProcess],
                                                             home: Path) -> None:
    """JSON holds integers of any size, msgpack 64 bits at most: such an event is answered after its commit."""
    proc = daemon_up()
    body = json.dumps({"session_id": "big", "hook_event_name": "Stop", "cwd": "/tmp/journal-test",
                       "n": 10**30}).encode()
    with Client(proc.sock) as c:
        assert c.call("hook", agent="claude", event="Stop", raw=body, eid="big-0")["stored"] == 1
        assert c.call("status")["journal"]["direct"] == 1
    assert stored(home / "loomd.db", "big") == ["eid:big-0"]


def test_a_hook_that_comes_while_another_is_in_flight_is_answered_after_its_commit(
        daemon_up: Callable[..., DaemonProcess], home: Path) -> None:
    """Hooks that come together share a group commit instead of a record and a sync each (`HookJournal.append`):
    the second hook, arriving while the first (a payload the journal cannot hold: the direct path) waits for its
    commit, waits for its own. A hook that comes alone afterwards is journaled again."""
    proc = daemon_up()
    db = home / "loomd.db"
    assert hook(proc.sock, "warm", 0)["stored"] == 1
    big = json.dumps({"session_id": "first", "hook_event_name": "Stop", "cwd": "/tmp/journal-test",
                      "n": 10**30}).encode()
    answered: dict[str, int] = {}

    def send(name: str, event: str, body: bytes) -> None:
        with Client(proc.sock, timeout=30) as c:
            answered[name] = c.call("hook", agent="claude", event=event, raw=body, eid=f"{name}-0")["stored"]

    def until(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while not check(status := journal_status(proc.sock)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return status

    with write_lock(db):
        first = threading.Thread(target=send, args=("first", "Stop", big))
        first.start()
        assert until(lambda s: s["direct"] == 1)["direct"] == 1
        second = threading.Thread(target=send, args=("second", "PostToolUse", raw("second", 0)))
        second.start()
        status = until(lambda s: s["together"] == 1)
        assert status["together"] == 1 and status["appended"] == 1, status
        time.sleep(0.2)
        assert answered == {}  # both wait for the lock
    first.join(30)
    second.join(30)
    assert answered == {"first": 1, "second": 1}
    assert stored(db, "first") == ["eid:first-0"] and stored(db, "second") == ["eid:second-0"]
    with write_lock(db):  # alone again: answered from the journal while the lock is held
        assert hook(proc.sock, "alone", 0)["stored"] == 1
    assert until(lambda s: s["unsettled"] == 0)["appended"] == 2
