"""The memory workers through a real daemon: scheduling, watermarks, crashes, reflection, dropper, digest, GC."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import itertools
import json
import math
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import DaemonProcess, caught_up, need_test_data, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomd.cli import main as cli_main
from loomd.client import AsyncClient, Client
from loomd.daemon import Daemon
from loomd.ingest.reading import CLIP_CHARS, CODE_SLACK
from loomd.ingest.writer import LIVE_QUIET_S
from loomd.store.db import connect_sync, on_thread, open_reader
from loomd.workers.base import RunReport
from loomd.workers.digest import budgets, render_digest
from loomd.workers.observer import CHUNK_EVENTS, CONTEXT_EVENTS, PASSAGES_PER_WRITE, Observer
from loomd.workers.reflector import Reflector, plan_chunk, read_snapshot
from loomd.workers.rules import observe
from loomd.workers.scheduler import HOLD_RETRY_S
from loomd.workers.steps import SourceEvent

PROJECT = "proj-w"
_n = itertools.count(1)
# A trigger that makes every observation insert take a while: a real slow write, to stop a run mid-transaction.
SLOW_TRIGGER = (
    "CREATE TRIGGER slow_obs AFTER INSERT ON memories WHEN new.kind = 'observation' BEGIN"
    " SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 400000)"
    " SELECT x FROM c); END"
)


@asynccontextmanager
async def loomd(monkeypatch: pytest.MonkeyPatch, home: Path, **env: Any) -> AsyncIterator[tuple[Daemon, AsyncClient]]:
    """A real daemon in this loop with extra LOOMD_* settings (passive, no tailing, no embedder unless given)."""
    settings = {"passive": True, "tail_transcripts": False, "embedder": "none", **env}
    for name, value in settings.items():
        monkeypatch.setenv(f"LOOMD_{name.upper()}", str(int(value) if isinstance(value, bool) else value))
    async with serving(home / "loomd.sock") as d, AsyncClient(home / "loomd.sock") as client:
        yield d, client


def ev(session: str, kind: str, payload: dict[str, Any], ts: float, **extra: Any) -> dict[str, Any]:
    n = next(_n)
    return {"agent": "claude", "session_id": session, "kind": kind, "payload": payload, "ts": ts,
            "project": PROJECT, "source": "transcript", "key": f"t:{session}:{n}", **extra}


def user(session: str, text: str, ts: float) -> dict[str, Any]:
    return ev(session, "user_message", {"text": text}, ts)


def assistant(session: str, text: str, ts: float) -> dict[str, Any]:
    return ev(session, "assistant_message", {"text": text}, ts)


def shell(session: str, command: str, output: str, ts: float, failed: bool = False) -> list[dict[str, Any]]:
    tid = f"toolu_{next(_n)}"
    return [
        ev(session, "tool_use", {"text": f"Bash: {command}", "tool_name": "Bash", "tool_input": {"command": command}},
           ts, tool_name="Bash", tool_use_id=tid, dedup=f"tu:{tid}"),
        ev(session, "tool_result", {"text": output, "is_error": failed}, ts + 1, tool_use_id=tid, dedup=f"tr:{tid}"),
    ]


def work_session(session: str, t0: float) -> list[dict[str, Any]]:
    """A small but realistic session: a rule, a failing then passing test run, a fix, a commit, a report."""
    return [
        user(session, "Add retry to the uploader. From now on never use print for logging, use the logging module.",
             t0),
        assistant(session, "I'll use tenacity for the retries because it already handles jitter and backoff.", t0 + 2),
        *shell(session, "pytest tests/test_upload.py", "FAILED tests/test_upload.py::test_retry - assert 0 == 3\n"
               "=== 1 failed, 4 passed in 0.3s ===", t0 + 3, failed=True),
        *shell(session, "pytest tests/test_upload.py", "=== 5 passed in 0.2s ===", t0 + 6),
        *shell(session, 'git commit -m "Add retry with backoff to the uploader"',
               "[main 1a2b3c4] Add retry with backoff to the uploader\n 2 files changed", t0 + 8),
        assistant(session, "Done. The uploader now retries three times with exponential backoff.", t0 + 10),
    ]


async def ingest(client: AsyncClient, events: list[dict[str, Any]]) -> list[int]:
    result = await client.call("ingest", events=events)
    return result["ids"]


async def memories(client: AsyncClient, **where: Any) -> list[dict[str, Any]]:
    total = (await client.call("status"))["counts"]
    count = total["memories"] + total["archived"]
    if not count:
        return []
    items = (await client.call("detail", id=list(range(1, count + 1)), sources=True))["memories"]
    return [m for m in items if all(m.get(k) == v for k, v in where.items())]


async def db_rows(d: Daemon, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    return await d.store.fetchall(sql, params)


def essence(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a run wrote, without ids or times: comparable between a dry run, a re-run and a fresh daemon."""
    return sorted((o["action"], o.get("type"), o.get("text"), tuple(o.get("sources") or ())) for o in output)


# --- observer, watermarks, jobs ---------------------------------------------------------------------------------

