"""What held the CPU while each hook waited for one: `bench/hooks.py` under a scheduler trace (issue #17's tails).

    python bench/schedtrace.py [--top K] [--keep DIR] -- [bench/hooks.py arguments]

Runs Linux's `perf record` machine-wide on the scheduler's events (a task switched in or out, woken, forked, exec'd)
around `bench/hooks.py ... --samples`, then reads the trace back (`perf script`). Each timed spawn of the daemon-up
side is found in it (the bench's children, matched to the samples in order and by wall time) with, over its
processes (the shell and the shim): the time they ran, the time they waited runnable for a CPU, and who held that
CPU meanwhile: the daemon's threads by name (`status`'s `threads`), its helper process, the spawn's own other process,
the bench itself, or any other task by its command name. Prints one JSON object: the bench's verdict per kind, each
kind's K slowest spawns with that breakdown, and, over every spawn, how long each holder kept a waiting spawn off
its CPU.

Needs `perf` (Debian: linux-perf) and the right to trace the scheduler (root, or kernel.perf_event_paranoid <= -1);
as root, run it with the project's interpreter (`sudo .venv/bin/python bench/schedtrace.py ...`).
The trace costs the machine: spawns run slower under it, so compare runs traced alike.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EVENTS = ",".join(f"sched:sched_{e}" for e in ("switch", "wakeup", "wakeup_new", "process_fork", "process_exec"))
LINE = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")
# The one baseline whose spawns are broken down too: the interpreter floor, what the hooks are measured against.
FLOOR = "python_floor"


class Trace:
    """The scheduler's story from `perf script` lines: per task its forks, execs, run and runnable-wait intervals; per
    CPU who ran from when."""

    def __init__(self, lines: Iterable[str]) -> None:
        self.parent: dict[int, int] = {}
        self.forked: dict[int, float] = {}
        self.exec: dict[int, str] = {}
        self.comm: dict[int, str] = {}
        self.last: dict[int, float] = {}
        self.events = 0  # the scheduler's events read
        self.ran: dict[int, float] = defaultdict(float)
        self.waits: dict[int, list[tuple[float, float, int]]] = defaultdict(list)  # (from, to, the CPU it got)
        self.cpu: dict[int, list[tuple[float, int]]] = defaultdict(list)  # CPU -> (since, tid) in time order
        state: dict[int, tuple[str, float]] = {}

        def now_in(tid: int, kind: str, t: float, cpu: int = -1) -> None:
            was = state.get(tid)
            if was is not None:
                if was[0] == "run":
                    self.ran[tid] += t - was[1]
                elif was[0] == "wait":
                    self.waits[tid].append((was[1], t, cpu))
            state[tid] = (kind, t)
            self.last[tid] = t

        for line in lines:
            m = LINE.match(line)
            if m is None:
                continue
            _, _, cpu, at, event, rest = m.groups()
            t, f = float(at), dict(FIELD.findall(rest))
            if event in ("sched_switch", "sched_wakeup", "sched_wakeup_new") and not ("pid" in f or "prev_pid" in f):
                raise SystemExit("perf script printed the scheduler's events as comm:pid (libtraceevent's plugins);"
                                 " this reads them as key=value, perf's own form")
            self.events += 1
            if event == "sched_switch":
                prev, nxt = int(f["prev_pid"]), int(f["next_pid"])
                self.comm[prev], self.comm[nxt] = f["prev_comm"], f["next_comm"]
                self.cpu[int(cpu)].append((t, nxt))
                if prev:
                    now_in(prev, "wait" if f["prev_state"].startswith("R") else "off", t)
                if nxt:
                    now_in(nxt, "run", t, int(cpu))
            elif event in ("sched_wakeup", "sched_wakeup_new"):
                tid = int(f["pid"])
                if state.get(tid, ("", 0.0))[0] not in ("run", "wait"):  # a task preempted is woken while queued
                    now_in(tid, "wait", t)
            elif event == "sched_process_fork":
                child = int(f["child_pid"])
                for held in (self.ran, self.waits, self.exec, self.comm, state):  # a Linux id used again: a new task
                    held.pop(child, None)
                self.parent[child], self.forked[child], self.last[child] = int(f["pid"]), t, t
            elif event == "sched_process_exec":
                self.exec[int(f["pid"])] = f["filename"]
        self.children: dict[int, list[int]] = defaultdict(list)
        for child, parent in self.parent.items():
            self.children[parent].append(child)
        self._starts = {c: [since for since, _ in runs] for c, runs in self.cpu.items()}

    def tree(self, tid: int) -> list[int]:
        out = [tid]
        for child in self.children.get(tid, ()):
            out += self.tree(child)
        return out

    def ancestors(self, tid: int) -> list[int]:
        """The task's forks up, nearest first."""
        out: list[int] = []
        while tid in self.parent and tid not in out:
            tid = self.parent[tid]
            out.append(tid)
        return out

    def process_of(self, tid: int) -> int:
        """The task's process: up its forks to the nearest that exec'd (a thread never does), or its first ancestor."""
        line = [tid, *self.ancestors(tid)]
        return next((t for t in line if t in self.exec), line[-1])

    def holders(self, start: float, end: float, cpu: int) -> dict[int, float]:
        """Who ran on `cpu` from `start` to `end`, in seconds by task (idle left out)."""
        held: dict[int, float] = defaultdict(float)
        runs, starts = self.cpu.get(cpu, []), self._starts.get(cpu, [])
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(runs) and runs[i][0] < end:
            until = runs[i + 1][0] if i + 1 < len(runs) else end
            span = min(end, until) - max(start, runs[i][0])
            if span > 0 and runs[i][1]:
                held[runs[i][1]] += span
            i += 1
        return held


