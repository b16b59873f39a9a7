"""Distillers: the observer's rules on synthetic sessions, similarity rules, and the optional model path against a
fake model server on 127.0.0.1 that speaks the real OpenAI chat-completions and Anthropic Messages wire formats."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from secret_corpus import GITHUB_PAT
from test_workers import PROJECT, loomd, work_session

from loomd.errors import ModelError
from loomd.ingest.reading import clip, command_heads, commit_subject, first_error_line
from loomd.ingest.sentences import classify_user_sentence
from loomd.workers.model import ModelClient, parse_observations
from loomd.workers.reflector import Mem, contradicts, same_meaning, supersedes
from loomd.workers.rules import observe
from loomd.workers.steps import SourceEvent
from loomd.workers.text import classify_assistant_sentence, content_words

KEY = "sk-test-" + "9f8e7d6c5b4a3f2e1d0c"


# --- the observer's rules ------------------------------------------------------------------------------------------

class Session:
    """Builds SourceEvents the way the ingest path stores them (hook and transcript kinds)."""

    def __init__(self, sid: str = "s") -> None:
        self.sid, self.events, self.t = sid, [], 1_700_000_000.0

    def add(self, kind: str, payload: dict[str, Any], **kw: Any) -> SourceEvent:
        self.t += 1
        e = SourceEvent(len(self.events) + 1, self.sid, kind, self.t, "claude", "p", kw.get("tool_name"),
                        kw.get("tool_use_id"), payload)
        self.events.append(e)
        return e

    def user(self, text: str) -> None:
        self.add("user_message", {"text": text})

    def assistant(self, text: str) -> None:
        self.add("assistant_message", {"text": text})

    def run(self, command: str, output: str, failed: bool = False, tool: str = "Bash",
            tool_input: dict[str, Any] | None = None) -> None:
        tid = f"t{len(self.events)}"
        self.add("tool_use", {"tool_name": tool, "tool_input": tool_input or {"command": command}}, tool_name=tool,
                 tool_use_id=tid)
        self.add("tool_result", {"text": output, "is_error": failed}, tool_use_id=tid)

    def hook_run(self, command: str, stdout: str, stderr: str = "", exit_code: int = 0) -> None:
        self.add("PostToolUse", {"tool_name": "Bash", "tool_input": {"command": command},
                                 "tool_response": {"stdout": stdout, "stderr": stderr, "exit_code": exit_code}},
                 tool_name="Bash")

    def observe(self, final: bool = False, split: int = 0) -> list[tuple[str, str]]:
        context, new = self.events[:split], self.events[split:]
        return [(o.type, o.text) for o in observe(new, context, final=final)]


@pytest.mark.parametrize("sentence, kind", [
    ("From now on always run the linter before committing.", "constraint"),
    ("Don't use ClMail for communication, use the builtin subagent teams.", "constraint"),
    ("THIS IS READ ONLY WORKFLOW FOR NOW, but the doc must list every issue.", "constraint"),
    ("Make sure to use branching appropriately.", "constraint"),
    ("I don't want to make it only work for me or make assumptions about people's env.", "preference"),
    ("I prefer small commits with imperative subjects.", "preference"),
    ("ok, fine, let's do vite", "decision"),
    ("They don't look that bad.", None),
    ("Why don't you check the logs first?", None),
    ("Can you add margin-bottom to the details element when it's not open?", None),
    ("I want to pick it up again and fix the broken APIs.", None),
    ("Thanks, that works!", None),
])
def test_user_sentences_are_classified_like_a_careful_reader_would(sentence: str, kind: str | None) -> None:
    assert classify_user_sentence(sentence) == kind


@pytest.mark.parametrize("sentence, kind", [
    ("I'll use tenacity for the retries because it already handles jitter.", "decision"),
    ("Since this is an existing codebase, I'll modify the CI to allow type check failures for now.", "decision"),
    ("Key finding: SQS still uses aws-sdk v2 in every package.", "finding"),
    ("The build has some dependency issues, but those are unrelated to our changes.", "blocker"),
    ("Let me check the test configuration first.", None),
    ("Now let me look at how the parser handles nested archives.", None),
])
def test_assistant_sentences(sentence: str, kind: str | None) -> None:
    assert classify_assistant_sentence(sentence) == kind


def test_a_failure_and_its_fix_become_a_pitfall_with_the_reason() -> None:
    s = Session()
    s.user("Do all the tests pass?")
    s.run("pytest", "/bin/bash: line 1: pytest: command not found", failed=True)
    s.assistant("Need to activate the virtual environment. Let me run tests properly:")
    s.run("(source .venv/bin/activate && pytest)", "======= 40 passed in 1.2s =======")
    got = s.observe()
    pitfall = [t for k, t in got if k == "pitfall"]
    assert pitfall == ["`pytest` failed (/bin/bash: line 1: pytest: command not found); "
                       "`(source .venv/bin/activate && pytest)` worked (Need to activate the virtual environment.)"]
    assert ("procedure", "Tests pass: `(source .venv/bin/activate && pytest)`") in got


def test_a_run_piped_through_tail_keeps_its_summary_and_one_through_head_does_not() -> None:
    """`| tail -n` keeps the end of the output, where the runner's summary is: the run proves the tests pass (a real
    session ran its suite only this way). `| head` and `| grep` cut it: such a run proves nothing."""
    s = Session()
    s.run("PYTHONPATH=src python3 -m pytest tests/ -v 2>&1 | tail -20",
          "tests/test_store.py::test_roundtrip PASSED\n============ 78 passed in 0.41s ============")
    s.run("python3 -m pytest tests/ -v | head -3", "tests/test_a.py::test_one PASSED")
    got = s.observe()
    assert [t for k, t in got if k == "procedure"] == [
        "Tests pass: `PYTHONPATH=src python3 -m pytest tests/ -v 2>&1 | tail -20`"]


def test_tests_going_green_and_commits_from_hook_payloads() -> None:
    s = Session()
    s.hook_run("npm test", "Tests  1 failed | 28 passed (29)", exit_code=1)
    s.hook_run("npm test", "Tests  29 passed (29)")
    s.hook_run("git commit -m 'Fix the retry budget'", "[main 0badf00] Fix the retry budget\n 1 file changed")
    got = s.observe()
    assert ("progress", "Tests green: `npm test` (Tests 29 passed (29)); was failing: Tests 1 failed | 28 passed "
                        "(29)") in got
    assert ("decision", "Committed [main 0badf00]: Fix the retry budget") in got


def test_an_unrelated_later_command_is_not_called_a_fix() -> None:
    s = Session()
    s.run("git checkout main && git pull origin main", "error: Your local changes would be overwritten", True)
    s.run("git checkout -b feature/docs", "Switched to a new branch 'feature/docs'")
    assert not [t for k, t in s.observe() if k == "pitfall"]


def test_a_rejected_command_and_its_replacement_say_what_the_user_prefers() -> None:
    s = Session()
    s.run("npm install", "The user doesn't want to proceed with this tool use. The tool use was rejected.", True)
    s.run("pnpm install", "Packages: +11\nDone in 2.1s")
    assert ("preference", "User rejected `npm install`; `pnpm install` was used instead") in s.observe()


def test_user_choices_plans_and_open_todos() -> None:
    s = Session()
    s.run("", 'User has answered your questions: "How should corrupted archives be reported?"="Option C: Extra '
              'field". You can now continue.', tool="AskUserQuestion", tool_input={"questions": []})
    s.run("", "User has approved your plan.", tool="ExitPlanMode",
          tool_input={"plan": "# Plan: Add Tar Archive Support\n\n## Overview"})
    s.run("", "ok", tool="TodoWrite", tool_input={"todos": [
        {"content": "Write the tests", "status": "completed"},
        {"content": "Update the README", "status": "pending"}]})
    got = s.observe(final=True)
    assert ("decision", 'User chose "Option C: Extra field" for: How should corrupted archives be reported?') in got
    assert ("decision", "Plan approved: Add Tar Archive Support") in got
    assert ("todo", "Unfinished (pending): Update the README") in got
    assert not [k for k, _ in s.observe(final=False) if k == "todo"]  # only a finished session has leftovers


def test_a_choice_keeps_its_object_and_the_user_speaks_outside_prompts() -> None:
    s = Session()
    s.assistant("For the bundler I'd go with Vite or webpack; Vite builds faster and needs less config.")
    s.user("ok, fine, let's do vite")
    s.run("", 'User has answered your questions: "How should corrupted archives be reported?"="Option C: Extra '
              'field". You can now continue.', tool="AskUserQuestion", tool_input={"questions": [
                  {"question": "How should corrupted archives be reported?", "options": [
                      {"label": "Option C: Extra field", "description": "Keep the archive and flag it in a field"}]}]})
    s.run("", "The user doesn't want to proceed with this tool use. The tool use was rejected. To tell you how to "
              "proceed, the user said:\nSplit the plan into milestones with a contract for each\n\nNote: The user's "
              "next message may contain a correction or preference.", True, tool="ExitPlanMode",
          tool_input={"plan": "# Plan"})
    s.run("", json.dumps({"answers": {"pace": {"answers": ["Fast (Recommended)", "user_note: Prioritize tests over "
                                                           "speed of delivery, always."]}}}),
          tool="request_user_input", tool_input={"questions": [
              {"id": "pace", "question": "How fast should we go?",
               "options": [{"label": "Fast (Recommended)", "description": "Ship daily"}]}]})
    got = s.observe(final=True)
    assert ("decision", "ok, fine, let's do vite (on: For the bundler I'd go with Vite or webpack; Vite builds faster "
                        "and needs less config.)") in got
    assert ("decision", 'User chose "Option C: Extra field: Keep the archive and flag it in a field" for: How should '
                        "corrupted archives be reported?") in got
    assert ("goal", "User said instead of ExitPlanMode: Split the plan into milestones with a contract for each") in got
    assert ("decision", 'User chose "Fast (Recommended): Ship daily" for: How fast should we go?') in got
    assert ("preference", "Prioritize tests over speed of delivery, always.") in got


def test_a_change_the_user_asked_for_is_a_decision_with_what_it_became() -> None:
    """"Let's make X be Y" is the user's choice; its object is in the agent's report of the change."""
    s = Session()
    s.user("Let's modify the link button to be classic blue link color")
    s.run("", "The file has been updated.", tool="Edit", tool_input={
        "file_path": "docs/showcase.html", "old_string": "color: var(--primary-600);", "new_string": "color: #0066cc;"})
    s.assistant("Perfect! The link button now uses classic blue (#0066cc) with a darker blue (#004499) on hover.")
    s.user("make sure you commit and push to run on the latest")  # a rule, not a change of how a thing is
    s.assistant("Committed and pushed the showcase change to the main branch.")
    s.user("update the readme to mention the new theme")  # reported on something else: no decision
    s.assistant("Done: I added a section about the warm orange palette to the docs.")
    got = s.observe(final=True)
    decisions = [t for k, t in got if k == "decision"]
    assert decisions == ["Let's modify the link button to be classic blue link color → The link button now uses "
                         "classic blue (#0066cc) with a darker blue (#004499) on hover."], got


def test_a_compaction_summary_keeps_intent_pending_work_and_fixes() -> None:
    s = Session()
    s.add("compact_summary", {"text": (
        "This session is being continued from a previous conversation.\nSummary:\n"
        "1. Primary Request and Intent:\n   - Release v0.2.0 on GitHub and npm\n"
        "4. Errors and fixes:\n   - Git checkout errors:\n      - Local changes would be overwritten\n"
        "      - Fixed using: git stash\n"
        "7. Pending Tasks:\n   - None explicitly requested\n"
        "9. Optional Next Step:\n   - Close issue #351 since deals are already implemented\n")})
    got = s.observe()
    assert ("goal", "Before compaction: Release v0.2.0 on GitHub and npm") in got
    assert ("pitfall", "Before compaction: Git checkout errors: Local changes would be overwritten; Fixed using: "
                       "git stash") in got
    assert ("todo", "Before compaction: Close issue #351 since deals are already implemented") in got
    assert not any("None explicitly" in t for _, t in got)


def test_a_fix_in_a_code_span_is_not_cut_by_the_clip() -> None:
    """The clip finishes a `code span` it would cut when it closes soon after; a longer one is left out whole."""
    s = Session()
    s.add("compact_summary", {"text": (
        "Summary:\n4. Errors and fixes:\n"
        "   - **Bodyclose Linting Failures**: WebSocket Dial operations didn't close HTTP response bodies:\n"
        "      - Fixed by adding proper cleanup: `if resp != nil && resp.Body != nil { defer resp.Body.Close() }`\n")})
    (fix,) = [t for k, t in s.observe() if k == "pitfall"]
    assert fix.endswith("`if resp != nil && resp.Body != nil { defer resp.Body.Close() }`"), fix
    long_span = "Run " + "step " * 30 + "then `" + "make lint-all-the-things " * 10 + "` and read its output"
    assert clip(long_span).endswith("then…") and len(clip(long_span)) <= 200


def test_context_events_pair_and_inform_but_produce_nothing_themselves() -> None:
    s = Session()
    s.user("Never push on Fridays.")
    s.run("pytest -x", "=== 1 failed, 3 passed in 0.1s ===\nFAILED tests/test_a.py::test_b", True)
    s.run("pytest -x", "=== 4 passed in 0.1s ===")
    got = s.observe(split=3)  # the rule and the failure are context; only the green run is new
    assert not any(k == "constraint" for k, _ in got)
    assert any(k == "progress" and t.startswith("Tests green: `pytest -x`") for k, t in got)


def test_every_observation_is_short_and_sourced() -> None:
    s = Session()
    s.user("Please " + "refactor the enormous module " * 40 + ". Never break the public API.")
    s.assistant("I'll use the adapter pattern because " + "it keeps callers unchanged " * 30)
    s.run("make build", "error: " + "x" * 5000, True)
    for obs in observe(s.events, final=True):
        assert 0 < len(obs.text) <= 200 and obs.sources and set(obs.sources) <= {e.id for e in s.events}


def test_command_parsing_helpers() -> None:
    assert command_heads("cd app && (source .venv/bin/activate && pytest -x) | tail -5") == {"pytest"}
    assert command_heads("unset GITHUB_TOKEN; gh issue list --repo a/b") == {"gh issue"}
    assert command_heads("npm run build && npm run test:offline") == {"npm run build", "npm run test:offline"}
    assert commit_subject("git commit -m \"$(cat <<'EOF'\nfeat: x\n\nbody\nEOF\n)\"",
                          "[master 70f2781] feat: add tar support\n 3 files changed") == ("70f2781",
                                                                                         "feat: add tar support",
                                                                                         "master")
    assert first_error_line("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'") \
        == "KeyError: 'x'"


@pytest.mark.parametrize("output, line", [
    # the checker's own diagnostic, not its count ("Found 1 error." was chosen before)
    ("Exit code 1\nW292 [*] No newline at end of file\n --> src/server.py:260:6\n\nFound 1 error.\n"
     "[*] 1 fixable with the `--fix` option.", "W292 [*] No newline at end of file"),
    ("ANN401 Dynamically typed expressions (typing.Any) are disallowed in `_get`\n\nFound 1 error.",
     "ANN401 Dynamically typed expressions (typing.Any) are disallowed in `_get`"),
    ("===== FAILURES =====\n___ test_retry ___\nFAILED tests/test_up.py::test_retry - assert 0 == 3\n"
     "=== 1 failed, 4 passed in 0.3s ===", "FAILED tests/test_up.py::test_retry - assert 0 == 3"),
    ("src/cli.ts(350,27): error TS2345: Argument of type 'X' is not assignable",
     "src/cli.ts(350,27): error TS2345: Argument of type 'X' is not assignable"),
    ("Found 3 errors in 2 files (checked 5 source files)", "Found 3 errors in 2 files (checked 5 source files)"),
])
def test_the_error_line_names_the_error_not_a_banner(output: str, line: str) -> None:
    assert first_error_line(output) == line


def _mem(i: int, kind: str, text: str, created: float) -> Mem:
    return Mem(i, kind, text, created, None, None, 0.5, 0, {}, content_words(text), frozenset(), None, text)


def test_similarity_rules() -> None:
    a = _mem(1, "constraint", "Never commit directly to main, always open a pull request.", 1)
    b = _mem(2, "constraint", "Never commit directly to main; always open a pull request!", 2)
    c = _mem(3, "constraint", "Always commit directly to main, open a pull request.", 3)
    assert same_meaning(a, b) and not same_meaning(a, c) and contradicts(c, a)
    old = _mem(4, "decision", "I'll use SQLite for the job queue because it needs no server.", 1)
    new = _mem(5, "decision", "I'll switch the job queue to Postgres instead of SQLite for concurrent writers.", 2)
    unrelated = _mem(6, "decision", "I'll use ruff instead of flake8 because it is faster.", 3)
    assert supersedes(new, old) and not supersedes(old, new) and not supersedes(unrelated, old)
    q1 = _mem(7, "decision", 'User chose "Option A" for: How should errors be reported?', 1)
    q2 = _mem(8, "decision", 'User chose "Option C" for: How should errors be reported?', 2)
    assert supersedes(q2, q1)


# --- the model path ------------------------------------------------------------------------------------------------

Reply = Callable[[dict[str, Any], str], tuple[int, Any, float]]


class FakeModel:
    """A model endpoint on 127.0.0.1; `reply(body, api)` -> (status, JSON-able body or raw bytes, delay seconds)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                api = "anthropic" if self.path.endswith("/messages") else "openai"
                owner.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                       "body": body, "api": api})
                status, payload, delay = owner.reply(body, api)
                time.sleep(delay)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (a timeout test)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeModel:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def wire(api: str, text: str, prompt_tokens: int = 900, output_tokens: int = 100) -> dict[str, Any]:
    """A real-shaped, non-streaming reply of either API carrying `text`."""
    if api == "openai":
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
                          "total_tokens": prompt_tokens + output_tokens}}
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "fake",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens}}


