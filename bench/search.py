"""BENCH.md §4, search and context latency at 1k, 10k and 100k memories.

The corpus: every LoCoMo dialog turn and every text item of the real transcripts under ../shared/data/transcripts,
then the same again with variation (each copy joins the start of one item to a sentence of another and renumbers
its digits) until the level is reached; one project, sessions of 40 memories in time order, two years of times.
It is written with loomd's own `insert_memory` + `write_derived` (what the `store` op runs) straight into a
database file, then a daemon back-fills the vectors (embed_threads 2), and the database is kept in --cache for the
next run. Each level is measured on a fresh `python -m loomd serve` with the default config.

`--vectors-from DB` (before/after runs of two loomd versions): the back-fill's rows (vectors, mixed vectors, bits,
recurrence counts, near pairs) are copied from DB, a database this bench built at the same level with the same
model, instead of embedding the same texts again (an hour at 100k on 2 cores). Memories are matched by session,
time and content hash; the copy is refused unless every memory has its match. It fills a fresh build, or a cached
database without vectors; the daemon then back-fills only what the copy left (`backfill_s` says how long).

`--stand-in-vectors` (when the model cannot embed a level in the time there is: 100k texts take an hour or more
on 2 shared cores): the daemon's own back-fill runs with a stand-in embedder instead of the model, an
OpenAI-compatible endpoint on 127.0.0.1 served by this script (a hashed bag of words: each word a fixed random
direction, so texts that share words stay near and near pairs still form), then the rows are labelled with the
local model's name so the measuring daemon searches them. The query is still embedded by the real model, and the
index has the real size and shape, so latencies stay comparable between two versions given the same rows
(`--vectors-from` a stand-in database); result quality is meaningless. Its databases are cached under their own
name (`…-standin.db`) and the JSON says `"stand_in_vectors": true`.

Measured per level, interleaved round-robin over the same questions (LoCoMo questions and real user prompts):
`search` hybrid (limit 10, the default), keyword (the FTS-only baseline in the same run), semantic; `context`
kind prompt (the per-prompt recall the hook asks for) and kind start (a fresh session's block); `ping` (the
socket floor). Client wall time p50/p99; the daemon's own breakdown of hybrid and semantic searches from their
`explain` timings: `embed_ms` (the query embedding), `vec_rank_ms` (the in-memory index: Hamming prefilter, int8
re-rank), `vec_rerank_ms` (sqlite-vec's exact re-rank in SQL), `vec_ms` (the whole vector signal). Ingest ack
latency is measured while the first back-fill of the level runs and again idle.

Prints one JSON object on stdout; a markdown table goes to stderr.

    python bench/search.py [--quick] [--levels 1000,10000,100000] [--queries 300] [--cache DIR] [--fresh]
                           [--vectors-from DB] [--stand-in-vectors]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import re
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from locomo import DEFAULT_DATA, Daemon, load  # noqa: E402

from loomd.ingest.transcript import parse_file  # noqa: E402
from loomd.store.db import Store  # noqa: E402
from loomd.store.derived import write_derived  # noqa: E402
from loomd.store.memories import insert_memory  # noqa: E402
from loomd.vectors.embed import LOCAL_DIM, LOCAL_NAME  # noqa: E402

TRANSCRIPTS = REPO.parent / "shared" / "data" / "transcripts"
PROJECT = "bench:search"
SESSION_SIZE = 40
CORPUS_VERSION = 2
SPAN_S = 2 * 365 * 86400.0
END = 1_750_000_000.0


def base_items(data: Path) -> tuple[list[str], list[str]]:
    """The corpus seeds (LoCoMo turns, transcript texts) and the queries (LoCoMo questions, user prompts)."""
    texts, queries = [], []
    for conv in load(data, list(range(5))):
        texts += [t.item() for t in conv.turns]
        queries += [q for q, _, _ in conv.questions]
    for path in sorted(TRANSCRIPTS.rglob("*")):
        if path.suffix != ".jsonl" and path.name != "chat.json":
            continue
        try:
            items = parse_file(path)
        except (OSError, ValueError):
            continue
        for item in items:
            text = " ".join(item.text.split())[:300]  # memories are short (capture keeps 200 chars)
            if len(text) >= 20:
                texts.append(text)
                if item.kind == "user_message" and len(text) < 400:
                    queries.append(text)
    return texts, queries


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def corpus(seeds: list[str], n: int) -> list[str]:
    """n texts: the seeds, then varied copies (start of one + a sentence of another, digits renumbered)."""
    out = list(seeds[:n])
    rng = random.Random(7)
    copy = 1
    while len(out) < n:
        for i, seed in enumerate(seeds):
            if len(out) >= n:
                break
            other = _SENTENCE.split(seeds[rng.randrange(len(seeds))])
            head = _SENTENCE.split(seed)
            text = " ".join(head[: max(1, len(head) // 2)] + [rng.choice(other)])
            shift = copy * 7 + i
            text = re.sub(r"\d+", lambda m, shift=shift: str((int(m.group()[:9]) + shift) % 10_000), text)
            out.append(f"{text} [{copy}.{i}]" if rng.random() < 0.1 else text)
        copy += 1
    return out


async def build_db(path: Path, texts: list[str]) -> int:
    """Write the memories as the `store` op does, 500 per transaction."""
    store = await Store.open(path)
    try:
        for start in range(0, len(texts), 500):
            async with store.atomic() as db:
                ids = []
                for i in range(start, min(start + 500, len(texts))):
                    memory_id, _ = await insert_memory(
                        db, kind="observation", text=texts[i], project=PROJECT, session_id=f"s{i // SESSION_SIZE}",
                        created=END - SPAN_S + SPAN_S * i / len(texts))
                    ids.append(memory_id)
                await write_derived(db, ids)
        return int(await store.scalar("SELECT count(*) FROM memories"))
    finally:
        await store.close()


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return {"n": len(xs), "p50": round(statistics.median(xs), 2), "p99": round(p99, 2), "max": round(xs[-1], 2)}


def ingest_probe(daemon: Daemon, n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        item = {"session_id": f"probe-{tag}", "kind": "UserPromptSubmit", "payload": {"prompt": f"probe {tag} {i}"}}
        t = time.perf_counter()
        daemon.client.call("ingest", {"item": item})
        out.append((time.perf_counter() - t) * 1000)
    return out


def copy_vectors(source: Path, target: Path) -> int:
    """The back-fill's rows of `source` written into `target` (same corpus, same model): what the back-fill would
    compute from the same texts, sessions and times. Returns the number of vectors copied."""
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(target)
    try:
        key = "SELECT session_id, created, content_hash, id FROM memories WHERE project = ?"
        theirs = {(s, c, h): i for s, c, h, i in src.execute(key, (PROJECT,))}
        mine = {(s, c, h): i for s, c, h, i in dst.execute(key, (PROJECT,))}
        missing = [k for k in mine if k not in theirs]
        if missing:
            raise SystemExit(f"--vectors-from {source}: {len(missing)} of {len(mine)} memories have no match there")
        to_mine = {theirs[k]: i for k, i in mine.items()}
        cols = ", ".join(c for (c,) in src.execute("SELECT name FROM pragma_table_info('memory_vectors')")
                         if c in {d for (d,) in dst.execute("SELECT name FROM pragma_table_info('memory_vectors')")})
        rows = [(to_mine[r[0]], *r[1:]) for r in src.execute(f"SELECT {cols} FROM memory_vectors ORDER BY memory_id")
                if r[0] in to_mine]
        if len(rows) != len(mine):
            raise SystemExit(f"--vectors-from {source}: {len(mine) - len(rows)} memories have no vector there")
        pairs = [(to_mine[a], to_mine[b], c) for a, b, c in src.execute("SELECT a, b, cosine FROM memory_near")
                 if a in to_mine and b in to_mine]
        with dst:
            dst.execute("DELETE FROM memory_vectors")
            dst.execute("DELETE FROM memory_near")
            dst.executemany(f"INSERT INTO memory_vectors ({cols}) VALUES ({', '.join('?' * len(cols.split(',')))})",
                            rows)
            dst.executemany("INSERT INTO memory_near (a, b, cosine) VALUES (?, ?, ?)", pairs)
        return len(rows)
    finally:
        src.close()
        dst.close()


class StandInEmbeddings(BaseHTTPRequestHandler):
    """`POST /v1/embeddings` (the OpenAI format) answered with a hashed bag of words: each lower-cased word is a
    fixed random direction (seeded by its hash), a text is the normalised sum of its words'."""

    words: dict[str, np.ndarray] = {}

    def log_message(self, format: str, *args: Any) -> None:
        return  # one line per batch of 8 would drown the bench's own output

    def do_POST(self) -> None:
        texts = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["input"]
        body = json.dumps({"data": [{"index": i, "embedding": self.vector(t).tolist()}
                                    for i, t in enumerate(texts)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    @classmethod
    def vector(cls, text: str) -> np.ndarray:
        total = np.zeros(LOCAL_DIM)
        for word in re.findall(r"\w+", text.lower()) or [text]:
            if word not in cls.words:
                seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
                cls.words[word] = np.random.default_rng(seed).standard_normal(LOCAL_DIM)
            total += cls.words[word]
        return total / (np.linalg.norm(total) or 1.0)


def backfill_env(stand_in: ThreadingHTTPServer | None) -> dict[str, str]:
    """The back-fill daemon's settings: the local model on 2 threads, or the stand-in endpoint."""
    if stand_in is None:
        return {"LOOMD_EMBED_THREADS": "2"}
    return {"LOOMD_EMBEDDER": "openai", "LOOMD_EMBED_URL": f"http://127.0.0.1:{stand_in.server_address[1]}/v1",
            "LOOMD_EMBED_MODEL": "stand-in", "LOOMD_EMBED_DIM": str(LOCAL_DIM)}


def prepare(level: int, texts: list[str], cache: Path, fresh: bool,
            vectors_from: Path | None = None, stand_in: bool = False) -> tuple[Path, dict[str, Any]]:
    """A database of `level` memories with every vector back-filled (from the cache when it has one)."""
    # A cached database is migrated forward when a daemon opens it; --fresh rebuilds it (after a change to what
    # is derived from a memory's text, or to the corpus, which bumps CORPUS_VERSION).
    key = f"v{CORPUS_VERSION}-{level}{'-standin' if stand_in else ''}.db"
    cached = cache / key
    info: dict[str, Any] = {"cached": cached.exists() and not fresh}
    if info["cached"]:
        if vectors_from is not None and not _has_vectors(cached):
            info["vectors_copied"] = copy_vectors(vectors_from, cached)
            info["vectors_from"] = str(vectors_from)
        return cached, info
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lmbuild", dir="/tmp"))
    t0, cpu0 = time.perf_counter(), time.process_time()
    info["memories"] = asyncio.run(build_db(work / "loomd.db", texts[:level]))
    info["build_s"] = round(time.perf_counter() - t0, 1)
    # The build's own CPU (every thread of this process): on a shared machine the wall time also counts the others.
    info["build_cpu_s"] = round(time.process_time() - cpu0, 1)
    # Said now: the back-fill that follows can take an hour.
    print(f"level {level}: {info['memories']} memories written in {info['build_s']} s ({info['build_cpu_s']} s CPU)",
          file=sys.stderr, flush=True)
    if vectors_from is not None:
        info["vectors_copied"] = copy_vectors(vectors_from, work / "loomd.db")
        info["vectors_from"] = str(vectors_from)
    server = None
    if stand_in and vectors_from is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), StandInEmbeddings)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    d = Daemon(backfill_env(server), home=work)
    try:
        t1 = time.perf_counter()
        time.sleep(0.5)
        info["ingest_ack_ms_during_backfill"] = percentiles(ingest_probe(d, 200, "busy"))
        status = d.wait_caught_up(timeout=4 * 3600)  # 100k on 2 busy cores: over an hour
        info["backfill_s"] = round(time.perf_counter() - t1, 1)
        info["vectors"] = status["vectors"]
        info["ingest_ack_ms_idle"] = percentiles(ingest_probe(d, 200, "idle"))
    finally:
        d.stop(keep=True)
        if server is not None:
            server.shutdown()
    if server is not None:  # the measuring daemon runs the local model: the rows must carry its name
        with sqlite3.connect(work / "loomd.db") as conn:
            conn.execute("UPDATE memory_vectors SET model = ?", (LOCAL_NAME,))
        conn.close()
    shutil.copyfile(work / "loomd.db", cached)
    shutil.rmtree(work, ignore_errors=True)
    return cached, info


def _has_vectors(db: Path) -> bool:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT 1 FROM memory_vectors LIMIT 1").fetchone() is not None
    finally:
        conn.close()


def measure(db: Path, queries: list[str], n: int, rng: random.Random) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="lmsearch", dir="/tmp"))
    shutil.copyfile(db, home / "loomd.db")
    d = Daemon(home=home)
    out: dict[str, Any] = {}
    try:
        status = d.wait_caught_up()
        out["vectors"] = status["vectors"]
        picked = [rng.choice(queries)[:2000] for _ in range(n)]
        for q in picked[:20]:  # warm the caches (page cache, FTS segments, the model's first runs)
            d.client.call("search", {"query": q, "project": PROJECT})
        ops: dict[str, list[float]] = {k: [] for k in (
            "ping", "search hybrid", "search keyword", "search semantic", "context prompt", "context start")}
        daemon_ms: dict[str, list[float]] = {}
        semantic_ms: dict[str, list[float]] = {}
        for i, q in enumerate(picked):
            calls = [
                ("ping", "ping", {}),
                ("search hybrid", "search", {"query": q, "project": PROJECT, "explain": True}),
                ("search keyword", "search", {"query": q, "project": PROJECT, "mode": "keyword"}),
                ("search semantic", "search", {"query": q, "project": PROJECT, "mode": "semantic",
                                                "explain": True}),
                ("context prompt", "context", {"kind": "prompt", "session_id": f"bench-{i % 20}", "prompt": q,
                                               "project": PROJECT}),
                ("context start", "context", {"kind": "start", "session_id": f"start-{i}", "project": PROJECT}),
            ]
            rng.shuffle(calls)
            for name, op, args in calls:
                t = time.perf_counter()
                reply = d.client.call(op, args)
                ops[name].append((time.perf_counter() - t) * 1000)
                if name in ("search hybrid", "search semantic"):
                    for stage, ms in reply["timings"].items():
                        (daemon_ms if name == "search hybrid" else semantic_ms).setdefault(stage, []).append(ms)
        # The 1-bit prefilter is approximate: how much of the exact vector top 10 / top 100 it keeps.
        overlap: dict[int, list[float]] = {10: [], 100: []}
        for q in picked[:30]:
            args = {"query": q, "project": PROJECT, "mode": "semantic", "limit": 100}
            fast = [r["id"] for r in d.client.call("search", args)["results"]]
            exact = [r["id"] for r in d.client.call("search", {**args, "tuning": {"prefilter": 100_000}})["results"]]
            for k in overlap:
                if exact[:k]:
                    overlap[k].append(len(set(fast[:k]) & set(exact[:k])) / len(exact[:k]))
        out["knn_recall_vs_exact"] = {f"@{k}": round(statistics.fmean(v), 4) for k, v in overlap.items() if v}
        out["client_ms"] = {k: percentiles(v) for k, v in ops.items()}
        out["daemon_hybrid_ms"] = {k: percentiles(v) for k, v in daemon_ms.items()}
        out["daemon_semantic_ms"] = {k: percentiles(v) for k, v in semantic_ms.items()}
        p50 = out["client_ms"]["search keyword"]["p50"]
        out["ratio_hybrid_to_keyword_p50"] = round(out["client_ms"]["search hybrid"]["p50"] / p50, 2)
    finally:
        d.stop()
    return out


