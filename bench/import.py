"""Issue #17: `loom import` of a large history into the full daemon (embedder and workers on).

A synthetic history is made from the shared real transcripts (`$LOOMD_TEST_DATA/transcripts`: Claude Code main
sessions and Codex rollouts) by repeating and varying them: synthetic session s takes real session s mod n and
repeats its lines until it holds events/sessions of them, each repetition with fresh line and tool-call ids, its
message texts marked with (s, repetition) so no two passages share a text, and its folder one of `--projects`
projects. It is laid out as Claude Code and Codex keep it (CLAUDE_CONFIG_DIR, CODEX_HOME) and imported by the real
CLI (`loom import --yes --json`) into a real daemon (`python -m loomd serve`).

Measured: the import's rate (events stored per second of the CLI's run) and the CPU each process used for it (in
all and per event read: on a loaded machine the rate swings, the CPU per event much less), the time until every
event is embedded (the back-fill caught up) and observed (every session's observer watermark at its last event), the
peak RSS of the daemon, its offload process and its import parsers (sampled every 0.2 s; their sum's peak also per
phase: start, with the model's load, import, catch-up, second import), and a second import of the same history
(must add 0). The import starts once the embedder has loaded, as on a daemon that was already running.
`observe_idle_s` is set to 5 s (default 600): an imported session is quiet at once, and the bench measures the
work, not the idle wait. Prints one JSON object.

    python bench/import.py [--events 200000] [--sessions 500] [--projects 25] [--max-wait-s 3600] [--repo DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd.client import Client, wait_until_serving  # noqa: E402
from loomd.store.db import connect_sync  # noqa: E402

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TOOL_ID_RE = re.compile(r"\b(toolu_|call_|msg_)([A-Za-z0-9]+)")
CWD_RE = re.compile(r'"cwd":\s*"[^"]*"')
TEXT_RE = re.compile(r'"text":\s*"')
CLI = "import sys; from loomd.cli import main; sys.argv[0] = 'loom'; main()"


def data_dir() -> Path:
    return Path(os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data") / "transcripts"


def sources(data: Path) -> list[tuple[str, str, list[str]]]:
    """(agent, session id, lines) of every real main session: Claude's `<uuid>.jsonl`, Codex's rollouts."""
    found: list[tuple[str, str, list[str]]] = []
    for path in sorted(data.rglob("*.jsonl")):
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if not lines:
            continue
        if UUID_RE.fullmatch(path.stem) and path.parent.name != "subagents":
            found.append(("claude", path.stem, lines))
        elif '"session_meta"' in lines[0]:
            sid = json.loads(lines[0]).get("payload", {}).get("id")
            if isinstance(sid, str) and UUID_RE.fullmatch(sid):
                found.append(("codex", sid, lines))
    return found


def vary(line: str, mark: str, sid: str, real_sid: str, cwd: str) -> str:
    """One line of a repetition: the session's own id, fresh ids for the rest, its folder, a marked first text."""
    line = UUID_RE.sub(lambda m: sid if m[0] == real_sid else str(uuid.uuid5(uuid.NAMESPACE_OID, f"{mark}:{m[0]}")),
                       line)
    line = TOOL_ID_RE.sub(lambda m: f"{m[1]}{m[2]}{mark.replace(' ', '')}", line)
    line = CWD_RE.sub(cwd, line)
    return TEXT_RE.sub(lambda m: f"{m[0]}({mark}) ", line, count=1)


