"""GC: TTL expiry, per-project caps, dangling edges, stale tasks, and the purge of raw events — archive-only.

By default no memory is ever deleted: expired, evicted and stale ones get `archived_at` (and stay fetchable by id);
only a retention the user sets (`archived_ttl_days`) deletes archived ones, that long after they were archived. The
working set is never touched: memories injected into a recently active session, memories hit recently, open
tasks and everything linked to them. Raw events older than `event_ttl_days` are purged only once the observer's
watermark has passed them; an event that a memory cites keeps its row (the provenance link) and loses its payload,
and a memory keeps only its first and latest such links (a rule restated every day is one memory, not a link a day).
The evidence passages made from such events are the events' own text, searchable: under that same retention they go
with them (deleted, outside the working set), so a retention the user sets bounds the evidence tier too. So does the
rest of an idle session's record: the blocks it was shown (`injections`) and its frozen start and compaction blocks
go once the session has been quiet longer than both that retention and the working set; the session's row stays
(its transcript offset, the memories it was shown). The runs' log (`jobs`) keeps `job_history_days`, and always each
worker's latest run and latest error (what `loom workers` shows).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from typing import NamedTuple

import aiosqlite

from loomd.config import Config
from loomd.store.memories import set_archived
from loomd.store.purge import Selection, remove
from loomd.workers.base import RunReport, RunRequest, WorkerContext, progress

OPEN_TASK_STATES = ("draft", "active")
KIND_WEIGHT = {"constraint": 3.0, "preference": 3.0, "task": 2.5, "handoff": 2.5, "decision": 2.0, "procedure": 2.0,
               "insight": 2.0, "digest": 5.0, "fact": 1.5, "reflection": 1.5, "error": 1.0, "observation": 0.5}
PURGE_BATCH = 5000
# Evidence passages deleted a run: `remove` checks every recorded block for each one (the blocks that showed it go),
# so a run that first meets a long backlog (a retention set on an old store) must not hold the writer for seconds.
EVIDENCE_BATCH = 1000
PURGED_PAYLOAD = '{"purged": true}'
# Events (alias e) past the TTL (the cutoff, a parameter) that the observer has passed: what the retention may purge.
PASSED_JOIN = "JOIN checkpoints c ON c.name = 'observer:' || e.session_id"
PASSED = "e.ts < ? AND e.id <= CAST(c.value AS INTEGER)"
# A memory's source link (alias s) that is neither its first nor its latest.
_INSIDE = ("s.event_id > (SELECT min(f.event_id) FROM memory_sources f WHERE f.memory_id = s.memory_id)"
           " AND s.event_id < (SELECT max(f.event_id) FROM memory_sources f WHERE f.memory_id = s.memory_id)")
# An edge whose end is gone.
DANGLING = ("(src_type = 'memory' AND src_id NOT IN (SELECT id FROM memories))"
            " OR (dst_type = 'memory' AND dst_id NOT IN (SELECT id FROM memories))"
            " OR (src_type = 'entity' AND src_id NOT IN (SELECT id FROM entities))"
            " OR (dst_type = 'entity' AND dst_id NOT IN (SELECT id FROM entities))")


async def _ids(db: aiosqlite.Connection, sql: str, params: Iterable[object] = ()) -> set[int]:
    async with db.execute(sql, tuple(params)) as cur:
        return {int(r[0]) for r in await cur.fetchall() if r[0] is not None and str(r[0]).lstrip("-").isdigit()}


async def working_set(db: aiosqlite.Connection, config: Config, now: float | None = None) -> set[int]:
    """Ids that no dropper or GC pass may archive."""
    since = (now or time.time()) - config.working_set_days * 86400
    ids = await _ids(db, "SELECT j.value FROM sessions s, json_each(s.injected) j"
                         " WHERE json_valid(s.injected) AND s.last_seen >= ?", (since,))
    ids |= await _ids(db, "SELECT id FROM memories WHERE last_hit IS NOT NULL AND CAST(last_hit AS REAL) >= ?",
                      (since,))
    open_tasks: set[int] = set()
    async with db.execute("SELECT id, meta FROM memories WHERE kind = 'task' AND archived_at IS NULL") as cur:
        for row in await cur.fetchall():
            try:
                meta = json.loads(row[1] or "{}")
            except ValueError:
                meta = {}
            if not isinstance(meta, dict) or meta.get("state", "draft") in OPEN_TASK_STATES:
                open_tasks.add(int(row[0]))
                evidence = meta.get("evidence") if isinstance(meta, dict) else None
                refs = evidence.get("memory") if isinstance(evidence, dict) else None
                ids |= {r for r in refs or [] if isinstance(r, int)}
    if open_tasks:
        marks = ",".join("?" * len(open_tasks))
        ids |= await _ids(db, f"SELECT src_id FROM edges WHERE src_type = 'memory' AND dst_type = 'memory'"
                              f" AND dst_id IN ({marks})", sorted(open_tasks))
        ids |= await _ids(db, f"SELECT dst_id FROM edges WHERE src_type = 'memory' AND dst_type = 'memory'"
                              f" AND src_id IN ({marks})", sorted(open_tasks))
    return ids | open_tasks


def value(kind: str, importance: float, hits: int, last_active: float, now: float, half_life_days: float) -> float:
    """What a memory is worth keeping: kind, importance, use, and recency (halving every `half_life_days`)."""
    age_days = max(0.0, now - last_active) / 86400
    return KIND_WEIGHT.get(kind, 1.0) * importance * (1 + math.log1p(hits)) * 0.5 ** (age_days / half_life_days)


async def archive(db: aiosqlite.Connection, ids: list[int], reason: str, report: RunReport) -> None:
    if ids:
        await set_archived(db, ids, True, reason)
        for memory_id in ids:
            report.wrote("archive", id=memory_id, reason=reason)


class Scope(NamedTuple):
    """Which projects a run may touch: a SQL condition on `project` and its one parameter (a JSON list)."""

    where: str
    param: str
    label: str


def _scope(cfg: Config, *, manual: bool) -> Scope | None:
    """The projects GC may touch: all but those whose own `gc` is off, or — `gc` off globally — only those whose
    own `gc` is on; asked for by hand (`loom workers run gc`), all. None: nothing to do."""
    own = {p: cfg.for_project(p).gc for p, settings in cfg.projects.items() if "gc" in settings}
    if manual:
        return Scope("project NOT IN (SELECT value FROM json_each(?))", "[]", "every project")
    if cfg.gc:
        off = sorted(p for p, on in own.items() if not on)
        return Scope("project NOT IN (SELECT value FROM json_each(?))", json.dumps(off),
                     f"every project but {', '.join(off)} (gc = false)" if off else "every project")
    on = sorted(p for p, on in own.items() if on)
    return Scope("project IN (SELECT value FROM json_each(?))", json.dumps(on),
                 f"only {', '.join(on)} (gc = true there)") if on else None


class GC:
    name = "gc"

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        cfg, now = ctx.config(), time.time()
        scope = _scope(cfg, manual=req.trigger == "manual")
        if scope is None:
            report.detail["skipped"] = "gc is off (config gc = false): it runs only when asked"
            return

        async def collect(db: aiosqlite.Connection) -> tuple[set[int], set[int]]:
            deleted: set[int] = set()
            protected = await working_set(db, cfg, now)
            before = report.items_out
            await self.expire(db, cfg, now, protected, report, scope)
            await self.cap(db, cfg, now, protected, report, req.project, scope)
            await self.stale_tasks(db, cfg, now, protected, report, scope)
            await self.banned(db, cfg, report, scope)
            await self.dangling_edges(db, dangling, report)
            if cfg.job_history_days > 0:
                await self.prune_jobs(db, cfg, now, report)
            if cfg.archived_ttl_days > 0:
                deleted |= await self.delete_archived(db, cfg, now, protected, report, scope)
            if cfg.event_ttl_days > 0:
                deleted |= await self.expire_evidence(db, cfg, now, protected, report, scope)
                await self.thin_sources(db, thinned, report)
                await self.purge_events(db, cfg, now, report, scope)
                await self.prune_sessions(db, cfg, now, report, scope)
            await progress(db, report, 0, report.items_out - before)
            return protected, deleted

        # Every edge is read to find the dangling ones (5 ms at 23k edges, and growing with the store): on the
        # workers' own reader, before the writer's turn, not in GC's transaction, which held it up to 24 ms during a
        # catch-up. An edge left dangling meanwhile goes at the next run.
        dangling = [int(r[0]) for r in await ctx.store.fetchall(f"SELECT rowid FROM edges WHERE {DANGLING}",
                                                                 background=True)]
        # The same for the links `thin_sources` drops: finding them reads every link of the memories citing expired
        # events (two index lookups a link), a read that grows with the store.
        thinned = await self.links_to_thin(ctx, cfg, now, scope) if cfg.event_ttl_days > 0 else []
        # One transaction in one trip to the writer's thread (`WorkerContext.commit`): a trip per statement waited
        # each time for the event loop's turn while GC held the writer (its run held it up to 105 ms during a
        # catch-up, and the hooks' commits waited behind).
        protected, deleted = await ctx.commit(req.dry_run, collect)
        if deleted and not req.dry_run:
            ctx.memories.gone(sorted(deleted))
        report.detail["protected"] = len(protected)
        report.detail["projects"] = scope.label

    async def banned(self, db: aiosqlite.Connection, cfg: Config, report: RunReport, scope: Scope) -> None:
        """Memories of a kind the user banned (`extract_banned`, or a project's own): archived, working set or not."""
        own = {p: cfg.for_project(p).kinds_banned() for p, s in cfg.projects.items() if "extract_banned" in s}
        rules = [(cfg.kinds_banned(), "project NOT IN (SELECT value FROM json_each(?))", json.dumps(sorted(own)))]
        rules += [(kinds, "project = ?", project) for project, kinds in own.items()]
        for kinds, where, param in rules:
            if kinds:
                ids = await _ids(db, f"SELECT id FROM memories WHERE archived_at IS NULL AND {where} AND {scope.where}"
                                     " AND kind IN (SELECT value FROM json_each(?))",
                                 (param, scope.param, json.dumps(sorted(kinds))))
                await archive(db, sorted(ids), "banned kind", report)

    async def expire(self, db: aiosqlite.Connection, cfg: Config, now: float, protected: set[int],
                     report: RunReport, scope: Scope) -> None:
        ids = await _ids(db, "SELECT id FROM memories WHERE archived_at IS NULL AND expires IS NOT NULL"
                             f" AND expires <= ? AND {scope.where}", (now, scope.param))
        await archive(db, sorted(ids - protected), "expired", report)
        if cfg.memory_ttl_days > 0:
            cutoff = now - cfg.memory_ttl_days * 86400
            ids = await _ids(db, "SELECT id FROM memories WHERE archived_at IS NULL"
                                 " AND kind NOT IN ('digest', 'task', 'evidence')"
                                 f" AND max(updated, coalesce(CAST(last_hit AS REAL), 0)) < ? AND {scope.where}",
                             (cutoff, scope.param))
            await archive(db, sorted(ids - protected), f"ttl: untouched for {cfg.memory_ttl_days:g} days", report)

    async def cap(self, db: aiosqlite.Connection, cfg: Config, now: float, protected: set[int], report: RunReport,
                  only: str | None, scope: Scope) -> None:
        # Evidence passages are the sessions' own record, kept like the events: the cap is on what was distilled.
        async with db.execute("SELECT project, count(*) FROM memories WHERE archived_at IS NULL AND kind != 'evidence'"
                              f" AND {scope.where} GROUP BY project HAVING count(*) > ?",
                              (scope.param, cfg.project_memory_cap)) as cur:
            over = [(r[0], r[1]) for r in await cur.fetchall() if only is None or r[0] == only]
        for project, count in over:
            async with db.execute(
                "SELECT id, kind, importance, hits, max(updated, coalesce(CAST(last_hit AS REAL), 0)) FROM memories"
                " WHERE project = ? AND archived_at IS NULL AND kind != 'evidence'", (project,)) as cur:
                rows = await cur.fetchall()
            ranked = sorted((value(r[1], r[2], r[3], r[4], now, cfg.recency_half_life_days), r[0])
                            for r in rows if r[0] not in protected)
            excess = count - cfg.project_memory_cap
            victims = [memory_id for _, memory_id in ranked[:excess]]
            await archive(db, victims, f"cap: project over {cfg.project_memory_cap} memories, lowest value", report)

    async def stale_tasks(self, db: aiosqlite.Connection, cfg: Config, now: float, protected: set[int],
                          report: RunReport, scope: Scope) -> None:
        cutoff = now - cfg.stale_task_days * 86400
        ids = await _ids(db, "SELECT id FROM memories WHERE kind = 'task' AND archived_at IS NULL AND updated < ?"
                             f" AND coalesce(json_extract(meta, '$.state'), 'draft') IN ('draft', 'active')"
                             f" AND {scope.where}", (cutoff, scope.param))
        # An open task is itself in the working set; a stale one is exactly the open task nobody touches.
        recent = await _ids(db, "SELECT id FROM memories WHERE kind = 'task' AND last_hit IS NOT NULL"
                                " AND CAST(last_hit AS REAL) >= ?", (cutoff,))
        await archive(db, sorted(ids - recent), f"stale task: untouched for {cfg.stale_task_days:g} days", report)

    async def dangling_edges(self, db: aiosqlite.Connection, found: list[int], report: RunReport) -> None:
        """Edges whose end is gone (an entity merged away, a row removed by hand): they point at nothing. `found`:
        their rowids as `run` read them before the transaction; each is checked again here."""
        if not found:
            return
        cur = await db.execute(f"DELETE FROM edges WHERE rowid IN (SELECT value FROM json_each(?)) AND ({DANGLING})",
                               (json.dumps(found),))
        if cur.rowcount:
            report.wrote("dangling_edges_removed", count=cur.rowcount)

    async def delete_archived(self, db: aiosqlite.Connection, cfg: Config, now: float, protected: set[int],
                              report: RunReport, scope: Scope) -> set[int]:
        """Memories archived more than `archived_ttl_days` ago (set by the user; off by default): deleted with
        every row that hangs on them (purge's `remove`). The events they cited lose that citation, so the event
        purge (`event_ttl_days`) can then remove them too."""
        cutoff = now - cfg.archived_ttl_days * 86400
        ids = await _ids(db, f"SELECT id FROM memories WHERE archived_at IS NOT NULL AND archived_at < ?"
                             f" AND {scope.where} ORDER BY archived_at LIMIT ?", (cutoff, scope.param, PURGE_BATCH))
        ids -= protected
        if ids:
            await remove(db, Selection(memories=ids), rebuild_fts=False)
            report.wrote("archived_deleted", count=len(ids))
        return ids

    async def expire_evidence(self, db: aiosqlite.Connection, cfg: Config, now: float, protected: set[int],
                              report: RunReport, scope: Scope) -> set[int]:
        """Under `event_ttl_days` (set by the user; off by default) an evidence passage, its events' own text, goes
        with them, working set excepted: its links to events past the TTL and passed by the observer are dropped,
        and a passage left with none is deleted with every row that hangs on them (purge's `remove`). A passage
        seen again (the same text, deduplicated: `git status` saying "clean" every day) keeps only its recent
        events. Kept, a passage would keep its events cited, and itself and all it indexes (full text, vectors,
        recurrence pairs, entity edges) would grow for good under a retention."""
        cutoff = now - cfg.event_ttl_days * 86400
        # `created` is the step's first time, no later than its events': the index on it skips the recent passages.
        old = (f"SELECT m.id FROM memories m WHERE m.created < ? AND m.kind = 'evidence' AND m.{scope.where}"
               " AND m.id NOT IN (SELECT value FROM json_each(?))")
        params = (cutoff, scope.param, json.dumps(sorted(protected)))
        cur = await db.execute(
            f"DELETE FROM memory_sources WHERE (memory_id, event_id) IN (SELECT s.memory_id, s.event_id FROM ({old}) o"
            " JOIN memory_sources s ON s.memory_id = o.id JOIN events e ON e.id = s.event_id"
            f" {PASSED_JOIN} WHERE {PASSED})", (*params, cutoff))
        unlinked = max(cur.rowcount, 0)
        ids = await _ids(db, f"{old} AND NOT EXISTS (SELECT 1 FROM memory_sources s WHERE s.memory_id = m.id) LIMIT ?",
                         (*params, EVIDENCE_BATCH))
        if ids:
            await remove(db, Selection(memories=ids), rebuild_fts=False)
        if ids or unlinked:
            report.wrote("evidence_expired", count=len(ids), links=unlinked)
        return ids

    async def links_to_thin(self, ctx: WorkerContext, cfg: Config, now: float, scope: Scope) -> list[list[int]]:
        """Under `event_ttl_days`, a memory keeps its first and its latest source event, and the rest of those past
        the TTL (and passed by the observer) stop being its sources: these links, as (memory, event) pairs. A rule
        restated in every session is one memory (deduplicated: `hits` counts the restatements) with a link to each
        restatement's event, and a cited event keeps its row for good: a memory in use would otherwise hold every
        event that ever repeated it (a fixed-size soak: 58 live constraints held 561 of 841 expired events, and the
        store grew by 210-250 events a minute). What reads the links needs only the ends: where a memory was first
        and last said (`_around`, `_session_end`); the drill-down's payloads past the TTL are gone already."""
        cutoff = now - cfg.event_ttl_days * 86400
        rows = await ctx.store.fetchall(
            f"SELECT s.memory_id, s.event_id FROM events e {PASSED_JOIN} JOIN memory_sources s ON s.event_id = e.id"
            f" WHERE {PASSED} AND e.{scope.where} AND {_INSIDE} LIMIT ?", (cutoff, scope.param, PURGE_BATCH),
            background=True)
        return [[int(r[0]), int(r[1])] for r in rows]

    async def thin_sources(self, db: aiosqlite.Connection, links: list[list[int]], report: RunReport) -> None:
        """Drop the links `links_to_thin` found, each still between its memory's first and latest (a link removed
        meanwhile, a memory deleted, may have made it an end)."""
        if not links:
            return
        cur = await db.execute(
            "DELETE FROM memory_sources AS s WHERE (s.memory_id, s.event_id) IN (SELECT json_extract(value, '$[0]'),"
            f" json_extract(value, '$[1]') FROM json_each(?)) AND {_INSIDE}", (json.dumps(links),))
        if cur.rowcount > 0:
            report.wrote("sources_thinned", links=cur.rowcount)

    async def purge_events(self, db: aiosqlite.Connection, cfg: Config, now: float, report: RunReport,
                           scope: Scope) -> None:
        """Raw events past their TTL that the observer has passed: payload-less if cited, else removed."""
        cutoff = now - cfg.event_ttl_days * 86400
        passed = f"FROM events e {PASSED_JOIN} WHERE {PASSED} AND e.{scope.where}"
        cited = "EXISTS (SELECT 1 FROM memory_sources s WHERE s.event_id = e.id)"
        cur = await db.execute(
            f"UPDATE events SET payload = ? WHERE id IN (SELECT e.id {passed} AND {cited}"
            f" AND e.payload != ? LIMIT ?)", (PURGED_PAYLOAD, cutoff, scope.param, PURGED_PAYLOAD, PURGE_BATCH))
        stripped = cur.rowcount
        cur = await db.execute(f"DELETE FROM events WHERE id IN (SELECT e.id {passed} AND NOT {cited} LIMIT ?)",
                               (cutoff, scope.param, PURGE_BATCH))
        if stripped or cur.rowcount:
            report.wrote("events_purged", deleted=cur.rowcount, payload_dropped=stripped)

    async def prune_jobs(self, db: aiosqlite.Connection, cfg: Config, now: float, report: RunReport) -> None:
        """Finished runs older than `job_history_days`: a worker runs every `worker_interval_s` whether or not it
        has work, so kept for good the log would grow by thousands of rows a day. Each worker's latest run and
        latest error stay, whatever their age (`status` and `loom workers` show them)."""
        cutoff = now - cfg.job_history_days * 86400
        workers = [r[0] for r in await (await db.execute("SELECT DISTINCT worker FROM jobs")).fetchall()]
        deleted = 0
        for worker in workers:  # one range of the (worker, started) index each
            cur = await db.execute(
                "DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE worker = ? AND started < ?"
                " AND outcome != 'running' AND id != (SELECT max(id) FROM jobs WHERE worker = ?)"
                " AND id IS NOT (SELECT max(id) FROM jobs WHERE worker = ? AND outcome = 'error') LIMIT ?)",
                (worker, cutoff, worker, worker, PURGE_BATCH))
            deleted += max(cur.rowcount, 0)
        if deleted:
            report.wrote("jobs_pruned", count=deleted)

    async def prune_sessions(self, db: aiosqlite.Connection, cfg: Config, now: float, report: RunReport,
                             scope: Scope) -> None:
        """Under `event_ttl_days`, a session quiet longer than it and than the working set loses the rest of its
        record: the blocks it was shown (`injections`, the viewer's session page) and its frozen start and
        compaction blocks (were it resumed, it gets fresh ones; a prompt cache is long cold by then). Its row
        stays: the transcript offset the tailer resumes from, and `injected`, the memories it was shown."""
        cutoff = now - max(cfg.event_ttl_days, cfg.working_set_days) * 86400
        idle = f"SELECT id FROM sessions WHERE last_seen < ? AND {scope.where}"
        cur = await db.execute(
            f"DELETE FROM injections WHERE id IN (SELECT i.id FROM ({idle}) s JOIN injections i"
            " ON i.session_id = s.id LIMIT ?)", (cutoff, scope.param, PURGE_BATCH))
        shown = max(cur.rowcount, 0)
        cur = await db.execute(
            f"UPDATE sessions SET start_block = NULL, compact_block = NULL WHERE id IN ({idle}"
            " AND (start_block IS NOT NULL OR compact_block IS NOT NULL) LIMIT ?)", (cutoff, scope.param, PURGE_BATCH))
        blocks = max(cur.rowcount, 0)
        if shown or blocks:
            report.wrote("sessions_pruned", injections=shown, blocks=blocks)