def analyse(trace: Trace, samples: list[dict[str, Any]], daemon: dict[str, Any], top: int,
            baselines: Iterable[str] = ()) -> dict[str, Any]:
    """The daemon-up side's timed spawns found in the trace, and what kept each off a CPU while it waited; of the
    bench's `baselines`, only the floor's slowest are shown."""
    timed = [s for s in samples if s["side"] == "up"]
    unshown = set(baselines) - {FLOOR}
    pid, helper = daemon.get("pid"), daemon.get("helper_pid")
    names = {int(k): v for k, v in (daemon.get("threads") or {}).items()}
    if pid not in trace.parent:
        raise SystemExit(f"the daemon's start is not in the trace ({trace.events} scheduler events read)")
    bench = trace.parent[pid]
    spawns = [c for c in sorted(trace.children.get(bench, ()), key=lambda c: trace.forked.get(c, 0.0))
              if c != pid and trace.forked.get(c, 0.0) > trace.forked[pid]]

    def wall_ms(child: int) -> float:
        return (max(trace.last.get(t, 0.0) for t in trace.tree(child)) - trace.forked[child]) * 1000

    walls = [wall_ms(c) for c in spawns]
    # The timed spawns are among the bench's children started after the daemon (with the import's process, the
    # warm-up round and any quiet side before them): at the offset where their walls match the samples' best. Rounds
    # run the variants in one order, so an offset off by any spawn pairs a python spawn with a shell's or another
    # round's; the mean error says how well it matched.
    best: tuple[float, int] | None = None
    for off in range(0, len(spawns) - len(timed) + 1):
        err = sum(abs(walls[off + i] - s["ms"]) for i, s in enumerate(timed)) / max(1, len(timed))
        if best is None or err < best[0]:
            best = (err, off)
    if best is None:
        raise SystemExit("fewer spawns in the trace than timed samples")
    err, off = best

    def label(tid: int, own: set[int]) -> str:
        if tid in own:
            return "spawn:" + trace.comm.get(tid, "?")
        process = trace.process_of(tid)
        if process == pid:
            return "daemon:" + names.get(tid, f"thread {tid}")  # not in `threads`: a native thread, or one gone
        if process == helper:
            return "helper"
        if pid in trace.ancestors(process):
            return "daemon's child:" + trace.comm.get(tid, "?")  # a helper restarted, the resource tracker
        if process == bench:
            return "bench"
        if trace.parent.get(process) == bench:
            return "bench's other child"  # the import's process, another spawn
        return trace.comm.get(tid, str(tid)).split("/")[0]

    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    overall: dict[str, float] = defaultdict(float)
    for sample, child in zip(timed, spawns[off:], strict=False):
        own = set(trace.tree(child))
        held: dict[str, float] = defaultdict(float)
        for tid in own:
            for start, end, cpu in trace.waits.get(tid, ()):
                for task, secs in trace.holders(start, end, cpu).items():
                    held[label(task, own)] += secs * 1000
        for name, ms in held.items():
            overall[name] += ms
        rows[sample["variant"]].append({
            "round": sample["round"], "ms": sample["ms"], "traced_ms": round(wall_ms(child), 2),
            "ran_ms": round(sum(trace.ran[t] for t in own) * 1000, 2),
            "waited_for_cpu_ms": round(sum(e - s for t in own for s, e, _ in trace.waits.get(t, ())) * 1000, 2),
            "held_by": {k: round(v, 2) for k, v in sorted(held.items(), key=lambda kv: -kv[1])[:5]}})
    return {"aligned": {"spawns": len(timed), "mean_abs_ms": round(err, 3)},
            "slowest": {v: sorted(xs, key=lambda r: -r["ms"])[:top] for v, xs in rows.items()
                        if v not in unshown},
            "held_by_total_ms": {k: round(v, 1) for k, v in sorted(overall.items(), key=lambda kv: -kv[1])[:15]}}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ours, hooks_args = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3, help="slowest spawns shown per kind")
    parser.add_argument("--keep", type=Path, default=None, help="keep the trace, samples and report in DIR")
    opts = parser.parse_args(ours)
    if shutil.which("perf") is None:
        raise SystemExit("needs perf (Debian: apt install linux-perf)")
    work = Path(tempfile.mkdtemp(prefix="loomd-schedtrace-")) if opts.keep is None else opts.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = traced(work, hooks_args, opts.top)
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


