"""`loom install` / `loom uninstall`: register loomd with the agents (and, through TARGETS, everything else).

A target turns a Request into Actions: printable as a shell script (`--print`) or carried out in order, backing up
every user file before it changes. For the agents:
- plugin mode (default): render the plugin into `<data_dir>/plugin` (a one-plugin marketplace) with the absolute
  interpreter in its hook commands and MCP entry, then register it with the client's own CLI (`plugin marketplace
  add` + `plugin install`/`add`). Without the client CLI, fall back to settings mode and say so.
- settings mode (`--settings-only`): merge the hook entries into `~/.claude/settings.json` or
  `$CODEX_HOME/hooks.json`; the other hooks there stay as they are.
Codex also gets `notify` (when unset) and `[features] hooks = true` in config.toml, each line marked. An install
record (`<data_dir>/installs.json`) keeps what was there before, so uninstall puts it back: byte for byte when
the file was not touched since, else by removing exactly what loomd added.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomd.config import Config, load_config
from loomd.installer import services
from loomd.installer.plugin import (
    MARKETPLACE,
    PLUGIN,
    PLUGIN_ID,
    SHIM_FILES,
    SHIM_MARK,
    SOURCE_ROOT,
    baked_env,
    hooks_object,
    marketplace_file,
    plugin_files,
    to_json,
)
from loomd.installer.steps import Actions, Backup, Copy, Edit, InstallError, Remove, Run, Step, Write, backup_path

TOML_MARK = "# added by loom install"


# --- requests, records -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One `loom install|uninstall TARGET` invocation: the options, the config and the environment it ran in."""

    target: str
    config: Config
    env: Mapping[str, str]
    python: str
    settings_only: bool = False

    @property
    def home(self) -> Path:
        return Path(self.env.get("HOME") or Path.home())

    @property
    def data_dir(self) -> Path:
        return self.config.paths.data_dir

    @property
    def plugin_root(self) -> Path:
        return self.data_dir / "plugin"

    @property
    def record_path(self) -> Path:
        return self.data_dir / "installs.json"

    def client(self, agent: str) -> str | None:
        override = self.env.get(f"LOOMD_{agent.upper()}_BIN")
        return override or shutil.which(agent, path=self.env.get("PATH"))

    @property
    def baked(self) -> dict[str, str]:
        return baked_env(self.env)

    def hooks(self, agent: str) -> dict[str, Any]:
        """Settings-mode hook entries: this interpreter, the rendered shim by absolute path."""
        shim = shlex.quote(str(self.plugin_root / PLUGIN / "shims" / "loom-hook"))
        return hooks_object(agent, self.python, shim, self.baked)


def check_python(python: str) -> str:
    """The interpreter hooks will run: absolute, executable, and a binary (a pyenv/asdf shim costs ~140 ms)."""
    path = Path(python)
    if not path.is_absolute() or not os.access(path, os.X_OK) or not path.is_file():
        raise InstallError(f"{python} is not an absolute path to an executable interpreter")
    with open(path, "rb") as f:
        if f.read(2) == b"#!":
            raise InstallError(f"{python} is a script (a version-manager shim?), which would add ~100 ms to every "
                               "hook; pass the real interpreter with --python, e.g. `pyenv which python`")
    return python


