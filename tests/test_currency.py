"""Currency: a later step that fixes an earlier failure supersedes the error noted about it. The error leaves the
start block, ranks below its successor, and the chain stays visible in `detail`. On a synthetic session, then on
every real transcript of the coding-QA set (at least one must show the chain)."""

from __future__ import annotations

import json
from typing import Any

from conftest import need_test_data

CWD = "/tmp/currency-project"


def hook(session: str, event: str, **fields: Any) -> dict[str, Any]:
    payload = {"session_id": session, "hook_event_name": event, "cwd": CWD, **fields}
    return {"event": event, "agent": "claude", "raw": json.dumps(payload)}


def bash(session: str, command: str, output: str, n: int, *, failed: bool = False) -> dict[str, Any]:
    return hook(session, "PostToolUseFailure" if failed else "PostToolUse", tool_name="Bash",
                tool_input={"command": command}, tool_use_id=f"tu-{session}-{n}",
                **({"error": output} if failed else {"tool_response": {"stdout": output, "exit_code": 0}}))


async def test_a_fixed_failure_supersedes_its_error(quiet: Any) -> None:
    _, client = quiet
    s = "cur-1"
    for args in [hook(s, "UserPromptSubmit", prompt="run the unit tests please"),
                 bash(s, "npm test", "sh: 1: jest: not found", 1, failed=True),
                 bash(s, "npm install", "added 312 packages in 9s", 2),
                 bash(s, "npm test", "Tests: 42 passed, 42 total", 3),
                 hook(s, "SessionEnd", reason="exit")]:
        await client.call("hook", **args)
    run = await client.call("workers_run", name="observer", session_id=s, final=True)
    assert run["outcome"] == "ok"
    rows = (await client.call("timeline", session_id=s, include_archived=True, limit=100))["memories"]
    errors = [r for r in rows if r["kind"] == "observation" and "error" in r["tags"]]
    fixes = [r for r in rows if r["kind"] == "observation" and {"pitfall", "progress", "procedure"} & set(r["tags"])
             and "npm test" in r["text"]]
    assert errors and fixes, [(r["kind"], r["tags"], r["text"]) for r in rows]
    assert all(e["superseded_by"] == fixes[0]["id"] for e in errors)
    detail = (await client.call("detail", id=errors[0]["id"]))["memories"][0]
    assert detail["superseded_by"] == fixes[0]["id"]
    found = await client.call("search", query="npm test jest not found", kind="observation",
                              project=rows[0]["project"], limit=20)
    order = [r["id"] for r in found["results"]]
    assert fixes[0]["id"] in order and errors[0]["id"] in order
    assert order.index(fixes[0]["id"]) < order.index(errors[0]["id"])  # the current one ranks first
    start = await client.call("context", kind="start", project=rows[0]["project"])
    assert f"#{errors[0]['id']}" not in start["text"]


async def test_a_command_that_works_again_supersedes_its_fails_repeatedly(quiet: Any) -> None:
    """Capture, at ingest: "Fails repeatedly: X" is out of date once X works (the "Works: X" capture supersedes it),
    so the next start block does not warn about a command that works."""
    _, client = quiet
    s = "cur-cap"
    error = "ImportError: cannot import name 'get_config' from 'app'"
    for args in [bash(s, "uv run python -c 'import app'", error, 1, failed=True),
                 bash(s, "uv run python -c 'import app'", error, 2, failed=True),
                 bash(s, "uv run python -c 'import app'", "ok", 3)]:
        await client.call("hook", **args)
    rows = (await client.call("timeline", session_id=s, include_archived=True, limit=100))["memories"]
    repeated = [r for r in rows if r["kind"] == "error" and r["text"].startswith("Fails repeatedly")]
    works = [r for r in rows if r["kind"] == "procedure" and r["text"].startswith("Works:")]
    assert repeated and works, [(r["kind"], r["text"]) for r in rows]
    assert repeated[0]["superseded_by"] == works[0]["id"]
    start = await client.call("context", kind="start", session_id="cur-cap-next", project=rows[0]["project"])
    assert "Fails repeatedly" not in start["text"] and "Works:" in start["text"]


async def test_real_sessions_show_supersession(quiet: Any) -> None:
    daemon, client = quiet
    qa = json.loads(need_test_data("coding-qa-dev.json").read_bytes())
    data = need_test_data("transcripts")
    chains = 0
    for session in qa["sessions"]:
        if session["format"] == "hooks":
            continue
        imported = await daemon.tailer.import_file(data / session["path"])
        for sid in imported["sessions"]:
            run = await client.call("workers_run", name="observer", session_id=sid, final=True)
            assert run["outcome"] == "ok", run
        superseded = await daemon.store.fetchall(
            "SELECT m.id, m.superseded_by, s.text, s.origin, json_extract(m.meta, '$.file') = json_extract(s.meta,"
            " '$.file') FROM memories m JOIN memories s ON s.id = m.superseded_by"
            " WHERE m.session_id IN (SELECT value FROM json_each(?))", [json.dumps(imported["sessions"])])
        for old_id, new_id, successor, origin, same_file in superseded:
            edge = await daemon.store.scalar(
                "SELECT count(*) FROM edges WHERE src_id = ? AND dst_id = ? AND type = 'supersedes'", (new_id, old_id))
            assert edge == 1, (old_id, new_id)
            if origin == "capture:memory_file":  # an entry of a memory file, by what the file says now
                assert same_file, (old_id, new_id)
                continue
            assert successor.startswith(("Works:", "Tests pass:", "Tests green:")) or " worked" in successor, successor
        chains += len(superseded)
    assert chains > 0, "no real session shows an error superseded by its fix"
