"""The web viewer's server time per page (issue 18: memories and sessions pages under 300 ms at 100k memories).

One store grows through the sizes (bench/search.py's corpus written by bench/write.py's batched path: `insert_memory`
+ `MemoryWriter.derive`, 500 a transaction; sessions of 40 memories, each session with a row and 20 events). At each
size a daemon (embedder off, passive: nothing else runs) serves it and the viewer's ASGI app — the same app `loom ui`
serves, with its guard and cookie — is called in process through httpx's ASGI transport, so the time is the
server's: routing, the socket ops, SQL and rendering, without a browser or a network. Per page: p50/p99 ms over
`--repeat` requests (the first request of each page is a warm-up and not counted).

Prints one JSON object on stdout; a table goes to stderr.

    python bench/ui.py [--sizes 1000,10000,100000] [--repeat 30] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from locomo import DEFAULT_DATA, Daemon  # noqa: E402
from search import PROJECT, SESSION_SIZE, base_items, corpus, percentiles  # noqa: E402
from write import BATCH, Timer, created_of, session_of  # noqa: E402

from loomd.store.db import Store  # noqa: E402
from loomd.store.memories import MemoryWriter  # noqa: E402
from loomd.ui.app import COOKIE, Viewer, build_app  # noqa: E402

EVENTS_PER_SESSION = 20
TOKEN = "bench-token"
HOST = "127.0.0.1:8000"


async def grow(path: Path, texts: list[str], start: int, stop: int, total: int) -> None:
    """Memories start..stop of the corpus, batched through the one write path."""
    store = await Store.open(path)
    try:
        memories, timer = MemoryWriter(store), Timer()
        for i in range(start, stop, BATCH):
            await timer.write(memories, texts[i : min(i + BATCH, stop)], i, total)
    finally:
        await store.close()


def add_sessions(path: Path, start: int, stop: int, total: int) -> None:
    """A session row and its events for every session the new memories belong to (the viewer lists them)."""
    with sqlite3.connect(path) as db:
        for s in range(start // SESSION_SIZE, (stop + SESSION_SIZE - 1) // SESSION_SIZE):
            sid, first = session_of(s * SESSION_SIZE), created_of(s * SESSION_SIZE, total)
            db.execute("INSERT OR IGNORE INTO sessions (id, agent, project, cwd, started, last_seen, start_block,"
                       " injected) VALUES (?, 'claude', ?, '/src/bench', ?, ?, ?, ?)",
                       (sid, PROJECT, first, first + 3600, f"[LOOM] bench · session {sid} [/LOOM]",
                        json.dumps([s * SESSION_SIZE + 1, s * SESSION_SIZE + 2])))
            db.executemany(
                "INSERT OR IGNORE INTO events (key, agent, session_id, project, kind, source, ts, received, tool_name,"
                " payload) VALUES (?, 'claude', ?, ?, ?, 'hook', ?, ?, ?, ?)",
                [(f"{sid}:{e}", sid, PROJECT, "tool_result" if e % 2 else "user_prompt", first + e, first + e,
                  "Bash" if e % 2 else None,
                  json.dumps({"prompt": f"step {e} of {sid}"} if e % 2 == 0 else
                             {"tool_input": {"command": "pytest -q"}, "tool_response": {"stdout": "ok " * 200}}))
                 for e in range(EVENTS_PER_SESSION)])


async def measure(sock: Path, repeat: int, size: int) -> dict[str, Any]:
    viewer = Viewer(sock)
    app = build_app(viewer, TOKEN, {HOST})
    middle = session_of(size // 2)
    pages = {
        "memories": "/",
        "memories_page_10": "/?offset=500",
        "memories_project": f"/?project={PROJECT}",
        "memories_kind_filter": f"/?kind=observation&project={PROJECT}",
        "memories_archived": "/?state=archived",
        "memories_search_keyword": "/?q=dinner+with+friends&mode=keyword",
        "sessions": "/sessions",
        "session": f"/session/{middle}",
        "review": "/review",
        "review_project": f"/review?project={PROJECT}",
        "sessions_project": f"/sessions?project={PROJECT}",
    }
    out: dict[str, Any] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{HOST}",
                                 cookies={COOKIE: TOKEN}) as client:
        for name, path in pages.items():
            first = await client.get(path)
            assert first.status_code == 200, (name, first.status_code, first.text[:300])
            samples = []
            for _ in range(repeat):
                started = time.perf_counter()
                reply = await client.get(path)
                samples.append((time.perf_counter() - started) * 1000)
                assert reply.status_code == 200
            out[name] = percentiles(samples)
    await viewer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--keep", default=None, help="build the store in DIR and keep it; a store already there at "
                        "the largest size is measured as it is")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    home = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lmbui", dir="/tmp"))
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    reuse = (home / "loomd.db").exists()
    texts = [] if reuse else corpus(base_items(DEFAULT_DATA)[0], sizes[-1])
    result: dict[str, Any] = {"machine": platform.platform(), "python": platform.python_version(), "sizes": {}}
    try:
        done = 0
        for size in sizes:
            started = time.perf_counter()
            if not reuse:
                asyncio.run(grow(home / "loomd.db", texts, done, size, sizes[-1]))
                add_sessions(home / "loomd.db", done, size, sizes[-1])
            built = time.perf_counter() - started
            done = size
            daemon = Daemon({"LOOMD_EMBEDDER": "none"}, home=home)
            try:
                pages = asyncio.run(measure(home / "loomd.sock", args.repeat, size))
            finally:
                daemon.stop(keep=True)
            result["sizes"][str(size)] = {"build_s": round(built, 1), "pages_ms": pages}
            for name, p in pages.items():
                print(f"{size:>7} {name:<26} p50 {p['p50']:>7} ms  p99 {p['p99']:>7} ms", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
