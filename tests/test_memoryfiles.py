"""A memory file another tool keeps, read by the agent: its typed entries become memories of their kind, once, with
the file as their source, and the next session's start block shows the preferences. Hook payloads first, then the
real session where the answer exists only in such a read (the chess study tool's `.claude/memories/…json`)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from conftest import need_test_data

from loomd.client import AsyncClient

CWD = "/tmp/memfile-project"
MEMORY_FILE = f"{CWD}/.claude/memories/project_memory.json"
_n = itertools.count(1)

DOCUMENT = {
    "memories": [
        {"type": "preference", "content": "Release notes go in CHANGELOG.md under Unreleased, newest entry first."},
        {
            "type": "tech_decision",
            "content": "Chose SQLite WAL over Postgres for the local cache: one file, no server.",
        },
        {"type": "known_issue", "content": "The watcher misses renames on network drives; poll there instead."},
        {"type": "completed_feature", "content": "v1.2: export to CSV and a dark theme in the settings page."},
    ],
    "realtime_memories": [{"type": "message", "content": "ok now make the button bigger please and ship it"}],
}


def numbered(text: str) -> str:
    """What Claude Code's Read tool returns: each line behind its number and an arrow."""
    return "\n".join(f"{i:>6}→{line}" for i, line in enumerate(text.splitlines(), 1))


async def read(
    client: AsyncClient, session: str, path: str, content: str, tool: str = "Read", command: str = ""
) -> None:
    """A finished Read, shell command (`cat PATH` unless `command` says otherwise) or Write of `path`."""
    tool_input: dict[str, Any] = {"file_path": path}
    response: dict[str, Any] = {"type": "text", "file": {"filePath": path, "content": content}}
    if tool == "Bash":
        tool_input, response = {"command": command or f"cat {path}"}, {"stdout": content, "exit_code": 0}
    elif tool == "Write":
        tool_input, response = {"file_path": path, "content": content}, {"type": "update", "filePath": path}
    payload = {
        "session_id": session,
        "hook_event_name": "PostToolUse",
        "cwd": CWD,
        "tool_name": tool,
        "tool_input": tool_input,
        "tool_response": response,
        "tool_use_id": f"tu-mf-{next(_n)}",
    }
    await client.call("hook", event="PostToolUse", agent="claude", raw=json.dumps(payload))


async def from_files(client: AsyncClient, session: str) -> list[dict[str, Any]]:
    rows = (await client.call("timeline", session_id=session, include_archived=True, limit=200))["memories"]
    return [r for r in rows if r["origin"] == "capture:memory_file"]


async def test_typed_entries_of_a_read_memory_file_become_memories_of_their_kind(quiet: Any) -> None:
    """Each typed entry once, under its kind; a chat log kept in the same file (type "message") and entries of no
    rule-like type are not taken, nor the same entries in a project's own JSON (an app's data, a test fixture of a
    memory tool): those are not a memory someone curates."""
    daemon, client = quiet
    text = json.dumps(DOCUMENT, indent=2)
    await read(client, "mf-1", f"{CWD}/src/data/entries.json", text)
    await read(client, "mf-1", f"{CWD}/tests/fixtures/memory.json", text)
    await read(client, "mf-1", MEMORY_FILE, numbered(text))
    await read(client, "mf-1", MEMORY_FILE, text)  # read again: nothing new
    await read(client, "mf-1", MEMORY_FILE, text, tool="Bash")  # `cat` of it: nothing new either
    rows = await from_files(client, "mf-1")
    assert sorted((r["kind"], r["text"][:20]) for r in rows) == [
        ("decision", "Chose SQLite WAL ove"),
        ("error", "The watcher misses r"),
        ("preference", "Release notes go in "),
    ]
    stored = await daemon.store.fetchall(
        "SELECT json_extract(meta, '$.file'), json_extract(meta, '$.type') FROM memories"
        " WHERE origin = 'capture:memory_file' ORDER BY id"
    )
    assert [tuple(r) for r in stored] == [
        (MEMORY_FILE, "preference"),
        (MEMORY_FILE, "tech_decision"),
        (MEMORY_FILE, "known_issue"),
    ]
    block = (await client.call("context", kind="start", session_id="mf-next", cwd=CWD))["text"]
    assert "[C]" in block and "Release notes go in CHANGELOG.md" in block, block


