"""BENCH.md §1, the hook path: wall time of one `loom-hook` invocation as the agent spawns it.

Runs the exact installed command line (`<abs python> -S -E <repo>/shims/loom-hook <Event>`, payload on stdin)
for each event kind with the daemon down (spool path) and up (`python -m loomd serve` on a private LOOMD_HOME),
next to same-run baselines: the interpreter floor (`<same python> -S -E -c pass`) and `/bin/true`. Variants are
interleaved round-robin so machine noise lands on all of them alike. Prints one JSON object on stdout, nothing else.

    python bench/hooks.py [--quick] [--runs N] [--events SessionStart,PostToolUse] [--skip-up]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "shims" / "loom-hook"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "transcripts"

# event kind -> the hook-log file name used by the disler/claude-code-hooks-mastery layout under transcripts/
EVENTS = {
    "SessionStart": "session_start.json",
    "UserPromptSubmit": "user_prompt_submit.json",
    "PreToolUse": "pre_tool_use.json",
    "PostToolUse": "post_tool_use.json",
    "Stop": "stop.json",
    "SubagentStop": "subagent_stop.json",
    "PreCompact": "pre_compact.json",
    "Notification": "notification.json",
    "SessionEnd": "session_end.json",
    "notify": "",  # Codex notify: payload in argv
}

_BASE = {"session_id": "9140aa1c-bench", "transcript_path": "/home/u/.claude/projects/-x-proj/9140aa1c-bench.jsonl",
         "cwd": "/x/proj"}  # fmt: skip
BUILTIN: dict[str, dict[str, Any]] = {
    "SessionStart": {**_BASE, "hook_event_name": "SessionStart", "source": "startup"},
    "UserPromptSubmit": {**_BASE, "prompt_id": "3a2e", "permission_mode": "default",
                         "hook_event_name": "UserPromptSubmit", "prompt": "why does the flaky test fail on CI?"},
    "PreToolUse": {**_BASE, "hook_event_name": "PreToolUse", "tool_name": "Bash",
                   "tool_input": {"command": "pytest -q tests/test_x.py", "description": "run tests"},
                   "tool_use_id": "toolu_bench01"},
    "PostToolUse": {**_BASE, "hook_event_name": "PostToolUse", "tool_name": "Bash",
                    "tool_input": {"command": "pytest -q tests/test_x.py"},
                    "tool_response": {"stdout": "....F.\n" + "E   AssertionError\n" * 40, "stderr": "",
                                      "interrupted": False},
                    "tool_use_id": "toolu_bench01", "duration_ms": 812},
    "Stop": {**_BASE, "hook_event_name": "Stop", "stop_hook_active": False,
             "last_assistant_message": "Fixed the race in the fixture; all tests pass."},
    "SubagentStop": {**_BASE, "hook_event_name": "SubagentStop", "stop_hook_active": False, "agent_id": "a1",
                     "agent_type": "general-purpose", "agent_transcript_path": "/home/u/.claude/a1.jsonl"},
    "PreCompact": {**_BASE, "hook_event_name": "PreCompact", "trigger": "auto", "custom_instructions": ""},
    "Notification": {**_BASE, "hook_event_name": "Notification", "message": "Claude needs your permission",
                     "notification_type": "permission_prompt"},
    "SessionEnd": {**_BASE, "hook_event_name": "SessionEnd", "reason": "other"},
    "notify": {"type": "agent-turn-complete", "thread-id": "01a2-bench", "turn-id": "t1", "cwd": "/x/proj",
               "client": "codex_exec", "input-messages": ["hello codex"],
               "last-assistant-message": "FAKE-CODEX-REPLY done."},
}  # fmt: skip


def load_payloads(data: Path, event: str) -> tuple[list[bytes], str]:
    """Every recorded payload for `event` under `data` (compact JSON, as the agent writes it), or the sample."""
    name = EVENTS[event]
    records: list[bytes] = []
    if name and data.is_dir():
        for path in sorted(data.rglob(name)):
            try:
                items = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and item.get("hook_event_name") == event:
                    records.append(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode())
    if records:
        return records, "transcripts"
    return [json.dumps(BUILTIN[event], separators=(",", ":")).encode()], "builtin"


def command(python: str, event: str, payload: bytes) -> tuple[list[str], bytes | None]:
    if event == "notify":
        return [python, "-S", "-E", str(SHIM), "notify", payload.decode()], None
    return [python, "-S", "-E", str(SHIM), event], payload


def spawn(argv: list[str], stdin: bytes | None, env: dict[str, str]) -> tuple[float, bytes, int]:
    """Wall time (ms) from spawn to exit, as a hook runner sees it: payload written, stdin closed, stdout read."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out, _ = proc.communicate(stdin or b"")
    return (time.perf_counter() - start) * 1000, out, proc.returncode


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted_xs[max(0, min(len(sorted_xs) - 1, math.ceil(q * len(sorted_xs)) - 1))]


