"""loom_hook: hand one agent hook event to loomd, or spool it when the daemon is down. Always exits 0.

The agents run the stub next to this file, `<abs python> -S -E <dir>/loom-hook [--agent claude|codex] <Event>`
(payload on stdin), or `... loom-hook notify '<json>'` for Codex `notify` (payload in argv). The stub only imports
this module, so the interpreter loads cached bytecode instead of compiling the whole shim on every event. It sits on
the agent's critical path, so it imports only builtin modules plus the small `_socket` extension (`socket`, `os`
and `json` each cost milliseconds), parses nothing, and never imports loomd. Any Python from 3.9 on runs it (a
plain plugin install may run it with whatever `python3` is first on PATH): no `X | Y` outside quoted annotations.
Wire format: design README §4 (4-byte big-endian length, one msgpack map), hand-encoded here. Path rules repeat
loomd/config.py::resolve_paths; keep both in step.

It trusts nothing another user could have placed (a shared or loose LOOMD_HOME): no frame goes to a socket that is
not a socket of this user, nor to a listener of another uid (SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS where
Python offers it); the event is spooled instead. hook.log is only appended to as a regular file of this user (never
through a symlink), and text from outside (the daemon's replies, errors) is written escaped: it cannot add a line or
do anything when the log is read by a shell.
"""

import _signal
import _socket
import posix
import sys
import time

CONTEXT_EVENTS = ("SessionStart", "UserPromptSubmit")
MAX_STDIN = 64 << 20  # keep at most this much of the payload; the daemon truncates further
STDIN_BUDGET_S = 3.0  # agents write the payload and close stdin; never wait longer than this for EOF
MAX_REPLY = 16 << 20
DEFAULT_MAX_FRAME = 8 << 20  # the daemon's max_frame_bytes; a larger event goes straight to the spool
WATCHDOG_MARGIN_S = 2.0  # after the deadline, time left for spooling before the process just exits 0 ...
WATCHDOG_BYTES_PER_S = 20e6  # ... plus time to write a large payload to a slow disk
LOG_MAX = 1 << 20  # stop appending to hook.log past this size
LINE_MAX = 600  # one hook.log line, at most
SHOWN_MAX = 200  # one piece of outside text in it, at most
S_IFMT, S_IFDIR, S_IFREG, S_IFSOCK = 0o170000, 0o040000, 0o100000, 0o140000


class _Late(Exception):
    """stdin stayed open past STDIN_BUDGET_S."""


class _Failed(Exception):
    """The daemon did not take the event: error reply, bad reply, or closed connection."""


class _Refused(Exception):
    """The socket, or who listens on it, is not this user's: no frame is sent."""


# ---------------------------------------------------------------- environment and paths


def env(name: bytes) -> bytes:
    return posix.environ.get(name, b"")


def flag(name: bytes) -> bool:
    value = env(name)
    return bool(value) and value != b"0"


def _home(environ: dict) -> bytes:
    home = environ.get(b"HOME")
    if home is None:
        import pwd  # builtin; only reached when HOME is unset

        return pwd.getpwuid(posix.getuid()).pw_dir.encode(sys.getfilesystemencoding(), "surrogateescape")
    return home.rstrip(b"/") or b"/"


def _expanduser(path: bytes, environ: dict) -> bytes:
    if not path.startswith(b"~"):
        return path
    name, sep, rest = path[1:].partition(b"/")
    try:
        if name:
            import pwd

            home = pwd.getpwnam(name.decode(sys.getfilesystemencoding(), "surrogateescape")).pw_dir
            home = home.encode(sys.getfilesystemencoding(), "surrogateescape").rstrip(b"/") or b"/"
        else:
            home = _home(environ)
    except KeyError:
        return path
    return home + sep + rest if home != b"/" else b"/" + rest


def _dir(path: bytes) -> bytes:
    return path.rstrip(b"/") or b"/"


def resolve(environ: dict) -> tuple[bytes, bytes]:
    """(socket path, state dir) as bytes, from a bytes-keyed environment; mirrors resolve_paths()."""
    if environ.get(b"LOOMD_HOME"):
        home = _dir(_expanduser(environ[b"LOOMD_HOME"], environ))
        return _join(home, b"loomd.sock"), home
    state_base = environ.get(b"XDG_STATE_HOME") or _join(_home(environ), b".local/state")
    state = _join(_dir(state_base), b"loomd")
    runtime = _join(_dir(environ[b"XDG_RUNTIME_DIR"]), b"loomd") if environ.get(b"XDG_RUNTIME_DIR") else state
    return _join(runtime, b"loomd.sock"), state


