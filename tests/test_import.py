"""`loom import`: the real CLI (a child process) against a real daemon, over histories built from the shared real
transcripts laid out as Claude Code (`$CLAUDE_CONFIG_DIR/projects`) and Codex (`$CODEX_HOME/sessions`) keep them.

What an import must equal is what the tailer stores when hooks name the same files; counts after a kill -9 are
compared with an uninterrupted import of the same history in another home.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, DaemonProcess, need_test_data, query, serving

from loomd.client import AsyncClient, Client, RemoteError
from loomd.daemon import Daemon
from loomd.ingest.history import ParserPool
from loomd.ingest.tailer import BATCH_EVENTS

CLI = "import sys; from loomd.cli import main; sys.argv[0] = 'loom'; main()"
SHIM = REPO / "plugin" / "shims" / "loom-hook"
CLAUDE_PROJECTS = "daaain-claude-code-log"  # a real ~/.claude/projects folder, subagent files included
ORPHANS = ("-Users-dain-workspace-coderabbit-review-helper",)  # an agent file without its session: no hook names it
CODEX_FILES = (
    "AcidicSoil-codex-session-view/.sample_session/rollout-2025-11-17T15-30-28-019a93b9-f380-7600-98ff-940e6b99603c"
    ".jsonl",
    "AkashJana18-edgerunner/codex-session.jsonl",
    "kvsankar-agent-history/tests/fixtures/real_sessions/codex/session-01.jsonl",
    "kunalcode12-Empire-of-bits-vorld/codex-session.jsonl",
)
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class History:
    claude: Path  # CLAUDE_CONFIG_DIR
    codex: Path  # CODEX_HOME
    mains: dict[str, Path]  # Claude session id -> its main transcript
    files: list[Path]  # every transcript file

    def env(self) -> dict[str, str]:
        return {"CLAUDE_CONFIG_DIR": str(self.claude), "CODEX_HOME": str(self.codex)}


def make_history(root: Path, copies: int = 1, orphans: bool = True) -> History:
    """Real transcripts as Claude Code and Codex store them; copy n > 0 gets fresh session ids (same content)."""
    data = need_test_data("transcripts")
    claude, codex = root / "claude", root / "codex"
    mains: dict[str, Path] = {}
    files: list[Path] = []
    day = codex / "sessions" / "2025" / "11" / "17"
    day.mkdir(parents=True)
    for n in range(copies):
        def vary(text: str, n: int = n) -> str:
            return text if n == 0 else UUID_RE.sub(lambda m: str(uuid.uuid5(uuid.NAMESPACE_OID, f"{n}:{m[0]}")), text)

        for src in sorted((data / CLAUDE_PROJECTS).rglob("*.jsonl")):
            rel = src.relative_to(data / CLAUDE_PROJECTS)
            if not orphans and rel.parts[0] in ORPHANS:
                continue
            project = f"{rel.parts[0]}-copy{n}" if n else rel.parts[0]
            dest = claude / "projects" / project / vary(str(Path(*rel.parts[1:])))
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(vary(src.read_text()))
            files.append(dest)
            if UUID_RE.fullmatch(dest.stem) and dest.parent.name != "subagents":
                mains[dest.stem] = dest
        for rel in CODEX_FILES:
            text = vary((data / rel).read_text())
            sid = json.loads(text.split("\n", 1)[0])["payload"]["id"]
            dest = day / f"rollout-2025-11-17T10-00-00-{sid}.jsonl"
            dest.write_text(text)
            files.append(dest)
    return History(claude, codex, mains, files)


@pytest.fixture
def other_home() -> Iterator[Path]:
    """A second LOOMD_HOME, short enough for its socket path (~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lm", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def transcript_events(home: Path) -> Counter[tuple[str, str, str]]:
    """Every transcript event by (key, session, kind), with its multiplicity (a duplicate shows as a 2)."""
    return Counter(query(home, "SELECT key, session_id, kind FROM events WHERE source = 'transcript'"))


def event_count(home: Path) -> int:
    if not (home / "loomd.db").exists():
        return 0
    return int(query(home, "SELECT count(*) FROM events")[0][0])


def cli_env(home: Path, history: History, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLAUDE_CONFIG_DIR", "CODEX_HOME")}
    return {**env, "LOOMD_HOME": str(home), **history.env(), **extra}


async def loom(home: Path, history: History, *args: str, stdin: int | None = subprocess.DEVNULL
               ) -> tuple[int, str, str]:
    """The `loom` CLI as a child process, while this loop keeps serving an in-process daemon."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLI, *args, cwd=REPO, env=cli_env(home, history), stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def loom_sync(home: Path, history: History, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *args], cwd=REPO, env=cli_env(home, history),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


async def wait_until(cond: Any, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


def tailed_everything(daemon: Daemon, files: list[Path]) -> bool:
    assert daemon.tailer is not None
    followers = daemon.tailer.followers
    return all(str(p) in followers and followers[str(p)].offset == p.stat().st_size for p in files)


# ---------------------------------------------------------------------------------------------------------------


async def test_import_equals_the_tailer_and_does_not_double_tailed_sessions(
        home: Path, other_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks name each Claude session and the tailer follows it (its subagent files too) and the Codex rollouts;
    `loom import` of the same history in a fresh home stores exactly the same transcript events (keys, sessions,
    kinds), and importing into the tailed home stores nothing new."""
    history = make_history(tmp_path / "h", orphans=False)  # every file here is one the tailer follows
    monkeypatch.setenv("LOOMD_CODEX_HOME", str(history.codex))  # the tailer's Codex folder: the same rollouts
    async with serving(home / "loomd.sock") as daemon, AsyncClient(home / "loomd.sock") as client:
        for sid, path in history.mains.items():
            raw = json.dumps({"session_id": sid, "cwd": "/tmp/import-test", "hook_event_name": "SessionStart",
                              "source": "startup", "transcript_path": str(path)})
            await client.call("hook", event="SessionStart", agent="claude", raw=raw.encode())
        await wait_until(lambda: tailed_everything(daemon, history.files), "the tailer to read every file")
        tailed = transcript_events(home)
        rc, out, err = await loom(home, history, "import", "--yes", "--json")
        assert rc == 0, err
        again = json.loads(out)
        assert again["files"] == len(history.files) and again["failed"] == []
        assert again["events"] > 0 and again["stored"] == 0  # read in full, and every event was already there
        assert transcript_events(home) == tailed

    other = other_home
    monkeypatch.setenv("LOOMD_HOME", str(other))
    monkeypatch.setenv("LOOMD_CODEX_HOME", str(other / "no-codex"))  # this daemon tails nothing by itself
    async with serving(other / "loomd.sock"):
        rc, out, err = await loom(other, history, "import", "--yes", "--json")
        assert rc == 0, err
        result = json.loads(out)
        imported = transcript_events(other)
    assert result["failed"] == [] and result["stored"] == sum(imported.values())
    assert set(tailed.values()) == {1} and set(imported.values()) == {1}
    assert imported == tailed
    sessions = {s for _k, s, _kind in imported}
    assert set(history.mains) <= sessions and len(sessions) == len(history.mains) + len(CODEX_FILES)


async def test_a_secret_inside_a_long_imported_line_is_redacted(
        daemon: Daemon, client: AsyncClient, home: Path, tmp_path: Path) -> None:
    """Import parses in the parser processes, where redaction picks its rules from the triggers a text holds: a key
    deep inside a long tool result, and a token inside a long assistant text, are stored as markers all the same."""
    aws = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzq9Tk3LmN"
    github = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    sid = str(uuid.uuid4())
    output = "build output line 1234 ok\n" * 200 + f"export AWS_SECRET_ACCESS_KEY={aws}\n" + "more output\n" * 100
    said = "Here is what I found. " * 100 + f"The token is {github} and it works. " + "Done. " * 50
    base = {"sessionId": sid, "cwd": str(tmp_path), "timestamp": "2025-11-17T10:00:00Z"}
    lines = [
        {**base, "type": "user", "uuid": str(uuid.uuid4()), "message": {"role": "user", "content": "build it"}},
        {**base, "type": "assistant", "uuid": str(uuid.uuid4()), "message": {"id": "msg_1", "role": "assistant",
         "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "make"}}]}},
        {**base, "type": "user", "uuid": str(uuid.uuid4()), "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": output}]}},
        {**base, "type": "assistant", "uuid": str(uuid.uuid4()), "message": {"id": "msg_2", "role": "assistant",
         "content": [{"type": "text", "text": said}]}},
    ]
    path = tmp_path / f"{sid}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = await client.call("import_file", {"path": str(path)})
    assert result["stored"] == 4
    assert (await client.call("status"))["offload"]["import_parsers"]["files"] == 1  # parsed in a parser process
    payloads = [row[0] for row in query(home, "SELECT payload FROM events WHERE session_id = ?", (sid,))]
    assert len(payloads) == 4
    assert not any(aws in p or github in p for p in payloads)
    assert any("[REDACTED:aws_key]" in p for p in payloads) and any("[REDACTED:github_token]" in p for p in payloads)


async def test_a_file_that_comes_while_idle_parsers_stop_is_parsed_by_a_fresh_one(tmp_path: Path) -> None:
    """The idle parsers are stopped in a thread; a file that comes meanwhile waits for that and starts fresh ones.
    (Sent to a child already told to stop, its call died with it and the file was parsed in the daemon's process,
    a fallback that holds the event loop's interpreter lock.)"""
    sid = str(uuid.uuid4())
    path = tmp_path / f"{sid}.jsonl"
    path.write_text(json.dumps({"type": "user", "sessionId": sid, "uuid": str(uuid.uuid4()), "cwd": str(tmp_path),
                                "timestamp": "2025-11-17T10:00:00Z",
                                "message": {"role": "user", "content": "hello"}}) + "\n")
    pool = ParserPool(1, idle_s=0.0)
    try:
        for _ in range(3):
            _, events = await pool.parse(path, 16_000)
            assert len(events) == 1
            for _ in range(10_000):  # until the idle timer has fired: the children are being stopped
                if pool._closer is None:
                    break
                await asyncio.sleep(0)
            _, events = await pool.parse(path, 16_000)
            assert len(events) == 1
        assert pool.fallbacks == 0 and pool.files == 6
    finally:
        await pool.shutdown()


def test_an_import_parser_process_loads_only_what_parsing_needs() -> None:
    """The parser processes run `read_session_file`: its module imports the transcript parsers, the event model
    and redaction, not the tailer, the writer or the store (each parser starts faster and holds less memory)."""
    from loomd.ingest.history import read_session_file

    probe = (f"import sys, {read_session_file.__module__}; print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split())
    assert read_session_file.__module__ in loaded
    assert not loaded & {"loomd.ingest.tailer", "loomd.ingest.writer", "loomd.store.db", "aiosqlite", "watchfiles"}


@pytest.fixture
def parsers_idle_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The import parsers stop half a second after the last file (the setting, before the daemon starts)."""
    monkeypatch.setenv("LOOMD_IMPORT_IDLE_S", "0.5")


async def test_dry_run_writes_nothing_and_a_second_import_adds_nothing(
        parsers_idle_soon: None, daemon: Daemon, client: AsyncClient, home: Path, tmp_path: Path) -> None:
    """The plan names what the folders hold (CLAUDE_CONFIG_DIR and CODEX_HOME honoured); --dry-run stores nothing;
    without a terminal and without --yes it refuses; an import then a second one: the second adds 0 events, and so
    does a forced re-read (the event keys, not the import records, make it so). The files are parsed in the
    daemon's parser processes, which stop once no file comes."""
    history = make_history(tmp_path / "h")
    rc, out, err = await loom(home, history, "import", "--dry-run", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert sorted(f["path"] for f in plan["files"]) == sorted(map(str, history.files))
    summary = plan["summary"]
    assert summary["agents"] == {"claude": len(history.mains), "codex": len(CODEX_FILES)}
    assert summary["todo_files"] == len(history.files) and summary["imported_files"] == 0
    assert summary["first_ts"] < summary["last_ts"]
    assert "/src/deep-manifest" in summary["by_project"]  # the session's own folder, from its lines
    assert event_count(home) == 0
    rc, out, err = await loom(home, history, "import", "--dry-run")
    assert rc == 0 and f"found {summary['sessions']} session(s)" in out, (out, err)
    rc, out, err = await loom(home, history, "import")
    assert rc != 0 and "--yes" in err, (out, err)
    assert event_count(home) == 0
    assert query(home, "SELECT count(*) FROM checkpoints WHERE name LIKE 'import:%'")[0][0] == 0

    rc, out, err = await loom(home, history, "import", "--yes", "--json")
    assert rc == 0, err
    first = json.loads(out)
    stored = event_count(home)
    assert first["stored"] == stored > 0 and first["files"] == len(history.files)
    assert "B/s" not in err and "%|" not in err  # no progress bar without a terminal
    parsers = (await client.call("status"))["offload"]["import_parsers"]
    assert parsers["files"] == len(history.files) and parsers["fallbacks"] == 0
    await wait_until(lambda: not daemon.history.pool.status()["processes"], "the idle parsers to stop")
    rc, out, err = await loom(home, history, "import", "--yes", "--json")
    second = json.loads(out)
    assert rc == 0 and second["files"] == 0 and second["skipped"] == len(history.files), (out, err)
    rc, out, err = await loom(home, history, "import", "--yes", "--json", "--force")
    assert rc == 0, err
    forced = json.loads(out)
    assert forced["files"] == len(history.files) and forced["events"] == first["events"] and forced["stored"] == 0
    assert event_count(home) == stored


async def test_since_project_and_paths_choose_what_is_imported(
        daemon: Daemon, client: AsyncClient, home: Path, tmp_path: Path) -> None:
    history = make_history(tmp_path / "h")
    rc, out, err = await loom(home, history, "import", "--dry-run", "--json", "--project", "deep-manifest")
    assert rc == 0, err
    chosen = json.loads(out)["files"]
    assert chosen and all("deep-manifest" in f["project"] for f in chosen)
    assert {f["subagent"] for f in chosen} == {False, True}  # the session's agent file counts in its project
    rc, out, err = await loom(home, history, "import", "--dry-run", "--json", "--since", "2026-06-01")
    assert rc == 0, err
    recent = json.loads(out)["files"]
    assert recent and all(f["last_ts"] >= time.mktime((2026, 6, 1, 0, 0, 0, 0, 0, -1)) for f in recent)
    assert len(recent) < len(history.files)
    rc, out, err = await loom(home, history, "import", "--dry-run", "--json", "codex")
    assert rc == 0, err
    assert {f["agent"] for f in json.loads(out)["files"]} == {"codex"}
    one = history.mains[next(iter(sorted(history.mains)))]
    rc, out, err = await loom(home, history, "import", "--yes", "--json", str(one))
    assert rc == 0 and json.loads(out)["files"] == 1, err
    assert {s for (s,) in query(home, "SELECT DISTINCT session_id FROM events")} == {one.stem}
    rc, out, err = await loom(home, history, "import", "--dry-run", "--since", "yesterday")
    assert rc != 0 and "not a date" in err
    rc, out, err = await loom(home, history, "import", "--dry-run", str(tmp_path / "nowhere"))
    assert rc != 0 and "neither 'claude', 'codex' nor an existing file or folder" in err
    # A folder that cannot even be listed (a name longer than the system allows) is the caller's error, said so.
    with pytest.raises(RemoteError, match="cannot be listed: File name too long") as refused:
        await client.call("import_scan", sources=["claude"], claude_dir="/" + "x" * 5000)
    assert refused.value.code == "bad_request"


def test_kill_9_mid_import_then_rerun_gives_the_same_counts(tmp_path: Path, home: Path, other_home: Path) -> None:
    """The daemon dies (SIGKILL) while `loom import` runs; the CLI says so and how to resume; after a restart the
    same command finishes, and the store equals an uninterrupted import of the same history in another home."""
    history = make_history(tmp_path / "h", copies=3)
    quiet = {"LOOMD_PASSIVE": "1", "LOOMD_EMBEDDER": "none", "LOOMD_CODEX_HOME": str(tmp_path / "no-codex")}
    reference_home = other_home
    reference = DaemonProcess(reference_home, quiet).start()
    try:
        done = loom_sync(reference_home, history, "import", "--yes", "--json")
        assert done.returncode == 0, done.stderr
    finally:
        reference.stop()
    want = transcript_events(reference_home)
    assert set(want.values()) == {1}

    victim = DaemonProcess(home, quiet).start()
    try:
        proc = import_under_way(home, history, "the import ended before it was killed")
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(30)
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "Run `loom import` again to resume" in err.replace("\n", " "), err
        at_kill = event_count(home)
        assert 0 < at_kill < sum(want.values())  # it really was killed mid-import
        victim = DaemonProcess(home, quiet).start()
        rerun = loom_sync(home, history, "import", "--yes", "--json")
        assert rerun.returncode == 0, rerun.stderr
        assert json.loads(rerun.stdout)["stored"] == sum(want.values()) - at_kill
        assert transcript_events(home) == want
        again = loom_sync(home, history, "import", "--yes", "--json", "--force")
        assert again.returncode == 0 and json.loads(again.stdout)["stored"] == 0, again.stderr
    finally:
        victim.stop()


def import_under_way(home: Path, history: History, why: str) -> subprocess.Popen[str]:
    """`loom import --yes` started in the background, returned once its first events are stored."""
    proc = subprocess.Popen([sys.executable, "-c", CLI, "import", "--yes", "--json"], cwd=REPO,
                            env=cli_env(home, history), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while event_count(home) == 0:
        assert proc.poll() is None and time.monotonic() < deadline, why
        time.sleep(0.01)
    return proc


def send_hook(home: Path, event: str, body: dict[str, Any]) -> subprocess.CompletedProcess[bytes]:
    """The real shim, as an agent runs it, with a clean environment."""
    payload = json.dumps({**body, "hook_event_name": event}).encode()
    return subprocess.run([sys.executable, "-S", "-E", str(SHIM), event], input=payload, capture_output=True,
                          timeout=30, env={"PATH": os.environ.get("PATH", ""), "HOME": str(home),
                                           "LOOMD_HOME": str(home)})


def test_a_hook_during_an_import_is_acknowledged(tmp_path: Path, home: Path) -> None:
    """The full daemon (embedder, workers) imports; hooks sent by the real shim in the middle of it are served.

    A PostToolUse must be acknowledged within the shim's ack deadline: the shim spools whatever is not, and the
    spool stays empty and unreplayed. A UserPromptSubmit is stored once, acknowledged or (past its 150 ms context
    deadline) through the spool: the import's parsers run only on idle CPU and its commits are sliced with hooks
    between them, but on a shared, loaded 2-CPU machine a prompt's recall and durable commit can still miss that
    deadline (`bench/hooks.py --background-import` measures it), so that part is not asserted here."""
    history = make_history(tmp_path / "h", copies=3)
    daemon = DaemonProcess(home, {"LOOMD_CODEX_HOME": str(tmp_path / "no-codex")}).start()
    try:
        proc = import_under_way(home, history, "the import ended before the hook")
        sid = "hook-during-import"
        base = {"session_id": sid, "cwd": str(tmp_path)}
        tool = send_hook(home, "PostToolUse", {**base, "tool_name": "Bash", "tool_use_id": "toolu_1",
                                               "tool_input": {"command": "pytest -q"},
                                               "tool_response": {"stdout": "3 passed", "stderr": ""}})
        prompt = send_hook(home, "UserPromptSubmit", {**base, "prompt": "what did we decide about the parser?"})
        importing = proc.poll() is None
        out, err = proc.communicate(timeout=300)
        assert importing, "the import finished before the hooks were acknowledged: grow the history"
        assert proc.returncode == 0 and json.loads(out)["stored"] > 0, err
        for shim in (tool, prompt):
            assert shim.returncode == 0 and shim.stderr == b"", shim.stderr
        deadline = time.monotonic() + 30
        while list((home / "spool").glob("*.msgpack")):  # what the shim spooled, the daemon replays
            assert time.monotonic() < deadline, "the spooled hook was never replayed"
            time.sleep(0.05)
        log = home / "hook.log"
        spooled = [line for line in log.read_text().splitlines() if " spooled: " in line] if log.exists() else []
        assert not [line for line in spooled if "PostToolUse" in line], spooled  # acked within its deadline
        assert len(spooled) <= 1 and all("UserPromptSubmit" in line for line in spooled), spooled
        rows = sorted(query(home, "SELECT source, kind FROM events WHERE session_id = ?", (sid,)))
        assert rows == [("hook", "PostToolUse"), ("hook", "UserPromptSubmit")]
    finally:
        daemon.stop()


def test_a_hook_is_committed_between_the_slices_of_an_imported_file(tmp_path: Path, home: Path) -> None:
    """An imported file's events are committed in slices, and a hook arriving meanwhile is committed between two of
    them, not after the whole file: some hook event's id falls inside one imported session's range of ids. Each file
    here is one session and one batch (fewer events than the tailer's BATCH_EVENTS), so before slicing its events
    had consecutive ids and a hook came before or after all of them. Hooks go every 10 ms while the import runs: the
    writer also idles between files (waiting for the parsers), when a hook falls between two sessions."""
    data = need_test_data("transcripts") / CLAUDE_PROJECTS
    source = max(data.rglob("*.jsonl"), key=lambda p: p.stat().st_size)
    lines = source.read_text().splitlines()[:250]
    claude = tmp_path / "h" / "claude"
    for n in range(16):
        text = UUID_RE.sub(lambda m, n=n: str(uuid.uuid5(uuid.NAMESPACE_OID, f"{n}:{m[0]}")), "\n".join(lines))
        dest = claude / "projects" / f"-slices-{n}" / f"{uuid.uuid5(uuid.NAMESPACE_OID, f'{n}:file')}.jsonl"
        dest.parent.mkdir(parents=True)
        dest.write_text(text + "\n")
    history = History(claude, tmp_path / "h" / "codex", {}, [])
    daemon = DaemonProcess(home, {"LOOMD_CODEX_HOME": str(tmp_path / "no-codex")}).start()
    try:
        proc = import_under_way(home, history, "the import ended before its first events were seen")
        sent = 0
        with Client(daemon.sock, timeout=30) as c:
            while proc.poll() is None and sent < 200:
                raw = json.dumps({"session_id": "hook-between-slices", "cwd": str(tmp_path), "tool_name": "Bash",
                                  "tool_use_id": f"toolu_{sent}", "tool_input": {"command": "true"},
                                  "tool_response": {"stdout": "", "stderr": ""}, "hook_event_name": "PostToolUse"})
                assert c.call("hook", {"event": "PostToolUse", "agent": "claude", "raw": raw.encode()})["stored"] == 1
                sent += 1
                time.sleep(0.01)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and json.loads(out)["stored"] > 0, err
        ranges = query(home, "SELECT min(id), max(id), count(*) FROM events WHERE source = 'transcript'"
                       " GROUP BY session_id")
        assert len(ranges) == 16 and all(count < BATCH_EVENTS for _, _, count in ranges), ranges
        hooks = [i for (i,) in query(home, "SELECT id FROM events WHERE session_id = 'hook-between-slices'")]
        assert len(hooks) == sent > 1
        inside = [i for i in hooks if any(low < i < high for low, high, _ in ranges)]
        assert inside, f"none of {sent} hooks was committed inside an imported file's batch"
    finally:
        daemon.stop()


def test_the_back_fill_and_the_workers_wait_for_an_import(tmp_path: Path, home: Path) -> None:
    """While `loom import` runs, the embedding back-fill and the scheduled workers wait (`status` says so) and no
    scheduled worker run starts, though they are due every second; once it is done both resume: vectors are added,
    the imported sessions are observed."""
    history = make_history(tmp_path / "h", copies=2)
    daemon = DaemonProcess(home, {"LOOMD_CODEX_HOME": str(tmp_path / "no-codex"), "LOOMD_WORKER_INTERVAL_S": "1",
                                  "LOOMD_OBSERVE_IDLE_S": "1"}).start()
    try:
        with Client(daemon.sock, timeout=60) as c:
            deadline = time.monotonic() + 120
            while c.call("status")["embedder"]["state"] == "loading":
                assert time.monotonic() < deadline, "the embedder did not load"
                time.sleep(0.1)
            proc = import_under_way(home, history, "the import ended before its first events were seen")
            began = time.time()
            during = c.call("status")
            out, err = proc.communicate(timeout=300)
            ended = time.time()
            assert proc.returncode == 0 and json.loads(out)["stored"] > 0, err
            # Within ACTIVE_GRACE_S of its last file an import still counts as running, so this holds even if it
            # was already done.
            assert during["import"]["running"] and during["embedder"]["held"], during
            started = query(home, "SELECT worker, trigger FROM jobs WHERE started BETWEEN ? AND ?", (began, ended))
            assert started == [], started
            after = c.call("status")
            deadline = time.monotonic() + 120
            while True:  # both resume: the back-fill embeds again, the observer reads the imported sessions
                status = c.call("status")
                observed = query(home, "SELECT count(*) FROM jobs WHERE worker = 'observer' AND started > ?"
                                 " AND items_in > 0", (ended,))[0][0]
                if status["embedder"]["vectors"] > after["embedder"]["vectors"] and observed:
                    break
                assert time.monotonic() < deadline, f"no catch-up after the import: {status['embedder']}, {observed}"
                time.sleep(0.2)
            assert not status["import"]["running"] and not status["embedder"]["held"]
    finally:
        daemon.stop()


def test_progress_bar_on_a_terminal(tmp_path: Path, home: Path) -> None:
    """On a terminal the import shows a bar with its rate and time left; without one (above) it prints none."""
    history = make_history(tmp_path / "h")
    daemon = DaemonProcess(home, {"LOOMD_PASSIVE": "1", "LOOMD_EMBEDDER": "none",
                                  "LOOMD_CODEX_HOME": str(tmp_path / "no-codex")}).start()
    try:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the CLI on the pseudo-terminal, 120 columns wide like a real one
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-c", CLI, "import", "--yes"], cli_env(home, history))
        seen = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        _, status = os.waitpid(pid, 0)
        text = seen.decode(errors="replace")
        assert os.waitstatus_to_exitcode(status) == 0, text
        # tqdm's bar: done/total, [elapsed<time left, rate], and the events read so far
        assert re.search(r"importing: +\d+%\|[^|]*\| \S+/\S+ \[\d\d:\d\d<(\d\d:\d\d|\?), \S+B/s", text), text
        assert re.search(r"importing: 100%\|[^|]*\| \S+/\S+ \[\d\d:\d\d<00:00, \S+B/s, events=\d+", text), text
        assert "events read" in text
    finally:
        daemon.stop()
        shutil.rmtree(tmp_path / "h", ignore_errors=True)
