"""The reflector: observations -> durable memories, merged with what the project already holds.

What is promoted (rules, deterministic):
- every user constraint and preference, at once (kinds `constraint` / `preference`);
- decisions that carry a reason, a user's choice, or a commit (kind `decision`);
- pitfalls — a failure and what fixed it — and findings (kind `insight`);
- procedures seen working more than once, counting every session (kind `procedure`);
- errors that recur across sessions (kind `insight`), and work left unfinished at a session's end (`handoff`).

Each promotion first looks for a memory that says the same thing (same kind, same polarity; embedding cosine when
both have vectors, else content-word overlap plus shared entities). If one exists the observation becomes one more
`supports` edge on it (hits + 1, updated); if not, a new memory is written with the observation as its first
support. A newer decision that replaces an older one `supersedes` it (edge + `superseded_by`; the old one stays);
a rule or preference that says the opposite of an existing one is linked by `contradicts`, never overwritten.
The watermark `reflector:<project>` (the last observation id reflected) moves in the same transaction.

How it holds the writer: a chunk is read in one snapshot on a connection of the reflector's own and planned (every
match above) in the offload process; only the plan's writes run in the write transaction, after a check that what it
was decided from is still so (the watermark, the memories it relies on, no new durable memory in the project). A
chunk that changed meanwhile is planned again. Reads and matching inside the transaction held the writer up to
736 ms after an import, and every hook's commit waited behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

from loomd.offload import Offload
from loomd.store.db import on_thread, open_reader
from loomd.store.derived import write_derived
from loomd.store.memories import content_hash, insert_memory
from loomd.store.trip import run_through
from loomd.vectors.embed import from_blob
from loomd.workers.base import (
    REFLECTION_KINDS,
    RunReport,
    RunRequest,
    WorkerContext,
    add_edge,
    add_sources,
    entity_names,
    get_int_checkpoint,
    meta_of,
    progress,
    requested_projects,
    set_checkpoint,
    sources_of,
)
from loomd.workers.text import RATIONALE, content_words, cosine, jaccard, polarity, text_key

AT_ONCE = frozenset({"constraint", "preference", "pitfall", "decision", "todo"})
SAME_JACCARD = 0.7
# Short items of a list ("Unfinished: test the recorder" / "Unfinished: test the synth") differ by one word.
SAME_JACCARD_BY_KIND = {"handoff": 0.85, "procedure": 0.85, "decision": 0.75}
# Calibrated on the local MiniLM: paraphrases of one rule score ~0.7, while "always X" / "never X" score 0.96 —
# so a vector match also needs the same polarity and some shared words.
SAME_COSINE = 0.88
_LABEL = re.compile(r"^(?:[A-Z][\w ()]{0,30}|Committed [0-9a-f]{7}):\s+")
CONTRADICT_JACCARD = 0.5
HANDOFF_TTL_S = 30 * 86400
# Observations per transaction: the write lock is shared with ingest, so each hold must stay short.
MAX_OBSERVATIONS = 100
REPLACES = re.compile(
    r"\b(instead of|rather than|switch(?:ed|ing)? (?:from|to|back)|replac(?:e|ed|es|ing)|no longer|"
    r"migrat(?:e|ed|ing) (?:to|from|off)|now use|moved? (?:to|from|off)|drop(?:ped|ping)?|in favou?r of|"
    r"not .{1,30} anymore|supersed\w+)\b", re.IGNORECASE)
_CHOICE = re.compile(r'^User chose "(.+)" for: (.+)$')


@dataclass
class Mem:
    """A memory as the reflector compares it."""

    id: int
    kind: str
    text: str
    created: float
    session_id: str | None
    agent: str | None
    importance: float
    hits: int
    meta: dict[str, Any]
    words: frozenset[str] = frozenset()
    entities: frozenset[str] = frozenset()
    vec: list[float] | None = None
    hash: str = ""

    @classmethod
    def from_row(cls, row: Any, vec: list[float] | None = None) -> Mem:
        meta = meta_of(row)
        names: list[Any] = meta["entities"] if isinstance(meta.get("entities"), list) else entity_names(row["text"])
        return cls(int(row["id"]), row["kind"], row["text"], float(row["created"]), row["session_id"],
                   row["agent"], float(row["importance"]), int(row["hits"]), meta, words_of(row["text"]),
                   frozenset(map(str, names)), vec, content_hash(row["text"]))

    @property
    def type(self) -> str:
        return str(self.meta.get("type") or self.kind)


def words_of(text: str) -> frozenset[str]:
    """Content words without a leading label ("Works:", "Unfinished (pending):"): labels are not meaning."""
    return content_words(_LABEL.sub("", text, count=1))


def command_key(mem: Mem) -> str:
    """Procedures are the same when their commands are (flags aside), whatever the description says."""
    return text_key(str(mem.meta.get("command") or _LABEL.sub("", mem.text, count=1)))


def same_meaning(a: Mem, b: Mem) -> bool:
    """Do two memories say the same thing (so one should support the other)?"""
    if a.hash == b.hash:
        return True
    if "command" in a.meta and "command" in b.meta:
        return command_key(a) == command_key(b)
    if polarity(a.text) != polarity(b.text):
        return False
    choice_a, choice_b = _CHOICE.match(a.text), _CHOICE.match(b.text)
    if choice_a and choice_b and choice_a.group(1).lower() != choice_b.group(1).lower():
        return False  # one question, two different answers: a change of mind, not a repeat
    overlap = jaccard(a.words, b.words)
    if a.vec is not None and b.vec is not None and cosine(a.vec, b.vec) >= SAME_COSINE and overlap >= 0.3:
        return True
    threshold = SAME_JACCARD_BY_KIND.get(a.kind if a.kind != "observation" else b.kind, SAME_JACCARD)
    return overlap + 0.05 * min(2, len(a.entities & b.entities)) >= threshold


def contradicts(new: Mem, old: Mem) -> bool:
    """The same subject with the opposite polarity: "always use tabs" against "never use tabs"."""
    if polarity(new.text) == polarity(old.text):
        return False
    overlap = jaccard(new.words, old.words)
    if new.vec is not None and old.vec is not None and cosine(new.vec, old.vec) >= 0.85 and overlap >= 0.4:
        return True
    return overlap >= CONTRADICT_JACCARD


def supersedes(new: Mem, old: Mem) -> bool:
    """Does decision `new` replace decision `old` (same subject, a newer choice)?"""
    if (new.created, new.id) <= (old.created, old.id) or same_meaning(new, old):
        return False
    if new.text.startswith("Committed") or old.text.startswith("Committed"):
        return False  # a commit records what happened; it does not revoke an earlier one
    a, b = _CHOICE.match(new.text), _CHOICE.match(old.text)
    if a and b:
        return jaccard(content_words(a.group(2)), content_words(b.group(2))) >= 0.8 and a.group(1) != b.group(1)
    shared = new.words & old.words
    related = len(shared) >= 2 and (jaccard(new.words, old.words) >= 0.2 or bool(new.entities & old.entities))
    return related and bool(REPLACES.search(new.text))


@dataclass
class Pool:
    """The project's durable memories (and the ones this run creates), by kind."""

    by_kind: dict[str, list[Mem]] = field(default_factory=dict)

    def add(self, mem: Mem) -> None:
        self.by_kind.setdefault(mem.kind, []).append(mem)

    def find_same(self, kind: str, mem: Mem) -> Mem | None:
        # A rule and a preference are one family: capture may have filed the same sentence under the other.
        kinds = ("constraint", "preference") if kind in ("constraint", "preference") else (kind,)
        return next((m for k in kinds for m in self.by_kind.get(k, []) if same_meaning(mem, m)), None)

    def of(self, kind: str) -> list[Mem]:
        return self.by_kind.get(kind, [])