def ignored_file(environ: dict) -> bytes:
    """`<data dir>/ignored-projects` (loomd/ignore.py); mirrors resolve_paths()'s data dir."""
    if environ.get(b"LOOMD_HOME"):
        return _join(_dir(_expanduser(environ[b"LOOMD_HOME"], environ)), b"ignored-projects")
    data_base = environ.get(b"XDG_DATA_HOME") or _join(_home(environ), b".local/share")
    return _join(_join(_dir(data_base), b"loomd"), b"ignored-projects")


def payload_cwd(raw: bytes) -> bytes:
    """The payload's "cwd" when it is a plain JSON string (no escapes), else the process's own directory."""
    at = raw.find(b'"cwd"')
    if at >= 0:
        start = raw.find(b'"', raw.find(b":", at + 5) + 1) + 1
        end = raw.find(b'"', start)
        if 0 < start <= end and b"\\" not in raw[start:end]:
            return raw[start:end]
    return posix.getcwd().encode(sys.getfilesystemencoding(), "surrogateescape")


def ignored(environ: dict, raw: bytes) -> bool:
    """Whether the event comes from a folder the user keeps out of memory (`loom project ignore`)."""
    try:
        # O_NONBLOCK: a FIFO planted there must not hold the hook; O_NOFOLLOW: nor a symlink lead elsewhere.
        fd = posix.open(ignored_file(environ), posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_NONBLOCK)
    except OSError:
        return False  # no list (the common case): one failed open
    try:
        data = posix.read(fd, 1 << 20)
    finally:
        posix.close(fd)
    roots = [line.strip().rstrip(b"/") for line in data.splitlines() if line.startswith(b"/")]
    if not roots:
        return False
    cwd = payload_cwd(raw).rstrip(b"/") or b"/"
    return any(cwd == root or cwd.startswith(root + b"/") for root in roots)


def _join(base: bytes, name: bytes) -> bytes:
    return base + name if base.endswith(b"/") else base + b"/" + name


def deadline_ms(context: bool, agent: str) -> int:
    kind = b"CONTEXT" if context else b"ACK"
    names = [b"LOOMD_" + kind + b"_DEADLINE_MS"]
    if agent in ("claude", "codex"):
        names.insert(0, b"LOOMD_" + agent.upper().encode() + b"_" + kind + b"_DEADLINE_MS")
    for name in names:
        try:
            return min(max(int(env(name)), 1), 600_000)
        except ValueError:
            continue
    return 150 if context else 1000


# ---------------------------------------------------------------- msgpack, by hand


def pack_uint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    for tag, width in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
        if n < 1 << (8 * width):
            return bytes((tag,)) + n.to_bytes(width, "big")
    raise ValueError("uint too large")


def pack_str(s: str) -> bytes:
    b = s.encode("utf-8", "replace")
    n = len(b)
    if n < 32:
        return bytes((0xA0 | n,)) + b
    if n < 0x100:
        return b"\xd9" + bytes((n,)) + b
    if n < 0x10000:
        return b"\xda" + n.to_bytes(2, "big") + b
    return b"\xdb" + n.to_bytes(4, "big") + b


def bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + bytes((n,))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def map_header(n: int) -> bytes:
    return bytes((0x80 | n,)) if n < 16 else b"\xde" + n.to_bytes(2, "big")


def pack_args(agent: str, event: str, raw: bytes, eid: str, context: bool, deadline: int, sent_at: int) -> bytes:
    """The `args` map of a hook request: the exact bytes sent and, on failure, spooled."""
    return b"".join((
        map_header(7),
        pack_str("agent"), pack_str(agent),
        pack_str("event"), pack_str(event),
        pack_str("raw"), bin_header(len(raw)), raw,
        pack_str("eid"), pack_str(eid),
        pack_str("context"), b"\xc3" if context else b"\xc2",
        pack_str("deadline_ms"), pack_uint(deadline),
        pack_str("sent_at"), pack_uint(sent_at),
    ))  # fmt: skip


REQUEST_HEAD = map_header(4) + pack_str("v") + b"\x01" + pack_str("id") + b"\x01" + pack_str("op") + pack_str("hook")
REQUEST_HEAD += pack_str("args")

_INT = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
        0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}  # fmt: skip
_SIZED = {0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xD9: ("str", 1), 0xDA: ("str", 2),
          0xDB: ("str", 4), 0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}  # fmt: skip


def _take(buf: bytes, i: int, n: int) -> bytes:
    if i + n > len(buf):
        raise ValueError("truncated msgpack")
    return buf[i : i + n]


