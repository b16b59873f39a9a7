"""Memory writes as the store grows (issue 21): the one memory-write path, batched and one at a time.

The corpus is bench/search.py's (LoCoMo turns and real transcript texts, then varied copies; one project,
sessions of 40 memories in time order, two years of times), written with loomd's own path (`insert_memory` then
`MemoryWriter.derive`, in `MemoryWriter.atomic()` transactions) into one growing database file per mode:

- batched: 500 memories a transaction, the whole corpus;
- single: one memory a transaction (what a worker or the `store` op does) in the measured windows (the first
  window, the one ending at the middle and the one ending at the end); the stretches between them are filled
  batched (not timed), so the store is as large as the batched one at each window.

Per window: memories/s, per-memory (single) or per-transaction (batched) ms p50/p99, the writer's busy share
(time the write lock was held / wall time of the window) and this process's CPU time per memory (on a shared
machine the cost, where wall time also counts the others' load). `--socket N`: one `store` at a time through a fresh
daemon's socket (embedder off, so only the write path is timed) into one growing store of N; the first and last
N/10. `--backfill N`: a daemon back-fills the vectors of the last N memories of the batched store, every memory
before them already holding a vector (see `prefill_vectors`), timed against the embedder alone on the same N
texts in the same run. `--profile`: the writer's time per SQL statement in each window and the top Python
functions of the last.

Prints one JSON object on stdout (the batched rate at the end under `batched.at_<size>.per_s`, at 100k
`batched.at_100k.per_s`); a table goes to stderr.

    python bench/write.py [--size 100000] [--window 10000] [--modes batched,single] [--socket 20000]
                          [--backfill 2000] [--profile] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import hashlib
import io
import json
import os
import platform
import pstats
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from locomo import DEFAULT_DATA, Daemon  # noqa: E402
from search import END, PROJECT, SESSION_SIZE, SPAN_S, base_items, corpus, percentiles  # noqa: E402

from loomd.store.db import Store  # noqa: E402
from loomd.store.memories import MemoryWriter, insert_memory  # noqa: E402

BATCH = 500


def session_of(i: int) -> str:
    return f"s{i // SESSION_SIZE}"


def created_of(i: int, n: int) -> float:
    return END - SPAN_S + SPAN_S * i / n


class StatementClock:
    """The writer connection's time per statement (the await of each trip to its thread), for `--profile`."""

    def __init__(self, store: Store) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        conn = store.writer
        original = conn._execute

        async def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            key = " ".join(str(args[0]).split())[:110] if args and isinstance(args[0], str) else fn.__name__
            started = time.perf_counter()
            try:
                return await original(fn, *args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1

        conn._execute = timed  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def top(self, n: int, memories: int) -> list[dict[str, Any]]:
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:n]
        return [{"sql": k, "ms_per_memory": round(v * 1000 / memories, 4), "calls_per_memory":
                 round(self.calls[k] / memories, 2), "total_s": round(v, 2)} for k, v in rows]


class Timer:
    """Wall time of a window and the time the write lock was held in it."""

    def __init__(self) -> None:
        self.held = 0.0
        self.samples: list[float] = []

    async def write(self, memories: MemoryWriter, texts: list[str], start: int, n: int) -> None:
        started = time.perf_counter()
        async with memories.atomic() as db:
            ids = []
            for i in range(start, start + len(texts)):
                memory_id, _ = await insert_memory(db, kind="observation", text=texts[i - start], project=PROJECT,
                                                   session_id=session_of(i), created=created_of(i, n))
                ids.append(memory_id)
            await memories.derive(db, ids)
        took = time.perf_counter() - started
        self.held += took
        self.samples.append(took * 1000)


