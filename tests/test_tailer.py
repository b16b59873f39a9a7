"""The transcript tailer end to end: a real daemon, real files in a temporary folder, real hook events.

Expected counts come from a traversal written here (plain JSON field checks), never from loomd.ingest.transcript.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import need_test_data, query, wait_for_socket

from loomd.client import AsyncClient
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.ingest.tailer import Follower

KINDS = ("user_message", "assistant_message", "tool_use", "tool_result", "compact_summary", "summary")
CODEX_INJECTED = ("<environment_context>", "<user_instructions>", "# AGENTS.md instructions", "<INSTRUCTIONS>",
                  "<turn_aborted>")
CWD = "/tmp/loomd-tailer-test"


# ---------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def codex_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private CODEX_HOME, so the daemon never reads the real ~/.codex."""
    path = home / "codex"
    monkeypatch.setenv("LOOMD_CODEX_HOME", str(path))
    return path


def today_dir(codex_home: Path) -> Path:
    now = datetime.now()
    return codex_home / "sessions" / f"{now.year:04d}" / f"{now.month:02d}" / f"{now.day:02d}"


async def wait_until(cond: Callable[[], bool | Awaitable[bool]], what: str, within: float = 20.0) -> None:
    """Poll `cond` until it holds; fail with `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = cond()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


def transcript_counts(home: Path, session_id: str) -> Counter[str]:
    rows = query(home, "SELECT kind, count(*) FROM events WHERE session_id = ? AND source = 'transcript'"
                 " GROUP BY kind", (session_id,))
    return Counter({k: n for k, n in rows})


async def hook(client: AsyncClient, session_id: str, event: str = "SessionStart", **extra: Any) -> dict[str, Any]:
    body = {"session_id": session_id, "cwd": CWD, "hook_event_name": event, **extra}
    if event == "SessionStart":
        body.setdefault("source", "startup")
    return await client.call("hook", event=event, raw=json.dumps(body).encode())


def follower(daemon: Daemon, path: Path) -> Follower | None:
    assert daemon.tailer is not None
    return daemon.tailer.followers.get(str(path))


def caught_up(daemon: Daemon, *paths: Path) -> Callable[[], bool]:
    def check() -> bool:
        for p in paths:
            f = follower(daemon, p)
            if f is None or not f.seen or f.offset != p.stat().st_size:
                return False
        return True
    return check


async def passes(daemon: Daemon, n: int = 1) -> None:
    """Let the tailer finish `n` more full passes (a negative check needs proof that it looked)."""
    assert daemon.tailer is not None
    target = daemon.tailer.passes + n
    await wait_until(lambda: daemon.tailer is not None and daemon.tailer.passes >= target, f"{n} tailer passes")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def c_user(sid: str, uuid: str, text: str) -> dict[str, Any]:
    return {"type": "user", "sessionId": sid, "uuid": uuid, "timestamp": "2026-01-02T03:04:05Z", "cwd": CWD,
            "isSidechain": False, "message": {"role": "user", "content": text}}


def c_assistant(sid: str, uuid: str, mid: str, text: str | None = None, tool: str | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    if text:
        blocks.append({"type": "text", "text": text})
    if tool:
        blocks.append({"type": "tool_use", "id": tool, "name": "Bash", "input": {"command": "ls"}})
    return {"type": "assistant", "sessionId": sid, "uuid": uuid, "timestamp": "2026-01-02T03:04:06Z", "cwd": CWD,
            "message": {"id": mid, "role": "assistant", "content": blocks}}


def c_result(sid: str, uuid: str, tool: str, text: str) -> dict[str, Any]:
    return {"type": "user", "sessionId": sid, "uuid": uuid, "timestamp": "2026-01-02T03:04:07Z", "cwd": CWD,
            "message": {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool, "content": text}]}}


# ---------------------------------------------------------------------------------------------------------------
# the independent count


def norm(text: str) -> str:
    return " ".join(text.split())


class Expected:
    """Distinct things one session should yield: the same merges the database applies (ids, keys). A prompt typed
    twice is two prompts (one per line); Codex's two copies of one prompt (event and response item) are one."""

    def __init__(self) -> None:
        self.users: set[str] = set()  # Claude: one per line (its uuid)
        self.codex_user_events: Counter[str] = Counter()
        self.codex_user_items: Counter[str] = Counter()
        self.texts: set[tuple[str, str]] = set()
        self.tool_uses: set[str] = set()
        self.tool_results: set[str] = set()
        self.compacts: set[str] = set()
        self.summaries: set[str] = set()
        # Codex writes each assistant text twice (event_msg and response_item), a plan-mode <proposed_plan> only as
        # a response item: the distinct texts are the larger count of each text over the two copies.
        self.codex_events: Counter[str] = Counter()
        self.codex_items: Counter[str] = Counter()

    def counts(self) -> dict[str, int]:
        codex_texts = (self.codex_events | self.codex_items).total()
        codex_users = (self.codex_user_events | self.codex_user_items).total()
        return {"user_message": len(self.users) + codex_users, "assistant_message": len(self.texts) + codex_texts,
                "tool_use": len(self.tool_uses), "tool_result": len(self.tool_results),
                "compact_summary": len(self.compacts), "summary": len(self.summaries)}

    def claude(self, o: dict[str, Any]) -> None:
        if o.get("isMeta") is True:
            return
        t = o.get("type")
        if t == "summary" and isinstance(o.get("summary"), str) and o["summary"].strip():
            self.summaries.add(f"{o.get('leafUuid')}\0{o['summary']}")
        elif t == "system" and o.get("subtype") == "away_summary" and str(o.get("content") or "").strip():
            self.summaries.add(str(o.get("uuid")))
        elif t == "queue-operation" and o.get("operation") == "remove" and isinstance(o.get("content"), str) \
                and o["content"].strip():
            self.users.add(norm(o["content"]))
        elif t == "attachment":
            att = o.get("attachment") or {}
            if att.get("type") == "queued_command" and isinstance(att.get("prompt"), str) and att["prompt"].strip():
                self.users.add(str(o.get("uuid")))
        elif t == "assistant":
            msg = o["message"]
            content = msg["content"] if isinstance(msg["content"], list) else [{"type": "text", "text": msg["content"]}]
            for b in content:
                if b.get("type") == "text" and str(b.get("text") or "").strip():
                    self.texts.add((msg.get("id") or o["uuid"], b["text"]))
                elif b.get("type") in ("tool_use", "server_tool_use"):
                    self.tool_uses.add(b["id"])
                elif b.get("type") == "web_search_tool_result":
                    self.tool_results.add(b["tool_use_id"])
        elif t == "user":
            content = o["message"]["content"]
            words: list[str] = []
            for b in content if isinstance(content, list) else [content]:
                if isinstance(b, str):
                    words.append(b)
                elif b.get("type") == "tool_result":
                    self.tool_results.add(b["tool_use_id"])
                elif b.get("type") == "text":
                    words.append(b.get("text") or "")
                elif b.get("type") == "image":
                    words.append("[image]")
            text = "\n".join(w for w in words if w)
            if not text.strip():
                return
            if o.get("isCompactSummary") is True:
                self.compacts.add(o["uuid"])
            else:
                self.users.add(str(o.get("uuid")))

    def codex(self, o: dict[str, Any]) -> None:
        p = o.get("payload") or {}
        t, pt = o.get("type"), p.get("type")
        if t == "event_msg" and pt == "user_message" and not p["message"].lstrip().startswith(CODEX_INJECTED):
            self.codex_user_events[norm(p["message"])] += 1
        elif t == "event_msg" and pt == "agent_message":
            self.codex_events[norm(p["message"])] += 1
        elif t == "response_item" and pt == "message" and p.get("role") == "assistant":
            self.codex_items[norm("".join(part.get("text", "") for part in p["content"]))] += 1
        elif t == "response_item" and pt == "message" and p.get("role") == "user":
            text = "".join(part.get("text", "") for part in p["content"])
            if not text.lstrip().startswith(CODEX_INJECTED):
                self.codex_user_items[norm(text)] += 1
        elif t == "response_item" and pt in ("function_call", "custom_tool_call", "local_shell_call"):
            self.tool_uses.add(p.get("call_id") or p["id"])
        elif t == "response_item" and pt in ("function_call_output", "custom_tool_call_output"):
            self.tool_results.add(p["call_id"])
        elif t == "compacted":
            self.compacts.add(str(o.get("timestamp")))


