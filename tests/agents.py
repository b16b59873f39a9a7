"""Run the real Claude Code and Codex CLIs offline against the fakes in ``fake_models``.

Everything here follows HOOKS.md section 3: a fresh HOME per run, a minimal environment (like ``env -i``), stdin
from /dev/null, a timeout, and the model pointed at a fake server on 127.0.0.1. Typical use::

    claude = require_binary("claude")
    with AnthropicFake() as fake:
        write_claude_hooks(home, command_hooks(cmd, CLAUDE_EVENTS))
        run = run_claude("hello there", home=home, cwd=proj, base_url=fake.url, binary=claude)

Binaries are found through ``LOOMD_CLAUDE_BIN`` / ``LOOMD_CODEX_BIN``, else ``<prefix>/node_modules/.bin`` with
the prefix from ``LOOMD_AGENTS_PREFIX`` (default ``<repo>/.agents``, filled by
``npm install --prefix .agents ...``), else PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

REPO = Path(__file__).resolve().parent.parent

Client = Literal["claude", "codex"]
BIN_ENV: dict[str, str] = {"claude": "LOOMD_CLAUDE_BIN", "codex": "LOOMD_CODEX_BIN"}
REQUIRE_ALL_ENV = "LOOMD_REQUIRE_ALL"
NPM_PACKAGES: dict[str, str] = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}

# Events that fire in one offline tool-using turn (checked with claude-code 2.1.197 and codex 0.171.0).
CLAUDE_EVENTS = ("SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse", "PostToolBatch", "Stop", "SessionEnd")
CODEX_EVENTS = ("SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse", "Stop", "SessionEnd")

CODEX_MODEL = "gpt-5.1-codex"
CODEX_PROVIDER = "fake"
CODEX_API_KEY_ENV = "FAKE_API_KEY"
DEFAULT_TIMEOUT = 120.0


class AgentRun(NamedTuple):
    """Outcome of one client invocation; unpacks as ``rc, out, err, elapsed``."""

    returncode: int
    stdout: str
    stderr: str
    elapsed: float


class AgentCommandError(RuntimeError):
    """A setup command (plugin install, marketplace add) exited non-zero."""

    def __init__(self, argv: Sequence[str], run: AgentRun) -> None:
        super().__init__(f"{' '.join(argv)} exited {run.returncode}\nstdout: {run.stdout}\nstderr: {run.stderr}")
        self.run = run


# --- locating the binaries ------------------------------------------------------------------------


def agents_prefix() -> Path:
    """The npm prefix the clients are installed under."""
    return Path(os.environ.get("LOOMD_AGENTS_PREFIX") or REPO / ".agents")


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _is_stub(path: Path) -> bool:
    # Without its postinstall (npm --ignore-scripts) claude-code's bin/claude.exe stays a 500-byte shell stub that
    # prints an error; the real binary sits in the platform package next to it.
    return path.stat().st_size < 4096 and path.read_bytes().startswith(b"echo ")


def _prefix_binary(client: Client, prefix: Path) -> Path | None:
    local = prefix / "node_modules" / ".bin" / client
    if not _executable(local):
        return None
    if client == "claude" and _is_stub(local.resolve()):
        natives = sorted((prefix / "node_modules" / "@anthropic-ai").glob("claude-code-*/claude"))
        return next((p for p in natives if _executable(p)), None)
    return local


def find_binary(client: Client) -> Path | None:
    """Locate a client: ``LOOMD_<CLIENT>_BIN``, else ``<prefix>/node_modules/.bin/<client>``, else PATH."""
    override = os.environ.get(BIN_ENV[client])
    if override:
        path = Path(override)
        return path if _executable(path) else None
    local = _prefix_binary(client, agents_prefix())
    if local is not None:
        return local
    found = shutil.which(client)
    return Path(found) if found else None


def missing_reason(client: Client) -> str:
    override = os.environ.get(BIN_ENV[client])
    if override:
        return f"{BIN_ENV[client]}={override} is not an executable file"
    return (
        f"{client} not found in {BIN_ENV[client]}, {agents_prefix()}/node_modules/.bin or PATH "
        f"(npm install --prefix {agents_prefix()} {NPM_PACKAGES[client]})"
    )


def require_binary(client: Client) -> Path:
    """The client's path for a test; skip when it is absent, or fail when ``LOOMD_REQUIRE_ALL=1``."""
    import pytest  # local: the rest of this module is usable without pytest

    path = find_binary(client)
    if path is not None:
        return path
    if os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0"):
        pytest.fail(f"{missing_reason(client)} and {REQUIRE_ALL_ENV}=1")
    pytest.skip(missing_reason(client))