async def grow(path: Path, texts: list[str], mode: str, window: int, profile: bool) -> dict[str, Any]:
    """Write `texts` into a fresh store at `path`; measure the windows."""
    n = len(texts)
    ends = sorted({min(window, n), n // 2, n})
    windows = {(max(0, end - window), end) for end in ends}
    store = await Store.open(path)
    memories = MemoryWriter(store)
    clock = StatementClock(store) if profile else None
    profiler = cProfile.Profile() if profile else None
    out: dict[str, Any] = {}
    try:
        i = 0
        while i < n:
            inside = next(((a, b) for a, b in windows if a <= i < b), None)
            if inside is None:  # filling up to the next window: batched, not timed
                stop = min([a for a, _ in windows if a > i] + [n])
                filler = Timer()
                for start in range(i, stop, BATCH):
                    await filler.write(memories, texts[start : min(start + BATCH, stop)], start, n)
                i = stop
                continue
            a, b = inside
            timer = Timer()
            if clock is not None:
                clock.reset()
            if profiler is not None and b == n:
                profiler.enable()
            started, cpu = time.perf_counter(), time.process_time()
            step = BATCH if mode == "batched" else 1
            for start in range(a, b, step):
                await timer.write(memories, texts[start : min(start + step, b)], start, n)
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            if profiler is not None:
                profiler.disable()
            name = "first" if a == 0 else "at"
            key = f"{name}_{b // 1000}k" if b % 1000 == 0 and b >= 1000 else f"{name}_{b}"
            out[key] = {"from": a, "to": b, "per_s": round((b - a) / wall, 1),
                        ("txn_ms" if mode == "batched" else "ms"): percentiles(timer.samples),
                        "writer_busy_share": round(timer.held / wall, 3),
                        # CPU time of this process (all its threads) per memory: the cost, whatever else runs
                        "cpu_ms_per_memory": round(cpu * 1000 / (b - a), 3)}
            if clock is not None:  # where this window's writer time went, per statement
                out[key]["statements"] = clock.top(8, b - a)
            print(f"{mode} {key}: {out[key]['per_s']}/s", file=sys.stderr, flush=True)
            i = b
        firsts = [v for k, v in out.items() if k.startswith("first")]
        last = out[max(out, key=lambda k: out[k]["to"])]
        if firsts:
            out["last_over_first_time"] = round(firsts[0]["per_s"] / last["per_s"], 3)
        if clock is not None and profiler is not None:
            stats = io.StringIO()
            pstats.Stats(profiler, stream=stats).sort_stats("cumulative").print_stats(25)
            out["profile_python_last_window"] = stats.getvalue().splitlines()[:60]
        out["memories"] = int(await store.scalar("SELECT count(*) FROM memories"))
    finally:
        await store.close()
    return out


def via_socket(texts: list[str]) -> dict[str, Any]:
    """One `store` at a time through a fresh daemon's socket into one growing store."""
    n = len(texts)
    d = Daemon({"LOOMD_EMBEDDER": "none"})
    times: list[float] = []
    try:
        for i, text in enumerate(texts):
            args = {"text": text, "kind": "observation", "project": PROJECT, "session_id": session_of(i),
                    "created": created_of(i, n)}
            t = time.perf_counter()
            d.client.call("store", args)
            times.append(time.perf_counter() - t)
    finally:
        d.stop()
    part = max(1, n // 10)

    def stats(xs: list[float]) -> dict[str, Any]:
        return {"per_s": round(len(xs) / sum(xs), 1), "ms": percentiles([x * 1000 for x in xs])}

    first, last = stats(times[:part]), stats(times[-part:])
    return {"memories": n, f"first_{part}": first, f"last_{part}": last,
            "last_over_first_time": round(first["per_s"] / last["per_s"], 3),
            "ms_all": percentiles([x * 1000 for x in times])}


def synthetic_vector(text: str, dim: int) -> bytes:
    """A unit vector seeded by the text's hash: stands in for the model's vector of a memory the back-fill run
    does not time (embedding 100k texts takes most of an hour here); the index's size, not its content, is what
    the back-fill's own costs (scans, Hamming pairing) grow with."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(dim).astype("<f4")
    return (v / np.linalg.norm(v)).astype("<f4").tobytes()


def prefill_vectors(path: Path, keep_last: int, model: str, dim: int) -> int:
    """Give every memory but the last `keep_last` a stored vector (synthetic, under the model's name)."""
    from loomd.vectors.backfill import mix_vector
    from loomd.vectors.index import sign_bits

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT id, text, content_hash FROM memories ORDER BY id").fetchall()
        rows = rows[: max(0, len(rows) - keep_last)]
        conn.execute("BEGIN")
        for memory_id, text, digest in rows:
            raw = synthetic_vector(text, dim)
            mixed = mix_vector(raw, [])
            bits = sign_bits(np.frombuffer(mixed, dtype="<f4"))[0]
            conn.execute("INSERT OR REPLACE INTO memory_vectors (memory_id, model, content_hash, vec, mixed, bits,"
                         " raw_bits) VALUES (?,?,?,?,?,?,?)", (memory_id, model, digest, raw, mixed, bits, bits))
        conn.execute("COMMIT")
        return len(rows)
    finally:
        conn.close()


def embed_alone(texts: list[str], batch: int) -> float:
    """Texts/s of the local embedder alone, as the back-fill runs it: 2 threads, `batch` texts a call, on a thread
    at the back-fill's lower priority (its onnxruntime threads inherit it), the model loaded there too."""
    from loomd.offload import lower_thread_priority
    from loomd.vectors.embed import LocalEmbedder
    from loomd.vectors.service import EMBED_NICENESS

    def run() -> float:
        model = LocalEmbedder(threads=2)
        model.embed(["warm up"])
        started = time.perf_counter()
        for start in range(0, len(texts), batch):
            model.embed(texts[start : start + batch])
        return len(texts) / (time.perf_counter() - started)

    with ThreadPoolExecutor(1, initializer=functools.partial(lower_thread_priority, EMBED_NICENESS)) as pool:
        return pool.submit(run).result()


def backfill(store_db: Path, n: int) -> dict[str, Any]:
    """The daemon's back-fill of the last `n` memories of a full store against the embedder alone on their texts.
    The rate is taken from the daemon's own counters between its first batch and the last, so loading the model
    and the index at start is not counted."""
    from loomd.vectors.backfill import BATCH as BACKFILL_BATCH
    from loomd.vectors.embed import LOCAL_DIM, LOCAL_NAME

    home = Path(tempfile.mkdtemp(prefix="lmwbf", dir="/tmp"))
    shutil.copyfile(store_db, home / "loomd.db")
    prefilled = prefill_vectors(home / "loomd.db", n, LOCAL_NAME, LOCAL_DIM)
    conn = sqlite3.connect(home / "loomd.db")
    tail = [r[0] for r in conn.execute("SELECT text FROM memories ORDER BY id DESC LIMIT ?", (n,))][::-1]
    conn.close()
    alone = embed_alone(tail, BACKFILL_BATCH)
    d = Daemon({"LOOMD_EMBED_THREADS": "2"}, home=home)
    try:
        samples: list[tuple[float, int]] = []
        while True:
            status = d.client.call("status")["embedder"]
            done = status["embedded"] + status["copied"]
            if done:
                samples.append((time.perf_counter(), done))
            if status["state"] != "loading" and status["caught_up"] and done >= n:
                break
            time.sleep(0.2)
    finally:
        d.stop()
    (t0, n0), (t1, n1) = samples[0], samples[-1]
    rate = (n1 - n0) / (t1 - t0)
    return {"store_memories": prefilled + n, "prefilled_synthetic_vectors": prefilled, "backfilled": n1,
            "backfill_per_s": round(rate, 1), "embedder_alone_per_s": round(alone, 1),
            "backfill_over_embedder": round(rate / alone, 3), "vectors_after": status["vectors"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--modes", default="batched,single", help="batched, single, or both (or '' for none)")
    parser.add_argument("--socket", type=int, default=0, help="memories stored one at a time through the socket")
    parser.add_argument("--backfill", type=int, default=0, help="memories back-filled at the end of the store")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the batched store here")
    parser.add_argument("--store", type=Path, help="back-fill this store (one written by --keep) instead of a new one")
    args = parser.parse_args()
    started = time.time()
    seeds, _ = base_items(args.data)
    texts = corpus(seeds, max(args.size, args.socket))
    work = Path(tempfile.mkdtemp(prefix="lmwrite", dir="/tmp"))
    out: dict[str, Any] = {
        "bench": "write", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                      "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
        "parameters": {"size": args.size, "window": args.window, "batch": BATCH, "session_size": SESSION_SIZE},
    }
    try:
        for mode in [m for m in args.modes.split(",") if m]:
            if mode not in ("batched", "single"):
                parser.error(f"unknown mode {mode}")
            run: Callable[[], Awaitable[dict[str, Any]]] = lambda mode=mode: grow(  # noqa: E731
                work / f"{mode}.db", texts[: args.size], mode, args.window, args.profile)
            out[mode] = asyncio.run(run())
            out[mode]["db_mb"] = round(os.path.getsize(work / f"{mode}.db") / 1e6, 1)
        if args.socket:
            out["socket"] = via_socket(texts[: args.socket])
        if args.backfill:
            db = args.store or work / "batched.db"
            if not db.exists():
                asyncio.run(grow(db, texts[: args.size], "batched", args.window, False))
            out["backfill"] = backfill(db, args.backfill)
        if args.keep and (work / "batched.db").exists():
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / "batched.db", args.keep / "batched.db")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out["seconds"] = round(time.time() - started, 1)
    print(table(out), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


def table(out: dict[str, Any]) -> str:
    lines = ["| mode | window | memories/s | ms p50 / p99 | writer busy | cpu ms/memory |", "|---|---|---|---|---|---|"]
    for mode in ("batched", "single"):
        for key, res in out.get(mode, {}).items():
            if isinstance(res, dict) and "per_s" in res:
                ms = res.get("ms") or res.get("txn_ms")
                lines.append(f"| {mode} | {key} | {res['per_s']} | {ms['p50']} / {ms['p99']} |"
                             f" {res['writer_busy_share']} | {res['cpu_ms_per_memory']} |")
    if "socket" in out:
        for key, res in out["socket"].items():
            if isinstance(res, dict) and "per_s" in res:
                lines.append(f"| socket | {key} | {res['per_s']} | {res['ms']['p50']} / {res['ms']['p99']} | - | - |")
    if "backfill" in out:
        b = out["backfill"]
        lines.append(f"\nback-fill {b['backfill_per_s']}/s, embedder alone {b['embedder_alone_per_s']}/s"
                     f" ({b['backfill_over_embedder']}) at {b['store_memories']} memories")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
