"""BENCH.md §1, the hook path: wall time of one hook invocation, spawned the way the agent spawns it.

The commands are the ones `loom install` writes: the bench runs `loom install claude --settings-only` into a
scratch HOME and LOOMD_HOME (which also renders the plugin), reads the hook commands back from the rendered
`hooks/hooks.json` and runs each through `/bin/sh -c` with CLAUDE_PLUGIN_ROOT set, as Claude Code does (Codex uses
`bash -c`); Codex `notify` is the argv from config.toml, exec'd directly. The checked-in plugin's command (the
shell finds the interpreter pinned in `hook-python`) is measured too, daemon up. Per event kind, daemon down
(the spool path) and up (`python -m loomd serve` with one memory stored, so SessionStart renders a real block and
UserPromptSubmit runs a real recall), next to same-run baselines spawned the same way: the interpreter floor
`/bin/sh -c '<python> -S -E -c pass'`, `/bin/sh -c true` and `/bin/true`. Variants are interleaved round-robin
so machine noise lands on all alike. A third side acks every request at once (`instant_daemon`): above the
floor there is only the shim's own cost. Prints one JSON object on stdout, nothing else.

`--background-import N` (issue #17) measures the daemon-up side while `loom import` brings an N-event synthetic
history (bench/import.py's) into the same daemon, embedder and workers on: every hook then competes with the
import, the back-fill and the workers. The report says whether the import ran through the whole measurement and
how many hooks the shim spooled (a UserPromptSubmit spooled missed its context deadline).

`--background-catchup N`: the same import, waited for, then the daemon-up side is measured while the daemon
catches up on it (the back-fill embeds, the workers observe and reflect: what an import leaves to do). So that a
catch-up really runs while the hooks are timed, this variant sets by default (each can be overridden):
`observe_idle_s=5` (the observer takes every imported session at once, not after 10 quiet minutes as a live one),
`worker_interval_s=5` (the workers' interval runs come every 5 s, not every minute) and a pause of `--gap-ms 550`
before each daemon-up spawn (the agent's own time between two hooks): background work waits while live events
arrive without a pause of 0.5 s (`LiveTraffic`), so hooks sent back to back would measure a catch-up that hardly
runs. The report says how far the catch-up went during the measurement (`progress`: vectors embedded, events
observed, observations reflected), what was left after each timed round, and after how many of them work was
still left (`rounds_with_work_left`; `ran_through_measurement` only if after every one: a history too small for
the measurement leaves its last rounds timed on an idle daemon). `--gap-ms 0` measures back to back.

`--asking-prompts`: UserPromptSubmit's prompts are the coding QA dev set's questions instead of the recorded prompts,
of which few ask anything memory answers (3 of 26): every one then runs a recall, as a question to memory does.

`--quiet-first` measures the daemon-up side once more before the background work begins, on the quiet daemon with
the same gap (`quiet_same_gap`): what the gap alone costs (a machine idle for half a second wakes slowly: its disk's
first fsync, its threads' first wake-ups) apart from what the background work adds (`over_quiet`, per kind).

Every daemon-up report has `writer_holds`: per holder (live hook commits, import slices, each worker, the
back-fill), how long its transactions held the one writer connection (`status`'s `writer`), which a hook's
commit waits behind, `writer_gave_way`, how many background transactions gave way to a hook's commit (rolled
back, run again after it), and `writer_paced`, the rests background work took after its transactions while the hooks
came (`background_rest_ratio`: how many, and their length in seconds); and `collector`: Python's collections in the
daemon (each stops the event loop too), how many and the longest by generation.

`--samples FILE` writes every timed spawn (a JSON list), so that a slow one can be told apart: its wall and CPU time,
how often it was preempted or blocked, and how long, meanwhile, some task of the machine waited for a CPU and some
or every one for the disk (Linux's pressure files, /proc/pressure). A hook that waited for a disk stall (the daemon
answers after its commit's fsync) shows `io_full` of about its wait; one that waited for a CPU, `cpu_some`.

    python bench/hooks.py [--quick] [--runs N] [--events SessionStart,PostToolUse] [--skip-up] [--skip-plain]
                          [--gap-ms MS] [--daemon-config KEY=VALUE ...] [--background-import N]
                          [--background-catchup N] [--quiet-first] [--asking-prompts] [--repo DIR]
                          [--samples FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
DEFAULT_DATA = REPO.parent / "shared" / "data" / "transcripts"
PROJECT = "/x/proj"

# event kind -> the hook-log file name used by the disler/claude-code-hooks-mastery layout under transcripts/
EVENTS = {
    "SessionStart": "session_start.json",
    "UserPromptSubmit": "user_prompt_submit.json",
    "PostToolUse": "post_tool_use.json",
    "PostToolUseFailure": "",
    "PreCompact": "pre_compact.json",
    "Stop": "stop.json",
    "SubagentStop": "subagent_stop.json",
    "Notification": "notification.json",
    "SessionEnd": "session_end.json",
    "notify": "",  # Codex notify: payload in argv
}

_BASE = {"session_id": "9140aa1c-bench", "transcript_path": "/home/u/.claude/projects/-x-proj/9140aa1c-bench.jsonl",
         "cwd": PROJECT}  # fmt: skip
_TOOL = {"tool_name": "Bash", "tool_input": {"command": "pytest -q tests/test_x.py"}, "tool_use_id": "toolu_bench01"}
BUILTIN: dict[str, dict[str, Any]] = {
    "SessionStart": {**_BASE, "hook_event_name": "SessionStart", "source": "startup"},
    "UserPromptSubmit": {**_BASE, "prompt_id": "3a2e", "permission_mode": "default",
                         "hook_event_name": "UserPromptSubmit", "prompt": "how do I add a dependency here?"},
    "PostToolUse": {**_BASE, "hook_event_name": "PostToolUse", **_TOOL,
                    "tool_response": {"stdout": "....F.\n" + "E   AssertionError\n" * 40, "stderr": "",
                                      "interrupted": False}, "duration_ms": 812},
    "PostToolUseFailure": {**_BASE, "hook_event_name": "PostToolUseFailure", **_TOOL,
                           "error": "Exit code 1\nE   AssertionError"},
    "PreCompact": {**_BASE, "hook_event_name": "PreCompact", "trigger": "auto", "custom_instructions": ""},
    "Stop": {**_BASE, "hook_event_name": "Stop", "stop_hook_active": False,
             "last_assistant_message": "Fixed the race in the fixture; all tests pass."},
    "SubagentStop": {**_BASE, "hook_event_name": "SubagentStop", "stop_hook_active": False, "agent_id": "a1",
                     "agent_type": "general-purpose", "agent_transcript_path": "/home/u/.claude/a1.jsonl"},
    "Notification": {**_BASE, "hook_event_name": "Notification", "message": "Claude needs your permission",
                     "notification_type": "permission_prompt"},
    "SessionEnd": {**_BASE, "hook_event_name": "SessionEnd", "reason": "other"},
    "notify": {"type": "agent-turn-complete", "thread-id": "01a2-bench", "turn-id": "t1", "cwd": PROJECT,
               "client": "codex_exec", "input-messages": ["hello codex"],
               "last-assistant-message": "FAKE-CODEX-REPLY done."},
}  # fmt: skip
TARGET_P50_MS, TARGET_P99_MS = 3.0, 10.0  # issue 3: within this much of the interpreter floor
# `--background-catchup`'s defaults: a catch-up that runs while the hooks are timed (see the module's text).
CATCHUP_CONFIG = {"observe_idle_s": "5", "worker_interval_s": "5"}
CATCHUP_GAP_MS = 550.0  # just over the 0.5 s pause in live events that lets background work run


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


def asking_prompts(data: Path) -> list[bytes]:
    """UserPromptSubmit payloads whose prompts are the coding QA dev set's questions (next to the transcripts dir
    `data`): each asks what memory holds."""
    questions = json.loads((data.parent / "coding-qa-dev.json").read_text())["questions"]
    return [json.dumps({**BUILTIN["UserPromptSubmit"], "prompt": q["question"]}, separators=(",", ":")).encode()
            for q in questions]


def fresh_session(payload: bytes, n: int) -> bytes:
    """SessionStart of a new session each time: the daemon renders a start block instead of returning a frozen one."""
    try:
        item = json.loads(payload)
    except ValueError:
        return payload
    item["session_id"] = f"bench-{os.getpid()}-{n}"
    item["cwd"] = PROJECT
    return json.dumps(item, separators=(",", ":")).encode()


# ---------------------------------------------------------------- what loom install writes


def installed_commands(python: str, root: Path) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """`loom install claude --settings-only` into a scratch HOME (no client CLI on PATH) and LOOMD_HOME under
    `root`: the plugin-mode hook commands it rendered, the Codex notify argv, and the env the agent runs them with."""
    from loomd.installer.agents import plan

    env = {"HOME": str(root / "user"), "LOOMD_HOME": str(root), "PATH": str(root / "nobin")}
    (root / "user").mkdir(parents=True, exist_ok=True)
    plan("claude", env=env, python=python, settings_only=True).apply()
    plan("codex", env=env, python=python, settings_only=True).apply()
    plugin = root / "plugin" / "loom"
    hooks = json.loads((plugin / "hooks" / "hooks.json").read_text())["hooks"]
    commands = {event: groups[0]["hooks"][0]["command"] for event, groups in hooks.items()}
    notify = tomllib.loads((root / "user" / ".codex" / "config.toml").read_text())["notify"]
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root / "user"),
               "CLAUDE_PLUGIN_ROOT": str(plugin), "CLAUDECODE": "1"}  # fmt: skip
    return commands, notify, run_env


def plain_commands(python: str, root: Path) -> dict[str, str]:
    """The checked-in plugin's commands, with this interpreter pinned in `<LOOMD_HOME>/hook-python`."""
    from loomd.installer.plugin import PINNED_PYTHON

    (root / PINNED_PYTHON).write_text(python + "\n")
    hooks = json.loads((REPO / "plugin" / "hooks" / "hooks.json").read_text())["hooks"]
    return {event: groups[0]["hooks"][0]["command"] for event, groups in hooks.items()}