def unpack(buf: bytes, i: int = 0) -> tuple[object, int]:
    """Decode the msgpack object at buf[i] (nil, bool, int, float, str, bin, array, map); return it and the next i."""
    t = _take(buf, i, 1)[0]
    i += 1
    if t < 0x80:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if t in _INT:
        width, signed = _INT[t]
        return int.from_bytes(_take(buf, i, width), "big", signed=signed), i + width
    if t == 0xC0:
        return None, i
    if t in (0xC2, 0xC3):
        return t == 0xC3, i
    if t in (0xCA, 0xCB):
        import _struct  # builtin-cheap, and only when a reply carries a float

        width = 4 if t == 0xCA else 8
        return _struct.unpack(">f" if width == 4 else ">d", _take(buf, i, width))[0], i + width
    if t < 0x90:
        kind, n = "map", t & 0x0F
    elif t < 0xA0:
        kind, n = "array", t & 0x0F
    elif t < 0xC0:
        kind, n = "str", t & 0x1F
    elif t in _SIZED:
        kind, width = _SIZED[t]
        n = int.from_bytes(_take(buf, i, width), "big")
        i += width
    else:
        raise ValueError(f"unsupported msgpack type 0x{t:02x}")
    if kind == "str":
        return _take(buf, i, n).decode("utf-8"), i + n
    if kind == "bin":
        return _take(buf, i, n), i + n
    items = []
    for _ in range(2 * n if kind == "map" else n):
        item, i = unpack(buf, i)
        items.append(item)
    if kind == "map":  # no zip(strict=): Python 3.9 runs this too
        return {items[k]: items[k + 1] for k in range(0, len(items), 2)}, i
    return items, i


# ---------------------------------------------------------------- stdin


_watch = [False]


def _on_alarm(signum: int, frame: object) -> None:
    if _watch[0]:
        raise _Late


def read_stdin(keep: bool) -> bytes:
    """Read stdin to EOF (at most MAX_STDIN kept), so the agent never hits EPIPE; give up after STDIN_BUDGET_S."""
    chunks: list[bytes] = []
    size = 0
    try:
        if posix.isatty(0):
            return b""
        _signal.signal(_signal.SIGALRM, _on_alarm)
        _watch[0] = True
        _signal.setitimer(_signal.ITIMER_REAL, STDIN_BUDGET_S)
        try:
            while True:
                chunk = posix.read(0, 1 << 20)
                if not chunk:
                    break
                if keep and size < MAX_STDIN:
                    chunk = chunk[: MAX_STDIN - size]
                    chunks.append(chunk)
                    size += len(chunk)
        finally:
            _watch[0] = False
            _signal.setitimer(_signal.ITIMER_REAL, 0)
    except (_Late, OSError):
        pass  # keep what arrived; a closed or odd stdin is an empty payload
    return b"".join(chunks)


# ---------------------------------------------------------------- daemon


def _recv_exact(sock: _socket.socket, n: int, deadline: float) -> bytes:
    parts = []
    while n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        sock.settimeout(left)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise _Failed("connection closed")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def check_socket_file(sock_path: bytes) -> None:
    """Raise _Refused unless the path is a socket (not a symlink) of this user. A missing one raises OSError."""
    st = posix.lstat(sock_path)
    if st.st_mode & S_IFMT != S_IFSOCK:
        raise _Refused("not a socket" if st.st_mode & S_IFMT != 0o120000 else "a symlink")
    if st.st_uid != posix.geteuid():
        raise _Refused(f"owned by uid {st.st_uid}, not {posix.geteuid()}")


def peer_uid(sock: _socket.socket) -> "int | None":
    """The uid of the process listening at the other end, where the platform tells it; None where it does not."""
    try:
        if hasattr(_socket, "SO_PEERCRED"):  # Linux: struct ucred {pid_t pid; uid_t uid; gid_t gid}
            cred = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
            return int.from_bytes(cred[4:8], sys.byteorder)
        if hasattr(_socket, "LOCAL_PEERCRED"):  # macOS: struct xucred {u_int version; uid_t uid; ...} at SOL_LOCAL 0
            cred = sock.getsockopt(0, _socket.LOCAL_PEERCRED, 76)
            if len(cred) >= 8 and int.from_bytes(cred[0:4], sys.byteorder) == 0:
                return int.from_bytes(cred[4:8], sys.byteorder)
    except OSError:
        pass  # no peer credentials on this platform: the socket file's owner check stands alone
    return None


