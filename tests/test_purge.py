"""`loom purge` on a real daemon: the text is gone from the database file's bytes (`loomd.db`, `-wal`, `-shm`), not
just from what queries return, and nothing else is lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import caught_up

from loomd.cli import main as cli_main
from loomd.client import AsyncClient, RemoteError

SECRET = "Quokkafrost"  # a private word no redaction rule knows: only a purge can take it out
OTHER = "Wombatglade"
KEEP = "The exporter writes one CSV file per tenant into the reports bucket"


def file_bytes(home: Path) -> bytes:
    """Everything SQLite keeps on disk for the store, lower-cased (the FTS index keeps terms lower-cased)."""
    return b"".join((home / name).read_bytes() for name in ("loomd.db", "loomd.db-wal", "loomd.db-shm")
                    if (home / name).exists()).lower()


def on_disk(home: Path, word: str) -> bool:
    return word.lower().encode() in file_bytes(home)


async def loom(*args: str, answer: str | None = None) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli_main, list(args), input=answer)


def raw(event: str, session: str, cwd: str, **extra: Any) -> bytes:
    return json.dumps({"session_id": session, "cwd": cwd, "hook_event_name": event, **extra}).encode()


async def live_session(client: AsyncClient, session: str, word: str, cwd: str) -> None:
    """A session through the hook path that mentions `word` in a prompt, a command, its output and a rule, then
    distilled (observations, evidence passages, entities) and embedded."""
    await client.call("hook", event="SessionStart", eid=f"{session}-0", context=True,
                      raw=raw("SessionStart", session, cwd, source="startup"))
    await client.call("hook", event="UserPromptSubmit", eid=f"{session}-1", raw=raw(
        "UserPromptSubmit", session, cwd, prompt=f"Never mention the {word} launch codename outside this repo."))
    await client.call("hook", event="PostToolUse", eid=f"{session}-2", raw=raw(
        "PostToolUse", session, cwd, tool_name="Bash", tool_use_id=f"{session}-t",
        tool_input={"command": f"grep -rn {word} docs/{word}-plan.md"},
        tool_response={"stdout": f"docs/{word}-plan.md:3: {word} ships in May", "stderr": ""}))
    await client.call("hook", event="SessionEnd", eid=f"{session}-3", raw=raw("SessionEnd", session, cwd))
    # SessionEnd makes the observer due at once: run it, or wait for the run the event started.
    for _ in range(200):
        await client.call("workers_run", name="observer", session_id=session, final=True)
        found = await client.call("search", query=word, project=f"dir:{cwd}", mode="keyword", session_id=session,
                                  kind=["observation", "evidence"])
        if found["count"] >= 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {session} was never distilled")


async def test_purge_by_match_removes_the_text_from_every_byte_of_the_files(
        client: AsyncClient, home: Path, tmp_path: Path) -> None:
    cwd = str(tmp_path)
    await live_session(client, "pm1", SECRET, cwd)
    kept = (await client.call("store", text=KEEP, kind="fact", cwd=cwd))["id"]
    stored = (await client.call("store", text=f"Remember: {SECRET} is the codename", kind="fact", cwd=cwd))["id"]
    await client.call("context", kind="start", session_id="pm2", cwd=cwd)  # a start block frozen with it
    await caught_up(client)
    assert on_disk(home, SECRET)  # what the purge must take out really is there

    refused = await loom("purge", "--match", SECRET, answer="n\n")
    assert refused.exit_code == 1 and "nothing purged" in refused.output
    assert "for good" in refused.output and "memory #" in refused.output
    assert (await client.call("detail", id=stored))["memories"]

    done = await loom("purge", "--match", SECRET, "--yes")
    assert done.exit_code == 0, done.output
    assert "database rewritten" in done.output and "still in use" not in done.output
    assert not on_disk(home, SECRET), "the purged text is still in loomd.db, -wal or -shm"
    assert not on_disk(home, json.dumps(SECRET))

    # Nothing of it answers any more; the rest of the store still does.
    assert (await client.call("search", query=SECRET, cwd=cwd, mode="keyword"))["results"] == []
    assert (await client.call("timeline", cwd=cwd))["memories"] and \
        (await client.call("search", query="exporter CSV tenant", cwd=cwd, mode="keyword"))["results"][0]["id"] == kept
    events = (await client.call("events", limit=50))["events"]
    assert all(SECRET not in e["payload"] for e in events)
    again = await loom("purge", "--match", SECRET, "--yes")
    assert again.exit_code == 0 and "nothing to purge" in again.output


async def test_purge_a_session_or_ids_leaves_the_others(client: AsyncClient, home: Path, tmp_path: Path) -> None:
    cwd = str(tmp_path)
    await live_session(client, "ps1", SECRET, cwd)
    await live_session(client, "ps2", OTHER, cwd)
    own = (await client.call("store", text=f"A note on {OTHER} kept apart", kind="fact", cwd=cwd))["id"]
    await caught_up(client)

    plan = await client.call("purge", session_id="ps1")
    assert plan["purged"] is False and plan["plan"]["sessions"] == ["ps1"] and plan["plan"]["events"] >= 4
    assert on_disk(home, SECRET)  # asking changes nothing

    done = await loom("purge", "--session", "ps1", "--yes", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["purged"] is True
    assert not on_disk(home, SECRET)
    assert on_disk(home, OTHER)
    assert all(e["session_id"] != "ps1" for e in (await client.call("events", limit=100))["events"])

    by_id = await loom("purge", str(own), "--yes")
    assert by_id.exit_code == 0, by_id.output
    with pytest.raises(RemoteError, match=f"no memory with id {own}"):
        await client.call("detail", id=own)
    assert (await client.call("events", session_id="ps2"))["events"]  # the other session's events stay

    missing = await loom("purge", "999999", "--yes")
    assert missing.exit_code == 1 and "no memory with id 999999" in missing.output
    vague = await loom("purge", "--match", "ab", "--yes")
    assert vague.exit_code == 1 and "at least 4 characters" in vague.output
    assert (await loom("purge", "--yes")).exit_code == 1
