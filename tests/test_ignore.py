"""`loom project ignore|include`: nothing from an ignored folder is stored — the real shim stops at once, and the
daemon drops what still arrives (a transcript, the spool) — and `include` lets it back in."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner, Result
from conftest import REPO

from loomd.cli import main as cli_main
from loomd.client import AsyncClient
from loomd.ignore import covers

SHIM = REPO / "shims" / "loom-hook"


async def loom(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli_main, list(args))


async def shim(home: Path, cwd: Path, prompt: str, session: str) -> subprocess.CompletedProcess[bytes]:
    """The installed hook command for a prompt, as Claude runs it, with a clean environment."""
    payload = json.dumps({"session_id": session, "cwd": str(cwd), "hook_event_name": "UserPromptSubmit",
                          "prompt": prompt}).encode()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LOOMD_HOME": str(home)}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-S", "-E", str(SHIM), "--agent", "claude",
                                                    "UserPromptSubmit"], input=payload, capture_output=True,
                                   env=env, timeout=30, cwd="/")


async def prompts(client: AsyncClient, session: str) -> list[str]:
    events = (await client.call("events", session_id=session, limit=50))["events"]
    return [e["text"] for e in events]


async def stored(client: AsyncClient, session: str, word: str) -> bool:
    """Whether the session's prompt holding `word` arrives: at once, or through the spool when a loaded machine
    made the shim miss its ack deadline."""
    for _ in range(300):
        if any(word in text for text in await prompts(client, session)):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_an_ignored_folder_stores_nothing_until_included(client: AsyncClient, home: Path,
                                                               tmp_path: Path) -> None:
    secret, other = tmp_path / "secret-project", tmp_path / "other"
    (secret / "src").mkdir(parents=True)
    other.mkdir()

    done = await loom("project", "ignore", str(secret))
    assert done.exit_code == 0, done.output
    assert f"ignored {secret}" in done.output
    listed = home / "ignored-projects"
    assert listed.read_text() == f"{secret}\n" and stat.S_IMODE(listed.stat().st_mode) == 0o600
    assert f"ignored  {secret}" in (await loom("project")).output

    # The shim, from a subfolder of the ignored project: exit 0, no output, nothing sent, spooled or logged.
    ran = await shim(home, secret / "src", "the codename is Bluefin", "ig1")
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, b"", b"")
    assert await prompts(client, "ig1") == []
    assert not (home / "spool").exists() or not [p for p in (home / "spool").iterdir() if p.is_file()]
    assert not (home / "hook.log").exists()
    # What reaches the daemon anyway (a transcript line, a spooled file, an older shim) is dropped too.
    reply = await client.call("ingest", events=[{"session_id": "ig2", "kind": "user_message", "cwd": str(secret),
                                                  "payload": {"text": "the codename is Bluefin"}}])
    assert reply["accepted"] == 1 and reply["stored"] == 0
    assert await prompts(client, "ig2") == []
    # Elsewhere everything is stored as before.
    ran = await shim(home, other, "what does the exporter do", "ig3")
    assert ran.returncode == 0
    assert await stored(client, "ig3", "exporter")

    back = await loom("project", "include", str(secret))
    assert back.exit_code == 0 and f"included {secret}" in back.output
    ran = await shim(home, secret, "the codename is Bluefin", "ig4")
    assert ran.returncode == 0
    assert await stored(client, "ig4", "Bluefin")
    assert (await loom("project", "include", str(secret))).exit_code == 1  # not ignored any more: says so


def test_covers_is_by_folder_not_by_prefix() -> None:
    assert covers(["/w/app"], "/w/app") and covers(["/w/app"], "/w/app/src/") and covers(["/"], "/tmp")
    assert not covers(["/w/app"], "/w/app2") and not covers(["/w/app"], "/w") and not covers(["/w/app"], None)


def test_the_shim_itself_stops_at_once(home: Path, tmp_path: Path) -> None:
    """With no daemon, a shim that sent the event would spool it: from an ignored folder nothing is written at all;
    from any other folder the event is spooled as always."""
    secret, other = tmp_path / "secret-project", tmp_path / "other"
    secret.mkdir()
    other.mkdir()
    assert CliRunner().invoke(cli_main, ["project", "ignore", str(secret)]).exit_code == 0

    def spooled() -> list[Path]:
        folder = home / "spool"
        return [p for p in folder.iterdir() if p.is_file()] if folder.exists() else []

    ran = asyncio.run(shim(home, secret, "the codename is Bluefin", "ig5"))
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, b"", b"") and spooled() == []
    ran = asyncio.run(shim(home, other, "the codename is Bluefin", "ig6"))
    assert ran.returncode == 0 and len(spooled()) == 1