def prompt_of(body: dict[str, Any], api: str) -> str:
    return body["messages"][-1]["content"] if api == "anthropic" else body["messages"][1]["content"]


def good(body: dict[str, Any], api: str, tokens: int = 900) -> tuple[int, Any, float]:
    first = int(re.search(r"#(\d+)", prompt_of(body, api)).group(1))  # type: ignore[union-attr]
    text = json.dumps({"observations": [
        {"type": "decision", "text": "Model: the uploader retries with tenacity (jitter, backoff).",
         "sources": [first]},
        {"type": "constraint", "text": "Model: never use print for logging; use the logging module.",
         "sources": [first]}]})
    return 200, wire(api, f"```json\n{text}\n```", tokens), 0.0


@pytest.fixture
def model_env() -> Iterator[Callable[..., dict[str, Any]]]:
    def make(api: str, url: str, **extra: Any) -> dict[str, Any]:
        return {"model_api": api, "model_url": url, "model_name": "fake-1", "model_key": KEY,
                "model_timeout_s": 2.0, **extra}
    yield make


async def origins(client: Any) -> list[str]:
    from test_workers import memories

    return [m["origin"] for m in await memories(client, kind="observation")]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_the_model_distils_over_the_real_wire_format(api, monkeypatch, home, model_env, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with FakeModel(good) as fake:
        async with loomd(monkeypatch, home, **model_env(api, fake.url)) as (d, client):
            events = work_session("m1", 1_700_000_000)
            events[0]["payload"]["text"] += f" My token is {GITHUB_PAT} do not leak it."
            await client.call("ingest", events=events)
            result = await client.call("workers_run", name="observer", session_id="m1")
            assert result["outcome"] == "ok" and "model_fallback" not in result["detail"]
            assert set(await origins(client)) == {"observer:model"}
            texts = [o["text"] for o in result["output"]]
            assert "Model: the uploader retries with tenacity (jitter, backoff)." in texts
            usage = json.loads(await d.store.scalar("SELECT value FROM checkpoints WHERE name = 'model:usage'"))
            assert usage["tokens"] == 1000
            jobs = json.dumps([tuple(r) for r in await d.store.fetchall("SELECT * FROM jobs")])
    [request] = fake.requests
    sent = json.dumps(request["body"])
    assert GITHUB_PAT not in sent and "never use print for logging" in sent
    if api == "openai":
        assert request["path"] == "/v1/chat/completions" and request["headers"]["authorization"] == f"Bearer {KEY}"
    else:
        assert request["path"] == "/v1/messages" and request["headers"]["x-api-key"] == KEY
        assert request["headers"]["anthropic-version"] == "2023-06-01" and request["body"]["system"]
    assert KEY not in caplog.text and KEY not in jobs


def _text(payload: str) -> Reply:
    return lambda body, api: (200, wire(api, payload), 0.0)


GARBAGE: dict[str, Reply] = {
    "not json at all": lambda body, api: (200, b"<html>502 Bad Gateway</html>", 0.0),
    "prose instead of json": _text("Sure! Here are some observations about the session."),
    "json without observations": _text('{"notes": ["the uploader has retries"]}'),
    "unknown type": _text('{"observations": [{"type": "gossip", "text": "x", "sources": [1]}]}'),
    "sources from nowhere": _text('{"observations": [{"type": "goal", "text": "x", "sources": [424242]}]}'),
    "text too long": lambda body, api: good(body, api)[:1] + (wire(api, json.dumps({"observations": [
        {"type": "goal", "text": "y" * 201, "sources": [int(re.search(r"#(\d+)", prompt_of(body, api))[1])]}]})),
        0.0),
    "http 500": lambda body, api: (500, {"error": {"message": "overloaded"}}, 0.0),
    "missing content": lambda body, api: (200, {"choices": [], "content": None}, 0.0),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
async def test_garbage_from_the_model_means_the_rules_run(case, monkeypatch, home, model_env) -> None:
    with FakeModel(GARBAGE[case]) as fake:
        async with loomd(monkeypatch, home, **model_env("openai", fake.url)) as (d, client):
            await client.call("ingest", events=work_session("g1", 1_700_000_000))
            result = await client.call("workers_run", name="observer", session_id="g1")
            assert result["outcome"] == "ok" and result["detail"]["model_fallback"]
            assert set(await origins(client)) == {"observer"}
            assert any("never use print for logging" in o["text"] for o in result["output"])
    assert len(fake.requests) == 1


async def test_a_hanging_model_times_out_and_the_rules_run(monkeypatch, home, model_env) -> None:
    with FakeModel(lambda body, api: (200, wire(api, "{}"), 5.0)) as fake:
        async with loomd(monkeypatch, home, **model_env("anthropic", fake.url, model_timeout_s=0.5)) as (d, client):
            await client.call("ingest", events=work_session("h1", 1_700_000_000))
            started = time.monotonic()
            result = await client.call("workers_run", name="observer", session_id="h1")
            assert time.monotonic() - started < 3.0
            assert result["outcome"] == "ok" and "timed out" in result["detail"]["model_fallback"][0]
            assert set(await origins(client)) == {"observer"}


async def test_the_daily_budget_stops_model_calls_and_the_rules_take_over(monkeypatch, home, model_env) -> None:
    with FakeModel(lambda body, api: good(body, api, tokens=9000)) as fake:
        async with loomd(monkeypatch, home, **model_env("openai", fake.url, model_daily_tokens=6000)) as (d, client):
            await client.call("ingest", events=work_session("b1", 1_700_000_000))
            first = await client.call("workers_run", name="observer", session_id="b1")
            assert "model_fallback" not in first["detail"]  # paid for, valid: kept
            await client.call("ingest", events=[{**e, "key": e["key"] + "x"} for e in work_session("b2", 1_7e9)])
            second = await client.call("workers_run", name="observer", session_id="b2")
            assert "would pass the daily model budget (9100 of 6000 tokens used today" \
                in second["detail"]["model_fallback"][0]
            assert {o["origin"] for o in await _session_obs(client, "b2")} == {"observer"}
            status = await client.call("workers")
            assert status["model"]["usage"]["tokens"] == 9100 and status["model"]["daily_tokens"] == 6000
    assert len(fake.requests) == 1  # nothing was sent once the budget was spent


async def test_a_budget_smaller_than_one_request_says_so_on_the_first_call(monkeypatch, home, model_env) -> None:
    with FakeModel(lambda body, api: good(body, api, tokens=10)) as fake:
        async with loomd(monkeypatch, home, **model_env("openai", fake.url, model_daily_tokens=100)) as (d, client):
            await client.call("ingest", events=work_session("b1", 1_700_000_000))
            first = await client.call("workers_run", name="observer", session_id="b1")
            why = first["detail"]["model_fallback"][0]
            assert "a request of about" in why and "(0 of 100 tokens used today" in why and "reached" not in why
    assert fake.requests == []


async def _session_obs(client: Any, session: str) -> list[dict[str, Any]]:
    from test_workers import memories

    return [m for m in await memories(client, kind="observation") if m["session_id"] == session]


def test_model_output_is_validated_strictly() -> None:
    events = {7: SourceEvent(7, "s", "user_message", 1.0, "claude", PROJECT, None, None, {})}
    ok = parse_observations('{"observations": [{"type": "goal", "text": "Ship it", "sources": [7]}]}', events)
    assert [(o.type, o.text, o.sources, o.ts) for o in ok] == [("goal", "Ship it", [7], 1.0)]
    for bad in ('{"observations": [{"type": "goal", "text": "x", "sources": [7], "extra": 1}]}',
                '{"observations": [{"type": "goal", "text": "", "sources": [7]}]}',
                '{"observations": [{"type": "goal", "text": "x", "sources": [true]}]}',
                '{"observations": {"type": "goal"}}', "[]", ""):
        with pytest.raises(ModelError):
            parse_observations(bad, events)


def test_a_model_client_needs_a_known_api_and_never_puts_its_key_in_errors() -> None:
    with pytest.raises(ModelError):
        ModelClient("gemini", "http://x", "m")
    client = ModelClient("openai", "http://127.0.0.1:9/v1", "m", KEY, timeout_s=0.5)
    assert client.endpoint == "http://127.0.0.1:9/v1/chat/completions"
    assert ModelClient("anthropic", "https://api.anthropic.com", "m").endpoint == "https://api.anthropic.com/v1/messages"


async def test_a_private_project_is_never_sent_to_the_model(monkeypatch, home, model_env) -> None:
    from loomd.ignore import PRIVATE_FILE, write_roots

    write_roots(home / PRIVATE_FILE, [PROJECT])  # as `loom project private` writes it
    with FakeModel(lambda body, api: good(body, api, tokens=10)) as fake:
        async with loomd(monkeypatch, home, **model_env("openai", fake.url)) as (_, client):
            await client.call("ingest", events=work_session("pv1", 1_700_000_000))
            run = await client.call("workers_run", name="observer", session_id="pv1")
            assert run["outcome"] == "ok"
            assert f"{PROJECT} is private" in run["detail"]["model_fallback"][0]
            assert {o["origin"] for o in await _session_obs(client, "pv1")} == {"observer"}  # the rules ran
    assert fake.requests == []


def test_the_end_of_a_session_says_where_it_stopped() -> None:
    """The final run notes the user's last request and the agent's last words: where a next session picks up."""
    s = Session()
    s.user("port the uploader to the new queue client")
    s.assistant("The uploader now uses the queue client; 12 tests pass.")
    s.user("how do I explain how to use this to my friends that are also devs?")
    s.assistant("API Error: 400 the request was rejected, the conversation could not continue.")
    stopped = [t for kind, t in s.observe(final=True) if t.startswith("Session stopped")]
    assert len(stopped) == 1 and "my friends that are also devs" in stopped[0] and "API Error: 400" in stopped[0]
    assert "port the uploader" not in stopped[0]  # the last ask, not the first
    assert not [t for _, t in s.observe(final=False) if t.startswith("Session stopped")]  # only at its end