def call(sock_path: bytes, args: bytes, deadline: float) -> str:
    """Send one hook request, wait for the reply until `deadline` (monotonic). Returns result.stdout or ""."""
    body_len = len(REQUEST_HEAD) + len(args)
    check_socket_file(sock_path)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(sock_path)
        uid = peer_uid(sock)  # the file checked above may have been swapped since: ask who really listens
        if uid is not None and uid != posix.geteuid():
            raise _Refused(f"the listener runs as uid {uid}, not {posix.geteuid()}")
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(body_len.to_bytes(4, "big") + REQUEST_HEAD)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(args)
        size = int.from_bytes(_recv_exact(sock, 4, deadline), "big")
        if size > MAX_REPLY:
            raise _Failed(f"reply of {size} bytes")
        reply, _ = unpack(_recv_exact(sock, size, deadline))
    finally:
        sock.close()
    if not isinstance(reply, dict) or reply.get("id") != 1:
        raise _Failed("malformed reply")
    if reply.get("ok") is not True:
        error = reply.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise _Failed(f"error reply {shown(code)}: {shown(message)}")
    result = reply.get("result")
    out = result.get("stdout") if isinstance(result, dict) else None
    return out if isinstance(out, str) else ""


# ---------------------------------------------------------------- spool and log


def _is_dir(path: bytes) -> bool:
    try:
        return posix.stat(path).st_mode & 0o170000 == 0o040000
    except OSError:
        return False


def makedirs(path: bytes) -> None:
    """mkdir -p with mode 0700 for every directory created (umask-independent)."""
    try:
        posix.mkdir(path, 0o700)
    except FileExistsError:
        if not _is_dir(path):
            raise
        return
    except FileNotFoundError:
        parent = path.rstrip(b"/").rpartition(b"/")[0]
        if not parent or parent == path:
            raise
        makedirs(parent)
        try:
            posix.mkdir(path, 0o700)
        except FileExistsError:
            if not _is_dir(path):
                raise
            return
    posix.chmod(path, 0o700)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[posix.write(fd, view) :]


