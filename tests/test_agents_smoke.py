"""The real Claude Code and Codex CLIs, offline against the fake model servers: every hook fires and hook context
reaches the model. Proves the harness in ``agents.py`` / ``fake_models.py`` with a probe hook, not loomd code.

Skips when a client binary is absent, unless ``LOOMD_REQUIRE_ALL=1``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agents import (
    CLAUDE_EVENTS,
    CODEX_EVENTS,
    codex_home,
    codex_mcp_config,
    command_hooks,
    install_claude_plugin,
    install_codex_plugin,
    make_plugin_marketplace,
    mcp_stdio_server,
    require_binary,
    run_claude,
    run_codex,
    write_claude_hooks,
    write_claude_mcp_config,
    write_codex_config,
    write_codex_hooks,
)
from fake_models import AnthropicFake, OpenAIResponsesFake

PLUGIN, MARKETPLACE = "loomtest", "loomtest-mkt"
INJECTING = ("SessionStart", "UserPromptSubmit", "PostToolUse")

pytestmark = pytest.mark.e2e

PROBE = """\
import json, os, sys
raw = sys.stdin.read()
try:
    data = json.loads(raw) if raw.strip() else {}
except ValueError:
    data = {"unparsed": raw}
event = data.get("hook_event_name") or (sys.argv[1] if len(sys.argv) > 1 else "?")
env = {k: v for k, v in os.environ.items() if k.startswith(("CLAUDE", "CODEX")) or k in ("HOME", "PWD")}
with open(LOG, "a") as f:
    f.write(json.dumps({"event": event, "argv": sys.argv[1:], "stdin": data, "env": env}) + "\\n")
if event in INJECTING:
    out = {"hookSpecificOutput": {"hookEventName": event, "additionalContext": "MARKER-" + event}}
    sys.stdout.write(json.dumps(out))
"""


# A stdlib stdio MCP server (newline-delimited JSON-RPC) with one tool, probe_search.
MCP_PROBE = """\
import json, sys
def send(msg):
    sys.stdout.write(json.dumps(dict(msg, jsonrpc="2.0")) + "\\n")
    sys.stdout.flush()
