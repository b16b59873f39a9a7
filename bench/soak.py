"""Soak: a mixed load on a real daemon for a given time; throughput, latencies, errors, memory and descriptors.

Agents (hook events as the shim sends them: a fresh connection per event, the `hook` op, context events asking
for their block), a searcher (`search`), a planner (`context` start and prompt), a writer (`store`) and the
workers (`workers_run`, when the daemon has that op) run together against one `python -m loomd serve` on a
private LOOMD_HOME (or `--socket` of a running daemon). The daemon's RSS, open descriptors and threads are sampled
every second. Errors must be 0 and RSS flat after warm-up. Prints one JSON object on stdout.

`--fixed-size` (issue #17) holds the store's size constant by GC, at 10 hook events a second per agent (the load the
observer keeps up with here: see FIXED_SIZE_RATE), under retention set explicitly (none is on by default): raw
events are purged a minute after the observer passed them (`event_ttl_days`, and the evidence passages made from
them with them), each project keeps at most 300 live memories (`project_memory_cap`), archived memories are deleted
a minute after (`archived_ttl_days`), the working set (what GC never touches: memories injected or hit recently)
spans the last minute, not a week (`working_set_days`: at the soak's pace a week is its whole life, and everything
ever injected would be kept), the workers' runs are kept a minute (`job_history_days`), the workers run every 10 s.
The samples then add the database's bytes (file and WAL: `db_mb`; the pages holding data, without the free list:
`live_mb`) and the offload process's RSS (the embedding model lives there); the slopes are taken over each and over
the sum of the RSSs, and the JSON ends with the database's largest tables and indexes (`db_tables`, MB and rows,
read after the daemon stopped).

Slopes: `..._after_warmup` skips the first 10% of the run (at least 3 s). Under `--fixed-size` the store only
reaches its constant size once the retention chain has run through once (events live `event_ttl_days`, are observed
after `observe_idle_s`, their memories archived and then deleted `archived_ttl_days` later, each step on a worker
interval): `..._settled` skips that long too (`settle_s`, 160 s with the settings above) and is the number to judge
a fixed size by. The live memories take longer (FIXED_FILL_S), so under `--fixed-size` the measured `--seconds` follow
a fill of the same load (`--fill-s`, 600 s by default, in `params`): every `after_warmup`, `settled` and third is
then taken over the measured span alone, and `rows_held` shows whether the store held its size through it.
`anon_mb` is the daemon's anonymous RSS (heaps: Python's, SQLite's, malloc's arenas), `file_mb` its mapped files;
`sqlite_mb`, `malloc_used_mb`, `malloc_kept_mb` and `python_blocks` split the anonymous part as the daemon itself
counts it (`status`'s `memory`). `settled` splits the settled span into thirds: each third's max and
the last third's slope tell a high-water mark (what fills up to a bound: a cache, an arena; the last third no higher
than the middle one, its slope ~0) from growth (both keep rising). `events_held` splits what the store holds into
what the observer has not passed yet (`unobserved`: GC may not purge it, whatever its age; it stays small while the
observer keeps up) and the rest (`observed`: what the retention holds constant); `rows_held` does the same for the
rest of the store (ROWS_HELD): live and archived memories, evidence passages, their links, edges and pairs, and
sessions, the one part that grows with the run by design (a row per session, kept for the tailer's offset).

    python bench/soak.py [--seconds 300 | --quick] [--agents 4] [--rate 25 (10 with --fixed-size)] [--socket PATH]
                         [--fixed-size [--fill-s 600]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd import protocol  # noqa: E402
from loomd.client import AsyncClient, Client, RemoteError  # noqa: E402

WORDS = ("parser", "fixture", "migration", "flaky", "timeout", "retry", "cache", "schema", "index", "worker",
         "socket", "deadline", "release", "tokenizer", "pytest", "docker", "lint", "types", "async", "spool")
COMMANDS = ("pytest -q tests/test_{w}.py", "ruff check loomd/{w}.py", "git diff --stat", "make {w}",
            "python -m loomd.{w} --help", "grep -rn {w} loomd/")


class Stats:
    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter[str] = Counter()
        self.busy: Counter[str] = Counter()
        self.over_deadline: Counter[str] = Counter()
        self.first_errors: list[str] = []

    def ok(self, op: str, seconds: float, deadline_s: float | None = None) -> None:
        self.latencies[op].append(seconds)
        if deadline_s is not None and seconds > deadline_s:
            self.over_deadline[op] += 1

    def fail(self, op: str, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, RemoteError) else type(exc).__name__
        if code == "busy":
            self.busy[op] += 1
            return
        self.errors[f"{op}:{code}"] += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(f"{op}: {code}: {str(exc)[:200]}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def proc_sample(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            fields[key] = int(value.split()[0])
    # RssAnon is the heap (Python's and SQLite's, malloc's arenas); RssFile is mapped files (code, the model's
    # tables, the database's shared memory): which of the two grows says where to look.
    return {"rss_mb": round(fields["VmRSS"] / 1024, 1), "anon_mb": round(fields.get("RssAnon", 0) / 1024, 1),
            "file_mb": round(fields.get("RssFile", 0) / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": fields["Threads"]}


def cpu_seconds(pid: int) -> float:
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- load generators


async def hook_once(sock: Path, args: dict[str, Any]) -> dict[str, Any]:
    """One hook event the way the shim sends it: a fresh connection, one frame each way, then close."""
    reader, writer = await asyncio.open_unix_connection(str(sock))
    try:
        writer.write(protocol.encode_frame({"v": 1, "id": 1, "op": "hook", "args": args}))
        await writer.drain()
        (n,) = protocol.HEADER.unpack(await reader.readexactly(4))
        reply = protocol.decode_body(await reader.readexactly(n))
    finally:
        writer.close()
        await writer.wait_closed()
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise RemoteError(str(error.get("code")), str(error.get("message")))
    return reply["result"]


def session_events(rng: random.Random, sid: str, cwd: str) -> list[tuple[str, dict[str, Any]]]:
    """One agent session: start, prompts, tool calls (some failing, some fixed), stops, end."""
    base = {"session_id": sid, "cwd": cwd, "transcript_path": f"{cwd}/transcripts/{sid}.jsonl"}
    out: list[tuple[str, dict[str, Any]]] = [("SessionStart", {**base, "hook_event_name": "SessionStart",
                                                               "source": "startup"})]
    for turn in range(rng.randint(3, 8)):
        w = rng.choice(WORDS)
        out.append(("UserPromptSubmit", {**base, "hook_event_name": "UserPromptSubmit",
                                         "prompt": f"turn {turn}: fix the {w} problem and keep the {rng.choice(WORDS)}"
                                                   f" behaviour; we always use uv, never pip"}))
        for call in range(rng.randint(1, 5)):
            cmd = rng.choice(COMMANDS).format(w=w)
            tid = f"{sid}-{turn}-{call}"
            failed = rng.random() < 0.25
            stdout = ("E   AssertionError: expected 3 got 4\n" * rng.randint(1, 40)) if failed else \
                ("ok " * rng.randint(10, 700))
            out.append(("PreToolUse", {**base, "hook_event_name": "PreToolUse", "tool_name": "Bash",
                                       "tool_use_id": tid, "tool_input": {"command": cmd}}))
            out.append(("PostToolUse", {**base, "hook_event_name": "PostToolUse", "tool_name": "Bash",
                                        "tool_use_id": tid, "tool_input": {"command": cmd},
                                        "tool_response": {"stdout": stdout, "stderr": "", "exit_code": int(failed)}}))
        out.append(("Stop", {**base, "hook_event_name": "Stop",
                             "last_assistant_message": f"Done: the {w} fix is in; tests pass."}))
    out.append(("SessionEnd", {**base, "hook_event_name": "SessionEnd", "reason": "exit"}))
    return out


async def agent(n: int, sock: Path, cwd: str, rate: float, stop: asyncio.Event, stats: Stats) -> None:
    rng = random.Random(n)
    session = 0
    while not stop.is_set():
        session += 1
        for event, payload in session_events(rng, f"soak-{n}-{session}-{os.getpid()}", cwd):
            if stop.is_set():
                return
            context = event in ("SessionStart", "UserPromptSubmit")
            args = {"agent": "claude", "event": event, "raw": json.dumps(payload).encode(),
                    "eid": f"{time.time_ns():016x}-{n:08x}-{rng.getrandbits(32):08x}", "context": context,
                    "deadline_ms": 150 if context else 1000}
            t0 = time.perf_counter()
            try:
                await hook_once(sock, args)
            except (RemoteError, OSError, asyncio.IncompleteReadError) as exc:
                stats.fail(f"hook:{event}" if context else "hook", exc)
            else:
                stats.ok(f"hook:{event}" if context else "hook", time.perf_counter() - t0,
                         0.15 if context else 1.0)
            await asyncio.sleep(rng.expovariate(rate))


async def persistent(name: str, sock: Path, stop: asyncio.Event, stats: Stats, pause: float,
                     make: Any) -> None:
    """One long-lived connection (CLI, MCP server) calling `make()` -> (op, args) in a loop."""
    async with AsyncClient(sock) as client:
        while not stop.is_set():
            op, args = make()
            t0 = time.perf_counter()
            try:
                await client.call(op, args)
            except (RemoteError, OSError) as exc:
                stats.fail(op, exc)
            else:
                stats.ok(op, time.perf_counter() - t0)
            await asyncio.sleep(pause)


async def sampler(pid: int | None, sock: Path, stop: asyncio.Event, every: float, t0: float,
                  series: list[dict[str, Any]], db: Path | None) -> None:
    # Read-only, outside any transaction between samples: it never holds a checkpoint back.
    live = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None) if db is not None else None
    async with AsyncClient(sock) as client:
        while not stop.is_set():
            row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
            if pid is not None:
                row.update(proc_sample(pid))
            status = await client.call("status")
            row.update(events=status["counts"]["events"], memories=status["counts"]["memories"],
                       queue=status["queue_depth"], inflight=status["inflight"], spool=status["spool_backlog"],
                       db_mb=round(status["db_bytes"] / 2**20, 2))
            row.update({k: v for k, v in (status.get("memory") or {}).items() if k in MEMORY_PARTS})
            if live is not None:
                with contextlib.suppress(sqlite3.Error):
                    pages, free, size = (live.execute(f"PRAGMA {p}").fetchone()[0]
                                         for p in ("page_count", "freelist_count", "page_size"))
                    row["live_mb"] = round((pages - free) * size / 2**20, 2)
                    # Events the observer has not passed yet: GC may not purge them, whatever their age. A
                    # retention holds the rest constant; this part is the observer's lag.
                    row["unobserved"] = live.execute(UNOBSERVED).fetchone()[0]
                    row.update(zip(ROWS_HELD, live.execute(ROWS_HELD_SQL).fetchone(), strict=True))
            child = (status.get("offload") or {}).get("pid")
            if pid is not None and child:
                with contextlib.suppress(OSError, KeyError):
                    row["offload_rss_mb"] = proc_sample(child)["rss_mb"]
                    row["total_rss_mb"] = round(row["rss_mb"] + row["offload_rss_mb"], 1)
            series.append(row)
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
    if live is not None:
        live.close()


async def soak(sock: Path, pid: int | None, opts: argparse.Namespace, cwd: str, db: Path | None) -> dict[str, Any]:
    stats = Stats()
    stop = asyncio.Event()
    rng = random.Random(7)
    with Client(sock) as c:
        ops = set()
        try:
            c.call("no_such_op_soak_probe")
        except RemoteError as exc:
            ops = {o.strip() for o in str(exc).split("known:", 1)[-1].split(",")}
        for w in WORDS:  # something to find from the first second
            c.call("store", text=f"the {w} module: run `make {w}` before committing", kind="procedure", cwd=cwd)
    workers = [w for w in ("observer", "reflector", "dropper", "digest", "gc") if "workers_run" in ops]

    def search() -> tuple[str, dict[str, Any]]:
        return "search", {"query": " ".join(rng.sample(WORDS, 2)), "cwd": cwd, "limit": 10}

    def context() -> tuple[str, dict[str, Any]]:
        if rng.random() < 0.5:
            return "context", {"kind": "start", "session_id": f"ctx-{rng.randint(0, 50)}", "cwd": cwd}
        return "context", {"kind": "prompt", "session_id": f"ctx-{rng.randint(0, 50)}", "cwd": cwd,
                           "prompt": f"how do we handle the {rng.choice(WORDS)} {rng.choice(WORDS)}?"}

    def store() -> tuple[str, dict[str, Any]]:
        w = rng.choice(WORDS)
        return "store", {"text": f"decision {rng.getrandbits(24)}: the {w} uses {rng.choice(WORDS)}, not "
                                 f"{rng.choice(WORDS)}", "kind": "decision", "cwd": cwd}

    def worker() -> tuple[str, dict[str, Any]]:
        return "workers_run", {"name": rng.choice(workers)}

    series: list[dict[str, Any]] = []
    t0 = time.monotonic()
    cpu0 = cpu_seconds(pid) if pid else None
    tasks = [asyncio.create_task(agent(n, sock, cwd, opts.rate, stop, stats)) for n in range(opts.agents)]
    tasks += [asyncio.create_task(persistent("search", sock, stop, stats, 0.02, search)),
              asyncio.create_task(persistent("context", sock, stop, stats, 0.05, context)),
              asyncio.create_task(persistent("store", sock, stop, stats, 0.5, store)),
              asyncio.create_task(sampler(pid, sock, stop, 1.0, t0, series, db))]
    if workers:
        tasks.append(asyncio.create_task(persistent("workers", sock, stop, stats, 3.0, worker)))
    await asyncio.sleep(opts.fill_s + opts.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    per_op = {}
    for op, values in sorted(stats.latencies.items()):
        per_op[op] = {"count": len(values), "per_s": round(len(values) / elapsed, 1),
                      "p50_ms": round(pct(values, 0.5) * 1000, 2), "p99_ms": round(pct(values, 0.99) * 1000, 2),
                      "max_ms": round(max(values) * 1000, 2)}
    out: dict[str, Any] = {
        "elapsed_s": round(elapsed, 1), "ops": per_op,
        "throughput_per_s": round(sum(len(v) for v in stats.latencies.values()) / elapsed, 1),
        "errors": sum(stats.errors.values()), "errors_by_op": dict(stats.errors), "first_errors": stats.first_errors,
        "busy": sum(stats.busy.values()), "busy_by_op": dict(stats.busy),
        "over_shim_deadline": dict(stats.over_deadline), "workers": workers or "no workers_run op",
    }
    if pid is not None and series:
        warm = opts.fill_s + max(3.0, opts.seconds * 0.1)
        steady = [r for r in series if r["t"] >= warm] or series
        if opts.fill_s:  # the store reached its size during the fill: the whole measured span counts
            settle = opts.fill_s
        else:
            settle = max(warm, settle_s(FIXED_SIZE)) if opts.fixed_size else warm
        settled = [r for r in series if r["t"] >= settle] or steady
        out["settle_s"] = settle
        half = [r for r in steady if r["t"] >= steady[0]["t"] + (steady[-1]["t"] - steady[0]["t"]) / 2] or steady
        first_half = [r for r in series if r["t"] <= series[-1]["t"] / 2] or series
        out["rss_mb"] = {"start": series[0]["rss_mb"], "after_warmup": steady[0]["rss_mb"], "end": series[-1]["rss_mb"],
                         "max": max(r["rss_mb"] for r in series),
                         "first_half_max": max(r["rss_mb"] for r in first_half),
                         "growth_after_warmup": round(series[-1]["rss_mb"] - steady[0]["rss_mb"], 1),
                         "slope_mb_per_min_second_half": round(slope(half, "rss_mb") * 60, 2),
                         "slope_mb_per_min_after_warmup": round(slope(steady, "rss_mb") * 60, 2),
                         "slope_mb_per_min_settled": round(slope(settled, "rss_mb") * 60, 2),
                         "settled": thirds(settled, "rss_mb")}
        for key in ("anon_mb", "file_mb", *MEMORY_PARTS):
            if all(key in r for r in series):
                out[key] = {"after_warmup": steady[0][key], "end": series[-1][key], "max": max(r[key] for r in series),
                            "slope_per_min_settled": round(slope(settled, key) * 60, 2),
                            "settled": thirds(settled, key)}
        if all("total_rss_mb" in r for r in series):
            out["total_rss_mb"] = {"after_warmup": steady[0]["total_rss_mb"], "end": series[-1]["total_rss_mb"],
                                   "max": max(r["total_rss_mb"] for r in series),
                                   "slope_mb_per_min_after_warmup": round(slope(steady, "total_rss_mb") * 60, 2),
                                   "slope_mb_per_min_settled": round(slope(settled, "total_rss_mb") * 60, 2),
                                   "settled": thirds(settled, "total_rss_mb")}
        out["db_mb"] = {"after_warmup": steady[0]["db_mb"], "end": series[-1]["db_mb"],
                        "slope_mb_per_min_after_warmup": round(slope(steady, "db_mb") * 60, 3),
                        "slope_mb_per_min_settled": round(slope(settled, "db_mb") * 60, 3)}
        if all("live_mb" in r for r in steady):
            out["live_mb"] = {"after_warmup": steady[0]["live_mb"], "end": series[-1]["live_mb"],
                              "max": max(r["live_mb"] for r in steady),
                              "slope_mb_per_min_after_warmup": round(slope(steady, "live_mb") * 60, 3),
                              "slope_mb_per_min_settled": round(slope(settled, "live_mb") * 60, 3)}
        if all("offload_rss_mb" in r for r in steady):
            out["offload_rss_mb"] = {"after_warmup": steady[0]["offload_rss_mb"], "end": series[-1]["offload_rss_mb"],
                                     "max": max(r["offload_rss_mb"] for r in series),
                                     "slope_mb_per_min_after_warmup": round(slope(steady, "offload_rss_mb") * 60, 2),
                                     "slope_mb_per_min_settled": round(slope(settled, "offload_rss_mb") * 60, 2)}
        out["events_held"] = {"after_warmup": steady[0]["events"], "settled": settled[0]["events"],
                              "end": series[-1]["events"], "max": max(r["events"] for r in settled),
                              "slope_per_min_settled": round(slope(settled, "events") * 60, 1),
                              "settled_thirds": thirds(settled, "events")}
        if all("unobserved" in r for r in settled):
            # Held = unobserved (the observer's backlog) + observed and not yet past `event_ttl_days`: under a
            # fixed size the second part is what GC holds constant, the first what the observer keeps small.
            for r in settled:
                r["observed_held"] = r["events"] - r["unobserved"]
            out["events_held"]["unobserved"] = {"settled": settled[0]["unobserved"], "end": series[-1]["unobserved"],
                                                "max": max(r["unobserved"] for r in settled),
                                                "slope_per_min_settled": round(slope(settled, "unobserved") * 60, 1)}
            out["events_held"]["observed"] = {"settled": settled[0]["observed_held"],
                                              "end": settled[-1]["observed_held"],
                                              "max": max(r["observed_held"] for r in settled),
                                              "slope_per_min_settled": round(slope(settled, "observed_held") * 60, 1)}
        if all(key in r for r in settled for key in ROWS_HELD):
            out["rows_held"] = {key: {"settled": settled[0][key], "end": settled[-1][key],
                                      "max": max(r[key] for r in settled),
                                      "slope_per_min_settled": round(slope(settled, key) * 60, 1),
                                      "max_by_third": thirds(settled, key)["max_by_third"]} for key in ROWS_HELD}
        # What stays open: the least over the last quarter. A leak raises it; a connection held only while a worker
        # run or a client's call is in flight (the reflector reads on a connection of its own per run) does not.
        out["fds"] = {"start": series[0]["fds"], "after_warmup": steady[0]["fds"], "end": series[-1]["fds"],
                      "max": max(r["fds"] for r in series),
                      "last_quarter_min": min(r["fds"] for r in series[-max(1, len(series) // 4):])}
        out["threads"] = {"start": series[0]["threads"], "end": series[-1]["threads"],
                          "max": max(r["threads"] for r in series)}
        assert cpu0 is not None
        out["daemon_cpu_s"] = round(cpu_seconds(pid) - cpu0, 1)
    out["series"] = series
    return out


# The store's rows by what holds them: live memories (the per-project cap and the working set), archived ones (until
# `archived_ttl_days` deletes them), evidence passages (their events' retention), the links and pairs hanging on
# them, and sessions (one row each for good: the tailer resumes a transcript from its offset there).
ROWS_HELD = ("memories_live", "memories_archived", "evidence", "memory_sources", "edges", "memory_near", "sessions")
ROWS_HELD_SQL = ("SELECT sum(archived_at IS NULL AND kind != 'evidence'), sum(archived_at IS NOT NULL),"
                 " sum(archived_at IS NULL AND kind = 'evidence'), (SELECT count(*) FROM memory_sources),"
                 " (SELECT count(*) FROM edges), (SELECT count(*) FROM memory_near), (SELECT count(*) FROM sessions)"
                 " FROM memories")
UNOBSERVED = ("SELECT count(*) FROM events e LEFT JOIN checkpoints c ON c.name = 'observer:' || e.session_id"
              " WHERE e.id > coalesce(CAST(c.value AS INTEGER), 0)")


def thirds(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """`key` over the first, middle and last third of `rows` (by time): each third's max and the slope of the last
    third. What only fills up to a bound (a cache, an arena's high-water mark, a table reaching its retention) stops
    rising: the last third's max is no higher than the middle third's and its slope is ~0. Growth keeps both up."""
    if len(rows) < 6:
        return {}
    t0, t1 = rows[0]["t"], rows[-1]["t"]
    cut = [t0 + (t1 - t0) * i / 3 for i in (1, 2)]
    parts = [[r for r in rows if r["t"] < cut[0]], [r for r in rows if cut[0] <= r["t"] < cut[1]],
             [r for r in rows if r["t"] >= cut[1]]]
    return {"max_by_third": [max(r[key] for r in part) for part in parts],
            "slope_per_min_last_third": round(slope(parts[2], key) * 60, 2)}


def slope(rows: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of `key` over `t` (units per second)."""
    if len(rows) < 2:
        return 0.0
    ts = [r["t"] for r in rows]
    ys = [r[key] for r in rows]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


# --fixed-size: what GC keeps (events a minute after they were observed, 300 live memories a project, archived ones a
# minute).
# The daemon's own account of its anonymous memory (`status`'s `memory`, loomd/memory.py): SQLite's allocations, the
# heap's bytes in use and freed-but-kept, Python's objects (a count); which of them grows tells a cache filling up to
# its bound, a heap that is not handed back and objects that pile up apart.
MEMORY_PARTS = ("sqlite_mb", "malloc_used_mb", "malloc_kept_mb", "malloc_heaps", "python_blocks")
# A store held at a fixed size needs an observer that keeps up: at 25 events a second per agent (with the searcher,
# the planner and the writer) the soak takes both CPUs of a 2-CPU machine, the workers get only their slices of an
# unbroken stream of hooks, and the events waiting for the observer grew by ~500 a minute, so the store grew with them.
FIXED_SIZE_RATE = 10.0
FIXED_SIZE = {"LOOMD_EVENT_TTL_DAYS": str(60 / 86400), "LOOMD_PROJECT_MEMORY_CAP": "300",
              "LOOMD_ARCHIVED_TTL_DAYS": str(60 / 86400), "LOOMD_WORKING_SET_DAYS": str(60 / 86400),
              "LOOMD_WORKER_INTERVAL_S": "10", "LOOMD_OBSERVE_IDLE_S": "20", "LOOMD_JOB_HISTORY_DAYS": str(60 / 86400)}


# How long the fixed-size store takes to reach its size, measured: the retention chain runs through in `settle_s`,
# but the live memories reach theirs only when the working set does (what the searches hit within a minute, which
# grows with what there is to hit). In 10-minute runs begun on an empty store the live memories still rose 5 to 15
# a minute and the pairs (`memory_near`) up to 620 a minute in the last third; in a 20-minute run both stopped in
# its second half (closing notes, stops 38 and 39). So the measured minutes begin after a fill of this long.
FIXED_FILL_S = 600.0


def settle_s(env: dict[str, str]) -> float:
    """How long the fixed-size retention takes to reach a constant size: an event's TTL, the wait until its session
    is observed, the archived memories' TTL, and a worker interval for each of the two GC steps."""
    days = float(env["LOOMD_EVENT_TTL_DAYS"]) + float(env["LOOMD_ARCHIVED_TTL_DAYS"])
    return days * 86400 + float(env["LOOMD_OBSERVE_IDLE_S"]) + 2 * float(env["LOOMD_WORKER_INTERVAL_S"])


def db_tables(db: Path, top: int = 12) -> list[dict[str, Any]]:
    """The largest tables and indexes of the file (SQLite's `dbstat`): what a store that grows grows in."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        sizes = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC LIMIT ?",
                             (top,)).fetchall()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        return [{"name": name, "mb": round(size / 2**20, 2),
                 **({"rows": conn.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]} if name in tables else {})}
                for name, size in sizes]


def start_daemon(home: Path, embedder: str, extra: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[bytes], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
    env.update(LOOMD_HOME=str(home), LOOMD_EMBEDDER=embedder, LOOMD_CODEX_HOME=str(home / "codex"), **(extra or {}))
    t0 = time.monotonic()
    with open(home / "daemon.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO)
    while time.monotonic() - t0 < 60:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode}: {(home / 'daemon.log').read_text()[-2000:]}")
        try:
            with Client(home / "loomd.sock", timeout=2) as c:
                c.call("ping")
            return proc, time.monotonic() - t0
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.02)
    proc.kill()
    raise TimeoutError("the daemon did not come up")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="30 seconds")
    parser.add_argument("--agents", type=int, default=4, help="concurrent agents sending hook events")
    parser.add_argument("--rate", type=float, default=None,
                        help=f"hook events per second per agent (default 25; {FIXED_SIZE_RATE:g} with --fixed-size)")
    parser.add_argument("--socket", type=Path, default=None, help="soak a running daemon instead of a fresh one")
    parser.add_argument("--embedder", default="local", help="LOOMD_EMBEDDER for the fresh daemon")
    parser.add_argument("--no-series", action="store_true", help="leave the per-second samples out of the JSON")
    parser.add_argument("--fixed-size", action="store_true", help="GC holds the store's size constant (see above)")
    parser.add_argument("--fill-s", type=float, default=None,
                        help=f"seconds of the same load before the measured --seconds (default {FIXED_FILL_S:g} with"
                             " --fixed-size, else 0): the store fills to its fixed size first")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.seconds = 30.0
    if opts.fill_s is None:
        opts.fill_s = FIXED_FILL_S if opts.fixed_size and not opts.quick else 0.0
    if opts.rate is None:
        opts.rate = FIXED_SIZE_RATE if opts.fixed_size else 25.0
    report: dict[str, Any] = {
        "bench": "soak",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
        "params": {"seconds": opts.seconds, "fill_s": opts.fill_s, "agents": opts.agents, "rate_per_agent": opts.rate,
                   "embedder": opts.embedder, "socket": str(opts.socket) if opts.socket else "fresh daemon",
                   "fixed_size": FIXED_SIZE if opts.fixed_size else None},
    }
    root = Path(tempfile.mkdtemp(prefix="lsk", dir="/tmp"))
    proc = None
    try:
        if opts.socket is None:
            home = root / "h"
            home.mkdir(mode=0o700)
            proc, ready = start_daemon(home, opts.embedder, FIXED_SIZE if opts.fixed_size else None)
            report["daemon_ready_s"] = round(ready, 3)
            sock, pid, db = home / "loomd.sock", proc.pid, home / "loomd.db"
        else:
            sock, pid, db = opts.socket, None, None
        (root / "work").mkdir()
        with Client(sock) as c:
            report["versions"] = c.call("status")["versions"]
        report.update(asyncio.run(soak(sock, pid, opts, str(root / "work"), db)))
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            report["daemon_exit"] = proc.wait(60)
            log = (home / "daemon.log").read_text()
            notable = Counter(line.split(" ", 2)[-1][:160] for line in log.splitlines()
                              if " WARNING " in line or " ERROR " in line)
            report["daemon_log"] = {"errors": log.count(" ERROR "), "warnings": log.count(" WARNING "),
                                    "tracebacks": log.count("Traceback"), "top": notable.most_common(5)}
            if "Traceback" in log:  # the first one whole: what an `internal` error was
                start = log.index("Traceback")
                report["daemon_log"]["first_traceback"] = log[start:start + 3000].split("\n20", 1)[0]
            if opts.fixed_size:
                report["db_tables"] = db_tables(home / "loomd.db")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if opts.no_series:
        report.pop("series", None)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