async def test_a_memory_file_read_in_a_real_session_reaches_the_next_start_block(quiet: Any) -> None:
    """chess-06 of the coding-QA dev set: "Bug fixes use .1 increments" is written only in the project's
    `.claude/memories/project_memory.json` (a preference entry bundled with two others), which the agent Read once.
    After the session is imported and observed, a new session of the project starts with that preference."""
    daemon, client = quiet
    questions = json.loads(need_test_data("coding-qa-dev.json").read_text())["questions"]
    question = next(q for q in questions if q["id"] == "chess-06")
    assert daemon.tailer is not None
    (session,) = (await daemon.tailer.import_file(need_test_data("transcripts", question["session"])))["sessions"]
    assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] == "ok"
    project = (await client.call("events", session_id=session, limit=1))["events"][0]["project"]
    block = (await client.call("context", kind="start", session_id="chess-next", project=project))["text"]
    rules = [line for line in block.splitlines() if line.startswith("[C]")]
    assert any(all(k.lower() in line.lower() for k in question["answer_keys"]) for line in rules), block
    # The chat log the same file keeps ("make it 5000 tokens max for both" as type "message") is not taken from it.
    rows = await daemon.store.fetchall(
        "SELECT kind, text FROM memories WHERE origin = 'capture:memory_file' AND project = ?", [project]
    )
    assert rows and not any("5000 tokens" in r["text"] for r in rows)


async def test_other_memory_file_conventions(quiet: Any) -> None:
    """Markdown with a `type:` front matter (Claude Code's auto memory: `feedback` is the user's guidance, `user` a
    note about them), strings listed under a typed key, and a read cut short (only the entries that arrived whole)."""
    _, client = quiet
    feedback = "---\nname: db-tests\ndescription: no mocks\ntype: feedback\n---\n"
    feedback += "Integration tests hit a real database, never mocks.\n\n**Why:** a mocked migration hid a bug."
    await read(client, "mf-3", "/home/u/.claude/projects/-tmp-memfile-project/memory/feedback_db.md", feedback)
    about = "---\nname: role\ndescription: who\ntype: user\n---\nThe user is a data scientist new to Go."
    await read(client, "mf-3", "/home/u/.claude/projects/-tmp-memfile-project/memory/user_role.md", about)
    keyed = {"decisions": ["Deploys go through the staging slot first, then swap."], "notes": ["Met on Tuesday."]}
    await read(client, "mf-3", f"{CWD}/.memory/project.json", json.dumps(keyed))
    cut = json.dumps(DOCUMENT, indent=2)[:260]  # the first entry whole, the second cut inside its text
    await read(client, "mf-3", f"{CWD}/memory-bank/memories.json", cut)
    rows = await from_files(client, "mf-3")
    assert sorted((r["kind"], r["text"]) for r in rows) == [
        ("decision", "Deploys go through the staging slot first, then swap."),
        ("preference", "Integration tests hit a real database, never mocks."),
        ("preference", "Release notes go in CHANGELOG.md under Unreleased, newest entry first."),
    ]


async def test_the_file_as_it_is_now_retires_what_it_no_longer_holds(quiet: Any) -> None:
    """The memory tool consolidates its file (here the agent writes it back, as the chess session's Stop hook asked):
    an entry reworded supersedes the one it was, an entry of a kind the file no longer has is archived, one kept
    stays. A read that shows part of the file (`head`) retires nothing."""
    daemon, client = quiet
    await read(client, "mf-4", MEMORY_FILE, json.dumps(DOCUMENT, indent=2))
    consolidated = {
        "memories": [
            {"type": "preference", "content": "Release notes go in CHANGELOG.md under Unreleased, newest first."},
            {"type": "tech_decision", "content": "Chose SQLite WAL over Postgres for the local cache: one file."},
            {"type": "tech_decision", "content": "Settings are stored as TOML, one file per profile."},
        ]
    }
    await read(client, "mf-4", MEMORY_FILE, json.dumps(consolidated, indent=2), tool="Write")
    head = json.dumps({"memories": consolidated["memories"][2:]}, indent=2)
    await read(client, "mf-4", MEMORY_FILE, head, tool="Bash", command=f"head -n 8 {MEMORY_FILE}")
    rows = {r["text"]: r for r in await from_files(client, "mf-4")}
    live = sorted(t for t, r in rows.items() if r["archived_at"] is None and r["superseded_by"] is None)
    assert live == sorted(m["content"] for m in consolidated["memories"])
    old_rule = rows["Release notes go in CHANGELOG.md under Unreleased, newest entry first."]
    assert old_rule["superseded_by"] == rows["Release notes go in CHANGELOG.md under Unreleased, newest first."]["id"]
    old_decision = rows["Chose SQLite WAL over Postgres for the local cache: one file, no server."]
    assert old_decision["superseded_by"] == rows["Chose SQLite WAL over Postgres for the local cache: one file."]["id"]
    gone = rows["The watcher misses renames on network drives; poll there instead."]
    assert gone["archived_at"] is not None and gone["superseded_by"] is None
    block = (await client.call("context", kind="start", session_id="mf-4-next", cwd=CWD))["text"]
    assert "newest first." in block and "newest entry first" not in block and "watcher" not in block, block
