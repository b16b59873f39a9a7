"""`loom doctor`: healthy on a sound install, and each thing it claims to check, broken for real, is reported with
its fix (FAIL makes `loom doctor` exit non-zero). Only outside tools are stood in for: systemctl (no user manager
in this container) and, for one test, the sqlite-vec package."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import REPO, path_without_agents, serving
from test_spool import shim_spool

from loomd.client import AsyncClient
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.installer import agents as install
from loomd.installer import services
from loomd.installer.doctor import Finding, run_checks
from loomd.store.db import connect_sync
from loomd.vectors.embed import default_model_path

LOOM = str(Path(sys.executable).with_name("loom"))
SHIM = str(REPO / "shims" / "loom-hook")


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    path = tmp_path / "user"
    path.mkdir()
    return path


@pytest.fixture
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `systemctl` on PATH answering is-active with the contents of `state` (default: both active)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "systemctl-state"
    state.write_text("active\nactive\n")
    script = bin_dir / "systemctl"
    script.write_text(f'#!/bin/sh\ncat {state}\ngrep -q "^active" {state} && [ "$(grep -c active {state})" = 2 ] '
                      "&& exit 0\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return state


def env_for(user_home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(user_home), "CODEX_HOME": str(user_home / ".codex")}


def install_hooks(user_home: Path, python: str = sys.executable, shim: str = SHIM) -> None:
    """Hooks in the settings files, exactly as `loom install claude|codex --settings-only` writes them."""
    claude = user_home / ".claude" / "settings.json"
    claude.parent.mkdir(parents=True, exist_ok=True)
    claude.write_text(json.dumps({"hooks": install.hooks_object("claude", python, shim)}))
    codex = user_home / ".codex" / "hooks.json"
    codex.parent.mkdir(parents=True, exist_ok=True)
    codex.write_text(json.dumps({"hooks": install.hooks_object("codex", python, shim)}))
    (user_home / ".codex" / "config.toml").write_text(
        '[hooks.state."hooks.json:session_start:0:0"]\ntrusted_hash = "sha256:00"\n')


def install_units(user_home: Path, python: str = sys.executable) -> Path:
    env = env_for(user_home)
    services.apply(services.systemd_install_plan(load_config(), python, env, namespaces=True), run=False)
    return services.systemd_unit_dir(env)


async def checks(user_home: Path, **overrides: str) -> dict[str, Finding]:
    """run_checks in a thread, so a daemon served by this test's loop can answer it."""
    env = {**env_for(user_home), **overrides}
    config = load_config(env)
    findings = await asyncio.to_thread(run_checks, config, env)
    return {f.name: f for f in findings}


def assert_status(findings: dict[str, Finding], name: str, status: str, *words: str) -> Finding:
    f = findings[name]
    assert f.status == status, f
    for word in words:
        assert word in f.detail + " " + f.fix, f
    if status != "OK":
        assert f.fix, f"{name}: a {status} must say how to fix it"
    return f


