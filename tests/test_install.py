"""`loom install|uninstall claude|codex` on a temporary HOME, without the client CLIs (settings mode and the
fallback to it); registration through the real clients is proven in test_e2e_agents.py. Also: the checked-in
plugin is what loomd/installer/plugin.py generates, and the commands it writes really run the shim."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import msgpack
import pytest
from conftest import REPO

from loomd.errors import LoomdError
from loomd.installer.agents import TOML_MARK, plan, toml_with_codex_keys
from loomd.installer.plugin import EVENTS, PINNED_PYTHON, SHIM_MARK, static_files
from loomd.installer.steps import Remove

THEIRS = {"Stop": [{"hooks": [{"type": "command", "command": "notify-send done"}]}],
          "PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "audit.sh", "timeout": 3}]}]}


@pytest.fixture
def env(tmp_path: Path, home: Path) -> dict[str, str]:
    """A user's environment: a fresh HOME, loomd under `home`, and a PATH with neither client on it."""
    (tmp_path / "user").mkdir()
    (tmp_path / "bin").mkdir()
    return {"HOME": str(tmp_path / "user"), "LOOMD_HOME": str(home), "PATH": str(tmp_path / "bin")}


def install(env: dict[str, str], target: str, **options: object) -> list[str]:
    return plan(target, env=env, **options).apply()  # type: ignore[arg-type]


def uninstall(env: dict[str, str], target: str) -> list[str]:
    return plan(target, uninstall=True, env=env).apply()


def settings(env: dict[str, str]) -> Path:
    return Path(env["HOME"]) / ".claude" / "settings.json"


def codex_home(env: dict[str, str]) -> Path:
    return Path(env["HOME"]) / ".codex"


def ours(hooks: dict) -> list[str]:
    return [h["command"] for groups in hooks.values() for g in groups for h in g["hooks"] if SHIM_MARK in h["command"]]


