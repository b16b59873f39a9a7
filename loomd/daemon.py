"""The daemon's lifecycle: startup, serve, shutdown; signals, socket activation, sd_notify, uvloop.

Shutdown order (signals only set an event; the serve loop does the work):
1. stop accepting connections;
2. drain in-flight requests, bounded by `drain_timeout_s`;
3. stop background work (scheduler, watchers) and the event writer, committing what was accepted;
4. close the database;
5. unlink the socket (unless systemd owns it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loomd import __version__, memory, offload
from loomd.config import Config, load_config
from loomd.context.planner import Planner
from loomd.errors import LoomdError
from loomd.ingest.capture import Capturer
from loomd.ingest.history import HistoryImporter
from loomd.ingest.journal import HookJournal, done_notes, replay, to_replay
from loomd.ingest.spool import Spool
from loomd.ingest.tailer import Tailer
from loomd.ingest.writer import EventWriter
from loomd.ops import Ops, Services
from loomd.protocol import Request
from loomd.search.retrieval import Hit, SearchContext, recount_stale, search_hits
from loomd.server import Server
from loomd.store.db import Store
from loomd.store.memories import MemoryWriter
from loomd.store.turns import Durations
from loomd.supervisor import Supervisor
from loomd.team.search import SharedSearch
from loomd.team.sync import SyncEngine
from loomd.trust import UntrustedPath, make_private_dir, require_trusted
from loomd.vectors.service import VectorService
from loomd.workers.scheduler import Scheduler

log = logging.getLogger("loomd")
SERVICE_KEYS = 128  # ops and hook kinds in `status`'s `service` (a client names them: the rest count as "other")

STARTUP_FAILURE = 3
SD_LISTEN_FDS_START = 3


class StartupError(Exception):
    """Startup cannot go on; the message says exactly why. Exit status 3."""


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) our state; a no-op outside systemd."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    address = "\0" + target[1:] if target.startswith("@") else target
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


def inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed us (LISTEN_FDS), if any; launchd has no such protocol (README)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or int(os.environ.get("LISTEN_FDS", "0") or 0) < 1:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.setblocking(False)
    return sock


def socket_is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                return False
            raise
    return True


class Daemon:
    """Owns the store, the server and the background tasks of one running loomd."""

    def __init__(self, config: Config, *, listen_sock: socket.socket | None = None, owns_process: bool = False) -> None:
        """`owns_process`: the daemon is its process's only tenant (`loomd serve`), so it may settle the process's
        heap for itself (`memory.freeze_startup`); a daemon inside another process (a test's) leaves it alone."""
        self.config = config
        self.listen_sock = listen_sock
        self.owns_process = owns_process
        self.socket_path = config.paths.socket
        self.started = time.time()
        self.should_exit = asyncio.Event()
        self.store: Store
        self.writer: EventWriter
        self.server: Server | None = None
        self.spool: Spool | None = None
        self.journal: HookJournal | None = None
        self.tailer: Tailer | None = None
        self.scheduler: Scheduler | None = None
        self.ops: Ops | None = None
        self.supervisor = Supervisor(self.should_exit)
        self._lock_fd: int | None = None
        self._owns_socket = False
        # `status`'s `service`: how long the daemon took to answer each op (a hook by its event kind), and how long a
        # hook took to arrive, the shim's send time to its frame cut here (its connect, and the loop's wait to read).
        self.answered = Durations(max_keys=SERVICE_KEYS)
        self.arrived = Durations(max_keys=SERVICE_KEYS)
        # Lowered while only background work runs, lifted by every request (`SchedulingGroup`): kept only by a daemon
        # that owns its process and leads its session, as its service manager starts it.
        self.group = offload.SchedulingGroup(lifts=True)

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def startup(self) -> None:
        os.umask(0o077)  # every file and folder we create is the owner's alone, whatever umask we inherited
        paths = self.config.paths
        self._claim_folders()
        if self.listen_sock is None:
            if self.socket_path.exists():
                if socket_is_live(self.socket_path):
                    raise StartupError(f"another loomd is already listening on {self.socket_path}")
                log.info("removing stale socket %s", self.socket_path)
                self.socket_path.unlink()
        try:
            self.store = await Store.open(paths.db, busy_timeout_ms=self.config.busy_timeout_ms)
        except LoomdError as exc:
            raise StartupError(str(exc)) from exc
        # The embedding model, the workers' text work and the parse of huge hook payloads run in the offload process
        # (shared by the daemons of one process, restarted by the supervisor below). Started now, before any client
        # is served: starting it holds the interpreter lock 20-50 ms, which a client would otherwise feel.
        self.offload = offload.shared()
        if self.owns_process and self.group.start(own_session=False):
            self.offload.own_group = False  # the helper stays in our session, so in the group we lower and lift
        await asyncio.to_thread(self.offload.ensure_started)
        self.writer = EventWriter(self.store, max_pending=self.config.max_inflight, offload=self.offload)
        self.writer.start()
        self.vectors = VectorService(self.config, self.store, self.offload)
        self.memories = MemoryWriter(self.store)
        self.memories.stale.append(self.vectors.mark_dirty)
        self.memories.committed.append(self.vectors.wake)
        self.memories.deleted.append(self.vectors.forget)
        capturer = Capturer(self.config.capture_rate_per_session, self.memories, lambda: self.config)
        self.writer.processors.append(capturer)
        # Captured memories commit inside ingest transactions: marked for the back-fill, which is woken, after each.
        self.writer.listeners.append(capturer.listener)
        self.writer.listeners.append(lambda _events: self.memories.changed())
        self.planner = Planner(self.store, lambda: self.config, self.search, self.vectors.searchable,
                               lambda: recount_stale(self.retrieval_context()))
        self.tailer = Tailer(self.config, self.store, self.writer)
        self.writer.listeners.append(self.tailer.listener)
        # Before the socket opens: nothing may await between serving the first request and the signal handlers.
        self.sync = SyncEngine(self.store, lambda: self.config, self.memories, self.offload)
        self.shared_search = SharedSearch(lambda: self.config)
        self.scheduler = Scheduler(self.store, lambda: self.config, self.memories, self.offload, self.sync)
        self.writer.listeners.append(self.scheduler.listener)
        await self.scheduler.start()
        # Replay groups share a commit; a quarter of the writer's queue leaves room for live hooks.
        self.spool = Spool(paths.spool, self._ingest_spooled, batch=min(32, self.config.max_inflight // 4))
        try:
            self.spool.prepare()  # checked in _claim_folders; created here, checked again against a race
        except UntrustedPath as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(f"cannot create {paths.spool}: {exc.strerror or exc}") from None
        self.history = HistoryImporter(self.store, self.tailer, idle_s=self.config.import_idle_s)
        # An import first: its memories are embedded and its sessions observed after it. Live hooks first too: the
        # back-fill and the workers catch up when they pause, and while the agent works they rest after each of their
        # transactions (`LiveTraffic`).
        history, live = self.history, self.writer.live
        self.vectors.hold = self.scheduler.hold = lambda: history.active or live.busy()
        self.vectors.resume_in = self.scheduler.resume_in = lambda: None if history.active else live.resume_in()
        self.store.resume_in = live.resume_in  # the log is started over in a pause of the hooks (`Store.restart_log`)
        self.store.pace_background(lambda seconds: live.ran(seconds, self.config.background_rest_ratio))
        self.journal = await self._open_journal()
        self.ops = Ops(Services(
            config=lambda: self.config, store=self.store, writer=self.writer, memories=self.memories,
            planner=self.planner, search=self.retrieval_context, scheduler=self.scheduler, runtime=self.runtime,
            history=self.history, sync=self.sync, shared_search=self.shared_search, journal=self.journal))
        self.server = Server(self.ops.handlers(), max_frame=self.config.max_frame_bytes,
                             max_inflight=self.config.max_inflight, served=self._served, group=self.group)
        if self.listen_sock is not None:
            # systemd owns this socket file: never unlinked here. Shims and the CLI only find it at our path.
            bound = self.listen_sock.getsockname()
            if isinstance(bound, str) and bound and Path(bound) != self.socket_path:
                log.warning("the inherited socket is %s but clients look for %s; fix ListenStream= in the unit "
                            "(`loom install systemd` renders it)", bound, self.socket_path)
            await self.server.start(sock=self.listen_sock)
        else:
            await self.server.start(path=str(self.socket_path))
            self._owns_socket = True
        spool, tailer = self.spool, self.tailer
        self.supervisor.start("offload", self.offload.watch)
        self.supervisor.start("spool", lambda: spool.watch(self.should_exit))
        self.supervisor.start("embeddings", lambda: self.vectors.run(self.should_exit))
        self.supervisor.start("tailer", lambda: tailer.run(self.should_exit))
        if self.owns_process:
            memory.freeze_startup()  # everything is built: what is alive now lives as long as the daemon
        log.info("loomd %s listening on %s (db %s)", __version__, self.socket_path, paths.db)
        sd_notify("READY=1\nSTATUS=serving")

    async def _open_journal(self) -> HookJournal | None:
        """The hook journal, its records not committed before a crash replayed first (before any client is served);
        None when it is off. One that cannot be opened says so once (`status`'s `journal.broken`), and every hook is
        then answered after its commit."""
        if self.config.hook_journal_bytes <= 0:
            return None
        journal = HookJournal(self.config.paths.journal, self.config.hook_journal_bytes, self.writer)
        file_epoch, records = await asyncio.to_thread(journal.open)
        done_epoch, notes = await self.store.read(done_notes)
        left = to_replay(file_epoch, records, done_epoch, notes.get(file_epoch or 0, set()))
        if left:
            stored = await replay(journal, left)
            log.info("replayed %d journaled hook(s) whose commit was not known: %d new", len(left), stored)
        journal.begin(max(file_epoch or 0, done_epoch or 0) + 1)
        return journal

    def _claim_folders(self) -> None:
        """Create or check our folders, then take the lock; refuse (exit 3) what another user placed or may change.

        Nothing of ours is trusted that is a symlink, belongs to another user or is writable by others: a shared
        LOOMD_HOME would let them swap the socket for their own listener, or plant files we write through.
        """
        paths = self.config.paths
        spool = paths.spool
        try:
            for directory in dict.fromkeys((paths.data_dir, paths.state_dir, paths.runtime_dir)):
                make_private_dir(directory)
            for directory in (spool, spool / "rejected", spool / "quarantine"):
                require_trusted(directory, "directory")
            for path in (paths.db, paths.db.with_name(paths.db.name + "-wal"),
                         paths.db.with_name(paths.db.name + "-shm"), paths.data_dir / "loomd.lock"):
                require_trusted(path, "file")
            if self.listen_sock is None:
                require_trusted(self.socket_path, "socket")
            self._take_lock(paths.data_dir / "loomd.lock")
        except UntrustedPath as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:  # an unwritable home: say which folder, and how to fix it
            what = Path(exc.filename) if exc.filename else paths.data_dir / "loomd.lock"
            raise StartupError(f"cannot use {what.parent}: creating {what.name} failed: {exc.strerror or exc}; "
                               f"fix: chmod u+rwx {shlex.quote(str(what.parent))}  # or set LOOMD_HOME to a folder "
                               "of yours") from None

    def _take_lock(self, path: Path) -> None:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StartupError(
                f"another loomd (pid {holder}) already owns {path.parent}; stop it first (loom status)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    async def serve(self) -> None:
        try:
            await self.startup()
        except BaseException:
            await self._close_resources()
            raise
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.should_exit.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self.should_exit.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self.shutdown()

    def reload(self) -> None:
        """SIGHUP: re-read the config; what needs a restart (paths, frame limits) keeps its old value."""
        try:
            fresh = load_config()
        except LoomdError as exc:
            log.error("config reload failed, keeping the old config: %s", exc)
            return
        self.config = fresh
        logging.getLogger().setLevel(fresh.log_level.upper())
        log.info("config reloaded")

    async def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        log.info("shutting down")
        if self.server is not None:
            self.server.stop_accepting()
            left = await self.server.drain(self.config.drain_timeout_s)
            if left:
                log.warning("cancelled %d request(s) still running after %.1fs", left, self.config.drain_timeout_s)
        if self.scheduler is not None:
            await self.scheduler.stop()
        if hasattr(self, "planner"):
            await self.planner.close()
        await self.supervisor.cancel()
        await self._close_resources()
        log.info("stopped")

    async def _close_resources(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()  # no-op after shutdown() stopped it; needed when startup failed late
        if hasattr(self, "sync"):
            await self.sync.close()
            await self.shared_search.close()
        if hasattr(self, "writer"):
            await self.writer.stop()
        if self.journal is not None:
            self.journal.close()  # after the writer: every record it held is committed
        if hasattr(self, "history"):
            await self.history.close()  # its parser processes (after the writer: no import is left to parse for)
        if hasattr(self, "vectors"):
            await self.vectors.close()
        if hasattr(self, "store"):
            await self.store.close()
        if self._owns_socket:
            self.socket_path.unlink(missing_ok=True)
            self._owns_socket = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- services for ops ------------------------------------------------------------------------------------

    async def _ingest_spooled(self, args: dict[str, Any]) -> None:
        await self.writer.submit_args(args, max_chars=self.config.max_tool_output_chars)

    async def search(self, **kwargs: Any) -> list[Hit]:
        return await search_hits(self.retrieval_context(), **kwargs)

    def retrieval_context(self) -> SearchContext:
        return SearchContext(self.store, self.vectors, self.config.recency_half_life_days)

    def _served(self, request: Request, received: float, ms: float) -> None:
        if request.op != "hook":
            self.answered.record(request.op, ms)
            return
        kind = f"hook:{request.args.get('event') or request.args.get('agent') or '?'}"
        self.answered.record(kind, ms)
        sent = request.args.get("sent_at")
        if isinstance(sent, int) and not isinstance(sent, bool):
            self.arrived.record(kind, max(0.0, received * 1000 - sent))

    def runtime(self) -> dict[str, Any]:
        """What only the running daemon knows, for the `status` op."""
        tailer = self.tailer.status() if self.tailer else None
        return {
            "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3), "socket": str(self.socket_path),
            "spool_backlog": self.spool.backlog() if self.spool else 0,
            "spool": self.spool.status() if self.spool else None, "tasks": self.supervisor.status(),
            "inflight": len(self.server.inflight) if self.server else 0,
            "embedder": self.vectors.status(), "tailer": tailer,
            "offload": {**self.offload.status(), "import_parsers": self.history.pool.status()},
            "import": {"running": self.history.active, "files_in_flight": self.history.in_flight},
            "journal": self.journal.status() if self.journal is not None else {"on": False},
            "service": {"answer": self.answered.summary(), "arrival": self.arrived.summary()},
            "memory": memory.usage(), "time_slice_ns": offload.thread_slice(), "scheduling_group": self.group.status(),
            # Each thread's Linux id and what it does: what a scheduler trace or `top -H` shows by id.
            "threads": {str(t.native_id): t.name for t in threading.enumerate()},
        }


def setup_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # aiosqlite's DEBUG lines carry every statement's parameters: whole events, copied into the journal.
    logging.getLogger("aiosqlite").setLevel(max(logging.INFO, logging.getLogger().level))


def loop_factory() -> asyncio.AbstractEventLoop:
    """uvloop where it exists (not on Windows), else the default loop; no global policy is set."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# How long a thread may hold the GIL while another waits (Python's default: 5 ms). The embedding threads do Python
# and numpy work between model runs; a hook's request must not wait that long for the event loop's turn.
GIL_SWITCH_INTERVAL_S = 0.0005


def run(config: Config) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    offload.short_slice()  # before the first thread and the helper process: they inherit it
    memory.limit_heaps()  # before the first thread
    daemon = Daemon(config, listen_sock=inherited_socket(), owns_process=True)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(daemon.serve())
        except StartupError as exc:
            log.error("startup failed: %s", exc)
            sys.stderr.write(f"loomd: {exc}\n")
            return STARTUP_FAILURE
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loomd", description="loomd: long-term memory daemon for coding agents")
    parser.add_argument("command", nargs="?", default="serve", choices=["serve"], help="run in the foreground")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="version", version=f"loomd {__version__}")
    args = parser.parse_args(argv)
    try:
        config = load_config()
    except LoomdError as exc:
        sys.stderr.write(f"loomd: {exc}\n")
        return STARTUP_FAILURE
    setup_logging(args.log_level or config.log_level)
    return run(config)
