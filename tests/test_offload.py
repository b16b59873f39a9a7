"""The offload process (loomd/offload.py): the embedding model and the observer's text work run there, not in the
event loop's process; killed, it is restarted, and no event is lost or left unobserved."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomd.client import Client
from loomd.ingest.history import ParserPool
from loomd.offload import CHILD_NICE, GROUP_LIFT_HOLD_S, GROUP_LOW_NICE, SHORT_SLICE_NS, Offload, autogroups_on
from loomd.store.db import connect_sync
from tests.conftest import DaemonProcess, need_test_data

SESSION = "offload-session"


def hook(client: Client, i: int, kind: str = "PostToolUse") -> dict[str, Any]:
    body: dict[str, Any] = {"session_id": SESSION, "cwd": "/x/offload", "hook_event_name": kind}
    if kind == "PostToolUse":
        body.update(tool_name="Bash", tool_use_id=f"toolu_{i}", tool_input={"command": f"make step-{i}"},
                    tool_response={"stdout": f"step {i} built the parser cache in {i}.2s", "stderr": ""})
    return client.call("hook", agent="claude", event=kind, raw=json.dumps(body).encode())


def rows(home: Path, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> list[Any]:
    conn = connect_sync(home / "loomd.db")
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def niceness(autogroup: str) -> int:
    """The niceness in a /proc autogroup file's text: "/autogroup-123 nice 19"."""
    return int(autogroup.split()[-1])