def target_kind(obs: Mem) -> str | None:
    """The kind an observation is promoted to at once, or None (procedures and errors need company first)."""
    kind = obs.type
    if kind in ("constraint", "preference"):
        return kind
    if kind == "decision":
        reasoned = obs.meta.get("by") == "user" or "commit" in obs.meta or obs.text.startswith("Committed")
        return "decision" if reasoned or RATIONALE.search(obs.text) else None
    if kind in ("pitfall", "finding"):
        return "insight"
    if kind == "todo":
        return "handoff"
    return None


def _error_key(text: str) -> str:
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"(/[\w.\-]+)+|\b0x[0-9a-f]+\b|\b\d+\b", " ", text.lower())
    return text_key(text)


# Placeholder ids of the memories a plan creates: above every real id and in the order the plan creates them, as the
# ids the inserts return will be (a newer decision is compared by (created, id)); the write maps them to those ids.
NEW_ID = 1 << 60
COLUMNS = "id, kind, text, created, session_id, agent, importance, hits, meta, archived_at"
# A chunk whose memories changed between its read and its write is read and planned again this often; then it is
# read, planned and written in one transaction, as a last resort (the writer held for the lot).
REPLANS = 2


@dataclass
class Chunk:
    """What one chunk of a project's new observations is reflected from, read in one snapshot (plain values: it is
    planned in the offload process)."""

    project: str
    watermark: int
    top: int  # the largest memory id at the read: a durable memory above it was written since
    fresh: list[dict[str, Any]]
    durable: list[dict[str, Any]]
    company: list[dict[str, Any]]
    vectors: dict[int, bytes]