# --- environments ---------------------------------------------------------------------------------


def base_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An ``env -i``-like environment: PATH and HOME only, plus ``extra``."""
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(home)}
    if extra:
        env.update(extra)
    return env


def claude_env(home: Path, base_url: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = base_env(
        home,
        {
            "ANTHROPIC_API_KEY": "sk-ant-dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            # In -p mode Claude waits only about 2 s for MCP servers, then sends the first request without their
            # tools; "0" makes it wait until they have connected.
            "MCP_CONNECTION_NONBLOCKING": "0",
        },
    )
    if base_url:
        env["ANTHROPIC_BASE_URL"] = base_url
    if extra:
        env.update(extra)
    return env


def codex_home(home: Path) -> Path:
    return home / ".codex"


def codex_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = base_env(home, {"CODEX_HOME": str(codex_home(home)), CODEX_API_KEY_ENV: "dummy"})
    if extra:
        env.update(extra)
    return env


# --- running --------------------------------------------------------------------------------------


def run_process(
    argv: Sequence[str | os.PathLike[str]], *, cwd: Path, env: Mapping[str, str], timeout: float = DEFAULT_TIMEOUT
) -> AgentRun:
    """Run with stdin from /dev/null in its own session; on timeout kill the whole group and re-raise."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [os.fspath(a) for a in argv],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # hooks and MCP servers are children: kill them with the client
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(exc.cmd, timeout, output=out, stderr=err) from None
    return AgentRun(proc.returncode, out, err, time.monotonic() - start)


def run_claude(
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    base_url: str,
    allowed_tools: Sequence[str] = ("Bash",),
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    binary: Path | None = None,
) -> AgentRun:
    """``claude -p <prompt> [args] --allowedTools ...`` (as root ``--dangerously-skip-permissions`` is refused)."""
    exe = binary or find_binary("claude")
    if exe is None:
        raise FileNotFoundError(missing_reason("claude"))
    argv: list[str | Path] = [exe, "-p", prompt, *args]
    if allowed_tools:
        # Variadic option: keep it last so it cannot swallow anything after it.
        argv += ["--allowedTools", *allowed_tools]
    return run_process(argv, cwd=cwd, env=claude_env(home, base_url, env), timeout=timeout)


def run_codex(
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    args: Sequence[str] = (),
    bypass_hook_trust: bool = True,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    binary: Path | None = None,
) -> AgentRun:
    """``codex exec --skip-git-repo-check [--dangerously-bypass-hook-trust] [args] <prompt>``.

    Call ``write_codex_config`` first: the fake's URL lives in ``$CODEX_HOME/config.toml``. Without the bypass flag
    (or persisted trust) Codex silently skips every hook, plugin hooks included; ``notify`` still runs.
    """
    exe = binary or find_binary("codex")
    if exe is None:
        raise FileNotFoundError(missing_reason("codex"))
    argv: list[str | Path] = [exe, "exec", "--skip-git-repo-check"]
    if bypass_hook_trust:
        argv.append("--dangerously-bypass-hook-trust")
    argv += [*args, prompt]
    return run_process(argv, cwd=cwd, env=codex_env(home, env), timeout=timeout)


# --- configuration: hooks in settings -------------------------------------------------------------


