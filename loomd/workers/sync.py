"""The `sync` worker: one cycle of shared-memory sync (loomd/team/sync.py) per run, on its own interval
(`shared_interval_s`), scheduled only when a shared server is configured."""

from __future__ import annotations

from loomd.workers.base import RunReport, RunRequest, WorkerContext


class Sync:
    name = "sync"

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        engine = ctx.sync
        if engine is None or not engine.configured:
            report.detail["skipped"] = "no shared server configured"
            return
        # A manual run (`loom workers run sync`) is someone waiting: it ignores the backoff.
        out = await engine.run(force=req.trigger == "manual")
        report.detail.update(out)
        for direction in ("push", "pull"):
            counts = out.get(direction) or {}
            report.items_in += sum(counts.values())
            report.items_out += counts.get("inserted", 0) + counts.get("updated", 0)
