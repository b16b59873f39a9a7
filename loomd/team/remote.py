"""The PostgreSQL side: connecting (asyncpg, pgvector's codec), pushing versions, pulling a team's changes.

Each call is one short transaction. Nothing here touches the local store; `team/sync.py` joins the two.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from loomd.config import Config
from loomd.errors import SharedError
from loomd.redact import redact_text
from loomd.team import schema
from loomd.team.rows import Shared, Verdict, wins

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
STATEMENT_TIMEOUT_S = 30.0
# What asyncpg raises for a server that is down, gone, or refuses us.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
# ...and what registering pgvector's codec raises on a server without the extension (ValueError: no such type).
NO_VECTOR: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, ValueError)

_COLUMNS = ("gid, team, project, kind, scope, text, tags, importance, created_at, changed_at, changed_by,"
            " archived_at, superseded_by, device, person, provenance, embed_model, embedding")


def describe(exc: BaseException) -> str:
    """An error as status and logs show it: its class and message, any credential in it redacted."""
    return redact_text(f"{type(exc).__name__}: {exc}")[:500]


def read_password(cfg: Config) -> str | None:
    """The password from `shared_password_file` (first line), if set; else asyncpg falls back on PGPASSFILE or
    ~/.pgpass, and on a password inside the DSN."""
    if not cfg.shared_password_file:
        return None
    try:
        lines = Path(cfg.shared_password_file).expanduser().read_text().splitlines()
    except OSError as exc:
        raise SharedError(f"cannot read shared_password_file {cfg.shared_password_file}: {exc.strerror}") from None
    return lines[0].strip() if lines else None


async def connect(cfg: Config, dsn: str | None = None, *, vector: bool = True) -> asyncpg.Connection:
    """One connection (loomd's own: sync and search never share the user's other sessions) with pgvector's codec
    (`vector`: off for `init`, which may have to create the extension first)."""
    target = dsn or cfg.shared_dsn
    if not target:
        raise SharedError("no shared server configured: set [shared] dsn in the config file or LOOMD_SHARED_DSN")
    try:
        conn = await asyncpg.connect(
            target, password=read_password(cfg), timeout=CONNECT_TIMEOUT_S, command_timeout=STATEMENT_TIMEOUT_S,
            server_settings={"application_name": "loomd"})
    except CONNECTION_ERRORS as exc:
        raise SharedError(f"cannot connect to the shared server {redact_text(target)}: {describe(exc)}") from None
    except ValueError as exc:  # a malformed DSN
        raise SharedError(f"the shared DSN cannot be read: {describe(exc)}") from None
    if not vector:
        return conn
    try:
        await register_vector(conn)
    except NO_VECTOR as exc:
        await conn.close()
        raise SharedError(f"the shared server has no pgvector (`loom shared init` creates it): {describe(exc)}"
                          ) from None
    return conn


async def check_schema(conn: asyncpg.Connection) -> int:
    """The server's vector dimension, once its schema is the one this loomd speaks."""
    have, dim = await schema.server_version(conn)
    if have < schema.version():
        raise SharedError(f"the shared server's schema is at version {have}, this loomd needs {schema.version()}: "
                          "run `loom shared init` with the admin DSN")
    if have > schema.version():
        raise SharedError(f"the shared server's schema (version {have}) is newer than this loomd knows "
                          f"({schema.version()}): upgrade loomd")
    return dim


def _row(record: asyncpg.Record) -> Shared:
    data = dict(record)
    data["gid"] = str(data["gid"])
    data["superseded_by"] = str(data["superseded_by"]) if data["superseded_by"] else None
    provenance = data["provenance"]
    data["provenance"] = json.loads(provenance) if isinstance(provenance, str) else dict(provenance or {})
    return Shared(**data)


def _args(row: Shared) -> tuple[Any, ...]:
    return (row.gid, row.team, row.project, row.kind, row.scope, row.text, row.tags, row.importance, row.created_at,
            row.changed_at, row.changed_by, row.archived_at, row.superseded_by, row.device, row.person,
            json.dumps(row.provenance), row.embed_model, row.embedding)


