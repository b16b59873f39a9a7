"""The dropper: when a project's active observations pass `observations_pool_max_tokens`, archive the ones a
reflection already covers (a `supports` edge to a live memory), oldest first, down to
`observations_pool_target_tokens`. Uncovered observations and the working set are never dropped."""

from __future__ import annotations

import functools
import time

import aiosqlite

from loomd.config import Config
from loomd.workers.base import RunReport, RunRequest, WorkerContext, progress
from loomd.workers.gc import archive, working_set


class Dropper:
    name = "dropper"

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        cfg = ctx.config()
        if req.project:
            projects = [req.project]
        else:
            rows = await ctx.store.fetchall(
                "SELECT project FROM memories WHERE kind = 'observation' AND archived_at IS NULL GROUP BY project"
                " HAVING sum(tokens) > ?", (cfg.observations_pool_max_tokens,), background=True)
            projects = [r[0] for r in rows]
        for project in projects:
            # One trip to the writer's thread for the project's reads and archives: the writer is held for that work
            # alone, not also for a trip through the busy event loop per statement.
            await ctx.commit(req.dry_run, functools.partial(self.drop, cfg, project=project, report=report))

    async def drop(self, cfg: Config, db: aiosqlite.Connection, *, project: str, report: RunReport) -> None:
        """Archive `project`'s covered observations down to the target. It awaits only `db` (`store.trip`)."""
        async with db.execute("SELECT coalesce(sum(tokens), 0) FROM memories WHERE project = ?"
                              " AND kind = 'observation' AND archived_at IS NULL", (project,)) as cur:
            row = await cur.fetchone()
        total = int(row[0]) if row else 0
        if total <= cfg.observations_pool_max_tokens:
            return
        protected = await working_set(db, cfg, time.time())
        async with db.execute(
            "SELECT m.id, m.tokens, min(e.dst_id) FROM memories m"
            " JOIN edges e ON e.src_type = 'memory' AND e.src_id = m.id AND e.dst_type = 'memory'"
            "  AND e.type IN ('supports', 'derives_from')"
            " JOIN memories r ON r.id = e.dst_id AND r.archived_at IS NULL AND r.kind != 'observation'"
            " WHERE m.project = ? AND m.kind = 'observation' AND m.archived_at IS NULL"
            " GROUP BY m.id ORDER BY m.created, m.id", (project,)) as cur:
            covered = list(await cur.fetchall())
        dropped = 0
        for memory_id, tokens, by in covered:
            if total <= cfg.observations_pool_target_tokens:
                break
            if memory_id in protected:
                continue
            await archive(db, [memory_id], f"dropped: covered by #{by}", report)
            total -= tokens
            dropped += 1
        await progress(db, report, len(covered), dropped)
        report.items_in += len(covered)
        report.detail.setdefault("pool_tokens", {})[project] = total
