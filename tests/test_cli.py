"""The `loom` CLI as a newcomer meets it, against a real daemon: search with scores and a relevance floor, project
scope made visible, the projects list."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from loomd.cli import main as cli_main
from loomd.client import AsyncClient
from tests.conftest import caught_up

RELEVANT = "We pin SQLite to 3.45 because the FTS5 trigram tokenizer crashed on 3.44 in CI"
UNRELATED = [
    "Marta's birthday party is on the fourth of June at the lake house",
    "Buy oat milk and coffee beans for the office kitchen",
    "The bicycle's rear tyre needs a new inner tube before the weekend ride",
    "Grandmother's apple cake recipe uses cinnamon and brown sugar",
]


async def loom(*args: str) -> Result:
    """`loom ARGS` in-process (click's runner), off the event loop the daemon runs on."""
    return await asyncio.to_thread(CliRunner().invoke, cli_main, list(args))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plain folder (no git) as the current directory: its project key is `dir:<path>`."""
    folder = tmp_path / "shop"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


async def seed(client: AsyncClient, cwd: Path) -> dict[str, Any]:
    ids = {"relevant": (await client.call("store", text=RELEVANT, kind="decision", cwd=str(cwd)))["id"]}
    for n, text in enumerate(UNRELATED):
        ids[f"unrelated{n}"] = (await client.call("store", text=text, kind="fact", cwd=str(cwd)))["id"]
    await caught_up(client)
    return ids


async def test_search_shows_score_and_signal_and_cuts_what_is_not_about_the_query(
        client: AsyncClient, workdir: Path) -> None:
    ids = await seed(client, workdir)
    project = f"dir:{workdir}"

    nonsense = await loom("search", "xyzzy plugh frobnicate")
    assert nonsense.exit_code == 0, nonsense.output
    assert f"no results in project {project}" in nonsense.output
    assert "--all-projects" in nonsense.output
    empty = await loom("search", "")
    assert empty.exit_code == 0 and "no results" in empty.output

    real = await loom("search", "why is the sqlite version pinned")
    assert real.exit_code == 0, real.output
    shown = [line for line in real.output.splitlines() if line.startswith("#")]
    assert len(shown) == 1 and shown[0].startswith(f"#{ids['relevant']} "), real.output
    # The fused score and the signal behind it, with that signal's own score.
    assert any(f" {signal} " in shown[0] for signal in ("vec", "fts", "graph")), shown[0]
    assert "below the relevance floor: --all shows them" in real.output

    everything = await loom("search", "why is the sqlite version pinned", "--all")
    assert sum(line.startswith("#") for line in everything.output.splitlines()) == 1 + len(UNRELATED)

    as_json = json.loads((await loom("search", "why is the sqlite version pinned", "--json")).output)
    assert as_json["project"] == project and as_json["below_floor"] == len(UNRELATED)
    [hit] = as_json["results"]
    assert hit["why"]["signal"] in ("vec", "fts", "graph") and isinstance(hit["why"]["score"], float)


async def test_search_op_without_floor_answers_as_before(client: AsyncClient, workdir: Path) -> None:
    await seed(client, workdir)
    reply = await client.call("search", query="why is the sqlite version pinned", cwd=str(workdir))
    assert reply["count"] == 1 + len(UNRELATED) and "below_floor" not in reply


async def test_project_scope_is_visible_and_a_typo_is_an_error(
        client: AsyncClient, workdir: Path, tmp_path: Path) -> None:
    await seed(client, workdir)
    other = tmp_path / "garden"
    other.mkdir()
    await client.call("store", text="The garden shed keeps the SQLite backups on a USB stick", cwd=str(other))
    await client.call("context", kind="start", session_id="s-garden", cwd=str(other))

    wide = await loom("search", "sqlite", "--all-projects")
    assert wide.exit_code == 0, wide.output
    assert f"[dir:{workdir}]" in wide.output and f"[dir:{other}]" in wide.output

    listing = await loom("projects")
    assert listing.exit_code == 0, listing.output
    rows = {line.split()[0]: line.split() for line in listing.output.splitlines()[1:]}
    assert rows[f"dir:{workdir}"][1:4] == ["0", str(1 + len(UNRELATED)), "0"]  # sessions, memories, evidence
    assert rows[f"dir:{other}"][1:3] == ["1", "1"]
    assert listing.output.splitlines()[1].startswith(f"dir:{other}")  # the latest activity first
    listed = json.loads((await loom("projects", "--json")).output)["projects"]
    assert {p["project"] for p in listed} == {f"dir:{workdir}", f"dir:{other}"}

    named = await loom("search", "sqlite", "--project", f"dir:{other}")
    assert named.exit_code == 0 and "garden shed" in named.output and "FTS5" not in named.output
    typo = await loom("search", "sqlite", "--project", f"dir:{other}x")
    assert typo.exit_code == 1
    assert f"no project 'dir:{other}x'; did you mean: dir:{other}" in typo.output
    nothing_close = await loom("search", "sqlite", "--project", "zz")
    assert nothing_close.exit_code == 1 and "`loom projects` lists them" in nothing_close.output


async def test_projects_on_an_empty_store_says_so(client: AsyncClient) -> None:
    result = await loom("projects")
    assert result.exit_code == 0 and "no projects yet" in result.output
    assert os.environ["LOOMD_HOME"]  # the runner talks to this test's daemon, never the user's


# --- the commands a newcomer looks for ------------------------------------------------------------------------------

def hook_raw(event: str, session: str, **extra: Any) -> bytes:
    return json.dumps({"session_id": session, "cwd": "/tmp", "hook_event_name": event, **extra}).encode()


async def test_events_show_their_text(client: AsyncClient) -> None:
    await client.call("hook", event="UserPromptSubmit", eid="p1",
                      raw=hook_raw("UserPromptSubmit", "ev1", prompt="please add retries to the uploader"))
    await client.call("hook", event="PostToolUse", eid="t1", raw=hook_raw(
        "PostToolUse", "ev1", tool_name="Bash", tool_input={"command": "pytest -q tests/test_upload.py"},
        tool_response={"stdout": "3 passed in 0.2s", "stderr": ""}))
    shown = await loom("events")
    assert shown.exit_code == 0, shown.output
    assert "please add retries to the uploader" in shown.output
    assert "pytest -q tests/test_upload.py" in shown.output
    events = json.loads((await loom("events", "--json")).output)["events"]
    assert events[0]["text"].endswith("please add retries to the uploader") or \
        "please add retries" in events[0]["text"]


async def test_stats_lists_what_the_store_holds(client: AsyncClient, workdir: Path) -> None:
    await seed(client, workdir)
    await client.call("hook", event="Stop", eid="s1", raw=hook_raw("Stop", "st1"))
    shown = await loom("stats")
    assert shown.exit_code == 0, shown.output
    assert "decision" in shown.output and "fact" in shown.output and "Stop" in shown.output
    data = json.loads((await loom("stats", "--json")).output)
    assert data["memories"]["fact"]["active"] == len(UNRELATED)
    scoped = await loom("stats", "--project", f"dir:{workdir}")
    assert scoped.exit_code == 0 and f"dir:{workdir}:" in scoped.output
    assert (await loom("stats", "--project", "nope")).exit_code == 1


async def test_call_takes_its_arguments_with_args_and_still_with_the_old_json(client: AsyncClient) -> None:
    new = await loom("call", "events", "--args", '{"limit": 1}')
    assert new.exit_code == 0 and "events" in json.loads(new.output)
    old = await asyncio.to_thread(CliRunner().invoke, cli_main,
                                  ["call", "events", "--json", '{"limit": 1}'])
    assert old.exit_code == 0 and "events" in json.loads(old.stdout)
    assert "deprecated, use --args" in old.stderr
    bad = await loom("call", "events", "--args", "[1]")
    assert bad.exit_code == 1 and "--args must be a JSON object" in bad.output


async def test_workers_run_final_notes_open_todos_only_when_asked(client: AsyncClient) -> None:
    base = {"agent": "claude", "session_id": "todo1", "project": "p-todo", "source": "transcript"}
    todo = {**base, "kind": "tool_use", "ts": 1_700_000_000.0, "key": "t:todo1:1", "tool_name": "TodoWrite",
            "tool_use_id": "toolu_1", "payload": {"text": "TodoWrite", "tool_name": "TodoWrite", "tool_input": {
                "todos": [{"content": "Write the schema migration for orders", "status": "pending"}]}}}
    done = {**base, "kind": "tool_result", "ts": 1_700_000_001.0, "key": "t:todo1:2", "tool_use_id": "toolu_1",
            "payload": {"text": "Todos have been modified successfully"}}
    await client.call("ingest", events=[todo, done])

    async def dry(flag: str) -> str:
        result = await loom("workers", "run", "observer", "--session", "todo1", "--dry-run", flag)
        assert result.exit_code == 0, result.output
        return result.output

    assert "Write the schema migration for orders" in await dry("--final")
    assert "Write the schema migration for orders" not in await dry("--not-final")


def test_loom_stop_stops_the_daemon_and_loomd_says_its_version(daemon_process: Any, home: Path) -> None:
    import subprocess
    import sys

    from loomd import __version__

    proc = daemon_process().start()
    result = CliRunner().invoke(cli_main, ["stop"])
    assert result.exit_code == 0, result.output
    assert f"stopped loomd (pid {proc.proc.pid})" in result.output
    assert proc.proc.wait(10) == 0 and not (home / "loomd.sock").exists()
    down = CliRunner().invoke(cli_main, ["stop"])
    assert down.exit_code == 1
    version = subprocess.run([sys.executable, "-m", "loomd", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"loomd {__version__}"