async def test_healthy_install_has_no_fail(daemon: Daemon, user_home: Path, systemctl: Path) -> None:
    # No agent CLIs (whatever this machine has): `install` writes the settings files.
    env = {**env_for(user_home), "PATH": path_without_agents(user_home / "bin")}
    for agent in ("claude", "codex"):
        done = await asyncio.to_thread(subprocess.run, [LOOM, "install", agent, "--settings-only"], env=env,
                                       capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    config_toml = user_home / ".codex" / "config.toml"
    trust = '\n[hooks.state."hooks.json:session_start:0:0"]\ntrusted_hash = "sha256:00"\n'
    await asyncio.to_thread(config_toml.write_text, config_toml.read_text() + trust)  # as Codex's /hooks does
    install_units(user_home)
    found = await checks(user_home)
    bad = [f for f in found.values() if f.status == "FAIL"]
    assert not bad, bad
    for name in ("interpreter", "sqlite extensions", "embedder", "daemon socket", "permissions", "service (systemd)",
                 "hooks (claude)", "hooks (codex)", "spool", "transcript tailers", "database", "workers",
                 "model endpoint"):
        assert found[name].status == "OK", found[name]
    assert "sha256" in found["embedder"].detail


def test_daemon_down_is_a_fail_and_the_cli_exits_non_zero(home: Path, user_home: Path) -> None:
    found = asyncio.run(checks(user_home))
    assert_status(found, "daemon socket", "FAIL", "not running")
    done = subprocess.run([LOOM, "doctor"], env=env_for(user_home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "FAIL daemon socket" in done.stdout and "fix:" in done.stdout
    as_json = subprocess.run([LOOM, "doctor", "--json"], env=env_for(user_home), capture_output=True, text=True,
                             timeout=120)
    assert {"name": "daemon socket", "status": "FAIL"}.items() <= next(
        f for f in json.loads(as_json.stdout) if f["name"] == "daemon socket").items()


def test_missing_sqlite_extension_is_a_fail(home: Path, user_home: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sqlite_vec.py").write_text("raise ImportError('sqlite_vec removed for this test')\n")
    env = {**env_for(user_home), "PYTHONPATH": str(broken)}
    done = subprocess.run([LOOM, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    line = next(x for x in done.stdout.splitlines() if "sqlite extensions" in x)
    assert line.startswith("FAIL") and "sqlite_vec removed" in line


async def test_tampered_embedding_model_is_a_fail(home: Path, user_home: Path, tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    data = bytearray(default_model_path().read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    found = await checks(user_home, LOOMD_EMBED_MODEL_PATH=str(model))
    assert_status(found, "embedder", "FAIL", "sha256", "pip install")


async def test_loose_permissions_are_a_fail(daemon: Daemon, home: Path, user_home: Path) -> None:
    os.chmod(home, 0o755)
    try:
        found = await checks(user_home)
    finally:
        os.chmod(home, 0o700)
    assert_status(found, "permissions", "FAIL", "755", "chmod 700")
    os.chmod(daemon.socket_path, 0o666)
    found = await checks(user_home)
    assert_status(found, "permissions", "FAIL", "loomd.sock", "chmod 600")


def test_service_problems_are_fails(home: Path, user_home: Path, systemctl: Path, tmp_path: Path) -> None:
    found = asyncio.run(checks(user_home))
    assert_status(found, "service (systemd)", "WARN", "not installed", "loom install systemd")
    gone = tmp_path / "old-venv" / "bin" / "python"
    gone.parent.mkdir(parents=True)
    gone.symlink_to(sys.executable)
    install_units(user_home, str(gone))
    shutil.rmtree(tmp_path / "old-venv")  # the venv the unit was rendered for is gone
    found = asyncio.run(checks(user_home))
    assert_status(found, "service (systemd)", "FAIL", str(gone), "loom install systemd")
    install_units(user_home)
    found = asyncio.run(checks(user_home, LOOMD_MODEL_URL="http://127.0.0.1:9/v1", LOOMD_MODEL_API="openai"))
    assert_status(found, "service (systemd)", "FAIL", "IP sockets")
    systemctl.write_text("inactive\ninactive\n")
    found = asyncio.run(checks(user_home))
    assert_status(found, "service (systemd)", "FAIL", "loomd.socket is inactive", "enable --now")
    systemctl.write_text("active\nfailed\n")
    found = asyncio.run(checks(user_home))
    assert_status(found, "service (systemd)", "FAIL", "failed", "journalctl")


async def test_broken_hooks_are_fails(home: Path, user_home: Path, tmp_path: Path) -> None:
    # What is on this machine's PATH never decides the outcome: the checks get a PATH of their own.
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    (user_home / ".claude").mkdir()
    (user_home / ".codex").mkdir()  # a leftover folder alone is no sign the agent is in use
    found = await checks(user_home, PATH=str(bare))
    assert_status(found, "hooks (claude)", "OK", "not on PATH")
    assert_status(found, "hooks (codex)", "OK", "not on PATH")
    agents = tmp_path / "agents-bin"
    agents.mkdir()
    for name in ("claude", "codex"):
        (agents / name).write_text("#!/bin/sh\nexit 0\n")
        (agents / name).chmod(0o755)
    found = await checks(user_home, PATH=str(agents))
    assert_status(found, "hooks (claude)", "WARN", f"claude is installed ({agents / 'claude'})", "no loomd hook",
                  "loom install claude")
    assert_status(found, "hooks (codex)", "WARN", "codex is installed", "loom install codex")
    (user_home / ".codex").rmdir()
    install_hooks(user_home, python=str(tmp_path / "deleted-venv" / "bin" / "python"))
    found = await checks(user_home)
    assert_status(found, "hooks (claude)", "FAIL", "deleted-venv", "loom install claude")
    assert_status(found, "hooks (codex)", "FAIL", "deleted-venv", "loom install codex")
    install_hooks(user_home, shim=str(tmp_path / "moved" / "shims" / "loom-hook"))
    found = await checks(user_home)
    assert_status(found, "hooks (claude)", "FAIL", "shim", "moved")
    install_hooks(user_home)
    (user_home / ".codex" / "config.toml").write_text("")
    found = await checks(user_home)
    assert_status(found, "hooks (claude)", "OK")
    assert_status(found, "hooks (codex)", "WARN", "trusted", "/hooks")


async def test_spool_backlog_is_reported(home: Path, user_home: Path) -> None:
    spool = load_config().paths.spool
    spool.mkdir(parents=True, mode=0o700)
    for n in range(3):
        (spool / f"{n:016x}-00000000-00000000.msgpack").write_bytes(b"\x80")
    found = await checks(user_home)
    assert_status(found, "spool", "WARN", "3 events wait")
    (spool / "rejected").mkdir(mode=0o700)
    (spool / "rejected" / "bad.msgpack").write_bytes(b"junk")
    found = await checks(user_home)
    assert_status(found, "spool", "WARN", "1 rejected")


@pytest.fixture
def no_tailing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMD_TAIL_TRANSCRIPTS", "0")


async def test_tailers_off_is_reported(no_tailing: None, daemon: Daemon, user_home: Path) -> None:
    found = await checks(user_home)
    assert_status(found, "transcript tailers", "WARN", "tail_transcripts")


async def test_worker_failures_of_the_last_day_are_reported(daemon: Daemon, user_home: Path) -> None:
    async with daemon.store.atomic() as db:
        await db.execute("INSERT INTO jobs (worker, started, ended, outcome, error) VALUES (?,?,?,?,?)",
                         ("reflector", time.time() - 600, time.time() - 590, "error", "ValueError: bad cluster"))
        await db.execute("INSERT INTO jobs (worker, started, ended, outcome, error) VALUES (?,?,?,?,?)",
                         ("observer", time.time() - 3 * 86400, time.time(), "error", "too old to matter"))
    found = await checks(user_home)
    assert_status(found, "workers", "WARN", "1 failed run", "reflector", "bad cluster")


def test_corrupt_database_is_a_fail(daemon_process: Any, home: Path, user_home: Path) -> None:
    proc = daemon_process().start()
    assert proc.stop() == 0
    db = load_config().paths.db
    conn = connect_sync(db)
    conn.execute("CREATE TABLE filler (x)")
    conn.executemany("INSERT INTO filler VALUES (?)", [(os.urandom(200).hex(),) for _ in range(400)])
    conn.close()
    size = db.stat().st_size
    with open(db, "r+b") as f:  # scribble over the second half of the file, past the schema page
        f.seek(size // 2)
        f.write(os.urandom(size - size // 2))
    found = asyncio.run(checks(user_home))
    assert_status(found, "database", "FAIL", str(db), "move")


class _Answering(http.server.BaseHTTPRequestHandler):
    """A local model server whose GET (the doctor's `/models` probe) answers `status` with an empty body."""

    status: int

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the test reads the doctor's verdict, not the fake server's access log


class _Refusing(_Answering):
    status = 401  # a wrong key


@pytest.fixture
def refusing_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_model_endpoint_unreachable_or_refusing_is_a_fail(home: Path, user_home: Path,
                                                                refusing_server: str) -> None:
    found = await checks(user_home, LOOMD_MODEL_API="openai", LOOMD_MODEL_URL=f"http://127.0.0.1:{_closed_port()}/v1")
    assert_status(found, "model endpoint", "FAIL", "unreachable", "model_url")
    found = await checks(user_home, LOOMD_MODEL_API="openai", LOOMD_MODEL_URL=refusing_server,
                         LOOMD_MODEL_KEY="sk-wrong")
    assert_status(found, "model endpoint", "FAIL", "401", "model_key")
    found = await checks(user_home, LOOMD_MODEL_API="anthropik", LOOMD_MODEL_URL=refusing_server)
    assert_status(found, "model endpoint", "FAIL", "model_api")


async def test_a_daemon_running_with_other_paths_is_a_fail(daemon: Daemon, home: Path, user_home: Path,
                                                           tmp_path: Path) -> None:
    """E.g. a service started without the user's LOOMD_HOME: it answers, but stores elsewhere than `loom` reads."""
    other = Path(tempfile.mkdtemp(prefix="lo", dir="/tmp"))
    try:
        os.link(daemon.socket_path, other / "loomd.sock")  # the same listening socket, reached by another path
        found = await checks(user_home, LOOMD_HOME=str(other))
        assert_status(found, "daemon socket", "FAIL", "other paths", str(home / "loomd.db"), "LOOMD_HOME")
    finally:
        shutil.rmtree(other, ignore_errors=True)


async def test_normal_worker_outcomes_are_not_failures(daemon: Daemon, user_home: Path) -> None:
    async with daemon.store.atomic() as db:
        for outcome in ("ok", "noop", "dry_run", "cancelled"):
            await db.execute("INSERT INTO jobs (worker, started, ended, outcome) VALUES (?,?,?,?)",
                             ("observer", time.time() - 60, time.time() - 59, outcome))
    found = await checks(user_home)
    assert_status(found, "workers", "OK")
    async with daemon.store.atomic() as db:
        await db.execute("INSERT INTO jobs (worker, started, ended, outcome, error) VALUES (?,?,?,?,?)",
                         ("digest", time.time() - 60, time.time() - 59, "interrupted", "the daemon stopped"))
    found = await checks(user_home)
    assert_status(found, "workers", "WARN", "digest", "interrupted")


async def test_orphan_temp_files_and_quarantined_files_are_reported_with_fixes_that_work(
    home: Path, user_home: Path, sock_path: Path
) -> None:
    spool = load_config().paths.spool
    spool.mkdir(parents=True, mode=0o700)
    orphan_data = shim_spool("Stop", "dr-orphan")
    orphan = spool / f".tmp-{msgpack.unpackb(orphan_data)['eid']}"
    orphan.write_bytes(orphan_data)  # a shim killed between writing and renaming
    two_minutes_ago = time.time() - 120
    os.utime(orphan, (two_minutes_ago, two_minutes_ago))
    found = await checks(user_home)
    assert_status(found, "spool temp files", "WARN", "1 temporary file", "unredacted", "loomd")
    quarantine = spool / "quarantine"
    quarantine.mkdir(mode=0o700)
    held_data = shim_spool("Stop", "dr-held")
    held = quarantine / f"{msgpack.unpackb(held_data)['eid']}.msgpack"
    held.write_bytes(held_data)
    os.chown(held, 65534, 65534)  # written by a hook run as another user (under sudo, say)
    found = await checks(user_home)
    spool_finding = assert_status(found, "spool", "WARN", "1 file(s) in", "sudo chown")
    command = spool_finding.fix.split("  #", 1)[0]
    if os.geteuid() == 0:
        command = command.replace("sudo ", "")  # root already; sudo is not installed here
    await asyncio.to_thread(subprocess.run, ["sh", "-c", command], check=True, timeout=30)
    assert list(quarantine.iterdir()) == [] and (spool / held.name).exists()
    async with serving(sock_path):  # the other fix: a running daemon takes the orphan in
        for _ in range(600):
            if not orphan.exists() and not (spool / held.name).exists():
                break
            await asyncio.sleep(0.05)
        found = await checks(user_home)
        async with AsyncClient(sock_path) as client:
            for session in ("dr-orphan", "dr-held"):
                events = (await client.call("events", {"session_id": session, "limit": 5}))["events"]
                assert [e["kind"] for e in events] == ["Stop"], session
    assert_status(found, "spool temp files", "OK")
    assert_status(found, "spool", "OK")


class _NoModelList(_Answering):
    """Answers chat completions but not GET /models (llama.cpp-style servers)."""

    status = 501


async def test_a_model_server_that_lists_no_models_is_fine(home: Path, user_home: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoModelList)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        found = await checks(user_home, LOOMD_MODEL_API="openai", LOOMD_MODEL_URL=url)
        assert_status(found, "model endpoint", "OK", "reachable", "does not list models")
    finally:
        server.shutdown()
        server.server_close()