async def test_observer_writes_typed_sourced_observations_and_moves_its_watermark(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        ids = await ingest(client, work_session("s1", 1_700_000_000))
        result = await client.call("workers_run", name="observer", session_id="s1")
        assert result["outcome"] == "ok" and result["items_in"] == len(ids)
        obs = await memories(client, kind="observation")
        by_type = {}
        for m in obs:
            meta = (await db_rows(d, "SELECT meta FROM memories WHERE id = ?", (m["id"],)))[0][0]
            by_type.setdefault(json.loads(meta)["type"], []).append(m)
            assert len(m["text"]) <= 200 and m["sources"] and m["session_id"] == "s1"
            assert all(s["event_id"] in ids for s in m["sources"])
            assert m["created"] >= 1_700_000_000  # the event's time, not the run's
        assert "never use print for logging" in by_type["constraint"][0]["text"]
        assert any("tenacity" in m["text"] for m in by_type["decision"])
        assert any(m["text"].startswith("Committed [main 1a2b3c4]: Add retry") for m in by_type["decision"])
        assert any(m["text"].startswith("Tests green: `pytest tests/test_upload.py` (5 passed") for m in
                   by_type["progress"])
        assert any("test_retry" in m["text"] for m in by_type["error"])
        mark = await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:s1'")
        assert int(mark) == max(ids)
        again = await client.call("workers_run", name="observer", session_id="s1")
        assert again["outcome"] == "noop" and again["items_out"] == 0
        jobs = await db_rows(d, "SELECT worker, outcome, items_in, items_out, ended FROM jobs ORDER BY id")
        assert [(j[0], j[1]) for j in jobs] == [("observer", "ok"), ("observer", "noop")]
        assert jobs[0][2] == len(ids) and jobs[0][3] == len(obs) and jobs[0][4] is not None


async def test_dry_run_reports_exactly_what_a_run_writes_and_writes_nothing(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, work_session("s1", 1_700_000_000))
        before = (await client.call("status"))["counts"]
        dry = await client.call("workers_run", name="observer", session_id="s1", dry_run=True)
        assert dry["outcome"] == "dry_run" and dry["output"]
        assert (await client.call("status"))["counts"] == before
        assert await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:s1'") is None
        real = await client.call("workers_run", name="observer", session_id="s1")
        assert essence(real["output"]) == essence(dry["output"])
        for name in ("reflector", "digest", "dropper", "gc"):
            assert (await client.call("workers_run", name=name, dry_run=True))["outcome"] == "dry_run"


async def test_a_failed_chunk_never_moves_the_watermark(monkeypatch, home) -> None:
    """600 events, a write fault at the 551st: the chunks before it commit; the faulty chunk rolls back only."""
    async with loomd(monkeypatch, home) as (d, client):
        events = []
        for i in range(300):
            events.append(user("big", f"Step {i}: please look at module number {i} and summarise what it does.",
                               1_700_000_000 + i))
            events.append(assistant("big", f"Module {i} parses the config section {i}.", 1_700_000_000 + i))
        events[550]["payload"]["text"] = "Never deploy on Fridays, BOOM."
        ids = await ingest(client, events)
        async with d.store.atomic() as db:
            await db.execute("CREATE TRIGGER boom BEFORE INSERT ON memories WHEN new.text LIKE '%BOOM%'"
                             " BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
        failed = await client.call("workers_run", name="observer", session_id="big")
        assert failed["outcome"] == "error" and "disk says no" in failed["error"]
        mark = int(await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:big'"))
        committed = 550 // CHUNK_EVENTS * CHUNK_EVENTS  # the chunks before the faulty one
        assert mark == ids[committed - 1]  # and not one event further
        cited = await d.store.scalar("SELECT max(s.event_id) FROM memory_sources s JOIN memories m"
                                     " ON m.id = s.memory_id WHERE m.kind = 'observation'")
        assert cited <= mark  # nothing written cites an event past the watermark
        job = (await db_rows(d, "SELECT outcome, error FROM jobs ORDER BY id DESC LIMIT 1"))[0]
        assert job[0] == "error" and "disk says no" in job[1]
        async with d.store.atomic() as db:
            await db.execute("DROP TRIGGER boom")
        done = await client.call("workers_run", name="observer", session_id="big")
        assert done["outcome"] == "ok" and done["items_in"] == 600 - committed
        assert int(await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:big'")) == ids[-1]
        assert any("Never deploy on Fridays" in m["text"] for m in await memories(client, kind="observation"))


async def observe_all_but_one(d: Daemon, client: AsyncClient, failing: str) -> None:
    """A run over every due session while any memory saying BOOM fails to insert: `failing` is skipped, noted in
    the run's report, and the run goes on."""
    async with d.store.atomic() as db:
        await db.execute("CREATE TRIGGER boom BEFORE INSERT ON memories WHEN new.text LIKE '%BOOM%'"
                         " BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
    run = await client.call("workers_run", name="observer", final=True)
    assert run["outcome"] == "ok", run
    assert run["detail"]["sessions_failed"] == [f"{failing}: IntegrityError: disk says no"], run["detail"]


async def test_one_session_that_fails_never_stalls_the_others(monkeypatch, home) -> None:
    """A run over every due session: the session whose write faults keeps its watermark and is named in the run's
    report; the sessions after it are observed all the same."""
    async with loomd(monkeypatch, home, observe_idle_s=0) as (d, client):
        await ingest(client, [user("aa-bad", "Never deploy on Fridays, BOOM.", 1_700_000_000)])
        await ingest(client, work_session("zz-good", 1_700_000_100))
        await observe_all_but_one(d, client, "aa-bad")
        assert await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:aa-bad'") is None
        assert await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:zz-good'") is not None
        assert any("tenacity" in m["text"] for m in await memories(client, session_id="zz-good"))
        async with d.store.atomic() as db:
            await db.execute("DROP TRIGGER boom")
        again = await client.call("workers_run", name="observer", final=True)
        assert again["outcome"] == "ok" and "sessions_failed" not in again["detail"], again
        assert any("Never deploy on Fridays" in m["text"] for m in await memories(client, session_id="aa-bad"))


async def test_the_next_chunk_is_read_and_distilled_while_one_is_written(monkeypatch, home) -> None:
    """A run's text work (the offload process) and its writes (the writer's thread) overlap: the second chunk goes
    to the offload process while the first one's slow observation inserts still run, before its watermark moves.
    The result is the sequential one: every chunk written, in order, the watermark on the last event."""
    async with loomd(monkeypatch, home) as (d, client):
        events = []
        for i in range(CHUNK_EVENTS):  # two chunks: a full one and a short one
            events.append(user("long", f"Step {i}: never touch module number {i}, it is generated.", 1_700_000_000 + i))
        events.append(user("long", "Last step: always run the linter before committing.", 1_700_000_100))
        ids = await ingest(client, events)
        async with d.store.atomic() as db:
            await db.execute(SLOW_TRIGGER)
        assert d.offload is not None
        calls = d.offload.calls
        run = asyncio.ensure_future(client.call("workers_run", name="observer", session_id="long", final=True))
        while d.offload.calls < calls + 2:  # the first chunk's text work, then the second's
            assert not run.done(), await run
            await asyncio.sleep(0.001)
        # The first chunk is being written (its observations one slow insert each): nothing of it is committed.
        assert await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:long'") is None
        done = await run
        assert done["outcome"] == "ok" and done["items_in"] == CHUNK_EVENTS + 1, done
        assert int(await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:long'")) == ids[-1]
        texts = " ".join(m["text"] for m in await memories(client, kind="observation"))
        assert "module number 3" in texts and "always run the linter" in texts


def many_chunks(session: str) -> list[dict[str, Any]]:
    """Eleven chunks whose observations need the ones before: a test run fails in the eighth chunk and passes in
    the tenth, a call ends the ninth chunk and its result starts the tenth, the last chunk is short; and a lint run
    that fails in the first chunk passes in the tenth, by then more than CONTEXT_EVENTS events back."""
    events = [user(session, f"Step {i}: look at module number {i} and say what it does.", 1_700_000_000 + i)
              for i in range(10 * CHUNK_EVENTS + 10)]
    lint, clean = (shell(session, "ruff check src", "src/a.py:1:1: F401 unused import\nFound 1 error.",
                         1_700_000_002, failed=True), shell(session, "ruff check src", "All checks passed!",
                                                            1_700_000_000 + 9 * CHUNK_EVENTS + 16))
    failed = shell(session, "pytest tests/test_upload.py", "FAILED tests/test_upload.py::test_retry - assert 0 == 3\n"
                   "=== 1 failed, 4 passed in 0.3s ===", 1_700_000_000 + 7 * CHUNK_EVENTS + 20, failed=True)
    passed = shell(session, "pytest tests/test_upload.py", "=== 5 passed in 0.2s ===",
                   1_700_000_000 + 9 * CHUNK_EVENTS + 10)
    across = shell(session, 'git commit -m "Add retry with backoff"', "[main 1a2b3c4] Add retry with backoff\n"
                   " 2 files changed", 1_700_000_000 + 9 * CHUNK_EVENTS - 1)
    tenth = 9 * CHUNK_EVENTS
    assert 3 < tenth - CONTEXT_EVENTS <= tenth - 5  # the tenth chunk's window: the test run's failure, not the lint's
    events[2:4], events[tenth - 5 : tenth - 3] = lint, failed
    events[tenth - 1 : tenth + 1], events[tenth + 10 : tenth + 12], events[tenth + 16 : tenth + 18] = (across, passed,
                                                                                                       clean)
    return events


async def test_a_run_carries_each_chunk_s_context_over_as_reading_it_again_would(monkeypatch, home) -> None:
    """The observer reads a session's earlier events once a run and slides them along chunk after chunk: what one
    run over eleven chunks writes is what eleven runs, one a chunk (each reading its context afresh), write."""

    def written(items: list[dict[str, Any]], ids: list[int]) -> set[tuple[Any, ...]]:
        at = {event_id: n for n, event_id in enumerate(ids)}
        return {(m["kind"], m["text"], m["superseded_by"] is not None,
                 tuple(sorted(at[s["event_id"]] for s in m["sources"]))) for m in items
                if m["kind"] in ("observation", "evidence")}

    events = many_chunks("long")
    for name in ("one", "each"):
        (home / name).mkdir(mode=0o700)
    monkeypatch.setenv("LOOMD_HOME", str(home / "one"))
    async with loomd(monkeypatch, home / "one") as (_, client):
        ids = await ingest(client, events)
        run = await client.call("workers_run", name="observer", session_id="long", final=True)
        assert run["outcome"] == "ok" and run["items_in"] == len(events), run
        in_one_run = written(await memories(client), ids)
    monkeypatch.setenv("LOOMD_HOME", str(home / "each"))
    async with loomd(monkeypatch, home / "each") as (_, client):
        ids = []
        for start in range(0, len(events), CHUNK_EVENTS):
            ids += await ingest(client, events[start : start + CHUNK_EVENTS])
            last = start + CHUNK_EVENTS >= len(events)
            run = await client.call("workers_run", name="observer", session_id="long", final=last)
            assert run["outcome"] == "ok", run
        one_a_run = written(await memories(client), ids)
    assert in_one_run == one_a_run
    # The context mattered: the passing run in the third chunk supersedes the failure in the first.
    assert [text for kind, text, superseded, _ in in_one_run if kind == "observation" and superseded] == [
        "`pytest tests/test_upload.py` failed: 1 failed, 4 passed tests/test_upload.py::test_retry"], in_one_run


async def test_a_chunk_that_fails_mid_session_drops_what_was_read_ahead_of_it(monkeypatch, home) -> None:
    """A run over every due session: the long session's second chunk faults while its third was read ahead. The
    first chunk stays committed, nothing of the second or third is written, and the next session is observed."""
    async with loomd(monkeypatch, home, observe_idle_s=0) as (d, client):
        events = [user("aa-long", f"Step {i}: never touch module number {i}, it is generated.", 1_700_000_000 + i)
                  for i in range(2 * CHUNK_EVENTS + 10)]
        events[CHUNK_EVENTS + 5]["payload"]["text"] = "Never deploy on Fridays, BOOM."
        ids = await ingest(client, events)
        await ingest(client, work_session("zz-good", 1_700_000_500))
        await observe_all_but_one(d, client, "aa-long")
        mark = int(await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:aa-long'"))
        assert mark == ids[CHUNK_EVENTS - 1]
        cited = await d.store.scalar("SELECT max(s.event_id) FROM memory_sources s JOIN memories m"
                                     " ON m.id = s.memory_id WHERE m.session_id = 'aa-long' AND m.kind = 'observation'")
        assert cited <= mark  # neither the failed chunk nor the one read ahead of it wrote an observation
        read_ahead = await d.store.scalar(
            "SELECT count(*) FROM memory_sources s JOIN memories m ON m.id = s.memory_id WHERE m.session_id = 'aa-long'"
            " AND m.kind IN ('observation', 'evidence') AND s.event_id > ?", (ids[2 * CHUNK_EVENTS - 1],))
        assert read_ahead == 0  # the third chunk was read ahead, never written
        assert any("tenacity" in m["text"] for m in await memories(client, session_id="zz-good"))


# Any JSON a hook or a transcript line may carry, with the strings the rules look for among it.
_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
            | st.sampled_from(["User has approved your plan\n# Plan: ship", "[main abc1234] Subject", "pytest -q",
                               "Exit code 1\nError: boom", "*** Update File: a.py", "5 passed in 0.1s",
                               "git commit -m 'x'", "gh pr create", "https://github.com/a/b/pull/1", '"Q?"="A"']))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["status", "content", "step", "text", "type", "stdout", "exit_code"]), inner, max_size=3),
    max_leaves=6)
_INPUT = st.dictionaries(st.sampled_from(["todos", "plan", "description", "input", "file_path", "path", "command",
                                          "cmd", "notebook_path"]), _JSON, max_size=4) | _JSON
_TOOLS = st.sampled_from(["Bash", "Edit", "Write", "apply_patch", "TodoWrite", "update_plan", "ExitPlanMode",
                          "AskUserQuestion", "mcp__srv__call", "exec_command", "Task"])


@st.composite
def _hostile_turn(draw: st.DrawFn) -> list[SourceEvent]:
    """A turn of odd but well-formed rows: a prompt, tool runs by hook or by transcript pair, a reply, a stop."""
    rows: list[tuple[str, str | None, str | None, dict[str, Any]]] = [("UserPromptSubmit", None, None,
                                                                       {"prompt": draw(_JSON)})]
    for n in range(draw(st.integers(1, 4))):
        tool, tool_input, response = draw(_TOOLS), draw(_INPUT), draw(_JSON)
        how = draw(st.sampled_from(["PostToolUse", "PostToolUseFailure", "transcript"]))
        if how == "transcript":
            rows.append(("tool_use", tool, f"t{n}", {"tool_name": tool, "tool_input": tool_input}))
            rows.append(("tool_result", None, f"t{n}", {"text": response, "is_error": draw(_JSON)}))
        else:
            rows.append((how, tool, f"t{n}", {"tool_name": tool, "tool_input": tool_input,
                                              "tool_response" if how == "PostToolUse" else "error": response}))
    rows.append(("assistant_message", None, None, {"text": draw(_JSON)}))
    rows.append((draw(st.sampled_from(["Stop", "SubagentStop"])), None, None,
                 {"last_assistant_message": draw(_JSON), "agent_id": draw(st.none() | _SCALARS)}))
    return [SourceEvent(i, "s", kind, float(i), "claude", PROJECT, tool, use, payload)
            for i, (kind, tool, use, payload) in enumerate(rows, 1)]


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(turn=_hostile_turn(), final=st.booleans())
def test_the_rule_observer_reads_any_json_without_raising(turn: list[SourceEvent], final: bool) -> None:
    """The stored payload of an event is whatever was sent: a number where a list is expected must not stop the
    observer (found: `TodoWrite` with `"todos": 7`)."""
    for observation in observe(turn, final=final):
        assert observation.text.strip() and len(observation.text) <= 400 and observation.sources


async def test_cancelled_run_keeps_nothing_and_reruns_to_the_same_result(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, work_session("c1", 1_700_000_000))
        reference = await client.call("workers_run", name="observer", session_id="c1", dry_run=True)
        async with d.store.atomic() as db:
            await db.execute(SLOW_TRIGGER)
        assert d.scheduler is not None
        run = asyncio.create_task(d.scheduler.run("observer", session_id="c1"))
        deadline = time.monotonic() + 10
        while not await d.store.scalar("SELECT count(*) FROM jobs WHERE outcome = 'running'"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        while not d.store.writer.in_transaction:  # the output transaction is open, slow inserts under way
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        assert not run.done()
        d.should_exit.set()  # shutdown: the scheduler cancels the running job
        with pytest.raises(asyncio.CancelledError):
            await run
    async with loomd(monkeypatch, home) as (d, client):
        job = (await db_rows(d, "SELECT outcome FROM jobs ORDER BY id DESC LIMIT 1"))[0]
        assert job[0] == "cancelled"
        assert await memories(client, kind="observation") == []
        assert await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:c1'") is None
        async with d.store.atomic() as db:
            await db.execute("DROP TRIGGER slow_obs")
        again = await client.call("workers_run", name="observer", session_id="c1")
        assert again["outcome"] == "ok" and essence(again["output"]) == essence(reference["output"])


def observe_in_background(sock: Path, session: str) -> tuple[threading.Thread, list[BaseException]]:
    """`workers_run observer` for `session` on a thread; what the call raised (the daemon killed under it) in the
    list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with Client(sock, timeout=30) as c:
                c.call("workers_run", name="observer", session_id=session)
        except BaseException as exc:  # noqa: BLE001 - the daemon dies under this call on purpose
            errors.append(exc)

    caller = threading.Thread(target=run)
    caller.start()
    return caller, errors


def wait_for_an_open_write(db: Path, deadline: float, failure: str) -> None:
    """Until the daemon holds the database's write lock (one of its write transactions is open)."""
    probe = sqlite3.connect(db, timeout=0)
    try:
        while True:
            try:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
            except sqlite3.OperationalError:
                return
            assert time.monotonic() < deadline, failure
            time.sleep(0.005)
    finally:
        probe.close()


@pytest.mark.slow
def test_kill_9_mid_run_keeps_nothing_and_reruns_to_the_same_result(daemon_process, home: Path) -> None:
    env = {"LOOMD_PASSIVE": "1", "LOOMD_TAIL_TRANSCRIPTS": "0", "LOOMD_EMBEDDER": "none"}
    proc = daemon_process(env).start()
    with Client(proc.sock, timeout=30) as c:
        c.call("ingest", events=work_session("k1", 1_700_000_000))
        reference = c.call("workers_run", name="observer", session_id="k1", dry_run=True)
    conn = connect_sync(home / "loomd.db")
    conn.execute(SLOW_TRIGGER)
    caller, errors = observe_in_background(proc.sock, "k1")
    deadline = time.monotonic() + 10
    while not conn.execute("SELECT count(*) FROM jobs WHERE outcome = 'running'").fetchone()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait_for_an_open_write(home / "loomd.db", deadline, "the run's output transaction never opened")
    time.sleep(0.1)
    assert proc.stop(signal.SIGKILL) == -signal.SIGKILL
    caller.join(10)
    assert errors  # the call never got its answer
    conn.execute("DROP TRIGGER slow_obs")
    conn.close()
    proc2 = daemon_process(env).start()
    with Client(proc2.sock, timeout=30) as c:
        jobs = sqlite3.connect(home / "loomd.db").execute("SELECT outcome FROM jobs ORDER BY id").fetchall()
        assert jobs[-1][0] == "interrupted"
        assert c.call("stats")["memories"].get("observation") is None
        again = c.call("workers_run", name="observer", session_id="k1")
    assert again["outcome"] == "ok" and essence(again["output"]) == essence(reference["output"])
    assert proc2.stop(signal.SIGTERM) == 0


# --- reflector ---------------------------------------------------------------------------------------------------

async def observe_and_reflect(client: AsyncClient, sessions: list[str]) -> dict[str, Any]:
    for session in sessions:
        assert (await client.call("workers_run", name="observer", session_id=session))["outcome"] == "ok"
    return await client.call("workers_run", name="reflector", project=PROJECT)


async def supports_of(d: Daemon, memory_id: int) -> list[int]:
    rows = await db_rows(d, "SELECT src_id FROM edges WHERE dst_type = 'memory' AND dst_id = ? AND type = 'supports'"
                                " ORDER BY src_id",
                         (memory_id,))
    return [r[0] for r in rows]


async def test_a_constraint_repeated_in_three_sessions_is_one_memory_with_three_supports(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        rule = "Never commit directly to main, always open a pull request."
        for n, session in enumerate(("a", "b", "c")):
            await ingest(client, [user(session, f"{rule} Then bump the version for release {n}.",
                                       1_700_000_000 + n * 86400)])
        result = await observe_and_reflect(client, ["a", "b", "c"])
        assert result["outcome"] == "ok"
        rules = [m for m in await memories(client) if m["kind"] in ("constraint", "preference")
                 and m["archived_at"] is None and "commit directly to main" in m["text"]]
        assert len(rules) == 1, rules
        supporters = await supports_of(d, rules[0]["id"])
        assert len(supporters) == 3
        sessions = await db_rows(d, f"SELECT DISTINCT session_id FROM memories WHERE id IN"
                                    f" ({','.join(map(str, supporters))})")
        assert {r[0] for r in sessions} == {"a", "b", "c"}
        assert rules[0]["hits"] >= 2
        # Reflecting again adds nothing: the watermark passed these observations.
        again = await client.call("workers_run", name="reflector", project=PROJECT)
        assert again["outcome"] == "noop" and await supports_of(d, rules[0]["id"]) == supporters


async def test_a_newer_decision_supersedes_the_older_one(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, [assistant("d1", "I'll use SQLite for the job queue because it needs no server.",
                                        1_700_000_000)])
        await observe_and_reflect(client, ["d1"])
        await ingest(client, [assistant("d2", "I'll switch the job queue to Postgres instead of SQLite because"
                                              " we need concurrent writers.", 1_700_500_000)])
        await observe_and_reflect(client, ["d2"])
        decisions = {m["text"]: m for m in await memories(client, kind="decision")}
        old = next(m for t, m in decisions.items() if t.startswith("I'll use SQLite"))
        new = next(m for t, m in decisions.items() if "Postgres" in t)
        assert old["superseded_by"] == new["id"] and old["archived_at"] is None  # kept, never deleted
        assert new["superseded_by"] is None
        edge = await db_rows(d, "SELECT type FROM edges WHERE src_type = 'memory' AND src_id = ?"
                                " AND dst_type = 'memory' AND dst_id = ?", (new["id"], old["id"]))
        assert [r[0] for r in edge] == ["supersedes"]
        assert (await client.call("detail", id=old["id"]))["memories"][0]["superseded_by"] == new["id"]


async def test_a_memory_forgotten_between_the_reflectors_read_and_its_write_gets_no_support(monkeypatch, home) -> None:
    """The reflector plans a chunk from a snapshot read outside its write transaction. If a memory the plan merges
    into is forgotten before the write, the write is refused and the chunk planned again: the forgotten memory gets no
    support, and the observation makes a new memory, as if it had been reflected after the forget."""
    async with loomd(monkeypatch, home) as (d, client):
        rule = "Never commit directly to main, always open a pull request."
        await ingest(client, [user("f1", rule, 1_700_000_000)])
        await observe_and_reflect(client, ["f1"])
        kept = [m for m in await memories(client) if m["kind"] == "constraint" and m["text"] == rule]
        assert len(kept) == 1
        before = await supports_of(d, kept[0]["id"])
        await ingest(client, [user("f2", rule, 1_700_086_400)])
        assert (await client.call("workers_run", name="observer", session_id="f2"))["outcome"] == "ok"
        # The reflector's two steps, with the forget between them (a run interleaves them with whatever commits).
        conn = connect_sync(home / "loomd.db")
        chunk = read_snapshot(conn, PROJECT)
        conn.close()
        assert chunk is not None
        plan = plan_chunk(chunk, frozenset())
        assert [step.target for step in plan.steps] == [kept[0]["id"]]  # it would merge into the rule
        assert (await client.call("forget", id=kept[0]["id"], reason="test"))["archived"] == 1
        report = RunReport()
        refused = await d.scheduler.ctx.commit(False, functools.partial(Reflector().apply, plan, report=report,
                                                                        dry_run=False))
        assert refused is None and report.output == []
        # Planned again (here through the last resort, read, planned and written in one transaction).
        changed, read, made = await d.scheduler.ctx.commit(False, functools.partial(
            Reflector().reflect, project=PROJECT, off=frozenset(), report=report, dry_run=False))
        assert (changed, read, len(made)) == (1, 1, 1)
        assert await supports_of(d, kept[0]["id"]) == before  # the forgotten memory got nothing
        live = [m for m in await memories(client) if m["kind"] == "constraint" and m["text"] == rule
                and m["archived_at"] is None]
        assert len(live) == 1 and live[0]["id"] != kept[0]["id"]
        observation = await db_rows(d, "SELECT id FROM memories WHERE session_id = 'f2' AND kind = 'observation'")
        assert await supports_of(d, live[0]["id"]) == [observation[0][0]]


async def test_a_reflector_run_cancelled_mid_read_closes_its_connection_behind_the_read(home: Path) -> None:
    """The reflector reads on a connection of its own (`open_reader`), on that connection's thread (`on_thread`). A
    run cancelled while a read is on the thread (the daemon stopping: `Scheduler.stop`) closes the connection behind
    the read, never under it: closed from another thread, the read's statements were freed while it stepped them (a
    general protection fault in SQLite's `sqlite3Error` took a test process down in CI)."""
    path = home / "reads.db"
    setup = connect_sync(path)
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(1000)])
    setup.close()
    conn = await open_reader(path, busy_timeout_ms=1000)
    inside, release, seen = threading.Event(), threading.Event(), []

    def read(c: sqlite3.Connection) -> None:
        cursor = c.execute("SELECT x FROM t ORDER BY x")
        first = cursor.fetchone()[0]
        inside.set()
        release.wait(10)  # the read is still stepping its statement when the run is cancelled
        seen.append(first + len(cursor.fetchall()))

    run = asyncio.create_task(on_thread(conn, read))
    assert await asyncio.to_thread(inside.wait, 10)
    run.cancel()
    closing = asyncio.create_task(conn.close())  # what the run's `finally` does
    await asyncio.sleep(0.2)
    assert not closing.done() and not seen  # queued behind the read
    release.set()
    await asyncio.wait_for(closing, 10)
    assert seen == [999]  # the read went on to its end, then the connection closed
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_a_contradiction_is_linked_and_both_sides_kept(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, [user("p1", "Always squash commits before merging a branch.", 1_700_000_000)])
        await observe_and_reflect(client, ["p1"])
        await ingest(client, [user("p2", "Never squash commits before merging a branch.", 1_700_100_000)])
        await observe_and_reflect(client, ["p2"])
        rules = {m["text"]: m for m in await memories(client, kind="constraint") if m["archived_at"] is None}
        always, never = rules["Always squash commits before merging a branch."], \
            rules["Never squash commits before merging a branch."]
        links = await db_rows(d, "SELECT src_id, dst_id FROM edges WHERE type = 'contradicts' AND dst_type = 'memory'")
        assert (never["id"], always["id"]) in [tuple(r) for r in links]
        assert always["superseded_by"] is None and always["archived_at"] is None


# --- dropper, GC, working set ------------------------------------------------------------------------------------

async def test_dropper_and_gc_never_touch_the_working_set(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, observations_pool_max_tokens=60, observations_pool_target_tokens=10,
                     project_memory_cap=8, event_ttl_days=1) as (d, client):
        now = time.time()
        old = now - 5 * 86400
        sessions = [f"g{i}" for i in range(4)]
        for n, session in enumerate(sessions):
            await ingest(client, [user(session, f"Never use print for logging, use the logging module ({n}).", old),
                                  user(session, "Make sure every migration runs inside one transaction please.",
                                       old + 1)])
        await observe_and_reflect(client, sessions)
        observations = await memories(client, kind="observation")
        assert len(observations) >= 8
        injected, hit = observations[0]["id"], observations[1]["id"]
        stored = [(await client.call("store", text=f"Fact number {i} about the build", project=PROJECT,
                                     importance=0.1))["id"] for i in range(6)]
        expired = (await client.call("store", text="Temporary: the CI runner is down today", project=PROJECT,
                                     expires=now - 10))["id"]
        task = await client.call("task_create", title="Ship the uploader retry", project=PROJECT)
        await client.call("task_update", id=task["id"], evidence={"memory": [stored[0]]})
        async with d.store.atomic() as db:
            await db.execute("UPDATE sessions SET injected = ?, last_seen = ? WHERE id = 'g0'",
                             (json.dumps([injected, stored[1]]), now))
            await db.execute("UPDATE memories SET last_hit = ? WHERE id = ?", (now, hit))
            await db.execute("INSERT INTO edges (src_type, src_id, dst_type, dst_id, type, created)"
                             " VALUES ('memory', ?, 'memory', 99999, 'relates_to', ?)", (stored[2], now))
        protected = {injected, hit, stored[0], stored[1], task["id"]}

        dropped = await client.call("workers_run", name="dropper", project=PROJECT)
        assert dropped["outcome"] == "ok" and dropped["items_out"] > 0
        gc = await client.call("workers_run", name="gc")
        assert gc["outcome"] == "ok"
        actions = {o["action"] for o in gc["output"]}
        assert {"archive", "dangling_edges_removed", "events_purged"} <= actions

        # Ids with gaps: the old sessions' evidence passages went with their events (event_ttl_days).
        ids = [r[0] for r in await db_rows(d, "SELECT id FROM memories ORDER BY id")]
        everything = (await client.call("detail", id=ids))["memories"]
        archived = [m for m in everything if m["archived_at"] is not None]
        assert archived and not protected & {m["id"] for m in archived}
        assert any(m["id"] == expired for m in archived)
        active = [m for m in everything if m["archived_at"] is None]
        assert len(active) <= 8 + len(protected)
        # Every archived id is still there, with its text, through `detail`.
        fetched = (await client.call("detail", id=[m["id"] for m in archived]))["memories"]
        assert [m["id"] for m in fetched] == [m["id"] for m in archived] and all(m["text"] for m in fetched)
        assert await d.store.scalar("SELECT count(*) FROM edges WHERE dst_type = 'memory' AND dst_id = 99999") == 0
        # Old events the observer passed: cited ones keep their row without payload, the others are gone.
        left = await db_rows(d, "SELECT payload FROM events WHERE session_id IN ('g0','g1','g2','g3')")
        assert left and all(json.loads(r[0]) == {"purged": True} for r in left)
        assert await d.store.scalar("SELECT count(*) FROM memory_sources s LEFT JOIN events e ON e.id = s.event_id"
                                    " WHERE e.id IS NULL") == 0


async def test_archived_memories_are_deleted_only_under_a_retention_the_user_set(monkeypatch, home) -> None:
    """Archive-only by default: GC keeps an archived memory however old. With `archived_ttl_days` set, one
    archived longer ago than that is deleted with its sources and edges (what lets a store's size stay constant);
    one archived recently stays, fetchable."""
    stored: list[int] = []
    for ttl in (0, 1):
        async with loomd(monkeypatch, home, archived_ttl_days=ttl) as (d, client):
            # One session's: deleting one refreshes its neighbours' context.
            old, recent, live = [(await client.call("store", text=f"Build fact {ttl}-{i}: the cache lives in /var",
                                                     project=PROJECT, session_id=f"retention-{ttl}"))["id"]
                                 for i in range(3)]
            stored += [old, recent, live]
            await client.call("forget", id=[old, recent])
            async with d.store.atomic() as db:
                await db.execute("UPDATE memories SET archived_at = ? WHERE id = ?", (time.time() - 3 * 86400, old))
            gc = await client.call("workers_run", name="gc")
            assert gc["outcome"] == ("ok" if ttl else "noop")
            left = {m["id"] for m in (await client.call("detail", id=[recent, live]))["memories"]}
            assert left == {recent, live}
            gone = await d.store.scalar("SELECT count(*) = 0 FROM memories WHERE id = ?", (old,))
            assert bool(gone) == (ttl > 0)
            assert ({"archived_deleted"} <= {o["action"] for o in gc["output"]}) == (ttl > 0)
            assert await d.store.scalar("SELECT count(*) FROM memory_sources s LEFT JOIN memories m"
                                        " ON m.id = s.memory_id WHERE m.id IS NULL") == 0


async def test_events_are_purged_only_after_the_observer_passed_them(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, event_ttl_days=1) as (d, client):
        old = time.time() - 3 * 86400
        await ingest(client, [user("e1", "Please tidy the README headings.", old)])
        await client.call("workers_run", name="gc")
        assert await d.store.scalar("SELECT count(*) FROM events WHERE session_id = 'e1'") == 1
        await client.call("workers_run", name="observer", session_id="e1")
        await client.call("workers_run", name="gc")
        payloads = [r[0] for r in await db_rows(d, "SELECT payload FROM events WHERE session_id = 'e1'")]
        assert payloads in ([], ['{"purged": true}'])


async def test_a_restated_memory_keeps_only_its_first_and_latest_expired_sources(monkeypatch, home) -> None:
    """A rule the user restates in every session is one memory with a link to each restatement. Under
    `event_ttl_days` it keeps the first and the latest of its expired sources and all its recent ones; the rest lose
    the citation and their events go (kept, a memory in use would hold every event that ever repeated it). Without
    a retention every link stays."""
    rule = "Never edit the generated files under gen/; change the templates instead."
    old, now = time.time() - 9 * 86400, time.time()
    events = [user(f"r{i}", rule, old + i * 86400) for i in range(6)] + [user("r-now", rule, now - 60)]

    async def links(d: Daemon) -> list[str]:
        rows = await db_rows(d, "SELECT e.session_id FROM memories m JOIN memory_sources s ON s.memory_id = m.id"
                                " JOIN events e ON e.id = s.event_id WHERE m.kind = 'constraint' ORDER BY e.id")
        return [r[0] for r in rows]

    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, events)
        for i in [*range(6), "-now"]:
            await client.call("workers_run", name="observer", session_id=f"r{i}")
        assert await d.store.scalar("SELECT count(*) FROM memories WHERE kind = 'constraint'") == 1
        await client.call("workers_run", name="gc")
        assert await links(d) == [f"r{i}" for i in range(6)] + ["r-now"]
    async with loomd(monkeypatch, home, event_ttl_days=1, archived_ttl_days=1) as (d, client):
        async with d.store.atomic() as db:  # each session's own observation, archived long ago: deleted
            await db.execute("UPDATE memories SET archived_at = ? WHERE kind = 'observation'", (old,))
        gc = await client.call("workers_run", name="gc")
        assert {"sources_thinned", "events_purged"} <= {o["action"] for o in gc["output"]}
        assert await links(d) == ["r0", "r-now"]
        kept = await db_rows(d, "SELECT session_id FROM events WHERE session_id LIKE 'r%' ORDER BY id")
        assert [r[0] for r in kept] == ["r0", "r-now"]  # the uncited expired events are deleted
        assert await d.store.scalar("SELECT hits FROM memories WHERE kind = 'constraint'") >= 6


async def test_gcs_reads_in_its_transaction_take_an_index_not_every_memory(monkeypatch, home) -> None:
    """GC holds the writer (every hook's commit waits behind it) for the reads it runs in its transaction: each must
    find its few rows (hit lately, open tasks, an expiry) by an index, not read every memory (50 ms a read at 100k
    memories). Checked on SQLite's own plan for every statement GC ran, not on a clock."""
    async with loomd(monkeypatch, home) as (d, client):
        for i in range(30):
            await client.call("store", text=f"Fact {i}: the build cache lives under .cache/{i}", project=PROJECT)
        await client.call("store", text="Temporary: the CI runner is down today", project=PROJECT, expires=1.0)
        task = await client.call("task_create", title="Ship the uploader retry", project=PROJECT)
        async with d.store.atomic() as db:
            await db.execute("UPDATE memories SET last_hit = ? WHERE id = ?", (time.time(), task["id"]))
        seen: list[str] = []
        await d.store.writer._execute(d.store.writer._conn.set_trace_callback, seen.append)
        try:
            gc = await client.call("workers_run", name="gc")
        finally:
            await d.store.writer._execute(d.store.writer._conn.set_trace_callback, None)
        assert gc["outcome"] == "ok" and "archive" in {o["action"] for o in gc["output"]}
        reads = [sql for sql in seen if sql.lstrip().upper().startswith("SELECT") and "FROM memories" in sql]
        assert len(reads) >= 4, seen  # the working set's, the expiry's, the cap's, the stale tasks'
        scans = {}
        for sql in reads:
            plan = [r[3] for r in await d.store.fetchall("EXPLAIN QUERY PLAN " + sql)]
            if any(step.startswith("SCAN memories") and "INDEX" not in step for step in plan):
                scans[sql] = plan
        assert not scans, scans


async def shown(client: AsyncClient, session: str, event: str, cwd: str, **extra: Any) -> str:
    """A hook with context, the way the shim sends it: what the agent was shown."""
    raw = json.dumps({"session_id": session, "transcript_path": f"{cwd}/{session}.jsonl", "cwd": cwd,
                      "hook_event_name": event, **extra}).encode()
    reply = await client.call("hook", raw=raw, event=event, context=True, deadline_ms=5000)
    return str(reply["stdout"])


async def test_gc_prunes_an_idle_sessions_record_and_old_runs_but_keeps_what_is_needed(monkeypatch, home) -> None:
    """A worker runs every interval, work or not: GC keeps the runs' log `job_history_days` (each worker's latest
    run and latest error always). Under `event_ttl_days`, a session quiet longer than it and the working set loses
    the blocks it was shown and its frozen blocks; its row stays with its transcript offset (a resumed session must
    not re-read its transcript from byte 0) and the memories it was shown. Without a retention, all of it stays."""
    cwd = str(home / "work")
    for ttl in (0, 1):
        async with loomd(monkeypatch, home, event_ttl_days=ttl) as (d, client):
            await client.call("store", text=f"Never push directly to main; open a pull request ({ttl})",
                              kind="constraint", cwd=cwd)
            idle, live = f"idle-{ttl}", f"live-{ttl}"
            for session in (idle, live):
                assert await shown(client, session, "SessionStart", cwd, source="startup")
                await shown(client, session, "UserPromptSubmit", cwd, prompt="how do we push to main, again?")
            for _ in range(100):  # what a session was shown is noted just after the hook's answer
                noted = await db_rows(d, "SELECT count(*) FROM sessions WHERE id IN (?, ?) AND start_block IS NOT"
                                         " NULL AND injected != '[]'", (idle, live))
                if noted[0][0] == 2:
                    break
                await asyncio.sleep(0.02)
            for name in ("digest", "dropper", "digest", "dropper", "digest"):
                await client.call("workers_run", name=name)
            old = time.time() - 30 * 86400
            async with d.store.atomic() as db:
                await db.execute("UPDATE sessions SET last_seen = ?, transcript_offset = 1234 WHERE id = ?",
                                 (old, idle))
                await db.execute("UPDATE jobs SET started = ?, ended = ?", (old, old + 1))
                # An old failed run of the digest, older than its latest run: `loom workers` shows it.
                await db.execute("UPDATE jobs SET outcome = 'error', error = 'disk full' WHERE id ="
                                 " (SELECT min(id) FROM jobs WHERE worker = 'digest')")
            runs = await db_rows(d, "SELECT worker, id, outcome FROM jobs ORDER BY id")
            latest = {w: i for w, i, _ in runs if w != "gc"}  # the run below is gc's latest
            failed = {w: i for w, i, o in runs if o == "error"}
            before = {s: await db_rows(d, "SELECT start_block, injected, transcript_offset FROM sessions WHERE id = ?",
                                       (s,)) for s in (idle, live)}
            blocks = {s: (await db_rows(d, "SELECT count(*) FROM injections WHERE session_id = ?", (s,)))[0][0]
                      for s in (idle, live)}
            assert all(blocks.values())

            gc = await client.call("workers_run", name="gc")
            assert gc["outcome"] == "ok"
            left = {r[0] for r in await db_rows(d, "SELECT id FROM jobs WHERE started < ?", (old + 10,))}
            assert left == set(latest.values()) | set(failed.values()) and failed
            assert await d.store.scalar("SELECT count(*) FROM jobs WHERE id = ?", (gc["job_id"],)) == 1
            after = {s: await db_rows(d, "SELECT start_block, injected, transcript_offset FROM sessions WHERE id = ?",
                                      (s,)) for s in (idle, live)}
            assert [tuple(r) for r in after[live]] == [tuple(r) for r in before[live]]
            ((block, injected, offset),) = after[idle]
            assert (injected, offset) == (before[idle][0][1], 1234) and json.loads(injected)
            assert (block is None) == bool(ttl)
            assert (await db_rows(d, "SELECT count(*) FROM injections WHERE session_id = ?", (idle,)))[0][0] == (
                0 if ttl else blocks[idle])
            assert (await db_rows(d, "SELECT count(*) FROM injections WHERE session_id = ?", (live,)))[0][0] == (
                blocks[live])
            # Resumed after all, the session gets a start block again.
            assert await shown(client, idle, "SessionStart", cwd, source="resume")


async def sessions_cited(d: Daemon, memory_id: int) -> set[str]:
    rows = await db_rows(d, "SELECT e.session_id FROM memory_sources s JOIN events e ON e.id = s.event_id"
                            " WHERE s.memory_id = ?", (memory_id,))
    return {r[0] for r in rows}


async def test_evidence_passages_go_with_their_events_only_under_a_retention(monkeypatch, home) -> None:
    """Evidence passages are their events' text. By default GC keeps both for good; with `event_ttl_days` set,
    a passage whose events are all past it and observed is deleted with all it indexes (full text, vector, its
    row in the in-memory index, pairs, edges), so its events lose that citation and go too; a passage seen again
    recently (the same text) stays, citing only its recent events. A passage in the working set stays, and so does
    what is recent or not yet observed."""
    old, now = time.time() - 3 * 86400, time.time()

    async def state(d: Daemon) -> dict[str, Any]:
        rows = await db_rows(d, "SELECT session_id, id FROM memories WHERE kind = 'evidence'")
        events = await db_rows(d, "SELECT session_id, count(*), sum(payload = '{\"purged\": true}') FROM events"
                                  " GROUP BY session_id")
        return {"evidence": {s: sorted(i for t, i in rows if t == s) for s in ("v-old", "v-chat", "v-new")},
                "events": {r[0]: (r[1], r[2]) for r in events}}

    async with loomd(monkeypatch, home, embedder="local") as (d, client):
        recent = [user("v-new", "Deploy the staging build with the new cache settings, please.", now - 60),
                  *shell("v-new", "make deploy-staging", "deployed build 42 to staging in 31s", now - 50),
                  assistant("v-new", "Done. The uploader now retries three times with exponential backoff.", now - 40)]
        chat = [user("v-chat", "What does the transfer module do exactly?", old),
                assistant("v-chat", "It copies the nightly exports between the two storage buckets.", old + 1)]
        await ingest(client, work_session("v-old", old) + chat + recent
                     + [user("v-later", "Rename the uploader module to transfer.", old)])
        for session in ("v-old", "v-chat", "v-new"):
            await client.call("workers_run", name="observer", session_id=session)
        await caught_up(client)
        before = await state(d)
        assert all(before["evidence"].values()) and before["events"]["v-old"][1] == 0
        # The same closing message in both sessions: one passage (deduplicated), citing both.
        ((shared,),) = await db_rows(d, "SELECT id FROM memories WHERE kind = 'evidence'"
                                        " AND text LIKE '%retries three times%'")
        assert await sessions_cited(d, shared) == {"v-old", "v-new"}
        gc = await client.call("workers_run", name="gc")
        assert "evidence_expired" not in {o["action"] for o in gc["output"]}
        assert await state(d) == before  # no retention set: nothing removed, no payload dropped

    kept, *expired = [i for i in before["evidence"]["v-old"] if i != shared]
    expired += before["evidence"]["v-chat"]
    terms = "uploader OR tenacity OR pytest OR exports OR buckets"
    async with loomd(monkeypatch, home, embedder="local", event_ttl_days=1, archived_ttl_days=1) as (d, client):
        await caught_up(client)
        assert all(i in d.vectors.index for i in expired)
        assert set(expired) <= {r[0] for r in await db_rows(d, "SELECT rowid FROM memories_fts WHERE memories_fts"
                                                               " MATCH ?", (terms,))}
        async with d.store.atomic() as db:  # `kept` was shown in a session active now: the working set
            await db.execute("UPDATE sessions SET injected = ?, last_seen = ? WHERE id = 'v-new'",
                             (json.dumps([kept]), now))
            # What was distilled from v-chat was archived long ago: deleted, it leaves only passages citing it.
            await db.execute("UPDATE memories SET archived_at = ? WHERE session_id = 'v-chat' AND kind != 'evidence'",
                             (old,))
        gc = await client.call("workers_run", name="gc")
        after = await state(d)
        assert after["evidence"] == {"v-old": sorted([kept, shared]), "v-chat": [],
                                     "v-new": before["evidence"]["v-new"]}
        assert await sessions_cited(d, shared) == {"v-new"}
        assert {"evidence_expired", "events_purged"} <= {o["action"] for o in gc["output"]}
        gone = json.dumps(expired)
        for table, column in (("memory_sources", "memory_id"), ("memory_vectors", "memory_id"), ("memory_near", "a"),
                              ("memory_near", "b"), ("edges", "src_type = 'memory' AND src_id"),
                              ("edges", "dst_type = 'memory' AND dst_id")):
            assert await d.store.scalar(f"SELECT count(*) FROM {table} WHERE {column} IN"
                                        " (SELECT value FROM json_each(?))", (gone,)) == 0, table
        # Out of the full-text index's own entries too (its content rows are the memories themselves).
        assert not set(expired) & {r[0] for r in await db_rows(d, "SELECT rowid FROM memories_fts WHERE memories_fts"
                                                                   " MATCH ?", (terms,))}
        assert not any(i in d.vectors.index for i in expired) and kept in d.vectors.index
        # Old observed events: those a memory still cites keep their row (payload dropped), the others (all of
        # v-chat's) are deleted.
        cited = await d.store.scalar("SELECT count(DISTINCT s.event_id) FROM memory_sources s JOIN events e"
                                     " ON e.id = s.event_id WHERE e.session_id = 'v-old'")
        assert after["events"]["v-old"] == (cited, cited) and "v-chat" not in after["events"]
        assert after["events"]["v-new"] == before["events"]["v-new"]  # recent
        assert after["events"]["v-later"] == before["events"]["v-later"]  # old, but not observed yet


# --- digest --------------------------------------------------------------------------------------------------------

async def test_digest_never_exceeds_its_budget(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, reflection_context_max_tokens=120) as (d, client):
        verbatim, budget = budgets(120)
        kinds = ("decision", "constraint", "procedure", "insight", "fact")
        for i in range(40):
            await client.call("store", text=f"Memory {i}: " + "a fairly long durable lesson about the build " * 2,
                              kind=kinds[i % len(kinds)], project=PROJECT, importance=0.3 + (i % 7) / 10)
        first = await client.call("workers_run", name="digest", project=PROJECT)
        digests = await memories(client, kind="digest")
        assert len(digests) == 1 and len(digests[0]["text"]) <= budget
        assert digests[0]["text"].startswith("Digest of ")
        assert [o for o in first["output"] if o["action"] == "digest"][0]["chars"] <= budget
        mark = json.loads(await d.store.scalar("SELECT value FROM checkpoints WHERE name = ?", (f"digest:{PROJECT}",)))
        assert mark["digest_id"] == digests[0]["id"] and mark["folded"] > 0 and mark["watermark"]
        assert (await client.call("workers_run", name="digest", project=PROJECT))["outcome"] == "noop"
        folded_before = await derived_from(d, digests[0]["id"])
        # A long new memory takes verbatim room: the oldest verbatim one is folded, and the project's one digest is
        # rewritten in place (it is derived data: no archived copy, no second set of edges).
        await client.call("store", text="A brand new decision: deploy from tags only, " + "never from branches " * 6,
                          kind="decision", project=PROJECT)
        await client.call("workers_run", name="digest", project=PROJECT)
        (digest,) = await memories(client, kind="digest")
        assert digest["id"] == digests[0]["id"] and digest["archived_at"] is None
        assert digest["text"] != digests[0]["text"] and len(digest["text"]) <= budget
        folded = await derived_from(d, digest["id"])
        assert set(folded_before) < set(folded) and len(set(folded)) == len(folded)  # more folded, each once
        assert verbatim + budget == 120 * 4


async def derived_from(d: Daemon, digest_id: int) -> list[int]:
    rows = await db_rows(d, "SELECT dst_id FROM edges WHERE src_type = 'memory' AND src_id = ? AND dst_type = 'memory'"
                            " AND type = 'derives_from' ORDER BY dst_id", (digest_id,))
    return [r[0] for r in rows]


@pytest.mark.parametrize("budget", [0, 1, 5, 39, 40, 41, 80, 157, 400, 4000])
def test_render_digest_fits_any_budget(budget: int) -> None:
    rows = [{"id": i, "kind": ("decision", "constraint", "weird")[i % 3], "text": "x" * (i * 37 % 300 + 1),
             "importance": 0.5, "hits": i % 4, "created": 1.7e9 + i, "updated": 1.7e9 + i} for i in range(1, 60)]
    text = render_digest(rows, budget)
    assert len(text) <= budget
    assert (text == "") == (budget == 0)


# --- scheduler, triggers, passive, ops and CLI --------------------------------------------------------------------

async def wait_for_job(d: Daemon, worker: str, within_s: float = 10.0) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        rows = await db_rows(d, "SELECT outcome, trigger FROM jobs WHERE worker = ? AND outcome != 'running'"
                                " ORDER BY id DESC LIMIT 1", (worker,))
        if rows:
            return rows[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {worker} job within {within_s}s")


async def test_session_end_and_token_threshold_wake_the_workers(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, passive=False, worker_interval_s=3600, observe_after_tokens=200) as (d, client):
        status = await client.call("workers")
        assert not status["passive"] and [w["name"] for w in status["workers"]] == [
            "observer", "reflector", "dropper", "digest", "gc", "sync"]
        # sync is scheduled only with a shared server (tests/test_shared.py).
        scheduled = {w["name"]: w["next_run"] for w in status["workers"]}
        assert scheduled.pop("sync") is None
        assert all(t and t > time.time() + 3000 for t in scheduled.values())
        await ingest(client, [*work_session("t1", 1_700_000_000),
                              ev("t1", "SessionEnd", {"reason": "exit"}, 1_700_000_100, source="hook")])
        assert tuple(await wait_for_job(d, "observer")) == ("ok", "event")
        assert tuple(await wait_for_job(d, "reflector")) == ("ok", "event")  # the observer's output woke it
        await wait_for_job(d, "digest")
        assert any(m["kind"] == "constraint" for m in await memories(client))
        # Tokens: a long session with no end is observed once it passes observe_after_tokens.
        await ingest(client, [user("t2", "Explain the storage layer in detail. " * 30, 1_700_000_200)])
        deadline = time.monotonic() + 10
        while not await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'observer:t2'"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)


async def test_a_wake_while_the_workers_are_held_does_not_run_the_job_to_put_it_off(monkeypatch, home) -> None:
    """While runs are held (hooks stream, an import runs), a wake (one per commit of an import) sets the worker's
    next try HOLD_RETRY_S away, as a held run would put itself off, instead of a run now that only does that; more
    wakes before that try leave it where it is. Once nothing holds them, a wake runs the worker at once."""
    async with loomd(monkeypatch, home, passive=False, worker_interval_s=3600) as (d, client):
        aps = d.scheduler.aps
        assert aps is not None
        d.writer.live.arrived()  # a live event now: held for LIVE_QUIET_S
        assert d.scheduler.hold()
        before = dt.datetime.now(dt.UTC)
        d.scheduler.wake("observer", "w1")
        first = aps.get_job("observer").next_run_time
        assert first >= before + dt.timedelta(seconds=HOLD_RETRY_S)
        d.scheduler.wake("observer", "w2")
        assert aps.get_job("observer").next_run_time == first and d.scheduler.pending["observer"] >= {"w1", "w2"}
        await asyncio.sleep(LIVE_QUIET_S + 0.1)  # the stream has paused
        assert not d.scheduler.hold()
        now = dt.datetime.now(dt.UTC)
        d.scheduler.wake("observer", "w3")
        assert aps.get_job("observer").next_run_time <= now + dt.timedelta(seconds=1)


async def test_due_sessions_are_the_woken_the_ended_and_those_past_the_token_threshold_with_events_pending(
        monkeypatch, home) -> None:
    """What a run observes (`Observer.due_sessions`, read from index entries and, for live sessions only, their
    pending tokens): a session with events past its watermark that was woken, has ended, or holds
    observe_after_tokens; not a live one under the threshold, nor one observed up to its last event."""
    async with loomd(monkeypatch, home, passive=True, observe_after_tokens=200, observe_idle_s=3600) as (d, client):
        t0 = 1_700_000_000
        await ingest(client, [user("few", "Rename the helper.", t0), user("woken", "Rename the helper.", t0),
                              user("many", "Explain the storage layer in detail. " * 30, t0),
                              user("ended", "Rename the helper.", t0),
                              ev("ended", "SessionEnd", {"reason": "exit"}, t0 + 1, source="hook"),
                              user("done", "Explain the storage layer in detail. " * 30, t0)])
        assert (await client.call("workers_run", name="observer", session_id="done"))["outcome"] == "ok"
        observer = d.scheduler.workers["observer"]
        assert isinstance(observer, Observer)
        assert sorted(await observer.due_sessions(d.scheduler.ctx, frozenset({"woken"}))) == ["ended", "many", "woken"]
        assert sorted(await observer.due_sessions(d.scheduler.ctx, frozenset())) == ["ended", "many"]


async def test_a_run_held_by_a_pause_in_hooks_is_tried_right_after_the_pause_not_a_retry_later(monkeypatch,
                                                                                             home) -> None:
    """A wake held by live hooks that will have paused LIVE_QUIET_S sooner than HOLD_RETRY_S from now is tried right
    after the pause ends: a run let start anywhere up to HOLD_RETRY_S later met the next hook of an agent whose hooks
    come about LIVE_QUIET_S apart. It runs once the pause allows it, not before."""
    async with loomd(monkeypatch, home, passive=False, worker_interval_s=3600) as (d, client):
        aps = d.scheduler.aps
        assert aps is not None
        left = 0.1
        d.writer.live.arrived(time.monotonic() - (LIVE_QUIET_S - left))  # the last hook came 0.4 s ago
        pause_ends = time.time() + left
        assert d.scheduler.hold()
        d.scheduler.wake("observer", "p1")
        tried = aps.get_job("observer").next_run_time.timestamp()
        assert pause_ends <= tried < pause_ends + 0.05 < time.time() + HOLD_RETRY_S
        deadline = time.monotonic() + 5
        while (started := await d.store.scalar("SELECT max(started) FROM jobs WHERE worker = 'observer'")) is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert pause_ends <= started < pause_ends + 0.2


async def test_passive_means_no_background_work(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, passive=True, observe_after_tokens=10) as (d, client):
        await ingest(client, [*work_session("q1", 1_700_000_000),
                              ev("q1", "SessionEnd", {"reason": "exit"}, 1_700_000_100, source="hook")])
        await asyncio.sleep(0.3)
        assert await d.store.scalar("SELECT count(*) FROM jobs") == 0
        status = await client.call("workers")
        assert status["passive"] and all(w["next_run"] is None for w in status["workers"])
        assert (await client.call("workers_run", name="observer", session_id="q1"))["outcome"] == "ok"
        with pytest.raises(Exception, match="unknown worker"):
            await client.call("workers_run", name="nope")


async def test_cli_lists_and_runs_workers(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, work_session("cli", 1_700_000_000))
        runner = CliRunner()
        dry = await asyncio.to_thread(runner.invoke, cli_main, ["workers", "run", "observer", "--session", "cli",
                                                                "--dry-run"])
        assert dry.exit_code == 0, dry.output
        assert "dry_run" in dry.output and "constraint" in dry.output
        real = await asyncio.to_thread(runner.invoke, cli_main, ["workers", "run", "observer", "--session", "cli"])
        assert real.exit_code == 0 and "ok" in real.output
        listing = await asyncio.to_thread(runner.invoke, cli_main, ["workers"])
        assert listing.exit_code == 0 and "observer" in listing.output and "gc" in listing.output
        as_json = await asyncio.to_thread(runner.invoke, cli_main, ["workers", "--json"])
        assert json.loads(as_json.output)["workers"][0]["last_run"]["outcome"] == "ok"


# --- real sessions ----------------------------------------------------------------------------------------------

async def test_a_real_session_yields_useful_observations_and_reflections(monkeypatch, home) -> None:
    path = need_test_data("transcripts", "daaain-claude-code-log", "-src-deep-manifest",
                          "a7da6a22-facc-4fcd-8bab-f83c87862004.jsonl")
    async with loomd(monkeypatch, home) as (d, client):
        assert d.tailer is not None
        imported = await d.tailer.import_file(path)
        session = imported["sessions"][0]
        result = await client.call("workers_run", name="observer", session_id=session, final=True)
        assert result["outcome"] == "ok"
        obs = [m["text"] for m in await memories(client, kind="observation")]
        assert all(len(t) <= 200 for t in obs)
        assert any("pytest: command not found" in t and ".venv/bin/activate" in t for t in obs)
        assert any(t.startswith("Committed [master 70f2781]: feat: add support for tar archives") for t in obs)
        # The choice says what Option C is, not only its label.
        assert any(t.startswith('User chose "Option C: Extra field: Add CORRUPTED as a 4th tab-separated field')
                   for t in obs)
        # Where it stopped: the user's last words and the agent's last reply.
        assert [t for t in obs if t.startswith("Session stopped; the user last asked: Excellent work, thank you!; "
                                               "the agent last said: You're welcome! Here's a summary")]
        await client.call("workers_run", name="reflector", session_id=session)
        durable = {m["kind"]: m["text"] for m in await memories(client) if m["kind"] in ("insight", "decision")}
        assert "insight" in durable and "decision" in durable
        found = await client.call("search", query="pytest command not found virtual environment", limit=5)
        assert any(".venv" in r["text"] for r in found["results"])


async def test_the_users_own_words_outside_prompts_are_kept_and_start_the_next_session(monkeypatch, home) -> None:
    """The user speaks outside prompts too: a prompt queued while the agent worked (taken into the running turn, so
    only the queue line holds it), the words typed with a rejected plan, notes beside the options of Codex's
    questions. Each is the user's voice, and the next session's start block shows what they asked for."""
    queued = need_test_data("transcripts", "RyanLisse-big3", "logs", "chat.json")
    rejected = need_test_data("transcripts", "pookNast-loopkit", "logs", "chat.json")
    answered = need_test_data("transcripts", "AkashJana18-edgerunner", "codex-session.jsonl")
    async with loomd(monkeypatch, home) as (d, client):
        assert d.tailer is not None
        texts: list[str] = []
        starts: list[str] = []
        for path in (queued, rejected, answered):
            session = (await d.tailer.import_file(path))["sessions"][0]
            assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] \
                == "ok"
            for project in [r[0] for r in await db_rows(d, "SELECT DISTINCT project FROM memories")]:
                await client.call("workers_run", name="reflector", project=project)
            texts += [m["text"] for m in await memories(client, kind="observation", session_id=session)]
            project = (await db_rows(d, "SELECT project FROM events WHERE session_id = ? GROUP BY project"
                                        " ORDER BY count(*) DESC LIMIT 1", (session,)))[0][0]
            start = await client.call("context", kind="start", session_id=f"next-{session}", project=project)
            starts.append(start["text"])
        assert "also use tdd and serena and the mcp tools" in texts  # a preference, in the user's words
        assert any(t.startswith("User said instead of ExitPlanMode: Generate the plan/miletsonte contract")
                   for t in texts)
        assert any(t.startswith("User noted: Prioritize low-level systems design over AI wrappers") for t in texts)
        # A choice keeps the option's own words, not only its label.
        assert any(t.startswith('User chose "EdgeRunner (Recommended): Best balance of quant depth') and
                   t.endswith("for: Which idea should I turn into a decision-complete architecture and nine-day build"
                              " plan?") for t in texts)
        assert "also use tdd and serena" in starts[0]
        # What corrected the agent (the words given with the rejected plan) first, then the newest of what was asked.
        assert "Generate the plan/miletsonte contract" in starts[1], starts[1]
        assert "how do I explain how to use this" in starts[1]
        assert "Build EdgeRunner as a reusable trading engine" in starts[2]  # a note beside a chosen option


def test_a_compaction_summary_quotes_the_users_own_words() -> None:
    """Claude Code's compaction summary lists "All user messages" verbatim: the user's voice from the part of the
    session the transcript no longer holds, read as prompts are (a rule as a rule, an ask as an ask)."""
    summary = ("Summary:\n1. Primary Request and Intent:\n   The user asked to fix the failing CI checks.\n\n"
               "6. All user messages:\n   - \"fix the failing ci checks with this branch and ci\"\n"
               "   - \"make sure you commit and push to run on the latest\"\n\n"
               "7. Pending Tasks:\n   - Fix the remaining duplicate code findings in internal/errors/\n")
    out = observe([SourceEvent(1, "s", "compact_summary", 1.0, "claude", PROJECT, None, None, {"text": summary})],
                  final=True)
    said = {(o.type, o.text) for o in out}
    assert ("constraint", "make sure you commit and push to run on the latest") in said, said
    assert ("goal", "User asked (before compaction): fix the failing ci checks with this branch and ci") in said
    assert any(o.type == "todo" and "duplicate code findings" in o.text for o in out)


async def test_every_real_session_replays_into_observations_and_reflections(monkeypatch, home) -> None:
    root = need_test_data("transcripts")
    from loomd.ingest.transcript import detect_format

    files = sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl") and detect_format(p) is not None)
    async with loomd(monkeypatch, home) as (d, client):
        assert d.tailer is not None and d.scheduler is not None
        for path in files:
            await d.tailer.import_file(path)
        sessions = [r[0] for r in await db_rows(d, "SELECT id FROM sessions")]
        for session in sessions:
            assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] \
                in ("ok", "noop")
        for project in [r[0] for r in await db_rows(d, "SELECT DISTINCT project FROM memories")]:
            for name in ("reflector", "digest"):
                assert (await client.call("workers_run", name=name, project=project))["outcome"] in ("ok", "noop")
        talk = await db_rows(d, "SELECT DISTINCT session_id FROM events WHERE kind IN ('user_message',"
                                " 'assistant_message') AND payload NOT LIKE '%REDACTED_PROMPT%'")
        observed = {r[0] for r in await db_rows(d, "SELECT DISTINCT session_id FROM memories"
                                                   " WHERE kind = 'observation'")}
        assert {r[0] for r in talk} <= observed
        reflected = await d.store.scalar(
            "SELECT count(DISTINCT o.session_id) FROM edges e JOIN memories o ON o.id = e.src_id"
            " WHERE e.type = 'supports' AND e.src_type = 'memory' AND e.dst_type = 'memory'")
        assert reflected >= len(observed) // 2
        assert await d.store.scalar("SELECT count(*) FROM jobs WHERE outcome = 'error'") == 0
        # An observation is clipped to CLIP_CHARS, or to the end of a code span the clip would cut (`clip`).
        too_long = await d.store.scalar("SELECT count(*) FROM memories WHERE kind = 'observation'"
                                        " AND length(text) > ?", (CLIP_CHARS + CODE_SLACK + 1,))
        assert too_long == 0


def test_the_replay_script_prints_and_writes_json(tmp_path: Path) -> None:
    need_test_data("transcripts", "daaain-claude-code-log", "-src-deep-manifest")
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, "bench/replay.py", "--only=-src-deep-manifest/a7da", "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "observations (" in proc.stdout and "durable memories" in proc.stdout
    data = json.loads(out.read_text())
    [session] = data["sessions"]
    assert session["observations"] and session["durable"] and not data["failed_runs"]


# --- the user's switches: auto-capture, kinds never extracted, GC -------------------------------------------------

async def test_auto_capture_off_leaves_distilling_to_the_workers(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, auto_capture=False) as (_, client):
        await ingest(client, work_session("ac1", 1_700_000_000))
        assert [m for m in await memories(client) if m["origin"].startswith("capture:")] == []
        await observe_and_reflect(client, ["ac1"])
        assert any("logging module" in m["text"] for m in await memories(client, kind="constraint"))


async def test_auto_capture_on_captures_at_ingest(monkeypatch, home) -> None:
    """The control of the test above: the same session, the switch at its default."""
    async with loomd(monkeypatch, home) as (_, client):
        await ingest(client, work_session("ac2", 1_700_000_000))
        assert [m for m in await memories(client) if m["origin"].startswith("capture:")]


async def test_kinds_switched_off_are_never_extracted(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, extract_off="constraint, insight") as (_, client):
        await ingest(client, work_session("ko1", 1_700_000_000))
        await observe_and_reflect(client, ["ko1"])
        kinds = {m["kind"] for m in await memories(client) if m["archived_at"] is None}
        assert "constraint" not in kinds and "insight" not in kinds
        assert "observation" in kinds and "decision" in kinds  # everything else as before
        # The observation of the rule is kept (it is evidence of what was said), only the durable rule is not.
        assert any("logging module" in m["text"] for m in await memories(client, kind="observation"))


async def test_gc_off_runs_only_when_asked(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home, gc=False) as (d, client):
        stale = (await client.call("store", text="a note that expired long ago", cwd="/tmp", expires=1.0))["id"]
        scheduled = await d.scheduler.run("gc", trigger="interval")
        assert "gc is off" in scheduled["detail"]["skipped"]
        assert (await client.call("detail", id=stale))["memories"][0]["archived_at"] is None
        asked = await client.call("workers_run", name="gc")
        assert asked["outcome"] == "ok"
        assert (await client.call("detail", id=stale))["memories"][0]["archived_at"] is not None


@pytest.mark.parametrize("config, swept", [
    ('[project."proj-keep"]\ngc = false\n', {"proj-gc"}),  # on everywhere but where a project turns it off
    ('gc = false\n[project."proj-gc"]\ngc = true\n', {"proj-gc"}),  # off everywhere but where a project turns it on
])
async def test_a_project_turns_gc_off_or_on_for_itself(monkeypatch, home, config: str, swept: set[str]) -> None:
    (home / "config.toml").write_text(config)
    async with loomd(monkeypatch, home) as (d, client):
        stale = {p: (await client.call("store", text=f"a note of {p} that expired long ago", project=p,
                                       expires=1.0))["id"] for p in ("proj-keep", "proj-gc")}
        assert d.scheduler is not None
        scheduled = await d.scheduler.run("gc", trigger="interval")
        assert scheduled["outcome"] == "ok", scheduled
        shown = (await client.call("detail", id=list(stale.values())))["memories"]
        archived = {p for p, i in stale.items() for m in shown if m["id"] == i and m["archived_at"] is not None}
        assert archived == swept
        await client.call("workers_run", name="gc")  # asked for by hand: every project
        shown = (await client.call("detail", id=list(stale.values())))["memories"]
        assert all(m["archived_at"] is not None for m in shown)


async def test_a_project_sets_its_own_capture_and_kinds(monkeypatch, home) -> None:
    (home / "config.toml").write_text(f'[project."{PROJECT}"]\nauto_capture = false\nextract_off = "constraint"\n')
    async with loomd(monkeypatch, home) as (_, client):
        other = [{**e, "project": "proj-x", "key": e["key"] + "x"} for e in work_session("px1", 1_700_000_000)]
        await ingest(client, [*work_session("pw1", 1_700_000_000), *other])
        captured = {m["project"] for m in await memories(client) if m["origin"].startswith("capture:")}
        assert captured == {"proj-x"}  # the other project captures as before
        await observe_and_reflect(client, ["pw1", "px1"])
        await client.call("workers_run", name="reflector", project="proj-x")
        rules = {m["project"] for m in await memories(client, kind="constraint")}
        assert rules == {"proj-x"}
        shown = (await client.call("config"))[f'project."{PROJECT}".extract_off']
        assert shown["value"] == "constraint" and shown["source"].endswith("config.toml")


async def test_banned_kinds_are_archived_by_gc_and_a_project_may_lift_the_ban(monkeypatch, home) -> None:
    (home / "config.toml").write_text('extract_banned = "insight"\n[project."proj-x"]\nextract_banned = ""\n')
    async with loomd(monkeypatch, home) as (_, client):
        banned = (await client.call("store", text="Flaky tests come from shared tmp dirs", kind="insight",
                                    project=PROJECT))["id"]
        lifted = (await client.call("store", text="Flaky tests come from shared ports", kind="insight",
                                    project="proj-x"))["id"]
        kept = (await client.call("store", text="We deploy with make release", kind="procedure",
                                  project=PROJECT))["id"]
        assert (await client.call("workers_run", name="gc"))["outcome"] == "ok"
        shown = (await client.call("detail", id=[banned, lifted, kept]))["memories"]
        state = {m["id"]: m["archived_at"] for m in shown}
        assert state[banned] is not None and state[lifted] is None and state[kept] is None


def test_a_project_table_may_set_only_what_a_project_owns(tmp_path: Path) -> None:
    from loomd.config import load_config
    from loomd.errors import BadRequest

    (tmp_path / "config.toml").write_text('[project."proj-w"]\nembedder = "none"\n')
    with pytest.raises(BadRequest, match="cannot set 'embedder'; a project sets: auto_capture, gc, extract_off, "
                                         "extract_banned"):
        load_config({"LOOMD_HOME": str(tmp_path)})
    (tmp_path / "config.toml").write_text('project = "proj-w"\n')
    with pytest.raises(BadRequest, match=r"\[project\] must hold tables"):
        load_config({"LOOMD_HOME": str(tmp_path)})


async def test_status_says_how_long_each_holder_kept_the_writer(monkeypatch, home) -> None:
    async with loomd(monkeypatch, home) as (d, client):
        await ingest(client, long_session("h1", 1_700_000_000))
        run = await client.call("workers_run", name="observer", session_id="h1")
        holds = (await client.call("status"))["writer"]["holds"]
    passages = run["detail"]["evidence"]
    assert holds["events:live"]["n"] >= 1
    # the observer's run: its chunk in parts (passages, then observations), besides its job row's begin and end
    assert holds["worker:observer"]["n"] == 2 + math.ceil(passages / PASSAGES_PER_WRITE) + 1
    assert all(h["p50_ms"] <= h["p99_ms"] <= h["max_ms"] for h in holds.values())


def long_session(session: str, t0: float) -> list[dict[str, Any]]:
    """One observer chunk (under CHUNK_EVENTS events) with many evidence passages: several parts of it."""
    events = work_session(session, t0)
    for n in range(5):
        events += [assistant(session, f"Next I check the parser module number {n} for the retry regression.",
                             t0 + 20 + 3 * n),
                   *shell(session, f"pytest tests/test_parser_{n}.py",
                          f"=== {n + 3} passed in 0.{n}s ===", t0 + 21 + 3 * n)]
    assert len(events) < CHUNK_EVENTS
    return events


@pytest.mark.slow
def test_a_chunk_commits_its_passages_apart_and_a_kill_between_them_doubles_nothing(daemon_process,
                                                                                     home: Path) -> None:
    """The observer writes a chunk in parts (its evidence passages a few at a time, then its observations with the
    watermark), each its own transaction: the writer is handed on between them. Killed in the last part, the
    passages stay, the watermark has not moved, and the re-run writes the same observations and no passage twice."""
    env = {"LOOMD_PASSIVE": "1", "LOOMD_TAIL_TRANSCRIPTS": "0", "LOOMD_EMBEDDER": "none"}
    proc = daemon_process(env).start()
    with Client(proc.sock, timeout=30) as c:
        ids = c.call("ingest", events=long_session("p1", 1_700_000_000))["ids"]
        reference = c.call("workers_run", name="observer", session_id="p1", dry_run=True)
    passages = reference["detail"]["evidence"]
    assert passages > PASSAGES_PER_WRITE  # more than one part
    conn = connect_sync(home / "loomd.db")
    conn.execute(SLOW_TRIGGER)  # the observations' part is slow: the kill lands in it
    def count(kind: str) -> int:
        return int(conn.execute("SELECT count(*) FROM memories WHERE kind = ?", (kind,)).fetchone()[0])

    caller, errors = observe_in_background(proc.sock, "p1")
    deadline = time.monotonic() + 20
    while count("evidence") < passages:  # every passage part committed, seen from another connection
        assert time.monotonic() < deadline, "the chunk's passages were not committed before its observations"
        time.sleep(0.005)
    # and the observations' transaction open
    wait_for_an_open_write(home / "loomd.db", deadline, "the passages were committed with the observations")
    assert proc.stop(signal.SIGKILL) == -signal.SIGKILL
    caller.join(10)
    assert errors  # the call never got its answer
    assert count("evidence") == passages and count("observation") == 0
    assert conn.execute("SELECT value FROM checkpoints WHERE name = 'observer:p1'").fetchone() is None
    conn.execute("DROP TRIGGER slow_obs")
    conn.close()
    proc2 = daemon_process(env).start()
    with Client(proc2.sock, timeout=30) as c:
        again = c.call("workers_run", name="observer", session_id="p1")
    assert proc2.stop(signal.SIGTERM) == 0
    assert again["outcome"] == "ok" and essence(again["output"]) == essence(reference["output"])
    clean_home = Path(tempfile.mkdtemp(prefix="lm", dir="/tmp"))  # short: the socket path's limit
    try:
        clean = DaemonProcess(clean_home, env).start()
        with Client(clean.sock, timeout=30) as c:
            c.call("ingest", events=long_session("p1", 1_700_000_000))
            assert c.call("workers_run", name="observer", session_id="p1")["outcome"] == "ok"
        assert clean.stop(signal.SIGTERM) == 0
        recovered, fresh = observed_state(home / "loomd.db"), observed_state(clean_home / "loomd.db")
    finally:
        shutil.rmtree(clean_home, ignore_errors=True)
    assert recovered == fresh and recovered["watermark"] == (str(max(ids)),)
    assert recovered["doubled"] == [] and len(recovered["evidence"]) == passages


def observed_state(db: Path) -> dict[str, Any]:
    """What the observer left in a store, without ids or times: its memories' texts by kind (with how many events
    each cites and entities each mentions), texts stored twice, the watermark."""
    conn = connect_sync(db)
    try:
        def texts(kind: str) -> list[tuple[str, int, int]]:
            return sorted(tuple(r) for r in conn.execute(
                "SELECT text, (SELECT count(*) FROM memory_sources s WHERE s.memory_id = m.id),"
                " (SELECT count(*) FROM edges e WHERE e.src_type = 'memory' AND e.src_id = m.id"
                "  AND e.type = 'mentions') FROM memories m WHERE kind = ?", (kind,)))

        return {"observation": texts("observation"), "evidence": texts("evidence"),
                "doubled": conn.execute("SELECT session_id, kind, content_hash FROM memories WHERE archived_at IS NULL"
                                        " GROUP BY 1, 2, 3 HAVING count(*) > 1").fetchall(),
                "watermark": tuple(conn.execute("SELECT value FROM checkpoints WHERE name = 'observer:p1'").fetchone()
                                   or ()),
                "watermarks": sorted(tuple(r) for r in conn.execute(
                    "SELECT name, value FROM checkpoints WHERE name LIKE 'observer:%'"))}
    finally:
        conn.close()


def ended_session(session: str, t0: float) -> list[dict[str, Any]]:
    """A short ended session whose texts are its own (no passage of it is another session's too)."""
    events: list[dict[str, Any]] = [user(session, f"From now on never push to main in {session}, open a pull request.",
                                         t0)]
    for n in range(6):
        events += [assistant(session, f"Next I check parser module {n} of {session} for the retry regression.",
                             t0 + 1 + 3 * n),
                   *shell(session, f"pytest tests/{session}/test_parser_{n}.py",
                          f"=== {n + 3} passed in 0.{n}s ({session}) ===", t0 + 2 + 3 * n)]
    return [*events, ev(session, "SessionEnd", {"reason": "other"}, t0 + 30)]


@pytest.mark.slow
def test_kill_9_during_the_catch_up_then_restart_gives_a_clean_runs_memories(daemon_process, home: Path) -> None:
    """The scheduled workers catching up on ended sessions, killed -9 halfway: restarted, they finish with what a
    daemon never killed writes, nothing doubled."""
    sessions = [f"cu{n}" for n in range(10)]
    events = [e for n, s in enumerate(sessions) for e in ended_session(s, 1_700_000_000 + 100 * n)]
    env = {"LOOMD_PASSIVE": "0", "LOOMD_TAIL_TRANSCRIPTS": "0", "LOOMD_EMBEDDER": "none"}
    conn = connect_sync(home / "loomd.db")  # created and migrated by the first daemon below
    proc = daemon_process(env).start()
    conn.execute(SLOW_TRIGGER)  # each observation takes a while: the catch-up lasts long enough to be cut
    with Client(proc.sock, timeout=30) as c:
        c.call("ingest", events=events)  # each SessionEnd wakes the observer

    def observed() -> int:
        return int(conn.execute("SELECT count(*) FROM checkpoints WHERE name LIKE 'observer:%'").fetchone()[0])

    deadline = time.monotonic() + 60
    while observed() < 2:
        assert time.monotonic() < deadline, "the observer did not catch up on its own"
        time.sleep(0.005)
    assert proc.stop(signal.SIGKILL) == -signal.SIGKILL
    assert observed() < len(sessions)  # cut halfway
    conn.execute("DROP TRIGGER slow_obs")
    conn.close()
    proc2 = daemon_process(env).start()
    with Client(proc2.sock, timeout=30) as c:
        for session in sessions:  # what the scheduler has not done yet (it may be doing it now: that run waits)
            assert c.call("workers_run", name="observer", session_id=session)["outcome"] in ("ok", "noop")
    assert proc2.stop(signal.SIGTERM) == 0
    clean_home = Path(tempfile.mkdtemp(prefix="lm", dir="/tmp"))
    try:
        clean = DaemonProcess(clean_home, {**env, "LOOMD_PASSIVE": "1"}).start()
        with Client(clean.sock, timeout=30) as c:
            c.call("ingest", events=events)
            for session in sessions:
                assert c.call("workers_run", name="observer", session_id=session)["outcome"] == "ok"
        assert clean.stop(signal.SIGTERM) == 0
        recovered, fresh = observed_state(home / "loomd.db"), observed_state(clean_home / "loomd.db")
    finally:
        shutil.rmtree(clean_home, ignore_errors=True)
    assert recovered["doubled"] == []
    assert recovered["observation"] == fresh["observation"] and recovered["evidence"] == fresh["evidence"]
    assert recovered["watermarks"] == fresh["watermarks"]