def summary(xs: list[float]) -> dict[str, Any]:
    s = sorted(xs)
    return {
        "n": len(s),
        "p50": round(percentile(s, 0.50), 3),
        "p95": round(percentile(s, 0.95), 3),
        "p99": round(percentile(s, 0.99), 3),
        "max": round(s[-1], 3),
        "mean": round(sum(s) / len(s), 3),
    }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "node": platform.node(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
    env["LOOMD_HOME"] = str(home)
    return env


# ---------------------------------------------------------------- the daemon


def _frame(obj: dict[str, Any]) -> bytes:
    import msgpack

    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


def call(sock_path: Path, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    import msgpack

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock_path))
        s.sendall(_frame({"v": 1, "id": 1, "op": op, "args": args or {}}))
        head = b""
        while len(head) < 4:
            chunk = s.recv(4 - len(head))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            head += chunk
        (size,) = struct.unpack(">I", head)
        body = b""
        while len(body) < size:
            chunk = s.recv(size - len(body))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            body += chunk
    return msgpack.unpackb(body, raw=False)


def start_daemon(python: str, home: Path, within_s: float) -> tuple[subprocess.Popen[bytes], float]:
    env = clean_env(home)
    start = time.monotonic()
    with open(home / "daemon.log", "ab") as log:
        proc = subprocess.Popen([python, "-m", "loomd", "serve"], cwd=REPO, env=env, stdout=log, stderr=log)
    sock_path = home / "loomd.sock"
    while time.monotonic() - start < within_s:
        if proc.poll() is not None:
            tail = (home / "daemon.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"daemon exited with {proc.returncode}: {tail}")
        try:
            if call(sock_path, "ping", timeout=1.0).get("ok"):
                return proc, time.monotonic() - start
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"daemon socket did not answer within {within_s} s")