def backups(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.loomd-bak-*"))


# --- the checked-in plugin ----------------------------------------------------------------------------------------


def test_checked_in_plugin_is_what_plugin_py_generates() -> None:
    fix = "python -c 'import loomd.installer.plugin as p; p.write_static()'"
    for rel, data in static_files().items():
        assert (REPO / rel).read_bytes() == data, f"{rel} is stale: run {fix}"
    marketplace = json.loads((REPO / ".claude-plugin" / "marketplace.json").read_text())
    assert marketplace["plugins"] == [{**marketplace["plugins"][0], "name": "loom", "source": "./plugin"}]
    for agent, path in (("claude", "plugin/hooks/hooks.json"), ("codex", "plugin/hooks/codex.json")):
        hooks = json.loads((REPO / path).read_text())["hooks"]
        assert list(hooks) == list(EVENTS[agent])
        assert all(f"--agent {agent} " in command for command in ours(hooks))
    assert json.loads((REPO / "plugin/.codex-plugin/plugin.json").read_text())["hooks"] == "./hooks/codex.json"
    assert json.loads((REPO / "plugin/hooks/codex.json").read_text())["hooks"]["SessionEnd"][0]["hooks"][0][
        "timeout"] == 3  # Codex clamps it to 3 s anyway; more would only print a warning


def run_hook(command: str, event: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    payload = json.dumps({"session_id": "s-1", "cwd": "/x", "hook_event_name": event}).encode()
    return subprocess.run(["/bin/sh", "-c", command], input=payload, capture_output=True, env=env, timeout=30)


def spooled(home: Path) -> list[dict]:
    return [msgpack.unpackb(p.read_bytes(), raw=False) for p in sorted((home / "spool").glob("*.msgpack"))]


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-interpreter", "python3-on-path"])
def test_checked_in_hook_command_runs_the_shim(home: Path, tmp_path: Path, pinned: bool) -> None:
    """What Claude runs for the plain plugin install: `/bin/sh -c <command>` with CLAUDE_PLUGIN_ROOT set."""
    hooks = json.loads((REPO / "plugin/hooks/hooks.json").read_text())["hooks"]
    command = hooks["Stop"][0]["hooks"][0]["command"]
    if pinned:
        (home / PINNED_PYTHON).write_text(sys.executable + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # without a pin the command takes `python3` from PATH; make that this interpreter, and record that it ran
    (bin_dir / "python3").write_text(f'#!/bin/sh\ntouch {shlex.quote(str(tmp_path / "via-path"))}\n'
                                     f'exec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LOOMD_HOME": str(home),
           "CLAUDE_PLUGIN_ROOT": str(REPO / "plugin")}
    proc = run_hook(command, "Stop", env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
    [args] = spooled(home)
    assert (args["agent"], args["event"]) == ("claude", "Stop")
    assert (tmp_path / "via-path").exists() is not pinned


# --- Claude, settings mode ----------------------------------------------------------------------------------------


def test_print_shows_the_steps_and_changes_nothing(env: dict[str, str], home: Path) -> None:
    before = sorted(p.name for p in home.iterdir())
    script = plan("claude", env=env, settings_only=True).script()
    assert shlex.quote(sys.executable) + " -S -E " in script
    assert f"LOOMD_HOME={home}" in script  # the install's LOOMD_HOME is baked into every hook
    assert not Path(env["HOME"]).joinpath(".claude").exists()
    assert sorted(p.name for p in home.iterdir()) == before


def test_cli_print(env: dict[str, str]) -> None:
    loom = Path(sys.executable).with_name("loom")
    argv = [str(loom)] if loom.exists() else [sys.executable, "-c", "from loomd.cli import main; main()"]
    done = subprocess.run([*argv, "install", "codex", "--print"], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# loom install codex (settings mode" in done.stdout and "notify" in done.stdout
    assert not codex_home(env).exists()


def test_claude_settings_install_is_idempotent_and_keeps_other_hooks(env: dict[str, str], home: Path) -> None:
    path = settings(env)
    path.parent.mkdir(parents=True)
    original = json.dumps({"hooks": THEIRS, "env": {"FOO": "1"}}).encode()  # compact: not how loomd writes JSON
    path.write_bytes(original)
    done = install(env, "claude")
    assert any("not on PATH" in line for line in done)  # no client CLI: settings mode, said out loud
    first = path.read_bytes()
    install(env, "claude")
    assert path.read_bytes() == first
    doc = json.loads(first)
    assert doc["env"] == {"FOO": "1"}
    assert doc["hooks"]["PreToolUse"] == THEIRS["PreToolUse"]
    assert doc["hooks"]["Stop"][0] == THEIRS["Stop"][0]
    commands = ours(doc["hooks"])
    assert len(commands) == len(EVENTS["claude"])  # once each, however often installed
    assert all(c.startswith(f"LOOMD_HOME={home} {shlex.quote(sys.executable)} -S -E ") for c in commands)
    assert [b.read_bytes() for b in backups(path)] == [original]
    uninstall(env, "claude")
    assert path.read_bytes() == original  # byte for byte
    assert not (home / "plugin").exists() and not (home / "installs.json").exists()


def test_installed_command_runs_the_rendered_shim(env: dict[str, str], home: Path) -> None:
    install(env, "claude", settings_only=True)
    command = json.loads(settings(env).read_text())["hooks"]["SessionStart"][0]["hooks"][0]["command"]
    proc = run_hook(command, "SessionStart", {"PATH": "/usr/bin:/bin", "HOME": env["HOME"]})  # no LOOMD_HOME here
    assert (proc.returncode, proc.stdout) == (0, b"")
    [args] = spooled(home)  # the daemon is down: the event waits in the install's LOOMD_HOME
    assert (args["agent"], args["event"], args["context"]) == ("claude", "SessionStart", True)


def test_claude_uninstall_after_user_edits_removes_only_loomd(env: dict[str, str]) -> None:
    path = settings(env)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"hooks": THEIRS}))
    install(env, "claude")
    doc = json.loads(path.read_text())
    doc["permissions"] = {"allow": ["Bash(ls)"]}
    doc["hooks"]["Stop"][-1]["hooks"].append({"type": "command", "command": "mine-too"})  # into loomd's group
    path.write_text(json.dumps(doc))
    uninstall(env, "claude")
    after = json.loads(path.read_text())
    assert after["permissions"] == {"allow": ["Bash(ls)"]}
    assert after["hooks"]["PreToolUse"] == THEIRS["PreToolUse"]
    assert after["hooks"]["Stop"] == [THEIRS["Stop"][0], {"hooks": [{"type": "command", "command": "mine-too"}]}]
    assert ours(after["hooks"]) == [] and set(after["hooks"]) == {"Stop", "PreToolUse"}


def test_settings_file_created_by_install_is_removed_by_uninstall(env: dict[str, str]) -> None:
    install(env, "claude")
    assert settings(env).exists()
    uninstall(env, "claude")
    assert not settings(env).exists()


def test_broken_settings_file_is_refused_untouched(env: dict[str, str], home: Path) -> None:
    path = settings(env)
    path.parent.mkdir(parents=True)
    path.write_text('{"hooks": ')
    with pytest.raises(LoomdError, match="not valid JSON"):
        install(env, "claude")
    assert path.read_text() == '{"hooks": '
    assert backups(path) == [] and not (home / "installs.json").exists()


def test_uninstall_without_a_record_still_removes_loomds_hooks(env: dict[str, str], home: Path) -> None:
    install(env, "claude")
    (home / "installs.json").unlink()
    uninstall(env, "claude")
    assert not settings(env).exists() or ours(json.loads(settings(env).read_text()).get("hooks", {})) == []


@pytest.mark.parametrize("python", ["python3", "/no/such/python"])
def test_interpreter_must_be_an_absolute_executable(env: dict[str, str], python: str) -> None:
    with pytest.raises(LoomdError, match="absolute path"):
        plan("claude", env=env, python=python)


def test_version_manager_shim_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    shim = tmp_path / "bin" / "python"
    shim.write_text('#!/usr/bin/env bash\nexec pyenv exec python "$@"\n')
    shim.chmod(0o755)
    with pytest.raises(LoomdError, match="version-manager"):
        plan("claude", env=env, python=str(shim))


# --- Codex, settings mode -----------------------------------------------------------------------------------------


CONFIGS = {
    "absent": None,
    "plain": '# my settings\nmodel = "gpt-5"\n\n[mcp_servers.x]\ncommand = "x"  # keep this comment\n',
    "features": '[features]\nweb_search = true\n\n[profiles.fast]\nmodel = "o4-mini"\n',
    "no-final-newline": 'model = "gpt-5"',
}


@pytest.mark.parametrize("name", CONFIGS)
def test_codex_settings_install_and_exact_uninstall(env: dict[str, str], home: Path, name: str) -> None:
    config = codex_home(env) / "config.toml"
    hooks_json = codex_home(env) / "hooks.json"
    codex_home(env).mkdir()
    theirs = json.dumps({"hooks": THEIRS}, indent=4).encode()
    hooks_json.write_bytes(theirs)
    if CONFIGS[name] is not None:
        config.write_text(CONFIGS[name])
    install(env, "codex")
    install(env, "codex")  # idempotent: nothing doubled
    data = tomllib.loads(config.read_text())
    shim = str(home / "plugin" / "loom" / "shims" / "loom-hook")
    assert data["notify"] == ["/usr/bin/env", f"LOOMD_HOME={home}", sys.executable, "-S", "-E", shim, "notify"]
    assert data["features"]["hooks"] is True
    before = tomllib.loads(CONFIGS[name] or "")
    assert {k: v for k, v in data.items() if k not in ("notify", "features")} == \
        {k: v for k, v in before.items() if k != "features"}
    assert config.read_text().count("notify =") == 1
    hooks = json.loads(hooks_json.read_text())["hooks"]
    assert len(ours(hooks)) == len(EVENTS["codex"]) and hooks["PreToolUse"] == THEIRS["PreToolUse"]
    assert all("--agent codex" in c for c in ours(hooks))
    uninstall(env, "codex")
    assert hooks_json.read_bytes() == theirs
    if CONFIGS[name] is None:
        assert not config.exists()
    else:
        assert config.read_text() == CONFIGS[name]


def test_codex_notify_of_the_user_is_left_alone(env: dict[str, str]) -> None:
    config = codex_home(env) / "config.toml"
    codex_home(env).mkdir()
    config.write_text('notify = ["my-notifier"]\n[features]\nhooks = false\n')
    done = install(env, "codex")
    assert tomllib.loads(config.read_text())["notify"] == ["my-notifier"]
    assert any("notify` is already set" in line for line in done)
    assert any("hooks = false" in line for line in done)
    uninstall(env, "codex")
    assert config.read_text() == 'notify = ["my-notifier"]\n[features]\nhooks = false\n'


def test_codex_config_edits_survive_a_user_edit_in_between(env: dict[str, str]) -> None:
    config = codex_home(env) / "config.toml"
    codex_home(env).mkdir()
    config.write_text('model = "gpt-5"\n')
    install(env, "codex")
    config.write_text(config.read_text() + '\n[mcp_servers.y]\ncommand = "y"\n')
    uninstall(env, "codex")
    assert TOML_MARK not in config.read_text()
    assert tomllib.loads(config.read_text()) == {"model": "gpt-5", "mcp_servers": {"y": {"command": "y"}}}


def test_codex_broken_config_is_refused(env: dict[str, str]) -> None:
    config = codex_home(env) / "config.toml"
    codex_home(env).mkdir()
    config.write_text("model = \n")
    with pytest.raises(LoomdError, match="not valid TOML"):
        install(env, "codex")
    assert config.read_text() == "model = \n"


def test_toml_edit_never_changes_meaning() -> None:
    # a [features] table made of dotted keys cannot take a line under a header: said, not guessed
    text, notes = toml_with_codex_keys('features.web_search = true\n', ["py", "notify"])
    assert tomllib.loads(text) == {"notify": ["py", "notify"], "features": {"web_search": True}}
    assert any("add it yourself" in n for n in notes)


def test_both_agents_share_one_rendered_plugin(env: dict[str, str], home: Path) -> None:
    install(env, "claude")
    install(env, "codex")
    uninstall(env, "claude")
    assert (home / "plugin" / "loom" / "shims" / "loom_hook.py").exists()  # codex still runs it
    assert set(json.loads((home / "installs.json").read_text())) == {"codex"}
    uninstall(env, "codex")
    assert not (home / "plugin").exists() and not (home / "installs.json").exists()


def test_removing_what_is_not_there_says_so_plainly(tmp_path: Path) -> None:
    assert Remove(tmp_path / "never-made").run() == f"nothing to remove at {tmp_path / 'never-made'}"
    (tmp_path / "made").write_text("x")
    assert Remove(tmp_path / "made").run() == f"removed {tmp_path / 'made'}"
