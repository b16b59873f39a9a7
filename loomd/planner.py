"""The planner's I/O: freeze the start block per session, track what was injected, recall per prompt."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .config import Config
from .context import (
    Line,
    hook_output,
    is_trivial,
    project_label,
    render_compact_block,
    render_recall_block,
    render_start_block,
    session_lines,
    start_lines,
)
from .ingest import Event
from .store import Store

log = logging.getLogger(__name__)

Search = Callable[..., Awaitable[list[dict[str, Any]]]]


def relevant(item: dict[str, Any], min_score: float) -> bool:
    """Inject a hit only when the meaning matches: a close vector, or a keyword hit that is not far off."""
    explain = item.get("explain") or {}
    vec = explain.get("vec") or {}
    cosine = vec.get("cosine", vec.get("score"))
    fts = explain.get("fts")
    if isinstance(cosine, int | float):
        return cosine >= min_score or (bool(fts) and cosine >= min_score - 0.15)
    # Full-text only (no embedder): trust only the top keyword hits.
    return isinstance(fts, dict) and int(fts.get("rank", 99)) <= 2


class Planner:
    def __init__(self, store: Store, config: Callable[[], Config], search: Search) -> None:
        self.store = store
        self.config = config
        self.search = search

    async def for_hook(self, event: Event, deadline_ms: int) -> str:
        """The stdout of a SessionStart / UserPromptSubmit hook, or "" if nothing fits or time ran out."""
        try:
            text = await asyncio.wait_for(self._for_hook(event), max(deadline_ms, 1) / 1000)
        except TimeoutError:
            log.warning("context for %s in session %s missed its %d ms deadline", event.kind, event.session_id,
                        deadline_ms)
            return ""
        return hook_output(event.kind, text)

    async def _for_hook(self, event: Event) -> str:
        if event.kind == "SessionStart":
            if event.payload.get("source") == "compact":
                return (await self.compact(event.session_id, event.project))[0]
            return (await self.start(event.session_id, event.project, event.agent))[0]
        if event.kind == "UserPromptSubmit" and isinstance(event.payload.get("prompt"), str):
            return (await self.recall(event.session_id, event.project, event.payload["prompt"]))[0]
        return ""

    async def _injected(self, session_id: str) -> set[int]:
        raw = await self.store.scalar("SELECT injected FROM sessions WHERE id = ?", (session_id,))
        return set(json.loads(raw)) if raw else set()

    async def _mark_injected(self, session_id: str, ids: list[int]) -> None:
        if not ids:
            return
        async with self.store.atomic() as db:
            async with db.execute("SELECT injected FROM sessions WHERE id = ?", (session_id,)) as cur:
                row = await cur.fetchone()
            if row is None:
                return
            merged = sorted(set(json.loads(row[0] or "[]")) | set(ids))
            await db.execute("UPDATE sessions SET injected = ? WHERE id = ?", (json.dumps(merged), session_id))
            marks = ",".join("?" * len(ids))
            # An injected memory is in the working set: GC and the dropper leave it alone.
            await db.execute(f"UPDATE memories SET last_hit = strftime('%s','now') WHERE id IN ({marks})", ids)

    async def start(self, session_id: str, project: str, agent: str) -> tuple[str, list[int]]:
        """Rendered once per session, then returned byte for byte (resume included): the prefix stays cacheable."""
        frozen = await self.store.fetchone("SELECT start_block FROM sessions WHERE id = ?", (session_id,))
        if frozen is not None and frozen[0] is not None:
            return frozen[0], []
        lines, counts = await start_lines(self.store, project)
        text, ids = render_start_block(project_label(project), lines, counts, self.config().start_block_budget(agent))
        async with self.store.atomic() as db:
            await db.execute("UPDATE sessions SET start_block = ? WHERE id = ? AND start_block IS NULL",
                             (text, session_id))
            async with db.execute("SELECT start_block FROM sessions WHERE id = ?", (session_id,)) as cur:
                row = await cur.fetchone()
        if row is not None and row[0] != text:
            return row[0], []  # a concurrent start won the race; its block is the session's
        await self._mark_injected(session_id, ids)
        return text, ids

    async def compact(self, session_id: str, project: str) -> tuple[str, list[int]]:
        budget = self.config().reflection_context_max_tokens * 4
        lines = await session_lines(self.store, session_id, project, budget)
        text, ids = render_compact_block(project_label(project), lines, budget)
        await self._mark_injected(session_id, ids)
        return text, ids

    async def recall(self, session_id: str, project: str, prompt: str) -> tuple[str, list[int]]:
        """Relevant memories for a prompt that this session has not seen yet; nothing rather than noise."""
        if is_trivial(prompt):
            return "", []
        cfg = self.config()
        seen = await self._injected(session_id)
        hits = await self.search(query=prompt[:2000], limit=12, project=project, explain=True)
        lines = [Line(h["id"], h["kind"], h["created"], h["text"]) for h in hits
                 # This session's own memories are still in the agent's context (a capture of this very
                 # prompt among them); after compaction the compact block restores them.
                 if h["id"] not in seen and h.get("session_id") != session_id and relevant(h, cfg.prompt_min_score)]
        text, ids = render_recall_block(lines, cfg.prompt_block_chars, cfg.prompt_block_lines)
        await self._mark_injected(session_id, ids)
        return text, ids
