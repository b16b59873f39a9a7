"""`loom doctor`: each check is one finding, OK / WARN / FAIL, one line, with the fix."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomd import __version__
from loomd.client import Client
from loomd.config import Config, load_config
from loomd.errors import LoomdError
from loomd.installer import services
from loomd.installer.plugin import PINNED_PYTHON, PREAMBLE
from loomd.store.db import NewerSchema, check_schema_version, connect_sync, damaged_fts, integrity_problems, rebuild_fts
from loomd.trust import problem_with, user_name

HOOK_MARKERS = ("loom-hook", "loom_hook")
DAY_S = 86_400
STALE_RUNNING_S = 3_600  # a job still 'running' after an hour died with its daemon
SPOOL_STUCK_S = 300  # a spool file this old while the daemon runs: the replay is not getting through
ORPHAN_TEMP_S = 60  # the daemon's ingest/spool.py ORPHAN_AGE_S: a .tmp-* file older than this is a killed shim's
TASK_RECENT_S = 3_600  # a background task that failed this recently (and runs again) is still worth a WARN
# Job outcomes (workers/scheduler.py): ok, noop, dry_run, cancelled (at shutdown) are normal; error, and
# interrupted (the daemon died mid-run), are failures.


@dataclass
class Finding:
    name: str
    status: str  # OK | WARN | FAIL
    detail: str
    fix: str = ""


@dataclass
class Checkup:
    """What the checks share: the config, the environment, and the daemon's status (asked once)."""

    config: Config
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    _status: dict[str, Any] | None = None
    _status_error: str | None = None
    _asked: bool = False

    @property
    def home(self) -> Path:
        return Path(self.env.get("HOME") or Path.home())

    def status(self) -> dict[str, Any] | None:
        if not self._asked:
            self._asked = True
            try:
                with Client(self.config.paths.socket, timeout=5.0) as client:
                    self._status = client.call("status")
            except (LoomdError, OSError) as exc:
                self._status_error = str(exc)
        return self._status


def ok(name: str, detail: str) -> Finding:
    return Finding(name, "OK", detail)


def warn(name: str, detail: str, fix: str) -> Finding:
    return Finding(name, "WARN", detail, fix)


def fail(name: str, detail: str, fix: str) -> Finding:
    return Finding(name, "FAIL", detail, fix)


# --- the interpreter and what it loads ---------------------------------------------------------------------------


def check_interpreter(c: Checkup) -> Finding:
    name = "interpreter"
    if not os.access(sys.executable, os.X_OK):
        return fail(name, f"{sys.executable} is not executable", "reinstall loomd into a working virtualenv")
    return ok(name, f"Python {platform.python_version()} at {sys.executable}, loomd {__version__}")


def check_extensions(c: Checkup) -> Finding:
    try:
        conn = connect_sync(":memory:")
        version = conn.execute("SELECT sqlite_version(), vec_version()").fetchone()
        conn.close()
    except LoomdError as exc:
        return fail("sqlite extensions", str(exc), f"{sys.executable} -m pip install sqlean.py sqlite-vec")
    return ok("sqlite extensions", f"SQLite {version[0]}, sqlite-vec {version[1]} load")


def check_embedder(c: Checkup) -> Finding:
    name = "embedder"
    kind = c.config.embedder.strip().lower()
    if kind == "none":
        return warn(name, "embeddings are off: search runs on keywords, recency and the graph only",
                    "set embedder = \"local\" in the config (works offline)")
    from loomd.vectors.embed import MODEL_SHA256, EmbedderError, make_embedder

    live = (c.status() or {}).get("embedder") or {}
    if live.get("state") == "failed":  # the running daemon could not load it: it searches full text only
        error = str(live.get("error", ""))
        return fail(name, f"the daemon runs full-text only: {error.split('; fix:')[0]}",
                    _fix_of(error, "fix the embedder config, then restart loomd"))
    try:
        embedder = make_embedder(c.config)
        vector = embedder.embed(["loom doctor"])[0]
    except EmbedderError as exc:
        return fail(name, str(exc).split("; fix:")[0], _fix_of(str(exc), "reinstall loomd's dependencies"))
    except (OSError, ValueError) as exc:  # a remote endpoint that is down or answers nonsense
        return fail(name, f"{kind} embedder failed: {exc}", "check embed_url, embed_model and embed_key")
    dim = len(vector) // 4
    if kind == "local":
        model = getattr(embedder, "model_path", "?")
        return ok(name, f"local MiniLM int8 ({model}), sha256 {MODEL_SHA256[:12]}… verified, {dim} dims")
    return ok(name, f"{kind} endpoint {c.config.embed_url} answers, {dim} dims")