def read_records(req: Request) -> dict[str, Any]:
    try:
        data = json.loads(req.record_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_step(req: Request, entry: dict[str, Any] | None) -> Step:
    records = read_records(req)
    if entry is None:
        records.pop(req.target, None)
    else:
        records[req.target] = entry
    if not records:
        return Remove(req.record_path)
    return Write(req.record_path, to_json(records), 0o600)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def render_steps(req: Request) -> list[Step]:
    """The plugin with this interpreter, as a one-plugin marketplace under <data_dir>/plugin."""
    source = SOURCE_ROOT / "plugin" / "shims"
    missing = [name for name in SHIM_FILES if not (source / name).is_file()]
    if missing:
        raise InstallError(f"the hook shim is not at {source} (loom install needs the plugin/ folder of a source "
                           "checkout next to the loomd package: pip install -e <checkout>)")
    root = req.plugin_root
    steps: list[Step] = [Remove(root)]  # a re-install starts clean: no file of an older version lingers
    steps.append(Write(root / ".claude-plugin" / "marketplace.json", marketplace_file(f"./{PLUGIN}")))
    for rel, data in plugin_files(req.python, req.baked).items():
        steps.append(Write(root / PLUGIN / rel, data))
    steps += [Copy(source / name, root / PLUGIN / "shims" / name, mode) for name, mode in SHIM_FILES.items()]
    return steps


# --- JSON hook settings (Claude settings.json, Codex hooks.json) ------------------------------------------------


def _is_ours(handler: Any) -> bool:
    return isinstance(handler, dict) and SHIM_MARK in str(handler.get("command", ""))


def strip_hooks(hooks: Any) -> Any:
    """`hooks` without loomd's handlers; groups and events left empty by that are dropped, the rest kept as is."""
    if not isinstance(hooks, dict):
        return hooks
    out: dict[str, Any] = {}
    for event, groups in hooks.items():
        if not isinstance(groups, list):
            out[event] = groups
            continue
        kept = []
        for group in groups:
            handlers = group.get("hooks") if isinstance(group, dict) else None
            if isinstance(handlers, list) and any(_is_ours(h) for h in handlers):
                rest = [h for h in handlers if not _is_ours(h)]
                if rest:
                    kept.append({**group, "hooks": rest})
            else:
                kept.append(group)
        if kept or not groups:
            out[event] = kept
    return out


def _load_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text() or "{}")
    except ValueError as exc:
        raise InstallError(f"{path} is not valid JSON ({exc}); fix it first, loomd will not overwrite it") from exc
    if not isinstance(data, dict):
        raise InstallError(f"{path} does not hold a JSON object; fix it first")
    return data


def with_hooks(path: Path, ours: dict[str, Any]) -> bytes:
    doc = _load_json(path)
    hooks = strip_hooks(doc.get("hooks", {}))
    if not isinstance(hooks, dict):
        raise InstallError(f'{path}: "hooks" is not an object; fix it first')
    for event, groups in ours.items():
        hooks.setdefault(event, []).extend(groups)
    doc["hooks"] = hooks
    return to_json(doc)


# --- TOML (Codex config.toml), edited as text so comments and layout survive ------------------------------------


