"""The MCP server (`python -m loomd.mcp`) driven by real clients: the SDK's stdio client, and the real `claude` and
`codex` CLIs offline against the fake model servers, each calling a loom tool whose result must reach the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agents import (
    codex_mcp_config,
    mcp_stdio_server,
    require_binary,
    run_claude,
    run_codex,
    write_claude_mcp_config,
    write_codex_config,
)
from conftest import REPO, path_without_agents
from fake_models import AnthropicFake, OpenAIResponsesFake
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from loomd import __version__
from loomd.daemon import Daemon
from loomd.mcp import TOOLS

MCP_ARGV = [sys.executable, "-m", "loomd.mcp"]
FACT = "We chose PostgreSQL 16 for the billing service because it has logical replication"


@asynccontextmanager
async def mcp_session(home: Path) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "loomd.mcp"], cwd=str(REPO),
                                   env={"LOOMD_HOME": str(home), "PATH": os.environ.get("PATH", "")})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def text_of(result: Any) -> str:
    return "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")


async def call(session: ClientSession, tool: str, args: dict[str, Any] | None = None, *, error: bool = False) -> str:
    result = await session.call_tool(tool, args or {})
    text = text_of(result)
    assert bool(result.isError) is error, f"{tool}: {text}"
    return text


async def test_sdk_client_lists_and_calls_every_tool(daemon: Daemon, home: Path) -> None:
    async with mcp_session(home) as session:
        listed = await session.list_tools()
        names = {t.name for t in listed.tools}
        assert names == set(TOOLS)
        for t in listed.tools:
            assert "token" in (t.description or ""), f"{t.name}: say what it costs"
            assert t.outputSchema is None, f"{t.name}: plain text, no structured duplicate"
        read_only = {t.name for t in listed.tools if t.annotations and t.annotations.readOnlyHint}
        assert read_only == {"loom_search", "loom_detail", "loom_timeline", "loom_evidence", "loom_context",
                             "loom_status", "loom_task_list"}

        stored = await call(session, "loom_store", {"text": FACT, "kind": "decision", "tags": ["db"]})
        assert stored.startswith("stored #")
        memory_id = int(stored.split("#")[1].split()[0])
        assert (await call(session, "loom_store", {"text": FACT, "kind": "decision"})).startswith("already known")

        hits = await call(session, "loom_search", {"query": "billing database replication", "all_projects": True})
        assert f"#{memory_id} [decision]" in hits and "PostgreSQL 16" in hits

        detail = await call(session, "loom_detail", {"ids": [memory_id]})
        assert FACT in detail and "tags db" in detail

        assert f"#{memory_id}" in await call(session, "loom_timeline", {"id": memory_id})
        evidence = await call(session, "loom_evidence", {"id": memory_id})
        assert f"#{memory_id}" in evidence and "stored directly" in evidence

        await call(session, "loom_context")  # the project digest; may be short for a fresh store
        assert "loomd" in await call(session, "loom_status")

        created = await call(session, "loom_task_create", {"title": "migrate billing to PostgreSQL 16"})
        assert "[active]" in created
        task_id = int(created.split("#")[1].split()[0])
        refused = await call(session, "loom_task_close", {"id": task_id}, error=True)
        assert "missing" in refused and "artifact" in refused
        updated = await call(session, "loom_task_update", {"id": task_id, "artifacts": ["db/migrations/0042.sql"],
                                                           "note": "schema written"})
        assert "needs:" in updated and "artifact" not in updated.split("needs:")[1]
        closed = await call(session, "loom_task_close", {
            "id": task_id, "eval_command": "pytest tests/test_billing.py", "eval_result": "12 passed",
            "eval_passed": True, "memory_ids": [memory_id]})
        assert "[stable]" in closed
        assert f"task #{task_id} [stable]" in await call(session, "loom_task_list", {"all_projects": True})

        bad = await call(session, "loom_detail", {"ids": [999_999]}, error=True)
        assert "999999" in bad and "not_found" in bad


async def test_tool_reports_a_daemon_that_is_down(home: Path) -> None:
    async with mcp_session(home) as session:
        text = await call(session, "loom_search", {"query": "anything"}, error=True)
    assert "not running" in text or "cannot reach" in text


def test_import_stays_light_and_the_handshake_answers(home: Path) -> None:
    """Clients drop MCP servers that are slow to start: importing loomd.mcp must not pull the SDK or the daemon's
    heavy modules, and a fresh server answers `initialize` with its own name and version. How fast it answers
    against a bare interpreter is `bench/mcp.py`'s to measure (no timing assertion here: a loaded machine crosses
    any wall-clock bound)."""
    probe = ("import sys, loomd.mcp; heavy = ('mcp', 'pydantic', 'numpy', 'onnxruntime', 'aiosqlite', 'apscheduler');"
             "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
    hello = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}) + "\n"
    proc = subprocess.run(MCP_ARGV, input=hello, capture_output=True, text=True, cwd=REPO, timeout=30,
                          env={**os.environ, "LOOMD_HOME": str(home)})
    reply = json.loads(proc.stdout.splitlines()[0])
    assert reply["result"]["serverInfo"]["name"] == "loom"
    assert reply["result"]["serverInfo"]["version"] == __version__  # its own, not the SDK's


@pytest.fixture
def memory_daemon(daemon_process: Any, tmp_path: Path) -> Any:
    proc = daemon_process().start()
    from loomd.client import Client

    with Client(proc.sock) as client:
        client.call("store", {"text": FACT, "kind": "decision", "project": "elsewhere"})
    return proc


@pytest.mark.e2e
def test_claude_calls_loom_search_and_the_result_reaches_the_model(memory_daemon: Any, tmp_path: Path,
                                                                   home: Path) -> None:
    claude = require_binary("claude")
    user_home, proj = tmp_path / "user", tmp_path / "proj"
    user_home.mkdir()
    proj.mkdir()
    args = write_claude_mcp_config(tmp_path / "mcp.json", {
        "loom": mcp_stdio_server(sys.executable, ["-m", "loomd.mcp"], {"LOOMD_HOME": str(home)})})
    tool = "mcp__loom__loom_search"
    with AnthropicFake(tool_name=tool, tool_input={"query": "billing database", "all_projects": True}) as fake:
        run = run_claude("which database did we choose?", home=user_home, cwd=proj, base_url=fake.url,
                         allowed_tools=(tool,), args=args, binary=claude)
        results = fake.tool_results()
    assert run.returncode == 0, run.stderr
    assert results, f"no tool_result reached the model; stderr: {run.stderr[-2000:]}"
    text = json.dumps(results)
    assert "PostgreSQL 16" in text and "[decision]" in text
    assert not any(r.get("is_error") for r in results), text


@pytest.mark.e2e
def test_codex_calls_loom_search_and_the_result_reaches_the_model(memory_daemon: Any, tmp_path: Path,
                                                                  home: Path) -> None:
    codex = require_binary("codex")
    user_home, proj = tmp_path / "user", tmp_path / "proj"
    user_home.mkdir()
    proj.mkdir()
    servers = {"loom": mcp_stdio_server(sys.executable, ["-m", "loomd.mcp"], {"LOOMD_HOME": str(home)})}
    # `codex exec` sends its first request about a second after start, with whatever MCP servers are ready by
    # then; nothing makes it wait (checked: startup_timeout_sec, startup_readiness = connection|catalog). The
    # handshake time itself is asserted by test_import_stays_light_and_start_is_fast; here a machine busy with
    # other work gets up to three runs, so this test is about the tool's result reaching the model.
    for _attempt in range(3):
        with OpenAIResponsesFake(tool_name="mcp__loom__loom_search",
                                 tool_input={"query": "billing database", "all_projects": True}) as fake:
            write_codex_config(user_home, fake.url, extra=codex_mcp_config(servers))
            run = run_codex("which database did we choose?", home=user_home, cwd=proj, binary=codex)
            outputs = fake.tool_outputs()
        assert run.returncode == 0, run.stderr
        if outputs:
            break
    assert outputs, f"codex never called the tool (server too slow to start?); stderr: {run.stderr[-2000:]}"
    assert "PostgreSQL 16" in json.dumps(outputs)


LOOM = str(Path(sys.executable).with_name("loom"))


def loom(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LOOM, *args], env=env, capture_output=True, text=True, timeout=180, cwd=REPO)


@pytest.mark.e2e
def test_loom_install_mcp_registers_with_both_real_clients(tmp_path: Path, memory_daemon: Any, home: Path) -> None:
    claude, codex = require_binary("claude"), require_binary("codex")
    user_home = tmp_path / "user"
    user_home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(user_home), "LOOMD_HOME": str(home),
           "LOOMD_CLAUDE_BIN": str(claude), "LOOMD_CODEX_BIN": str(codex), "CODEX_HOME": str(user_home / ".codex")}
    (user_home / ".codex").mkdir()
    printed = loom("install", "mcp", "--print", env=env)
    assert printed.returncode == 0, printed.stderr
    assert f"{claude} mcp add -s user loom -e LOOMD_HOME={home} -- " in printed.stdout
    assert f"{codex} mcp add loom --env LOOMD_HOME={home} -- " in printed.stdout
    assert " -m loomd.mcp" in printed.stdout
    done = loom("install", "mcp", env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    again = loom("install", "mcp", env=env)  # idempotent: claude's "already exists" is handled
    assert again.returncode == 0, again.stderr
    client_env = {k: env[k] for k in ("PATH", "HOME", "CODEX_HOME")}
    got = subprocess.run([claude, "mcp", "get", "loom"], env=client_env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "loomd.mcp" in got.stdout and "Connected" in got.stdout, got.stdout + got.stderr
    listed = subprocess.run([codex, "mcp", "list"], env=client_env, capture_output=True, text=True, timeout=120)
    assert "loom" in listed.stdout and "loomd.mcp" in listed.stdout, listed.stdout + listed.stderr
    removed = loom("uninstall", "mcp", env=env)
    assert removed.returncode == 0, removed.stderr
    got = subprocess.run([claude, "mcp", "get", "loom"], env=client_env, capture_output=True, text=True, timeout=120)
    assert got.returncode != 0
    listed = subprocess.run([codex, "mcp", "list"], env=client_env, capture_output=True, text=True, timeout=120)
    assert "loomd.mcp" not in listed.stdout


def test_loom_install_mcp_without_the_clients_edits_their_files(tmp_path: Path) -> None:
    user_home = tmp_path / "user"
    (user_home / ".codex").mkdir(parents=True)
    claude_json = user_home / ".claude.json"
    claude_json.write_text(json.dumps({"numStartups": 3, "mcpServers": {"other": {"command": "x"}}}))
    codex_toml = user_home / ".codex" / "config.toml"
    original = 'model = "gpt-5"  # keep me\n\n[mcp_servers.other]\ncommand = "y"\n'
    codex_toml.write_text(original)
    # No claude or codex on PATH (whatever this machine has): the config files are edited, not the CLIs run.
    env = {"PATH": path_without_agents(user_home / "bin"), "HOME": str(user_home), "LOOMD_HOME": "/srv/loom"}
    done = loom("install", "mcp", env=env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(claude_json.read_text())
    assert doc["numStartups"] == 3 and doc["mcpServers"]["other"] == {"command": "x"}
    assert doc["mcpServers"]["loom"]["args"] == ["-m", "loomd.mcp"]
    assert doc["mcpServers"]["loom"]["env"] == {"LOOMD_HOME": "/srv/loom"}
    assert list(user_home.glob(".claude.json.loomd-bak-*"))  # backed up first
    import tomllib

    text = codex_toml.read_text()
    assert text.startswith(original.rstrip("\n"))
    table = tomllib.loads(text)["mcp_servers"]
    assert table["other"] == {"command": "y"} and table["loom"]["env"] == {"LOOMD_HOME": "/srv/loom"}
    assert Path(table["loom"]["command"]).parent == Path(sys.executable).parent
    assert loom("install", "mcp", env=env).returncode == 0  # twice: still one table
    assert codex_toml.read_text().count("[mcp_servers.loom]") == 1
    removed = loom("uninstall", "mcp", env=env)
    assert removed.returncode == 0, removed.stderr
    assert "loom" not in json.loads(claude_json.read_text())["mcpServers"]
    assert codex_toml.read_text().rstrip("\n") == original.rstrip("\n")


def test_socket_candidates_follow_the_shims_rules(tmp_path: Path) -> None:
    from loomd.mcp import socket_candidates

    assert socket_candidates({"LOOMD_HOME": str(tmp_path)}) == [tmp_path / "loomd.sock"]
    assert socket_candidates({"HOME": str(tmp_path), "XDG_RUNTIME_DIR": "/run/user/7"}) == [
        Path("/run/user/7/loomd/loomd.sock")]
    # Codex hides XDG_RUNTIME_DIR from MCP servers: the state dir first, then /run/user/<uid> when it exists.
    found = socket_candidates({"HOME": str(tmp_path)})
    assert found[0] == tmp_path / ".local" / "state" / "loomd" / "loomd.sock"
    assert found[1:] == ([Path(f"/run/user/{os.getuid()}/loomd/loomd.sock")]
                         if Path(f"/run/user/{os.getuid()}").is_dir() else [])