def command_hooks(
    command: str, events: Iterable[str], *, timeout: int = 10, matcher: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The ``hooks`` object (same shape for Claude settings, Codex hooks.json and a plugin's hooks/hooks.json)."""
    hooks: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        group: dict[str, Any] = {"hooks": [{"type": "command", "command": command, "timeout": timeout}]}
        if matcher is not None:
            group["matcher"] = matcher
        hooks[event] = [group]
    return hooks


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def write_claude_hooks(home: Path, hooks: Mapping[str, Any]) -> Path:
    """Set the ``hooks`` key of ``~/.claude/settings.json``, keeping its other keys (plugins, marketplaces)."""
    path = home / ".claude" / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = _read_json(path)
    settings["hooks"] = dict(hooks)
    path.write_text(json.dumps(settings, indent=2))
    return path


def write_codex_hooks(home: Path, hooks: Mapping[str, Any]) -> Path:
    """Write ``$CODEX_HOME/hooks.json`` (runs only with ``--dangerously-bypass-hook-trust`` or persisted trust)."""
    path = codex_home(home) / "hooks.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"hooks": dict(hooks)}, indent=2))
    return path


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dump_toml(data: Mapping[str, Any], _prefix: tuple[str, ...] = ()) -> str:
    """Minimal TOML writer for config files (scalars, arrays, tables; arrays of tables become inline tables)."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    for key, value in data.items():
        if isinstance(value, Mapping):
            path = (*_prefix, key)
            body = dump_toml(value, path).strip("\n")
            lines.append("")
            if not value or any(not isinstance(v, Mapping) for v in value.values()):  # else only subtables follow
                lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
            lines.append(body)
    return "\n".join(lines).strip("\n") + "\n"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
    return base


def write_codex_config(
    home: Path, base_url: str, *, model: str = CODEX_MODEL, extra: Mapping[str, Any] | None = None
) -> Path:
    """Point Codex at the fake Responses server in ``$CODEX_HOME/config.toml``.

    Merges into what is there (``codex plugin ...`` adds ``marketplaces`` / ``plugins`` tables), so it may be called
    before or after installing plugins, and again. ``extra`` is deep-merged last, e.g. ``{"notify": [...]}`` or
    ``codex_mcp_config(...)``.
    """
    path = codex_home(home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
    ours: dict[str, Any] = {
        "model": model,
        "model_provider": CODEX_PROVIDER,
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",
        "model_providers": {
            CODEX_PROVIDER: {
                "name": CODEX_PROVIDER,
                "base_url": base_url.rstrip("/") + "/v1",
                "wire_api": "responses",
                "env_key": CODEX_API_KEY_ENV,
            }
        },
    }
    _merge(_merge(config, ours), extra or {})
    path.write_text(dump_toml(config))
    return path


def mcp_stdio_server(command: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One stdio MCP server entry, as ``.mcp.json`` / ``--mcp-config`` spell it."""
    return {"type": "stdio", "command": command, "args": list(args), "env": dict(env or {})}


def write_claude_mcp_config(path: Path, servers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Write an MCP config file; returns the ``claude`` arguments that load only it.

    Claude names the tools ``mcp__<server>__<tool>``; allow them with ``--allowedTools mcp__<server>`` (or the full
    name, or ``mcp__<server>__*``). Unallowed, the call is refused and the model gets an ``is_error`` tool_result.
    """
    path.write_text(json.dumps({"mcpServers": {k: dict(v) for k, v in servers.items()}}, indent=2))
    return ["--mcp-config", str(path), "--strict-mcp-config"]


def codex_mcp_config(servers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"mcp_servers": ...}`` for ``write_codex_config(extra=...)`` from ``mcp_stdio_server`` entries.

    Codex offers the tools as a namespace ``mcp__<server>`` holding ``<tool>``. In ``codex exec`` the first request
    goes out without a server that has not finished its handshake within about a second, so keep test servers
    light (stdlib, no heavy imports).
    """
    tables: dict[str, Any] = {}
    for name, spec in servers.items():
        table: dict[str, Any] = {"command": str(spec["command"]), "args": [str(a) for a in spec.get("args", ())]}
        if spec.get("env"):
            table["env"] = {str(k): str(v) for k, v in spec["env"].items()}
        tables[name] = table
    return {"mcp_servers": tables}


# --- configuration: plugins -----------------------------------------------------------------------


def make_plugin_marketplace(
    root: Path,
    *,
    hooks: Mapping[str, Any] | None = None,
    plugin: str = "loomtest",
    marketplace: str = "loomtest-mkt",
    version: str = "0.0.1",
    files: Mapping[str, str] | None = None,
    mcp_servers: Mapping[str, Any] | None = None,
) -> Path:
    """Build a directory marketplace holding one plugin; returns the plugin directory.

    Layout: ``root/.claude-plugin/marketplace.json`` and ``root/plugins/<plugin>/`` with
    ``.claude-plugin/plugin.json``, ``hooks/hooks.json`` (commands may use ``${CLAUDE_PLUGIN_ROOT}``), an optional
    ``.mcp.json`` and ``files`` (relative path -> text; files starting with ``#!`` are made executable). Both
    clients read this same layout.
    """
    plugin_dir = root / "plugins" / plugin
    (root / ".claude-plugin").mkdir(parents=True, exist_ok=True)
    (plugin_dir / ".claude-plugin").mkdir(parents=True, exist_ok=True)
    author = {"name": "loomd tests"}
    (root / ".claude-plugin" / "marketplace.json").write_text(
        json.dumps(
            {
                "name": marketplace,
                "owner": author,
                "plugins": [{"name": plugin, "source": f"./plugins/{plugin}", "description": "loomd test plugin"}],
            },
            indent=2,
        )
    )
    (plugin_dir / ".claude-plugin" / "plugin.json").write_text(
        json.dumps({"name": plugin, "version": version, "description": "loomd test plugin", "author": author})
    )
    if hooks is not None:
        (plugin_dir / "hooks").mkdir(exist_ok=True)
        (plugin_dir / "hooks" / "hooks.json").write_text(
            json.dumps({"description": "loomd test hooks", "hooks": dict(hooks)}, indent=2)
        )
    if mcp_servers is not None:
        (plugin_dir / ".mcp.json").write_text(json.dumps({"mcpServers": dict(mcp_servers)}, indent=2))
    for rel, text in (files or {}).items():
        target = plugin_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        if text.startswith("#!"):
            target.chmod(0o755)
    return plugin_dir


def _checked(argv: Sequence[str | os.PathLike[str]], *, cwd: Path, env: Mapping[str, str], timeout: float) -> AgentRun:
    run = run_process(argv, cwd=cwd, env=env, timeout=timeout)
    if run.returncode != 0:
        raise AgentCommandError([os.fspath(a) for a in argv], run)
    return run


def install_claude_plugin(
    home: Path,
    marketplace_dir: Path,
    plugin: str,
    marketplace: str,
    *,
    cwd: Path | None = None,
    timeout: float = 60.0,
    binary: Path | None = None,
) -> list[AgentRun]:
    """As a user would: ``claude plugin marketplace add <dir>`` then ``claude plugin install <plugin>@<mkt>``.

    Writes ``extraKnownMarketplaces`` and ``enabledPlugins`` into ``~/.claude/settings.json``; with a directory
    marketplace ``CLAUDE_PLUGIN_ROOT`` is the source directory itself (no copy).
    """
    exe = binary or find_binary("claude")
    if exe is None:
        raise FileNotFoundError(missing_reason("claude"))
    env = claude_env(home)
    where = cwd or home
    return [
        _checked([exe, "plugin", "marketplace", "add", marketplace_dir], cwd=where, env=env, timeout=timeout),
        _checked([exe, "plugin", "install", f"{plugin}@{marketplace}"], cwd=where, env=env, timeout=timeout),
    ]


def install_codex_plugin(
    home: Path,
    marketplace_dir: Path,
    plugin: str,
    marketplace: str,
    *,
    cwd: Path | None = None,
    timeout: float = 60.0,
    binary: Path | None = None,
) -> list[AgentRun]:
    """As a user would: ``codex plugin marketplace add <dir>`` then ``codex plugin add <plugin>@<mkt>``.

    Writes ``[marketplaces.<mkt>]`` and ``[plugins."<plugin>@<mkt>"]`` into config.toml and copies the plugin to
    ``$CODEX_HOME/plugins/cache/<mkt>/<plugin>/<version>`` (that copy is ``CLAUDE_PLUGIN_ROOT``; re-run after edits).
    """
    exe = binary or find_binary("codex")
    if exe is None:
        raise FileNotFoundError(missing_reason("codex"))
    env = codex_env(home)
    where = cwd or home
    codex_home(home).mkdir(parents=True, exist_ok=True)
    return [
        _checked([exe, "plugin", "marketplace", "add", marketplace_dir], cwd=where, env=env, timeout=timeout),
        _checked([exe, "plugin", "add", f"{plugin}@{marketplace}"], cwd=where, env=env, timeout=timeout),
    ]


def client_version(client: Client, binary: Path | None = None) -> str:
    """``claude --version`` / ``codex --version`` (for report headers)."""
    exe = binary or find_binary(client)
    if exe is None:
        return "absent"
    with tempfile.TemporaryDirectory(prefix="loomd-version-") as tmp:
        run = run_process([exe, "--version"], cwd=Path(tmp), env=base_env(Path(tmp)), timeout=30)
    lines = run.stdout.strip().splitlines()
    return lines[0] if lines else "unknown"
