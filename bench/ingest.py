"""BENCH.md §2, ingest: durable events per second through the socket, ack latency, spool replay rate.

A real daemon (`python -m loomd serve` on a private LOOMD_HOME) takes 2 KB hook events the way the shim sends
them (one connection per event, the shim's own `pack_args` frame, `hook` op, acknowledged only after COMMIT)
from 1 and from 8 concurrent client processes. Same-run baselines: the durable-commit floor (one INSERT + COMMIT
per event on a bare SQLite file, WAL, synchronous=FULL, as the daemon configures it) and the socket floor (a
`ping` round trip on a fresh connection). Then the daemon is stopped, the shim's `spool()` writes N spool files,
the daemon is started again and the replay rate is timed. Prints one JSON object on stdout.

Per run it also reports the daemon's CPU per event (its own process and the offload process, from /proc: a
measure that machine noise moves less than the wall clock), the background transactions committed while the clients
ran (per writer holder: the back-fill, each worker), the hook journal's counts after each client run (`journal`:
hooks journaled, and those that came with others and shared a group commit instead), 8 concurrent clients sending
only `ping` on a fresh connection each (what the connection handling alone allows), and the issue #17 acceptance
checks. The clients start once the
full daemon has loaded its embedding model (`embedder_ready_s`), as a daemon that has been running does. `--repo` runs
the daemon from another checkout (the same bench, the code before a change: run both back to back).

    python bench/ingest.py [--quick] [--events N] [--size BYTES] [--spool N] [--embedder none|local] [--repo DIR]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd.client import Client  # noqa: E402
from loomd.store.db import connect_sync  # noqa: E402


def shim_module() -> ModuleType:
    for folder in (REPO / "shims", REPO / "plugin" / "shims"):
        for name in ("loom_hook.py", "loom-hook"):
            if (folder / name).exists():
                loader = importlib.machinery.SourceFileLoader("loom_hook", str(folder / name))
                spec = importlib.util.spec_from_loader("loom_hook", loader)
                assert spec is not None
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
                return module
    raise FileNotFoundError("no shim module under shims/")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def payload(tag: str, i: int, size: int) -> bytes:
    """A PostToolUse hook payload of about `size` bytes with a unique tool_use_id."""
    body = {"session_id": f"bench-{tag}", "cwd": "/x/proj", "hook_event_name": "PostToolUse", "tool_name": "Bash",
            "tool_use_id": f"{tag}-{i}", "tool_input": {"command": f"make test-{i}"},
            "tool_response": {"stdout": "", "stderr": ""}}
    base = len(json.dumps(body))
    body["tool_response"]["stdout"] = ("ok build step passed in 0.2s\n" * (size // 28 + 1))[: max(0, size - base)]
    return json.dumps(body).encode()


# ---------------------------------------------------------------- the daemon


def start_daemon(home: Path, env: dict[str, str], timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], float]:
    t0 = time.monotonic()
    log = open(home / "daemon.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=env.get("PYTHONPATH") or REPO)
    log.close()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode}: {(home / 'daemon.log').read_text()[-2000:]}")
        try:
            with Client(home / "loomd.sock", timeout=2) as c:
                c.call("ping")
            return proc, time.monotonic() - t0
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.01)
    proc.kill()
    raise TimeoutError("the daemon did not come up")


def stop_daemon(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def status(home: Path) -> dict[str, Any]:
    with Client(home / "loomd.sock", timeout=30) as c:
        return c.call("status")


# ---------------------------------------------------------------- clients


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU a live process has used (Linux /proc), 0 when it cannot be read."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_cpu(home: Path, pid: int) -> dict[str, float]:
    """CPU seconds so far of the daemon and of its offload process (absent before issue #17: 0)."""
    child = (status(home).get("offload") or {}).get("pid")
    return {"daemon": cpu_seconds(pid), "offload": cpu_seconds(child)}


def ping_worker(args: tuple[str, int]) -> list[float]:
    """One client process: `n` pings, each on a fresh connection: the connection handling alone."""
    import msgpack

    home, n = args
    frame = msgpack.packb({"v": 1, "id": 1, "op": "ping"})
    frame = len(frame).to_bytes(4, "big") + frame
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.path.join(home, "loomd.sock"))
            s.sendall(frame)
            size = int.from_bytes(s.recv(4), "big")
            got = b""
            while len(got) < size:
                got += s.recv(size - len(got))
        times.append(time.perf_counter() - t0)
    return times


