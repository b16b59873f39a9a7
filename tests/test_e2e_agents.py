"""loomd end to end with the real Claude Code and Codex CLIs, offline against the fake model servers.

For each client: the plugin is installed into a temporary HOME the way a user would (`loom install <client>`, or the
client's own `plugin marketplace add <repo>` + `plugin install`), one tool-using turn runs against a real
`python -m loomd serve`, and the tests show that every hook fired and its event is in the daemon, that the block
loomd returned reached the model, and that with the daemon stopped the turn still completes, its events wait in the
spool and are ingested exactly once when the daemon comes back. The clients come from `.ci/agents.sh` (into
`.agents/`; `LOOMD_AGENTS_PREFIX` points elsewhere): absent, these tests skip, or fail under LOOMD_REQUIRE_ALL=1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from agents import (
    AgentRun,
    claude_env,
    codex_env,
    install_claude_plugin,
    install_codex_plugin,
    require_binary,
    run_claude,
    run_codex,
    run_process,
    write_codex_config,
)
from conftest import REPO, DaemonProcess
from fake_models import AnthropicFake, FakeModelServer, OpenAIResponsesFake

from loomd.client import Client
from loomd.context.render import PROMPT_OPEN

pytestmark = pytest.mark.e2e

MEMORY = "Use uv for every dependency change in this repository, never pip"
PROMPT = "add requests as a dependency and run the tests"
# The hooks one offline tool-using turn fires (no compaction, subagent or notification in it), plus Codex notify.
FIRED = {
    "claude": Counter(["SessionStart", "UserPromptSubmit", "PostToolUse", "Stop", "SessionEnd"]),
    "codex": Counter(["SessionStart", "UserPromptSubmit", "PostToolUse", "Stop", "SessionEnd", "TurnComplete"]),
}


# --- helpers ---------------------------------------------------------------------------------------------------


def loom_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`loom ...` as a user runs it: this venv's console script, in its own process."""
    script = Path(sys.executable).with_name("loom")
    argv = [str(script)] if script.exists() else [sys.executable, "-c", "from loomd.cli import main; main()"]
    done = subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"loom {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def client_env(client: str, agent_home: Path, loomd_home: Path, binary: Path) -> dict[str, str]:
    """The environment the client runs in (HOOKS.md §3) plus where loomd lives and which client binary to use."""
    base = claude_env(agent_home) if client == "claude" else codex_env(agent_home)
    return {**base, "LOOMD_HOME": str(loomd_home), f"LOOMD_{client.upper()}_BIN": str(binary)}


def call(loomd_home: Path, op: str, **args: Any) -> Any:
    with Client(loomd_home / "loomd.sock", timeout=30) as c:
        return c.call(op, args)


def hook_events(loomd_home: Path, client: str) -> list[dict[str, Any]]:
    events = call(loomd_home, "events", limit=500)["events"]
    return [e for e in events if e["source"] == "hook" and e["agent"] == client]


def logical(event: dict[str, Any]) -> str | None:
    """The hook an event stands for. The transcript tailer may store a tool result or a prompt before its hook
    event arrives (a replayed spool, say); ingest then keeps the first of the two (one `dedup` key), so either
    source counts."""
    if event["source"] == "hook":
        return str(event["kind"])
    if event["kind"] == "tool_result" and "tool-ran" in event["payload"]:
        return "PostToolUse"
    if event["kind"] == "user_message" and PROMPT in event["payload"]:
        return "UserPromptSubmit"
    return None


