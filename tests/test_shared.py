"""Shared memory (loomd/team/) against a real PostgreSQL 18 with pgvector, started here (tests/pg_server.py): real
daemons standing for machines, each with its own LOOMD_HOME and database role; the server's tables are read as the
superuser to check what reached it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner
from conftest import DaemonProcess, serving
from pg_server import PgServer
from secret_corpus import SECRET_SAMPLES

from loomd.cli import main as cli_main
from loomd.client import AsyncClient, Client
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.errors import LoomdError
from loomd.ignore import PRIVATE_FILE, write_roots
from loomd.installer.doctor import Checkup, check_shared
from loomd.store.db import Store, connect_sync
from loomd.store.memories import insert_memory
from loomd.team import schema
from loomd.team.rows import uuid7, wins

PROJECT = "git:example.com/acme/widget"


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    """One server for the module; each test makes its own team and roles, so tests never see each other's rows."""
    server = PgServer().start()
    try:
        # `loom shared init` as an admin would run it, twice: the second run finds nothing to do.
        first = CliRunner().invoke(cli_main, ["shared", "init", "--team", "founders", "--member", "root_admin",
                                              "--dim", "384"], env={"LOOMD_SHARED_ADMIN_DSN": server.dsn()})
        assert first.exit_code == 0 and "m001_memories" in first.output, first.output
        assert "GRANT loomd_member TO <member>" in first.output and server.password not in first.output
        again = CliRunner().invoke(cli_main, ["shared", "init", "--dsn", server.dsn(), "--team", "founders",
                                              "--dim", "384"])
        assert again.exit_code == 0 and "already up to date" in again.output, again.output
        yield server
    finally:
        server.close()


async def admin(pg: PgServer, sql: str, *args: Any) -> list[asyncpg.Record]:
    """A query as the superuser, whom row-level security does not restrict."""
    conn = await asyncpg.connect(pg.dsn())
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def make_team(pg: PgServer, *names: str) -> tuple[str, dict[str, str]]:
    """A fresh team with fresh login roles (role name -> password)."""
    suffix = uuid.uuid4().hex[:6]
    team, roles = f"team_{suffix}", {f"{n}_{suffix}": f"pw-{uuid.uuid4().hex[:10]}" for n in names}
    conn = await asyncpg.connect(pg.dsn())
    try:
        await schema.add_members(conn, team, list(roles))
        for role, password in roles.items():
            await conn.execute(f"ALTER ROLE {schema.quote_ident(role)} PASSWORD '{password}'")
    finally:
        await conn.close()
    return team, roles


def test_global_ids_are_uuid7_in_time_order_and_the_later_version_wins() -> None:
    ids = [uuid7(1_700_000_000 + i) for i in range(50)]
    assert all(uuid.UUID(g).version == 7 and uuid.UUID(g).variant == uuid.RFC_4122 for g in ids)
    assert ids == sorted(ids) and len(set(ids)) == 50
    assert wins((2.0, "a"), (1.0, "z")) and wins((1.0, "b"), (1.0, "a")) and not wins((1.0, "a"), (1.0, "a"))


def test_the_dsn_comes_from_the_shared_table_and_is_never_shown_whole(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[shared]\ndsn = "postgresql://alice:Xk9pQ2mZ7w@db.example.com/loom"\n'
                                          'team = "acme"\nevidence_projects = ["git:h/a/one", "git:h/a/two"]\n')
    config = load_config({"LOOMD_HOME": str(tmp_path)})
    assert (config.shared_dsn, config.shared_team) == ("postgresql://alice:Xk9pQ2mZ7w@db.example.com/loom", "acme")
    assert config.evidence_projects() == {"git:h/a/one", "git:h/a/two"}
    shown = config.public()["shared_dsn"]
    assert "Xk9pQ2mZ7w" not in str(shown) and "db.example.com" in str(shown)
    env = {"LOOMD_HOME": str(tmp_path), "LOOMD_SHARED_DSN": "postgresql://bob@h/db"}
    assert load_config(env).shared_dsn == "postgresql://bob@h/db"


