"""The digest: keep a project's reflection block within `reflection_context_max_tokens`.

The newest durable memories are kept verbatim (60% of the budget, in characters: tokens × 4); everything older is
folded into one extractive `digest` memory that fits the other 40% to the character: grouped by kind, counted, and
the most valuable line of each group first, then the next ones while they fit. A project has one digest, rewritten
in place when its text changes: it is derived from the memories it folds (its `derives_from` edges name them), not a
memory of its own, so a version replaced is not kept. Archived and kept at each change, a digest rewritten whenever a
folded rule was restated (its `updated` moves the span) left an archived copy and up to MAX_EDGES edges each time:
in the soak, about 40 copies and 14,000 edges a minute. The checkpoint `digest:<project>` records the newest folded
memory (the watermark) and a fingerprint of the folded set, so a run with nothing new to fold writes nothing.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from loomd.ingest.reading import clip
from loomd.store.derived import write_derived
from loomd.store.memories import MAX_MEMORY_CHARS, insert_memory, rewrite, set_archived
from loomd.workers.base import (
    REFLECTION_KINDS,
    RunReport,
    RunRequest,
    WorkerContext,
    add_edge,
    get_checkpoint,
    progress,
    requested_projects,
    set_checkpoint,
)

VERBATIM_SHARE = 0.6
LABELS = {"constraint": "Rules", "preference": "Preferences", "decision": "Decisions", "procedure": "Procedures",
          "insight": "Insights", "fact": "Facts", "reflection": "Reflections", "handoff": "Handoffs"}
MAX_EDGES = 500


def budgets(max_tokens: int) -> tuple[int, int]:
    """(verbatim chars, digest chars) for a reflection block of `max_tokens`."""
    total = max(0, max_tokens) * 4
    verbatim = int(total * VERBATIM_SHARE)
    return verbatim, total - verbatim


def _worth(row: Any) -> float:
    return float(row["importance"]) * (1 + math.log1p(int(row["hits"]))) + float(row["updated"]) * 1e-12


def _day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d")


def render_digest(rows: Sequence[Any], budget: int) -> str:
    """An extractive digest of `rows`, at most `budget` characters (never more, whatever the input)."""
    if budget <= 0 or not rows:
        return ""
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(row["kind"], []).append(row)
    order = [k for k in LABELS if k in groups] + sorted(k for k in groups if k not in LABELS)
    for kind in order:
        groups[kind].sort(key=_worth, reverse=True)
    span = f"{_day(min(r['created'] for r in rows))}..{_day(max(r['updated'] for r in rows))}"
    counts = ", ".join(f"{len(groups[k])} {LABELS.get(k, k).lower()}" for k in order)
    out = clip(f"Digest of {len(rows)} older memories ({span}): {counts}", budget)
    depth = max(len(g) for g in groups.values())
    for rank in range(depth):  # the best line of every group before the second line of any
        for kind in order:
            if rank >= len(groups[kind]):
                continue
            row = groups[kind][rank]
            line = f"\n{LABELS.get(kind, kind)}: {' '.join(row['text'].split())} #{row['id']}"
            room = budget - len(out)
            if len(line) <= room:
                out += line
            elif room >= 40:
                out += "\n" + clip(line.strip(), room - 1)
                return out
            else:
                return out
    return out


class Digest:
    name = "digest"

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        projects = await requested_projects(ctx, req)
        if projects is None:
            # Periodic: only projects whose durable memories changed (written, merged, archived) since their digest.
            marks = ",".join("?" * len(REFLECTION_KINDS))
            rows = await ctx.store.fetchall(
                f"SELECT m.project FROM memories m LEFT JOIN checkpoints c ON c.name = 'digest:' || m.project"
                f" WHERE m.kind IN ({marks}) GROUP BY m.project"
                f" HAVING c.updated IS NULL OR max(max(m.updated), coalesce(max(m.archived_at), 0)) > c.updated",
                REFLECTION_KINDS, background=True)
            projects = sorted({r[0] for r in rows} | set(req.keys))
        for project in projects:
            # Its reads, the render and the writes in one trip to the writer's thread: the writer is held for that
            # work alone, not also for a trip through the busy event loop per statement.
            made = await ctx.commit(req.dry_run, functools.partial(self.digest, ctx, project=project, report=report,
                                                                   dry_run=req.dry_run))
            if made is not None and not req.dry_run:
                ctx.memories.mark_stale([made])  # for the back-fill

    async def digest(self, ctx: WorkerContext, db: Any, *, project: str, report: RunReport,
                     dry_run: bool) -> int | None:
        """Fold a project's older durable memories into its digest: the new digest's id, if one was written. It
        awaits only `db` (`store.trip`); the caller marks the new digest's vector stale."""
        verbatim_budget, digest_budget = budgets(ctx.config().reflection_context_max_tokens)
        marks = ",".join("?" * len(REFLECTION_KINDS))
        async with db.execute(
            f"SELECT id, kind, text, importance, hits, created, updated FROM memories WHERE project = ?"
            f" AND kind IN ({marks}) AND archived_at IS NULL AND superseded_by IS NULL"
            f" ORDER BY updated DESC, id DESC", (project, *REFLECTION_KINDS)) as cur:
            rows = list(await cur.fetchall())
        used, cut = 0, len(rows)
        for i, row in enumerate(rows):
            used += len(row["text"]) + 1
            if used > verbatim_budget:
                cut = i
                break
        older = rows[cut:]
        fingerprint = hashlib.sha256(json.dumps(
            [[r["id"], r["updated"], r["hits"]] for r in older] + [digest_budget]).encode()).hexdigest()[:24]
        raw = await get_checkpoint(db, f"digest:{project}")
        state = json.loads(raw) if raw else {}
        async with db.execute("SELECT id, text FROM memories WHERE project = ? AND kind = 'digest'"
                              " AND archived_at IS NULL ORDER BY id DESC", (project,)) as cur:
            current = list(await cur.fetchall())
        if state.get("fingerprint") == fingerprint and (current or not older):
            return None  # nothing new to fold since the last digest
        report.items_in += len(rows)
        # Made of stored texts, redacted when they were written; within the column's bound, so what is stored is
        # what was rendered, and the next run's comparison holds.
        text = render_digest(older, min(digest_budget, MAX_MEMORY_CHARS))
        digest_id = made = None
        if text and not (current and current[0]["text"] == text):
            meta = {"folded": len(older), "verbatim": cut, "budget_chars": digest_budget}
            if current:
                digest_id = current[0]["id"]
                await rewrite(db, digest_id, text, "digest", meta)
                await db.execute("DELETE FROM edges WHERE src_type = 'memory' AND src_id = ? AND dst_type = 'memory'"
                                 " AND type = 'derives_from'", (digest_id,))
            else:
                digest_id, _ = await insert_memory(db, kind="digest", text=text, project=project, importance=0.6,
                                                   origin="digest", meta=meta, redacted=True)
            for row in older[:MAX_EDGES]:
                await add_edge(db, digest_id, row["id"], "derives_from")
            report.wrote("digest", id=digest_id, chars=len(text), budget=digest_budget, folded=len(older), text=text)
            if not dry_run:
                await write_derived(db, [digest_id])
                made = digest_id
        elif current:
            digest_id = current[0]["id"]
        stale = [r["id"] for r in current if r["id"] != digest_id]
        if stale:
            reason = f"replaced by digest #{digest_id}" if digest_id else "nothing left to fold"
            await set_archived(db, stale, True, reason)
            for memory_id in stale:
                report.wrote("archive", id=memory_id, reason=reason)
        await set_checkpoint(db, f"digest:{project}", {
            "fingerprint": fingerprint, "digest_id": digest_id, "folded": len(older), "verbatim": cut,
            "watermark": max((r["updated"] for r in older), default=None)})
        await progress(db, report, len(rows), 1 if digest_id and text else 0)
        return made