def wait_for(cond: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_killed_offload_process_is_restarted_and_no_event_is_lost(
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    daemon = daemon_process({"LOOMD_PASSIVE": "1", "LOOMD_EMBEDDER": "local"}).start()
    with Client(daemon.sock, timeout=60) as c:
        wait_for(lambda: c.call("status")["embedder"]["state"] == "ready", "the model to load in the child")
        first = c.call("status")["offload"]["pid"]
        assert daemon.proc is not None and first != daemon.proc.pid
        for i in range(10):
            assert hook(c, i)["stored"] == 1
        # The observer's text work runs in the child: its first run observes the first ten events.
        assert c.call("workers_run", name="observer", session_id=SESSION)["outcome"] == "ok"

        os.kill(first, signal.SIGKILL)
        # The loop does not wait on the child: events are acknowledged while it is dead or restarting.
        for i in range(10, 20):
            assert hook(c, i)["stored"] == 1
        assert hook(c, 20, "SessionEnd")["stored"] == 1
        status = wait_for(lambda: (s := c.call("status"))["offload"]["pid"] not in (None, first) and s,
                          "a new offload process")
        assert status["offload"]["starts"] >= 2
        assert status["tasks"]["offload"]["failures"] >= 1  # the supervisor saw it die and restarted it
        assert status["counts"]["events"] == 21

        # Nothing the dead child was doing is lost: the observer reaches the last event (the events after the kill
        # have evidence passages), the back-fill embeds every memory.
        wait_for(lambda: c.call("workers_run", name="observer", session_id=SESSION)["outcome"] == "ok",
                 "an observer run on the new child")
        last, mark, cited = rows(daemon.home, "SELECT (SELECT max(id) FROM events WHERE session_id = :s),"
                                 " (SELECT value FROM checkpoints WHERE name = 'observer:' || :s),"
                                 " (SELECT count(DISTINCT event_id) FROM memory_sources WHERE event_id >"
                                 "  (SELECT min(id) + 10 FROM events WHERE session_id = :s))", {"s": SESSION})[0]
        assert int(mark) == last and cited >= 5, (last, mark, cited)
        wait_for(lambda: (e := c.call("status")["embedder"])["caught_up"] and e["state"] == "ready",
                 "the back-fill to catch up")
        (memories,) = rows(daemon.home, "SELECT count(*) FROM memories")[0]
        assert c.call("status")["embedder"]["vectors"] == memories > 0
    assert daemon.stop() == 0


def test_a_closed_helper_exits_and_the_next_call_starts_a_fresh_one() -> None:
    """`Offload.close()` (the import's parsers, when idle): the child answers what it runs, exits, and is gone; a
    later call starts a new child."""
    helper = Offload()
    try:
        helper.ensure_started()
        first = helper.call_sync("work", os.getpid)
        assert first == helper.pid and first != os.getpid()
        helper.close()
        assert helper.pid is None
        helper.ensure_started()
        second = helper.call_sync("work", os.getpid)
        assert second not in (first, os.getpid())
    finally:
        helper.close()


def test_the_helper_yields_the_cpu_and_import_parsers_take_only_idle_cpu() -> None:
    """The shared helper's background lanes (the back-fill, the workers' text work) and `loom import`'s parsers run
    only on CPU time nothing else wants (SCHED_IDLE on Linux; elsewhere the helper is niced, the parsers at 19): at
    the daemon's own priority the parsers took a core from the hooks at every wake-up, and a niced back-fill kept a
    core until its slice ended. What a search or a hook waits on (the query and parse lanes) is not lowered."""
    mine = os.nice(0)
    helper = Offload()
    try:
        helper.ensure_started()
        if sys.platform.startswith("linux"):  # threads are scheduled apart
            for lane in ("embed", "work"):
                assert helper.call_sync(lane, os.sched_getscheduler, 0) == os.SCHED_IDLE
            for lane in ("query", "parse"):
                assert helper.call_sync(lane, os.sched_getscheduler, 0) == os.SCHED_OTHER
                assert helper.call_sync(lane, os.nice, 0) == mine
        else:
            assert helper.call_sync("work", os.nice, 0) == min(19, mine + CHILD_NICE)
    finally:
        helper.close()
    parser = ParserPool(1, idle_s=1.0).children[0]
    try:
        parser.ensure_started()
        if sys.platform.startswith("linux"):
            assert parser.call_sync("parse", os.sched_getscheduler, 0) == os.SCHED_IDLE
            assert parser.call_sync("query", os.sched_getscheduler, 0) == os.SCHED_IDLE
        else:
            assert parser.call_sync("parse", os.nice, 0) == 19
    finally:
        parser.close()


def test_the_helper_has_a_scheduling_group_of_its_own_lowered_except_while_a_call_is_waited_on() -> None:
    """Linux schedules each session as a group (autogroups) and SCHED_IDLE ranks threads only within one: so the
    helper makes a session of its own whose group is niced 19, and lifted to 0 while a call someone waits on runs
    (a search's query, a hook's parse) and GROUP_LIFT_HOLD_S after; background calls (the back-fill, the workers)
    never lift it. The kernel takes one such change per 100 ms machine-wide, hence `wait_for`. An import's parsers
    (nothing there is waited on) stay low. Without autogroups, nothing changes: the helper keeps our session."""
    group = Path("/proc/self/autogroup")

    def nice_of(helper: Offload, lane: str) -> int:
        return niceness(helper.call_sync(lane, group.read_text))  # the child's own, read inside the call

    helper = Offload()
    try:
        helper.ensure_started()
        if not autogroups_on():
            assert helper.call_sync("work", os.getsid, 0) == os.getsid(0)
            return
        assert helper.call_sync("work", os.getsid, 0) == helper.pid != os.getsid(0)
        wait_for(lambda: nice_of(helper, "work") == GROUP_LOW_NICE, "the helper's group lowered", within=5)
        wait_for(lambda: nice_of(helper, "query") == 0, "a query lifting the group", within=5)
        # Lifted while it runs (a refused change, under 100 ms after another, leaves one call low: asked again).
        wait_for(lambda: nice_of(helper, "parse") == 0, "a parse lifting the group", within=5)
        lifted = time.monotonic()  # the last lifted call has ended: the hold runs from its end
        wait_for(lambda: nice_of(helper, "work") == GROUP_LOW_NICE, "the group lowered after the hold",
                 within=GROUP_LIFT_HOLD_S + 5)
        assert time.monotonic() - lifted >= GROUP_LIFT_HOLD_S * 0.5  # held, not lowered as the call ended
        assert nice_of(helper, "embed") == GROUP_LOW_NICE  # a background call does not lift it
    finally:
        helper.close()
    parser = ParserPool(1, idle_s=1.0).children[0]
    try:
        parser.ensure_started()
        wait_for(lambda: nice_of(parser, "parse") == GROUP_LOW_NICE, "the parser's group lowered", within=5)
        assert nice_of(parser, "query") == GROUP_LOW_NICE  # nothing lifts it
        assert parser.call_sync("parse", os.getsid, 0) == parser.pid
    finally:
        parser.close()


def autogroup_nice(pid: int) -> int:
    return niceness(Path(f"/proc/{pid}/autogroup").read_text())


def test_a_daemon_leading_its_session_lowers_its_group_with_its_helper_in_it_except_while_a_request_runs(
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    """As its service manager starts it, the daemon leads a session of its own (here: setsid). Its whole group,
    the helper kept in it, is niced 19 while only background work runs, and lifted to 0 by every request and
    GROUP_LIFT_HOLD_S after: its writer's and loop's share of a catch-up no longer takes a CPU from the agent's
    session at full weight. A daemon that does not lead its session (run in a terminal, which it shares) leaves
    that group alone, and its helper makes one of its own, as before."""
    led = daemon_process({"LOOMD_PASSIVE": "1"}, preexec_fn=os.setsid).start()
    assert led.proc is not None
    with Client(led.sock, timeout=30) as c:
        status = c.call("status")
        helper = status["offload"]["pid"]
        if not autogroups_on():
            assert status["scheduling_group"] == {"on": False, "nice": None}
            wait_for(lambda: os.getsid(helper) == helper, "the helper's own session, as without this", within=10)
            return
        assert status["scheduling_group"]["on"]
        # Its query lane's thread is up: it started after the session would have been made.
        wait_for(lambda: len(os.listdir(f"/proc/{helper}/task")) >= 2, "the helper's lanes", within=10)
        assert os.getsid(helper) == led.proc.pid  # kept in the daemon's session, so in its group
        assert Path(f"/proc/{helper}/autogroup").read_text() == Path(f"/proc/{led.proc.pid}/autogroup").read_text()
        wait_for(lambda: autogroup_nice(led.proc.pid) == GROUP_LOW_NICE, "the daemon's group lowered", within=5)
        # A request lifts it, and the hold keeps it lifted a moment after the reply (the kernel refuses a change
        # under 100 ms after another, machine-wide: such a request stays low, hence asked again).
        wait_for(lambda: c.call("ping") and autogroup_nice(led.proc.pid) == 0, "a request lifting the group",
                 within=5)
        lifted = time.monotonic()
        wait_for(lambda: autogroup_nice(led.proc.pid) == GROUP_LOW_NICE, "the group lowered after the hold",
                 within=GROUP_LIFT_HOLD_S + 5)
        assert time.monotonic() - lifted >= GROUP_LIFT_HOLD_S * 0.5  # held, not lowered as the request ended
        # `loom import`'s files are background work, held to what the machine spares: they do not lift it.
        transcript = need_test_data("transcripts", "AkashJana18-edgerunner", "codex-session.jsonl")
        time.sleep(0.15)  # past the kernel's 100 ms between changes: a lift now would hold
        seen: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool, Client(led.sock, timeout=60) as importer:
            importing = pool.submit(importer.call, "import_file", {"path": str(transcript)})
            while not importing.done():
                seen.append(autogroup_nice(led.proc.pid))
                time.sleep(0.002)
            assert importing.result()["stored"] > 0
        assert len(seen) > 5 and set(seen) == {GROUP_LOW_NICE}
    led.stop()
    mine = Path("/proc/self/autogroup").read_text()
    shared = daemon_process({"LOOMD_PASSIVE": "1"}).start()  # in this test's session
    assert shared.proc is not None
    with Client(shared.sock, timeout=30) as c:
        status = c.call("status")
        helper = status["offload"]["pid"]
        assert status["scheduling_group"] == {"on": False, "nice": None}
        wait_for(lambda: os.getsid(helper) == helper, "the helper's own session (made as it starts)", within=10)
        c.call("ping")
    assert Path("/proc/self/autogroup").read_text() == mine  # this session's group untouched


# sched_setattr on this thread with a 0.1 ms slice (its own policy and niceness), then the kernel's own account
# (/proc/self/sched): written here, apart from the daemon's code, to learn whether this kernel grants a task a slice.
SLICE_PROBE = """
import ctypes, os, platform, struct
calls = {"x86_64": 314, "aarch64": 274}.get(platform.machine())
attr = struct.pack("=IIQiIQQQ", 48, 0, 0, os.nice(0), 0, 100_000, 0, 0)
libc = ctypes.CDLL(None, use_errno=True)
ok = calls is not None and libc.syscall(calls, 0, ctypes.create_string_buffer(attr), 0) == 0
print(ok and open("/proc/self/sched").read())
"""


def task_slices(pid: int) -> dict[int, tuple[int, int | None]]:
    """Each thread of `pid`: its policy and its slice in ns, as the kernel reports them (/proc/<pid>/task/*/sched)."""
    out: dict[int, tuple[int, int | None]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        lines = [line.split(":", 1) for line in (task / "sched").read_text().splitlines() if ":" in line]
        fields = {key.strip(): value.strip() for key, value in lines}
        slice_ns = fields.get("se.slice")
        out[int(task.name)] = (int(fields["policy"]), int(slice_ns) if slice_ns else None)
    return out


def test_the_daemon_and_its_helper_take_the_cpu_in_the_shortest_slices_linux_grants(
    daemon_process: Callable[..., DaemonProcess],
) -> None:
    """Since Linux 6.12 a task may ask for a shorter time slice than the default (1.4 ms on 2 CPUs), with no
    privilege: the daemon asks for the shortest (0.1 ms) before its first thread, so every thread and its helper
    process inherit it. Its wake-ups (a hook's request) then preempt sooner, and its background work gives way
    sooner to what wakes (a hook's shim). `status` says what the event loop's thread runs with."""
    probe = subprocess.run([sys.executable, "-c", SLICE_PROBE], capture_output=True, text=True, check=True).stdout
    granted = "se.slice" in probe and " 100000\n" in probe
    daemon = daemon_process({"LOOMD_PASSIVE": "1", "LOOMD_EMBEDDER": "local"}).start()
    with Client(daemon.sock, timeout=60) as c:
        status = wait_for(lambda: (s := c.call("status"))["embedder"]["state"] == "ready" and s,
                          "the model to load in the helper")
    assert daemon.proc is not None
    if not granted:  # an older kernel, or not Linux: the daemon runs as it always did
        assert status["time_slice_ns"] != SHORT_SLICE_NS
        return
    assert status["time_slice_ns"] == SHORT_SLICE_NS
    assert task_slices(daemon.proc.pid)[daemon.proc.pid] == (0, SHORT_SLICE_NS)  # the event loop's thread
    helper = task_slices(status["offload"]["pid"])
    assert len(helper) >= 4  # its lanes' threads are up: the model loaded there
    # SCHED_IDLE's threads (the background lanes) are not shown a slice; every other one runs with the short one.
    assert {s for policy, s in helper.values() if policy != os.SCHED_IDLE} == {SHORT_SLICE_NS}