def _fix_of(message: str, default: str) -> str:
    return message.split("; fix: ", 1)[1] if "; fix: " in message else default


# --- the daemon, its socket and its files ------------------------------------------------------------------------


def check_socket(c: Checkup) -> Finding:
    path = c.config.paths.socket
    status = c.status()
    if status is None:
        return fail("daemon socket", c._status_error or f"no daemon on {path}", _start_fix())
    if status.get("socket") != str(path) or status.get("db") != str(c.config.paths.db):
        return fail("daemon socket", f"the daemon on {path} runs with other paths (its socket {status.get('socket')}, "
                                     f"its database {status.get('db')}): what it stores is not what `loom` reads",
                    "give the service the same LOOMD_HOME / XDG_* variables: re-run `loom install systemd|launchd`")
    return ok("daemon socket", f"loomd {status.get('version')} pid {status.get('pid')} answers on {path}")


def _start_fix() -> str:
    if sys.platform == "darwin":
        return "loom install launchd (or run `loomd` in a terminal)"
    return "loom install systemd (or run `loomd` in a terminal)"


def check_permissions(c: Checkup) -> Finding:
    p = c.config.paths
    checks = [(p.data_dir, "directory"), (p.state_dir, "directory"), (p.socket.parent, "directory"),
              (p.db, "file"), (p.socket, "socket"), (p.spool, "directory"), (p.spool / "rejected", "directory"),
              (p.spool / "quarantine", "directory"), (p.state_dir / "hook.log", "file")]
    for path, kind in dict.fromkeys(checks):
        problem = problem_with(path, kind, forbidden_mode=0o077)  # the daemon refuses writable; yours alone is best
        if problem:
            return fail("permissions", problem.detail, problem.fix)
    return ok("permissions", "data, state, socket and spool are yours alone (0700 dirs, 0600 files)")


def check_database(c: Checkup) -> Finding:
    db = c.config.paths.db
    if not db.exists():
        return warn("database", f"{db} does not exist yet", "start the daemon once: `loomd`")
    try:
        conn = connect_sync(f"file:{db}?mode=ro")
    except LoomdError as exc:
        return fail("database", str(exc), f"{sys.executable} -m pip install sqlean.py sqlite-vec")
    try:
        check_schema_version(conn, db)
        problems = integrity_problems(conn)
    except NewerSchema as exc:
        return fail("database", str(exc), "upgrade loomd to the version that wrote it")
    except Exception as exc:  # noqa: BLE001 - any driver error is a finding, not a crash
        return fail("database", f"{db}: {exc}", f"stop loomd, move {db} aside, restart loomd")
    finally:
        conn.close()
    if problems and damaged_fts(problems):
        return fail("database", f"{db}: the full-text index is damaged ({'; '.join(problems)[:200]}); the tables are "
                    "sound", "loom doctor --repair (rebuilds it from the tables; so does the daemon when it starts)")
    if problems:
        return fail("database", f"{db}: integrity check says {'; '.join(problems)[:300]}",
                    f"stop loomd, move {db} aside, restart")
    size = sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists())
    return ok("database", f"{db} ({size / 1e6:.1f} MB) passes its integrity check")


def _ages(files: list[Path]) -> list[float]:
    ages = []
    for path in files:
        try:
            ages.append(time.time() - path.lstat().st_mtime)
        except OSError:
            continue
    return ages