@dataclass
class Step:
    """One promotion: `members` support `target` (an existing memory, one made earlier in the plan, or `new`, made
    now under the placeholder id `target`), which is then linked to the memories it supersedes or contradicts."""

    target: int
    kind: str  # the target's kind and text, for the report
    text: str
    members: list[int]
    importance: float
    last_seen: float
    links: list[tuple[str, int]]
    new: dict[str, Any] | None = None  # `insert_memory`'s arguments when the target is made by this step


@dataclass
class Plan:
    """A chunk's promotions, decided from its snapshot; written later in one short transaction if the memories it
    relies on are still as they were read (`unchanged`)."""

    project: str
    watermark: int
    top: int
    last: int  # the last observation read: the watermark once written
    read: int
    steps: list[Step]
    relies_on: list[int]  # existing memories the steps merge into, link to or count as support


def _rows(rows: Iterable[Any]) -> list[dict[str, Any]]:
    return [dict(zip(row.keys(), row, strict=True)) for row in rows]


async def _load(db: aiosqlite.Connection, sql: str, params: Iterable[Any]) -> list[dict[str, Any]]:
    async with db.execute(sql, tuple(params)) as cur:
        return _rows(await cur.fetchall())


async def _vectors(db: aiosqlite.Connection, ids: Sequence[int]) -> dict[int, bytes]:
    """Embeddings where the retrieval side has computed them (one model only); empty when none exist."""
    out: dict[int, bytes] = {}
    for i in range(0, len(ids), 500):
        part = list(ids[i:i + 500])
        marks = ",".join("?" * len(part))
        async with db.execute(f"SELECT memory_id, model, vec FROM memory_vectors WHERE memory_id IN ({marks})",
                              part) as cur:
            rows = await cur.fetchall()
        models = {r[1] for r in rows}
        for row in rows:
            if len(models) == 1 and row[2]:
                out[int(row[0])] = bytes(row[2])
    return out


async def read_chunk(db: aiosqlite.Connection, *, project: str) -> Chunk | None:
    """The next chunk of `project`'s new observations and what they are matched against; None when none is new. It
    awaits only `db` (run over a plain connection by `store.trip.run_through`)."""
    watermark = await get_int_checkpoint(db, f"reflector:{project}")
    fresh = await _load(db, f"SELECT {COLUMNS} FROM memories WHERE project = ? AND kind = 'observation' AND id > ?"
                            " ORDER BY id LIMIT ?", (project, watermark, MAX_OBSERVATIONS))
    if not fresh:
        return None
    async with db.execute("SELECT max(id) FROM memories") as cur:
        row = await cur.fetchone()
    top = int(row[0] or 0) if row is not None else 0
    marks = ",".join("?" * len(REFLECTION_KINDS))
    durable = await _load(db, f"SELECT {COLUMNS} FROM memories WHERE project = ? AND kind IN ({marks}) AND"
                              " archived_at IS NULL AND superseded_by IS NULL", (project, *REFLECTION_KINDS))
    company = await _load(
        db, f"SELECT {COLUMNS} FROM memories WHERE project = ? AND kind = 'observation' AND archived_at IS NULL"
            " AND json_extract(meta, '$.type') IN ('procedure', 'error') ORDER BY id DESC LIMIT 2000", (project,))
    vectors = await _vectors(db, [r["id"] for r in (*fresh, *durable)])
    return Chunk(project, watermark, top, fresh, durable, company, vectors)


