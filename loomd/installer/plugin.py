"""The loom plugin's files (one plugin for Claude Code and Codex): manifests, hooks, MCP entry, marketplace.

Two renderings of the same files: the checked-in one under `plugin/` (any install; it cannot know the interpreter,
so the shell finds one), and the one `loom install` writes under `<data_dir>/plugin` with the absolute interpreter
(and `LOOMD_HOME`, when set) baked in. `write_static()` regenerates the checked-in files; a test keeps them equal.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loomd import __version__

PLUGIN, MARKETPLACE = "loom", "loomd"
PLUGIN_ID = f"{PLUGIN}@{MARKETPLACE}"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # a source checkout: plugin/ and .claude-plugin/ live here
SHIM_FILES = {"loom-hook": 0o755, "loom_hook.py": 0o644}
SHIM_MARK = "/shims/loom-hook"  # every hook command loomd writes runs this file: how uninstall knows its own
PINNED_PYTHON = "hook-python"
DESCRIPTION = "loomd: long-term memory for coding agents (hooks to the local daemon, MCP tools)"

# Synchronous hooks, short timeouts: the shim bounds itself (150 ms for context, 1 s for an ack, then it spools);
# the timeout only guards against a wedged interpreter. SessionEnd gets longer than Claude's 1.5 s default budget
# so the final flush is not cut; Codex clamps hook timeouts to 3 s there, so it gets 3. No PreToolUse: PostToolUse
# and PostToolUseFailure carry the tool input too, and a hook before every tool call would only cost time.
# PostCompact carries the compaction summary (`compact_summary`, checked with Claude Code 2.1.197).
EVENTS: dict[str, dict[str, int]] = {
    "claude": {"SessionStart": 5, "UserPromptSubmit": 5, "PostToolUse": 5, "PostToolUseFailure": 5, "PreCompact": 5,
               "PostCompact": 5, "Stop": 5, "SubagentStop": 5, "Notification": 5, "SessionEnd": 10},
    "codex": {"SessionStart": 5, "UserPromptSubmit": 5, "PostToolUse": 5, "PreCompact": 5, "PostCompact": 5,
              "Stop": 5, "SubagentStop": 5, "SessionEnd": 3},
}  # fmt: skip
# Codex reads .codex-plugin/ first: its manifest names its own hooks file, so each client's commands say --agent.
HOOK_FILES = {"claude": "hooks/hooks.json", "codex": "hooks/codex.json"}
PLUGIN_SHIM = '"${CLAUDE_PLUGIN_ROOT}/shims/loom-hook"'
# The checked-in plugin cannot know the interpreter: the shell the client runs the command with (sh for Claude,
# bash for Codex) reads a pinned one with builtins only (no extra process), else takes `python3` from PATH.
PREAMBLE = ('P=; { read -r P < "${LOOMD_HOME:-${XDG_CONFIG_HOME:-$HOME/.config}/loomd}/' + PINNED_PYTHON + '"; } '
            '2>/dev/null; [ -x "$P" ] || P=python3; exec "$P"')


def baked_env(env: Mapping[str, str]) -> dict[str, str]:
    """What an installed hook or MCP server must see to find this daemon: LOOMD_HOME when the install had one."""
    return {"LOOMD_HOME": env["LOOMD_HOME"]} if env.get("LOOMD_HOME") else {}


def hook_command(agent: str, event: str, python: str | None, shim: str = PLUGIN_SHIM,
                 env: Mapping[str, str] | None = None) -> str:
    """The command line of one hook; `python` None is the checked-in form that finds an interpreter itself."""
    assign = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())  # sh: no extra process
    interpreter = shlex.quote(python) if python else PREAMBLE
    return f"{assign}{interpreter} -S -E {shim} --agent {agent} {event}"


def hooks_object(agent: str, python: str | None, shim: str = PLUGIN_SHIM,
                 env: Mapping[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The `hooks` object (the same shape in a plugin's hooks file, Claude's settings and Codex's hooks.json)."""
    return {event: [{"hooks": [{"type": "command", "command": hook_command(agent, event, python, shim, env),
                                "timeout": timeout}]}]
            for event, timeout in EVENTS[agent].items()}  # fmt: skip


def mcp_server(python: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The MCP server entry: `loom mcp` from PATH when checked in, this installation's interpreter otherwise."""
    if python is None:
        return {"type": "stdio", "command": "loom", "args": ["mcp"]}
    entry: dict[str, Any] = {"type": "stdio", "command": python, "args": ["-m", "loomd.mcp"]}
    if env:
        entry["env"] = dict(env)
    return entry


def to_json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()


def plugin_files(python: str | None, env: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Every generated file of the plugin, by path relative to the plugin root (the shims are copied, not made)."""
    manifest = {"name": PLUGIN, "version": __version__, "description": DESCRIPTION, "author": {"name": "loomd"}}
    files = {
        ".claude-plugin/plugin.json": to_json(manifest),
        ".codex-plugin/plugin.json": to_json({**manifest, "hooks": "./" + HOOK_FILES["codex"]}),
        ".mcp.json": to_json({"mcpServers": {PLUGIN: mcp_server(python, env)}}),
    }
    for agent, name in HOOK_FILES.items():
        hooks = hooks_object(agent, python, env=env)
        files[name] = to_json({"description": f"loomd hooks for {agent}", "hooks": hooks})
    return files


def marketplace_file(source: str) -> bytes:
    return to_json({"name": MARKETPLACE, "owner": {"name": "loomd"}, "description": DESCRIPTION,
                    "plugins": [{"name": PLUGIN, "source": source, "description": DESCRIPTION,
                                 "version": __version__}]})  # fmt: skip


def static_files() -> dict[str, bytes]:
    """The checked-in plugin, relative to the repository root."""
    files = {f"plugin/{rel}": data for rel, data in plugin_files(None).items()}
    files[".claude-plugin/marketplace.json"] = marketplace_file("./plugin")
    return files


def write_static(root: Path = SOURCE_ROOT) -> None:
    """Regenerate the checked-in plugin files after changing this module."""
    for rel, data in static_files().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