def embed_floor(queries: list[str], n: int) -> dict[str, Any]:
    """The query embedding alone, one thread: in this process, and through the offload helper's query lane set up
    as the daemon sets it up (`make_embedder`), over the same queries, interleaved in random order; the helper's
    extra cost per query (the paired median) is what moving the model out of the daemon's process costs a search.
    The helper's vectors must be the same bytes."""
    from loomd.config import Config
    from loomd.offload import Offload
    from loomd.vectors.embed import ChildEmbedder, LocalEmbedder, make_embedder

    model = LocalEmbedder(threads=1)
    model.embed(["warm up"])
    helper = Offload()
    try:
        child = make_embedder(Config(embedder="local"), helper)
        assert isinstance(child, ChildEmbedder)
        lane = child.on_lane("query")
        rng = random.Random(5)
        times: dict[str, list[float]] = {"in_process": [], "helper": []}
        identical = True
        for q in queries[:n]:
            order = [("in_process", model), ("helper", lane)]
            rng.shuffle(order)
            blobs = []
            for name, embedder in order:
                t = time.perf_counter()
                blobs.append(embedder.embed([q[:2000]])[0])
                times[name].append((time.perf_counter() - t) * 1000)
            identical = identical and blobs[0] == blobs[1]
    finally:
        helper.close()
    extra = [h - i for h, i in zip(times["helper"], times["in_process"], strict=True)]
    return {
        "in_process": percentiles(times["in_process"]),
        "helper_query_lane": percentiles(times["helper"]),
        "helper_extra_p50": round(statistics.median(extra), 3),
        "identical_vectors": identical,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--levels", default="1000,10000,100000")
    parser.add_argument("--queries", type=int, default=300, help="questions per level (each runs every op)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "loomd-bench-search")
    parser.add_argument("--fresh", action="store_true", help="rebuild the cached databases")
    parser.add_argument("--vectors-from", type=Path, help="copy the back-fill's rows from this database of the same"
                        " level instead of embedding again (see above)")
    parser.add_argument("--stand-in-vectors", action="store_true", help="back-fill with a stand-in embedder, not"
                        " the model (see above): for latency comparisons only")
    parser.add_argument("--quick", action="store_true", help="1k and 10k, 100 questions: under a minute when cached")
    args = parser.parse_args()
    levels = [1000, 10000] if args.quick else [int(x) for x in args.levels.split(",")]
    n = 100 if args.quick else args.queries
    started = time.time()
    seeds, queries = base_items(args.data)
    texts = corpus(seeds, max(levels))
    rng = random.Random(11)
    results: dict[str, Any] = {}
    for level in levels:
        db, info = prepare(level, texts, args.cache, args.fresh, args.vectors_from, args.stand_in_vectors)
        results[str(level)] = {"prepare": info, **measure(db, queries, n, rng)}
        print(f"level {level}: done", file=sys.stderr, flush=True)
    out = {
        "bench": "search", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "parameters": {"levels": levels, "queries": n, "corpus_seeds": len(seeds), "query_pool": len(queries),
                       "session_size": SESSION_SIZE, "cache": str(args.cache), "quick": args.quick,
                       "vectors_from": str(args.vectors_from) if args.vectors_from else None,
                       "stand_in_vectors": args.stand_in_vectors},
        "query_embedding_ms": embed_floor(queries, n),
        "levels": results, "seconds": round(time.time() - started, 1),
    }
    print(table(out), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


def table(out: dict[str, Any]) -> str:
    names = ["search hybrid", "search keyword", "search semantic", "context prompt", "context start", "ping"]
    stages = ["embed_ms", "vec_rank_ms", "vec_rerank_ms", "vec_ms"]
    lines = ["| memories | " + " | ".join(f"{n} p50 / p99" for n in names)
             + " | " + " | ".join(f"hybrid: {s} p50 / p99" for s in stages) + " |",
             "|---|" + "---|" * (len(names) + len(stages))]
    for level, res in out["levels"].items():
        cells = [f"{res['client_ms'][n]['p50']} / {res['client_ms'][n]['p99']}" for n in names]
        for stage in stages:
            ms = res["daemon_hybrid_ms"].get(stage, {"p50": "-", "p99": "-"})
            cells.append(f"{ms['p50']} / {ms['p99']}")
        lines.append(f"| {int(level):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