def read_snapshot(conn: sqlite3.Connection, project: str) -> Chunk | None:
    """`read_chunk` over a read connection of the reflector's own, in one read transaction (one snapshot)."""
    conn.execute("BEGIN")
    try:
        return run_through(functools.partial(read_chunk, project=project), conn)
    finally:
        conn.execute("ROLLBACK")


def _read_and_submit(conn: sqlite3.Connection, project: str, off: frozenset[str],
                     offload: Offload | None) -> tuple[Chunk | None, concurrent.futures.Future[Plan] | None]:
    """The next chunk, and its planning sent to the offload process (None without one: planned by the caller)."""
    chunk = read_snapshot(conn, project)
    if chunk is None or offload is None:
        return chunk, None
    return chunk, offload.submit("work", plan_chunk, chunk, off)


def _links(mem: Mem, pool: Pool) -> list[tuple[str, int]]:
    """`supersedes` older decisions `mem` replaces (they leave the pool); `contradicts` rules it says the opposite
    of."""
    links: list[tuple[str, int]] = []
    family = ("constraint", "preference") if mem.kind in ("constraint", "preference") else (mem.kind,)
    for old in [m for k in family for m in pool.of(k) if m.id != mem.id]:
        if mem.kind == "decision" and supersedes(mem, old):
            links.append(("supersedes", old.id))
            pool.by_kind[old.kind].remove(old)
        elif mem.kind in ("constraint", "preference", "decision") and contradicts(mem, old):
            links.append(("contradicts", old.id))
    return links


def _promote(kind: str, obs: Mem, members: list[Mem], pool: Pool, new_id: int) -> Step:
    """Merge `members` into a memory that says the same, or make a new one under `new_id`."""
    supports = [m.id for m in members]
    target = pool.find_same(kind, obs)
    if target is not None:
        return Step(target.id, target.kind, target.text, supports, obs.importance,
                    max(m.created for m in members), _links(target, pool))
    text = obs.text
    if kind == "insight" and obs.type == "error":
        text = f"Recurring error: {obs.text}"
    meta = {"type": obs.type, "key": text_key(text), "supports": len(members)}
    if "command" in obs.meta and kind == "procedure":
        meta["command"] = obs.meta["command"]
    expires = max(time.time(), obs.created) + HANDOFF_TTL_S if kind == "handoff" else None
    created = max(m.created for m in members)
    importance = max(m.importance for m in members)
    made = Mem(new_id, kind, text, created, None, obs.agent, obs.importance, 0, meta, words_of(text), obs.entities,
               obs.vec, content_hash(text))
    links = _links(made, pool)
    pool.add(made)
    return Step(new_id, kind, text, supports, importance, created, links,
                new={"kind": kind, "text": text, "agent": obs.agent, "importance": importance, "tags": [obs.type],
                     "created": created, "expires": expires, "meta": meta})


def plan_chunk(chunk: Chunk, off: frozenset[str]) -> Plan:
    """Every promotion of a chunk, decided from its snapshot alone (pure: run in the offload process, off the event
    loop's interpreter lock and outside any write transaction). `off`: kinds the user does not want distilled."""
    vectors = {i: from_blob(blob) for i, blob in chunk.vectors.items()}
    pool = Pool()
    for row in chunk.durable:
        pool.add(Mem.from_row(row, vectors.get(row["id"])))
    # Keys computed once per chunk, not once per observation.
    by_command: dict[str, list[Mem]] = {}
    by_error: dict[str, list[Mem]] = {}
    for p in (Mem.from_row(r) for r in chunk.company):
        if p.type == "procedure":
            by_command.setdefault(command_key(p), []).append(p)
        elif p.type == "error":
            by_error.setdefault(_error_key(p.text), []).append(p)
    steps: list[Step] = []
    for row in chunk.fresh:
        if row["archived_at"] is not None:
            continue
        obs = Mem.from_row(row, vectors.get(row["id"]))
        kind, members = target_kind(obs), [obs]
        if kind is None and obs.type == "procedure":
            members = by_command.get(command_key(obs)) or [obs]
            runs = sum(int(m.meta.get("runs", 1)) + m.hits for m in members)
            kind = "procedure" if runs >= 2 else None
        elif kind is None and obs.type == "error":
            members = by_error.get(_error_key(obs.text)) or [obs]
            kind = "insight" if len({m.session_id for m in members}) >= 2 else None
        if kind is None or kind in off:
            continue
        steps.append(_promote(kind, obs, members, pool, NEW_ID + len(steps)))
    relies_on = {i for step in steps for i in (*step.members, step.target, *(other for _, other in step.links))}
    return Plan(chunk.project, chunk.watermark, chunk.top, int(chunk.fresh[-1]["id"]), len(chunk.fresh), steps,
                sorted(i for i in relies_on if i < NEW_ID))


