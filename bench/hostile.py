"""What a hostile payload costs everyone else: ping latency of another client, with and without it in flight.

A real daemon (`python -m loomd serve`) and the real shim: the hostile side pipes a PostToolUse payload whose
`tool_input` holds `--keys` keys (200k by default, about 4 MB) into `shims/loom-hook`, as an agent would. Meanwhile
this process pings the daemon on its own connection every `--interval-ms` and records each round trip. Rounds
alternate a quiet window and a hostile one (the same length), so machine noise lands on both alike; a ping counts
as "hostile" when it was sent while a hostile hook was in flight. Prints one JSON object: ping p50/p99/max per side,
the extra latency (hostile minus quiet), and what was stored (the row's size and its truncation marker).

    python bench/hostile.py [--keys 200000] [--rounds 5] [--interval-ms 2] [--embedder none] [--keep-home]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hooks import machine, percentile, start_daemon, stop_daemon  # bench/hooks.py: the same daemon handling

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "shims" / "loom-hook"


def hostile_payload(keys: int, session: str) -> bytes:
    tool_input = {f"key{i:07d}": f"v{i}" for i in range(keys)}
    return json.dumps({"session_id": session, "hook_event_name": "PostToolUse", "cwd": "/x/proj",
                       "tool_name": "Bash", "tool_use_id": f"toolu_{session}", "tool_input": tool_input,
                       "tool_response": {"stdout": "ok"}}).encode()


def stats(xs: list[float]) -> dict[str, Any]:
    s = sorted(xs)
    return {"n": len(s), "p50_ms": round(percentile(s, 0.5) * 1000, 3), "p99_ms": round(percentile(s, 0.99) * 1000, 3),
            "max_ms": round(s[-1] * 1000, 3) if s else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--embedder", default="none", help="LOOMD_EMBEDDER for the daemon (none: no model noise)")
    parser.add_argument("--keep-home", action="store_true", help="keep the scratch LOOMD_HOME (its daemon.log)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from loomd.client import Client

    home = Path(tempfile.mkdtemp(prefix="lmh", dir="/tmp"))
    os.environ["LOOMD_EMBEDDER"] = args.embedder
    proc, startup_s = start_daemon(sys.executable, home, 60.0)
    shim_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LOOMD_HOME": str(home)}
    pings: list[tuple[float, float]] = []  # (sent, round trip)
    windows: list[tuple[float, float]] = []  # hostile hooks in flight: (start, end)
    shim_s: list[float] = []
    stored_s: list[float] = []
    stop = threading.Event()

    def pinger() -> None:
        with Client(home / "loomd.sock", timeout=30) as c:
            while not stop.is_set():
                sent = time.perf_counter()
                c.call("ping")
                pings.append((sent, time.perf_counter() - sent))
                time.sleep(args.interval_ms / 1000)

    try:
        payloads = [hostile_payload(args.keys, f"hostile-{i}") for i in range(args.rounds)]
        # The shim reads its stdin from a file: feeding a pipe from here is a Python loop that would take the GIL
        # from this process's pinger and count as the daemon's latency.
        files = []
        for i, payload in enumerate(payloads):
            files.append(home / f"payload-{i}.json")
            files[-1].write_bytes(payload)
        thread = threading.Thread(target=pinger, daemon=True)
        thread.start()
        for payload, file in zip(payloads, files, strict=True):
            quiet_start = time.perf_counter()
            start = time.perf_counter()
            with file.open("rb") as stdin:
                done = subprocess.run([sys.executable, "-S", "-E", str(SHIM), "claude", "PostToolUse"], stdin=stdin,
                                      env=shim_env, capture_output=True, timeout=120)
            shim_s.append(time.perf_counter() - start)
            assert done.returncode == 0, done.stderr
            # In flight until stored: a shim past its deadline spools, and the daemon replays the spool file.
            session = json.loads(payload[:200].split(b",")[0] + b"}")["session_id"]
            with Client(home / "loomd.sock", timeout=30) as c:
                while not c.call("events", {"session_id": session, "limit": 1})["events"]:
                    time.sleep(0.05)
            end = time.perf_counter()
            windows.append((start, end))
            stored_s.append(end - start)
            # a quiet window as long as the hostile one, right after it
            time.sleep(max(end - quiet_start, 0.5))
        stop.set()
        thread.join()
        with Client(home / "loomd.sock", timeout=30) as c:
            rows = [c.call("events", {"session_id": f"hostile-{i}", "limit": 5})["events"] for i in range(args.rounds)]
            storage = c.call("status").get("storage")
        import sqlite3

        db = sqlite3.connect(home / "loomd.db")
        sizes = [r[0] for r in db.execute("SELECT length(payload) FROM events WHERE session_id LIKE 'hostile-%'")]
        marker = db.execute("SELECT payload FROM events WHERE session_id = 'hostile-0'").fetchone()
        db.close()
    finally:
        stop.set()
        stop_daemon(proc)
        if args.keep_home:
            print(f"kept {home}", file=sys.stderr)
        else:
            shutil.rmtree(home, ignore_errors=True)

    def in_flight(sent: float) -> bool:
        return any(a <= sent <= b for a, b in windows)

    hostile = [rt for sent, rt in pings if in_flight(sent)]
    quiet = [rt for sent, rt in pings if not in_flight(sent)]
    q, h = stats(quiet), stats(hostile)
    payload_json = json.loads(marker[0]) if marker else {}
    cut = [v for k, v in (payload_json.get("tool_input") or {}).items() if k == "…"]
    print(json.dumps({
        "bench": "hostile", "keys": args.keys, "rounds": args.rounds, "payload_bytes": len(payloads[0]),
        "daemon_startup_s": round(startup_s, 3), "machine": machine(),
        "ping_quiet": q, "ping_hostile": h,
        "extra_ms": {k: round(h[k] - q[k], 3) for k in ("p50_ms", "p99_ms", "max_ms")
                     if h[k] is not None and q[k] is not None},
        "ping_max_per_round_ms": [round(max((rt for sent, rt in pings if a <= sent <= b), default=0) * 1000, 3)
                                  for a, b in windows],
        "shim_wall_s": [round(s, 3) for s in shim_s], "until_stored_s": [round(s, 3) for s in stored_s],
        "stored_rows": sum(len(r) for r in rows), "stored_payload_bytes": sizes, "marker": cut[:1],
        "storage_status": storage,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