def repair_database(config: Config) -> Finding:
    """`loom doctor --repair`: rebuild a damaged full-text index from the tables (the daemon may keep running)."""
    db = config.paths.db
    if not db.exists():
        return ok("repair", f"{db} does not exist: nothing to repair")
    conn = connect_sync(db)
    try:
        check_schema_version(conn, db)
        problems = integrity_problems(conn)
        damaged = damaged_fts(problems)
        if problems and not damaged:
            return fail("repair", f"{db}: damage beyond the derived indexes ({'; '.join(problems)[:200]})",
                        f"stop loomd, move {db} aside (or restore a backup), restart")
        if damaged:
            rebuild_fts(conn, damaged)
            problems = integrity_problems(conn)
    except LoomdError as exc:
        return fail("repair", str(exc), "upgrade loomd to the version that wrote it")
    finally:
        conn.close()
    if problems:
        return fail("repair", f"{db}: still damaged after the rebuild ({'; '.join(problems)[:200]})",
                    f"stop loomd, move {db} aside (or restore a backup), restart")
    return ok("repair", f"rebuilt {', '.join(damaged)} from the tables" if damaged else "nothing to repair")


LOW_DISK_BYTES = 200 * 1024 * 1024
RECENT_FAILURE_S = 3_600


def check_storage(c: Checkup) -> Finding:
    """Events that could not be stored, and the free space of the data folder (a full disk loses events)."""
    name = "storage"
    data = c.config.paths.db.parent
    try:
        free = shutil.disk_usage(data).free
    except OSError as exc:
        return fail(name, f"cannot read the free space of {data}: {exc}", f"check that {data} exists and is yours")
    space = f"{free / 1e6:.0f} MB free on {data}"
    status = c.status() or {}
    storage = status.get("storage") or {}
    recent = storage.get("recent_errors") or []
    failed, busy = int(storage.get("commit_failed") or 0), int(storage.get("busy_refused") or 0)
    if failed and recent:
        last = recent[-1]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(last.get("time", 0))))
        detail = (f"{failed} event(s) could not be committed since the daemon started; last at {when}: "
                  f"{str(last.get('message'))[:200]}; {space}")
        fix = (f"free space on the disk holding {data} (`df -h {shlex.quote(str(data))}`); the shim spooled what it "
               "could and the daemon replays it")
        recent_enough = time.time() - float(last.get("time", 0)) < RECENT_FAILURE_S
        return fail(name, detail, fix) if recent_enough else warn(name, detail, fix)
    if free < LOW_DISK_BYTES:
        return fail(name, f"only {space}: commits fail when it runs out",
                    f"free space on the disk holding {data} (`df -h {shlex.quote(str(data))}`)")
    if busy:
        return warn(name, f"{busy} event(s) refused as busy since the daemon started (the shim spooled them); {space}",
                    "see `loom status` (queue depth, in flight); raise max_inflight if it keeps happening")
    return ok(name, f"no failed commits; {space}")


def check_spool(c: Checkup) -> Finding:
    spool = c.config.paths.spool
    waiting = list(spool.glob("*.msgpack")) if spool.is_dir() else []
    backlog = len(waiting)
    rejected = len(list((spool / "rejected").glob("*"))) if (spool / "rejected").is_dir() else 0
    quarantine = spool / "quarantine"
    quarantined = len(list(quarantine.glob("*"))) if quarantine.is_dir() else 0
    oldest = max(_ages(waiting), default=0.0)
    if backlog and oldest > SPOOL_STUCK_S and c.status() is not None:
        last = ((c.status() or {}).get("spool") or {}).get("last_error") or "see the daemon log"
        return fail("spool", f"stuck: {backlog} events wait in {spool}, the oldest for {oldest / 60:.0f} min, although "
                             f"the daemon runs ({last})",
                    "loom status --json (spool, tasks) says why; then restart loomd: "
                    + ("launchctl kickstart -k gui/$UID/" + services.LAUNCHD_LABEL if sys.platform == "darwin"
                       else "systemctl --user restart loomd"))
    if quarantined:
        q = shlex.quote(str(quarantine))
        return warn("spool", f"{quarantined} file(s) in {quarantine} that loomd could not read or that were not its "
                             "user's own (a hook run under sudo?)",
                    f"sudo chown {shlex.quote(user_name())} {q}/* && mv {q}/* {shlex.quote(str(spool))}/  "
                    f"# to ingest them; or rm -r {q}")
    if rejected:
        return warn("spool", f"{backlog} waiting, {rejected} rejected in {spool / 'rejected'}",
                    "inspect the rejected files (they were not valid events), then delete them")
    if backlog and c.status() is None:
        return warn("spool", f"{backlog} events wait in {spool} for the daemon", _start_fix())
    if backlog > 100:
        return warn("spool", f"{backlog} events wait in {spool} although the daemon runs",
                    "check the daemon log for ingest errors")
    return ok("spool", f"{backlog} waiting")


