"""bench/schedtrace.py's reading of a scheduler trace: a hook's spawn that waited for a CPU is charged to whoever held
that CPU meanwhile, by name. The trace here is `perf script`'s text (its key=value form) for a made-up run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench" / "schedtrace.py"


def schedtrace() -> ModuleType:
    """The bench script as a module, without putting bench/ on the path (its mcp.py would hide the mcp package)."""
    spec = importlib.util.spec_from_file_location("bench_schedtrace", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

SW = ("sched:sched_switch: prev_comm={pc} prev_pid={pp} prev_prio=120 prev_state={st} ==> next_comm={nc} next_pid={np}"
      " next_prio=120")
TRACE = [
    # the bench (100) starts the daemon (200), whose writer's thread is 201, and its helper (300)
    "python 100 [000] 10.000000: sched:sched_process_fork: comm=python pid=100 child_comm=python child_pid=200",
    "python 200 [000] 10.001000: sched:sched_process_exec: filename=/usr/bin/python pid=200 old_pid=200",
    "python 200 [000] 10.002000: sched:sched_process_fork: comm=python pid=200 child_comm=python child_pid=201",
    "python 200 [000] 10.003000: sched:sched_process_fork: comm=python pid=200 child_comm=python child_pid=300",
    "python 300 [001] 10.004000: sched:sched_process_exec: filename=/usr/bin/python pid=300 old_pid=300",
    # a warm-up spawn (400), then the timed one (500: sh, which starts the shim 501)
    "python 100 [000] 11.000000: sched:sched_process_fork: comm=python pid=100 child_comm=python child_pid=400",
    "sh 400 [000] 11.000100: sched:sched_process_exec: filename=/bin/sh pid=400 old_pid=400",
    "swapper/0 0 [000] 11.000200: " + SW.format(pc="swapper/0", pp=0, st="R", nc="sh", np=400),
    "sh 400 [000] 11.010000: " + SW.format(pc="sh", pp=400, st="X", nc="swapper/0", np=0),
    "python 100 [000] 12.000000: sched:sched_process_fork: comm=python pid=100 child_comm=python child_pid=500",
    "sh 500 [000] 12.000100: sched:sched_process_exec: filename=/bin/sh pid=500 old_pid=500",
    "swapper/0 0 [000] 12.000200: " + SW.format(pc="swapper/0", pp=0, st="R", nc="sh", np=500),
    "sh 500 [000] 12.001000: sched:sched_process_fork: comm=sh pid=500 child_comm=sh child_pid=501",
    "sh 500 [000] 12.001100: sched:sched_wakeup_new: comm=sh pid=501 prio=120 target_cpu=000",
    "sh 500 [000] 12.001200: " + SW.format(pc="sh", pp=500, st="S", nc="sh", np=501),
    "python 501 [000] 12.002000: sched:sched_process_exec: filename=/usr/bin/python pid=501 old_pid=501",
    # the writer's thread wakes and takes the CPU from the shim for 8 ms, then the helper for 2 ms; the shim, queued,
    # is woken meanwhile (a wake-up of a task already waiting for a CPU): its wait goes on, charged all the same
    "python 501 [000] 12.003000: sched:sched_wakeup: comm=python pid=201 prio=120 target_cpu=000",
    "python 501 [000] 12.003100: " + SW.format(pc="python", pp=501, st="R", nc="python", np=201),
    "python 201 [000] 12.005000: sched:sched_wakeup: comm=python pid=501 prio=120 target_cpu=000",
    "python 201 [000] 12.011100: " + SW.format(pc="python", pp=201, st="S", nc="python", np=300),
    "python 300 [000] 12.013100: " + SW.format(pc="python", pp=300, st="S", nc="python", np=501),
    "python 501 [000] 12.020000: " + SW.format(pc="python", pp=501, st="X", nc="sh", np=500),
    "sh 500 [000] 12.020500: " + SW.format(pc="sh", pp=500, st="X", nc="swapper/0", np=0),
]


def test_a_spawns_wait_for_a_cpu_is_charged_to_the_threads_that_held_it() -> None:
    bench = schedtrace()
    trace = bench.Trace(TRACE)
    samples = [{"side": "up", "variant": "Stop", "round": 1, "ms": 20.4}]
    daemon = {"pid": 200, "helper_pid": 300, "threads": {"200": "MainThread", "201": "loomd-writer"}}
    result = bench.analyse(trace, samples, daemon, top=3)
    assert result["aligned"] == {"spawns": 1, "mean_abs_ms": 0.1}  # the timed spawn, not the warm-up's
    (stop,) = result["slowest"]["Stop"]
    # the shim waited 0.1 ms for its shell to go to sleep, then 10 ms for the writer's thread and the helper
    assert stop["traced_ms"] == 20.5 and stop["waited_for_cpu_ms"] == 10.1
    assert stop["held_by"] == {"daemon:loomd-writer": 8.0, "helper": 2.0, "spawn:sh": 0.1}
    # what ran: the shell 1.0 ms before it waited on the shim and 0.5 after, the shim 1.9 ms before its wait, 6.9 after
    assert stop["ran_ms"] == 10.3
    assert result["held_by_total_ms"] == {"daemon:loomd-writer": 8.0, "helper": 2.0, "spawn:sh": 0.1}
