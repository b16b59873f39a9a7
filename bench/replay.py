"""Replay every real agent session under ../shared/data/transcripts through a fresh loomd and show what it kept.

    python bench/replay.py                      # readable listing, all sessions
    python bench/replay.py --json out.json      # also the full result as JSON
    python bench/replay.py --only deep-manifest # sessions whose file path contains this

A fresh LOOMD_HOME in a temporary folder, the daemon in-process and passive (the workers run when this script says
so, deterministically); transcript tailing off (nothing of this machine's own sessions is read); no embedder
unless --embedder is given. Transcript files go through the tailer's one-shot import, hook logs (JSON arrays of hook
payloads) through the `hook` op, exactly as a live shim would send them. Then, per session: the observer (final),
the reflector and the digest for its project. Per session the listing shows the observations, the memories the
ingest-time capture rules wrote, and the durable memories the session's observations support.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data") / "transcripts"


def hook_records(path: Path) -> list[dict[str, Any]]:
    """A hook log: a JSON array of hook payloads (disler style); [] for anything else."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    return [r for r in data if isinstance(r, dict) and r.get("hook_event_name") and r.get("session_id")]


async def replay(files: list[Path], hooks: list[Path], embedder: str, keep: bool = False) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="lmr", dir="/tmp"))
    os.environ.update({"LOOMD_HOME": str(home), "LOOMD_PASSIVE": "1", "LOOMD_TAIL_TRANSCRIPTS": "0",
                       "LOOMD_EMBEDDER": embedder, "LOOMD_LOG_LEVEL": "WARNING"})
    from loomd.config import load_config
    from loomd.daemon import Daemon

    daemon = Daemon(load_config())
    serving = asyncio.create_task(daemon.serve())
    socket = daemon.config.paths.socket
    while not socket.exists() and not serving.done():  # noqa: ASYNC110 - a stat poll until the daemon serves
        await asyncio.sleep(0.02)
    if serving.done():
        serving.result()
    try:
        started = time.monotonic()
        origin: dict[str, str] = {}
        assert daemon.tailer is not None
        for path in files:
            result = await daemon.tailer.import_file(path)
            for sid in result["sessions"]:
                origin.setdefault(sid, str(path.relative_to(DATA)))
        for path in hooks:
            for record in hook_records(path):
                await daemon.ops.handle_hook({"raw": json.dumps(record), "event": record["hook_event_name"],
                                              "agent": "claude"})
                origin.setdefault(record["session_id"], str(path.relative_to(DATA)))
        ingest_s = time.monotonic() - started
        runs: list[dict[str, Any]] = []
        sessions = await daemon.store.fetchall("SELECT id, project, agent FROM sessions ORDER BY started, id")
        for row in sessions:
            runs.append(await daemon.scheduler.run("observer", session_id=row["id"], final=True))
        projects = await daemon.store.fetchall("SELECT DISTINCT project FROM memories ORDER BY project")
        for project in [r[0] for r in projects]:
            runs.append(await daemon.scheduler.run("reflector", project=project))
            runs.append(await daemon.scheduler.run("digest", project=project))
        out = {"data": str(DATA), "ingest_s": round(ingest_s, 2), "work_s": round(time.monotonic() - started
                                                                                  - ingest_s, 2),
               "failed_runs": [r for r in runs if r["outcome"] == "error"], "sessions": []}
        for row in sessions:
            out["sessions"].append(await describe(daemon, row["id"], row["project"], row["agent"],
                                                  origin.get(row["id"], "?")))
        return out
    finally:
        daemon.should_exit.set()
        await serving
        if keep:
            sys.stderr.write(f"kept the replay's LOOMD_HOME: {home}\n")
        else:
            shutil.rmtree(home, ignore_errors=True)