def check_spool_temp(c: Checkup) -> Finding:
    """Temporary spool files left by shims killed mid-write: unredacted, and ingested only by a running daemon."""
    name = "spool temp files"
    spool = c.config.paths.spool
    old = [a for a in _ages(list(spool.glob(".tmp-*")) if spool.is_dir() else []) if a > ORPHAN_TEMP_S]
    if not old:
        return ok(name, "none left behind")
    detail = f"{len(old)} temporary file(s) older than {ORPHAN_TEMP_S} s in {spool} (shims killed while spooling; " \
             "they hold unredacted hook payloads)"
    if c.status() is None:
        return warn(name, detail, _start_fix() + "  # it ingests them, or keeps them redacted in spool/rejected")
    return warn(name, detail + " and the daemon has not taken them",
                f"rm -f {shlex.quote(str(spool))}/.tmp-*  # loomd could not read them; see loom status --json")


def _reported(c: Checkup, name: str, key: str, what: str) -> dict[str, Any] | Finding:
    """`status[key]` of the running daemon, or the WARN saying why there is none."""
    status = c.status()
    if status is None:
        return warn(name, "unknown: the daemon is not running", _start_fix())
    value = status.get(key)
    if not isinstance(value, dict):
        return warn(name, f"the daemon does not report its {what}", "upgrade loomd and restart the daemon")
    return value


def check_tasks(c: Checkup) -> Finding:
    """The daemon's background tasks (spool watcher, tailer, embeddings): failing now is a FAIL."""
    name = "background tasks"
    tasks = _reported(c, name, "tasks", "background tasks")
    if isinstance(tasks, Finding):
        return tasks
    down = {n: t for n, t in tasks.items() if t.get("state") == "backoff"}
    recent = {n: t for n, t in tasks.items() if t.get("failures") and
              time.time() - float(t.get("last_failed_at") or 0) < TASK_RECENT_S}
    for group, verdict in ((down, fail), (recent, warn)):
        if group:
            n, t = next(iter(group.items()))
            now = "is failing" if verdict is fail else "failed and runs again"
            return verdict(name, f"{n} {now} ({t.get('failures')} failure(s), {t.get('failures_in_a_row')} in a row): "
                                 f"{t.get('last_error')}",
                           _fix_of(str(t.get("last_error")), "fix what the error names (loom doctor shows the "
                                                             "permissions; the daemon log has the rest)"))
    return ok(name, ", ".join(f"{n} {t.get('state')}" for n, t in sorted(tasks.items())))


def check_tailers(c: Checkup) -> Finding:
    name = "transcript tailers"
    t = _reported(c, name, "tailers", "tailers")
    if isinstance(t, Finding):
        return t
    if not t.get("enabled", True):
        return warn(name, "transcript tailing is off (tail_transcripts = false)",
                    "set tail_transcripts = true to fill in what hooks do not carry")
    if t.get("errors"):
        return warn(name, f"{t['errors']} of {t.get('files', 0)} transcripts failed: {t.get('last_error')}",
                    "check the daemon log; the file may be unreadable or of an unknown format")
    behind = int(t.get("bytes_behind") or 0)
    return ok(name, f"{t.get('live', 0)} live of {t.get('files', 0)} followed, {behind} bytes behind")