async def push(conn: asyncpg.Connection, rows: Sequence[Shared]) -> list[Verdict]:
    """Upsert versions in one transaction, conflict by conflict: a newer version replaces the row (the old one goes
    to history), an older one goes to history as the loser, the same one again changes nothing (replays are free).
    Origin fields (`device`, `person`, `created_at`) stay those of the first push."""
    verdicts: list[Verdict] = []
    async with conn.transaction():
        current = {str(r["gid"]): _row(r) for r in await conn.fetch(
            f"SELECT {_COLUMNS} FROM loomd.memories WHERE gid = ANY($1::uuid[]) FOR UPDATE",
            [r.gid for r in rows])}
        inserts, updates, history = [], [], []
        for row in rows:
            old = current.get(row.gid)
            if old is None:
                inserts.append(_args(row))
                current[row.gid] = row
                verdicts.append(Verdict(row.gid, "inserted"))
            elif row.version == old.version:
                verdicts.append(Verdict(row.gid, "same"))
            elif wins(row.version, old.version):
                history.append((old, "replaced"))
                row.device, row.person, row.created_at = old.device, old.person, old.created_at
                updates.append((row.gid, row.project, row.kind, row.scope, row.text, row.tags, row.importance,
                                row.changed_at, row.changed_by, row.archived_at, row.superseded_by,
                                json.dumps(row.provenance), row.embed_model, row.embedding))
                current[row.gid] = row
                verdicts.append(Verdict(row.gid, "updated"))
            else:
                history.append((row, "lost"))
                verdicts.append(Verdict(row.gid, "lost", old))
        if inserts:
            await conn.executemany(
                f"INSERT INTO loomd.memories ({_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,"
                "$15,$16::jsonb,$17,$18)", inserts)
        if updates:
            await conn.executemany(
                "UPDATE loomd.memories SET project=$2, kind=$3, scope=$4, text=$5, tags=$6, importance=$7,"
                " changed_at=$8, changed_by=$9, archived_at=$10, superseded_by=$11, provenance=$12::jsonb,"
                " embed_model=coalesce($13, embed_model), embedding=coalesce($14, embedding) WHERE gid=$1", updates)
        if history:
            await conn.executemany(
                "INSERT INTO loomd.memory_history (gid, team, changed_at, changed_by, why, version)"
                " VALUES ($1, $2, $3, $4, $5, $6::jsonb) ON CONFLICT (gid, changed_at, changed_by) DO NOTHING",
                [(h.gid, h.team, h.changed_at, h.changed_by, why, json.dumps(_history(h))) for h, why in history])
    return verdicts


def _history(row: Shared) -> dict[str, Any]:
    return {"text": row.text, "kind": row.kind, "scope": row.scope, "tags": row.tags, "importance": row.importance,
            "archived_at": row.archived_at, "superseded_by": row.superseded_by, "project": row.project}


Watermark = tuple[int, str]  # (txid, gid) of the last row pulled


async def pull(conn: asyncpg.Connection, team: str, device: str, after: Watermark, limit: int
               ) -> list[tuple[Shared, Watermark]]:
    """The team's row versions written after the watermark by other devices, oldest transaction first. Only
    transactions below the snapshot's xmin: every one of those has committed or aborted, so none can later appear
    under the watermark."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        records = await conn.fetch(
            f"SELECT {_COLUMNS}, txid::text::bigint AS xid FROM loomd.memories WHERE team = $1"
            " AND (txid, gid) > ($2::text::xid8, $3::uuid)"
            " AND txid < pg_snapshot_xmin(pg_current_snapshot()) AND changed_by <> $5 ORDER BY txid, gid LIMIT $4",
            team, str(after[0]), after[1], limit, device)
    out = []
    for record in records:
        data = dict(record)
        xid = int(data.pop("xid"))
        row = _row(data)  # type: ignore[arg-type]
        out.append((row, (xid, row.gid)))
    return out


async def pending(conn: asyncpg.Connection, team: str, device: str, after: Watermark) -> int:
    """How many of the team's row versions by other devices are past the watermark (the pull's backlog)."""
    return int(await conn.fetchval(
        "SELECT count(*) FROM loomd.memories WHERE team = $1 AND (txid, gid) > ($2::text::xid8, $3::uuid)"
        " AND changed_by <> $4", team, str(after[0]), after[1], device))