def spool(state: bytes, eid: str, args: bytes) -> None:
    """Write the args map to <state>/spool/<eid>.msgpack atomically (tmp file, fsync, rename), mode 0600."""
    folder = _join(state, b"spool")
    makedirs(folder)
    st = posix.lstat(folder)
    if st.st_mode & S_IFMT != S_IFDIR or st.st_uid != posix.geteuid():
        raise PermissionError(f"the spool folder is a symlink or belongs to uid {st.st_uid}, not to this user")
    tmp = _join(folder, b".tmp-" + eid.encode())
    fd = posix.open(tmp, posix.O_WRONLY | posix.O_CREAT | posix.O_EXCL | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
    try:
        posix.fchmod(fd, 0o600)
        _write_all(fd, args)
        posix.fsync(fd)
    except BaseException:
        posix.close(fd)
        posix.unlink(tmp)
        raise
    posix.close(fd)
    posix.rename(tmp, _join(folder, eid.encode() + b".msgpack"))
    try:  # make the rename itself durable
        dfd = posix.open(folder, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_CLOEXEC)
        try:
            posix.fsync(dfd)
        finally:
            posix.close(dfd)
    except OSError:
        pass  # the folder's fsync is best effort: the file itself was fsynced


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:/=+@%")


def shown(value: object) -> str:
    """Outside text (a reply, an error) made inert for hook.log: every character but letters, digits, spaces and
    `_-.,:/=+@%` as a \\x/\\u escape (no quote, `$`, backtick, bracket or control character gets through), cut."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > SHOWN_MAX
    out = "".join(c if c in _SAFE else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                  if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in text[:SHOWN_MAX])
    return out + "..." if cut else out


def described(exc: BaseException) -> str:
    return type(exc).__name__ + (": " + shown(str(exc)) if str(exc) else "")


def log(state: "bytes | None", line: str) -> None:
    """Append one line to <state>/hook.log if at all possible; never raises.

    Only to a regular file of this user with one link, opened without following a symlink and without blocking (a
    FIFO planted there): a log another user set up is not written at all. Callers pass outside text through shown().
    """
    try:
        if state is None:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        text = f"{stamp} loom-hook[{posix.getpid()}] {line}"[:LINE_MAX]
        text = "".join(c if c >= " " and c != "\x7f" else " " for c in text) + "\n"
        flags = posix.O_WRONLY | posix.O_APPEND | posix.O_CREAT | posix.O_CLOEXEC | posix.O_NOFOLLOW | posix.O_NONBLOCK
        fd = posix.open(_join(state, b"hook.log"), flags, 0o600)
        try:
            st = posix.fstat(fd)
            if st.st_mode & S_IFMT == S_IFREG and st.st_uid == posix.geteuid() and st.st_nlink == 1 \
                    and st.st_size < LOG_MAX:
                _write_all(fd, text.encode("utf-8", "replace"))
        finally:
            posix.close(fd)
    except BaseException:
        pass  # the log is best effort: it must never cost the hook its exit 0


# ---------------------------------------------------------------- main


def parse_argv(argv: "list[str]") -> "tuple[str, str, bytes | None]":
    """(agent or "", event, notify payload or None)."""
    agent = ""
    rest = argv[1:]
    while rest and rest[0].startswith("--agent"):
        opt = rest.pop(0)
        value = opt.partition("=")[2] if "=" in opt else (rest.pop(0) if rest else "")
        agent = value if value in ("claude", "codex") else ""
    event = rest[0] if rest else ""
    if event != "notify":
        return agent, event, None
    payload = rest[1] if len(rest) > 1 else ""
    return agent or "codex", event, payload.encode(sys.getfilesystemencoding(), "surrogateescape")


def failure(exc: BaseException, sock_path: bytes, budget_ms: int) -> str:
    """What hook.log says about a send that failed; "" when the daemon is simply not running (no socket file)."""
    where = shown(sock_path.decode("utf-8", "replace"))
    if isinstance(exc, _Refused):
        return f"refused {where}: {exc}"  # our own text, with uids only
    if isinstance(exc, (TimeoutError, _socket.timeout)):
        return f"timed out after {budget_ms} ms waiting for the daemon on {where}"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused on {where} (a stale socket: no daemon listens)"
    if isinstance(exc, _Failed):
        return str(exc)  # outside text in it went through shown()
    if isinstance(exc, FileNotFoundError):
        return ""
    return described(exc)


def _exit_now(signum: int, frame: object) -> None:
    posix._exit(0)


def main(argv: list[str]) -> None:
    agent, event, payload = parse_argv(argv)
    known = agent or ("claude" if env(b"CLAUDECODE") == b"1" else "")
    if flag(b"LOOMD_HOOK_DISABLE") or (known and flag(b"LOOMD_" + known.upper().encode() + b"_HOOK_DISABLE")):
        if payload is None:
            read_stdin(keep=False)
        return
    raw = read_stdin(keep=True) if payload is None else payload[:MAX_STDIN]
    try:
        if ignored(posix.environ, raw):
            return  # nothing is sent, spooled or logged from an ignored folder
    except BaseException:
        pass  # an unreadable ignore list ignores nothing: the event goes on as usual

    state = None
    try:
        sock_path, state = resolve(posix.environ)
        context = event in CONTEXT_EVENTS
        budget = deadline_ms(context, agent)
        deadline = time.monotonic() + budget / 1000
        # last resort: whatever hangs (a stuck filesystem, say), the agent gets its exit 0
        _signal.signal(_signal.SIGALRM, _exit_now)
        _signal.setitimer(_signal.ITIMER_REAL, budget / 1000 + WATCHDOG_MARGIN_S + len(raw) / WATCHDOG_BYTES_PER_S)
        eid = f"{time.time_ns():016x}-{posix.getpid():08x}-{posix.urandom(4).hex()}"
        args = pack_args(agent or "auto", event, raw, eid, context, budget, time.time_ns() // 1_000_000)
    except BaseException as exc:
        log(state, f"event={shown(event)} not sent, not spooled: {described(exc)}")
        return

    try:
        max_frame = int(env(b"LOOMD_MAX_FRAME_BYTES") or DEFAULT_MAX_FRAME)
    except ValueError:
        max_frame = DEFAULT_MAX_FRAME
    try:
        if len(REQUEST_HEAD) + len(args) > max_frame:
            raise _Failed(f"frame over {max_frame} bytes")
        out = call(sock_path, args, deadline)
    except BaseException as exc:
        why = failure(exc, sock_path, budget)
        try:
            spool(state, eid, args)
        except BaseException as spool_exc:
            log(state, f"event={shown(event)} eid={eid} lost: daemon {why or described(exc)}; "
                       f"spool {described(spool_exc)}")
            return
        if why:
            log(state, f"event={shown(event)} eid={eid} spooled: {why}")
        return
    if out:
        try:
            _write_all(1, out.encode("utf-8", "surrogatepass"))
        except BaseException:
            pass  # the daemon has the event; a closed stdout is the agent's business


def run() -> None:
    """The stub's entry point: main(), then exit 0 at once, whatever happened."""
    try:
        main(sys.argv)
    except BaseException:
        pass
    posix._exit(0)  # skip interpreter teardown: nothing is buffered, and the agent is waiting