def check_workers(c: Checkup) -> Finding:
    name = "workers"
    db = c.config.paths.db
    if not db.exists():
        return ok(name, "no database yet")
    since = time.time() - DAY_S
    try:
        conn = connect_sync(f"file:{db}?mode=ro")
        try:
            rows = conn.execute(
                "SELECT worker, outcome, error, started FROM jobs WHERE started >= ?"
                " AND (outcome IN ('error', 'interrupted') OR (outcome = 'running' AND started < ?))"
                " ORDER BY started DESC", (since, time.time() - STALE_RUNNING_S)).fetchall()
        finally:
            conn.close()
    except Exception as exc:  # noqa: BLE001 - a missing table or unreadable file is reported, not raised
        return warn(name, f"cannot read the jobs table: {exc}", "start the daemon once to migrate the database")
    if rows:
        workers = sorted({r[0] for r in rows})
        last = rows[0]
        return warn(name, f"{len(rows)} failed run(s) in the last day ({', '.join(workers)}); last: {last[0]} "
                          f"{last[1]}: {(last[2] or '')[:160]}", "see `loom workers` and the daemon log")
    return ok(name, "no failed runs in the last day")


SHARED_LAG_WARN_S = 3_600  # a change waiting this long to be pushed: teammates do not see this machine's work


def check_shared(c: Checkup) -> Finding:
    """Shared memory: off, or the daemon's sync health (push lag, last pull, last error; the DSN redacted)."""
    name = "shared memory"
    if not c.config.shared_dsn:
        return ok(name, "off (no [shared] dsn)")
    s = _reported(c, name, "shared", "shared-memory sync")
    if isinstance(s, Finding):
        return s
    lag = f"{s.get('push_queue')} change(s) to push, the oldest {float(s.get('push_lag_s') or 0):.0f}s old"
    if s.get("last_error"):
        return warn(name, f"sync with {s.get('dsn')} failing ({s.get('failures')} in a row; {lag}; retry in "
                          f"{s.get('retry_in_s')}s): {s['last_error']}",
                    "check the server is up and reachable, the role's password (shared_password_file or "
                    "PGPASSFILE) and `loom shared init`; `loom shared status` shows more; nothing is lost meanwhile")
    if float(s.get("push_lag_s") or 0) > SHARED_LAG_WARN_S:
        return warn(name, f"sync lags: {lag}", "see `loom shared status` and the daemon log")
    pulled = s.get("pull_age_s")
    return ok(name, f"{s.get('dsn')} team {s.get('team')}: {lag}; last pull "
                    f"{'never' if pulled is None else f'{pulled:.0f}s ago'}")


# --- the service manager -----------------------------------------------------------------------------------------


def _systemctl(*args: str) -> tuple[int, str]:
    try:
        done = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 255, str(exc)
    return done.returncode, (done.stdout or done.stderr).strip()


def _exec_interpreter(unit_text: str) -> str | None:
    for line in unit_text.splitlines():
        if line.startswith("ExecStart="):
            words = shlex.split(line[len("ExecStart="):].replace("%%", "%"))
            return words[0] if words else None
    return None


def check_systemd(c: Checkup) -> Finding:
    name = "service (systemd)"
    unit_dir = services.systemd_unit_dir(c.env)
    service, socket_unit = unit_dir / services.SERVICE_UNIT, unit_dir / services.SOCKET_UNIT
    if not service.exists() or not socket_unit.exists():
        return warn(name, f"not installed ({unit_dir} has no loomd units): nothing restarts loomd",
                    "loom install systemd")
    text = service.read_text()
    python = _exec_interpreter(text)
    if not python or not os.access(python, os.X_OK):
        return fail(name, f"{service} starts {python}, which does not exist", "loom install systemd (re-renders it)")
    families = next((line.split("=", 1)[1].split() for line in text.splitlines()
                     if line.startswith("RestrictAddressFamilies=")), ["AF_INET"])
    if services.needs_network(c.config) and "AF_INET" not in families:
        return fail(name, "a model or embedding endpoint is configured but the unit forbids IP sockets",
                    "loom install systemd (re-renders RestrictAddressFamilies)")
    if shutil.which("systemctl") is None:
        return warn(name, "units installed, but systemctl is not on PATH to ask their state", "install systemd")
    rc, active = _systemctl("is-active", services.SOCKET_UNIT, services.SERVICE_UNIT)
    states = active.split()
    if rc == 255 or len(states) != 2:
        return warn(name, f"units installed; the user manager cannot be asked ({active[:120]})",
                    "run doctor in your login session (`systemctl --user` needs the user bus)")
    if states[0] != "active":
        return fail(name, f"{services.SOCKET_UNIT} is {states[0]}, {services.SERVICE_UNIT} is {states[1]}",
                    "systemctl --user enable --now loomd.socket loomd.service; journalctl --user -u loomd")
    if states[1] == "failed":
        return fail(name, f"{services.SERVICE_UNIT} failed", "journalctl --user -u loomd -n 50")
    return ok(name, f"{services.SOCKET_UNIT} active, {services.SERVICE_UNIT} {states[1]} ({python})")