class Machine:
    """One daemon standing for one machine: its home, its client, and its settings."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home, self.env = home, env
        self.client: AsyncClient
        self.daemon: Daemon

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        return await self.client.call(op, args or {})

    async def sync(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("shared_sync")
        return result


def machine_env(pg: PgServer, home: Path, team: str, role: str, password: str, device: str,
                **extra: str) -> dict[str, str]:
    """The settings of one machine; the password goes in a file (the DSN carries none), as a user would keep it."""
    secret = home / "pgpass"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    return {"LOOMD_HOME": str(home), "LOOMD_SHARED_DSN": pg.dsn(role, ""), "LOOMD_SHARED_PASSWORD_FILE": str(secret),
            "LOOMD_SHARED_TEAM": team, "LOOMD_SHARED_DEVICE": device, "LOOMD_EMBEDDER": "none",
            "LOOMD_SHARED_INTERVAL_S": "3600", "LOOMD_PASSIVE": "1", **extra}


@asynccontextmanager
async def machine(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> AsyncIterator[Machine]:
    """A real daemon (conftest's `serving`) configured by `env`; the environment is only read as it starts."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    home = Path(env["LOOMD_HOME"])
    m = Machine(home, env)
    async with serving(home / "loomd.sock") as daemon, AsyncClient(home / "loomd.sock") as client:
        m.client, m.daemon = client, daemon
        yield m


@pytest.fixture
def second_home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lm", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def teammates(pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch,
                    **a_settings: str) -> AsyncIterator[tuple[Machine, Machine, str]]:
    """Two machines of a fresh team, A (device "a1", with `a_settings`) and B ("b1"), each with its own role."""
    team, roles = await make_team(pg, "ann", "ben")
    (a_role, a_pw), (b_role, b_pw) = roles.items()
    async with machine(monkeypatch, machine_env(pg, home, team, a_role, a_pw, "a1", **a_settings)) as a, \
            machine(monkeypatch, machine_env(pg, second_home, team, b_role, b_pw, "b1")) as b:
        yield a, b, team


async def server_rows(pg: PgServer, team: str) -> list[asyncpg.Record]:
    return await admin(pg, "SELECT * FROM loomd.memories WHERE team = $1 ORDER BY gid", team)


async def wait_for(check: Any, what: str, within_s: float = 20.0) -> Any:
    for _ in range(int(within_s / 0.05)):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(what)


async def test_a_decision_reaches_the_other_machine_and_an_archive_comes_back(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "alice", "bob")
    alice, bob = roles
    env_a = machine_env(pg, home, team, alice, roles[alice], "laptop-a")
    # B syncs by itself, on the scheduler (non-passive, a short interval): "after one sync" is the worker's.
    env_b = machine_env(pg, second_home, team, bob, roles[bob], "desktop-b", LOOMD_PASSIVE="0",
                        LOOMD_SHARED_INTERVAL_S="0.2")
    async with machine(monkeypatch, env_a) as a, machine(monkeypatch, env_b) as b:
        decision = "Decision: widgets are cached in Redis with a 5 minute TTL, never in process memory"
        stored = await a.call("store", {"text": decision, "kind": "decision", "project": PROJECT})
        pushed = await a.sync()
        assert pushed["push"]["inserted"] == 1

        async def pulled() -> bool:
            return bool((await b.call("shared_status"))["pulled"])
        await wait_for(pulled, "B never pulled A's decision")
        block = await b.call("context", {"kind": "start", "project": PROJECT})
        assert decision in block["text"], block["text"]
        [hit] = (await b.call("search", {"query": "widgets cached Redis", "project": PROJECT}))["results"]
        rows = await server_rows(pg, team)
        assert [(r["device"], r["person"], r["changed_by"], r["pushed_by"]) for r in rows] == [
            ("laptop-a", alice, "laptop-a", alice)]
        assert (hit["origin"], hit["from"]) == ("shared", {"gid": str(rows[0]["gid"]), "device": "laptop-a",
                                                           "person": alice})

        # Archived on B (pushed by B's worker), then pulled by A: the archive propagates.
        assert (await b.call("forget", {"id": hit["id"]}))["archived"] == 1

        async def archived_on_server() -> bool:
            return (await server_rows(pg, team))[0]["archived_at"] is not None
        await wait_for(archived_on_server, "B's archive never reached the server")
        assert (await a.sync())["pull"]["updated"] == 1
        [memory] = (await a.call("detail", {"id": stored["id"], "sources": False}))["memories"]
        assert memory["archived_at"] is not None
        [row] = await server_rows(pg, team)
        assert (row["changed_by"], row["device"], row["pushed_by"]) == ("desktop-b", "laptop-a", bob)
        [old] = await admin(pg, "SELECT why, changed_by FROM loomd.memory_history WHERE gid = $1", row["gid"])
        assert tuple(old) == ("replaced", "laptop-a")