TOOL = {"name": "probe_search", "description": "Search the probe memory",
        "inputSchema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
for line in sys.stdin:
    if not line.strip():
        continue
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if mid is None:
        continue
    if method == "initialize":
        version = msg["params"].get("protocolVersion", "2025-06-18")
        send({"id": mid, "result": {"protocolVersion": version, "capabilities": {"tools": {}},
                                    "serverInfo": {"name": "probe", "version": "0"}}})
    elif method == "tools/list":
        send({"id": mid, "result": {"tools": [TOOL]}})
    elif method == "tools/call":
        query = msg["params"].get("arguments", {}).get("query")
        send({"id": mid, "result": {"content": [{"type": "text", "text": "PROBE-RESULT " + str(query)}]}})
    elif method == "ping":
        send({"id": mid, "result": {}})
    else:
        send({"id": mid, "error": {"code": -32601, "message": "no such method"}})
"""
MCP_TOOL = "mcp__probe__probe_search"


def probe_source(log: Path, shebang: str) -> str:
    return f"{shebang}\nLOG = {str(log)!r}\nINJECTING = {INJECTING!r}\n{PROBE}"


def read_log(log: Path, expected: set[str], timeout: float = 5.0) -> list[dict[str, Any]]:
    """Hook records, waiting briefly for late ones (SessionEnd, notify) to land."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if expected <= {r["event"] for r in records} or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    return home, proj, tmp_path / "hooks.jsonl"


@pytest.mark.parametrize("install", ["settings", "plugin"])
def test_claude_hooks_fire_and_inject(tmp_path: Path, dirs: tuple[Path, Path, Path], install: str) -> None:
    claude = require_binary("claude")
    home, proj, log = dirs
    plugin_dir: Path | None = None
    if install == "settings":
        script = tmp_path / "probe-hook"
        script.write_text(probe_source(log, f"#!{sys.executable} -SE"))
        # The form loomd's installer writes: absolute interpreter, -S -E, absolute script.
        command = f"{shlex.quote(sys.executable)} -S -E {shlex.quote(str(script))}"
        write_claude_hooks(home, command_hooks(command, CLAUDE_EVENTS))
    else:
        plugin_dir = make_plugin_marketplace(
            tmp_path / "mkt",
            plugin=PLUGIN,
            marketplace=MARKETPLACE,
            hooks=command_hooks("${CLAUDE_PLUGIN_ROOT}/shims/probe-hook", CLAUDE_EVENTS),
            files={"shims/probe-hook": probe_source(log, f"#!{sys.executable} -SE")},
        )
        install_claude_plugin(home, tmp_path / "mkt", PLUGIN, MARKETPLACE, cwd=proj, binary=claude)

    with AnthropicFake() as fake:
        run = run_claude("hello there", home=home, cwd=proj, base_url=fake.url, binary=claude, timeout=90)
        assert run.returncode == 0, run
        assert fake.final_text in run.stdout
        records = read_log(log, set(CLAUDE_EVENTS))
        sent = fake.request_text()
        tool_results = fake.tool_results()

    fired = [r["event"] for r in records]
    assert set(CLAUDE_EVENTS) <= set(fired), fired
    assert len({r["stdin"]["session_id"] for r in records}) == 1
    for event in INJECTING:
        assert f"MARKER-{event}" in sent, f"{event} context did not reach the model"
    assert any("tool-ran" in json.dumps(t) for t in tool_results)
    post = next(r for r in records if r["event"] == "PostToolUse")
    assert post["stdin"]["tool_name"] == "Bash"
    for r in records:
        assert r["env"]["CLAUDECODE"] == "1"
        assert r["env"]["CLAUDE_CODE_SESSION_ID"] == r["stdin"]["session_id"]
        assert Path(r["env"]["CLAUDE_PROJECT_DIR"]).resolve() == proj.resolve()
        if plugin_dir is not None:
            # A directory marketplace is used in place: the root is the source dir, not a cache copy.
            assert Path(r["env"]["CLAUDE_PLUGIN_ROOT"]).resolve() == plugin_dir.resolve()
        else:
            assert "CLAUDE_PLUGIN_ROOT" not in r["env"]


@pytest.mark.parametrize("install", ["settings", "plugin"])
def test_codex_hooks_fire_and_inject(tmp_path: Path, dirs: tuple[Path, Path, Path], install: str) -> None:
    codex = require_binary("codex")
    home, proj, log = dirs
    script = tmp_path / "probe-hook"
    script.write_text(probe_source(log, f"#!{sys.executable} -SE"))
    command = f"{shlex.quote(sys.executable)} -S -E {shlex.quote(str(script))}"
    notify = [sys.executable, "-S", "-E", str(script), "notify"]

    with OpenAIResponsesFake() as fake:
        write_codex_config(home, fake.url, extra={"notify": notify})
        if install == "settings":
            write_codex_hooks(home, command_hooks(command, CODEX_EVENTS))
        else:
            make_plugin_marketplace(
                tmp_path / "mkt",
                plugin=PLUGIN,
                marketplace=MARKETPLACE,
                hooks=command_hooks("${CLAUDE_PLUGIN_ROOT}/shims/probe-hook", CODEX_EVENTS),
                files={"shims/probe-hook": probe_source(log, f"#!{sys.executable} -SE")},
            )
            install_codex_plugin(home, tmp_path / "mkt", PLUGIN, MARKETPLACE, cwd=proj, binary=codex)
        run = run_codex("hello codex", home=home, cwd=proj, binary=codex, timeout=90)
        assert run.returncode == 0, run
        assert fake.final_text in run.stdout
        records = read_log(log, {*CODEX_EVENTS, "notify"})
        sent = fake.request_text()
        outputs = fake.tool_outputs()

    fired = [r["event"] for r in records]
    assert {*CODEX_EVENTS, "notify"} <= set(fired), fired
    hook_records = [r for r in records if r["event"] != "notify"]
    assert len({r["stdin"]["session_id"] for r in hook_records}) == 1
    for event in INJECTING:
        assert f"MARKER-{event}" in sent, f"{event} context did not reach the model"
    assert any("tool-ran" in json.dumps(o) for o in outputs)
    post = next(r for r in records if r["event"] == "PostToolUse")
    assert post["stdin"]["tool_name"] == "Bash"
    assert isinstance(post["stdin"]["tool_response"], str)
    # notify gets its payload as one argv argument, not on stdin.
    payload = json.loads(next(r for r in records if r["event"] == "notify")["argv"][1])
    assert payload["type"] == "agent-turn-complete"
    cache = (codex_home(home) / "plugins" / "cache").resolve()
    for r in hook_records:
        assert "CLAUDECODE" not in r["env"]
        if install == "plugin":
            # Codex runs the cached copy made at install time.
            assert cache in Path(r["env"]["CLAUDE_PLUGIN_ROOT"]).resolve().parents
        else:
            assert "CLAUDE_PLUGIN_ROOT" not in r["env"]


def test_claude_mcp_tool_result_reaches_model(tmp_path: Path, dirs: tuple[Path, Path, Path]) -> None:
    claude = require_binary("claude")
    home, proj, _ = dirs
    server = tmp_path / "mcp_probe.py"
    server.write_text(MCP_PROBE)
    args = write_claude_mcp_config(
        tmp_path / "mcp.json", {"probe": mcp_stdio_server(sys.executable, ["-S", "-E", str(server)])}
    )
    with AnthropicFake(tool_name=MCP_TOOL, tool_input={"query": "deploy"}) as fake:
        run = run_claude(
            "search memory",
            home=home,
            cwd=proj,
            base_url=fake.url,
            args=args,
            allowed_tools=["mcp__probe"],
            binary=claude,
            timeout=90,
        )
        assert run.returncode == 0, run
        first = fake.model_requests()[0].json
        results = fake.tool_results()
    assert MCP_TOOL in [t["name"] for t in first["tools"]]
    assert len(results) == 1 and not results[0].get("is_error"), results
    assert "PROBE-RESULT deploy" in json.dumps(results[0]["content"])


def test_codex_mcp_tool_result_reaches_model(tmp_path: Path, dirs: tuple[Path, Path, Path]) -> None:
    codex = require_binary("codex")
    home, proj, _ = dirs
    server = tmp_path / "mcp_probe.py"
    server.write_text(MCP_PROBE)
    mcp = codex_mcp_config({"probe": mcp_stdio_server(sys.executable, ["-S", "-E", str(server)])})
    with OpenAIResponsesFake(tool_name=MCP_TOOL, tool_input={"query": "deploy"}) as fake:
        write_codex_config(home, fake.url, extra=mcp)
        run = run_codex("search memory", home=home, cwd=proj, binary=codex, timeout=90)
        assert run.returncode == 0, run
        outputs = fake.tool_outputs()
    assert len(outputs) == 1, outputs
    assert "PROBE-RESULT deploy" in json.dumps(outputs[0]["output"])
