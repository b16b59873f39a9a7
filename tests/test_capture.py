"""Auto-capture rules, each fired by a real payload shape sent through a real daemon, and plumbing never."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

import pytest

from loomd.client import AsyncClient
from loomd.daemon import Daemon
from loomd.ingest.capture import RULES, SESSIONS_KEPT, Capturer
from loomd.ingest.events import Event
from loomd.ingest.reading import commit_subject, failed_output, shell_command

_ids = itertools.count(1)


def claude_post(command: str, stdout: str = "", stderr: str = "", *, session: str = "cap", failed: bool = False,
                tool: str = "Bash", tool_input: dict[str, Any] | None = None) -> bytes:
    """The shape Claude Code 2.1 sends for PostToolUse (tool_response is an object)."""
    n = next(_ids)
    body: dict[str, Any] = {
        "session_id": session, "transcript_path": f"/tmp/{session}.jsonl", "cwd": "/tmp/capproj",
        "permission_mode": "default", "hook_event_name": "PostToolUseFailure" if failed else "PostToolUse",
        "tool_name": tool, "tool_input": tool_input or {"command": command, "description": "run"},
        "tool_use_id": f"toolu_{n:04d}", "duration_ms": 40,
    }
    if failed:
        body["error"] = f"Exit code 1\n{stderr or stdout}"
    else:
        body["tool_response"] = {"stdout": stdout, "stderr": stderr, "interrupted": False, "isImage": False}
    return json.dumps(body).encode()


def codex_post(command: str, output: str, exit_code: int, *, session: str = "capx") -> bytes:
    """The shape Codex 0.171 sends: tool_response is a string, and the session has a turn_id."""
    n = next(_ids)
    return json.dumps({
        "session_id": session, "turn_id": f"turn{n}",
        "transcript_path": f"/tmp/.codex/sessions/rollout-{session}.jsonl",
        "cwd": "/tmp/capproj", "hook_event_name": "PostToolUse", "model": "gpt-5.1-codex",
        "permission_mode": "bypassPermissions", "tool_name": "Bash", "tool_input": {"command": command},
        "tool_response": f"Exit code: {exit_code}\nWall time: 0.2 seconds\nOutput:\n{output}",
        "tool_use_id": f"call_{n}",
    }).encode()


def prompt(text: str, session: str = "cap") -> bytes:
    return json.dumps({"session_id": session, "transcript_path": f"/tmp/{session}.jsonl", "cwd": "/tmp/capproj",
                       "hook_event_name": "UserPromptSubmit", "prompt": text}).encode()


async def send(client: AsyncClient, raw: bytes) -> None:
    event = json.loads(raw)["hook_event_name"]
    await client.call("hook", raw=raw, event=event, eid=f"cap-{next(_ids)}")


async def captured(client: AsyncClient) -> list[dict[str, Any]]:
    """Every memory, via `detail` (ids are dense from 1)."""
    total = (await client.call("status"))["counts"]
    count = total["memories"] + total["archived"]
    if not count:
        return []
    return (await client.call("detail", id=list(range(1, count + 1)), sources=True))["memories"]


async def test_every_rule_fires_on_its_payload(client: AsyncClient) -> None:
    await send(client, claude_post('git commit -m "Switch the cache to Redis streams"',
                                    "[main 1a2b3c4] Switch the cache to Redis streams\n 1 file changed"))
    await send(client, claude_post("git checkout -b feature/retry-queue", "Switched to a new branch"))
    await send(client, claude_post("git stash -u; git checkout -b chore/bump-node", "Switched to a new branch"))
    await send(client, claude_post("", tool="Edit", tool_input={"file_path": "/tmp/capproj/pyproject.toml",
                                                                "old_string": "a", "new_string": "b"}))
    await send(client, claude_post("npm run build", stderr="Error: Cannot find module 'vite'", failed=True))
    await send(client, claude_post("npm run build", stderr="Error: Cannot find module 'vite'", failed=True))
    await send(client, claude_post("npm run build", "built in 2.1s"))
    await send(client, codex_post("pytest tests/test_api.py", "FAILED tests/test_api.py::test_login - assert 401", 1))
    await send(client, codex_post("pytest tests/test_api.py", "5 passed in 0.31s", 0))
    await send(client, prompt("From now on always run the linter before committing. Thanks!"))
    await send(client, prompt("I prefer small commits with imperative subjects."))
    memories = await captured(client)
    by_origin = {m["origin"]: m for m in memories}
    assert by_origin["capture:git_commit"]["text"] == "Committed: Switch the cache to Redis streams"
    assert by_origin["capture:git_commit"]["kind"] == "decision"
    history = [m["text"] for m in memories if m["origin"] == "capture:git_history"]
    assert "New branch feature/retry-queue" in history
    # More than the branch happened: the whole command line is part of the fact.
    assert "New branch chore/bump-node: `git stash -u; git checkout -b chore/bump-node`" in history
    assert by_origin["capture:significant_edit"]["text"] == "Edited /tmp/capproj/pyproject.toml"
    assert "Cannot find module" in by_origin["capture:repeated_failure"]["text"]
    assert by_origin["capture:repeated_failure"]["kind"] == "error"
    assert by_origin["capture:fixed_after_failure"]["text"].startswith("Works: `npm run build`")
    assert by_origin["capture:tests_green"]["text"].startswith("Tests green again: `pytest tests/test_api.py`")
    assert "5 passed" in by_origin["capture:tests_green"]["text"]
    rules = [m for m in memories if m["origin"] == "capture:user_rule"]
    assert {m["kind"] for m in rules} == {"constraint", "preference"}
    assert any(m["text"].startswith("From now on always run the linter") for m in rules)
    assert {r.name for r in RULES} <= {m["origin"].split(":", 1)[1] for m in memories}
    # Each captured memory links back to the event that produced it.
    assert all(m["sources"] for m in memories)


async def test_the_rules_remember_only_the_recently_active_sessions(daemon: Daemon, client: AsyncClient) -> None:
    """What the rules remember within a session (its failing commands) is kept for the SESSIONS_KEPT most recently
    active sessions: a daemon that has seen many sessions holds a bounded state, and an active one still has its
    fix linked to its failures."""
    await send(client, claude_post("npm run build", stderr="Error: Cannot find module 'vite'", session="busy",
                                   failed=True))
    for n in range(SESSIONS_KEPT + 20):
        await send(client, prompt(f"tidy the module number {n}", session=f"many-{n}"))
        if n % 100 == 0:
            await send(client, claude_post("npm run build", stderr="Error: Cannot find module 'vite'",
                                           session="busy", failed=True))
    await send(client, claude_post("npm run build", "built in 2.1s", session="busy"))
    (capturer,) = [p for p in daemon.writer.processors if isinstance(p, Capturer)]
    assert len(capturer.sessions) == SESSIONS_KEPT and "busy" in capturer.sessions
    fixed = [m for m in await captured(client) if m["origin"] == "capture:fixed_after_failure"]
    assert [m["text"].startswith("Works: `npm run build`") for m in fixed] == [True]


async def test_a_long_rule_keeps_its_end_in_memory_and_in_the_next_start_block(client: AsyncClient) -> None:
    """What to do often closes a long request: the rule is kept past 200 characters, and the start block's line
    (160 characters) shows its start and its end around the cut, not just its start."""
    ask = ("this package would need a bump to node 22 or even 24, check out the recent work in docs and the current"
           " plan in motion from the other session and let's make a PR (we would need to rebase later but that's"
           " fine I guess) and you must bump to node 22 then 24 if possible")
    await send(client, prompt(ask, session="cap-long"))
    (rule,) = [m for m in await captured(client) if m["origin"] == "capture:user_rule"]
    assert rule["kind"] == "constraint" and rule["text"].endswith("bump to node 22 then 24 if possible")
    block = (await client.call("context", kind="start", session_id="cap-next", cwd="/tmp/capproj"))["text"]
    (line,) = [ln for ln in block.splitlines() if ln.startswith("[C]")]
    assert "this package would need a bump" in line and "node 22 then 24 if possible" in line and " … " in line
    assert len(line) <= 160


@pytest.mark.parametrize("command", [
    "git push origin main", "git stash", "ls -la", "cat README.md", "git status", "git commit", "git commit --amend",
    "pwd", "git diff HEAD~1", "echo hello",
])
async def test_plumbing_never_fires(client: AsyncClient, command: str) -> None:
    await send(client, claude_post(command, "output"))
    await send(client, claude_post(command, stderr="fatal: something", failed=True))
    await send(client, claude_post(command, stderr="fatal: something", failed=True))
    await send(client, claude_post(command, "output"))
    await send(client, claude_post("", tool="Read", tool_input={"file_path": "/tmp/capproj/src/app.py"}))
    await send(client, claude_post("", tool="Edit", tool_input={"file_path": "/tmp/capproj/src/app.py"}))
    await send(client, prompt("yes"))
    await send(client, prompt("what does this function do?"))
    stats = await client.call("stats")
    assert stats["counts"]["memories"] == 0, stats


async def test_rate_limit_per_session(client: AsyncClient, home) -> None:
    for i in range(80):
        await send(client, claude_post(f'git commit -m "change number {i}"', "ok", session="busy"))
    stats = await client.call("stats")
    assert stats["memories"]["decision"]["active"] == 60  # capture_rate_per_session


def test_parsers_on_real_command_shapes() -> None:
    assert commit_subject('git commit -m "fix: handle empty input"', "") == ("", "fix: handle empty input", "")
    assert commit_subject("git commit -am 'wip'", "") == ("", "wip", "")
    assert commit_subject(
        "git commit -m \"$(cat <<'EOF'\nAdd retry queue\n\nLonger body\nEOF\n)\"", "") == ("", "Add retry queue", "")
    assert commit_subject('git commit -m "$MSG"', "") is None
    assert commit_subject("git commit", "") is None
    assert commit_subject('git commit -m "x"', "[main 1a2b3c4d] Real subject\n 1 file changed") == \
        ("1a2b3c4", "Real subject", "main")
    assert shell_command({"command": ["bash", "-lc", "npm test"]}) == "npm test"
    assert shell_command({"cmd": "cargo test"}) == "cargo test"
    # Codex's code mode: a JavaScript snippet calling the shell tool, its argument JSON or a JavaScript literal.
    assert shell_command({"input": 'const r = await tools.exec_command({"cmd":"sed -n \'1,80p\' SKILL.md",'
                                   '"workdir":"/w"});\ntext(r.output);'}) == "sed -n '1,80p' SKILL.md"
    assert shell_command({"input": 'const a = await tools.exec_command({cmd:"cargo test -q",workdir:w});\n'
                                   'const b = await tools.exec_command({cmd:"git status --short"});'}) == \
        "cargo test -q\ngit status --short"
    assert shell_command({"input": "const r = await tools.web__run({open: [{ref_id: 'x'}]});"}) == ""
    assert shell_command({"command": 5}) == ""


def test_a_failed_run_is_read_from_its_exit_code_in_any_case() -> None:
    """The exit-code pattern is case-insensitive, and the check before it must not miss what it matches: `İ` and `ı`
    match its `i` too (lower-casing keeps `ı` and turns `İ` into two characters)."""
    for output in ("Exit code 1", "EXIT CODE: 2", 'x "exit_code": 3', "build: exit status 4", "ex\u0130t code 5",
                   "EX\u0131T code 6", "Exit code -1"):
        assert failed_output(output, False), output
    for output in ("Exit code 0", "exit", "ok build step passed", "", "exit code x", "e-x-i-t code 1"):
        assert not failed_output(output, False), output
    assert failed_output("anything", True)


# Any JSON value, where a hook or transcript line carries a tool call: what an agent or a script may send.
ODD_VALUES: list[Any] = [1, -2.5, True, None, "ls -la", [], [1, "a"], {}, {"command": 5},
                         {"command": ["bash", "-lc", 3]}, {"command": None, "file_path": {"a": 1}}, {"todos": 7},
                         {"input": ["*** Update File: x"]}, {"plan": 3, "description": []}]


async def test_any_json_shape_of_a_tool_call_is_stored(client: AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    """Hook PostToolUse and transcript tool_use/tool_result with odd tool_input and tool_response values: every
    event is acknowledged and stored, and no error is logged (the capture rules read them as 'no command')."""
    caplog.set_level(logging.ERROR)
    before = (await client.call("status"))["counts"]["events"]
    sent = 0
    for n, value in enumerate(ODD_VALUES):
        for tool in ("Bash", "Edit", "apply_patch", "TodoWrite", "mcp__x__y"):
            body = {"session_id": "odd", "cwd": "/tmp/capproj", "hook_event_name": "PostToolUse", "tool_name": tool,
                    "tool_input": value, "tool_response": ODD_VALUES[-1 - n], "tool_use_id": f"odd-{n}-{tool}"}
            await send(client, json.dumps(body).encode())
            failure = {**body, "hook_event_name": "PostToolUseFailure", "error": value, "tool_use_id": f"f{n}{tool}"}
            await send(client, json.dumps(failure).encode())
            line = {"agent": "claude", "session_id": "odd-t", "cwd": "/tmp/capproj", "source": "transcript",
                    "tool_name": tool, "tool_use_id": f"t-{n}-{tool}", "ts": 1.0 + n}
            await client.call("ingest", events=[{**line, "kind": "tool_use", "key": f"u{n}{tool}",
                                                 "payload": {"tool_name": tool, "tool_input": value}},
                                                {**line, "kind": "tool_result", "key": f"r{n}{tool}",
                                                 "payload": {"text": str(value), "is_error": value}}])
            sent += 4
    assert (await client.call("status"))["counts"]["events"] - before == sent
    assert [r.getMessage() for r in caplog.records if r.name.startswith("loomd")] == []


async def test_a_failing_processor_loses_no_event(daemon: Daemon, client: AsyncClient,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A bug in a processor (here: one that raises on a marked event, added beside the capture rules) must not
    cost events: the hostile event is stored without its captures, the events committed in the same group commit
    are stored with theirs, and every submitter gets its ack."""
    async def broken(_db: Any, events: Any) -> None:
        if any(isinstance(e, Event) and e.payload.get("tool_use_id") == "poison" for e in events):
            raise TypeError("argument of type 'int' is not iterable")

    daemon.writer.processors.append(broken)
    caplog.set_level(logging.WARNING)
    before = (await client.call("status"))["counts"]["events"]
    poison = json.loads(claude_post('git commit -m "Poisoned subject"', "[main 9f9f9f9] Poisoned subject"))
    poison["tool_use_id"] = "poison"
    raws = [claude_post(f'git commit -m "Change number {i}"', f"[main {i:07x}] Change number {i}") for i in range(20)]
    raws.insert(7, json.dumps(poison).encode())
    # Concurrent submitters share group commits; the poisoned one fails its group's first attempt.
    await asyncio.gather(*(send(client, raw) for raw in raws))
    assert (await client.call("status"))["counts"]["events"] - before == 21
    texts = {m["text"] for m in await captured(client)}
    assert {f"Committed: Change number {i}" for i in range(20)} <= texts
    assert "Committed: Poisoned subject" not in texts
    logged = [r.getMessage() for r in caplog.records if r.name == "loomd.ingest.writer"]
    assert "1 event(s) stored without their captures: a processor failed on them" in logged, logged