def _toml(path: Path) -> tuple[str, dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(f"{path} is not valid TOML ({exc}); fix it first, loomd will not edit it") from exc


def unmark(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.rstrip().endswith(TOML_MARK))


def toml_with_codex_keys(text: str, notify: list[str]) -> tuple[str, list[str]]:
    """`text` plus `notify` (when unset) and `[features] hooks = true` (when unset), each line marked."""
    text = unmark(text)  # a re-install replaces what an earlier one added
    data = tomllib.loads(text)
    notes: list[str] = []
    lines = text.splitlines(keepends=True)
    if "notify" not in data:
        # the top of the file is always top-level TOML, whatever tables follow
        lines.insert(0, f"notify = {json.dumps(notify)}  {TOML_MARK}\n")
    else:
        notes.append(f"Codex `notify` is already set to {data['notify']}; loomd left it alone (its hooks still "
                     "capture each turn)")
    features = data.get("features", {})
    added_features = False
    if "hooks" in features or "codex_hooks" in features:
        if features.get("hooks", features.get("codex_hooks")) is False:
            notes.append("config.toml has [features] hooks = false: Codex will not run loomd's hooks")
    elif "features" not in data:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines += [f"{TOML_MARK}\n", f"[features]  {TOML_MARK}\n", f"hooks = true  {TOML_MARK}\n"]
        added_features = True
    else:
        header = re.compile(r"^\s*\[\s*features\s*\]\s*(#.*)?$")
        at = next((i for i, line in enumerate(lines) if header.match(line)), None)
        if at is None:
            notes.append("could not place `hooks = true` in config.toml's [features]; add it yourself")
        else:
            lines.insert(at + 1, f"hooks = true  {TOML_MARK}\n")
            added_features = True
    new = "".join(lines)
    expected = tomllib.loads(text)
    if "notify" not in data:
        expected["notify"] = notify
    if added_features:
        expected.setdefault("features", {})["hooks"] = True
    if tomllib.loads(new) != expected:  # never write a file that means something else than intended
        raise InstallError("could not add notify / [features] to config.toml safely; add them yourself: "
                           f"notify = {json.dumps(notify)}")
    return new, notes


# --- user files: back up, write, remember how to put them back ---------------------------------------------------


def user_file_steps(path: Path, new: bytes, prior: dict[str, Any] | None, **facts: Any) -> tuple[
        list[Step], dict[str, Any]]:
    """Back up `path` and write `new`. The record keeps the state before loomd's first change, as long as the file
    was not touched since loomd last wrote it (else only the semantic undo is safe)."""
    current = path.read_bytes() if path.exists() else None
    untouched = prior is not None and (
        _sha(current) == prior.get("wrote") if current is not None else not prior.get("existed"))
    entry: dict[str, Any] = {k: v for k, v in (prior or {}).items() if k != "wrote"} if untouched else \
        {"existed": current is not None, **facts}
    steps: list[Step] = []
    if current is not None and current != new:
        saved = backup_path(path)
        steps.append(Backup(path, saved))
        entry.setdefault("backup", str(saved))
    steps.append(Write(path, new, 0o600))
    entry["wrote"] = _sha(new)
    return steps, entry


def restore_or(entry: dict[str, Any], fallback: Callable[[bytes], bytes | None],
               parse: Callable[[bytes], Any]) -> Callable[[bytes], bytes | None]:
    """Uninstall's edit of a user file: the semantic undo `fallback`, except that when its result means the same as
    the original (saved before loomd's first change) the original bytes come back, formatting and comments too."""
    def change(current: bytes) -> bytes | None:
        if entry.get("wrote") == _sha(current) and entry.get("existed") is False:
            return None  # loomd created the file and nobody touched it since
        result = fallback(current)
        saved = entry.get("backup")
        if result is not None and saved and Path(saved).is_file():
            original = Path(saved).read_bytes()
            try:
                if parse(result) == parse(original):
                    return original
            except ValueError:
                pass
        return result
    return change


def _parse_json(data: bytes) -> Any:
    return json.loads(data or b"{}")


def _parse_toml(data: bytes) -> Any:
    return tomllib.loads(data.decode())


def hooks_undo(path: Path, entry: dict[str, Any], tidy: Callable[[dict[str, Any]], None] | None = None) -> Step:
    """Remove loomd's hook entries from a JSON settings file (and let `tidy` drop what else loomd left there)."""
    def fallback(current: bytes) -> bytes | None:
        doc = _parse_json(current)
        if not isinstance(doc, dict):
            return current
        if "hooks" in doc:
            doc["hooks"] = strip_hooks(doc["hooks"])
            if doc["hooks"] == {} and not entry.get("had_hooks", True):
                del doc["hooks"]
        if tidy is not None:
            tidy(doc)
        return None if doc == {} and entry.get("existed") is False else to_json(doc)
    return Edit(path, restore_or(entry, fallback, _parse_json),
                f"# remove the hook entries running {SHIM_MARK} from {path}")


def toml_undo(path: Path, entry: dict[str, Any]) -> Step:
    def fallback(current: bytes) -> bytes | None:
        text = unmark(current.decode())
        return None if not text.strip() and entry.get("existed") is False else text.encode()
    return Edit(path, restore_or(entry, fallback, _parse_toml), f"sed -i '/{TOML_MARK}$/d' {shlex.quote(str(path))}")


# --- Claude Code -------------------------------------------------------------------------------------------------


def claude_dir(req: Request) -> Path:
    return Path(req.env.get("CLAUDE_CONFIG_DIR") or req.home / ".claude")


def _claude_source_arg(source: Any) -> str | None:
    """`claude plugin marketplace add` argument that recreates an `extraKnownMarketplaces` entry."""
    src = source.get("source") if isinstance(source, dict) else None
    if not isinstance(src, dict):
        return None
    return next((str(src[k]) for k in ("path", "repo", "url") if src.get(k)), None)


def claude_install(req: Request) -> Actions:
    settings = claude_dir(req) / "settings.json"
    binary = req.client("claude")
    mode = "settings" if req.settings_only or not binary else "plugin"
    prior = read_records(req).get("claude")
    acts = Actions(f"loom install claude ({mode} mode, interpreter {req.python})")
    if prior and prior.get("mode") != mode:
        acts.steps += claude_undo(req, prior)
        prior = None
    acts.steps += render_steps(req)
    doc = _load_json(settings)
    if mode == "settings":
        if not req.settings_only:
            acts.notes.append("`claude` is not on PATH: the hooks went into settings.json instead of the plugin")
        steps, entry = user_file_steps(settings, with_hooks(settings, req.hooks("claude")),
                                       (prior or {}).get("settings"), had_hooks="hooks" in doc)
        acts.steps += steps
    else:
        assert binary is not None
        previous = doc.get("extraKnownMarketplaces", {}).get(MARKETPLACE)
        ours = _claude_source_arg(previous) == str(req.plugin_root)
        # a re-install keeps what the first install found
        entry = (prior or {}).get("settings") or {
            "existed": settings.exists(), "had": [k for k in ("extraKnownMarketplaces", "enabledPlugins") if k in doc],
            "previous": None if ours else previous, "was_enabled": doc.get("enabledPlugins", {}).get(PLUGIN_ID)}
        if settings.exists():  # the client CLI rewrites the file
            saved = backup_path(settings)
            acts.steps.append(Backup(settings, saved))
            entry.setdefault("backup", str(saved))
        if previous and not ours:
            acts.notes.append(f"the `{MARKETPLACE}` marketplace pointed at {_claude_source_arg(previous)}; it now "
                              "points at loomd's rendered plugin (`loom uninstall claude` puts it back)")
        acts.steps += [Run([binary, "plugin", "marketplace", "add", str(req.plugin_root)], req.env),
                       Run([binary, "plugin", "install", PLUGIN_ID], req.env)]
    acts.steps.append(record_step(req, {"mode": mode, "python": req.python, "settings": entry}))
    return acts


def claude_undo(req: Request, prior: dict[str, Any] | None) -> list[Step]:
    settings = claude_dir(req) / "settings.json"
    entry = (prior or {}).get("settings", {})
    binary = req.client("claude")
    steps: list[Step] = []
    if (prior or {}).get("mode") != "settings" and binary:
        if settings.exists():
            steps.append(Backup(settings, backup_path(settings)))
        steps += [Run([binary, "plugin", "uninstall", PLUGIN_ID], req.env, may_fail=True),
                  Run([binary, "plugin", "marketplace", "remove", MARKETPLACE], req.env, may_fail=True)]
        again = _claude_source_arg(entry.get("previous"))
        if again:
            steps.append(Run([binary, "plugin", "marketplace", "add", again], req.env, may_fail=True))
            if entry.get("was_enabled"):
                steps.append(Run([binary, "plugin", "install", PLUGIN_ID], req.env, may_fail=True))
        had = entry.get("had", ["extraKnownMarketplaces", "enabledPlugins"])

        def tidy(doc: dict[str, Any]) -> None:  # the client leaves its emptied tables behind
            for key in ("extraKnownMarketplaces", "enabledPlugins"):
                if doc.get(key) == {} and key not in had:
                    del doc[key]

        steps.append(hooks_undo(settings, entry, tidy))
    else:
        steps.append(hooks_undo(settings, entry))
    return steps


# --- Codex -------------------------------------------------------------------------------------------------------


def codex_dir(req: Request) -> Path:
    return Path(req.env.get("CODEX_HOME") or req.config.codex_home or req.home / ".codex").expanduser()


def codex_install(req: Request) -> Actions:
    home = codex_dir(req)
    config_toml, hooks_json = home / "config.toml", home / "hooks.json"
    binary = req.client("codex")
    mode = "settings" if req.settings_only or not binary else "plugin"
    prior = read_records(req).get("codex")
    acts = Actions(f"loom install codex ({mode} mode, interpreter {req.python})")
    if prior and prior.get("mode") != mode:
        acts.steps += codex_undo(req, prior)
        prior = None
    acts.steps += render_steps(req)
    text, data = _toml(config_toml)
    notify = [req.python, "-S", "-E", str(req.plugin_root / PLUGIN / "shims" / "loom-hook"), "notify"]
    if req.baked:  # an argv, not a shell line: `env` sets the variable
        notify = ["/usr/bin/env", *(f"{k}={v}" for k, v in req.baked.items()), *notify]
    new_toml, notes = toml_with_codex_keys(text, notify)
    acts.notes += notes
    toml_steps, toml_entry = user_file_steps(config_toml, new_toml.encode(), (prior or {}).get("config"))
    acts.steps += toml_steps
    entry: dict[str, Any] = {"mode": mode, "python": req.python, "config": toml_entry}
    if mode == "settings":
        if not req.settings_only:
            acts.notes.append("`codex` is not on PATH: the hooks went into hooks.json instead of the plugin")
        steps, entry["hooks"] = user_file_steps(
            hooks_json, with_hooks(hooks_json, req.hooks("codex")),
            (prior or {}).get("hooks"), had_hooks="hooks" in _load_json(hooks_json))
        acts.steps += steps
    else:
        assert binary is not None
        previous = data.get("marketplaces", {}).get(MARKETPLACE, {}).get("source")
        ours = previous == str(req.plugin_root)
        if prior:
            entry.update({k: prior[k] for k in ("previous", "was_enabled") if k in prior})
        else:
            entry["previous"] = None if ours else previous
            entry["was_enabled"] = data.get("plugins", {}).get(PLUGIN_ID, {}).get("enabled")
        if previous and not ours:
            # Codex refuses a second source under one marketplace name
            acts.steps.append(Run([binary, "plugin", "marketplace", "remove", MARKETPLACE], req.env))
            acts.notes.append(f"the `{MARKETPLACE}` marketplace pointed at {previous}; it now points at loomd's "
                              "rendered plugin (`loom uninstall codex` puts it back)")
        # `plugin add` again refreshes Codex's cached copy of the plugin
        acts.steps += [Run([binary, "plugin", "marketplace", "add", str(req.plugin_root)], req.env),
                       Run([binary, "plugin", "add", PLUGIN_ID], req.env)]
    acts.notes.append("Codex runs hooks only once you trust them: open `codex` and approve loomd's hooks in /hooks "
                      "(until then `notify` still records every turn)")
    acts.steps.append(record_step(req, entry))
    return acts


def codex_undo(req: Request, prior: dict[str, Any] | None) -> list[Step]:
    home = codex_dir(req)
    prior = prior or {}
    binary = req.client("codex")
    steps: list[Step] = []
    if prior.get("mode") != "settings" and binary:
        steps += [Run([binary, "plugin", "remove", PLUGIN_ID], req.env, may_fail=True),
                  Run([binary, "plugin", "marketplace", "remove", MARKETPLACE], req.env, may_fail=True)]
        if prior.get("previous"):
            steps.append(Run([binary, "plugin", "marketplace", "add", str(prior["previous"])], req.env,
                             may_fail=True))
            if prior.get("was_enabled"):
                steps.append(Run([binary, "plugin", "add", PLUGIN_ID], req.env, may_fail=True))
    if prior.get("mode") != "plugin":
        steps.append(hooks_undo(home / "hooks.json", prior.get("hooks", {})))
    steps.append(toml_undo(home / "config.toml", prior.get("config", {})))
    return steps


# --- targets -----------------------------------------------------------------------------------------------------


def agent_uninstall(undo: Callable[[Request, dict[str, Any] | None], list[Step]]) -> Callable[[Request], Actions]:
    def uninstall(req: Request) -> Actions:
        records = read_records(req)
        acts = Actions(f"loom uninstall {req.target}")
        if req.target not in records:
            acts.notes.append("no install record: removing whatever loomd registration is there")
        acts.steps += undo(req, records.get(req.target))
        if not (set(records) - {req.target}) & set(AGENTS):
            acts.steps.append(Remove(req.plugin_root))  # no other agent runs the rendered plugin
        acts.steps.append(record_step(req, None))
        return acts
    return uninstall


@dataclass(frozen=True)
class Target:
    """One `loom install|uninstall <name>`: each callable turns a Request into Actions (nothing done yet)."""

    help: str
    install: Callable[[Request], Actions]
    uninstall: Callable[[Request], Actions]


AGENTS = ("claude", "codex")
TARGETS: dict[str, Target] = {
    "claude": Target("Claude Code: the loom plugin (hooks + MCP), or hooks in ~/.claude/settings.json",
                     claude_install, agent_uninstall(claude_undo)),
    "codex": Target("Codex CLI: the loom plugin (hooks + MCP) and notify, or hooks in $CODEX_HOME/hooks.json",
                    codex_install, agent_uninstall(codex_undo)),
}


# --- services and the MCP entry: services.py renders and plans them; this adapts its plans --------------------------


def _units_target(make: Callable[[Request], services.Plan], verb: str) -> Callable[[Request], Actions]:
    def build(req: Request) -> Actions:
        made = make(req)
        steps: list[Step] = [*made.steps()]
        return Actions(f"loom {verb} {made.target}", steps, list(made.notes))
    return build


TARGETS.update({
    "systemd": Target("systemd user units: loomd.socket (socket activation) and loomd.service, enabled and started",
                      _units_target(lambda r: services.systemd_install_plan(r.config, r.python, r.env), "install"),
                      _units_target(lambda r: services.systemd_uninstall_plan(r.env), "uninstall")),
    "launchd": Target("macOS LaunchAgent io.loomd.daemon (RunAtLoad, KeepAlive), loaded with launchctl",
                      _units_target(lambda r: services.launchd_install_plan(r.config, r.python, r.env), "install"),
                      _units_target(lambda r: services.launchd_uninstall_plan(r.env), "uninstall")),
    "mcp": Target("the MCP server `loom` for Claude Code and Codex (user scope), without the plugin",
                  _units_target(lambda r: services.mcp_install_plan(r.python, r.env), "install"),
                  _units_target(lambda r: services.mcp_uninstall_plan(r.env), "uninstall")),
})


def plan(target: str, *, uninstall: bool = False, python: str | None = None, settings_only: bool = False,
         env: Mapping[str, str] | None = None, config: Config | None = None) -> Actions:
    """The Actions for `loom install|uninstall <target>` in this environment; nothing is changed yet."""
    if target not in TARGETS:
        raise InstallError(f"unknown target {target!r}; one of: {', '.join(TARGETS)}")
    env = os.environ if env is None else env
    req = Request(target, config or load_config(env), env, check_python(python or sys.executable), settings_only)
    return (TARGETS[target].uninstall if uninstall else TARGETS[target].install)(req)
