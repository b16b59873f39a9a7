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
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

from loomd.store.derived import write_derived
from loomd.store.memories import content_hash, insert_memory
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


class Reflector:
    name = "reflector"

    async def due_projects(self, ctx: WorkerContext, woken: frozenset[str]) -> list[str]:
        cfg = ctx.config()
        quiet_before = time.time() - cfg.observe_idle_s
        rows = await ctx.store.fetchall(
            "SELECT m.project, sum(m.tokens), max(m.created), max(m.updated),"
            " sum(json_extract(m.meta, '$.type') IN ('constraint', 'preference', 'pitfall', 'decision', 'todo'))"
            " FROM memories m LEFT JOIN checkpoints c ON c.name = 'reflector:' || m.project"
            " WHERE m.kind = 'observation' AND m.id > coalesce(CAST(c.value AS INTEGER), 0) GROUP BY m.project")
        return [r[0] for r in rows
                if r[0] in woken or r[1] >= cfg.reflect_after_tokens or r[4] or r[3] < quiet_before]

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        projects = await requested_projects(ctx, req)
        if projects is None:
            projects = await self.due_projects(ctx, req.keys)
        for project in projects:
            wrote = 0
            while True:
                # The chunk, its reads and its matching, in one trip to the writer's thread: the writer is held
                # for that work alone, not for a hundred trips each waiting for the event loop's turn too.
                changed, seen, new_ids = await ctx.commit(req.dry_run, functools.partial(
                    self.reflect, ctx, project=project, report=report, dry_run=req.dry_run))
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

    async def _vectors(self, db: aiosqlite.Connection, ids: Sequence[int]) -> dict[int, list[float]]:
        """Embeddings where the retrieval side has computed them (one model only); empty when none exist."""
        if not ids:
            return {}
        out: dict[int, list[float]] = {}
        for i in range(0, len(ids), 500):
            part = list(ids[i:i + 500])
            marks = ",".join("?" * len(part))
            async with db.execute(f"SELECT memory_id, model, vec FROM memory_vectors WHERE memory_id IN ({marks})",
                                  part) as cur:
                rows = await cur.fetchall()
            models = {r[1] for r in rows}
            for row in rows:
                if len(models) == 1 and row[2]:
                    out[int(row[0])] = from_blob(row[2])
        return out

    async def _load(self, db: aiosqlite.Connection, sql: str, params: Iterable[Any]) -> list[Any]:
        async with db.execute(sql, tuple(params)) as cur:
            return list(await cur.fetchall())

    async def reflect(self, ctx: WorkerContext, db: aiosqlite.Connection, *, project: str, report: RunReport,
                      dry_run: bool) -> tuple[int, int, list[int]]:
        """Reflect one chunk of a project's new observations: (memories written or merged into, observations read,
        the new memories' ids). It awaits only `db` (`store.trip.in_one_trip` runs it on the writer's thread); the
        caller marks the new memories' vectors stale."""
        watermark = await get_int_checkpoint(db, f"reflector:{project}")
        fresh = await self._load(db, "SELECT * FROM memories WHERE project = ? AND kind = 'observation' AND id > ?"
                                     " ORDER BY id LIMIT ?", (project, watermark, MAX_OBSERVATIONS))
        if not fresh:
            return 0, 0, []
        off = ctx.config().for_project(project).kinds_off()  # kinds the user does not want distilled
        marks = ",".join("?" * len(REFLECTION_KINDS))
        durable = await self._load(db, f"SELECT * FROM memories WHERE project = ? AND kind IN ({marks}) AND"
                                       " archived_at IS NULL AND superseded_by IS NULL", (project, *REFLECTION_KINDS))
        company = await self._load(
            db, "SELECT * FROM memories WHERE project = ? AND kind = 'observation' AND archived_at IS NULL"
                " AND json_extract(meta, '$.type') IN ('procedure', 'error') ORDER BY id DESC LIMIT 2000", (project,))
        vectors = await self._vectors(db, [r["id"] for r in (*fresh, *durable)])
        pool = Pool()
        for row in durable:
            pool.add(Mem.from_row(row, vectors.get(row["id"])))
        peers = [Mem.from_row(r) for r in company]
        # Keys computed once per chunk, not once per observation: this runs while ingest waits for the lock.
        by_command: dict[str, list[Mem]] = {}
        by_error: dict[str, list[Mem]] = {}
        for p in peers:
            if p.type == "procedure":
                by_command.setdefault(command_key(p), []).append(p)
            elif p.type == "error":
                by_error.setdefault(_error_key(p.text), []).append(p)
        new_ids: list[int] = []
        changed = 0
        for row in fresh:
            obs = Mem.from_row(row, vectors.get(row["id"]))
            if row["archived_at"] is not None:
                continue
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
            created, touched = await self.promote(db, project, kind, obs, members, pool, report)
            changed += touched
            if created is not None:
                new_ids.append(created)
        if new_ids and not dry_run:
            await write_derived(db, new_ids)
        await set_checkpoint(db, f"reflector:{project}", str(fresh[-1]["id"]))
        await progress(db, report, len(fresh), len(new_ids))
        report.items_in += len(fresh)
        return changed, len(fresh), new_ids

    async def promote(self, db: aiosqlite.Connection, project: str, kind: str, obs: Mem, members: list[Mem],
                      pool: Pool, report: RunReport) -> tuple[int | None, bool]:
        """Merge `members` into a memory that says the same, or write a new one: (new id or None, changed)."""
        now = time.time()
        target = pool.find_same(kind, obs)
        events = await sources_of(db, [m.id for m in members])
        if target is not None:
            added = [m.id for m in members if await add_edge(db, m.id, target.id, "supports")]
            if added:
                await db.execute(
                    "UPDATE memories SET hits = hits + ?, updated = ?, importance = max(importance, ?),"
                    " meta = json_set(meta, '$.last_seen', ?) WHERE id = ?",
                    (len(added), now, obs.importance, max(m.created for m in members), target.id))
                await add_sources(db, target.id, events)
            links = await self.link(db, target, pool, now)
            if added or any(links.values()):
                report.wrote("merge", id=target.id, kind=target.kind, text=target.text, supports=added,
                             **{k: v for k, v in links.items() if v})
            return None, bool(added)
        text = obs.text
        if kind == "insight" and obs.type == "error":
            text = f"Recurring error: {obs.text}"
        meta = {"type": obs.type, "key": text_key(text), "supports": len(members)}
        if "command" in obs.meta and kind == "procedure":
            meta["command"] = obs.meta["command"]
        expires = max(now, obs.created) + HANDOFF_TTL_S if kind == "handoff" else None
        created = max(m.created for m in members)
        memory_id, is_new = await insert_memory(
            db, kind=kind, text=text, project=project, scope="project", agent=obs.agent,
            importance=max(m.importance for m in members), tags=[obs.type], created=created, expires=expires,
            origin="reflector", meta=meta, sources=events)
        for member in members:
            await add_edge(db, member.id, memory_id, "supports")
        fresh = Mem(memory_id, kind, text, created, None, obs.agent, obs.importance, 0, meta, words_of(text),
                    obs.entities, obs.vec, content_hash(text))
        links = await self.link(db, fresh, pool, now)
        pool.add(fresh)
        report.wrote("reflection" if is_new else "merge", id=memory_id, kind=kind, text=text,
                     supports=[m.id for m in members], **{k: v for k, v in links.items() if v})
        return (memory_id if is_new else None), True

    async def link(self, db: aiosqlite.Connection, mem: Mem, pool: Pool, now: float) -> dict[str, list[int]]:
        """`supersedes` older decisions `mem` replaces; `contradicts` rules it says the opposite of."""
        links: dict[str, list[int]] = {"supersedes": [], "contradicts": []}
        family = ("constraint", "preference") if mem.kind in ("constraint", "preference") else (mem.kind,)
        for old in [m for k in family for m in pool.of(k) if m.id != mem.id]:
            if mem.kind == "decision" and supersedes(mem, old):
                if await add_edge(db, mem.id, old.id, "supersedes"):
                    links["supersedes"].append(old.id)
                await db.execute("UPDATE memories SET superseded_by = ?, updated = ? WHERE id = ?"
                                 " AND superseded_by IS NULL", (mem.id, now, old.id))
                pool.by_kind[old.kind].remove(old)
            elif mem.kind in ("constraint", "preference", "decision") and contradicts(mem, old):
                if await add_edge(db, mem.id, old.id, "contradicts"):
                    links["contradicts"].append(old.id)
        return links