async def test_a_stale_concurrent_edit_loses_and_is_kept_in_history(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "carol", "dave")
    carol, dave = roles
    async with machine(monkeypatch, machine_env(pg, home, team, carol, roles[carol], "c1")) as a, \
            machine(monkeypatch, machine_env(pg, second_home, team, dave, roles[dave], "d1")) as b:
        stored = await a.call("store", {"text": "Procedure: run make lint before every push", "kind": "procedure",
                                        "project": PROJECT})
        await a.sync()
        await b.sync()
        [hit] = (await b.call("search", {"query": "make lint push", "project": PROJECT}))["results"]
        # Both change it without syncing: A archives first, B archives later with another reason, then A
        # restores last. The last change (A's restore) must win on both machines; B's archive is history.
        await b.call("forget", {"id": hit["id"], "reason": "obsolete"})
        await asyncio.sleep(0.01)
        await a.call("forget", {"id": stored["id"]})
        await asyncio.sleep(0.01)
        await a.call("restore", {"id": stored["id"]})
        await a.sync()
        lost = await b.sync()
        assert lost["push"]["lost"] == 1
        [mine] = (await b.call("detail", {"id": hit["id"], "sources": False}))["memories"]
        assert mine["archived_at"] is None  # the winner came straight back with the verdict
        [row] = await server_rows(pg, team)
        assert row["archived_at"] is None and row["changed_by"] == "c1"
        history = await admin(pg, "SELECT why, changed_by, version->>'archived_at' IS NOT NULL AS archived"
                                  " FROM loomd.memory_history WHERE gid = $1 ORDER BY id", row["gid"])
        # A's first version (replaced by its restore) and B's archive (which lost).
        assert [tuple(h) for h in history] == [("replaced", "c1", False), ("lost", "d1", True)]


async def test_other_teams_see_nothing_even_in_sql_and_private_projects_and_secrets_stay_home(
        pg: PgServer, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "erin")
    other, strangers = await make_team(pg, "mallory")
    [erin], [mallory] = roles, strangers
    private_key = "git:example.com/acme/secret-sauce"
    write_roots(home / PRIVATE_FILE, [private_key])
    async with machine(monkeypatch, machine_env(pg, home, team, erin, roles[erin], "e1")) as a:
        await a.call("store", {"text": "Fact: the billing service retries webhooks three times", "project": PROJECT})
        await a.call("store", {"text": "Fact: sauce recipe lives in vault path kv/sauce", "project": private_key})
        # Secrets as an older loomd (or a redactor that has learnt since) may have left them in the store: written
        # straight into SQLite, past today's redaction at insert. The push re-redacts them.
        db = connect_sync(home / "loomd.db")
        with db:
            for i, (text, _secret) in enumerate(SECRET_SAMPLES):
                db.execute("INSERT INTO memories (kind, text, project, created, updated, content_hash, tags)"
                           " VALUES ('fact', ?, ?, 0, 0, ?, '')", (text, PROJECT, f"raw-{i}"))
        db.close()
        pushed = await a.sync()
        assert pushed["push"]["inserted"] == 1 + len(SECRET_SAMPLES)

    rows = await server_rows(pg, team)
    assert len(rows) == 1 + len(SECRET_SAMPLES)
    dump = "\n".join(str(dict(r)) for r in await admin(pg, "SELECT * FROM loomd.memories")) + "\n".join(
        str(dict(r)) for r in await admin(pg, "SELECT * FROM loomd.memory_history"))
    assert "sauce recipe" not in dump and private_key not in dump
    leaked = [secret for _text, secret in SECRET_SAMPLES if secret in dump]
    assert not leaked, f"{len(leaked)} secret(s) reached the server: {leaked[:3]}"

    # Row-level security, proven with hand-written SQL: the superuser sees the team's rows...
    everything = "SELECT count(*) FROM loomd.memories WHERE team = $1"
    assert (await admin(pg, everything, team))[0][0] == len(rows)
    # ...the stranger's role, asking the very same question, sees none of them and can change none.
    conn = await asyncpg.connect(pg.dsn(mallory, strangers[mallory]))
    try:
        assert await conn.fetchval(everything, team) == 0
        assert await conn.fetchval("SELECT count(*) FROM loomd.memories") == 0
        assert await conn.fetchval("SELECT count(*) FROM loomd.team_members WHERE team = $1", team) == 0
        # The full-text function runs as the owner (schema m002) but keeps the same team rule.
        search = "SELECT count(*) FROM loomd.fts(to_tsquery('english', 'billing'), NULL, NULL, true, 100)"
        assert await conn.fetchval(search) == 0
        assert await conn.execute("UPDATE loomd.memories SET text = 'pwned' WHERE team = $1", team) == "UPDATE 0"
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(
                "INSERT INTO loomd.memories (gid, team, project, kind, scope, text, created_at, changed_at,"
                " changed_by, device, person) VALUES ($1, $2, 'p', 'fact', 'project', 'x', 0, 0, 'm', 'm', 'm')",
                uuid.uuid4(), team)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM loomd.memories")
    finally:
        await conn.close()
    # And erin's own role does see them (the policy is per team, not a blanket refusal).
    conn = await asyncpg.connect(pg.dsn(erin, roles[erin]))
    try:
        assert await conn.fetchval(everything, team) == len(rows)
        assert await conn.fetchval(search) == 1
    finally:
        await conn.close()