async def unchanged(db: aiosqlite.Connection, plan: Plan) -> bool:
    """Is what `plan` was decided from still so, inside the write transaction: the same watermark, every memory it
    relies on still live, no durable memory of the project written since its read?"""
    if await get_int_checkpoint(db, f"reflector:{plan.project}") != plan.watermark:
        return False  # another run reflected this chunk meanwhile
    marks = ",".join("?" * len(REFLECTION_KINDS))
    async with db.execute(f"SELECT 1 FROM memories WHERE project = ? AND kind IN ({marks}) AND id > ?"
                          " AND archived_at IS NULL LIMIT 1", (plan.project, *REFLECTION_KINDS, plan.top)) as cur:
        if await cur.fetchone() is not None:
            return False  # it might say the same as a promotion: the plan would double it
    for i in range(0, len(plan.relies_on), 500):
        part = plan.relies_on[i:i + 500]
        async with db.execute(
                f"SELECT count(*) FROM memories WHERE id IN ({','.join('?' * len(part))}) AND archived_at IS NULL"
                " AND (kind = 'observation' OR superseded_by IS NULL)", part) as cur:
            row = await cur.fetchone()
        if row is None or row[0] != len(part):
            return False  # archived, forgotten or superseded since the read
    return True


class Reflector:
    name = "reflector"

    async def due_projects(self, ctx: WorkerContext, woken: frozenset[str]) -> list[str]:
        cfg = ctx.config()
        quiet_before = time.time() - cfg.observe_idle_s
        rows = await ctx.store.fetchall(
            "SELECT m.project, sum(m.tokens), max(m.created), max(m.updated),"
            " sum(json_extract(m.meta, '$.type') IN ('constraint', 'preference', 'pitfall', 'decision', 'todo'))"
            " FROM memories m LEFT JOIN checkpoints c ON c.name = 'reflector:' || m.project"
            " WHERE m.kind = 'observation' AND m.id > coalesce(CAST(c.value AS INTEGER), 0) GROUP BY m.project",
            background=True)
        return [r[0] for r in rows
                if r[0] in woken or r[1] >= cfg.reflect_after_tokens or r[4] or r[3] < quiet_before]

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        projects = await requested_projects(ctx, req)
        if projects is None:
            projects = await self.due_projects(ctx, req.keys)
        if not projects:
            return
        # The chunks are read on a connection of the reflector's own, outside any write transaction, and planned in
        # the offload process; the writer is held only for the writes (`apply`). The shared reader is left to the
        # hooks' recalls. The connection lives on a thread of its own, which also closes it: a run cancelled while a
        # read is on that thread (the daemon stopping) queues the close behind the read. Closed from another thread,
        # it freed its statements under the read: SQLite's general protection fault took a test process down in CI.
        conn = await open_reader(ctx.store.path, busy_timeout_ms=ctx.config().busy_timeout_ms,
                                 name="loomd-reflector-reader")
        try:
            for project in projects:
                wrote = 0
                while True:
                    changed, seen, new_ids = await self.reflect_next(ctx, conn, project, report, req.dry_run)
                    if new_ids and not req.dry_run:
                        ctx.memories.mark_stale(new_ids)  # for the back-fill
                    wrote += changed
                    if req.dry_run or seen < MAX_OBSERVATIONS:
                        break
                    await asyncio.sleep(0)  # let queued ingest commits through between chunks
                report.note("projects", project)
                if wrote and not req.dry_run:
                    ctx.wake("digest", project)
                    ctx.wake("dropper", project)
        finally:
            await conn.close()

    async def reflect_next(self, ctx: WorkerContext, conn: aiosqlite.Connection, project: str, report: RunReport,
                           dry_run: bool) -> tuple[int, int, list[int]]:
        """The next chunk: (memories written or merged into, observations read, the new memories' ids)."""
        off = ctx.config().for_project(project).kinds_off()
        for _ in range(REPLANS):
            # The read and the hand-over to the offload process (pickling the chunk) on a thread, off the loop.
            chunk, planning = await on_thread(conn, functools.partial(_read_and_submit, project=project, off=off,
                                                                      offload=ctx.offload))
            if chunk is None:
                return 0, 0, []
            plan = plan_chunk(chunk, off) if planning is None else await asyncio.wrap_future(planning)
            done = await ctx.commit(dry_run, functools.partial(self.apply, plan, report=report, dry_run=dry_run))
            if done is not None:
                return done
            report.detail["replanned"] = int(report.detail.get("replanned", 0)) + 1
        return await ctx.commit(dry_run, functools.partial(self.reflect, project=project, off=off, report=report,
                                                           dry_run=dry_run))

    async def reflect(self, db: aiosqlite.Connection, *, project: str, off: frozenset[str], report: RunReport,
                      dry_run: bool) -> tuple[int, int, list[int]]:
        """The last resort for a chunk whose memories kept changing under its plans: read, plan and write it in one
        write transaction (one trip to the writer's thread)."""
        chunk = await read_chunk(db, project=project)
        if chunk is None:
            return 0, 0, []
        return await self.write(plan_chunk(chunk, off), db, report=report, dry_run=dry_run)

    async def apply(self, plan: Plan, db: aiosqlite.Connection, *, report: RunReport,
                    dry_run: bool) -> tuple[int, int, list[int]] | None:
        """`plan`'s writes, or None if what it was decided from changed since its read (it is planned again)."""
        if not await unchanged(db, plan):
            return None
        return await self.write(plan, db, report=report, dry_run=dry_run)

    async def write(self, plan: Plan, db: aiosqlite.Connection, *, report: RunReport,
                    dry_run: bool) -> tuple[int, int, list[int]]:
        """Write a plan's promotions, its memories' derived rows and the watermark. It awaits only `db` (one trip to
        the writer's thread); the caller marks the new memories' vectors stale."""
        now = time.time()
        made: dict[int, int] = {}  # placeholder -> the id its insert returned
        new_ids: list[int] = []
        changed = 0
        for step in plan.steps:
            events = await sources_of(db, step.members)
            if step.new is None:
                target = made.get(step.target, step.target)
                added = [m for m in step.members if await add_edge(db, m, target, "supports")]
                if added:
                    await db.execute(
                        "UPDATE memories SET hits = hits + ?, updated = ?, importance = max(importance, ?),"
                        " meta = json_set(meta, '$.last_seen', ?) WHERE id = ?",
                        (len(added), now, step.importance, step.last_seen, target))
                    await add_sources(db, target, events)
                links = await self.link(db, target, step.links, made, now)
                if added or any(links.values()):
                    report.wrote("merge", id=target, kind=step.kind, text=step.text, supports=added,
                                 **{k: v for k, v in links.items() if v})
                changed += bool(added)
                continue
            memory_id, is_new = await insert_memory(db, project=plan.project, scope="project", origin="reflector",
                                                    sources=events, **step.new)
            made[step.target] = memory_id
            for member in step.members:
                await add_edge(db, member, memory_id, "supports")
            links = await self.link(db, memory_id, step.links, made, now)
            report.wrote("reflection" if is_new else "merge", id=memory_id, kind=step.kind, text=step.text,
                         supports=step.members, **{k: v for k, v in links.items() if v})
            changed += 1
            if is_new:
                new_ids.append(memory_id)
        if new_ids and not dry_run:
            await write_derived(db, new_ids)
        await set_checkpoint(db, f"reflector:{plan.project}", str(plan.last))
        await progress(db, report, plan.read, len(new_ids))
        report.items_in += plan.read
        return changed, plan.read, new_ids

    async def link(self, db: aiosqlite.Connection, src: int, links: list[tuple[str, int]], made: dict[int, int],
                   now: float) -> dict[str, list[int]]:
        """The plan's `supersedes` and `contradicts` edges from `src` (a superseded memory gets `superseded_by`)."""
        out: dict[str, list[int]] = {"supersedes": [], "contradicts": []}
        for relation, other in links:
            other = made.get(other, other)
            if other == src:
                continue  # a promotion whose insert found the very memory it was to be linked to
            if await add_edge(db, src, other, relation):
                out[relation].append(other)
            if relation == "supersedes":
                await db.execute("UPDATE memories SET superseded_by = ?, updated = ? WHERE id = ?"
                                 " AND superseded_by IS NULL", (src, now, other))
        return out
