"""systemd units and the launchd plist: rendered with real paths, verified by systemd's own tools, and the daemon
socket-activated on the unit's socket by a shim event sent before the daemon process existed.

What cannot run here (no systemd as PID 1, no user bus, no macOS): `systemctl --user enable --now`, a real
`Type=notify` start under the user manager, the sandbox options at run time, and `launchctl`. The units are checked
by `systemd-analyze verify`, the activation protocol by `systemd-socket-activate`, sd_notify against a datagram
socket of our own, and the plist by plistlib.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO, REQUIRE_ALL

from loomd.client import Client
from loomd.config import load_config
from loomd.errors import BadRequest
from loomd.installer import services

SHIM = REPO / "shims" / "loom-hook"
LOOM = str(Path(sys.executable).with_name("loom"))
STOP_PAYLOAD = b'{"session_id":"sa-1","transcript_path":"","cwd":"/tmp","hook_event_name":"Stop"}'


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (apt-get install systemd; .ci/run does it)"
        if REQUIRE_ALL:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def verify(unit_dir: Path) -> None:
    """`systemd-analyze --user verify` must pass and say nothing: it only warns (exit 0) on a bad setting."""
    analyze = need_tool("systemd-analyze")
    runtime = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: %t paths of every user unit must fit AF_UNIX
    try:
        done = subprocess.run([analyze, "--user", "verify", str(unit_dir / services.SOCKET_UNIT),
                               str(unit_dir / services.SERVICE_UNIT)], capture_output=True, text=True,
                              env={**os.environ, "XDG_RUNTIME_DIR": runtime}, timeout=60)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout


def write_units(unit_dir: Path, spec: services.ServiceSpec) -> None:
    unit_dir.mkdir(parents=True, exist_ok=True)
    (unit_dir / services.SOCKET_UNIT).write_text(services.render_socket(spec))
    (unit_dir / services.SERVICE_UNIT).write_text(services.render_service(spec))


def directives(text: str) -> dict[str, str]:
    return {k: v for k, _, v in (line.partition("=") for line in text.splitlines() if "=" in line
                                 and not line.startswith("#"))}


def test_checked_in_files_are_what_the_renderer_produces() -> None:
    for rel, data in services.reference_files().items():
        assert (REPO / rel).read_bytes() == data, f"{rel} is stale: run loomd.installer.services.write_reference(REPO)"


@pytest.mark.parametrize("namespaces", [True, False])
def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path, home: Path, namespaces: bool) -> None:
    spec = services.service_spec(load_config(), sys.executable, namespaces=namespaces)
    write_units(tmp_path / "units", spec)
    verify(tmp_path / "units")


def test_checked_in_units_pass_verify(tmp_path: Path) -> None:
    if not Path("/usr/bin/python3").exists():
        pytest.skip("the reference unit names /usr/bin/python3")
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for name in (services.SOCKET_UNIT, services.SERVICE_UNIT):
        shutil.copy(REPO / "systemd" / name, unit_dir / name)
    verify(unit_dir)


def test_default_paths_use_the_runtime_dir_the_shim_uses() -> None:
    env = {"HOME": "/home/ann", "XDG_RUNTIME_DIR": "/run/user/1000"}
    config = load_config(env)
    spec = services.service_spec(config, "/home/ann/.venvs/loomd/bin/python", env, namespaces=True)
    socket_unit = directives(services.render_socket(spec))
    assert socket_unit["ListenStream"] == "%t/loomd/loomd.sock"  # %t = the user manager's XDG_RUNTIME_DIR
    assert config.paths.socket == Path("/run/user/1000/loomd/loomd.sock")
    assert (socket_unit["SocketMode"], socket_unit["DirectoryMode"]) == ("0600", "0700")
    service = services.render_service(spec)
    d = directives(service)
    assert d["Type"] == "notify" and d["Restart"] == "on-failure" and d["NoNewPrivileges"] == "yes"
    assert d["ProtectSystem"] == "strict" and d["PrivateTmp"] == "yes" and d["RestrictAddressFamilies"] == "AF_UNIX"
    assert d["ReadWritePaths"].split() == [str(config.paths.data_dir), str(config.paths.state_dir), "%t/loomd"]
    assert d["ExecStart"] == "/home/ann/.venvs/loomd/bin/python -m loomd serve"
    assert int(d["TimeoutStopSec"]) > config.drain_timeout_s


def test_renderer_decides_network_tmp_timeout_and_escaping(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "LOOMD_HOME": "/tmp/loom 100%", "LOOMD_MODEL_URL": "http://127.0.0.1:9/v1",
           "LOOMD_MODEL_API": "openai", "LOOMD_DRAIN_TIMEOUT_S": "40"}
    config = load_config(env)
    spec = services.service_spec(config, "/opt/py 3/bin/python", env, namespaces=True)
    d = directives(services.render_service(spec))
    assert d["RestrictAddressFamilies"] == "AF_UNIX AF_INET AF_INET6"  # a model endpoint is configured
    assert "PrivateTmp" not in d  # LOOMD_HOME under /tmp: a private /tmp would hide it from the shims
    assert int(d["TimeoutStopSec"]) > config.drain_timeout_s == 40
    assert d["ExecStart"] == '"/opt/py 3/bin/python" -m loomd serve'
    assert directives(services.render_socket(spec))["ListenStream"] == '"/tmp/loom 100%%/loomd.sock"'
    assert 'Environment="LOOMD_HOME=/tmp/loom 100%%"' in services.render_service(spec)
    embed = services.service_spec(load_config({"HOME": str(tmp_path), "LOOMD_EMBEDDER": "openai"}), "/usr/bin/python3",
                               {"HOME": str(tmp_path)}, namespaces=False)
    rendered = services.render_service(embed)
    assert "AF_INET6" in rendered and "ProtectSystem" not in rendered and "NoNewPrivileges=yes" in rendered


def test_awkward_interpreter_path_still_verifies(tmp_path: Path, home: Path) -> None:
    odd = tmp_path / "py 50%"
    odd.mkdir()
    (odd / "python").symlink_to(sys.executable)
    spec = services.service_spec(load_config(), str(odd / "python"), namespaces=True)
    write_units(tmp_path / "units", spec)
    verify(tmp_path / "units")


def test_install_plan_writes_units_and_uninstall_removes_them(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "rt")}
    config = load_config(env)
    plan = services.systemd_install_plan(config, sys.executable, env, namespaces=True)
    script = plan.script()
    assert "systemctl --user daemon-reload" in script
    assert "systemctl --user enable --now loomd.socket loomd.service" in script
    done = services.apply(plan, run=False)
    unit_dir = tmp_path / ".config" / "systemd" / "user"
    assert (unit_dir / services.SERVICE_UNIT).exists() and (unit_dir / services.SOCKET_UNIT).exists()
    assert config.paths.data_dir.is_dir() and config.paths.state_dir.is_dir()  # ReadWritePaths must exist
    assert any(line.startswith("not run: systemctl --user enable") for line in done)
    verify(unit_dir)
    again = services.apply(services.systemd_install_plan(config, sys.executable, env, namespaces=True), run=False)
    assert f"unchanged {unit_dir / services.SERVICE_UNIT}" in again  # idempotent
    (unit_dir / services.SERVICE_UNIT).write_text("# edited by hand\n")
    rewritten = services.apply(services.systemd_install_plan(config, sys.executable, env, namespaces=True), run=False)
    assert any("previous version saved as loomd.service.loomd-bak-" in line for line in rewritten)
    services.apply(services.systemd_uninstall_plan(env), run=False)
    assert not (unit_dir / services.SERVICE_UNIT).exists() and not (unit_dir / services.SOCKET_UNIT).exists()
    assert config.paths.data_dir.is_dir()  # the memory stays


def test_printed_launchd_script_writes_a_plist_naming_existing_paths(tmp_path: Path) -> None:
    user_home = tmp_path / "home"
    user_home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(user_home)}
    done = subprocess.run([LOOM, "install", "launchd", "--print"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    plist_path = services.launchd_plist_path(user_home)
    assert not plist_path.exists()  # --print changes nothing
    body = re.search(r"<<'LOOMD_EOF'\n(.*?)\nLOOMD_EOF", done.stdout, re.S)
    assert body, done.stdout
    data = plistlib.loads(body.group(1).encode())
    assert data["Label"] == services.LAUNCHD_LABEL and data["RunAtLoad"] is True and data["KeepAlive"] is True
    python, *args = data["ProgramArguments"]
    assert Path(python).parent == Path(sys.executable).parent and args == ["-m", "loomd", "serve"]
    subprocess.run([python, "-c", "import loomd.daemon"], check=True, timeout=60)  # the venv that has loomd
    assert "Sockets" not in data  # the daemon binds its own socket on macOS (README: why)
    assert data["ExitTimeOut"] > load_config(env).drain_timeout_s
    # The printed script is the install: run it with launchctl replaced by a recorder (no macOS here).
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "launchctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'launchctl.log'}\n")
    (fake_bin / "launchctl").chmod(0o755)
    subprocess.run(["sh", "-e"], input=done.stdout, text=True, check=True, timeout=60,
                   env={**env, "PATH": f"{fake_bin}:{env['PATH']}"})
    written = plistlib.loads(plist_path.read_bytes())
    assert written == data
    for key in ("WorkingDirectory",):
        assert Path(written[key]).is_dir(), key
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert Path(written[key]).parent.is_dir() and str(Path(written[key])).startswith(str(user_home / "Library"))
    calls = (tmp_path / "launchctl.log").read_text().splitlines()
    assert calls[-1] == f"bootstrap gui/{os.getuid()} {plist_path}"


def _program(pid: int) -> str:
    """argv[0] of a process: systemd-socket-activate execs the daemon in its own place, on the first connection."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def test_socket_activation_serves_an_event_sent_before_the_daemon_existed(tmp_path: Path) -> None:
    activate = need_tool("systemd-socket-activate")
    home = Path(os.environ.get("TMPDIR_SHORT", "/tmp")) / f"lsa{os.getpid()}"
    home.mkdir(mode=0o700)
    try:
        env = {"HOME": str(tmp_path), "LOOMD_HOME": str(home), "PATH": os.environ["PATH"]}
        config = load_config(env)
        spec = services.service_spec(config, sys.executable, env, namespaces=True)
        listen = directives(services.render_socket(spec))["ListenStream"]
        assert listen == str(home / "loomd.sock") == str(config.paths.socket)
        notify_path = home / "notify"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(60)
        log = open(home / "daemon.log", "wb")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen(
            [activate, "-l", listen, "-E", f"LOOMD_HOME={home}", "-E", f"NOTIFY_SOCKET={notify_path}",
             "-E", "LOOMD_EMBEDDER=none", "-E", f"PATH={os.environ['PATH']}", sys.executable, "-m", "loomd", "serve"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            deadline = time.monotonic() + 20
            while not Path(listen).exists():
                assert time.monotonic() < deadline and proc.poll() is None, (home / "daemon.log").read_text()
                time.sleep(0.02)
            os.chmod(listen, 0o600)  # what SocketMode=0600 does under systemd
            assert _program(proc.pid).endswith("systemd-socket-activate")  # no daemon process exists yet
            # The shim connects to a socket nobody has accepted on; its connect succeeds (the kernel queues it),
            # systemd-socket-activate execs the daemon, and the shim's ack arrives once the daemon is up.
            shim_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LOOMD_HOME": str(home),
                        "LOOMD_ACK_DEADLINE_MS": "60000"}
            hook = subprocess.run([sys.executable, "-S", "-E", str(SHIM), "--agent", "claude", "Stop"],
                                  input=STOP_PAYLOAD, capture_output=True, env=shim_env, timeout=90)
            assert hook.returncode == 0
            assert _program(proc.pid) == sys.executable
            hook_log = home / "hook.log"
            assert "spooled" not in (hook_log.read_text() if hook_log.exists() else ""), "spooled, not served"
            assert not list((home / "spool").glob("*.msgpack"))
            with Client(listen, timeout=10) as client:
                events = client.call("events", {"limit": 10})["events"]
                status = client.call("status")
            assert [e["session_id"] for e in events] == ["sa-1"], events
            assert status["socket"] == listen
            assert b"READY=1" in notify.recv(4096)
            proc.terminate()
            assert proc.wait(60) == 0
            messages = b""
            notify.settimeout(2)
            try:
                while True:
                    messages += notify.recv(4096)
            except TimeoutError:
                pass
            assert b"STOPPING=1" in messages
            # The socket belongs to the service manager: the daemon must not have unlinked it.
            assert Path(listen).exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            notify.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def fake_tool(bin_dir: Path, name: str, log: Path, stdout: str = "", rc: int = 0) -> None:
    """A recorder standing in for systemctl/launchctl (outside boundaries: no user manager in this container)."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\nprintf '{stdout}'\nexit {rc}\n")
    script.chmod(0o755)


def test_loom_install_systemd_writes_enables_and_uninstall_reverses(tmp_path: Path) -> None:
    user_home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "calls.log"
    user_home.mkdir()
    fake_tool(bin_dir, "systemctl", log)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(user_home)}
    done = subprocess.run([LOOM, "install", "systemd"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    unit_dir = user_home / ".config" / "systemd" / "user"
    service = (unit_dir / services.SERVICE_UNIT).read_text()
    assert f"ExecStart={Path(sys.executable).parent}/" in service and " -m loomd serve" in service
    assert str(user_home / ".local" / "share" / "loomd") in service  # the real data dir is writable
    assert log.read_text().splitlines() == ["systemctl --user daemon-reload",
                                            "systemctl --user enable --now loomd.socket loomd.service"]
    verify(unit_dir)
    again = subprocess.run([LOOM, "install", "systemd"], env=env, capture_output=True, text=True, timeout=120)
    assert f"unchanged {unit_dir / services.SERVICE_UNIT}" in again.stdout
    log.unlink()
    gone = subprocess.run([LOOM, "uninstall", "systemd"], env=env, capture_output=True, text=True, timeout=120)
    assert gone.returncode == 0, gone.stderr
    assert not (unit_dir / services.SERVICE_UNIT).exists() and not (unit_dir / services.SOCKET_UNIT).exists()
    assert log.read_text().splitlines() == ["systemctl --user disable --now loomd.service loomd.socket",
                                            "systemctl --user daemon-reload"]


def test_loom_install_systemd_says_what_failed_when_the_user_manager_is_away(tmp_path: Path) -> None:
    user_home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "calls.log"
    user_home.mkdir()
    fake_tool(bin_dir, "systemctl", log, "Failed to connect to bus: No medium found\\n", rc=1)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(user_home)}
    done = subprocess.run([LOOM, "install", "systemd"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "systemctl --user daemon-reload" in done.stderr and "Failed to connect to bus" in done.stderr
    assert (user_home / ".config" / "systemd" / "user" / services.SERVICE_UNIT).exists()  # written before the failure


def test_a_setting_with_bounds_refuses_a_value_outside_them(tmp_path: Path) -> None:
    """`background_rest_ratio` takes 0 (never rest) to 10, from the environment or the file; anything else (negative,
    inf, NaN, past 10) is refused with its name, as an unreadable value is: inf held background work back for good."""
    env = {"HOME": str(tmp_path), "LOOMD_HOME": str(tmp_path / "h")}
    for good in ("0", "2", "10"):
        assert load_config({**env, "LOOMD_BACKGROUND_REST_RATIO": good}).background_rest_ratio == float(good)
    for bad in ("-1", "inf", "nan", "10.5", "often"):
        with pytest.raises(BadRequest, match="background_rest_ratio"):
            load_config({**env, "LOOMD_BACKGROUND_REST_RATIO": bad})
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.toml").write_text("background_rest_ratio = 50\n")
    with pytest.raises(BadRequest, match="outside 0 to 10"):
        load_config(env)
