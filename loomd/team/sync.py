"""Sync with the team's server: push this machine's queued changes, pull everyone else's, one short transaction at a
time on each side, on a connection of its own, which lives on a thread of its own (`team/wire.py`): the hooks'
event loop reads and writes the local store and hands each batch over.

A cycle pushes first (so a conflict is settled on the server, where the loser goes to history and the winner comes
straight back), then pulls past its watermark. A failure (server down, refused, timed out) closes the connection,
records the error and backs off (doubling up to BACKOFF_MAX_S); the hook path never waits on any of it: the local
store keeps capturing and the outbox keeps every change until a push gets through.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import socket
import sqlite3
import time
from collections.abc import Callable, Collection
from typing import Any

import asyncpg

from loomd.config import Config
from loomd.errors import ChildDied, SharedError
from loomd.ignore import PRIVATE_FILE, PrivateProjects
from loomd.offload import Offload
from loomd.redact import redact_text
from loomd.store.db import Store, on_thread
from loomd.store.memories import MemoryWriter
from loomd.team import local, remote, schema
from loomd.team.local import Identity
from loomd.team.remote import Watermark
from loomd.team.rows import Verdict
from loomd.team.wire import Wire

log = logging.getLogger(__name__)

PULL_CHECKPOINT = "shared:pull"
PUSH_CHECKPOINT = "shared:push"  # rows pushed by this daemon so far: written by the commit that syncs a batch's ids
_CHECKPOINT_SQL = ("INSERT INTO checkpoints (name, value, updated) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE"
               " SET value = excluded.value, updated = excluded.updated")
NO_ROW = "00000000-0000-0000-0000-000000000000"
BACKOFF_MAX_S = 300.0
# ChildDied: the offload process (where a batch is redacted) died mid-batch; the next cycle does the batch again.
SYNC_ERRORS: tuple[type[BaseException], ...] = (SharedError, ChildDied, *remote.CONNECTION_ERRORS)
MAX_ROUNDS = 10_000  # batches per direction of a forced cycle (push/pull --now): a bound a healthy one never meets
# Batches per direction of a scheduled cycle: a machine catching up on a large backlog still pushes its own changes
# every few thousand rows, instead of once the whole backlog is in.
CYCLE_ROUNDS = 30


class SyncEngine:
    """One machine's sync: its connection, identity, watermark and health (for `status` and `loom doctor`)."""

    def __init__(self, store: Store, config: Callable[[], Config], memories: MemoryWriter, offload: Offload) -> None:
        self.store = store
        self.offload = offload
        self.config = config
        self.memories = memories
        self.private = PrivateProjects(store.path.parent / PRIVATE_FILE)
        self.lock = asyncio.Lock()
        # Where the connection lives and every server round trip runs: the hooks' event loop only hands over.
        self.wire = Wire()
        self._conn: asyncpg.Connection | None = None
        self._who: Identity | None = None
        self.failures = 0
        self.next_try = 0.0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_push_at: float | None = None
        self.last_pull_at: float | None = None
        self.pushed = 0
        self.pulled = 0
        self.conflicts_lost = 0

    @property
    def configured(self) -> bool:
        return bool(self.config().shared_dsn)

    async def run(self, *, push: bool = True, pull: bool = True, force: bool = False) -> dict[str, Any]:
        """One cycle; `force` (push/pull --now) ignores the backoff. Raises SharedError after recording it."""
        if not self.configured:
            raise SharedError("no shared server configured: set [shared] dsn in the config file or LOOMD_SHARED_DSN")
        async with self.lock:
            wait = self.next_try - time.time()
            if wait > 0 and not force:
                return {"skipped": "backoff", "retry_in_s": round(wait, 1), "last_error": self.last_error}
            out: dict[str, Any] = {}
            try:
                conn, who = await self._connection()
                rounds = MAX_ROUNDS if force else CYCLE_ROUNDS
                if push:
                    out["push"] = await self._push(conn, who, rounds)
                    self.last_push_at = time.time()
                if pull:
                    out["pull"] = await self._pull(conn, who, rounds)
                    self.last_pull_at = time.time()
            except SYNC_ERRORS as exc:
                await self._failed(exc)
                raise SharedError(self.last_error or "sync failed") from None
            self.failures, self.next_try = 0, 0.0
            return out

    async def _connection(self) -> tuple[asyncpg.Connection, Identity]:
        if self._conn is not None and not self._conn.is_closed():
            assert self._who is not None
            return self._conn, self._who
        cfg = self.config()
        if not cfg.shared_team:
            raise SharedError("no team configured: set [shared] team (the team this machine's memories belong to)")
        conn, role = await self.wire.run(_open, cfg)
        self._conn = conn
        self._who = Identity(cfg.shared_team, cfg.shared_device or socket.gethostname(), role)
        return conn, self._who

    async def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = str(exc) if isinstance(exc, SharedError) else remote.describe(exc)
        self.last_error_at = time.time()
        delay = min(BACKOFF_MAX_S, self.config().shared_interval_s * 2 ** min(self.failures, 16))
        self.next_try = time.time() + delay * random.uniform(0.8, 1.0)
        log.warning("shared sync failed (%d in a row; next try in %.0fs): %s", self.failures, delay, self.last_error)
        await self.close()

    async def _push(self, conn: asyncpg.Connection, who: Identity, rounds: int) -> dict[str, int]:
        """The outbox, then the evidence passages of each project opted in to share them."""
        counts = {"inserted": 0, "updated": 0, "same": 0, "lost": 0}
        await self._push_queue(conn, who, rounds, counts, None)
        for project in sorted(self.config().evidence_projects()):
            await self._push_queue(conn, who, rounds, counts, project)
        return counts

    async def _push_queue(self, conn: asyncpg.Connection, who: Identity, rounds: int, counts: dict[str, int],
                          evidence_of: str | None) -> None:
        """Push batch by batch: the outbox, or with `evidence_of` that project's evidence passages. A private
        project sends nothing, even one opted in to share its evidence; the list is read again every batch, so a
        project made private mid-push stops at once."""
        batch = self.config().shared_batch

        def assign(conn: sqlite3.Connection, private: Collection[str]) -> None:
            if evidence_of is None:
                local.assign_gids(conn, private, batch)
            else:
                local.assign_evidence_gids(conn, evidence_of, batch)

        def finish(conn: sqlite3.Connection, done: list[local.Outgoing], private: Collection[str]) -> None:
            local.mark_pushed(conn, done)
            if len(done) == batch:
                assign(conn, private)

        if evidence_of in self.private.current():
            return
        async with self.store.atomic() as db:
            await on_thread(db, functools.partial(assign, private=self.private.current()))
        # `durable_commits` as of the last commit that gave ids without syncing them (None: all on disk).
        unsynced: int | None = None
        for _ in range(rounds):
            private = self.private.current()
            if evidence_of in private:
                return
            rows = await (local.outgoing(self.store.background, private, batch) if evidence_of is None
                          else local.evidence_outgoing(self.store.background, evidence_of, batch))
            if not rows:
                return
            if unsynced is not None and self.store.durable_commits <= unsynced:
                # The ids of this batch were given by a commit not yet synced, and no hook has committed since
                # (a hook's commit syncs it): sync it now. A server must never hold an id this machine could lose.
                async with self.store.atomic() as db:
                    await db.execute(_CHECKPOINT_SQL, (PUSH_CHECKPOINT, str(self.pushed), time.time()))
            queued, verdicts = await self.wire.run(self._send, conn, rows, who)
            winners = [v.winner for v in verdicts if v.outcome == "lost" and v.winner is not None]
            finished = functools.partial(finish, done=queued, private=private)
            if winners:
                # A conflict's winner changes a memory: a durable transaction, and the memory listeners (the
                # vector back-fill) woken.
                async with self.memories.atomic() as db:
                    await on_thread(db, finished)
                    await local.apply(db, self.memories, winners)
                unsynced = None
            else:
                # One short write transaction a batch (the hooks commit on the same writer and wait for it): this
                # batch marked pushed and the next one's global ids given, in one trip to the writer's thread,
                # committed without waiting for the disk. A power cut may undo it: the batch is pushed again (the
                # server answers "same"), and the next batch is not pushed before its ids are on disk (above).
                _, unsynced = await self.store.commit_on_thread(finished, durable=False)
            for verdict in verdicts:
                counts[verdict.outcome] += 1
            self.pushed += len(queued)
            self.conflicts_lost += len(winners)
            if len(queued) < batch:
                return

    async def _send(
        self, conn: asyncpg.Connection, rows: list[dict[str, Any]], who: Identity
    ) -> tuple[list[local.Outgoing], list[Verdict]]:
        """On the wire's thread: the batch redacted in the offload process (the rows written to its pipe from
        here, not from the hooks' loop), then pushed."""
        queued = await self.offload.call("work", local.to_push, rows, who)
        return queued, await remote.push(conn, [o.row for o in queued])

    async def _pull(self, conn: asyncpg.Connection, who: Identity, rounds: int) -> dict[str, int]:
        counts = {"inserted": 0, "updated": 0, "skipped": 0}
        batch = self.config().shared_batch
        for _ in range(rounds):
            mark = await self.watermark()
            got = await self.wire.run(remote.pull, conn, who.team, who.device, mark, batch)
            if not got:
                break
            async with self.memories.atomic() as db:
                for name, n in (await local.apply(db, self.memories, [row for row, _ in got])).items():
                    counts[name] += n
                await db.execute(_CHECKPOINT_SQL, (PULL_CHECKPOINT, json.dumps(list(got[-1][1])), time.time()))
            self.pulled += len(got)
            if len(got) < batch:
                break
        return counts

    async def watermark(self) -> Watermark:
        raw = await self.store.scalar("SELECT value FROM checkpoints WHERE name = ?", (PULL_CHECKPOINT,))
        if not raw:
            return (0, NO_ROW)
        xid, gid = json.loads(raw)
        return (int(xid), str(gid))

    async def status(self) -> dict[str, Any]:
        """Lag and health: what waits to be pushed and since when, the last push and pull, the last error."""
        cfg = self.config()
        if not self.configured:
            return {"configured": False}
        queued, oldest = await local.backlog(self.store.reader, self.private.current())
        now = time.time()
        return {
            "configured": True, "dsn": redact_text(cfg.shared_dsn), "team": cfg.shared_team,
            "device": cfg.shared_device or socket.gethostname(), "connected": self._conn is not None,
            "push_queue": queued, "push_lag_s": round(now - oldest, 3) if oldest else 0.0,
            "last_push_at": self.last_push_at, "last_pull_at": self.last_pull_at,
            "pull_age_s": round(now - self.last_pull_at, 3) if self.last_pull_at else None,
            "pushed": self.pushed, "pulled": self.pulled, "conflicts_lost": self.conflicts_lost,
            "failures": self.failures, "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "retry_in_s": round(max(0.0, self.next_try - now), 1) if self.failures else None,
        }

    async def remote_status(self) -> dict[str, Any]:
        """What the server says: our role, the rows it lets us see, what waits to be pulled, its schema."""
        async with self.lock:
            try:
                conn, who = await self._connection()
                mark = await self.watermark()
                visible, backlog, (version, dim) = await self.wire.run(_server_status, conn, who, mark)
            except remote.CONNECTION_ERRORS as exc:
                await self.close()
                raise SharedError(f"the shared server did not answer: {remote.describe(exc)}") from None
        return {"role": who.person, "visible_rows": visible, "pull_backlog": backlog, "schema_version": version,
                "dim": dim}

    async def close(self) -> None:
        """Close the connection and end the wire's thread (the next cycle starts both afresh)."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await self.wire.run(_close, conn)
        await asyncio.to_thread(self.wire.stop)


async def _open(cfg: Config) -> tuple[asyncpg.Connection, str]:
    """A connection to a server whose schema this loomd speaks, and the role it logged in as."""
    conn = await remote.connect(cfg)
    try:
        await remote.check_schema(conn)
        role = str(await conn.fetchval("SELECT current_user"))
    except BaseException:
        await conn.close()
        raise
    return conn, role


async def _server_status(conn: asyncpg.Connection, who: Identity, mark: Watermark) -> tuple[int, int, tuple[int, int]]:
    visible = int(await conn.fetchval("SELECT count(*) FROM loomd.memories"))
    backlog = await remote.pending(conn, who.team, who.device, mark)
    return visible, backlog, await schema.server_version(conn)


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 2.0)
    except remote.CONNECTION_ERRORS:
        conn.terminate()