# ---------------------------------------------------------------- timing


class Spawned(NamedTuple):
    """One spawned hook (or baseline) as `spawn` measured it."""

    ms: float  # wall time, as a hook runner sees it
    out: bytes
    rc: int
    cpu_ms: float  # the spawned process's own CPU time, user + system
    preempted: int  # involuntary context switches: runnable, but another task took its CPU
    blocked: int  # voluntary ones: it waited (for its stdin, the daemon's answer, the disk)
    major_faults: int  # pages it waited for the disk to read


def spawn(argv: list[str], stdin: bytes | None, env: dict[str, str]) -> Spawned:
    """Wall time (ms) from spawn to exit, as a hook runner sees it: payload written, stdin closed, stdout read; and,
    from the spawned process's rusage, its CPU time (user + system), how often it was preempted and how often it
    blocked: the wall time less its CPU is what it waited for (the CPU, the daemon, the disk)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(stdin or b"")  # a hook reads all its stdin before it writes: no deadlock on the pipes
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    out = proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)  # its own rusage, not the sum over every child of this process
    proc.returncode = os.waitstatus_to_exitcode(status)
    ms = (time.perf_counter() - start) * 1000
    return Spawned(ms, out, proc.returncode, (usage.ru_utime + usage.ru_stime) * 1000, usage.ru_nivcsw,
                   usage.ru_nvcsw, usage.ru_majflt)


def pressure() -> dict[str, int] | None:
    """The machine's stall totals (µs) from Linux's pressure files: time some task waited for a CPU (`cpu_some`),
    some for the disk (`io_some`), every running task for the disk (`io_full`); None where there are none."""
    totals: dict[str, int] = {}
    try:
        for resource in ("cpu", "io"):
            with open(f"/proc/pressure/{resource}") as f:
                for line in f:
                    kind, _, rest = line.partition(" ")
                    totals[f"{resource}_{kind}"] = int(rest.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return totals


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted_xs[max(0, min(len(sorted_xs) - 1, math.ceil(q * len(sorted_xs)) - 1))]


def summary(xs: list[float]) -> dict[str, Any]:
    s = sorted(xs)
    return {"n": len(s), "p50": round(percentile(s, 0.50), 3), "p95": round(percentile(s, 0.95), 3),
            "p99": round(percentile(s, 0.99), 3), "max": round(s[-1], 3), "mean": round(sum(s) / len(s), 3)}


Variant = tuple[list[str], bytes | None, dict[str, str]]


def measure(variants: dict[str, list[Variant]], runs: int, gap_ms: float = 0.0,
            after_round: Callable[[], None] | None = None, samples: list[dict[str, Any]] | None = None,
            side: str = "") -> dict[str, dict[str, Any]]:
    """Interleave every variant, `runs` rounds after one warm-up round; a variant may rotate through payloads.
    `gap_ms`: a pause before each spawn (the agent's own time between two hooks). `after_round`: called after each
    timed round, outside the timings (what the catch-up variant samples). `samples`: each timed spawn is appended to
    it (`--samples`), with `side` and what the machine stalled on meanwhile."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    waited: dict[str, list[float]] = {name: [] for name in variants}
    preempted = dict.fromkeys(variants, 0)
    printed = dict.fromkeys(variants, 0)
    failed = dict.fromkeys(variants, 0)
    began = time.monotonic()
    for round_ in range(runs + 1):
        for name, choices in variants.items():
            argv, stdin, env = choices[round_ % len(choices)]
            if gap_ms:
                time.sleep(gap_ms / 1000)
            at, before = time.monotonic() - began, pressure() if samples is not None and round_ else None
            run = spawn(argv, stdin, env)
            if round_:
                times[name].append(run.ms)
                cpu[name].append(run.cpu_ms)
                waited[name].append(run.ms - run.cpu_ms)
                preempted[name] += run.preempted
                printed[name] += bool(run.out)
                failed[name] += run.rc != 0
                if samples is not None:
                    after = pressure()
                    stalled = ({k: round((after[k] - before[k]) / 1000, 2) for k in after}
                               if before is not None and after is not None else None)
                    samples.append({"side": side, "variant": name, "round": round_, "at_s": round(at, 3),
                                    "ms": round(run.ms, 3), "cpu_ms": round(run.cpu_ms, 3),
                                    "preempted": run.preempted, "blocked": run.blocked,
                                    "major_faults": run.major_faults, "stalled_ms": stalled})
        if round_ and after_round is not None:
            after_round()
    # `cpu`: the spawned process's own CPU time; `waited`: its wall time less that (for the CPU, or the daemon).
    return {name: {**summary(xs), "printed_stdout": printed[name], "nonzero_exit": failed[name],
                   "cpu": brief(cpu[name]), "waited": brief(waited[name]), "preempted": preempted[name]}
            for name, xs in times.items()}  # fmt: skip


def brief(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": round(percentile(s, 0.50), 3), "p99": round(percentile(s, 0.99), 3)}


def with_deltas(stats: dict[str, dict[str, Any]], events: list[str], prefix: str = "") -> dict[str, Any]:
    floor = stats["python_floor"]
    out: dict[str, Any] = {}
    for event in events:
        s = stats[prefix + event]
        s["delta_p50_vs_floor_ms"] = round(s["p50"] - floor["p50"], 3)
        s["delta_p99_vs_floor_ms"] = round(s["p99"] - floor["p99"], 3)
        s["ratio_p50_vs_floor"] = round(s["p50"] / floor["p50"], 3) if floor["p50"] else None
        s["meets_target"] = s["delta_p50_vs_floor_ms"] <= TARGET_P50_MS and s["delta_p99_vs_floor_ms"] <= TARGET_P99_MS
        out[event] = s
    return out


def baselines(python: str, payload: bytes) -> dict[str, list[Variant]]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return {
        "python_floor": [(["/bin/sh", "-c", f"{python} -S -E -c pass"], payload, env)],  # spawned as hooks are
        "python_floor_direct": [([python, "-S", "-E", "-c", "pass"], payload, env)],
        "sh_true": [(["/bin/sh", "-c", "true"], payload, env)],
        "bin_true": [(["/bin/true"], payload, env)],
    }


def hook_variants(events: list[str], payloads: dict[str, list[bytes]], commands: dict[str, str],
                  notify: list[str], env: dict[str, str], prefix: str = "") -> dict[str, list[Variant]]:
    out: dict[str, list[Variant]] = {}
    for event in events:
        if event == "notify":
            out[prefix + event] = [([*notify, p.decode()], None, env) for p in payloads[event]]
        elif event in commands:
            choices = payloads[event]
            if event == "SessionStart":
                choices = [fresh_session(choices[n % len(choices)], n) for n in range(64)]
            out[prefix + event] = [(["/bin/sh", "-c", commands[event]], p, env) for p in choices]
    return out


# ---------------------------------------------------------------- the daemon


class InstantDaemon:
    """A stand-in that acks every hook request at once (no parsing, no commit): with it, what remains above the
    floor is the shim's own cost; the real daemon's share (durable commit, planner) is the difference to `up`."""

    def __init__(self, path: Path) -> None:
        import socket
        import threading

        import msgpack

        body = msgpack.packb({"v": 1, "id": 1, "ok": True, "result": {"stored": 1, "stdout": ""}})
        self.reply = len(body).to_bytes(4, "big") + body
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(64)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                try:
                    head = conn.recv(4, 0x100)  # MSG_WAITALL
                    body = int.from_bytes(head, "big")
                    while body > 0:
                        chunk = conn.recv(min(body, 1 << 20))
                        if not chunk:
                            break
                        body -= len(chunk)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()



def start_daemon(python: str, home: Path, within_s: float, repo: Path = REPO,
                 own_session: bool = True) -> tuple[subprocess.Popen[bytes], float]:
    """`python -m loomd serve`, answering. `own_session`: in a session of its own, as its service manager starts
    it (a systemd user service runs in a cgroup of its own, apart from the agent's; Linux schedules a session as a
    group of its own where `kernel.sched_autogroup_enabled` is on): the hooks then compete with the daemon's work
    as the agent's do, group against group. Otherwise it shares the bench's session and group."""
    from loomd.client import Client

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
    env.update(LOOMD_HOME=str(home), LOOMD_CODEX_HOME=str(home / "codex-home"), PYTHONPATH=str(repo))
    start = time.monotonic()
    with open(home / "daemon.log", "ab") as log:
        proc = subprocess.Popen([python, "-m", "loomd", "serve"], cwd=repo, env=env, stdout=log, stderr=log,
                                start_new_session=own_session)
    while time.monotonic() - start < within_s:
        if proc.poll() is not None:
            tail = (home / "daemon.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"daemon exited with {proc.returncode}: {tail}")
        try:
            with Client(home / "loomd.sock", timeout=1.0) as c:
                c.call("ping")
            return proc, time.monotonic() - start
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"daemon socket did not answer within {within_s} s")


def call(home: Path, op: str, **args: Any) -> Any:
    from loomd.client import Client

    with Client(home / "loomd.sock", timeout=30) as c:
        return c.call(op, args)


def stop_daemon(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class BackgroundImport:
    """`loom import --yes` of a synthetic history (bench/import.py's), started now, in the background."""

    def __init__(self, root: Path, home: Path, events: int, repo: Path = REPO) -> None:
        history = importlib.import_module("import")  # bench/import.py: a keyword as a module name
        self.started = time.monotonic()
        self.history = history.make_history(root, events, max(1, events // 400), 10)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
        env.update(LOOMD_HOME=str(home), CLAUDE_CONFIG_DIR=str(root / "claude"), CODEX_HOME=str(root / "codex"),
                   PYTHONPATH=str(repo))
        self.proc = subprocess.Popen([sys.executable, "-c", history.CLI, "import", "--yes", "--json"], cwd=repo,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def wait(self) -> None:
        """Until the import is done (the catch-up variant measures what follows it)."""
        self.proc.wait(timeout=3600)

    def finish(self) -> dict[str, Any]:
        """Called when the measurement ends: whether the import was still running, then its result."""
        running = self.proc.poll() is None
        out, err = self.proc.communicate(timeout=3600)
        result = json.loads(out) if self.proc.returncode == 0 and out.strip() else {"error": err[-500:]}
        return {"history": self.history, "ran_through_measurement": running, "stored": result.get("stored"),
                "seconds": round(time.monotonic() - self.started, 1)}


def catchup(home: Path, besides: str | None = None) -> dict[str, Any]:
    """How far the daemon has caught up: vectors embedded and pending, events observed (the observer's watermarks);
    `besides`: the events and observations of that project left out."""
    from loomd.store.db import connect_sync

    embedder = call(home, "status")["embedder"]
    conn = connect_sync(home / "loomd.db")
    try:
        events, observed = conn.execute(
            "SELECT count(*), coalesce(sum(e.id <= coalesce(CAST(c.value AS INTEGER), 0)), 0) FROM events e"
            " LEFT JOIN checkpoints c ON c.name = 'observer:' || e.session_id WHERE e.project IS NOT ?",
            (besides,)).fetchone()
        observations, reflected = conn.execute(
            "SELECT count(*), coalesce(sum(m.id <= coalesce(CAST(c.value AS INTEGER), 0)), 0) FROM memories m"
            " LEFT JOIN checkpoints c ON c.name = 'reflector:' || m.project WHERE m.kind = 'observation'"
            " AND m.project IS NOT ?", (besides,)).fetchone()
    finally:
        conn.close()
    return {"embedded": embedder.get("embedded"), "vectors_pending": embedder.get("pending"),
            "backfill_caught_up": embedder.get("caught_up"), "backfill_yielded": embedder.get("yielded"),
            "events": events, "observed": observed,
            "observations": observations, "reflected": reflected}


class WorkLeft:
    """After each timed round of the catch-up variant: what the catch-up still had to do (vectors to embed, the
    history's events to observe, observations to reflect). A round timed with none left measured an idle daemon, so
    the report says how many rounds had work left, not only whether the import ran."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.rounds: list[tuple[int, int, int]] = []

    def sample(self) -> None:
        # The history's own work: the bench's live sessions (its project) are never idle long enough to be observed
        # while it runs.
        now = catchup(self.home, besides=f"dir:{PROJECT}")
        pending, unobserved = int(now["vectors_pending"] or 0), now["events"] - now["observed"]
        unreflected = now["observations"] - now["reflected"]
        self.rounds.append((pending, unobserved, unreflected))

    def report(self) -> dict[str, Any]:
        busy = [any(r) for r in self.rounds]
        return {"rounds": len(self.rounds), "rounds_with_work_left": sum(busy),
                "ran_through_measurement": all(busy),
                "left_after_each_round": [list(r) for r in self.rounds]}


def progress(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the catch-up did while the hooks were timed: zero everywhere means it hardly ran."""
    return {key: (after.get(key) or 0) - (before.get(key) or 0) for key in ("embedded", "observed", "reflected")}


def split(events: dict[str, Any], floor: dict[str, Any], service: dict[str, Any] | None) -> dict[str, Any]:
    """Where each kind's time went, p50 / p99 / max in ms: the wall time over the floor; the shim's own CPU time
    (`cpu`) and its wall time less that (`waited`: for a CPU, or the daemon), each next to the floor's; the daemon's
    `answer` (frame read to reply written) and the hook's `arrival` (the shim's send to the frame read), from
    `status`'s `service` (None: a daemon without it, e.g. an older checkout's; its windows include the warm-up)."""
    answer, arrival = ((service or {}).get(k) or {} for k in ("answer", "arrival"))

    def of(kept: dict[str, Any], event: str) -> list[float] | None:
        s = kept.get(f"hook:{event}")
        return [s["p50_ms"], s["p99_ms"], s["max_ms"]] if s else None

    return {event: {"over_floor": [s["delta_p50_vs_floor_ms"], s["delta_p99_vs_floor_ms"],
                                   round(s["max"] - floor["max"], 3)],
                    "cpu": [s["cpu"]["p50"], s["cpu"]["p99"]], "floor_cpu": [floor["cpu"]["p50"], floor["cpu"]["p99"]],
                    "waited": [s["waited"]["p50"], s["waited"]["p99"]],
                    "floor_waited": [floor["waited"]["p50"], floor["waited"]["p99"]],
                    "preempted": s["preempted"], "answer": of(answer, event), "arrival": of(arrival, event)}
            for event, s in events.items()}


def quiet_side(quiet: dict[str, dict[str, Any]], busy: dict[str, Any], events: list[str]) -> dict[str, Any]:
    """The same daemon measured quiet first, with the same gap: its floor, each kind over that floor, and what the
    background work added to each kind (`over_quiet`: the busy run's ms over its floor less the quiet run's, at
    p50 and p99). The gap alone costs something: a machine idle for half a second wakes slowly (its disk's first
    fsync, its threads' first wake-ups), on a quiet daemon too."""
    kinds = with_deltas(quiet, events)
    over = {event: [round(busy[event][f"delta_{q}_vs_floor_ms"] - kinds[event][f"delta_{q}_vs_floor_ms"], 3)
                    for q in ("p50", "p99")] for event in events}
    return {"python_floor": {k: quiet["python_floor"][k] for k in ("p50", "p99", "max")},
            "acceptance": acceptance(kinds), "over_quiet": over}


def acceptance(events: dict[str, Any]) -> dict[str, Any]:
    """Issue 17's hook targets at a glance: per kind, ms over the floor at p50/p99 and whether both are met."""
    kinds = {event: [s["delta_p50_vs_floor_ms"], s["delta_p99_vs_floor_ms"], s["meets_target"]]
             for event, s in events.items()}
    return {"kinds": kinds, "all_met": all(v[2] for v in kinds.values())}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="runs per variant (default 200, --quick 30)")
    parser.add_argument("--quick", action="store_true", help="30 runs per variant: under a minute")
    parser.add_argument("--events", default=",".join(EVENTS), help="comma-separated event kinds")
    parser.add_argument("--python", default=sys.executable, help="absolute interpreter for the hooks and the floor")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="transcripts dir with hook logs")
    parser.add_argument("--skip-up", action="store_true", help="only the daemon-down (spool) path")
    parser.add_argument("--skip-plain", action="store_true", help="skip the checked-in plugin's command")
    parser.add_argument("--daemon-in-bench-session", action="store_true",
                        help="run the daemon in the bench's session (default: a session of its own, as a service)")
    parser.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for the daemon")
    parser.add_argument("--gap-ms", type=float, default=None,
                        help="pause before each spawn, as the agent's own time between hooks (default 0: back to"
                             f" back; {CATCHUP_GAP_MS:g} on the daemon-up side of --background-catchup)")
    parser.add_argument("--daemon-config", action="append", default=[], metavar="KEY=VALUE",
                        help="a TOML line for the daemon's config file, e.g. prompt_semantic_inline=true (repeatable)")
    parser.add_argument("--background-import", type=int, default=0, metavar="N",
                        help="run `loom import` of an N-event synthetic history while the daemon-up side is measured")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout whose daemon (and `loom import`) runs, for an A/B (default: this one)")
    parser.add_argument("--background-catchup", type=int, default=0, metavar="N",
                        help="import an N-event synthetic history first, then measure while the daemon catches up")
    parser.add_argument("--asking-prompts", action="store_true",
                        help="UserPromptSubmit's prompts are the coding QA dev set's questions (each asks what memory"
                             " holds, so each runs a recall), not the recorded ones (few of which do)")
    parser.add_argument("--quiet-first", action="store_true",
                        help="before the background work begins, measure the daemon-up side once on the quiet daemon,"
                             " with the same gap (`up.quiet_same_gap`, and each kind's `over_quiet`)")
    parser.add_argument("--samples", type=Path, default=None, metavar="FILE",
                        help="write every timed spawn to FILE (a JSON list): its side, variant, round, start, wall"
                             " and CPU time, context switches, and what the machine stalled on meanwhile (Linux PSI)")
    opts = parser.parse_args(argv)
    runs = opts.runs or (30 if opts.quick else 200)
    gap_ms = opts.gap_ms or 0.0
    up_gap_ms = opts.gap_ms if opts.gap_ms is not None else CATCHUP_GAP_MS if opts.background_catchup else 0.0
    if opts.background_catchup:
        given = {line.split("=", 1)[0].strip() for line in opts.daemon_config}
        opts.daemon_config += [f"{k}={v}" for k, v in CATCHUP_CONFIG.items() if k not in given]
    python = str(Path(opts.python).absolute())  # never resolve symlinks: a venv's python must stay the venv's
    events = [e for e in opts.events.split(",") if e]
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        parser.error(f"unknown event kind(s): {', '.join(unknown)}")

    payloads: dict[str, list[bytes]] = {}
    sources: dict[str, Any] = {}
    for event in events:
        payloads[event], origin = load_payloads(opts.data, event)
        if event == "UserPromptSubmit" and opts.asking_prompts:
            payloads[event], origin = asking_prompts(opts.data), "coding QA questions"
        sizes = sorted(len(p) for p in payloads[event])
        sources[event] = {"from": origin, "payloads": len(sizes), "bytes_p50": sizes[len(sizes) // 2],
                          "bytes_max": sizes[-1]}  # fmt: skip
    version = subprocess.run([python, "-S", "-E", "-c", "import sys; print(sys.version)"],
                             capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    report: dict[str, Any] = {"bench": "hooks", "machine": machine(), "python": {"executable": python,
                                                                                  "version": version}}
    started = time.monotonic()
    samples: list[dict[str, Any]] | None = [] if opts.samples else None
    root = Path(tempfile.mkdtemp(prefix="lb", dir="/tmp"))  # short: AF_UNIX paths are limited to ~107 bytes
    try:
        down_home, up_home = root / "d", root / "u"
        down_cmds, down_notify, down_env = installed_commands(python, down_home)
        report["params"] = {
            "runs": runs, "quick": opts.quick, "events": events, "payloads": sources,
            "spawn": "/bin/sh -c <command> with CLAUDE_PLUGIN_ROOT set (as Claude Code); notify: argv exec'd",
            "installed_command_example": down_cmds.get("Stop"), "notify_argv": down_notify,
            "timer": "perf_counter around Popen + communicate(payload) + wait", "gap_ms": gap_ms,
            "up_gap_ms": up_gap_ms,
            "daemon_config": opts.daemon_config, "repo": str(opts.repo),
            "daemon_session": "the bench's" if opts.daemon_in_bench_session else "its own (as a service)",
            "target": {"p50_within_ms": TARGET_P50_MS, "p99_within_ms": TARGET_P99_MS},
        }  # fmt: skip
        first = payloads[events[0]][0]
        down = measure({**baselines(python, first),
                        **hook_variants(events, payloads, down_cmds, down_notify, down_env)}, runs,
                       gap_ms, samples=samples, side="down")
        spool = down_home / "spool"
        report["down"] = {"baselines": {k: down[k] for k in baselines(python, first)},
                          "events": with_deltas(down, events),
                          "spooled_files": len(list(spool.glob("*.msgpack"))) if spool.is_dir() else 0}
        instant_home = root / "i"
        i_cmds, i_notify, i_env = installed_commands(python, instant_home)
        instant = InstantDaemon(instant_home / "loomd.sock")
        try:
            fast = measure({**baselines(python, first), **hook_variants(events, payloads, i_cmds, i_notify, i_env)},
                           runs, gap_ms, samples=samples, side="instant_daemon")
        finally:
            instant.close()
        report["instant_daemon"] = {"baselines": {k: fast[k] for k in baselines(python, first)},
                                    "events": with_deltas(fast, events)}
        if opts.skip_up:
            report["up"] = {"skipped": True}
        else:
            up_cmds, up_notify, up_env = installed_commands(python, up_home)
            variants = {**baselines(python, first), **hook_variants(events, payloads, up_cmds, up_notify, up_env)}
            if not opts.skip_plain:
                plain_env = {**up_env, "CLAUDE_PLUGIN_ROOT": str(REPO / "plugin"), "LOOMD_HOME": str(up_home)}
                plain = hook_variants([e for e in events if e != "notify"], payloads, plain_commands(python, up_home),
                                      [], plain_env, prefix="plain:")
                variants.update(plain)
            (up_home / "config.toml").write_text("".join(line + "\n" for line in opts.daemon_config))
            try:
                proc, ready_s = start_daemon(python, up_home, opts.start_timeout, opts.repo.absolute(),
                                             own_session=not opts.daemon_in_bench_session)
            except (RuntimeError, TimeoutError, OSError) as exc:
                report["up"] = {"error": str(exc)}
            else:
                try:
                    call(up_home, "store", text="Use uv for every dependency change, never pip", kind="constraint",
                         cwd=PROJECT)
                    quiet = (measure(variants, runs, up_gap_ms, samples=samples, side="up_quiet")
                             if opts.quiet_first else None)
                    size = opts.background_import or opts.background_catchup
                    background = (BackgroundImport(root / "history", up_home, size, opts.repo.absolute()) if size
                                  else None)
                    left = WorkLeft(up_home) if background is not None and opts.background_catchup else None
                    if left is not None and background is not None:
                        background.wait()
                        before = catchup(up_home)
                    up = measure(variants, runs, up_gap_ms, left.sample if left is not None else None, samples, "up")
                    if left is not None and background is not None:
                        after = catchup(up_home)
                        # The import itself ended before the measurement began: what ran through it is the catch-up.
                        report["up"] = {"background_catchup": {**background.finish(), **left.report(),
                                                               "at_start": before, "at_end": after,
                                                               "progress": progress(before, after)}}
                    elif background is not None:
                        report["up"] = {"background_import": background.finish()}
                    report["up"] = {**report.get("up", {}),
                                    "baselines": {k: up[k] for k in baselines(python, first)},
                                    "events": with_deltas(up, events), "daemon_ready_s": round(ready_s, 3)}
                    report["up"]["acceptance"] = acceptance(report["up"]["events"])
                    if quiet is not None:
                        report["up"]["quiet_same_gap"] = quiet_side(quiet, report["up"]["events"], events)
                    if not opts.skip_plain:
                        plain_events = [e for e in events if e != "notify"]
                        report["up"]["plain_plugin_events"] = with_deltas(up, plain_events, prefix="plain:")
                    status = call(up_home, "status")
                    report["up"]["daemon_counts"] = status.get("counts")
                    report["up"]["spool_backlog"] = status.get("spool_backlog")
                    report["up"]["writer_holds"] = (status.get("writer") or {}).get("holds")
                    report["up"]["writer_gave_way"] = (status.get("writer") or {}).get("gave_way")
                    report["up"]["writer_paced"] = (status.get("writer") or {}).get("paced")
                    # Python's collections in the daemon, each a stop of its every thread (`memory.CollectorPauses`).
                    report["up"]["collector"] = (status.get("memory") or {}).get("collector")
                    # Who is who in a scheduler trace of this run (`bench/schedtrace.py`): the daemon's threads by
                    # Linux id, and its helper process.
                    report["up"]["daemon"] = {"pid": status.get("pid"), "threads": status.get("threads"),
                                              "helper_pid": (status.get("offload") or {}).get("pid")}
                    report["up"]["split"] = split(report["up"]["events"], up["python_floor"], status.get("service"))
                    log = up_home / "hook.log"
                    lines = log.read_text().splitlines() if log.exists() else []
                    report["up"]["hook_log_lines"] = len(lines)
                    report["up"]["spooled"] = {event: sum(f"event={event} " in line and " spooled: " in line
                                                          for line in lines) for event in events}
                finally:
                    report["up"]["daemon_exit"] = stop_daemon(proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    try:
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if opts.samples is not None and samples is not None:
        opts.samples.write_text(json.dumps(samples) + "\n")
        report["samples"] = {"file": str(opts.samples), "spawns": len(samples)}
    sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
