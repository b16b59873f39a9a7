"""The hook shim `shims/loom-hook` (a stub importing `shims/loom_hook.py`), run as the agents run it: a real
subprocess, `python -S -E <shim> <Event>`.

The daemon side is played either by nobody (spool path) or by a plain listening AF_UNIX socket in this process
that answers with frames built by the real msgpack library, so the hand-made encoder and decoder in the shim are
checked against msgpack itself.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import msgpack
import pytest

SHIM = Path(__file__).resolve().parents[1] / "shims" / "loom-hook"
MODULE = SHIM.with_name("loom_hook.py")
ARGS_KEYS = ["agent", "event", "raw", "eid", "context", "deadline_ms", "sent_at"]
EID = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}-[0-9a-f]{8}$")
SAMPLE = (
    b'{"session_id":"9140aa","transcript_path":"/home/u/.claude/projects/-x-proj/9140aa.jsonl","cwd":"/x/proj",'
    b'"hook_event_name":"SessionStart","source":"startup"}'
)
# generous: the interpreter's own start on a loaded machine, on top of the deadline under test
MARGIN_S = 1.5


@pytest.fixture(scope="module")
def shim() -> ModuleType:
    """The shim's module (importing it runs nothing), for its encoder, decoder and path rules."""
    loader = importlib.machinery.SourceFileLoader("loom_hook", str(MODULE))
    spec = importlib.util.spec_from_loader("loom_hook", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture
def home() -> Iterator[Path]:  # deliberately not conftest's `home`: these runs get an explicit, clean env
    """A LOOMD_HOME short enough for an AF_UNIX socket path."""
    path = Path(tempfile.mkdtemp(prefix="lh", dir="/tmp"))
    yield path
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def shim_env(home: Path, **extra: str) -> dict[str, str]:
    # a clean environment: the test itself may run inside an agent (CLAUDECODE=1) or with LOOMD_* set
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LOOMD_HOME": str(home)}
    env.update(extra)
    return env


def run(
    home: Path, *argv: str, stdin: bytes = SAMPLE, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[bytes], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-S", "-E", str(SHIM), *argv],
        input=stdin,
        capture_output=True,
        env=env or shim_env(home),
        timeout=30,
    )
    return proc, time.monotonic() - start


def spooled(home: Path, spool: Path | None = None) -> list[tuple[Path, dict]]:
    folder = spool or home / "spool"
    if not folder.is_dir():
        return []
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")], "temporary file left behind"
    out = []
    for path in sorted(folder.glob("*.msgpack")):
        data = path.read_bytes()
        args = msgpack.unpackb(data, raw=False)
        # the shim's encoding is the canonical (smallest) one, exactly what msgpack itself would write
        assert msgpack.packb(args) == data
        out.append((path, args))
    return out


def only_spooled(home: Path) -> dict:
    files = spooled(home)
    assert len(files) == 1, files
    path, args = files[0]
    assert list(args) == ARGS_KEYS
    assert EID.match(args["eid"]) and path.name == args["eid"] + ".msgpack"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert abs(args["sent_at"] - time.time() * 1000) < 60_000
    return args


def assert_quiet(proc: subprocess.CompletedProcess[bytes]) -> None:
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b""


# ---------------------------------------------------------------- daemon absent: the spool


@pytest.mark.parametrize(
    ("event", "context", "deadline"),
    [
        ("SessionStart", True, 150),
        ("UserPromptSubmit", True, 150),
        ("PreToolUse", False, 1000),
        ("PostToolUse", False, 1000),
        ("Stop", False, 1000),
        ("SessionEnd", False, 1000),
    ],
)
def test_daemon_absent_spools_the_args_map(home: Path, event: str, context: bool, deadline: int) -> None:
    proc, _ = run(home, event)
    assert_quiet(proc)
    args = only_spooled(home)
    assert args["agent"] == "auto"
    assert args["event"] == event
    assert args["raw"] == SAMPLE
    assert args["context"] is context
    assert args["deadline_ms"] == deadline


def test_spool_creates_missing_dirs_0700_whatever_the_umask(home: Path) -> None:
    state = home / "a" / "b"
    env = shim_env(home, LOOMD_HOME=str(state))
    proc = subprocess.run(
        ["/bin/sh", "-c", 'umask 0; exec "$0" -S -E "$1" Stop', sys.executable, str(SHIM)],
        input=SAMPLE,
        capture_output=True,
        env=env,
        timeout=30,
    )
    assert_quiet(proc)
    for folder in (home / "a", state, state / "spool"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    [(path, _)] = spooled(home, state / "spool")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_each_invocation_gets_its_own_eid(home: Path) -> None:
    for _ in range(3):
        assert_quiet(run(home, "PostToolUse")[0])
    eids = [args["eid"] for _, args in spooled(home)]
    assert len(set(eids)) == 3


@pytest.mark.parametrize("payload", [b"", b"\x00\xff\xfe not json {{{", bytes(range(256)) * 3, "é✓".encode() * 40])
def test_any_stdin_is_carried_byte_for_byte(home: Path, payload: bytes) -> None:
    proc, _ = run(home, "PostToolUse", stdin=payload)
    assert_quiet(proc)
    assert only_spooled(home)["raw"] == payload


def test_huge_stdin(home: Path) -> None:
    payload = os.urandom(10 * 1024 * 1024)
    proc, _ = run(home, "PostToolUse", stdin=payload)
    assert_quiet(proc)
    assert only_spooled(home)["raw"] == payload


def test_stdin_over_64_mib_is_truncated_but_fully_read(home: Path) -> None:
    payload = b"x" * (64 * 1024 * 1024 + 4096)
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", str(SHIM), "PostToolUse"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=shim_env(home),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(payload)  # raises BrokenPipeError if the shim stopped reading
    proc.stdin.close()
    assert proc.stdout.read() == b""
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0
    raw = only_spooled(home)["raw"]
    assert len(raw) == 64 * 1024 * 1024


def test_stdin_left_open_does_not_hang_the_agent(home: Path, shim: ModuleType) -> None:
    proc = subprocess.Popen([sys.executable, "-S", "-E", str(SHIM), "Stop"], stdin=subprocess.PIPE, env=shim_env(home))
    assert proc.stdin is not None
    proc.stdin.write(b'{"partial":')
    proc.stdin.flush()
    start = time.monotonic()
    try:
        assert proc.wait(timeout=shim.STDIN_BUDGET_S + 5) == 0
    finally:
        proc.stdin.close()
    assert time.monotonic() - start < shim.STDIN_BUDGET_S + MARGIN_S
    assert only_spooled(home)["raw"] == b'{"partial":'


def test_stale_socket_file_is_like_no_daemon(home: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(home / "loomd.sock"))
    stale.close()  # the file stays, nobody listens: ECONNREFUSED
    proc, _ = run(home, "Stop")
    assert_quiet(proc)
    assert only_spooled(home)["event"] == "Stop"


def test_event_over_the_frame_limit_goes_straight_to_the_spool(home: Path) -> None:
    with FakeDaemon(home, reply_ok("should not be seen")) as daemon:
        proc, _ = run(home, "PostToolUse", stdin=b"y" * 5000, env=shim_env(home, LOOMD_MAX_FRAME_BYTES="4096"))
    assert_quiet(proc)
    assert daemon.requests == []
    assert len(only_spooled(home)["raw"]) == 5000


# ---------------------------------------------------------------- spool failures


def test_unwritable_spool_logs_a_line(home: Path) -> None:
    spool = home / "spool"
    if os.geteuid() == 0:
        spool.write_bytes(b"")  # root ignores modes; a file where the folder should be stops it as well
    else:
        spool.mkdir(mode=0o500)
    proc, elapsed = run(home, "Stop")
    assert_quiet(proc)
    assert elapsed < 1.0 + MARGIN_S
    lines = (home / "hook.log").read_text().splitlines()
    assert len(lines) == 1
    assert "event=Stop" in lines[0] and "lost" in lines[0]


def test_state_dir_under_a_regular_file(home: Path) -> None:
    blocker = home / "file"
    blocker.write_bytes(b"")
    proc, elapsed = run(home, "PostToolUse", env=shim_env(home, LOOMD_HOME=str(blocker / "state")))
    assert_quiet(proc)
    assert elapsed < 1.0 + MARGIN_S
    assert proc.stderr == b""
    assert sorted(p.name for p in home.iterdir()) == ["file"]


# ---------------------------------------------------------------- switches and argv


@pytest.mark.parametrize(
    ("argv", "extra", "disabled"),
    [
        (["Stop"], {"LOOMD_HOOK_DISABLE": "1"}, True),
        (["Stop"], {"LOOMD_HOOK_DISABLE": "yes"}, True),
        (["Stop"], {"LOOMD_HOOK_DISABLE": "0"}, False),
        (["Stop"], {"LOOMD_HOOK_DISABLE": ""}, False),
        (["--agent", "claude", "Stop"], {"LOOMD_CLAUDE_HOOK_DISABLE": "1"}, True),
        (["--agent=claude", "Stop"], {"LOOMD_CLAUDE_HOOK_DISABLE": "1"}, True),
        (["Stop"], {"LOOMD_CLAUDE_HOOK_DISABLE": "1", "CLAUDECODE": "1"}, True),
        (["Stop"], {"LOOMD_CLAUDE_HOOK_DISABLE": "1"}, False),
        (["--agent", "codex", "Stop"], {"LOOMD_CLAUDE_HOOK_DISABLE": "1", "CLAUDECODE": "1"}, False),
        (["--agent", "codex", "Stop"], {"LOOMD_CODEX_HOOK_DISABLE": "1"}, True),
        (["Stop"], {"LOOMD_CODEX_HOOK_DISABLE": "1"}, False),
        (["notify", '{"type":"agent-turn-complete"}'], {"LOOMD_CODEX_HOOK_DISABLE": "1"}, True),
    ],
)
def test_disable_switches(home: Path, argv: list[str], extra: dict[str, str], disabled: bool) -> None:
    proc, _ = run(home, *argv, env=shim_env(home, **extra))
    assert_quiet(proc)
    assert len(spooled(home)) == (0 if disabled else 1)
    if disabled:
        assert sorted(home.iterdir()) == []


def test_disabled_still_drains_stdin(home: Path) -> None:
    # an agent writing a payload larger than the pipe buffer must not get EPIPE from a disabled hook
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", str(SHIM), "PostToolUse"],
        stdin=subprocess.PIPE,
        env=shim_env(home, LOOMD_HOOK_DISABLE="1"),
    )
    assert proc.stdin is not None
    proc.stdin.write(b"z" * (4 * 1024 * 1024))
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert spooled(home) == []


@pytest.mark.parametrize(
    ("argv", "agent", "event"),
    [
        (["--agent", "claude", "UserPromptSubmit"], "claude", "UserPromptSubmit"),
        (["--agent=codex", "PreToolUse"], "codex", "PreToolUse"),
        (["--agent", "vim", "PreToolUse"], "auto", "PreToolUse"),
        (["Notification"], "auto", "Notification"),
        (["SubagentStop"], "auto", "SubagentStop"),
        (["PreCompact"], "auto", "PreCompact"),
    ],
)
def test_agent_flag_and_event_name(home: Path, argv: list[str], agent: str, event: str) -> None:
    proc, _ = run(home, *argv, env=shim_env(home, CLAUDECODE="1"))  # CLAUDECODE only matters for disabling
    assert_quiet(proc)
    args = only_spooled(home)
    assert (args["agent"], args["event"]) == (agent, event)


def test_notify_takes_its_payload_from_argv_and_leaves_stdin_alone(home: Path) -> None:
    payload = '{"type":"agent-turn-complete","thread-id":"t1","last-assistant-message":"done ✓"}'
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", str(SHIM), "notify", payload],
        stdin=subprocess.PIPE,  # held open and never written: reading it would hang
        stdout=subprocess.PIPE,
        env=shim_env(home),
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.wait(timeout=10) == 0
    finally:
        proc.stdin.close()
    assert proc.stdout.read() == b""
    proc.stdout.close()
    args = only_spooled(home)
    assert args["raw"] == payload.encode()
    assert (args["event"], args["agent"], args["context"]) == ("notify", "codex", False)


@pytest.mark.parametrize(
    ("argv", "extra", "deadline"),
    [
        (["SessionStart"], {"LOOMD_CONTEXT_DEADLINE_MS": "300"}, 300),
        (["Stop"], {"LOOMD_CONTEXT_DEADLINE_MS": "300"}, 1000),
        (["Stop"], {"LOOMD_ACK_DEADLINE_MS": "2500"}, 2500),
        (["Stop"], {"LOOMD_ACK_DEADLINE_MS": "soon"}, 1000),
        (["--agent", "claude", "SessionStart"], {"LOOMD_CLAUDE_CONTEXT_DEADLINE_MS": "90"}, 90),
        (["--agent", "codex", "SessionStart"], {"LOOMD_CLAUDE_CONTEXT_DEADLINE_MS": "90"}, 150),
        (["SessionStart"], {"LOOMD_CLAUDE_CONTEXT_DEADLINE_MS": "90", "CLAUDECODE": "1"}, 150),
        (
            ["--agent", "codex", "PostToolUse"],
            {"LOOMD_CODEX_ACK_DEADLINE_MS": "400", "LOOMD_ACK_DEADLINE_MS": "700"},
            400,
        ),
        (["--agent", "codex", "PostToolUse"], {"LOOMD_ACK_DEADLINE_MS": "700"}, 700),
    ],
)
def test_deadline_settings(home: Path, argv: list[str], extra: dict[str, str], deadline: int) -> None:
    proc, _ = run(home, *argv, env=shim_env(home, **extra))
    assert_quiet(proc)
    assert only_spooled(home)["deadline_ms"] == deadline


# ---------------------------------------------------------------- a fake daemon on a real socket


def read_frame(conn: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed mid-frame")
            buf += chunk
        return buf

    (size,) = struct.unpack(">I", exact(4))
    return exact(size)


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


Behaviour = Callable[[socket.socket, dict], None]


class FakeDaemon:
    """A listening AF_UNIX socket at <home>/loomd.sock serving one connection with `behaviour`."""

    def __init__(self, home: Path, behaviour: Behaviour) -> None:
        self.path = str(home / "loomd.sock")
        self.behaviour = behaviour
        self.requests: list[dict] = []
        self.raw_frames: list[bytes] = []
        self.errors: list[OSError] = []
        self.release = threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeDaemon:
        self.server.bind(self.path)
        self.server.listen(4)
        self.server.settimeout(0.02)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.close()
        self.thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
                break
            except TimeoutError:
                if self.release.is_set():
                    return
            except OSError:
                return
        with conn:
            conn.settimeout(15)
            try:
                body = read_frame(conn)
                self.raw_frames.append(body)
                self.requests.append(msgpack.unpackb(body, raw=False))
                self.behaviour(conn, self.requests[-1])
            except OSError as exc:  # the shim gave up first; the test's assertions tell the story
                self.errors.append(exc)
            self.release.wait(15)


def reply_ok(stdout: str, **more: object) -> Behaviour:
    def behaviour(conn: socket.socket, request: dict) -> None:
        conn.sendall(
            frame({"v": 1, "id": request["id"], "ok": True, "result": {"stored": 1, "stdout": stdout, **more}})
        )

    return behaviour


def never_reply(conn: socket.socket, request: dict) -> None:
    pass


def test_reply_stdout_is_printed_exactly_and_nothing_spooled(home: Path) -> None:
    text = (
        '{"hookSpecificOutput":{"hookEventName":"SessionStart",'
        '"additionalContext":"[LOOM] reference only\\nD 2026-11-02 use uv, not pip ✓ #41"}}'
    )
    with FakeDaemon(home, reply_ok(text)) as daemon:
        proc, _ = run(home, "--agent", "claude", "SessionStart")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text.encode()
    assert spooled(home) == []
    [request] = daemon.requests
    assert list(request) == ["v", "id", "op", "args"]
    assert (request["v"], request["id"], request["op"]) == (1, 1, "hook")
    args = request["args"]
    assert list(args) == ARGS_KEYS
    assert (args["agent"], args["event"], args["raw"], args["context"]) == ("claude", "SessionStart", SAMPLE, True)
    assert args["deadline_ms"] == 150 and EID.match(args["eid"])
    assert msgpack.packb(request) == daemon.raw_frames[0]


def test_reply_with_every_msgpack_type_is_decoded(home: Path) -> None:
    extras = {
        "nil": None,
        "flags": [True, False],
        "ints": [0, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63, -1, -32, -33, -128, -129, -(2**15) - 1, -(2**63)],
        "f64": 1.25,
        "bin": b"\x00\xff" * 200,
        "long": "x" * 70_000,
        "nested": {"a": [{"b": []}], "empty": {}},
        "wide": {f"k{i}": i for i in range(20)},
        "arr16": list(range(40)),
    }
    text = "ok ✓ " + "y" * 300
    with FakeDaemon(home, reply_ok(text, **extras)):
        proc, _ = run(home, "UserPromptSubmit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text.encode()
    assert spooled(home) == []


@pytest.mark.parametrize("stdout", ["", None, 42])
def test_ok_reply_without_text_prints_nothing(home: Path, stdout: object) -> None:
    with FakeDaemon(home, reply_ok(stdout)):  # type: ignore[arg-type]
        proc, _ = run(home, "SessionStart")
    assert_quiet(proc)
    assert spooled(home) == []


def test_stalled_daemon_spools_within_the_deadline(home: Path) -> None:
    with FakeDaemon(home, never_reply) as daemon:
        proc, elapsed = run(home, "PostToolUse", env=shim_env(home, LOOMD_ACK_DEADLINE_MS="400"))
    assert_quiet(proc)
    assert elapsed < 0.4 + MARGIN_S
    args = only_spooled(home)
    assert args == daemon.requests[0]["args"]  # same eid: the daemon dedupes a late ingest against the spool
    assert daemon.raw_frames[0].endswith((home / "spool" / f"{args['eid']}.msgpack").read_bytes())


def test_stalled_daemon_context_event_uses_the_short_deadline(home: Path) -> None:
    with FakeDaemon(home, never_reply):
        proc, elapsed = run(home, "UserPromptSubmit")
    assert_quiet(proc)
    assert elapsed < 0.15 + MARGIN_S
    assert only_spooled(home)["deadline_ms"] == 150


def test_daemon_that_never_accepts(home: Path) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(home / "loomd.sock"))
    server.listen(1)  # connect() completes through the backlog; nobody reads
    try:
        proc, elapsed = run(home, "SessionStart")
    finally:
        server.close()
    assert_quiet(proc)
    assert elapsed < 0.15 + MARGIN_S
    assert only_spooled(home)["raw"] == SAMPLE


def error_reply(conn: socket.socket, request: dict) -> None:
    conn.sendall(frame({"v": 1, "id": request["id"], "ok": False, "error": {"code": "busy", "message": "full"}}))


def close_at_once(conn: socket.socket, request: dict) -> None:
    conn.shutdown(socket.SHUT_RDWR)


def garbage_reply(conn: socket.socket, request: dict) -> None:
    conn.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")


def wrong_id(conn: socket.socket, request: dict) -> None:
    conn.sendall(frame({"v": 1, "id": 7, "ok": True, "result": {"stored": 1, "stdout": "not mine"}}))


def truncated_reply(conn: socket.socket, request: dict) -> None:
    conn.sendall(frame({"v": 1, "id": 1, "ok": True, "result": {"stdout": "cut"}})[:-2])
    conn.shutdown(socket.SHUT_WR)


def huge_length(conn: socket.socket, request: dict) -> None:
    conn.sendall(struct.pack(">I", 0xFFFFFFF0))


@pytest.mark.parametrize(
    "behaviour", [error_reply, close_at_once, garbage_reply, wrong_id, truncated_reply, huge_length]
)
def test_bad_daemon_answers_spool(home: Path, behaviour: Behaviour) -> None:
    with FakeDaemon(home, behaviour) as daemon:
        proc, _ = run(home, "SessionStart")
    assert_quiet(proc)
    assert only_spooled(home)["eid"] == daemon.requests[0]["args"]["eid"]
    if behaviour is error_reply:
        assert "error reply busy: full" in (home / "hook.log").read_text()


# ---------------------------------------------------------------- the shim's pieces against msgpack and config


@pytest.mark.parametrize("n", [0, 1, 31, 32, 255, 256, 65535, 65536, 70_000])
def test_str_and_bin_boundaries(shim: ModuleType, n: int) -> None:
    assert msgpack.unpackb(shim.pack_str("é" * (n // 2) + "a" * (n % 2)), raw=False) == "é" * (n // 2) + "a" * (n % 2)
    data = os.urandom(n)
    assert msgpack.unpackb(shim.bin_header(n) + data) == data
    assert shim.bin_header(n) + data == msgpack.packb(data)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1])
def test_uint_boundaries(shim: ModuleType, n: int) -> None:
    assert shim.pack_uint(n) == msgpack.packb(n)


def test_args_map_is_msgpack(shim: ModuleType) -> None:
    packed = shim.pack_args("codex", "Stop", b"\x00raw", "e1", False, 1000, 1_795_000_000_000)
    assert msgpack.unpackb(packed, raw=False) == {
        "agent": "codex",
        "event": "Stop",
        "raw": b"\x00raw",
        "eid": "e1",
        "context": False,
        "deadline_ms": 1000,
        "sent_at": 1_795_000_000_000,
    }


@pytest.mark.parametrize(
    "obj",
    [
        None,
        True,
        False,
        0,
        -1,
        -33,
        2**64 - 1,
        -(2**63),
        1.5,
        "",
        "s" * 40,
        "t" * 300,
        b"",
        b"\x01" * 300,
        [],
        list(range(20)),
        {},
        {"a": {"b": [1, None, "c"]}},
        {f"k{i}": i for i in range(17)},
    ],
)
def test_decoder_matches_msgpack(shim: ModuleType, obj: object) -> None:
    packed = msgpack.packb(obj)
    assert shim.unpack(packed) == (obj, len(packed))


def test_decoder_float32_and_truncation(shim: ModuleType) -> None:
    assert shim.unpack(msgpack.packb(0.5, use_single_float=True))[0] == 0.5
    with pytest.raises(ValueError):
        shim.unpack(msgpack.packb({"stdout": "abc"})[:-1])
    with pytest.raises(ValueError):
        shim.unpack(b"\xc1")


@pytest.mark.parametrize(
    "env",
    [
        {"HOME": "/home/u", "LOOMD_HOME": "/srv/loom"},
        {"HOME": "/home/u", "LOOMD_HOME": "/srv/loom/"},
        {"HOME": "/home/u", "LOOMD_HOME": "~/loom"},
        {"HOME": "/home/u", "LOOMD_HOME": "~"},
        {"HOME": "/home/u", "LOOMD_HOME": "rel/dir"},
        {"HOME": "/home/u"},
        {"HOME": "/home/u/"},
        {"HOME": "/home/u", "XDG_RUNTIME_DIR": "/run/user/1000"},
        {"HOME": "/home/u", "XDG_STATE_HOME": "/st", "XDG_RUNTIME_DIR": ""},
        {"HOME": "/home/u", "XDG_STATE_HOME": "/st", "XDG_RUNTIME_DIR": "/run/user/1000/"},
        {"HOME": "/home/u", "LOOMD_HOME": "", "XDG_STATE_HOME": "/st"},
    ],
)
def test_paths_match_the_daemon(shim: ModuleType, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from loomd.config import resolve_paths

    monkeypatch.setenv("HOME", env["HOME"])  # Path.expanduser() reads the process environment
    paths = resolve_paths(env)
    sock, state = shim.resolve({k.encode(): v.encode() for k, v in env.items()})
    assert Path(sock.decode()) == paths.socket
    assert Path(state.decode()) == paths.state_dir
    assert Path(state.decode()) / "spool" == paths.spool


# ---------------------------------------------------------------- the real daemon


class RealDaemon:
    """`python -m loomd serve` on a private LOOMD_HOME, as a child process."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RealDaemon:
        from loomd.client import Client

        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
        env["LOOMD_HOME"] = str(self.home)
        env.setdefault("LOOMD_EMBEDDER", os.environ.get("LOOMD_TEST_EMBEDDER", "local"))
        with open(self.home / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "loomd", "serve"], env=env, stdout=log, stderr=log, cwd=SHIM.parents[1]
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log()}")
            try:
                with Client(self.home / "loomd.sock", timeout=2) as c:
                    c.call("ping")
                return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        self.__exit__()  # `with` does not call __exit__ when __enter__ raises
        raise TimeoutError(f"daemon did not come up: {self.log()}")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        return (self.home / "daemon.log").read_text(errors="replace")[-2000:]

    def call(self, op: str, **args: object) -> dict:
        from loomd.client import Client

        with Client(self.home / "loomd.sock", timeout=10) as c:
            return c.call(op, args)

    def events(self, session_id: str) -> list[dict]:
        return self.call("events", session_id=session_id, limit=100)["events"]


def payload(event: str, session_id: str, cwd: Path, **more: object) -> bytes:
    body = {"session_id": session_id, "transcript_path": f"{cwd}/{session_id}.jsonl", "cwd": str(cwd),
            "hook_event_name": event, **more}  # fmt: skip
    return json.dumps(body).encode()


def wait_for(predicate: Callable[[], object], within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_real_daemon_acks_every_event_kind(home: Path) -> None:
    sid = "sess-" + os.urandom(4).hex()
    sent = [
        ("SessionStart", {"source": "startup"}),
        ("UserPromptSubmit", {"prompt": "why does the fixture leak sockets?"}),
        ("PreToolUse", {"tool_name": "Bash", "tool_input": {"command": "ls"}, "tool_use_id": "toolu_1"}),
        ("PostToolUse", {"tool_name": "Bash", "tool_input": {"command": "ls"}, "tool_use_id": "toolu_1",
                         "tool_response": {"stdout": "a\nb\n", "stderr": ""}}),
        ("Stop", {"stop_hook_active": False, "last_assistant_message": "done"}),
        ("SessionEnd", {"reason": "other"}),
    ]  # fmt: skip
    with RealDaemon(home) as daemon:
        for event, more in sent:
            proc, _ = run(home, "--agent", "claude", event, stdin=payload(event, sid, home, **more))
            assert proc.returncode == 0, proc.stderr
            if proc.stdout:  # only context events may inject, as the documented JSON the daemon builds
                assert event in ("SessionStart", "UserPromptSubmit")
                assert json.loads(proc.stdout)["hookSpecificOutput"]["hookEventName"] == event
        assert spooled(home) == [], (home / "hook.log").read_text() if (home / "hook.log").exists() else ""
        kinds = [e["kind"] for e in daemon.events(sid)]
    assert kinds == [event for event, _ in sent]


def test_real_daemon_takes_codex_notify(home: Path) -> None:
    thread = os.urandom(4).hex()
    note = {"type": "agent-turn-complete", "thread-id": f"thr-{thread}", "turn-id": "t1", "cwd": "/x",
            "last-assistant-message": "ok"}  # fmt: skip
    with RealDaemon(home) as daemon:
        proc, _ = run(home, "notify", json.dumps(note))
        assert_quiet(proc)
        assert spooled(home) == []
        [event] = daemon.events(f"thr-{thread}")
    assert (event["agent"], event["kind"]) == ("codex", "TurnComplete")


def test_spool_is_replayed_once_when_the_daemon_starts(home: Path) -> None:
    sid = "sess-" + os.urandom(4).hex()
    proc, _ = run(home, "Stop", stdin=payload("Stop", sid, home, stop_hook_active=False))
    assert_quiet(proc)
    [(path, args)] = spooled(home)
    copy = path.read_bytes()
    with RealDaemon(home) as daemon:
        wait_for(lambda: not path.exists())
        assert [e["kind"] for e in daemon.events(sid)] == ["Stop"]
        # the same eid again (a shim that timed out after the daemon had committed): stored once
        path.write_bytes(copy)
        wait_for(lambda: not path.exists())
        assert len(daemon.events(sid)) == 1


def test_real_daemon_rejecting_garbage_costs_the_agent_nothing(home: Path) -> None:
    with RealDaemon(home):
        proc, _ = run(home, "PostToolUse", stdin=b"\xff not json")
        assert_quiet(proc)
    assert "bad_request" in (home / "hook.log").read_text()


# ---------------------------------------------------------------- the stub and its cached module


def shim_copy(tmp: Path) -> Path:
    """The stub and its module copied to a fresh folder (no __pycache__ yet); returns the stub."""
    folder = tmp / "shims"
    folder.mkdir()
    for source in (SHIM, MODULE):
        shutil.copy2(source, folder / source.name)
    return folder / SHIM.name


def run_stub(home: Path, stub: Path, *flags: str, python: str = sys.executable) -> subprocess.CompletedProcess[bytes]:
    argv = [python, "-S", "-E", *flags, str(stub), "Stop"]
    return subprocess.run(argv, input=SAMPLE, capture_output=True, env=shim_env(home), timeout=30)


def test_stub_loads_the_module_from_cached_bytecode(home: Path, tmp_path: Path) -> None:
    stub = shim_copy(tmp_path)
    assert_quiet(run_stub(home, stub))
    cache = stub.parent / "__pycache__"
    tag = sys.implementation.cache_tag
    assert [p.name for p in cache.iterdir()] == [f"loom_hook.{tag}.pyc"]
    before = (cache / f"loom_hook.{tag}.pyc").stat().st_mtime_ns
    assert_quiet(run_stub(home, stub))
    assert (cache / f"loom_hook.{tag}.pyc").stat().st_mtime_ns == before  # reused, not rewritten
    assert len(spooled(home)) == 2
    assert len(SHIM.read_bytes()) < 1024  # what is compiled on every run stays tiny


def test_stub_works_when_the_bytecode_cache_cannot_be_written(home: Path, tmp_path: Path) -> None:
    stub = shim_copy(tmp_path)
    (stub.parent / "__pycache__").write_bytes(b"")  # a file where the folder should be: even root cannot write it
    for _ in range(2):
        assert_quiet(run_stub(home, stub))
    assert len(spooled(home)) == 2


def test_stub_finds_its_module_in_isolated_mode(home: Path, tmp_path: Path) -> None:
    stub = shim_copy(tmp_path)
    assert_quiet(run_stub(home, stub, "-I"))  # -I leaves the script's folder off sys.path
    assert only_spooled(home)["event"] == "Stop"


def test_stub_without_its_module_exits_0_quietly(home: Path, tmp_path: Path) -> None:
    stub = shim_copy(tmp_path)
    (stub.parent / MODULE.name).unlink()
    proc = run_stub(home, stub)
    assert_quiet(proc)
    assert proc.stderr == b""


def test_module_stays_importable_by_python_3_9(shim: ModuleType) -> None:
    """A plain plugin install may run the shim with any `python3` on PATH (macOS ships 3.9): annotations are
    evaluated when a function is defined, so a PEP 604 union must be quoted there, and zip() takes no strict=."""
    import ast

    tree = ast.parse(MODULE.read_text(), feature_version=(3, 9))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            annotations = [a.annotation for a in [*node.args.args, *node.args.kwonlyargs] if a.annotation]
            for annotation in [*annotations, node.returns]:
                unions = [n for n in ast.walk(annotation) if isinstance(n, ast.BinOp)] if annotation else []
                assert not unions, f"{node.name}: quote the annotation {ast.unparse(annotation)!r}"
        if isinstance(node, ast.Call):
            assert not any(k.arg == "strict" for k in node.keywords), "zip(strict=...) needs Python 3.10"


# ---------------------------------------------------------------- trust: another user's socket, log, daemon text


NOBODY = 65534
SECRET = "sk-ant-api03-" + "Qx7" * 30 + "AA"  # what a hijacker wants: a key in a hook payload


def listener_of_nobody(path: Path, bind_as_root: bool) -> tuple[int, int]:
    """A forked child listening at `path` as uid nobody, writing b"C" per connection and every byte it receives to
    a pipe; (pid, read end). With `bind_as_root` the file is bound by root (so it is root's) before the child drops
    to nobody and listens: only the listener's credentials (SO_PEERCRED) then say who is there."""
    read_end, write_end = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user
        try:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if bind_as_root:
                server.bind(str(path))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if not bind_as_root:
                server.bind(str(path))
            server.listen(8)
            server.settimeout(0.1)
            os.write(ready_w, b"ready")
            while True:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                os.write(write_end, b"C")
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(1 << 16):
                        os.write(write_end, chunk)
                except OSError:
                    pass  # the shim hung up: what it sent is in the pipe already
                conn.close()
        finally:
            os._exit(0)
    os.close(write_end)
    os.close(ready_w)
    assert os.read(ready_r, 5) == b"ready"
    os.close(ready_r)
    return pid, read_end


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.parametrize("bind_as_root", [False, True], ids=["socket-file-of-nobody", "listener-of-nobody"])
def test_no_frame_reaches_a_listener_of_another_user(home: Path, bind_as_root: bool) -> None:
    """In a LOOMD_HOME others may write, `nobody` replaced loomd.sock with its own listener and received the raw,
    unredacted hook frames. Now the shim sends nothing to a socket file that is not its user's, nor to a listener of
    another uid (SO_PEERCRED): the event goes to the spool, and hook.log says why."""
    os.chmod(home, 0o777)
    payload = json.dumps({"session_id": "s", "hook_event_name": "UserPromptSubmit", "prompt": f"key {SECRET}"})
    pid, heard = listener_of_nobody(home / "loomd.sock", bind_as_root)
    try:
        proc, _ = run(home, "UserPromptSubmit", stdin=payload.encode())
        time.sleep(0.3)  # let the listener pass on whatever it got
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    received = b""
    while chunk := os.read(heard, 1 << 20):
        received += chunk
    os.close(heard)
    assert_quiet(proc)
    assert SECRET.encode() not in received and received in (b"", b"C"), received[:200]
    assert only_spooled(home)["raw"] == payload.encode()
    [line] = (home / "hook.log").read_text().splitlines()
    assert "refused" in line and f"uid {NOBODY}" in line and "spooled" in line, line


def error_saying(message: str) -> Behaviour:
    def behaviour(conn: socket.socket, request: dict) -> None:
        conn.sendall(frame({"v": 1, "id": request["id"], "ok": False, "error": {"code": "busy", "message": message}}))

    return behaviour


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_hook_log_is_never_written_through_a_symlink_nor_with_raw_daemon_text(home: Path, tmp_path: Path) -> None:
    """`nobody` planted hook.log as a symlink to a file of the victim's, and a daemon's error text `$(…)` was
    appended there as it came: sourcing the file ran it. Now the shim writes hook.log only as a regular file of its
    own user (O_NOFOLLOW, fstat) and escapes outside text, so the log holds one inert line per event."""
    os.chmod(home, 0o777)
    victim = tmp_path / "victim.rc"
    victim.write_text("# the victim's shell file\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    hostile = f"$(touch {scratch}/pwned1)\n`touch {scratch}/pwned2`; touch {scratch}/pwned3 #'\"\x1b[2J"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user plants the link
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.symlink(victim, home / "hook.log")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (home / "hook.log").is_symlink()
    with FakeDaemon(home, error_saying(hostile)):
        proc, _ = run(home, "Stop")
    assert_quiet(proc)
    assert victim.read_text() == "# the victim's shell file\n"
    (home / "hook.log").unlink()
    (home / "loomd.sock").unlink()  # the fake daemon's socket file stays after it closes
    with FakeDaemon(home, error_saying(hostile)):
        proc, _ = run(home, "Stop")
    assert_quiet(proc)
    log = (home / "hook.log").read_text()
    [line] = log.splitlines()
    assert "error reply busy: " in line and "touch" in line, line
    assert not set("$`;'\"\x1b") & set(line.split("error reply busy: ", 1)[1]), line
    subprocess.run(["sh", str(home / "hook.log")], cwd=scratch, capture_output=True, timeout=30)
    assert list(scratch.iterdir()) == []


def test_a_fifo_planted_as_hook_log_does_not_hold_the_hook(home: Path) -> None:
    """Opening a FIFO for writing waits for a reader: the log is opened O_NONBLOCK, so the hook does not hang."""
    os.mkfifo(home / "hook.log", 0o600)
    with FakeDaemon(home, error_reply):
        proc, elapsed = run(home, "Stop")
    assert_quiet(proc)
    assert elapsed < 1.0 + MARGIN_S, elapsed
    assert len(spooled(home)) == 1


def test_hook_log_records_refused_connections_and_timeouts(home: Path) -> None:
    """A stale socket (nobody listening) and a daemon that never answers used to leave no trace in hook.log; now
    each is one line, and the event is spooled."""
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(home / "loomd.sock"))
    stale.close()
    proc, _ = run(home, "Stop")
    assert_quiet(proc)
    (home / "loomd.sock").unlink()
    with FakeDaemon(home, never_reply):
        proc, _ = run(home, "PostToolUse", env=shim_env(home, LOOMD_ACK_DEADLINE_MS="300"))
    assert_quiet(proc)
    refused, timed_out = (home / "hook.log").read_text().splitlines()
    assert "event=Stop" in refused and "connection refused" in refused and "spooled" in refused, refused
    assert "event=PostToolUse" in timed_out and "timed out after 300 ms" in timed_out, timed_out
    assert len(spooled(home)) == 2