async def describe(daemon: Any, session_id: str, project: str, agent: str, source: str) -> dict[str, Any]:
    store = daemon.store
    events = await store.scalar("SELECT count(*) FROM events WHERE session_id = ?", (session_id,))
    observations = await store.fetchall(
        "SELECT id, text, created, json_extract(meta, '$.type') AS type FROM memories WHERE kind = 'observation'"
        " AND session_id = ? ORDER BY created, id", (session_id,))
    captured = await store.fetchall(
        "SELECT id, kind, text FROM memories WHERE session_id = ? AND origin LIKE 'capture:%' ORDER BY id",
        (session_id,))
    durable = await store.fetchall(
        "SELECT r.id, r.kind, r.text, r.hits, r.superseded_by, count(e.src_id) AS supports,"
        " (SELECT group_concat(x.type || '#' || x.dst_id) FROM edges x WHERE x.src_type = 'memory'"
        "  AND x.src_id = r.id AND x.type IN ('supersedes', 'contradicts')) AS links"
        " FROM memories r JOIN edges e ON e.dst_type = 'memory' AND e.dst_id = r.id AND e.type = 'supports'"
        " JOIN memories o ON o.id = e.src_id AND o.session_id = ?"
        " GROUP BY r.id ORDER BY r.kind, r.id", (session_id,))
    project = await store.scalar("SELECT project FROM memories WHERE session_id = ? AND kind = 'observation'"
                                 " GROUP BY project ORDER BY count(*) DESC LIMIT 1", (session_id,)) or project
    digest = await store.fetchone("SELECT id, text FROM memories WHERE project = ? AND kind = 'digest'"
                                  " AND archived_at IS NULL ORDER BY id DESC LIMIT 1", (project,))
    return {
        "session_id": session_id, "source": source, "agent": agent, "project": project, "events": events,
        "observations": [{"id": r["id"], "type": r["type"], "text": r["text"]} for r in observations],
        "captured": [{"id": r["id"], "kind": r["kind"], "text": r["text"]} for r in captured],
        "durable": [{"id": r["id"], "kind": r["kind"], "text": r["text"], "supports": r["supports"],
                     "hits": r["hits"], "superseded_by": r["superseded_by"], "links": r["links"]} for r in durable],
        "digest": None if digest is None else {"id": digest["id"], "text": digest["text"]},
    }


def listing(result: dict[str, Any]) -> str:
    lines = [f"replayed {len(result['sessions'])} sessions from {result['data']} "
             f"(ingest {result['ingest_s']}s, workers {result['work_s']}s, failed runs {len(result['failed_runs'])})"]
    for s in result["sessions"]:
        lines.append("")
        lines.append(f"=== {s['source']}  session {s['session_id']} ({s['agent']}, {s['events']} events)")
        lines.append(f"  observations ({len(s['observations'])}):")
        lines.extend(f"    O#{o['id']:<5} {o['type'] or '?':<10} {o['text']}" for o in s["observations"])
        if s["captured"]:
            lines.append(f"  captured at ingest ({len(s['captured'])}):")
            lines.extend(f"    #{c['id']:<6} {c['kind']:<10} {c['text']}" for c in s["captured"])
        lines.append(f"  durable memories these observations support ({len(s['durable'])}):")
        for d in s["durable"]:
            extra = f" [{d['links']}]" if d["links"] else ""
            extra += f" (superseded by #{d['superseded_by']})" if d["superseded_by"] else ""
            lines.append(f"    #{d['id']:<6} {d['kind']:<10} x{d['supports']} {d['text']}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full result as JSON to this file")
    parser.add_argument("--only", default="", help="only files whose path contains this")
    parser.add_argument("--embedder", default="none", help="none (default), local or openai")
    parser.add_argument("--keep", action="store_true", help="keep the temporary LOOMD_HOME (loom works against it)")
    args = parser.parse_args(argv)
    if not DATA.is_dir():
        sys.stderr.write(f"no test data at {DATA} (set LOOMD_TEST_DATA)\n")
        return 2
    from loomd.ingest.transcript import detect_format

    candidates = sorted(p for p in DATA.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")
                        and args.only in str(p))
    files = [p for p in candidates if detect_format(p) is not None]
    hooks = [p for p in candidates if p not in files and hook_records(p)]
    result = asyncio.run(replay(files, hooks, args.embedder, args.keep))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    print(listing(result))
    return 1 if result["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
