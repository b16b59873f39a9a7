"""Does the daemon's background work leave the CPU to the user's other sessions, and does a search stay quick on a
machine the user keeps busy? (`loomd.offload.SchedulingGroup`)

- job: a CPU-bound job of one process per CPU (a build or a test run), started from this process's session as the
  agent's would be, timed alone and then while a daemon catches up on an N-event import with its embedder and
  workers (bench/hooks.py's catch-up: the daemon in a session of its own, as its service manager starts it).
  `slowdown` is the median during the catch-up over the median alone: 1.0 when the background took nothing from it.
  The jobs are timed once the workers have begun, each followed by a look at what the catch-up still had to do
  (`work_left`: a job timed after it finished measured an idle daemon); `observed_during_jobs` is how far it went
  meanwhile (the price of yielding: a catch-up that yields progresses less while the user's job runs).
- search: `search` round trips to a daemon holding a few memories and their vectors, first on an idle machine, then
  with one busy loop per CPU running in this session. A search's query is embedded on the helper's query lane,
  which the helper's own scheduling group must not starve.

    python bench/yields.py [--events 20000] [--jobs 3] [--searches 30] [--repo DIR]

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
hooks = importlib.import_module("hooks")  # bench/hooks.py: the daemon, the catch-up and its progress

JOB = "s = 0\nfor i in range(12_000_000):\n    s += i\n"  # about 0.7 s of one CPU here
BUSY = "while True:\n    pass\n"


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def job() -> float:
    """One process per CPU running JOB; seconds until the last one ends."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", JOB]) for _ in range(cpus())]
    for proc in procs:
        proc.wait()
    return round(time.perf_counter() - start, 3)


def latencies(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "p50_ms": round(hooks.percentile(s, 0.5), 2), "p90_ms": round(hooks.percentile(s, 0.9), 2),
            "max_ms": round(s[-1], 2)}


def searches(home: Path, n: int) -> dict[str, float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        hooks.call(home, "search", query=f"which package manager for dependency change {i}, and why", limit=5)
        times.append((time.perf_counter() - start) * 1000)
        time.sleep(0.1)
    return latencies(times)


def measure_job(root: Path, events: int, runs: int, repo: Path) -> dict[str, Any]:
    alone = [job() for _ in range(runs)]
    home = root / "catchup"
    home.mkdir()
    (home / "config.toml").write_text("".join(f"{k} = {v}\n" for k, v in hooks.CATCHUP_CONFIG.items()))
    proc, _ = hooks.start_daemon(sys.executable, home, 60, repo)
    try:
        hooks.BackgroundImport(root, home, events, repo).wait()
        # The workers take the imported sessions after `observe_idle_s`: time the jobs once they have begun.
        deadline = time.monotonic() + 60
        while (began := hooks.catchup(home))["observed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        during, left = [], []
        for _ in range(runs):
            during.append(job())
            now = hooks.catchup(home)
            left.append({"vectors": now["vectors_pending"], "events": now["events"] - now["observed"],
                         "observations": now["observations"] - now["reflected"]})
    finally:
        hooks.stop_daemon(proc)
    return {"processes": cpus(), "alone_s": alone, "during_catchup_s": during,
            "slowdown": round(statistics.median(during) / statistics.median(alone), 2),
            "observed_during_jobs": now["observed"] - began["observed"], "work_left": left,
            "catchup_ran_through": all(any(v for v in w.values()) for w in left)}


def measure_search(root: Path, runs: int, repo: Path) -> dict[str, Any]:
    home = root / "search"
    home.mkdir()
    proc, _ = hooks.start_daemon(sys.executable, home, 60, repo)
    try:
        for i in range(30):
            hooks.call(home, "store", text=f"Decision {i}: use uv for dependency change {i}, never pip",
                       kind="decision", cwd=hooks.PROJECT)
        deadline = time.monotonic() + 60
        while hooks.call(home, "status")["embedder"].get("pending") and time.monotonic() < deadline:
            time.sleep(0.2)
        idle = searches(home, runs)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(cpus())]
        try:
            time.sleep(1)
            loaded = searches(home, runs)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    finally:
        hooks.stop_daemon(proc)
    return {"idle_machine": idle, "busy_machine": loaded,
            "slowdown_p50": round(loaded["p50_ms"] / idle["p50_ms"], 2) if idle["p50_ms"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000, help="the imported history the daemon catches up on")
    parser.add_argument("--jobs", type=int, default=3, help="timed jobs alone, and as many during the catch-up")
    parser.add_argument("--searches", type=int, default=30, help="searches timed on each side")
    parser.add_argument("--repo", type=Path, default=hooks.REPO, help="the checkout whose daemon is measured")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="loomd-yields-"))
    try:
        report = {"repo": str(opts.repo), "cpus": cpus(),
                  "job": measure_job(root, opts.events, opts.jobs, opts.repo),
                  "search": measure_search(root, opts.searches, opts.repo)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