def check_launchd(c: Checkup) -> Finding:
    name = "service (launchd)"
    plist = services.launchd_plist_path(c.home)
    if not plist.exists():
        return warn(name, f"not installed ({plist} is absent): nothing restarts loomd", "loom install launchd")
    import plistlib

    try:
        data = plistlib.loads(plist.read_bytes())
    except (OSError, ValueError) as exc:
        return fail(name, f"{plist} is not a valid plist: {exc}", "loom install launchd")
    python = (data.get("ProgramArguments") or [None])[0]
    if not python or not os.access(python, os.X_OK):
        return fail(name, f"{plist} starts {python}, which does not exist", "loom install launchd")
    if shutil.which("launchctl") is None:
        return warn(name, "plist installed, but launchctl is not here to ask its state", "run doctor on the Mac")
    try:
        done = subprocess.run(["launchctl", "print", f"gui/{os.getuid()}/{services.LAUNCHD_LABEL}"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return warn(name, f"launchctl failed: {exc}", "launchctl print gui/$UID/" + services.LAUNCHD_LABEL)
    if done.returncode != 0:
        return fail(name, f"{services.LAUNCHD_LABEL} is not loaded", f"launchctl bootstrap gui/$UID {plist}")
    state = next((line.split("=", 1)[1].strip() for line in done.stdout.splitlines()
                  if line.strip().startswith("state =")), "unknown")
    return ok(name, f"{services.LAUNCHD_LABEL} loaded, state {state} ({python})")


def check_service(c: Checkup) -> Finding:
    return check_launchd(c) if sys.platform == "darwin" else check_systemd(c)


# --- the agents' hooks -------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _hook_commands(hooks: Any) -> Iterator[str]:
    """Every command string in a Claude/Codex `hooks` object."""
    if not isinstance(hooks, dict):
        return
    for groups in hooks.values():
        for group in groups if isinstance(groups, list) else []:
            for handler in (group.get("hooks") or []) if isinstance(group, dict) else []:
                if isinstance(handler, dict) and isinstance(handler.get("command"), str):
                    yield handler["command"]


def _plugin_roots(enabled: list[str], marketplaces: dict[str, Any]) -> dict[str, Path]:
    """name@marketplace -> the plugin's directory, for directory marketplaces we can resolve."""
    roots: dict[str, Path] = {}
    for key in enabled:
        plugin, _, market = key.partition("@")
        source = (marketplaces.get(market) or {}).get("source") if isinstance(marketplaces.get(market), dict) else None
        path = source.get("path") if isinstance(source, dict) else source if isinstance(source, str) else None
        if not path:
            continue
        manifest = _read_json(Path(path) / ".claude-plugin" / "marketplace.json")
        for entry in manifest.get("plugins") or []:
            if isinstance(entry, dict) and entry.get("name") == plugin and isinstance(entry.get("source"), str):
                roots[key] = (Path(path) / entry["source"]).resolve()
    return roots


def _broken(command: str, plugin_root: Path | None = None) -> str | None:
    """Why a hook command cannot run (a missing interpreter or shim), or None."""
    if plugin_root is not None:
        command = command.replace("${CLAUDE_PLUGIN_ROOT}", str(plugin_root))
    if PREAMBLE in command:
        # The checked-in plugin finds its interpreter in the shell: a pinned path, else python3 on PATH.
        base = Path(os.environ.get("LOOMD_HOME") or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
                    / "loomd")
        try:
            pinned = (base / PINNED_PYTHON).read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            pinned = ""
        exe = pinned if pinned and os.access(pinned, os.X_OK) else shutil.which("python3")
        if exe is None:
            return f"no interpreter: {base / PINNED_PYTHON} names none and python3 is not on PATH"
        command = shlex.quote(exe) + command.split(PREAMBLE, 1)[1]
    try:
        words = shlex.split(command)
    except ValueError:
        return f"cannot parse {command!r}"
    while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] == "env"):
        words = words[1:]  # `LOOMD_HOME=… python …` or `env K=V python …`: the interpreter comes after
    if not words:
        return "empty command"
    exe = words[0]
    if "${" in exe:
        return None  # a variable only the agent can expand
    if os.sep in exe:
        if not os.access(exe, os.X_OK):
            return f"interpreter {exe} does not exist"
    elif shutil.which(exe) is None:
        return f"{exe} is not on PATH"
    for word in words[1:]:
        if word.endswith(HOOK_MARKERS) and "${" not in word and not Path(word).exists():
            return f"shim {word} does not exist"
    return None