def traced(work: Path, hooks_args: list[str], top: int) -> dict[str, Any]:
    """The bench run under `perf record`, its trace read back and analysed; the trace and the bench's files go in
    `work`."""
    data, samples, report = work / "sched.data", work / "samples.json", work / "hooks.json"
    perf = subprocess.Popen(["perf", "record", "-q", "-a", "-k", "mono", "-e", EVENTS, "-o", str(data)],
                            stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # perf has its buffers up
        if perf.poll() is not None:
            why = perf.stderr.read().decode(errors="replace") if perf.stderr else ""
            raise SystemExit(f"perf record failed: {why}")
        with open(report, "wb") as out:
            subprocess.run([sys.executable, str(REPO / "bench" / "hooks.py"), *hooks_args, "--samples", str(samples)],
                           stdout=out, check=True)
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    with open(work / "perf-script.err", "w+") as errors:
        script = subprocess.Popen(["perf", "script", "-i", str(data)], stdout=subprocess.PIPE, stderr=errors,
                                  text=True, errors="replace")
        assert script.stdout is not None
        trace = Trace(script.stdout)
        if script.wait() != 0:
            errors.seek(0)
            raise SystemExit(f"perf script failed: {errors.read()[-2000:]}")
        errors.seek(0)
        lost = [line.strip() for line in errors if "lost" in line.lower()]  # events perf could not keep up with
    hooks = json.loads(report.read_text())
    up = hooks.get("up") or {}
    return {"bench": "schedtrace", "hooks_params": hooks.get("params"), "acceptance": up.get("acceptance"),
            "perf_lost": lost, **analyse(trace, json.loads(samples.read_text()), up.get("daemon") or {}, top,
                                         up.get("baselines") or ())}


if __name__ == "__main__":
    sys.exit(main())