def stop_daemon(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# ---------------------------------------------------------------- the runs


def measure(
    python: str, events: list[str], payloads: dict[str, list[bytes]], runs: int, env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Interleave every event kind and both baselines, `runs` rounds (after one warm-up round)."""
    variants: dict[str, tuple[list[str], bytes | None]] = {
        "python_floor": ([python, "-S", "-E", "-c", "pass"], payloads[events[0]][0]),
        "bin_true": (["/bin/true"], payloads[events[0]][0]),
    }
    times: dict[str, list[float]] = {name: [] for name in [*variants, *events]}
    printed: dict[str, int] = {e: 0 for e in events}
    failed: dict[str, int] = {e: 0 for e in events}
    for round_ in range(runs + 1):
        for name, (argv, stdin) in variants.items():
            ms, _, _ = spawn(argv, stdin, env)
            if round_:
                times[name].append(ms)
        for event in events:
            choices = payloads[event]
            argv, stdin = command(python, event, choices[round_ % len(choices)])
            ms, out, rc = spawn(argv, stdin, env)
            if round_:
                times[event].append(ms)
                printed[event] += bool(out)
                failed[event] += rc != 0
    result: dict[str, dict[str, Any]] = {}
    for name, xs in times.items():
        result[name] = summary(xs)
        if name in printed:
            result[name]["printed_stdout"] = printed[name]
            result[name]["nonzero_exit"] = failed[name]
    return result


def with_deltas(stats: dict[str, dict[str, Any]], events: list[str]) -> dict[str, Any]:
    floor = stats["python_floor"]["p50"]
    true = stats["bin_true"]["p50"]
    for event in events:
        s = stats[event]
        s["delta_p50_vs_floor_ms"] = round(s["p50"] - floor, 3)
        s["ratio_p50_vs_floor"] = round(s["p50"] / floor, 3) if floor else None
        s["delta_p50_vs_true_ms"] = round(s["p50"] - true, 3)
    return {
        "baselines": {"python_floor": stats["python_floor"], "bin_true": stats["bin_true"]},
        "events": {e: stats[e] for e in events},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="runs per variant (default 200, --quick 50)")
    parser.add_argument("--quick", action="store_true", help="50 runs per variant")
    parser.add_argument("--events", default=",".join(EVENTS), help="comma-separated event kinds")
    parser.add_argument("--python", default=sys.executable, help="absolute interpreter for the shim and floor")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="transcripts dir with hook logs")
    parser.add_argument("--skip-up", action="store_true", help="only the daemon-down (spool) path")
    parser.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for the daemon")
    opts = parser.parse_args(argv)
    runs = opts.runs or (50 if opts.quick else 200)
    python = str(Path(opts.python).absolute())  # never resolve symlinks: a venv's python must stay the venv's
    events = [e for e in opts.events.split(",") if e]
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        parser.error(f"unknown event kind(s): {', '.join(unknown)}")

    payloads: dict[str, list[bytes]] = {}
    sources: dict[str, Any] = {}
    for event in events:
        payloads[event], origin = load_payloads(opts.data, event)
        sizes = sorted(len(p) for p in payloads[event])
        sources[event] = {"from": origin, "payloads": len(sizes), "bytes_p50": sizes[len(sizes) // 2],
                          "bytes_max": sizes[-1]}  # fmt: skip

    version = subprocess.run([python, "-S", "-E", "-c", "import sys; print(sys.version)"],
                             capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    report: dict[str, Any] = {
        "bench": "hooks",
        "machine": machine(),
        "python": {"executable": python, "version": version},
        "params": {
            "runs": runs,
            "quick": opts.quick,
            "events": events,
            "command": [python, "-S", "-E", str(SHIM), "<Event>"],
            "payloads": sources,
            "timer": "perf_counter around Popen + communicate(payload) + wait",
        },
    }

    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="lb", dir="/tmp"))  # short: AF_UNIX paths are limited to ~107 bytes
    try:
        down_home = root / "down"
        down_home.mkdir()
        down = measure(python, events, payloads, runs, clean_env(down_home))
        report["down"] = with_deltas(down, events)
        spool = down_home / "spool"
        report["down"]["spooled_files"] = len(list(spool.glob("*.msgpack"))) if spool.is_dir() else 0

        if opts.skip_up:
            report["up"] = {"skipped": True}
        else:
            up_home = root / "up"
            up_home.mkdir()
            try:
                proc, ready_s = start_daemon(sys.executable, up_home, opts.start_timeout)
            except (RuntimeError, TimeoutError, OSError) as exc:
                report["up"] = {"error": str(exc)}
            else:
                try:
                    up = measure(python, events, payloads, runs, clean_env(up_home))
                    report["up"] = with_deltas(up, events)
                    report["up"]["daemon_ready_s"] = round(ready_s, 3)
                    try:
                        status = call(up_home / "loomd.sock", "status", timeout=10.0)
                        report["up"]["daemon_status"] = status.get("result", status)
                    except (OSError, ValueError) as exc:
                        report["up"]["daemon_status"] = {"error": str(exc)}
                    log = up_home / "hook.log"
                    report["up"]["hook_log_lines"] = len(log.read_text().splitlines()) if log.exists() else 0
                finally:
                    report["up"]["daemon_exit"] = stop_daemon(proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    try:
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
