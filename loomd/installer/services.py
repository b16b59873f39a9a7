"""What keeps loomd running and reachable: systemd user units, the launchd agent, the MCP server's registration.

A plan is data (files to write or remove, commands to run); `apply` carries it out (backing up what it replaces)
and `Plan.script` prints the same plan as a shell script for `--print`. Nothing here starts a daemon itself.
"""

from __future__ import annotations

import math
import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loomd.config import Config
from loomd.installer.steps import InstallError, MakeDirs, Remove, Run, Step, Write

SOCKET_UNIT = "loomd.socket"
SERVICE_UNIT = "loomd.service"
LAUNCHD_LABEL = "io.loomd.daemon"
# Variables that change where loomd keeps its files: baked into the unit so the service and the shims agree.
PATH_VARS = ("LOOMD_HOME", "LOOMD_CONFIG", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")
TEMP_ROOTS = ("/tmp", "/var/tmp")
MISSING = "launchd is macOS only, systemd Linux only; `--print` shows the steps without running them"


# --- systemd -------------------------------------------------------------------------------------------------


def systemd_quote(value: str) -> str:
    """One word for a unit file: `%` and `\\` escaped, quoted when it holds spaces or quotes."""
    escaped = value.replace("\\", "\\\\").replace("%", "%%")
    if any(c.isspace() or c in "\"'" for c in escaped):
        return '"' + escaped.replace('"', '\\"') + '"'
    return escaped


def needs_network(config: Config) -> bool:
    """Whether the daemon must reach an endpoint over IP (model distillers or remote embeddings)."""
    return bool(config.model_url) or config.embedder.strip().lower() == "openai"


def userns_available() -> bool:
    """Can this user create a user + mount namespace? systemd needs one to sandbox a *user* service."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-Urm", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(frozen=True)
class ServiceSpec:
    """Everything the systemd units depend on, as unit-file words (specifiers such as %t/%h allowed)."""

    python: str
    listen: str
    writable: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    network: bool = False
    namespaces: bool = True
    private_tmp: bool = True
    stop_timeout_s: int = 30
    description: str = "loomd: long-term memory for AI coding agents"


def stop_timeout(config: Config) -> int:
    """TimeoutStopSec: the drain, then scheduler, writer and database close, with room to spare."""
    return max(30, math.ceil(config.drain_timeout_s) + 25)


def _under_temp(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in TEMP_ROOTS)


def service_spec(config: Config, python: str | None = None, env: Mapping[str, str] | None = None,
                 *, namespaces: bool | None = None) -> ServiceSpec:
    """The spec for this machine: the interpreter running now, the config's paths, the install environment."""
    env = os.environ if env is None else env
    python = python or sys.executable
    paths = config.paths
    if env.get("LOOMD_HOME"):
        listen = str(paths.socket)
        writable = [str(paths.data_dir)]
    else:
        # %t is the user manager's XDG_RUNTIME_DIR: the same directory the shims and the CLI resolve.
        listen = "%t/loomd/loomd.sock"
        writable = [str(paths.data_dir), str(paths.state_dir), "%t/loomd"]
    passed = tuple((name, env[name]) for name in PATH_VARS if env.get(name))
    # A private /tmp would hide an interpreter, a venv or a data dir that lives in /tmp.
    private_tmp = not any(_under_temp(p) for p in [python, str(paths.data_dir), str(paths.state_dir),
                                                   str(paths.socket)])
    return ServiceSpec(
        python=python, listen=listen, writable=tuple(dict.fromkeys(writable)), env=passed,
        network=needs_network(config), namespaces=userns_available() if namespaces is None else namespaces,
        private_tmp=private_tmp, stop_timeout_s=stop_timeout(config),
    )


def reference_spec() -> ServiceSpec:
    """The spec of the checked-in `systemd/` files: a system python3 and the default paths, as specifiers."""
    return ServiceSpec(python="/usr/bin/python3", listen="%t/loomd/loomd.sock",
                       writable=("%h/.local/share/loomd", "%h/.local/state/loomd", "%t/loomd"))


def _word(value: str) -> str:
    # Values that already carry specifiers (%t, %h) are written as they are; real paths are escaped.
    return value if value.startswith("%") else systemd_quote(value)


def render_socket(spec: ServiceSpec) -> str:
    return f"""\
# loomd socket: exists from login on, so a hook never misses the daemon; the first connection starts it.
# Rendered by `loom install systemd`; re-run that command rather than editing this file.
[Unit]
Description={spec.description} (socket)

[Socket]
ListenStream={_word(spec.listen)}
SocketMode=0600
DirectoryMode=0700
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""


def render_service(spec: ServiceSpec) -> str:
    families = "AF_UNIX AF_INET AF_INET6" if spec.network else "AF_UNIX"
    lines = [
        "# loomd daemon: started by loomd.socket (or at login), stopped gracefully within TimeoutStopSec.",
        "# Rendered by `loom install systemd`; re-run that command rather than editing this file.",
        "[Unit]",
        f"Description={spec.description}",
        f"Requires={SOCKET_UNIT}",
        f"After={SOCKET_UNIT}",
        "",
        "[Service]",
        "Type=notify",
        f"ExecStart={systemd_quote(spec.python)} -m loomd serve",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "RestartSec=2",
        "# Exit 3 is a startup failure with a clear message (missing extension, bad config): retrying won't fix it.",
        "RestartPreventExitStatus=3",
        "# Longer than drain_timeout_s: in-flight requests finish and the event queue commits before SIGKILL.",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        "KillMode=mixed",
        "Environment=PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1",
        *(f"Environment={systemd_quote(f'{k}={v}')}" for k, v in spec.env),
        "UMask=0077",
        "# Hardening: seccomp-based settings work in every user manager.",
        "NoNewPrivileges=yes",
        "# AF_INET/AF_INET6 only when a model or embedding endpoint is configured (re-run install after changing it).",
        f"RestrictAddressFamilies={families}",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "SystemCallArchitectures=native",
        "LockPersonality=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "RestrictNamespaces=yes",
    ]
    if spec.namespaces:
        lines += [
            "# File-system sandbox: a user manager needs a user namespace for it (PrivateUsers maps only this user).",
            "PrivateUsers=yes",
            "ProtectSystem=strict",
            f"ReadWritePaths={' '.join(_word(p) for p in spec.writable)}",
            "PrivateDevices=yes",
            "ProtectKernelTunables=yes",
            "ProtectKernelModules=yes",
            "ProtectKernelLogs=yes",
            "ProtectControlGroups=yes",
            "ProtectClock=yes",
            "ProtectHostname=yes",
        ]
        if spec.private_tmp:
            lines.append("PrivateTmp=yes")
        else:
            lines.append("# PrivateTmp is off: the interpreter or a loomd path lives under /tmp.")
    else:
        lines.append("# No file-system sandbox: this machine cannot create user namespaces for user services.")
    lines += ["", "[Install]", "WantedBy=default.target", f"Also={SOCKET_UNIT}", ""]
    return "\n".join(lines)


def systemd_unit_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "systemd" / "user"


# --- launchd -------------------------------------------------------------------------------------------------


def launchd_log_dir(home: Path) -> Path:
    return home / "Library" / "Logs" / "loomd"


def launchd_plist_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"


def render_plist(config: Config, python: str | None = None, env: Mapping[str, str] | None = None,
                 home: Path | None = None) -> bytes:
    """The LaunchAgent: started at login, restarted when it dies; the daemon binds its own socket (README)."""
    env = os.environ if env is None else env
    home = home or Path(env.get("HOME") or Path.home())
    log = str(launchd_log_dir(home) / "loomd.log")
    variables = {"PYTHONUNBUFFERED": "1"}
    variables.update({name: env[name] for name in PATH_VARS if env.get(name)})
    plist = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [python or sys.executable, "-m", "loomd", "serve"],
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 10,
        # Not "Background": that class is throttled, and the daemon answers hooks on the agent's critical path.
        "ProcessType": "Standard",
        "ExitTimeOut": stop_timeout(config),
        "Umask": 0o077,
        "WorkingDirectory": str(config.paths.data_dir),
        "EnvironmentVariables": variables,
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }
    return plistlib.dumps(plist, sort_keys=False)


# --- plans ---------------------------------------------------------------------------------------------------
# Each step has `script()` (the shell equivalent, for --print) and `run()` (do it, say what happened): the Step
# protocol of install.py, whose TARGETS registry turns these plans into `loom install|uninstall` targets.


@dataclass
class Plan:
    """What an install or uninstall does, in order: before, mkdirs, files, removals, after."""

    target: str
    before: list[Run] = field(default_factory=list)
    mkdirs: list[Path] = field(default_factory=list)
    write: dict[Path, bytes] = field(default_factory=dict)
    remove: list[Path] = field(default_factory=list)
    after: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def steps(self, *, commands: bool = True) -> list[Step]:
        out: list[Step] = list(self.before) if commands else []
        if self.mkdirs:
            out.append(MakeDirs(tuple(self.mkdirs)))
        out += [Write(path, data, backup=True) for path, data in self.write.items()]
        out += [Remove(path) for path in self.remove]
        return out + (list(self.after) if commands else [])

    def script(self) -> str:
        """The same plan as a shell script a user can read and paste."""
        verb = "uninstall" if self.remove and not self.write else "install"
        lines = [f"# loom {verb} {self.target}", *(f"# {note}" for note in self.notes)]
        return "\n".join(lines + [step.script() for step in self.steps()]) + "\n"


def apply(plan: Plan, *, run: bool = True) -> list[str]:
    """Carry out a plan; with run=False only touch files (the commands are returned as what is left to do)."""
    done = [step.run() for step in plan.steps(commands=run)]
    if not run:
        done += [f"not run: {c.script()}" for c in [*plan.before, *plan.after]]
    return done


def systemd_install_plan(config: Config, python: str | None = None, env: Mapping[str, str] | None = None,
                         *, namespaces: bool | None = None) -> Plan:
    env = os.environ if env is None else env
    spec = service_spec(config, python, env, namespaces=namespaces)
    unit_dir = systemd_unit_dir(env)
    paths = config.paths
    # ReadWritePaths must exist before the service starts, so the directories are made here.
    dirs = [paths.data_dir] if env.get("LOOMD_HOME") else [paths.data_dir, paths.state_dir]
    plan = Plan("systemd", mkdirs=[unit_dir, *dirs])
    plan.write[unit_dir / SOCKET_UNIT] = render_socket(spec).encode()
    plan.write[unit_dir / SERVICE_UNIT] = render_service(spec).encode()
    systemctl = ("systemctl", "--user")
    # The service is enabled too: transcript tailing should run from login, not from the first hook.
    plan.after = [Run([*systemctl, "daemon-reload"], missing=MISSING),
                  Run([*systemctl, "enable", "--now", SOCKET_UNIT, SERVICE_UNIT], missing=MISSING)]
    if not spec.namespaces:
        plan.notes.append("user namespaces are unavailable here: the service runs without a file-system sandbox")
    return plan


def systemd_uninstall_plan(env: Mapping[str, str] | None = None) -> Plan:
    unit_dir = systemd_unit_dir(env)
    systemctl = ("systemctl", "--user")
    return Plan("systemd", before=[Run([*systemctl, "disable", "--now", SERVICE_UNIT, SOCKET_UNIT], may_fail=True)],
                remove=[unit_dir / SERVICE_UNIT, unit_dir / SOCKET_UNIT],
                after=[Run([*systemctl, "daemon-reload"], may_fail=True)],
                notes=["the database and spool stay where they are"])


def launchd_install_plan(config: Config, python: str | None = None, env: Mapping[str, str] | None = None) -> Plan:
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    plist = launchd_plist_path(home)
    domain = f"gui/{os.getuid()}"
    plan = Plan("launchd", mkdirs=[plist.parent, launchd_log_dir(home), config.paths.data_dir])
    plan.write[plist] = render_plist(config, python, env, home)
    # bootout first so a changed plist is really reloaded; it fails harmlessly when nothing is loaded.
    plan.before = [Run(["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"], may_fail=True)]
    # enable first: bootstrap refuses a label that was disabled before (launchctl disable persists).
    plan.after = [Run(["launchctl", "enable", f"{domain}/{LAUNCHD_LABEL}"], missing=MISSING),
                  Run(["launchctl", "bootstrap", domain, str(plist)], missing=MISSING)]
    return plan


def launchd_uninstall_plan(env: Mapping[str, str] | None = None) -> Plan:
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    return Plan("launchd",
                before=[Run(["launchctl", "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"], may_fail=True)],
                remove=[launchd_plist_path(home)], notes=["the database, spool and logs stay where they are"])


# --- the checked-in reference files ------------------------------------------------------------------------------


def reference_files() -> dict[str, bytes]:
    """`systemd/` and `launchd/` in the repository: what packagers start from (a test keeps them rendered)."""
    from loomd.config import resolve_paths

    home = Path("/Users/you")
    env = {"HOME": str(home)}
    config = Config(paths=resolve_paths(env))
    spec = reference_spec()
    return {
        f"systemd/{SOCKET_UNIT}": render_socket(spec).encode(),
        f"systemd/{SERVICE_UNIT}": render_service(spec).encode(),
        f"launchd/{LAUNCHD_LABEL}.plist": render_plist(config, "/usr/local/bin/python3", env, home),
    }


def write_reference(root: Path) -> None:
    """Regenerate the checked-in files after changing a renderer."""
    for rel, data in reference_files().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


# --- the MCP server's registration with the clients --------------------------------------------------------------

MCP_NAME = "loom"


def mcp_entry(python: str, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The MCP server's argv and the variables it needs (only where loomd keeps its files, when not default)."""
    return [python, "-m", "loomd.mcp"], {k: env[k] for k in ("LOOMD_HOME", "LOOMD_CONFIG") if env.get(k)}


def _client(name: str, env: Mapping[str, str]) -> str | None:
    return env.get(f"LOOMD_{name.upper()}_BIN") or shutil.which(name, path=env.get("PATH"))


def _claude_json(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home()) / ".claude.json"


def _codex_config(env: Mapping[str, str]) -> Path:
    return Path(env.get("CODEX_HOME") or Path(env.get("HOME") or Path.home()) / ".codex") / "config.toml"


def _toml_str(value: str) -> str:
    import json

    return json.dumps(value)  # a JSON string is a valid TOML basic string


def toml_without_table(text: str, table: str) -> str:
    """`text` minus `[table]` and its `[table.*]` subtables, edited as lines so the rest stays byte for byte."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        head = line.strip()
        if head.startswith("[") and not head.startswith("[["):
            name = head.strip("[]").split("]")[0].strip().replace('"', "")
            skipping = name == table or name.startswith(table + ".")
        if not skipping:
            out.append(line)
    return "".join(out)


def codex_with_mcp(text: str, argv: list[str], variables: dict[str, str]) -> str:
    import tomllib

    table = f"mcp_servers.{MCP_NAME}"
    base = toml_without_table(text, table).rstrip("\n")
    block = [f"[{table}]", f"command = {_toml_str(argv[0])}",
             "args = [" + ", ".join(_toml_str(a) for a in argv[1:]) + "]"]
    if variables:
        block += ["", f"[{table}.env]", *(f"{k} = {_toml_str(v)}" for k, v in variables.items())]
    new = (base + "\n\n" if base else "") + "\n".join(block) + "\n"
    parsed = tomllib.loads(new)["mcp_servers"][MCP_NAME]
    if parsed.get("command") != argv[0] or parsed.get("args") != argv[1:]:
        raise InstallError("could not add [mcp_servers.loom] to config.toml safely; use `codex mcp add`")
    return new


def mcp_install_plan(python: str, env: Mapping[str, str]) -> Plan:
    """Register `python -m loomd.mcp` as the user-scope MCP server "loom" of Claude Code and of Codex: through
    their own CLIs when they are on PATH, else by editing their config files (backed up first)."""
    import json

    argv, variables = mcp_entry(python, env)
    plan = Plan("mcp")
    claude, codex = _client("claude", env), _client("codex", env)
    if claude:
        flags = [f for k, v in variables.items() for f in ("-e", f"{k}={v}")]
        plan.after += [Run([claude, "mcp", "remove", "-s", "user", MCP_NAME], env, may_fail=True),
                       Run([claude, "mcp", "add", "-s", "user", MCP_NAME, *flags, "--", *argv], env)]
    else:
        path = _claude_json(env)
        doc = json.loads(path.read_text() or "{}") if path.exists() else {}
        doc.setdefault("mcpServers", {})[MCP_NAME] = {"type": "stdio", "command": argv[0], "args": argv[1:],
                                                      "env": variables}
        plan.write[path] = (json.dumps(doc, indent=2) + "\n").encode()
        plan.notes.append(f"claude is not on PATH: {path} is edited directly")
    if codex:
        flags = [f for k, v in variables.items() for f in ("--env", f"{k}={v}")]
        plan.after.append(Run([codex, "mcp", "add", MCP_NAME, *flags, "--", *argv], env))
    else:
        path = _codex_config(env)
        plan.write[path] = codex_with_mcp(path.read_text() if path.exists() else "", argv, variables).encode()
        plan.notes.append(f"codex is not on PATH: {path} is edited directly")
    plan.notes.append("the loom plugin (`loom install claude|codex`) already brings this server; use one or the other")
    return plan


def mcp_uninstall_plan(env: Mapping[str, str]) -> Plan:
    import json

    plan = Plan("mcp")
    claude, codex = _client("claude", env), _client("codex", env)
    if claude:
        plan.before.append(Run([claude, "mcp", "remove", "-s", "user", MCP_NAME], env, may_fail=True))
    elif _claude_json(env).exists():
        path = _claude_json(env)
        doc = json.loads(path.read_text() or "{}")
        if MCP_NAME in (doc.get("mcpServers") or {}):
            del doc["mcpServers"][MCP_NAME]
            plan.write[path] = (json.dumps(doc, indent=2) + "\n").encode()
    if codex:
        plan.before.append(Run([codex, "mcp", "remove", MCP_NAME], env, may_fail=True))
    elif _codex_config(env).exists():
        path = _codex_config(env)
        text = path.read_text()
        stripped = toml_without_table(text, f"mcp_servers.{MCP_NAME}")
        if stripped != text:
            plan.write[path] = stripped.encode()
    return plan