def load(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".json":
        return json.loads(path.read_bytes())
    return [json.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]


def classify(path: Path) -> str | None:
    """claude / codex / claude_array / None (hook logs, metadata)."""
    if path.suffix == ".jsonl":
        first = json.loads(path.read_bytes().split(b"\n", 1)[0])
        return "codex" if "payload" in first else "claude"
    if path.suffix != ".json" or path.name.endswith(".meta.json"):
        return None
    data = json.loads(path.read_bytes())
    if isinstance(data, list) and data and all(isinstance(o, dict) and "type" in o for o in data):
        if not any("hook_event_name" in o for o in data):
            return "claude_array"
    return None


def real_files(root: Path) -> Iterator[tuple[Path, str]]:
    for dirpath, _dirs, names in os.walk(root):  # os.walk enters .sample_session, glob would not
        for name in sorted(names):
            path = Path(dirpath) / name
            kind = classify(path)
            if kind is not None:
                yield path, kind


# ---------------------------------------------------------------------------------------------------------------
# (1) every real transcript file


@pytest.fixture
def codex_rollouts(codex_home: Path, tmp_path: Path) -> list[Path]:
    """The real Codex rollouts, copied into CODEX_HOME before the daemon starts (found by the startup scan)."""
    data = need_test_data("transcripts")
    out: list[Path] = []
    for path, kind in real_files(data):
        if kind != "codex":
            continue
        name = path.name
        if not name.startswith("rollout-"):
            meta = load(path)[0]["payload"]
            name = f"rollout-{meta['timestamp'][:19].replace(':', '-')}-{meta['id']}.jsonl"
        dest = codex_home / "sessions" / "2025" / "11" / "17" / name  # an old folder: only the full scan sees it
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        out.append(dest)
    return out


async def test_every_real_transcript_is_ingested(codex_rollouts: list[Path], client: AsyncClient, daemon: Daemon,
                                                 home: Path, tmp_path: Path) -> None:
    data = need_test_data("transcripts")
    assert daemon.tailer is not None
    expected: dict[str, Expected] = defaultdict(Expected)
    label: dict[str, str] = {}
    followed: list[Path] = []
    files = list(real_files(data))
    present = {p for p, _k in files}
    # Copy each project folder whole: subagent files must be found next to their session, as on a real disk.
    for path, kind in files:
        if kind != "claude":
            continue
        src_dir = path.parent
        while src_dir.parent != data and not src_dir.parent.name.endswith("claude-code-log"):
            src_dir = src_dir.parent
        dest_dir = tmp_path / "projects" / src_dir.name
        if not dest_dir.exists():
            shutil.copytree(src_dir, dest_dir)
    for path, kind in files:
        rel = path.relative_to(data)
        if kind == "claude":
            copy = tmp_path / "projects" / Path(*rel.parts[1:])
            first = load(path)[0]
            sid = first.get("sessionId") or path.stem
            if path.name.startswith("agent-"):
                main = copy.parent / f"{sid}.jsonl"
                if path.parent / f"{sid}.jsonl" not in present:
                    # Its session file is not in the data set: SubagentStop names the subagent file itself.
                    await hook(client, sid, "SubagentStop", transcript_path=str(main), agent_id=path.stem[6:],
                               agent_transcript_path=str(copy), stop_hook_active=False)
            else:
                sid = path.stem
                await hook(client, sid, transcript_path=str(copy))
            for o in load(path):
                expected[sid].claude(o)
            label.setdefault(sid, str(rel))
            followed.append(copy)
        elif kind == "codex":
            objs = load(path)
            sid = objs[0]["payload"]["id"]
            for o in objs:
                expected[sid].codex(o)
            label[sid] = str(rel)
        elif rel.parts[0].startswith("CoorpAcademy"):
            # An array is not appendable: the tailer imports it whole when a hook names it.
            copy = tmp_path / "arrays" / rel.parent.name / path.name
            copy.parent.mkdir(parents=True)
            shutil.copyfile(path, copy)
            sid = rel.parent.name
            await hook(client, sid, transcript_path=str(copy))
            for o in load(path):
                expected[sid].claude(o)
            label[sid] = str(rel)
            followed.append(copy)
        else:
            result = await daemon.tailer.import_file(path)
            assert result["format"] == "claude_array" and result["events"] > 0
            objs = load(path)
            # Lines without a session id (summary, mode, ...) belong to the file's first session.
            first = next(o["sessionId"] for o in objs if o.get("sessionId"))
            for o in objs:
                expected[o.get("sessionId") or first].claude(o)
                label.setdefault(o.get("sessionId") or first, str(rel))
    await wait_until(caught_up(daemon, *followed, *codex_rollouts), "every transcript to be read", within=60)
    subagents = [f for f in daemon.tailer.followers.values() if f.role == "subagent"]
    assert len(subagents) == sum(1 for p, k in files if k == "claude" and p.name.startswith("agent-"))
    assert all(f.offset == f.size for f in subagents)
    rows = []
    for sid in sorted(expected, key=lambda s: label[s]):
        want = expected[sid].counts()
        got = transcript_counts(home, sid)
        rows.append((label[sid], sid, want, got))
    heads = ("user", "assistant", "tool_use", "tool_res", "compact", "summary")
    print("\ntranscript events stored per session (a cell reads stored/expected only where they differ)")
    print(f"| {'file (session)':<72} | " + " | ".join(f"{h:>9}" for h in heads) + " |")
    for name, sid, want, got in rows:
        cells = [str(got[k]) if got[k] == want[k] else f"{got[k]}/{want[k]}" for k in KINDS]
        print(f"| {(name[-60:] + ' (' + sid[:8] + ')'):<72} | " + " | ".join(f"{c:>9}" for c in cells) + " |")
    totals_got = sum((got for *_x, got in rows), Counter())
    totals_want = sum((Counter(want) for *_x, want, _g in rows), Counter())
    print(f"| {'total':<72} | " + " | ".join(f"{totals_got[k]:>9}" for k in KINDS) + " |")
    assert {sid: dict(got) for _n, sid, _w, got in rows} == {
        sid: {k: n for k, n in want.items() if n} for _n, sid, want, _g in rows}
    assert totals_want == totals_got
    # Every transcript event is unique by key, and a second import adds nothing.
    assert query(home, "SELECT count(*) - count(DISTINCT key) FROM events")[0][0] == 0
    again = await daemon.tailer.import_file(next(p for p, k in files if k == "claude_array"
                                                 and "kesslerio" in str(p)))
    assert again["stored"] == 0
    status = daemon.tailer.status()
    assert status["bytes_behind"] == 0 and status["errors"] == 0, status
    # Sidechain files are tagged as such, with the agent metadata from .meta.json.
    payloads = [json.loads(p) for (p,) in query(
        home, "SELECT payload FROM events WHERE session_id = 'ef958aa1-0e93-49f0-bb71-150f63befcd1'"
        " AND source = 'transcript' AND json_extract(payload, '$.agent_type') IS NOT NULL")]
    assert payloads and all(p["is_sidechain"] is True and p["agent_id"] for p in payloads)


QA_FORMATS = {"claude-array": "claude_array", "claude-jsonl": "claude", "codex-rollout": "codex"}


async def test_every_coding_qa_session_imports(client: AsyncClient, daemon: Daemon, home: Path) -> None:
    """Every file the coding-QA dev set names imports to completion: transcripts (and their subagent files) through
    the tailer's one-shot import, hook logs through the `hook` op as the shim sends them. A file the format
    detection refuses, or one that yields nothing, fails here."""
    qa_path = need_test_data("coding-qa-dev.json")
    data = qa_path.parent / "transcripts"
    qa = json.loads(qa_path.read_bytes())
    assert daemon.tailer is not None
    named: set[str] = set()
    imported: dict[str, int] = {}
    for s in qa["sessions"]:
        if s["format"] == "hooks":
            sid = s["session_id"]
            for rel in s["hook_files"]:
                named.add(rel)
                records = [r for r in load(data / rel) if r.get("session_id") == sid]
                assert records, f"{rel} holds no hook payload of session {sid}"
                for r in records:
                    reply = await client.call("hook", event=r["hook_event_name"], agent="claude",
                                              raw=json.dumps(r).encode())
                    assert reply["stored"] == 1
            sessions = [sid]
        else:
            sessions = []
            for rel in [s["path"], *s.get("subagent_files", [])]:
                named.add(rel)
                result = await daemon.tailer.import_file(data / rel)
                assert result["format"] == QA_FORMATS[s["format"]], rel
                assert result["events"] > 0 and result["stored"] > 0, (rel, result)
                sessions += result["sessions"]
        marks = ",".join("?" * len(sessions))
        imported[s["id"]] = query(home, f"SELECT count(*) FROM events WHERE session_id IN ({marks})",
                                  tuple(sessions))[0][0]
    assert {q["session"] for q in qa["questions"]} <= named
    assert all(imported.values()), imported
    assert daemon.tailer.status()["errors"] == 0


# ---------------------------------------------------------------------------------------------------------------
# (2) a live file, appended in pieces


async def test_appended_lines_are_ingested_once(client: AsyncClient, daemon: Daemon, home: Path,
                                                tmp_path: Path) -> None:
    sid = "live-1"
    path = tmp_path / "proj" / f"{sid}.jsonl"
    path.parent.mkdir()
    # The hook comes before the agent writes its file: the follower waits for it.
    await hook(client, sid, transcript_path=str(path))
    await wait_until(lambda: follower(daemon, path) is not None, "a follower for the hook's transcript")
    assert daemon.tailer is not None and daemon.tailer.status()["waiting"] == 1
    path.write_bytes(line(c_user(sid, "u1", "first prompt")) + line(c_assistant(sid, "a1", "m1", "first answer")))
    await wait_until(caught_up(daemon, path), "the first lines")
    assert transcript_counts(home, sid) == {"user_message": 1, "assistant_message": 1}

    whole = line(c_assistant(sid, "a2", "m2", "second answer", tool="toolu_live"))
    with path.open("ab") as fh:
        fh.write(whole[:40])
    await wait_until(lambda: (f := follower(daemon, path)) is not None and f.size == path.stat().st_size,
                     "the half line to be seen")
    await passes(daemon)
    assert transcript_counts(home, sid) == {"user_message": 1, "assistant_message": 1}
    f = follower(daemon, path)
    assert f is not None and f.offset == path.stat().st_size - 40
    with path.open("ab") as fh:
        fh.write(whole[40:] + line(c_result(sid, "r1", "toolu_live", "file_a file_b")))
        fh.write(line(c_user(sid, "u2", "second prompt"))[:-1])  # no newline yet
    await wait_until(lambda: transcript_counts(home, sid)["tool_result"] == 1, "the rest of the line")
    await passes(daemon)
    assert transcript_counts(home, sid) == {"user_message": 1, "assistant_message": 2, "tool_use": 1,
                                            "tool_result": 1}
    with path.open("ab") as fh:
        fh.write(b"\n")
    await wait_until(caught_up(daemon, path), "the completed last line")
    assert transcript_counts(home, sid) == {"user_message": 2, "assistant_message": 2, "tool_use": 1,
                                            "tool_result": 1}
    keys = [k for (k,) in query(home, "SELECT key FROM events WHERE session_id = ? AND source = 'transcript'", (sid,))]
    assert len(keys) == len(set(keys)) == 6 and f"t:{sid}:tu:toolu_live" in keys
    row = query(home, "SELECT transcript_path, transcript_offset FROM sessions WHERE id = ?", (sid,))
    assert row == [(str(path), path.stat().st_size)]
    tool = query(home, "SELECT tool_name, tool_use_id, dedup, payload FROM events WHERE key = ?",
                 (f"t:{sid}:tu:toolu_live",))[0]
    assert tool[:3] == ("Bash", "toolu_live", "tu:toolu_live")
    assert json.loads(tool[3]) == {"text": "Bash: ls", "tool_name": "Bash", "tool_input": {"command": "ls"},
                                   "message_id": "m2", "uuid": "a2"}


async def test_an_ended_sessions_transcripts_are_let_go_once_read(client: AsyncClient, daemon: Daemon, home: Path,
                                                                   tmp_path: Path) -> None:
    """A session that ended writes nothing more: its transcript is read to the end and then no longer followed
    (nor stat'ed every pass), and one never made is not waited for; a later hook of the session (a resume) follows
    it again from where reading stood, so nothing is read twice."""
    assert daemon.tailer is not None
    daemon.tailer.ended_idle_s = 0.5
    made, never = tmp_path / "end-1.jsonl", tmp_path / "end-2.jsonl"
    made.write_bytes(line(c_user("end-1", "u1", "first prompt")) + line(c_assistant("end-1", "a1", "m1", "answer")))
    for sid, path in (("end-1", made), ("end-2", never)):
        await hook(client, sid, transcript_path=str(path))
    await wait_until(caught_up(daemon, made), "the made transcript read")
    # The hooks name both files; the tailer takes up each request on its own loop, not before the hook's ack.
    await wait_until(lambda: follower(daemon, never) is not None, "the never-made transcript waited for")
    await hook(client, "end-1", "UserPromptSubmit", transcript_path=str(made), prompt="one more thing")
    await passes(daemon, 2)
    assert follower(daemon, made) is not None  # a live session's file stays followed however quiet
    for sid, path in (("end-1", made), ("end-2", never)):
        await hook(client, sid, "SessionEnd", transcript_path=str(path), reason="exit")
    await wait_until(lambda: follower(daemon, made) is None and follower(daemon, never) is None,
                     "the ended sessions' files let go")
    with made.open("ab") as fh:
        fh.write(line(c_user("end-1", "u2", "resumed prompt")))
    await hook(client, "end-1", "SessionStart", transcript_path=str(made), source="resume")
    await wait_until(caught_up(daemon, made), "the resumed transcript read")
    assert transcript_counts(home, "end-1") == {"user_message": 2, "assistant_message": 1}


async def test_lone_surrogates_in_a_transcript_never_stall_it(client: AsyncClient, daemon: Daemon, home: Path,
                                                              tmp_path: Path) -> None:
    """JSON may escape half a surrogate pair ("\\ud800"), which has no UTF-8 form: such lines are stored with U+FFFD
    in its place, in text, ids and keys alike, and the lines after them follow."""
    sid = "sur-1"
    path = tmp_path / "proj" / f"{sid}.jsonl"
    path.parent.mkdir()
    path.write_bytes(line(c_user(sid, "u1", "half a pair \ud800 here"))
                     + line(c_assistant(sid, "a1\udc80", "m1\udfff", "answer \udbff", tool="toolu_\ud83d"))
                     + line(c_result(sid, "r1", "toolu_\ud83d", "out \ud800\ud800"))
                     + line(c_user(sid, "u2", "after it, an emoji \U0001f600 stays whole")))
    await hook(client, sid, transcript_path=str(path))
    await wait_until(caught_up(daemon, path), "every line")
    assert transcript_counts(home, sid) == {"user_message": 2, "assistant_message": 1, "tool_use": 1,
                                            "tool_result": 1}
    texts = [json.loads(p)["text"] for (p,) in query(
        home, "SELECT payload FROM events WHERE session_id = ? AND source = 'transcript' ORDER BY id", (sid,))]
    assert texts == ["half a pair \ufffd here", "answer \ufffd", "Bash: ls", "out \ufffd\ufffd",
                     "after it, an emoji \U0001f600 stays whole"]
    assert query(home, "SELECT tool_use_id FROM events WHERE session_id = ? AND kind = 'tool_result'", (sid,)) == \
        [("toolu_\ufffd",)]


# ---------------------------------------------------------------------------------------------------------------
# (3) hook and transcript copies of one thing merge


async def test_hook_and_transcript_merge(client: AsyncClient, daemon: Daemon, home: Path, tmp_path: Path) -> None:
    sid = "merge-1"
    path = tmp_path / f"{sid}.jsonl"
    path.write_bytes(b"")
    await hook(client, sid, transcript_path=str(path))
    # Hooks first for X: the transcript copies arriving later are dropped.
    common = {"transcript_path": str(path), "tool_name": "Bash", "tool_input": {"command": "ls"}}
    assert (await hook(client, sid, "UserPromptSubmit", transcript_path=str(path), prompt="list  the files"))["stored"]
    assert (await hook(client, sid, "PreToolUse", tool_use_id="X", **common))["stored"] == 1
    assert (await hook(client, sid, "PostToolUse", tool_use_id="X", tool_response={"stdout": "a b"}, **common))[
        "stored"] == 1
    with path.open("ab") as fh:
        fh.write(line(c_user(sid, "u1", "list the files")))
        fh.write(line(c_assistant(sid, "a1", "m1", "Listing.", tool="X")))
        fh.write(line(c_result(sid, "r1", "X", "a b")))
        fh.write(line(c_assistant(sid, "a2", "m2", tool="Y")))
        fh.write(line(c_result(sid, "r2", "Y", "c d")))
    await wait_until(caught_up(daemon, path), "the transcript")
    # Transcript first for Y: the hooks arriving later store nothing (answered once journaled, they are committed
    # by the time the next op is answered).
    await hook(client, sid, "PreToolUse", tool_use_id="Y", **common)
    await hook(client, sid, "PostToolUse", tool_use_id="Y", tool_response={"stdout": "c d"}, **common)
    await client.call("events", session_id=sid)  # the rows below are read from the file: after those commits
    rows = query(home, "SELECT dedup, source, kind FROM events WHERE session_id = ? AND dedup IS NOT NULL"
                 " ORDER BY dedup", (sid,))
    by_dedup: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for dedup, source, kind in rows:
        by_dedup[dedup].append((source, kind))
    assert by_dedup["tu:X"] == [("hook", "PreToolUse")]
    assert by_dedup["tr:X"] == [("hook", "PostToolUse")]
    assert by_dedup["tu:Y"] == [("transcript", "tool_use")]
    assert by_dedup["tr:Y"] == [("transcript", "tool_result")]
    prompts = [v for k, v in by_dedup.items() if k.startswith("p:")]
    assert prompts == [[("hook", "UserPromptSubmit")]]
    assert transcript_counts(home, sid) == {"assistant_message": 1, "tool_use": 1, "tool_result": 1}


# ---------------------------------------------------------------------------------------------------------------
# (4) restart: resume from the stored offsets


async def test_restart_resumes_without_reingesting(client: AsyncClient, daemon: Daemon, home: Path, tmp_path: Path,
                                                   codex_home: Path) -> None:
    sid = "restart-1"
    path = tmp_path / "proj" / f"{sid}.jsonl"
    sub = tmp_path / "proj" / sid / "subagents" / "agent-abc.jsonl"
    sub.parent.mkdir(parents=True)
    path.write_bytes(line(c_user(sid, "u1", "one")) + line(c_assistant(sid, "a1", "m1", "uno")))
    sub.write_bytes(line({**c_user(sid, "s1", "sub task"), "isSidechain": True, "agentId": "abc"}))
    # A Codex rollout cut between the two copies of one answer: the copy after the restart must still be dropped.
    codex_lines = load(need_test_data("transcripts", "kvsankar-agent-history", "tests", "fixtures", "real_sessions",
                                      "codex", "session-01.jsonl"))
    split = next(i for i, o in enumerate(codex_lines) if o["payload"].get("type") == "agent_message") + 1
    rollout = today_dir(codex_home) / "rollout-2026-06-05T04-58-20-019e9625-802f-7e91-840a-cfe88d14117a.jsonl"
    rollout.parent.mkdir(parents=True)
    rollout.write_bytes(b"".join(line(o) for o in codex_lines[:split]))
    await hook(client, sid, transcript_path=str(path))
    await wait_until(caught_up(daemon, path, sub, rollout), "all three files", within=30)
    before = query(home, "SELECT count(*) FROM events WHERE source = 'transcript'")[0][0]
    assert before == 2 + 1 + 2  # user+answer, the subagent prompt, Codex prompt+answer

    serve = next(t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Daemon.serve")
    daemon.should_exit.set()
    await asyncio.wait_for(serve, 30)
    # Written while the daemon is down: picked up at start from the stored offsets.
    with path.open("ab") as fh:
        fh.write(line(c_assistant(sid, "a2", "m2", "dos")))
    with rollout.open("ab") as fh:
        fh.write(b"".join(line(o) for o in codex_lines[split:]))

    second = Daemon(load_config())
    task = asyncio.create_task(second.serve())
    try:
        await wait_for_socket(home / "loomd.sock")
        assert second.tailer is not None
        await wait_until(caught_up(second, path, sub, rollout), "the restarted tailer to catch up", within=30)
        assert query(home, "SELECT count(*) FROM events WHERE source = 'transcript'")[0][0] == before + 1
        # Nothing before the stored offsets was read again (dedupe would hide it in the count; this would not).
        assert second.tailer.submitted == 1
        with path.open("ab") as fh:
            fh.write(line(c_user(sid, "u3", "tres")))
        with sub.open("ab") as fh:
            fh.write(line({**c_assistant(sid, "s2", "sm1", "sub answer"), "isSidechain": True, "agentId": "abc"}))
        await wait_until(caught_up(second, path, sub), "new lines after the restart")
        assert second.tailer.submitted == 3
        assert transcript_counts(home, sid) == {"user_message": 3, "assistant_message": 3}
        codex_sid = "019e9625-802f-7e91-840a-cfe88d14117a"
        assert transcript_counts(home, codex_sid) == {"user_message": 1, "assistant_message": 1}
        offset = query(home, "SELECT transcript_offset FROM sessions WHERE id = ?", (sid,))[0][0]
        assert offset == path.stat().st_size
        names = {n for (n,) in query(home, "SELECT name FROM checkpoints WHERE name LIKE 'tail:%'")}
        assert names == {f"tail:{path}", f"tail:{sub}", f"tail:{rollout}"}
    finally:
        second.should_exit.set()
        await asyncio.wait_for(task, 30)


# ---------------------------------------------------------------------------------------------------------------
# (5) rotated, truncated, deleted and unreadable files


async def test_rotated_truncated_deleted_unreadable(client: AsyncClient, daemon: Daemon, home: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loomd.ingest.tailer")
    assert daemon.tailer is not None
    sid = "rotate-1"
    path = tmp_path / f"{sid}.jsonl"
    first = line(c_user(sid, "u1", "alpha")) + line(c_assistant(sid, "a1", "m1", "beta"))
    path.write_bytes(first)
    await hook(client, sid, transcript_path=str(path))
    await wait_until(caught_up(daemon, path), "the first file")

    # Rotation: renamed away, a new file (longer than the old offset) with an old line and a new one.
    path.rename(tmp_path / f"{sid}.jsonl.1")
    path.write_bytes(first + line(c_user(sid, "u2", "gamma")))
    await wait_until(caught_up(daemon, path), "the rotated file")
    assert transcript_counts(home, sid) == {"user_message": 2, "assistant_message": 1}

    # Truncated in place to less than the offset: read again from the start.
    path.write_bytes(line(c_user(sid, "u3", "delta")))
    await wait_until(lambda: transcript_counts(home, sid)["user_message"] == 3, "the truncated file")
    await wait_until(caught_up(daemon, path), "the truncated file's offset")
    assert transcript_counts(home, sid) == {"user_message": 3, "assistant_message": 1}

    # Deleted: logged once, then no longer followed.
    daemon.tailer.gone_grace_s = 1.0
    path.unlink()
    await wait_until(lambda: follower(daemon, path) is None, "the deleted file to be dropped")
    assert daemon.tailer.status()["dropped"] >= 1
    await hook(client, sid, "Stop", transcript_path=str(path), stop_hook_active=False)  # names it again
    await passes(daemon)
    gone = [r for r in caplog.records if "was deleted" in r.getMessage()]
    assert len(gone) == 1, [r.getMessage() for r in gone]

    # Unreadable (a folder where the file should be; root can read any mode): an error, and the rest goes on.
    bad = tmp_path / "bad-1.jsonl"
    bad.mkdir()
    await hook(client, "bad-1", transcript_path=str(bad))
    await wait_until(lambda: daemon.tailer is not None and daemon.tailer.status()["errors"] == 1, "the error state")
    assert "bad-1.jsonl: not a regular file" in str(daemon.tailer.status()["last_error"])
    other = tmp_path / "ok-1.jsonl"
    other.write_bytes(line(c_user("ok-1", "u1", "still working")))
    await hook(client, "ok-1", transcript_path=str(other))
    await wait_until(caught_up(daemon, other), "a good file next to a bad one")
    bad.rmdir()
    bad.write_bytes(line(c_user("bad-1", "u1", "readable now")))
    await wait_until(caught_up(daemon, bad), "the repaired file")
    assert transcript_counts(home, "bad-1") == {"user_message": 1}
    assert daemon.tailer.status()["errors"] == 0
    # A FIFO is never opened (that would block a thread, and shutdown with it).
    fifo = tmp_path / "fifo-1.jsonl"
    os.mkfifo(fifo)
    await hook(client, "fifo-1", transcript_path=str(fifo))
    await wait_until(lambda: daemon.tailer is not None and daemon.tailer.status()["errors"] == 1, "the FIFO error")


async def test_codex_rollouts_are_discovered_live(client: AsyncClient, daemon: Daemon, home: Path,
                                                  codex_home: Path) -> None:
    src = need_test_data("transcripts", "AcidicSoil-codex-session-view", ".sample_session")
    rollout = next(src.glob("rollout-*.jsonl"))
    dest = today_dir(codex_home) / rollout.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(rollout, dest)
    await wait_until(caught_up(daemon, dest), "a new rollout in today's folder", within=30)
    sid = "019a93b9-f380-7600-98ff-940e6b99603c"
    expected = Expected()
    for o in load(rollout):
        expected.codex(o)
    assert transcript_counts(home, sid) == {k: n for k, n in expected.counts().items() if n}
    assert query(home, "SELECT transcript_path FROM sessions WHERE id = ?", (sid,)) == [(str(dest),)]


async def test_tailing_off(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOOMD_TAIL_TRANSCRIPTS", "false")
    d = Daemon(load_config())
    task = asyncio.create_task(d.serve())
    try:
        await wait_for_socket(home / "loomd.sock")
        path = tmp_path / "off-1.jsonl"
        path.write_bytes(line(c_user("off-1", "u1", "private")))
        async with AsyncClient(home / "loomd.sock") as c:
            await hook(c, "off-1", transcript_path=str(path))
        assert d.tailer is not None
        assert d.tailer.status()["enabled"] is False and d.tailer.followers == {}
        # An explicit import still works.
        assert (await d.tailer.import_file(path, session_id="off-1"))["stored"] == 1
    finally:
        d.should_exit.set()
        await asyncio.wait_for(task, 30)