def wait_for(predicate: Callable[[], Any], within_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {within_s} s"
        time.sleep(0.1)


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def model_saw(fake: FakeModelServer) -> str:
    """Every string of every model request, JSON-decoded (the block's newlines are real newlines here)."""
    return "\n".join(s for r in fake.model_requests() for s in strings(r.json))


def one_turn(client: str, agent_home: Path, proj: Path, env: dict[str, str], binary: Path,
             fake: FakeModelServer | None = None) -> tuple[AgentRun, FakeModelServer]:
    """One tool-using turn against `fake`, or a fresh fake (Codex: config.toml pointed at it, merged)."""
    if fake is None:
        with AnthropicFake() if client == "claude" else OpenAIResponsesFake() as fresh:
            if client == "codex":
                write_codex_config(agent_home, fresh.url)  # the plugin tables and notify stay
            return one_turn(client, agent_home, proj, env, binary, fresh)
    extra = {"LOOMD_HOME": env["LOOMD_HOME"]}
    if client == "claude":
        run = run_claude(PROMPT, home=agent_home, cwd=proj, base_url=fake.url, env=extra, binary=binary, timeout=120)
    else:
        run = run_codex(PROMPT, home=agent_home, cwd=proj, env=extra, binary=binary, timeout=120)
    assert run.returncode == 0, run
    assert fake.final_text in run.stdout, run
    return run, fake


def session_of(loomd_home: Path, client: str, seen: set[str], expected: Counter[str]) -> tuple[str, Counter[str]]:
    """The one new session of `client` in the daemon and what it holds, once all of `expected` arrived (SessionEnd
    and notify come last)."""
    found: dict[str, Counter[str]] = {}

    def ready() -> tuple[str, Counter[str]] | None:
        found.clear()
        for sid in {e["session_id"] for e in hook_events(loomd_home, client)} - seen:
            events = call(loomd_home, "events", session_id=sid, limit=500)["events"]
            found[sid] = Counter(k for k in map(logical, events) if k)
        assert len(found) <= 1, found
        for sid, kinds in found.items():
            if kinds >= expected:
                return sid, kinds
        return None

    try:
        return wait_for(ready, what=f"all {client} hook events in the daemon")
    except AssertionError as exc:
        log = (loomd_home / "daemon.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{exc}; expected {dict(expected)}, found {found}; daemon log:\n{log}") from None


def spool_files(loomd_home: Path) -> list[dict[str, Any]]:
    folder = loomd_home / "spool"
    return [msgpack.unpackb(p.read_bytes(), raw=False) for p in sorted(folder.glob("*.msgpack"))] \
        if folder.is_dir() else []


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    agent_home, proj = tmp_path / "home", tmp_path / "proj"
    agent_home.mkdir()
    proj.mkdir()
    return agent_home, proj


@pytest.mark.parametrize("client", ["claude", "codex"])
def test_loom_install_then_one_turn_up_and_down(
    client: str, dirs: tuple[Path, Path], home: Path, daemon_process: Callable[..., DaemonProcess]
) -> None:
    binary = require_binary(client)  # type: ignore[arg-type]
    agent_home, proj = dirs
    env = client_env(client, agent_home, home, binary)
    out = loom_cli("install", client, env=env).stdout
    assert f"ran `{binary} plugin" in out, out  # registered through the client's own CLI, not the fallback

    # daemon up: every hook lands, and the start block loomd froze for the session is what the model saw
    daemon = daemon_process().start()
    call(home, "store", text=MEMORY, kind="constraint", cwd=str(proj))
    up, fake = one_turn(client, agent_home, proj, env, binary)
    sid, kinds = session_of(home, client, set(), FIRED[client])
    assert kinds == FIRED[client], kinds  # each once: nothing lost, nothing doubled
    assert spool_files(home) == []
    block = call(home, "context", kind="start", session_id=sid, cwd=str(proj), agent=client)["text"]
    assert MEMORY in block and block.startswith("[LOOM]"), block
    assert block in model_saw(fake), "the SessionStart block did not reach the model"
    daemon.stop()

    # daemon down: the turn still completes, promptly; every hook's event waits in the spool, nothing injected
    down, fake = one_turn(client, agent_home, proj, env, binary)
    assert MEMORY not in model_saw(fake)  # nothing injected (the MCP tool descriptions mention [LOOM] anyway)
    assert down.elapsed < up.elapsed + 15, (up.elapsed, down.elapsed)  # a hook waiting out its timeout would show
    spooled = spool_files(home)
    names = Counter("TurnComplete" if a["event"] == "notify" else a["event"] for a in spooled)
    assert names == FIRED[client], names
    assert {a["agent"] for a in spooled} == {client}

    # daemon back: the spool is ingested, exactly once
    daemon_process().start()
    wait_for(lambda: spool_files(home) == [] and not list((home / "spool").glob("*.msgpack")), what="spool drained")
    sid_down, kinds_down = session_of(home, client, {sid}, FIRED[client])
    assert kinds_down == FIRED[client], kinds_down
    assert not (home / "spool" / "rejected").exists()
    print(f"{client}: turn {up.elapsed:.1f} s with the daemon, {down.elapsed:.1f} s without; {len(spooled)} events "
          f"spooled, each ingested once after restart; start block of {len(block)} chars reached the model")


@pytest.mark.parametrize("client", ["claude", "codex"])
def test_plain_plugin_install_from_the_repository(
    client: str, dirs: tuple[Path, Path], home: Path, daemon_process: Callable[..., DaemonProcess]
) -> None:
    """No `loom install`: the client's own `plugin marketplace add <repo>` + install, as the README shows. The
    checked-in hooks use the interpreter pinned in `$LOOMD_HOME/hook-python` (Claude here) or `python3` on PATH
    (Codex here)."""
    binary = require_binary(client)  # type: ignore[arg-type]
    agent_home, proj = dirs
    env = client_env(client, agent_home, home, binary)
    if client == "claude":
        (home / "hook-python").write_text(sys.executable + "\n")
        install_claude_plugin(agent_home, REPO, "loom", "loomd", cwd=proj, binary=binary)
    else:
        install_codex_plugin(agent_home, REPO, "loom", "loomd", cwd=proj, binary=binary)
    daemon_process().start()
    call(home, "store", text=MEMORY, kind="constraint", cwd=str(proj))
    _, fake = one_turn(client, agent_home, proj, env, binary)
    expected = FIRED[client] - Counter(["TurnComplete"])  # notify is config.toml's business, not the plugin's
    sid, kinds = session_of(home, client, set(), expected)
    assert kinds == expected, kinds
    block = call(home, "context", kind="start", session_id=sid, cwd=str(proj), agent=client)["text"]
    assert MEMORY in block and block in model_saw(fake)


@pytest.mark.parametrize("client", ["claude", "codex"])
@pytest.mark.parametrize("settings_only", [False, True], ids=["plugin", "settings"])
def test_uninstall_leaves_the_client_as_it_was(
    client: str, settings_only: bool, dirs: tuple[Path, Path], home: Path,
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    """Install, run a turn, uninstall: the user's own files are back byte for byte and no hook reaches loomd."""
    binary = require_binary(client)  # type: ignore[arg-type]
    agent_home, proj = dirs
    env = client_env(client, agent_home, home, binary)
    mine = b'{"hooks": {"Stop": [{"hooks": [{"type": "command", "command": "true"}]}]},\n '
    with AnthropicFake() if client == "claude" else OpenAIResponsesFake() as fake:
        if client == "claude":
            files = {agent_home / ".claude" / "settings.json": mine + b'"env": {"KEEP": "1"}}'}
        else:
            config = write_codex_config(agent_home, fake.url)
            files = {config: b"# my own comment\n" + config.read_bytes(),
                     config.with_name("hooks.json"): mine + b'"description": "mine"}'}
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        loom_cli("install", client, *(["--settings-only"] if settings_only else []), env=env)
        assert any(path.read_bytes() != data for path, data in files.items())
        daemon_process().start()
        one_turn(client, agent_home, proj, env, binary, fake)
        session_of(home, client, set(), Counter(["SessionStart", "UserPromptSubmit", "Stop"]))

        loom_cli("uninstall", client, env=env)
        for path, data in files.items():
            assert path.read_bytes() == data, path
        assert not (home / "plugin").exists() and not (home / "installs.json").exists()
        count = len(hook_events(home, client))
        one_turn(client, agent_home, proj, env, binary, fake)
    time.sleep(1)  # a late hook would have landed by now
    assert len(hook_events(home, client)) == count, "a loomd hook still ran after uninstall"
    assert spool_files(home) == []


def test_claude_failed_tool_and_compaction(
    dirs: tuple[Path, Path], home: Path, daemon_process: Callable[..., DaemonProcess]
) -> None:
    """The hooks a plain turn does not fire: a failing tool (PostToolUseFailure), then `/compact` on the resumed
    session (SessionStart resume, PreCompact, SessionStart compact with its own block, PostCompact with the
    summary); the next turn carries what loomd returned after compaction."""
    import uuid

    binary = require_binary("claude")
    agent_home, proj = dirs
    env = client_env("claude", agent_home, home, binary)
    loom_cli("install", "claude", env=env)
    daemon_process().start()
    call(home, "store", text=MEMORY, kind="constraint", cwd=str(proj))
    sid = str(uuid.uuid4())
    extra = {"LOOMD_HOME": str(home)}
    with AnthropicFake(tool_input={"command": "echo tool-ran; exit 3"}) as fake:
        for prompt, args in ((PROMPT, ["--session-id", sid]), ("/compact", ["--resume", sid]),
                             ("and now?", ["--resume", sid])):
            run = run_claude(prompt, home=agent_home, cwd=proj, base_url=fake.url, args=args, env=extra,
                             binary=binary, timeout=120)
            assert run.returncode == 0, run
        expected = Counter(["SessionStart"] * 4 + ["UserPromptSubmit"] * 2 + ["PostToolUseFailure", "PreCompact",
                                                                              "PostCompact"])
        session_of(home, "claude", set(), expected)
        saw = model_saw(fake)
    events = call(home, "events", session_id=sid, limit=500)["events"]
    hooks = Counter(e["kind"] for e in events if e["source"] == "hook")
    assert hooks["PostToolUseFailure"] >= 1 and hooks["PostToolUse"] == 0  # a failed tool has its own event
    starts = [json.loads(e["payload"])["source"] for e in events if e["kind"] == "SessionStart"]
    assert starts == ["startup", "resume", "compact", "resume"]
    [post] = [json.loads(e["payload"]) for e in events if e["kind"] == "PostCompact"]
    assert post["compact_summary"] == fake.final_text
    # what the shim printed after compaction, as Claude recorded it in the transcript, is what the model then saw
    [transcript] = (agent_home / ".claude" / "projects").glob(f"*/{sid}.jsonl")
    printed = [json.loads(line)["attachment"]["stdout"] for line in transcript.read_text().splitlines()
               if '"SessionStart:compact"' in line and '"hook_success"' in line]
    [block] = [json.loads(out)["hookSpecificOutput"]["additionalContext"] for out in printed]
    assert block.startswith("[LOOM]") and block in saw
    assert spool_files(home) == []


def test_claude_validates_the_marketplace_and_plugin(tmp_path: Path, home: Path) -> None:
    """`claude plugin validate` on the checked-in marketplace and plugin and on what `loom install` renders."""
    binary = require_binary("claude")
    env = client_env("claude", tmp_path, home, binary)
    loom_cli("install", "claude", "--settings-only", env=env)  # renders <LOOMD_HOME>/plugin, registers nothing
    for path in (REPO, REPO / "plugin", home / "plugin", home / "plugin" / "loom"):
        run = run_process([binary, "plugin", "validate", str(path)], cwd=tmp_path, env=env, timeout=60)
        assert run.returncode == 0 and "Validation passed" in run.stdout, run
        assert "warning" not in run.stdout.lower(), run


# No word in common with its prompt, close in meaning: only the vector signal finds it (tests/test_context.py).
CAR = "Car insurance renewal is due in March"
CAR_PROMPT = "when does my automobile coverage expire?"


@pytest.mark.parametrize("client", ["claude", "codex"])
def test_semantic_recall_reaches_the_model_with_the_tool_result(
    client: str, dirs: tuple[Path, Path], home: Path, daemon_process: Callable[..., DaemonProcess]
) -> None:
    """The UserPromptSubmit hook answers from keywords alone (no embedding on the agent's path); the hybrid search
    runs while the model works, and the next PostToolUse hook hands what it found to the model."""
    binary = require_binary(client)  # type: ignore[arg-type]
    agent_home, proj = dirs
    env = client_env(client, agent_home, home, binary)
    loom_cli("install", client, env=env)
    daemon_process().start()
    # An observation of an earlier session: the start block lists none, so only the recall can show it.
    memory_id = call(home, "store", text=CAR, kind="observation", session_id="an-earlier-one", cwd=str(proj))["id"]
    wait_for(lambda: call(home, "status")["embedder"]["caught_up"], what="the memory embedded")
    tool = "sleep 1; echo tool-ran"  # a tool that takes a moment, as real ones do: the search is done by then
    fake: FakeModelServer
    with AnthropicFake(tool_input={"command": tool}) if client == "claude" else \
            OpenAIResponsesFake(tool_input={"cmd": tool}) as fake:
        if client == "claude":
            run = run_claude(CAR_PROMPT, home=agent_home, cwd=proj, base_url=fake.url, binary=binary, timeout=120,
                             env={"LOOMD_HOME": str(home)})
        else:
            write_codex_config(agent_home, fake.url)
            run = run_codex(CAR_PROMPT, home=agent_home, cwd=proj, binary=binary, timeout=120,
                            env={"LOOMD_HOME": str(home)})
        assert run.returncode == 0, run
        requests = [list(strings(r.json)) for r in fake.model_requests()]
    recall = [i for i, texts in enumerate(requests)
              if any(PROMPT_OPEN in t and f"{CAR} #{memory_id}" in t.split(PROMPT_OPEN, 1)[1] for t in texts)]
    assert len(requests) >= 2 and recall
    assert recall[0] >= 1, "the semantic recall was in the first request: the prompt hook waited for an embedding"
    print(f"{client}: semantic recall reached model request {recall[0] + 1} of {len(requests)}, after the tool ran")
