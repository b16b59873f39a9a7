"""The shared server's schema (PostgreSQL >= 15 with pgvector): numbered migrations, teams, row-level security.

Everything lives in the `loomd` schema. `loom shared init` runs as a role that owns the database (it creates the
extension, the tables, the `loomd_member` group and the members); the daemons connect as their person's own role,
a member of `loomd_member`, and only check the version.

Who sees what is PostgreSQL's business, not a WHERE clause in loomd: row-level security on `memories` and
`memory_history` lets a role read and write only the rows of the teams it belongs to (`team_members`, itself
visible to each role for its own rows only). The table owner is exempt (RLS is enabled, not forced): the admin who
ran `init` sees every team, which is also how a test proves the policy hides rows that exist.

Pull order: each row version carries the id of the transaction that wrote it (`txid`, xid8). A reader takes rows
below its snapshot's xmin only, so a transaction that commits late can never slip under a watermark already passed.
"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg

SCHEMA = "loomd"
MEMBER_ROLE = "loomd_member"
# Serialises concurrent `init`s (two admins, or a test suite's workers) on one server.
MIGRATION_LOCK = 0x6C6F6F6D  # "loom"

Migration = Callable[[int], str]
MIGRATIONS: list[Migration] = []
migration = MIGRATIONS.append


@migration
def m001_memories(dim: int) -> str:
    return f"""
    CREATE TABLE loomd.teams (
        name text PRIMARY KEY,
        created_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE loomd.team_members (
        team text NOT NULL REFERENCES loomd.teams(name),
        member name NOT NULL,
        PRIMARY KEY (team, member)
    );
    CREATE INDEX team_members_member ON loomd.team_members(member);
    CREATE TABLE loomd.memories (
        gid uuid PRIMARY KEY,
        team text NOT NULL REFERENCES loomd.teams(name),
        project text NOT NULL,
        kind text NOT NULL,
        scope text NOT NULL,
        text text NOT NULL,
        tags text NOT NULL DEFAULT '',
        importance real NOT NULL DEFAULT 0.5,
        created_at double precision NOT NULL,
        -- the version: when and on which device this state was made; the highest (changed_at, changed_by) wins
        changed_at double precision NOT NULL,
        changed_by text NOT NULL,
        archived_at double precision,
        superseded_by uuid,
        device text NOT NULL,   -- where the memory was first written
        person text NOT NULL,   -- who wrote it (their database role unless they named themselves)
        provenance jsonb NOT NULL DEFAULT '{{}}',
        embed_model text,
        embedding vector({dim}),
        tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', text || ' ' || tags)) STORED,
        txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
        pushed_by name NOT NULL DEFAULT current_user
    );
    CREATE INDEX memories_pull ON loomd.memories(team, txid, gid);
    CREATE INDEX memories_project ON loomd.memories(team, project);
    CREATE INDEX memories_tsv ON loomd.memories USING gin(tsv);
    CREATE INDEX memories_embedding ON loomd.memories USING hnsw (embedding vector_cosine_ops);
    -- Every version that lost a conflict, and every version a newer one replaced: nothing is overwritten unseen.
    CREATE TABLE loomd.memory_history (
        id bigserial PRIMARY KEY,
        gid uuid NOT NULL,
        team text NOT NULL REFERENCES loomd.teams(name),
        changed_at double precision NOT NULL,
        changed_by text NOT NULL,
        why text NOT NULL,      -- 'replaced' (an older version) or 'lost' (a concurrent edit that lost)
        version jsonb NOT NULL,
        recorded_at timestamptz NOT NULL DEFAULT now(),
        recorded_by name NOT NULL DEFAULT current_user,
        UNIQUE (gid, changed_at, changed_by)
    );

    -- Each write stamps its transaction (the pull order) and its role (no one pushes in another's name).
    CREATE FUNCTION loomd.stamp() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        NEW.txid := pg_current_xact_id();
        NEW.pushed_by := current_user;
        RETURN NEW;
    END $$;
    CREATE TRIGGER memories_stamp BEFORE INSERT OR UPDATE ON loomd.memories
        FOR EACH ROW EXECUTE FUNCTION loomd.stamp();

    ALTER TABLE loomd.team_members ENABLE ROW LEVEL SECURITY;
    CREATE POLICY own_rows ON loomd.team_members FOR SELECT USING (member = current_user);
    ALTER TABLE loomd.memories ENABLE ROW LEVEL SECURITY;
    CREATE POLICY team_rows ON loomd.memories
        USING (team IN (SELECT m.team FROM loomd.team_members m WHERE m.member = current_user))
        WITH CHECK (team IN (SELECT m.team FROM loomd.team_members m WHERE m.member = current_user));
    ALTER TABLE loomd.memory_history ENABLE ROW LEVEL SECURITY;
    CREATE POLICY team_rows ON loomd.memory_history
        USING (team IN (SELECT m.team FROM loomd.team_members m WHERE m.member = current_user))
        WITH CHECK (team IN (SELECT m.team FROM loomd.team_members m WHERE m.member = current_user));

    GRANT USAGE ON SCHEMA loomd TO {MEMBER_ROLE};
    GRANT SELECT ON loomd.schema_migrations, loomd.teams, loomd.team_members TO {MEMBER_ROLE};
    GRANT SELECT, INSERT, UPDATE ON loomd.memories TO {MEMBER_ROLE};
    GRANT SELECT, INSERT ON loomd.memory_history TO {MEMBER_ROLE};
    GRANT USAGE ON SEQUENCE loomd.memory_history_id_seq TO {MEMBER_ROLE};
    """



@migration
def m002_full_text_function(dim: int) -> str:
    """Full-text search for members through a function of the owner's. Under row-level security PostgreSQL will not
    use an index for `tsvector @@ tsquery` (the operator is not leakproof), so a member's query read every row. The
    function runs as the owner (the GIN index works) and applies the same team rule itself, keyed on the login
    role; it returns ids and ranks only, and the rows are then read under RLS as usual."""
    return f"""
    CREATE FUNCTION loomd.fts(q tsquery, p_project text, p_kinds text[], p_archived boolean, p_limit int)
    RETURNS TABLE (gid uuid, rank real)
    LANGUAGE plpgsql STABLE SECURITY DEFINER ROWS 100 SET search_path = pg_catalog, loomd AS $fn$
    BEGIN
        -- EXECUTE: planned with this query's terms (a cached generic plan would not know them and scan the table).
        RETURN QUERY EXECUTE $q$
            SELECT m.gid, ts_rank_cd(m.tsv, $1) FROM loomd.memories m
            WHERE m.tsv @@ $1
              AND m.team IN (SELECT t.team FROM loomd.team_members t WHERE t.member = session_user)
              AND ($2::text IS NULL OR m.project = $2 OR m.scope = 'user')
              AND ($3::text[] IS NULL OR m.kind = ANY($3))
              AND ($4 OR m.archived_at IS NULL)
            ORDER BY 2 DESC, 1 LIMIT $5
        $q$ USING q, p_project, p_kinds, p_archived, p_limit;
    END
    $fn$;
    REVOKE ALL ON FUNCTION loomd.fts(tsquery, text, text[], boolean, int) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION loomd.fts(tsquery, text, text[], boolean, int) TO {MEMBER_ROLE};
    """

def version() -> int:
    return len(MIGRATIONS)


async def migrate(conn: asyncpg.Connection, dim: int) -> list[str]:
    """Create the extension, schema and group role if missing, then apply pending migrations, one transaction each
    (under an advisory lock); the names applied."""
    await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    await conn.execute("CREATE SCHEMA IF NOT EXISTS loomd")
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS loomd.schema_migrations (version int PRIMARY KEY, name text NOT NULL,"
        " dim int NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", MEMBER_ROLE):
            await conn.execute(f"CREATE ROLE {MEMBER_ROLE} NOLOGIN")
    for number, step in enumerate(MIGRATIONS, start=1):
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            if await conn.fetchval("SELECT 1 FROM loomd.schema_migrations WHERE version = $1", number):
                continue
            await conn.execute(step(dim))
            await conn.execute("INSERT INTO loomd.schema_migrations (version, name, dim) VALUES ($1, $2, $3)",
                               number, step.__name__, dim)
            applied.append(step.__name__)
    return applied


async def add_members(conn: asyncpg.Connection, team: str, members: list[str]) -> list[str]:
    """Create the team and add each member (a login role, created without a password when missing: the admin
    sets one); the statements that the admin still has to run, if any."""
    todo: list[str] = []
    async with conn.transaction():
        await conn.execute("INSERT INTO loomd.teams (name) VALUES ($1) ON CONFLICT DO NOTHING", team)
        for member in members:
            role = quote_ident(member)
            if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", member):
                await conn.execute(f"CREATE ROLE {role} LOGIN")
                todo.append(f"ALTER ROLE {role} PASSWORD '…';  -- or a certificate / your server's usual login")
            await conn.execute(f"GRANT {MEMBER_ROLE} TO {role}")
            await conn.execute("INSERT INTO loomd.team_members (team, member) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                               team, member)
    return todo


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def server_version(conn: asyncpg.Connection) -> tuple[int, int]:
    """(schema version, vector dimension) the server holds; (0, 0) before `loom shared init`."""
    if not await conn.fetchval("SELECT to_regclass('loomd.schema_migrations') IS NOT NULL"):
        return 0, 0
    row = await conn.fetchrow("SELECT max(version), max(dim) FROM loomd.schema_migrations")
    return (int(row[0] or 0), int(row[1] or 0)) if row is not None else (0, 0)


# What `loom shared init` prints: the rights it needs, and what each member gets.
GRANTS_NEEDED = f"""\
-- `loom shared init` needs, on the target database, a role that may:
--   CREATE EXTENSION vector (a superuser, or the database owner where pgvector is a trusted extension),
--   CREATE SCHEMA / CREATE ROLE (or run it as the database owner with CREATEROLE).
-- Each member connects with their own login role, granted:
GRANT {MEMBER_ROLE} TO <member>;   -- USAGE on schema loomd; SELECT/INSERT/UPDATE on loomd.memories,
                                 -- SELECT/INSERT on loomd.memory_history (never DELETE);
-- and a row in loomd.team_members (team, member): row-level security shows each role its teams' rows only."""