def make_history(root: Path, events: int, sessions: int, projects: int) -> dict[str, Any]:
    """Write the synthetic history under root/claude and root/codex; returns what was written."""
    real = sources(data_dir())
    if not real:
        raise SystemExit(f"no transcripts under {data_dir()} (set LOOMD_TEST_DATA)")
    per_session = max(1, events // sessions)
    written = 0
    day = root / "codex" / "sessions" / "2025" / "11" / "17"
    day.mkdir(parents=True)
    for s in range(sessions):
        agent, real_sid, lines = real[s % len(real)]
        sid = str(uuid.uuid5(uuid.NAMESPACE_OID, f"bench-import:{s}"))
        cwd = f'"cwd":"/synthetic/proj{s % projects}"'
        out: list[str] = []
        rep = 0
        while len(out) < per_session:
            for line in lines:
                if len(out) >= per_session:
                    break
                if rep and '"session_meta"' in line:
                    continue  # one session_meta per rollout
                out.append(vary(line, f"s{s} r{rep}", sid, real_sid, cwd))
            rep += 1
        if agent == "claude":
            dest = root / "claude" / "projects" / f"-synthetic-proj{s % projects}" / f"{sid}.jsonl"
        else:
            dest = day / f"rollout-2025-11-17T10-00-00-{sid}.jsonl"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("\n".join(out) + "\n")
        written += len(out)
    return {"sessions": sessions, "lines": written, "real_sessions": len(real), "projects": projects}


class RssSampler(threading.Thread):
    """Peak resident memory of the daemon, of its offload process and of its import parsers (while an import runs),
    sampled every 0.2 s; the CPU seconds each has used (`cpu_s`, for rates measured on a loaded machine)."""

    def __init__(self, home: Path, pid: int) -> None:
        super().__init__(daemon=True)
        self.home, self.pid = home, pid
        self.peak = {"daemon_mb": 0.0, "offload_mb": 0.0, "parsers_mb": 0.0, "sum_mb": 0.0}
        self.phase_peak: dict[str, float] = {}  # the sum's peak in each phase (`phase`, set by the bench)
        self.phase_parts: dict[str, dict[str, float]] = {}  # what that peak was made of
        self.phase = "start"
        self.cpu: dict[int, float] = {}
        self.roles: dict[int, str] = {pid: "daemon"}
        self.stop = threading.Event()

    def run(self) -> None:
        child: int | None = None
        parsers: list[int] = []
        while not self.stop.wait(0.2):
            if child is None or rss_mb(child) == 0.0 or not parsers or any(rss_mb(p) == 0.0 for p in parsers):
                try:
                    with Client(self.home / "loomd.sock", timeout=5) as c:
                        offload = c.call("status").get("offload") or {}
                    child = offload.get("pid")
                    parsers = list((offload.get("import_parsers") or {}).get("processes") or [])
                except Exception:  # noqa: BLE001 - busy or restarting: sample the daemon alone this time
                    child = None
            self.roles.update({p: "parsers" for p in parsers})
            if child:
                self.roles[child] = "offload"
            own, off, par = rss_mb(self.pid), rss_mb(child), sum(rss_mb(p) for p in parsers)
            for key, value in (("daemon_mb", own), ("offload_mb", off), ("parsers_mb", par),
                               ("sum_mb", own + off + par)):
                self.peak[key] = max(self.peak[key], round(value, 1))
            if round(own + off + par, 1) > self.phase_peak.get(self.phase, 0.0):
                self.phase_peak[self.phase] = round(own + off + par, 1)
                self.phase_parts[self.phase] = {"daemon": round(own, 1), "offload": round(off, 1),
                                                "parsers": round(par, 1)}
            for pid in (self.pid, child, *parsers):
                if pid and (used := cpu_s(pid)) is not None:
                    self.cpu[pid] = used

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, used in self.cpu.items():
            role = self.roles.get(pid, "other")
            out[role] = round(out.get(role, 0.0) + used, 1)
        return out


def cpu_s(pid: int) -> float | None:
    """User and system CPU seconds a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return 0.0
    return 0.0


def start_daemon(home: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(home / "daemon.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=env["PYTHONPATH"])
    if wait_until_serving(home / "loomd.sock", 60, lambda: proc.poll() is None):
        return proc
    proc.kill()
    raise RuntimeError(f"the daemon did not come up: {(home / 'daemon.log').read_text()[-2000:]}")


def wait_for_embedder(home: Path, timeout: float = 300.0) -> str:
    """The embedder's state once it stopped loading: the model's load (seconds of CPU, its RSS peak) is the daemon's
    start, not the import's, which a user's long-running daemon has behind it."""
    deadline = time.monotonic() + timeout
    state = "loading"
    while state == "loading" and time.monotonic() < deadline:
        with Client(home / "loomd.sock", timeout=30) as c:
            state = c.call("status")["embedder"]["state"]
        time.sleep(0.2)
    return state


def run_import(env: dict[str, str]) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CLI, "import", "--yes", "--json"], env=env, cwd=env["PYTHONPATH"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=24 * 3600, check=False)
    took = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"loom import failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout), took


def unobserved_sessions(db: Path) -> int:
    conn = connect_sync(db)
    try:
        return int(conn.execute(
            "SELECT count(*) FROM sessions s WHERE (SELECT max(id) FROM events e WHERE e.session_id = s.id) >"
            " coalesce((SELECT CAST(value AS INTEGER) FROM checkpoints WHERE name = 'observer:' || s.id), 0)"
        ).fetchone()[0])
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events in the synthetic history")
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--projects", type=int, default=25)
    parser.add_argument("--max-wait-s", type=float, default=3600.0, help="give up waiting for embed/observe after")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose daemon runs (default: this one)")
    opts = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="lbm", dir="/tmp"))
    report: dict[str, Any] = {"bench": "import", "params": {**vars(opts), "repo": str(opts.repo)},
                              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    started = time.monotonic()
    try:
        t0 = time.monotonic()
        report["history"] = make_history(root / "history", opts.events, opts.sessions, opts.projects)
        report["history"]["write_s"] = round(time.monotonic() - t0, 1)
        home = root / "home"
        home.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") and k != "CLAUDECODE"}
        env.update({"LOOMD_HOME": str(home), "LOOMD_EMBEDDER": "local", "LOOMD_OBSERVE_IDLE_S": "5",
                    "PYTHONPATH": str(opts.repo), "CLAUDE_CONFIG_DIR": str(root / "history" / "claude"),
                    "CODEX_HOME": str(root / "history" / "codex"), "LOOMD_CODEX_HOME": str(root / "no-codex")})
        proc = start_daemon(home, env)
        sampler = RssSampler(home, proc.pid)
        sampler.start()
        try:
            report["embedder_at_start"] = wait_for_embedder(home)
            before = sampler.cpu_by_role()
            sampler.phase = "import"
            first, took = run_import(env)
            sampler.phase = "catch_up"
            used = sampler.cpu_by_role()
            stored = int(first.get("stored", 0))
            cpu = {k: v - before.get(k, 0.0) for k, v in used.items()}
            read = max(1, int(first.get("events", 0)))
            report["import"] = {"stored": stored, "seconds": round(took, 1),
                                "events_per_s": round(stored / max(took, 1e-9), 1), "goal_events_per_s": 5000,
                                "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
                                # CPU per event read, by process: what a loaded machine's rate hides
                                "cpu_us_per_event": {k: round(v / read * 1e6) for k, v in cpu.items()},
                                "loadavg": [round(x, 2) for x in os.getloadavg()],
                                "cli": {k: v for k, v in first.items() if not isinstance(v, (list, dict))}}
            t0 = time.monotonic()
            embedded_at = observed_at = None
            while time.monotonic() - t0 < opts.max_wait_s and (embedded_at is None or observed_at is None):
                with Client(home / "loomd.sock", timeout=60) as c:
                    embedder = c.call("status")["embedder"]
                if embedded_at is None and embedder["caught_up"] and embedder["state"] == "ready":
                    embedded_at = time.monotonic() - t0
                if observed_at is None and unobserved_sessions(home / "loomd.db") == 0:
                    observed_at = time.monotonic() - t0
                time.sleep(1.0)
            with Client(home / "loomd.sock", timeout=60) as c:
                status = c.call("status")
            report["after_import"] = {
                "embedded_s": None if embedded_at is None else round(embedded_at, 1),
                "observed_s": None if observed_at is None else round(observed_at, 1),
                "unobserved_sessions": unobserved_sessions(home / "loomd.db"),
                "embedder": {k: status["embedder"].get(k) for k in ("state", "vectors", "pending", "embedded")},
                "counts": status["counts"], "offload": status.get("offload"),
            }
            sampler.phase = "second_import"
            again, took = run_import(env)
            report["second_import"] = {"stored": int(again.get("stored", 0)), "seconds": round(took, 1)}
        finally:
            sampler.stop.set()
            sampler.join()
            report["peak_rss"] = {**sampler.peak, "sum_mb_by_phase": sampler.phase_peak,
                                  "sum_mb_by_phase_parts": sampler.phase_parts, "target_mb": 300}
            proc.terminate()
            report["daemon_exit"] = proc.wait(60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
