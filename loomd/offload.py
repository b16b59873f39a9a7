"""One long-lived helper process for the daemon's CPU-heavy work: embedding, the workers' text processing and the
parse of huge hook payloads.

The event loop's process keeps framing, redaction, SQLite writes and small reads. What costs CPU for long — the
embedding model (tokenizer, onnxruntime, numpy) and the observer's rules and evidence passages — runs here instead,
in a child process at a lower CPU priority, so it never holds the loop's interpreter lock and, on a busy machine,
yields the CPU to the loop and the agent.

A call names a lane and a module-level function (sent by reference, pickled with its arguments). Each lane has one
thread in the child, so a query's embedding never waits behind a back-fill batch and the observer's text work never
waits behind either. The query lane (a search waits on it) has a pipe of its own, which the calling thread writes
and reads itself: two thread wake-ups a call instead of four (the child's dispatcher and the parent's reader are
not in its path). The child is started with `spawn` (the daemon has threads a fork would copy mid-lock) and is
shared by every daemon of one process (tests start many; the model loads once).

Supervision: `watch()` (a task of the daemon's `Supervisor`) starts the child and waits for it to exit; a child
that dies (kill -9, out of memory) fails every call in flight with `ChildDied` and the supervisor starts a fresh one
after its backoff. Nothing is lost: callers run on what is already committed (the back-fill retries its batch, the
observer's watermark stays where it was and the next run does the chunk again, a huge hook payload being parsed
gets an error reply, so the shim spools it and the replay parses it again), and no small event waits on the child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from loomd.errors import ChildDied
from loomd.memory import release_memory

log = logging.getLogger(__name__)

T = TypeVar("T")
CHILD_NICE = 10

LANES = ("embed", "query", "work", "parse")
BACKGROUND = frozenset({"embed", "work"})  # the lanes nobody waits on: the back-fill, the workers' text work
AUTOGROUP = "/proc/self/autogroup"  # this process's session's scheduling group (Linux autogroups), its niceness
GROUP_LOW_NICE = 19
# After a call someone waits on, the helper's group stays at full weight this long (no change per call: the kernel
# takes one every 100 ms). Not longer: the lifted group runs the idle-class lanes at full weight too, and a prompt's
# follow-up search (its query embedded 50 ms after the hook's reply) held it up through the agent's next hook.
GROUP_LIFT_HOLD_S = 0.2
DIRECT = ("query",)  # lanes with a pipe of their own, called from a thread (`call_sync`), one call at a time
SHORT_SLICE_NS = 100_000  # the shortest time slice Linux grants a task (0.1 ms)
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")  # struct sched_attr as first defined (48 bytes): size, policy, flags, nice,
# priority, runtime (a fair task's time slice since Linux 6.12), deadline, period
_SCHED_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr


class Offload:
    """The parent's handle on the helper process: `call` and `call_sync` run a function there."""

    def __init__(self, nice: int = CHILD_NICE, *, idle: bool = False, trim: bool = False) -> None:
        # Not 0: the helper yields the CPU to the loop and the agent. On Linux its background lanes then run at idle
        # priority (`_child_main`); elsewhere `nice` is added to the whole child's priority.
        self.nice = nice
        self.idle = idle  # the whole child runs only on CPU time nothing else wants (`idle_priority`)
        # After each call's reply, the child hands its freed heap back (`release_memory`): for calls that each build a
        # large result, in a process that then waits (`loom import`'s parsers), not for small frequent ones.
        self.trim = trim
        # False: the daemon keeps a scheduling group that holds the child too (`SchedulingGroup`); it makes none.
        self.own_group = True
        self._lock = threading.Lock()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._direct: dict[str, Connection] = {}
        # One call at a time on a direct lane: its reply is the next message on its pipe (the child's lane runs one
        # call at a time anyway).
        self._direct_locks = {lane: threading.Lock() for lane in DIRECT}
        self._direct_busy = 0
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._ids = itertools.count(1)
        self.starts = 0
        self.calls = 0

    @property
    def pid(self) -> int | None:
        # `_conn` cleared: closed, or its reader saw it die. `is_alive()` alone can say "alive" for a child already
        # reaped by the reader thread's own join (both threads wait on it; the loser's waitpid finds no child).
        proc = self._proc
        return proc.pid if proc is not None and self._conn is not None and proc.is_alive() else None

    def status(self) -> dict[str, Any]:
        return {"pid": self.pid, "starts": self.starts, "calls": self.calls,
                "in_flight": len(self._pending) + self._direct_busy}

    def ensure_started(self) -> None:
        """Start the child unless it runs (blocking: spawning and importing take a fraction of a second)."""
        with self._lock:
            # Until its reader has failed what it was running (`_conn` cleared), a dying child is still the child:
            # its callers must hear `ChildDied`, not wait on a process that will never answer.
            if self._proc is not None and self._conn is not None:
                return
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            direct = {lane: ctx.Pipe() for lane in DIRECT}
            proc = ctx.Process(target=_child_main, args=(child, self.nice, {k: c for k, (_, c) in direct.items()},
                                                         self.idle, self.trim, self.own_group),
                               name="loomd-offload", daemon=True)
            proc.start()
            child.close()
            for _, end in direct.values():
                end.close()
            for old in self._direct.values():  # a dead child's: a caller still blocked on it gets EOFError
                with contextlib.suppress(OSError):
                    old.close()
            self._proc, self._conn = proc, parent
            self._direct = {k: p for k, (p, _) in direct.items()}
            self.starts += 1
            threading.Thread(target=self._read, args=(proc, parent), name="loomd-offload-reader",
                             daemon=True).start()
        log.info("offload process %d started", proc.pid)

    async def watch(self) -> None:
        """For the supervisor: start the child, then wait until it exits, which is a failure (restarted)."""
        await asyncio.to_thread(self.ensure_started)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        with self._lock:
            proc = self._proc
            alive = proc is not None and proc.is_alive() and self._conn is not None
            if alive:
                # The reader thread settles it when the pipe closes: several daemons (tests) may watch one child.
                self._watchers.append((loop, exited))
        if alive:
            try:
                await exited
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._watchers.remove((loop, exited))
        pid = proc.pid if proc is not None else None
        raise ChildDied(f"the offload process {pid} exited ({proc.exitcode if proc is not None else '?'})")

    def submit(self, lane: str, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        if lane in DIRECT:
            raise ValueError(f"lane {lane!r} has a pipe of its own: use call_sync (or call)")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is None or proc is None or not proc.is_alive():
                future.set_exception(ChildDied("the offload process is not running (restarting)"))
                return future
            rid = next(self._ids)
            self._pending[rid] = future
            self.calls += 1
            try:
                conn.send((rid, lane, fn, args))
            except (OSError, ValueError) as exc:
                self._pending.pop(rid, None)
                future.set_exception(ChildDied(f"the offload process cannot be reached: {exc}"))
            except (TypeError, AttributeError, pickle.PicklingError) as exc:  # a bug: arguments that cannot travel
                self._pending.pop(rid, None)
                future.set_exception(exc)
        return future

    async def call(self, lane: str, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the child on `lane`, from the event loop.

        A background lane's call is sent from a thread: its arguments are large (an observer's chunk of events), and
        pickling them and writing them into a pipe the child drains at its own pace held the loop 7-10 ms at a time
        during a catch-up, hooks waiting. A hook's own call (the parse lane) is sent at once: a thread's trip costs
        it more than its small write."""
        if lane in DIRECT:
            return await asyncio.to_thread(self._call_direct, lane, fn, args)
        if lane in BACKGROUND:
            return await asyncio.wrap_future(await asyncio.to_thread(self.submit, lane, fn, *args))
        return await asyncio.wrap_future(self.submit(lane, fn, *args))

    def call_sync(self, lane: str, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the child on `lane`, from a thread (blocking)."""
        if lane in DIRECT:
            return self._call_direct(lane, fn, args)
        return self.submit(lane, fn, *args).result()

    def _call_direct(self, lane: str, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """A call on a lane's own pipe: this thread sends it and reads the reply."""
        with self._direct_locks[lane]:
            with self._lock:
                conn, proc = self._direct.get(lane), self._proc
                if conn is None or self._conn is None or proc is None or not proc.is_alive():
                    raise ChildDied("the offload process is not running (restarting)")
                self.calls += 1
                self._direct_busy += 1
            try:
                # Pickled whole before a byte is written: arguments that cannot travel (a bug) leave the pipe clean.
                conn.send((fn, args))
                ok, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise ChildDied(f"the offload process {proc.pid} died: {exc or 'connection closed'}") from exc
            finally:
                with self._lock:
                    self._direct_busy -= 1
        if not ok:
            raise value
        result: T = value
        return result

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child for good (blocking): it finishes the calls it runs, then exits; for a private helper whose
        owner is done with it (`loom import`'s parsers). The shared helper lives as long as its process."""
        with self._lock:
            proc, conn = self._proc, self._conn
            if conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)  # the child's end of the pipe closes when it exits: the reader cleans up
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
            with self._lock:
                if self._proc is proc:
                    self._conn = None  # gone: the next `ensure_started` starts a fresh child at once
                    for own in self._direct.values():
                        own.close()
                    self._direct = {}

    def _read(self, proc: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        """The reader thread of one child: resolves calls as replies come; on its death fails what is left."""
        try:
            while True:
                rid, ok, value = conn.recv()
                with self._lock:
                    future = self._pending.pop(rid, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
        except (EOFError, OSError) as exc:
            reason = f"the offload process {proc.pid} died: {exc or 'connection closed'}"
        except Exception as exc:  # noqa: BLE001 - an unreadable reply: the stream cannot be trusted any more
            reason = f"the offload process {proc.pid} sent an unreadable reply: {exc}"
            with contextlib.suppress(OSError, AttributeError):
                proc.kill()
        with self._lock:
            if self._conn is conn:
                self._conn = None
            lost = list(self._pending.values()) if self._proc is proc else []
            watchers = list(self._watchers) if self._proc is proc else []
            if self._proc is proc:
                self._pending.clear()
        for loop, exited in watchers:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its daemon is gone
                loop.call_soon_threadsafe(_settle, exited)
        proc.join(1)
        for future in lost:
            if not future.done():
                future.set_exception(ChildDied(reason))
        with contextlib.suppress(OSError):
            conn.close()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_SHARED: Offload | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Offload:
    """The process's one helper (created, not started: the daemon's supervisor starts it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Offload()
        return _SHARED


# --- the child ---------------------------------------------------------------------------------------------------


def lower_thread_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by `nice`: on a busy machine the agent's processes, the hook shims
    among them, and the daemon's event loop come first. Linux schedules threads (and a thread may always lower its
    own priority); elsewhere this does nothing."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def idle_priority() -> str:
    """Let the calling process run only on CPU time nothing else wants; returns how ("idle" or "nice").

    On Linux, SCHED_IDLE for the calling thread, which the threads it starts inherit: any other runnable task takes
    the CPU from it as soon as it wakes, whatever its niceness (with only niceness, a task of the same one, such as a
    daemon run niced as a whole, waited for the end of the other's time slice at every wake-up). Elsewhere the
    lowest niceness (19). Lowering a priority needs no privilege; it cannot be raised again without one."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            log.debug("SCHED_IDLE refused; falling back to niceness 19")
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))
    return "nice"


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library the process already has loaded (glibc or musl): its `syscall`."""
    return ctypes.CDLL(None, use_errno=True)


def _sched_attr(set_slice_ns: int | None) -> int | None:
    """sched_getattr on the calling thread and, with `set_slice_ns`, sched_setattr with that slice and the thread's
    own policy and niceness; the slice it runs with after, or None (not Linux, no such call, refused)."""
    calls = _SCHED_CALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if calls is None:
        return None
    libc = _libc()
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if libc.syscall(calls[1], 0, buf, _SCHED_ATTR.size, 0) != 0:
        return None
    _, policy, flags, nice, priority, runtime, _, _ = _SCHED_ATTR.unpack(buf.raw)
    if set_slice_ns is not None and policy in (0, 3):  # SCHED_OTHER, SCHED_BATCH: the fair policies with a slice
        keep = flags & 0x01  # SCHED_FLAG_RESET_ON_FORK, if someone set it
        new = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, policy, keep, nice, priority,
                                                           set_slice_ns, 0, 0))
        if libc.syscall(calls[0], 0, new, 0) != 0:
            return None
        if libc.syscall(calls[1], 0, buf, _SCHED_ATTR.size, 0) != 0:
            return None
        runtime = _SCHED_ATTR.unpack(buf.raw)[5]
    return runtime or None


def short_slice() -> int | None:
    """Ask Linux for the shortest time slice (SHORT_SLICE_NS) for the calling thread, which the threads and
    processes it starts after inherit; the slice it runs with (ns), or None where a task has no slice of its own.

    Since Linux 6.12 (EEVDF) a task may ask for a slice shorter than the default (0.7 ms times a factor growing with
    the CPUs: 1.4 ms on 2), and needs no privilege for it: its CPU share stays the same, it just takes it in shorter
    turns. A task with a shorter slice gets an earlier deadline, so its wake-ups preempt sooner, and when it runs
    background work it gives way sooner to whatever wakes. For the daemon both help the hooks: its thread that
    answers a hook gets a CPU sooner, and its writer's and its helper's catch-up work leave a CPU sooner to the
    hook's shim (`bench/hooks.py --background-catchup`, 2 CPUs, the same day: every kind 0.2-2.0 ms closer to the
    floor at the median, 7 of 10 kinds within 3 ms of it against 4 of 10). Before 6.12 the kernel keeps its own
    slice and this returns None."""
    slice_ns = _sched_attr(SHORT_SLICE_NS)
    return slice_ns if slice_ns == SHORT_SLICE_NS else None


def thread_slice() -> int | None:
    """The calling thread's time slice (ns), None where Linux gives tasks none of their own (before 6.12)."""
    return _sched_attr(None)


def autogroups_on() -> bool:
    """Whether Linux schedules this process's session as a group of its own (autogroups built in and on)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1" and os.path.exists(AUTOGROUP)
    except OSError:
        return False


class SchedulingGroup:
    """A process's scheduling group, where Linux has autogroups: niceness 19 while only background work runs; 0 (full
    weight) while something someone waits on runs (`lifted`, `enter`/`leave`), and for GROUP_LIFT_HOLD_S after.

    Two processes keep one. The daemon, when its service manager started it in a session of its own (`start` with
    `own_session=False`): every client request lifts it. Otherwise the helper, in a session it makes: a search's
    query and a hook's parse lift it (the daemon's group, if kept, holds the helper too, which then makes none).

    Linux schedules each session as one group (`kernel.sched_autogroup_enabled`, on in most desktop distributions),
    and SCHED_IDLE ranks a thread only against the other threads of its group. In the daemon's session, the helper's
    idle-class lanes took as much CPU as the agent's whole session whenever both wanted it: during a catch-up, a CPU
    job of one process per CPU in another session took 2.03x as long as alone; with the helper's group at 19, 0.99x
    (`bench/yields.py`, 2 CPUs, stop 54). The daemon's own threads (the writer's background transactions, the
    loop's share of a catch-up) did the same at their normal priority: a process of the agent's session started
    during a catch-up waited 3.19 ms for a CPU at the median, 1.01 with the daemon's group at 19 (`bench/hooks.py
    --background-catchup 48000`'s floor, five runs each way, stop 69). At 19 for good, though, a search starved
    behind a busy session (8 -> 133 ms at the median with two busy loops running; lifted, 9.5 ms), hence the lift.

    An unprivileged process may set its own group's niceness anywhere from 0 to 19, but the kernel takes one change
    every 100 ms at most, machine-wide (EAGAIN): a lift refused leaves that call at the low weight (a machine with a
    CPU to spare runs it as fast), and the lowering is tried again until it holds. Inside a cgroup other than the
    root (a systemd service with the cpu controller) the kernel uses no autogroup, and this changes nothing."""

    def __init__(self, lifts: bool) -> None:
        self.lifts = lifts  # False: nothing in this helper is waited on (an import's parsers), it stays low
        self.enabled = False
        self.nice = 0  # the group's niceness as last set
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._lifted = 0  # calls running lifted
        self._ended = 0.0  # monotonic time the last lifted call ended

    def start(self, own_session: bool = True) -> bool:
        """Lower this process's group, in a session it makes (`own_session`) or, if not, in the one it leads already;
        False where there are no autogroups, or it cannot make one, or does not lead one (a `loomd` run in a
        terminal shares the terminal's session and group: lowering them would lower the user's shell)."""
        if not autogroups_on():
            return False
        if own_session:
            try:
                os.setsid()
            except OSError:
                return False
        elif os.getsid(0) != os.getpid():
            return False
        self.enabled = True
        with self._lock:
            self._set(GROUP_LOW_NICE)
        threading.Thread(target=self._lower, name="scheduling-group", daemon=True).start()
        return True

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Around a call someone waits on: the group at full weight while it runs."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """Something someone waits on begins: the group at full weight until it ends (`leave`)."""
        if not (self.enabled and self.lifts):
            return
        with self._lock:
            self._lifted += 1
            if self.nice != 0:
                self._set(0)

    def leave(self) -> None:
        """What `enter` began has ended: the group is lowered GROUP_LIFT_HOLD_S after the last such end."""
        if not (self.enabled and self.lifts):
            return
        with self._lock:
            self._lifted -= 1
            self._ended = time.monotonic()
            self._changed.notify()

    def status(self) -> dict[str, Any]:
        return {"on": self.enabled, "nice": self.nice if self.enabled else None}

    def _set(self, nice: int) -> bool:
        """Under the lock."""
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
        except OSError:
            return False  # EAGAIN: the machine's last change was under 100 ms ago
        self.nice = nice
        return True

    def _lower(self) -> None:
        """Its own thread: back to the low niceness GROUP_LIFT_HOLD_S after the last lifted call."""
        with self._lock:
            while True:
                if self.nice == GROUP_LOW_NICE or self._lifted:
                    self._changed.wait()
                elif (left := self._ended + GROUP_LIFT_HOLD_S - time.monotonic()) > 0:
                    self._changed.wait(left)
                elif not self._set(GROUP_LOW_NICE):
                    self._changed.wait(0.1)


def _child_main(conn: Connection, nice: int, direct: dict[str, Connection] | None = None, idle: bool = False,
                trim: bool = False, own_group: bool = True) -> None:
    """Serve calls until the parent goes away (the pipe closes); each lane on its own thread, a direct lane's thread
    reading its own pipe.

    On Linux only the background lanes' threads are lowered: a search waits on the query lane's embedding, and a hook
    on the parse lane, so those (and the thread that reads the calls) keep the daemon's priority; a niced query
    lane cost a search 1.5–2.7 ms at the median on a busy machine. Elsewhere the whole helper is niced.

    The background lanes (the back-fill's embedding, the workers' text work) run at idle priority (`idle_priority`,
    SCHED_IDLE), not niced: a niced thread keeps the CPU it runs on until its slice ends, so while a catch-up embedded
    on both cores every wake-up on a hook's path (the shim, the loop, the writer's and the log's threads) could wait
    for one; an idle-class thread gives the CPU up at once. Measured with `bench/hooks.py --background-catchup`
    (closing note, stop 41): the daemon's answer p99 35 against 39–40 ms, a hook's wait for the writer p90 2.2
    against 4–5 ms. An idle-class thread still gets a sliver of a busy CPU (weight 3 against a default task's 1,024),
    so a machine that is never idle slows the catch-up but does not stop it.

    SCHED_IDLE ranks threads within one scheduling group only, and with Linux autogroups each session is one: so the
    helper also runs in a session of its own, whose group is niced 19 except while a call someone waits on runs
    (`SchedulingGroup`): otherwise its idle-class lanes took half of a busy CPU from the agent's session. Unless the
    daemon keeps such a group (`own_group` False): the helper stays in it, lowered and lifted with the daemon."""
    per_thread = sys.platform.startswith("linux")
    group = SchedulingGroup(lifts=not idle)
    if (nice or idle) and own_group:
        group.start()
    if idle:  # before any thread starts: they inherit it
        idle_priority()
    elif nice and not per_thread:
        with contextlib.suppress(OSError):
            os.nice(nice)
    send_lock = threading.Lock()
    lanes = {lane: ThreadPoolExecutor(1, thread_name_prefix=f"offload-{lane}",
                                      initializer=idle_priority if nice and per_thread and lane in BACKGROUND else None)
             for lane in LANES if lane not in DIRECT}
    for lane, own in (direct or {}).items():
        threading.Thread(target=_serve_direct, args=(own, group), name=f"offload-{lane}", daemon=True).start()

    def run(rid: int, lane: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            with contextlib.nullcontext() if lane in BACKGROUND else group.lifted():  # nobody waits on those
                reply: tuple[int, bool, Any] = (rid, True, fn(*args))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its caller
            reply = (rid, False, exc)
        with send_lock:
            try:
                conn.send(reply)
            except (TypeError, AttributeError, ValueError) as exc:  # an unpicklable result or exception
                conn.send((rid, False, RuntimeError(f"{type(reply[2]).__name__} could not be sent back: {exc}")))
        if trim:
            del reply  # the result and its pickle are garbage now: what they took goes back to the system
            release_memory()

    finish = False
    try:
        while (message := conn.recv()) is not None:
            rid, lane, fn, args = message
            lane = lane if lane in lanes else "work"
            lanes[lane].submit(run, rid, lane, fn, args)
        finish = True  # `close()`: what runs is answered first
    except (EOFError, OSError):
        return  # the parent is gone: nothing to answer
    finally:
        for pool in lanes.values():
            pool.shutdown(wait=finish, cancel_futures=not finish)


def _serve_direct(conn: Connection, group: SchedulingGroup) -> None:
    """A direct lane in the child: each call read, run (its group lifted: someone waits) and answered on this
    thread, until the pipe closes."""
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone, or this child is exiting
        try:
            with group.lifted():
                reply: tuple[bool, Any] = (True, fn(*args))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its caller
            reply = (False, exc)
        try:
            conn.send(reply)
        except (TypeError, AttributeError, ValueError, pickle.PicklingError) as exc:  # unpicklable result
            conn.send((False, RuntimeError(f"{type(reply[1]).__name__} could not be sent back: {exc}")))
        except OSError:
            return