def concurrent_pings(home: Path, clients: int, per_client: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        results = pool.map(ping_worker, [(str(home), per_client)] * clients)
    wall = time.perf_counter() - t0
    times = [x for r in results for x in r]
    return {"clients": clients, "pings_per_s": round(len(times) / wall, 1),
            "ping_ms": {"p50": ms(pct(times, 0.5)), "p99": ms(pct(times, 0.99))}}


def client_worker(args: tuple[str, str, int, int, int, float]) -> dict[str, Any]:
    """One client process: `n` events one after another, each on its own connection, exactly like the shim."""
    home, tag, n, size, _seed, deadline_s = args
    shim = shim_module()
    sock = os.path.join(home, "loomd.sock").encode()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    t_start = time.perf_counter()
    cpu_start, in_call = time.process_time(), 0.0
    for i in range(n):
        raw = payload(tag, i, size)
        eid = f"{time.time_ns():016x}-{os.getpid():08x}-{os.urandom(4).hex()}"
        args_map = shim.pack_args("claude", "PostToolUse", raw, eid, False, int(deadline_s * 1000),
                                  time.time_ns() // 1_000_000)
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            shim.call(sock, args_map, time.monotonic() + deadline_s)
        except BaseException as exc:  # noqa: BLE001 - counted, the bench goes on
            key = type(exc).__name__ + (": " + str(exc)[:80] if "reply" in str(exc) else "")
            errors[key] = errors.get(key, 0) + 1
            continue
        finally:
            in_call += time.process_time() - cpu0
        latencies.append(time.perf_counter() - t0)
    return {"latencies": latencies, "errors": errors, "elapsed": time.perf_counter() - t_start,
            "cpu_s": time.process_time() - cpu_start, "call_cpu_s": in_call}


def run_clients(home: Path, clients: int, per_client: int, size: int, tag: str, pid: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    jobs = [(str(home), f"{tag}{c}", per_client, size, c, 10.0) for c in range(clients)]
    first = status(home)
    before, commits_before = first["counts"]["events"], first["storage"].get("commits")
    holds_before = first.get("writer", {}).get("holds", {})
    cpu_before = daemon_cpu(home, pid)
    t0 = time.perf_counter()
    with ctx.Pool(clients) as pool:
        results = pool.map(client_worker, jobs)
    wall = time.perf_counter() - t0
    cpu_after = daemon_cpu(home, pid)
    last = status(home)
    holds = {k: v["n"] - holds_before.get(k, {}).get("n", 0)
             for k, v in last.get("writer", {}).get("holds", {}).items()}
    catchup = embedded_after(home, t0 + wall)
    stored = last["counts"]["events"] - before
    commits = None if commits_before is None else last["storage"]["commits"] - commits_before
    latencies = [x for r in results for x in r["latencies"]]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "clients": clients, "events": clients * per_client, "acked": len(latencies), "stored": stored,
        "errors": errors, "wall_s": round(wall, 3), "events_per_s": round(len(latencies) / wall, 1),
        "ack_ms": {"p50": ms(pct(latencies, 0.5)), "p90": ms(pct(latencies, 0.9)), "p99": ms(pct(latencies, 0.99)),
                   "max": ms(max(latencies) if latencies else float("nan"))},
        # While the clients ran (the back-fill and the workers go on after: this is what the acks competed with).
        "cpu_ms_per_event": {k: round((cpu_after[k] - cpu_before[k]) * 1000 / max(1, len(latencies)), 3)
                             for k in cpu_after},
        # The clients' own CPU on the same machine (all of it, and the shim's `call` alone): on 2 CPUs the clients
        # and the daemon share them, so the rate is bound by their sum.
        "client_cpu_ms_per_event": {
            "all": round(sum(r["cpu_s"] for r in results) * 1000 / max(1, len(latencies)), 3),
            "shim_call": round(sum(r["call_cpu_s"] for r in results) * 1000 / max(1, len(latencies)), 3)},
        "events_per_commit": round(stored / commits, 2) if commits else None,  # group commit at work
        # Transactions each background holder of the writer committed while the clients ran (the back-fill, each
        # worker): what the acks competed with. Held back while hooks stream, they run in the pauses.
        "background_transactions": {k: n for k, n in sorted(holds.items()) if n and not k.startswith("events:")},
        # From the last ack until the back-fill was first caught up with nothing pending (it may wait for the clients
        # to pause). Not the whole catch-up: the workers run on their own schedule, and what they write is embedded
        # after that.
        "embedded_after_s": catchup,
    }


def embedded_after(home: Path, since: float, timeout: float = 120.0) -> float | None:
    """Seconds from `since` (perf_counter) until the embedder is caught up with nothing pending; None if it has no
    embedder, or did not catch up within `timeout`."""
    while time.perf_counter() - since < timeout:
        emb = status(home)["embedder"]
        if emb.get("state") in ("off", "failed"):
            return None
        if emb.get("caught_up") and not emb.get("pending"):
            return round(time.perf_counter() - since, 3)
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------- baselines


def sqlite_floor(root: Path, n: int, size: int) -> dict[str, Any]:
    """One INSERT + COMMIT per event into a bare table: the cost of durability alone, no daemon, no socket."""
    db = root / "floor.db"
    conn = connect_sync(db)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, key TEXT UNIQUE, payload TEXT)")
    rows = [(f"k{i}", payload("floor", i, size).decode()) for i in range(n)]
    t0 = time.perf_counter()
    for key, body in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t (key, payload) VALUES (?, ?)", (key, body))
        conn.execute("COMMIT")
    single = time.perf_counter() - t0
    t0 = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany("INSERT INTO t (key, payload) VALUES (?, ?)", [(k + "b", b) for k, b in rows])
    conn.execute("COMMIT")
    batched = time.perf_counter() - t0
    conn.close()
    return {"commit_per_event_per_s": round(n / single, 1), "one_commit_for_all_per_s": round(n / batched, 1)}


def ping_floor(home: Path, n: int) -> dict[str, Any]:
    """A `ping` on a fresh connection per call: connect + one frame each way, the socket's own cost."""
    times = ping_worker((str(home), n))
    return {"ping_ms": {"p50": ms(pct(times, 0.5)), "p99": ms(pct(times, 0.99))}}


# ---------------------------------------------------------------- spool replay


def spool_replay(home: Path, env: dict[str, str], n: int, size: int) -> dict[str, Any]:
    shim = shim_module()
    state = str(home).encode()
    t0 = time.perf_counter()
    for i in range(n):
        eid = f"{time.time_ns():016x}-{os.getpid():08x}-{os.urandom(4).hex()}"
        shim.spool(state, eid, shim.pack_args("claude", "PostToolUse", payload("spool", i, size), eid, False, 1000,
                                              time.time_ns() // 1_000_000))
    write_s = time.perf_counter() - t0
    before_files = len(list((home / "spool").glob("*.msgpack")))
    t0 = time.monotonic()
    proc, ready_s = start_daemon(home, env)
    try:
        while True:
            s = status(home)
            if s["spool_backlog"] == 0 and not list((home / "spool").glob("*.msgpack")):
                break
            if time.monotonic() - t0 > 600:
                raise TimeoutError("spool replay did not finish within 10 minutes")
            time.sleep(0.02)
        total = time.monotonic() - t0
        replayed = s["counts"]["events"]
    finally:
        code = stop_daemon(proc)
    replay_s = max(total - ready_s, 1e-9)
    return {"spooled_files": before_files, "shim_spool_write_per_s": round(n / write_s, 1),
            "daemon_ready_s": round(ready_s, 3), "replay_s": round(replay_s, 3),
            "replay_events_per_s": round(n / replay_s, 1), "events_after_replay": replayed, "daemon_exit": code}


CONFIGS = {
    # The write path alone: no workers, no embedder competing for the CPU.
    "ingest_only": {"LOOMD_PASSIVE": "1", "LOOMD_EMBEDDER": "none"},
    # The daemon as users run it: workers woken by ingest, the local embedder back-filling vectors.
    "full_daemon": {},
}


def bench_config(root: Path, name: str, extra: dict[str, str], opts: argparse.Namespace, events: int,
                 spool_n: int) -> dict[str, Any]:
    home = root / name
    home.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
    env.update({"LOOMD_HOME": str(home), "LOOMD_EMBEDDER": opts.embedder, "LOOMD_CODEX_HOME": str(root / "codex"),
                "PYTHONPATH": str(opts.repo), **extra})
    out: dict[str, Any] = {"env": {k: v for k, v in env.items() if k.startswith("LOOMD_") and k != "LOOMD_HOME"}}
    proc, ready_s = start_daemon(home, env)
    try:
        out["daemon_ready_s"] = round(ready_s, 3)
        # A daemon runs for days; its embedding model loads once, at start (seconds of CPU in the offload process).
        # The clients are timed on a daemon that has loaded it, as users meet it: not on its first seconds.
        out["embedder_ready_s"] = embedded_after(home, time.perf_counter())
        out["versions"] = status(home)["versions"]
        out["ping"] = ping_floor(home, 300 if opts.quick else 1000)["ping_ms"]
        out["pings_8"] = concurrent_pings(home, 8, 100 if opts.quick else 500)
        out["clients_1"] = run_clients(home, 1, events // 4 if opts.quick else events // 2, opts.size, "one",
                                       proc.pid)
        # The hook journal's counts so far (`status`): hooks journaled (`appended`), and those that came with others
        # and shared a commit instead (`together`).
        out["clients_1"]["journal"] = status(home).get("journal")
        out["clients_8"] = run_clients(home, 8, events // 8, opts.size, "eight", proc.pid)
        out["clients_8"]["journal"] = status(home).get("journal")
    finally:
        out["daemon_exit"] = stop_daemon(proc)
    replay_home = root / f"{name}-replay"
    replay_home.mkdir(mode=0o700)
    out["spool_replay"] = spool_replay(replay_home, {**env, "LOOMD_HOME": str(replay_home)}, spool_n, opts.size)
    return out


# Issue #17: the full daemon, 8 clients; and one client's ack p99 next to the ingest-only daemon's, same run.
TARGET_EVENTS_PER_S, TARGET_ACK_P99_MS, TARGET_P99_RATIO = 2000.0, 10.0, 2.0


def acceptance(report: dict[str, Any]) -> dict[str, Any]:
    full, bare = report.get("full_daemon"), report.get("ingest_only")
    if not full:
        return {}
    eight = full["clients_8"]
    out: dict[str, Any] = {
        "full_8_clients_events_per_s": [eight["events_per_s"], TARGET_EVENTS_PER_S,
                                        eight["events_per_s"] >= TARGET_EVENTS_PER_S],
        "full_8_clients_ack_p99_ms": [eight["ack_ms"]["p99"], TARGET_ACK_P99_MS,
                                      eight["ack_ms"]["p99"] <= TARGET_ACK_P99_MS],
    }
    if bare:
        ratio = full["clients_1"]["ack_ms"]["p99"] / max(bare["clients_1"]["ack_ms"]["p99"], 1e-9)
        out["full_vs_ingest_only_1_client_ack_p99_ratio"] = [round(ratio, 2), TARGET_P99_RATIO,
                                                             ratio <= TARGET_P99_RATIO]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: about a minute")
    parser.add_argument("--events", type=int, default=None, help="events per client run (split over clients)")
    parser.add_argument("--size", type=int, default=2048, help="bytes per hook payload")
    parser.add_argument("--spool", type=int, default=None, help="spool files to replay")
    parser.add_argument("--embedder", default="local", help="LOOMD_EMBEDDER of the full_daemon config")
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append", help="run only these configs")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose daemon runs (default: this one)")
    opts = parser.parse_args(argv)
    events = opts.events or (800 if opts.quick else 8000)
    spool_n = opts.spool or (500 if opts.quick else 5000)
    report: dict[str, Any] = {"bench": "ingest", "machine": machine(),
                              "params": {"repo": str(opts.repo), "events": events, "size": opts.size, "spool": spool_n,
                                         "quick": opts.quick,
                                         "client": "the shim's pack_args/call: a connection per event, `hook` op, "
                                                   "acknowledged after COMMIT (WAL, synchronous=FULL)"}}
    root = Path(tempfile.mkdtemp(prefix="lbi", dir="/tmp"))
    started = time.monotonic()
    try:
        report["baseline"] = sqlite_floor(root, min(events, 2000), opts.size)
        floor = report["baseline"]["commit_per_event_per_s"]
        summary: dict[str, Any] = {}
        for name in opts.config or list(CONFIGS):
            result = bench_config(root, name, CONFIGS[name], opts, events, spool_n)
            report[name] = result
            one, eight, replay = result["clients_1"], result["clients_8"], result["spool_replay"]
            summary[name] = {
                "events_per_s_1_client": one["events_per_s"], "events_per_s_8_clients": eight["events_per_s"],
                "ack_p50_p99_ms_1_client": [one["ack_ms"]["p50"], one["ack_ms"]["p99"]],
                "ack_p50_p99_ms_8_clients": [eight["ack_ms"]["p50"], eight["ack_ms"]["p99"]],
                "cpu_ms_per_event_1_client": one["cpu_ms_per_event"],
                "cpu_ms_per_event_8_clients": eight["cpu_ms_per_event"],
                "client_cpu_ms_per_event_8_clients": eight["client_cpu_ms_per_event"],
                "background_transactions_8_clients": eight["background_transactions"],
                "spool_replay_events_per_s": replay["replay_events_per_s"],
                "errors": sum(one["errors"].values()) + sum(eight["errors"].values()),
                "ratio_1_client_vs_commit_floor": round(one["events_per_s"] / floor, 2),
                "ratio_8_clients_vs_commit_floor": round(eight["events_per_s"] / floor, 2),
                "ratio_ack_p50_vs_ping_p50": round(one["ack_ms"]["p50"] / result["ping"]["p50"], 2),
                "ratio_replay_vs_commit_floor": round(replay["replay_events_per_s"] / floor, 2),
            }
        report["summary"] = summary
        report["acceptance"] = acceptance(report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    try:
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