def _sync_in_thread(sock: Path, out: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            with Client(sock, timeout=120) as c:
                out.append(c.call("shared_sync", {"pull": False}))
        except (LoomdError, OSError) as exc:  # the daemon is killed under it: expected
            out.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def test_offline_capture_then_kill_mid_push_syncs_once_nothing_lost_nothing_doubled(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "frank", "grace")
    frank, grace = roles
    seeded, offline = 1200, 20
    # A's past: memories already in its store when sharing is turned on (the outbox starts with them).
    store = await Store.open(home / "loomd.db")
    async with store.atomic() as db:
        for i in range(seeded):
            await insert_memory(db, kind="fact", text=f"Fact {i}: module m{i} owns table t{i}", project=PROJECT)
    await store.close()

    pg.stop()
    env = machine_env(pg, home, team, frank, roles[frank], "a-box", LOOMD_SHARED_BATCH="20")
    proc = DaemonProcess(home, env)
    try:
        proc.start()
        with Client(proc.sock, timeout=10) as c:
            for i in range(offline):  # captured while the server is down: ingest never waits on it
                c.call("store", {"text": f"Decision {i} taken offline on the train", "kind": "decision",
                                 "project": PROJECT})
            with pytest.raises(LoomdError, match="cannot connect"):
                c.call("shared_sync")
            status = c.call("shared_status")
            assert status["failures"] == 1 and "cannot connect" in status["last_error"]
            assert status["push_queue"] == seeded + offline and status["push_lag_s"] > 0
            assert roles[frank] not in str(status) and c.call("status")["shared"]["failures"] == 1
        shown = CliRunner().invoke(cli_main, ["shared", "status"], env={"LOOMD_HOME": str(home)})
        assert shown.exit_code == 0 and "unreachable: cannot connect" in shown.output, shown.output
        assert f"push queue {seeded + offline}" in shown.output and roles[frank] not in shown.output
        finding = check_shared(Checkup(load_config({**os.environ, **env})))
        assert finding.status == "WARN" and "cannot connect" in finding.detail, finding
        pg.start()

        # Push, and kill -9 the daemon once some batches have committed on the server.
        out: list[Any] = []
        thread = _sync_in_thread(proc.sock, out)

        async def some_pushed() -> int:
            return int((await admin(pg, "SELECT count(*) FROM loomd.memories WHERE team = $1", team))[0][0])
        await wait_for(some_pushed, "nothing reached the server", within_s=30)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(10)
        thread.join(10)
        total = seeded + offline
        at_kill = await some_pushed()  # the dead daemon commits nothing more
        assert 0 < at_kill < total, f"the push was not cut short ({at_kill} of {total} when killed)"
        print(f"kill -9 after {at_kill} of {total} memories reached the server")

        proc.start()  # the same home: the outbox and the global ids survived the kill
        with Client(proc.sock, timeout=60) as c:
            again = c.call("shared_sync")["push"]
            # The rest goes in; at most the batch in flight at the kill (committed there, not yet marked here) is
            # sent again, and the server recognises it.
            assert again["inserted"] == total - at_kill and again["same"] <= 20, again
            assert c.call("shared_status")["push_queue"] == 0
    finally:
        proc.stop()
    counts = (await admin(pg, "SELECT count(*), count(DISTINCT gid), count(DISTINCT text) FROM loomd.memories"
                              " WHERE team = $1", team))[0]
    assert tuple(counts) == (total, total, total), f"on the server: {tuple(counts)} for {total} memories"

    async with machine(monkeypatch, machine_env(pg, second_home, team, grace, roles[grace], "b-box")) as b:
        got = await b.sync()
        assert got["pull"] == {"inserted": total, "updated": 0, "skipped": 0}
        assert (await b.sync())["pull"] == {"inserted": 0, "updated": 0, "skipped": 0}
    pulled = connect_sync(second_home / "loomd.db").execute(
        "SELECT count(*), count(DISTINCT gid), count(DISTINCT text) FROM memories WHERE device = 'a-box'").fetchone()
    assert tuple(pulled) == (total, total, total)


async def test_shared_search_queries_the_server(pg: PgServer, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "heidi")
    [heidi] = roles
    env = machine_env(pg, home, team, heidi, roles[heidi], "h1", LOOMD_EMBEDDER=os.environ.get(
        "LOOMD_TEST_EMBEDDER", "local"))
    async with machine(monkeypatch, env) as a:
        for text in ("Decision: the payment gateway uses idempotency keys on every POST",
                     "Error: flaky test_upload times out on CI when the bucket is cold",
                     "Fact: release notes are generated from conventional commit messages"):
            await a.call("store", {"text": text, "kind": text.split(":")[0].lower(), "project": PROJECT})
        from conftest import caught_up
        await caught_up(a.client)
        await a.sync()
        reply = await a.call("search", {"query": "idempotency keys for payment requests", "scope": "shared",
                                        "project": PROJECT})
        assert reply["scope"] == "shared" and "idempotency" in reply["results"][0]["text"]
        assert reply["results"][0]["person"] == heidi and set(reply["signals"]) == {"fts", "vec"}
        semantic = await a.call("search", {"query": "money transfer retries must not charge twice",
                                           "scope": "shared", "project": PROJECT})
        assert "payment gateway" in semantic["results"][0]["text"]
        assert semantic["results"][0]["signals"].get("vec") == 1
        errors = await a.call("search", {"query": "test", "scope": "shared", "kind": ["error"], "project": PROJECT})
        assert [r["kind"] for r in errors["results"]] == ["error"]


async def test_a_supersession_whose_target_comes_in_a_later_pull_batch_resolves_when_it_arrives(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "ivan", "judy")
    ivan, judy = roles
    # B pulls one row per batch: the old memory (first by global id, the older one) comes a batch before its
    # replacement, so its link names a memory B does not hold yet.
    env_b = machine_env(pg, second_home, team, judy, roles[judy], "j1", LOOMD_SHARED_BATCH="1")
    async with machine(monkeypatch, machine_env(pg, home, team, ivan, roles[ivan], "i1")) as a, \
            machine(monkeypatch, env_b) as b:
        old = await a.call("store", {"text": "Decision: deploys go out on Tuesdays", "kind": "decision",
                                     "project": PROJECT})
        await asyncio.sleep(0.01)  # a later millisecond: a later global id
        new = await a.call("store", {"text": "Decision: deploys go out on Thursdays after the freeze",
                                     "kind": "decision", "project": PROJECT})
        await a.call("supersede", {"id": new["id"], "old": [old["id"]]})
        assert (await a.sync())["push"]["inserted"] == 2
        assert (await b.sync())["pull"]["inserted"] == 2
        by_text = {r["text"]: r for r in (await b.call("memories", {"project": PROJECT, "state": "all"}))["memories"]}
        b_old, b_new = by_text["Decision: deploys go out on Tuesdays"], by_text[
            "Decision: deploys go out on Thursdays after the freeze"]
        assert b_old["superseded_by"] == b_new["id"] and b_new["superseded_by"] is None
        # Resolving the link is sync's own write: nothing is queued, nothing echoes back to the server.
        assert (await b.call("shared_status"))["push_queue"] == 0
        assert (await b.sync())["push"] == {"inserted": 0, "updated": 0, "same": 0, "lost": 0}
        assert await admin(pg, "SELECT * FROM loomd.memory_history WHERE team = $1", team) == []
        assert {(r["text"][:30], r["changed_by"]) for r in await server_rows(pg, team)} == {
            ("Decision: deploys go out on Tu", "i1"), ("Decision: deploys go out on Th", "i1")}


async def test_a_pulled_supersession_links_the_two_memories_as_a_local_one_does(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pushes one row a batch: each batch is marked pushed (and the next one's id given) by a commit that does not
    # wait for the disk, and the next batch waits until that commit is synced.
    async with teammates(pg, home, second_home, monkeypatch, LOOMD_SHARED_BATCH="1") as (a, b, _):
        old = await a.call("store", {"text": "Decision: the API is versioned in the URL path",
                                     "kind": "decision", "project": PROJECT})
        new = await a.call("store", {"text": "Decision: the API is versioned by an Accept header from v3 on",
                                     "kind": "decision", "project": PROJECT})
        await a.call("supersede", {"id": new["id"], "old": [old["id"]]})
        edge = {"direction": "out", "type": "supersedes", "node": "memory"}
        [mine] = [e for e in (await a.call("links", {"id": new["id"]}))["edges"] if e["type"] == "supersedes"]
        assert {k: mine[k] for k in edge} == edge and mine["node_id"] == old["id"]
        assert (await a.sync())["push"]["inserted"] == 2
        assert list((await a.daemon.store.fetchone("SELECT value FROM checkpoints WHERE name = 'shared:push'")) or []
                    ) == ["1"]
        # ...and the writer's connection commits NORMAL as always: what must be durable waits for a sync of the log
        # after its commit (`store.wal`), whoever committed it.
        assert (await (await a.daemon.store.writer.execute("PRAGMA synchronous")).fetchone())[0] == 1
        assert (await b.sync())["pull"]["inserted"] == 2
        by_text = {r["text"]: r for r in (await b.call("memories", {"project": PROJECT, "state": "all"}))["memories"]}
        b_old = by_text["Decision: the API is versioned in the URL path"]
        b_new = by_text["Decision: the API is versioned by an Accept header from v3 on"]
        assert b_old["superseded_by"] == b_new["id"]
        # B holds the chain as A does: the edge from the new memory to the old one (the viewer's chain, search).
        theirs = [e for e in (await b.call("links", {"id": b_new["id"]}))["edges"] if e["type"] == "supersedes"]
        assert [({k: e[k] for k in edge}, e["node_id"]) for e in theirs] == [(edge, b_old["id"])]
        # A later version of the old memory (edited on A) leaves one edge, and nothing echoes back.
        await a.call("edit", {"id": old["id"], "text": "Decision: the API was versioned in the URL path (v1, v2)"})
        await a.sync()
        assert (await b.sync())["pull"]["updated"] == 1
        again = [e for e in (await b.call("links", {"id": b_new["id"]}))["edges"] if e["type"] == "supersedes"]
        assert len(again) == 1 and (await b.call("shared_status"))["push_queue"] == 0


async def test_evidence_is_shared_only_for_projects_that_opt_in_redacted_and_never_from_a_private_one(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    team, roles = await make_team(pg, "ken", "lea")
    ken, lea = roles
    opted, other, private_key = PROJECT, "git:example.com/acme/gadget", "git:example.com/acme/vault"
    write_roots(home / PRIVATE_FILE, [private_key])
    secret_text, secret = SECRET_SAMPLES[0]
    store = await Store.open(home / "loomd.db")
    async with store.atomic() as db:
        # A raw event and the evidence passage the observer cut from it: the passage may go, the event never.
        cur = await db.execute(
            "INSERT INTO events (key, agent, session_id, project, kind, source, ts, received, payload) VALUES"
            " ('k1', 'claude', 's1', ?, 'tool', 'hook', 1, 1, '{\"stdout\": \"RAW-PAYLOAD-7731 stays home\"}')",
            (opted,))
        for project in (opted, other, private_key):
            await insert_memory(db, kind="evidence", scope="session", session_id="s1", project=project,
                                text=f"Bash `pytest -q` in {project}: 3 failed, the fixture db_url is unset",
                                sources=[cur.lastrowid or 0], origin="evidence")
        # A passage stored before today's redactor knew its secret (written past redaction): re-redacted on push.
        await db.execute("INSERT INTO memories (kind, text, project, scope, session_id, created, updated,"
                         " content_hash, tags) VALUES ('evidence', ?, ?, 'session', 's1', 2, 2, 'raw-ev', '')",
                         (secret_text, opted))
    await store.close()

    env_a = machine_env(pg, home, team, ken, roles[ken], "k1",
                        LOOMD_SHARED_EVIDENCE_PROJECTS=f"{opted}, {private_key}")
    async with machine(monkeypatch, env_a) as a:
        assert (await a.sync())["push"]["inserted"] == 2
        assert (await a.sync())["push"] == {"inserted": 0, "updated": 0, "same": 0, "lost": 0}  # sent once
    rows = await server_rows(pg, team)
    assert sorted((r["project"], r["kind"]) for r in rows) == [(opted, "evidence")] * 2
    assert sorted(json.loads(r["provenance"])["sources"] for r in rows) == [0, 1]  # the event counted, not sent
    dump = str([dict(r) for r in await admin(pg, "SELECT * FROM loomd.memories")])
    assert "RAW-PAYLOAD-7731" not in dump and secret not in dump and other not in dump and private_key not in dump

    # A teammate's machine pulls the passages and finds them like its own.
    async with machine(monkeypatch, machine_env(pg, second_home, team, lea, roles[lea], "l1")) as b:
        assert (await b.sync())["pull"]["inserted"] == 2
        [hit] = (await b.call("search", {"query": "fixture db_url unset", "project": opted}))["results"]
        assert hit["kind"] == "evidence" and hit["from"]["device"] == "k1"


async def test_an_evidence_passage_archived_after_its_push_is_archived_on_the_server_and_on_the_team(
        pg: PgServer, home: Path, second_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await Store.open(home / "loomd.db")
    async with store.atomic() as db:
        passage, _ = await insert_memory(db, kind="evidence", scope="session", session_id="s1", project=PROJECT,
                                         text="Bash `make deploy`: the staging host refused the SSH key",
                                         origin="evidence")
    await store.close()
    async with teammates(pg, home, second_home, monkeypatch, LOOMD_SHARED_EVIDENCE_PROJECTS=PROJECT) as (a, b, team):
        assert (await a.sync())["push"]["inserted"] == 1
        assert (await b.sync())["pull"]["inserted"] == 1
        assert (await a.call("forget", {"id": passage, "reason": "the key was rotated"}))["archived"] == 1
        assert (await a.call("shared_status"))["push_queue"] == 1
        assert (await a.sync())["push"]["updated"] == 1
        [row] = await server_rows(pg, team)
        assert row["archived_at"] is not None and row["kind"] == "evidence"
        assert (await b.sync())["pull"]["updated"] == 1
        archived = (await b.call("memories", {"project": PROJECT, "kind": "evidence", "state": "archived"}))
        assert [m["text"] for m in archived["memories"]] == [row["text"]]
        # Restored on B (a pulled passage): the server and A follow; nothing is left queued on either side.
        assert (await b.call("restore", {"id": archived["memories"][0]["id"]}))["restored"] == 1
        assert (await b.sync())["push"]["updated"] == 1
        assert (await server_rows(pg, team))[0]["archived_at"] is None
        assert (await a.sync())["pull"]["updated"] == 1
        [mine] = (await a.call("detail", {"id": passage, "sources": False}))["memories"]
        assert mine["archived_at"] is None
        assert [(await m.call("shared_status"))["push_queue"] for m in (a, b)] == [0, 0]
