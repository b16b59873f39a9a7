"""`loom doctor`: each check is one finding, OK / WARN / FAIL, with the fix."""

from __future__ import annotations

import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .client import Client
from .config import Config, load_config
from .errors import LoomdError
from .store import connect_sync


@dataclass
class Finding:
    name: str
    status: str  # OK | WARN | FAIL
    detail: str
    fix: str = ""


def check_extensions(config: Config) -> Finding:
    try:
        conn = connect_sync(":memory:")
        version = conn.execute("SELECT sqlite_version(), vec_version()").fetchone()
        conn.close()
    except LoomdError as exc:
        return Finding("sqlite extensions", "FAIL", str(exc), "pip install sqlean.py sqlite-vec")
    return Finding("sqlite extensions", "OK", f"SQLite {version[0]}, sqlite-vec {version[1]} ({sys.executable})")


def check_socket(config: Config) -> Finding:
    path = config.paths.socket
    try:
        with Client(path, timeout=3.0) as client:
            status = client.call("status")
    except LoomdError as exc:
        return Finding("daemon socket", "FAIL", str(exc), "start the daemon: `loomd` (or `loom install systemd`)")
    return Finding("daemon socket", "OK", f"loomd {status['version']} pid {status['pid']} on {path}")


def _mode_finding(name: str, path: Path, want: int) -> Finding | None:
    if not path.exists():
        return None
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Finding(name, "FAIL", f"{path} is mode {mode:o}: other users can reach it", f"chmod {want:o} {path}")
    return None


def check_permissions(config: Config) -> Finding:
    p = config.paths
    checks = [("data dir", p.data_dir, 0o700), ("state dir", p.state_dir, 0o700), ("database", p.db, 0o600),
              ("socket", p.socket, 0o600), ("spool", p.spool, 0o700)]
    for name, path, want in checks:
        bad = _mode_finding(f"permissions ({name})", path, want)
        if bad:
            return bad
    return Finding("permissions", "OK", "data, state, database, socket and spool are owner-only")


def check_database(config: Config) -> Finding:
    db = config.paths.db
    if not db.exists():
        return Finding("database", "WARN", f"{db} does not exist yet", "start the daemon once: `loomd`")
    try:
        conn = connect_sync(f"file:{db}?mode=ro")
    except LoomdError as exc:
        return Finding("database", "FAIL", str(exc), "pip install sqlean.py sqlite-vec")
    try:
        result = conn.execute("PRAGMA quick_check").fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - any driver error is a finding, not a crash
        return Finding("database", "FAIL", f"{db}: {exc}", f"move {db} aside and restart loomd")
    finally:
        conn.close()
    if result != "ok":
        return Finding("database", "FAIL", f"{db}: integrity check says {result}", f"move {db} aside; restart loomd")
    return Finding("database", "OK", f"{db} ({db.stat().st_size / 1e6:.1f} MB) passes its integrity check")


def check_spool(config: Config) -> Finding:
    spool = config.paths.spool
    backlog = len(list(spool.glob("*.msgpack"))) if spool.is_dir() else 0
    rejected = len(list((spool / "rejected").glob("*"))) if (spool / "rejected").is_dir() else 0
    if rejected:
        return Finding("spool", "WARN", f"{backlog} waiting, {rejected} rejected in {spool / 'rejected'}",
                       "inspect the rejected files; they were not valid events")
    if backlog:
        return Finding("spool", "WARN", f"{backlog} events waiting in {spool}", "start the daemon to ingest them")
    return Finding("spool", "OK", "empty")


CHECKS: list[Callable[[Config], Finding]] = [
    check_extensions, check_socket, check_permissions, check_database, check_spool,
]


def run_checks(config: Config | None = None) -> list[Finding]:
    try:
        config = config or load_config()
    except LoomdError as exc:
        return [Finding("config", "FAIL", str(exc), "fix the config file or LOOMD_* variables")]
    return [check(config) for check in CHECKS]