def _agent_finding(agent: str, present: str, commands: list[tuple[str, Path | None]], plugins: list[str],
                   fix: str) -> Finding:
    """`present`: what shows the agent is in use (its CLI on PATH), or "" when nothing does."""
    name = f"hooks ({agent})"
    ours = [(cmd, root) for cmd, root in commands if any(m in cmd for m in HOOK_MARKERS)]
    for cmd, root in ours:
        problem = _broken(cmd, root)
        if problem:
            return fail(name, f"a loomd hook cannot run: {problem}", fix)
    in_settings = [cmd for cmd, root in ours if root is None and "notify" not in cmd.split()]
    if in_settings and plugins:
        return warn(name, f"registered twice: hooks in the settings and the plugin {', '.join(plugins)} (every "
                          "event is sent twice)", f"loom uninstall {agent}, then loom install {agent}")
    if ours:
        words = [w for w in shlex.split(ours[0][0]) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
        exe = words[0] if words else "?"
        return ok(name, f"{len(ours)} loomd hook command(s), via {exe}")
    if plugins:
        return ok(name, f"loomd plugin {', '.join(plugins)} enabled")
    if not present:
        return ok(name, f"{agent} is not on PATH and registers no loomd hook; nothing to check")
    return warn(name, f"{present}, but no loomd hook is registered: its sessions are not captured", fix)


def _in_use(agent: str, c: Checkup) -> str:
    """What shows that `agent` is used here: its CLI on the checked PATH (a leftover config folder does not)."""
    found = shutil.which(agent, path=c.env.get("PATH"))
    return f"{agent} is installed ({found})" if found else ""


def check_claude_hooks(c: Checkup) -> Finding:
    base = c.home / ".claude"
    settings = _read_json(base / "settings.json")
    enabled = [k for k, v in (settings.get("enabledPlugins") or {}).items() if v and "loom" in k]
    roots = _plugin_roots(enabled, settings.get("extraKnownMarketplaces") or {})
    commands: list[tuple[str, Path | None]] = [(cmd, None) for cmd in _hook_commands(settings.get("hooks"))]
    for root in roots.values():
        hooks_file = _read_json(root / "hooks" / "hooks.json")
        commands += [(cmd, root) for cmd in _hook_commands(hooks_file.get("hooks"))]
    return _agent_finding("claude", _in_use("claude", c), commands, enabled, "loom install claude")


def check_codex_hooks(c: Checkup) -> Finding:
    base = Path(c.env.get("CODEX_HOME") or c.home / ".codex")
    commands: list[tuple[str, Path | None]] = [(cmd, None) for cmd in
                                               _hook_commands(_read_json(base / "hooks.json").get("hooks"))]
    config: dict[str, Any] = {}
    try:
        config = tomllib.loads((base / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        pass
    commands += [(cmd, None) for cmd in _hook_commands(config.get("hooks"))]
    notify = config.get("notify")
    if isinstance(notify, list) and notify and all(isinstance(w, str) for w in notify):
        commands.append((shlex.join(notify), None))
    enabled = [k for k, v in (config.get("plugins") or {}).items()
               if "loom" in k and isinstance(v, dict) and v.get("enabled", True)]
    for key in enabled:
        plugin, _, market = key.partition("@")
        for root in sorted((base / "plugins" / "cache" / market / plugin).glob("*")):
            for name in ("hooks/codex.json", "hooks/hooks.json"):
                commands += [(cmd, root) for cmd in _hook_commands(_read_json(root / name).get("hooks"))]
    finding = _agent_finding("codex", _in_use("codex", c), commands, enabled, "loom install codex")
    trusted = [k for k, v in ((config.get("hooks") or {}).get("state") or {}).items()
               if isinstance(v, dict) and v.get("trusted_hash")]
    if finding.status == "OK" and (commands or enabled) and not trusted:
        return warn(finding.name, f"{finding.detail}, but none trusted yet: Codex skips untrusted hooks (notify "
                                  "still records each turn)", "open `codex`, run /hooks and approve loomd's hooks")
    return finding


# --- the optional model endpoint ---------------------------------------------------------------------------------


def check_model_endpoint(c: Checkup) -> Finding:
    name = "model endpoint"
    cfg = c.config
    if not cfg.model_url:
        return ok(name, "none configured: the rule-based distillers run")
    if cfg.model_api not in ("openai", "anthropic"):
        return fail(name, f"model_api is {cfg.model_api!r}", "set model_api = \"openai\" or \"anthropic\"")
    import httpx

    url = cfg.model_url.rstrip("/") + "/models"
    headers = {"x-api-key": cfg.model_key, "anthropic-version": "2023-06-01"} if cfg.model_api == "anthropic" \
        else {"authorization": f"Bearer {cfg.model_key}"} if cfg.model_key else {}
    try:
        reply = httpx.get(url, headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        return fail(name, f"{cfg.model_url} is unreachable: {exc}", "start the model server or fix model_url")
    if reply.status_code in (401, 403):
        return fail(name, f"{cfg.model_url} refused the key (HTTP {reply.status_code})", "fix model_key")
    if reply.status_code in (404, 405, 501):
        # Many local servers answer chat completions but do not list their models: not a fault of the endpoint.
        return ok(name, f"{cfg.model_api} endpoint {cfg.model_url} reachable (it does not list models: HTTP "
                        f"{reply.status_code} on /models; loomd does not need the list)")
    if reply.status_code >= 500:
        return warn(name, f"{cfg.model_url} answers HTTP {reply.status_code}", "check the model server's log")
    return ok(name, f"{cfg.model_api} endpoint {cfg.model_url} reachable (HTTP {reply.status_code})")


CHECKS: list[Callable[[Checkup], Finding]] = [
    check_interpreter, check_extensions, check_embedder, check_socket, check_permissions, check_service,
    check_claude_hooks, check_codex_hooks, check_spool, check_spool_temp, check_tasks, check_tailers, check_database,
    check_storage, check_workers, check_shared, check_model_endpoint,
]


def run_checks(config: Config | None = None, env: dict[str, str] | None = None, *, repair: bool = False
               ) -> list[Finding]:
    try:
        config = config or load_config()
    except LoomdError as exc:
        return [fail("config", str(exc), "fix the config file or the LOOMD_* variables")]
    checkup = Checkup(config, dict(os.environ if env is None else env))
    findings = [repair_database(config)] if repair else []
    for check in CHECKS:
        try:
            findings.append(check(checkup))
        except Exception as exc:  # noqa: BLE001 - a crashing check is itself a finding; the others still run
            findings.append(fail(check.__name__.removeprefix("check_"), f"the check crashed: {exc!r}",
                                 "report this as a loomd bug"))
    return findings
