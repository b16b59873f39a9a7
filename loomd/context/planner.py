"""The context planner: selects what each block shows (every query it needs), freezes the start block per
session, tracks what was injected, recalls per prompt. Rendering is `render.py`'s, pure."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiosqlite

from loomd.config import Config
from loomd.context.relevance import asks_memory, keyword_candidate, recalled
from loomd.context.render import (
    START_GROUPS,
    Line,
    hook_output,
    is_trivial,
    line_of,
    project_label,
    recall_room,
    render_compact_block,
    render_recall_block,
    render_start_block,
)
from loomd.errors import LoomdError
from loomd.ingest.events import Event
from loomd.ingest.project import project_folder
from loomd.ingest.sentences import clean_user_text
from loomd.search.retrieval import Hit
from loomd.store.db import Store
from loomd.store.tasks import OPEN_STATES
from loomd.store.trip import commit_in_one_trip, plain

log = logging.getLogger(__name__)

Search = Callable[..., Awaitable[list[Hit]]]


_NAME = re.compile(r"[a-z_]+")
ASK_SESSIONS = 3  # the project's newest sessions whose user asks the start block shows
ASK_LINES = 3
PROMPT_FTS_BUDGET = 2000  # memories the prompt hook's full-text query may score (retrieval.prune_terms)
FOLLOW_UP_TIMEOUT_S = 10.0
# A prompt's follow-up search begins this long after the hook's reply: the hook's process still has to read the reply
# and exit, and the search's query embedding and reads, begun at once, took a CPU from it (on 2 CPUs the hooks bench's
# UserPromptSubmit waited 2-3 ms longer than the daemon took to answer). Its result is wanted at the next tool result,
# which comes after the model has written a tool call: seconds later.
FOLLOW_UP_AFTER_S = 0.05
MAX_FOLLOW_UPS = 256  # sessions with a semantic recall waiting for its tool result
MIN_FOLLOW_UP = 200  # characters a prompt's block must have left for its follow-up to be searched for


@dataclass
class StartRead:
    """A new session's start block, read inside its SessionStart event's own commit (an `also` of the event writer:
    `Planner.start_read`), on the thread that commits it, with no hand-off to the reader's thread and back. Read there
    while the event committed, its result waited for the event loop's turn, which on a machine busy with a catch-up
    came after the log's sync, run on the loop for a hook that came alone (`WalSync.sync_here`): in the hooks bench
    with a catch-up running (2 CPUs, 60 runs) the read ended 1.87 ms into the answer and was taken up at 2.77. Read
    in the commit, the block is rendered right after the sync (the answer 2.89 -> 2.48 ms at the median)."""

    event: Event
    found: tuple[str | None, list[Line], dict[str, int]] | None = None
    in_commit: bool = True  # read by the event's commit (which the block then waits for), not `read_here`

    async def __call__(self, db: aiosqlite.Connection, events: Sequence[Event]) -> None:
        self.found = None  # a group commit that failed runs each submitter's `also` again (`_commit_apart`)
        try:
            self.found = read_start(self.event.project, time.time(), self.event.session_id, plain(db))
        except Exception as exc:  # noqa: BLE001 - never the event's loss: the block is read apart (`Planner.start`)
            log.warning("start block of session %s not read in its commit: %r", self.event.session_id, exc)

    def read_here(self, store: Store) -> None:
        """For a SessionStart the hook journal holds, answered before its commit: the same read, on the event loop's
        thread right away (`Store.read_here`); a read that finds the database busy is left to `Planner.start`."""
        self.in_commit = False
        try:
            self.found = store.read_here(functools.partial(read_start, self.event.project, time.time(),
                                                           self.event.session_id))
        except sqlite3.Error as exc:
            log.info("start block of session %s read apart: %r", self.event.session_id, exc)


class Planner:
    """What the hooks inject. A prompt's recall comes in two steps, so the agent never waits for an embedding: the
    keyword signals answer inside the UserPromptSubmit hook (about a millisecond), while the hybrid search runs in
    the background; what it adds is delivered with the session's next tool result (PostToolUse), which both
    clients accept `additionalContext` on. `prompt_semantic_inline` waits for the hybrid search in the hook."""

    def __init__(
        self, store: Store, config: Callable[[], Config], search: Search, semantic: Callable[[], bool],
        recount: Callable[[], Awaitable[int]],
    ) -> None:
        self.store = store
        self.config = config
        self.search = search
        self.semantic = semantic  # whether vector search can answer now
        self.recount = recount  # counts the recalls used past their time, counted again (`retrieval.recount_stale`)
        self._recounting: asyncio.Task[None] | None = None
        self._follow_ups: dict[str, asyncio.Task[list[Line]]] = {}
        self._follow_up_room: dict[str, int] = {}  # what the prompt's hook block left of its budget
        # Injected ids whose write has not committed yet: already part of the session's set for the next recall.
        self._marking: dict[str, list[int]] = {}
        self._freezing: dict[str, str] = {}  # start blocks rendered, not committed yet
        self._mark_tasks: set[asyncio.Task[None]] = set()

    async def for_hook(self, event: Event, deadline_ms: int, written: Awaitable[Any] | None = None,
                       start: StartRead | None = None) -> str:
        """The stdout of a SessionStart / UserPromptSubmit hook, or "" if nothing fits or time ran out.

        `written`: the event's own write, still running; the reads overlap it, the planner's writes wait for it
        (they update the session row it may create). It is never cancelled here, even when time runs out. `start`:
        the start block's read, run inside that write (`start_read`)."""
        try:
            # Awaited here, not in a task of its own (as `wait_for` would): its first read is queued on the reader's
            # thread before the event's commit runs, on the loop's thread, and runs while that commit waits for
            # the disk (a new session's SessionStart, quiet daemon, before `start_read`: 3.8 -> 3.0 ms at the median).
            async with asyncio.timeout(max(deadline_ms, 1) / 1000):
                text = await self._for_hook(event, written, start)
        except TimeoutError:
            log.warning("context for %s in session %s missed its %d ms deadline", event.kind, event.session_id,
                        deadline_ms)
            return ""
        return hook_output(event.kind, text)

    def reads(self, event: Event) -> bool:
        """Whether the context of this SessionStart / UserPromptSubmit hook reads the store while the event commits:
        a compaction's block does (a start block is read inside the commit: `start_read`); a prompt only when it asks
        something memory can answer (`asked`), which most do not."""
        if event.kind == "UserPromptSubmit":
            prompt = event.payload.get("prompt")
            return isinstance(prompt, str) and asked(prompt) is not None
        return event.kind == "SessionStart" and _after_compaction(event)

    @staticmethod
    def start_read(event: Event) -> StartRead | None:
        """For a SessionStart that gets a start block (not a compaction's): its read, to run inside the event's own
        commit (`EventWriter.enqueue`'s `also`) and to hand to `for_hook`. None for any other hook."""
        if event.kind == "SessionStart" and not _after_compaction(event):
            return StartRead(event)
        return None

    async def _for_hook(self, event: Event, written: Awaitable[Any] | None, start: StartRead | None) -> str:
        if event.kind == "SessionStart":
            if _after_compaction(event):
                return (await self.compact(event.session_id, event.project, written))[0]
            return (await self.start(event.session_id, event.project, event.agent, written, start))[0]
        if event.kind == "UserPromptSubmit" and isinstance(event.payload.get("prompt"), str):
            inline = self.config().prompt_semantic_inline
            return (await self.recall(event.session_id, event.project, event.payload["prompt"], inline,
                                      written))[0]
        return ""

    async def after_event(self, event: Event, written: Awaitable[Any] | None = None) -> str:
        """For any other hook: the stdout of a tool result that carries a finished follow-up recall, else "".
        `written`: the event's own write, as for `for_hook`."""
        if event.kind in ("Stop", "SessionEnd"):
            # The turn ended without a tool call: what was found for its prompt is stale now.
            self._drop_follow_up(event.session_id)
            return ""
        if event.kind not in ("PostToolUse", "PostToolUseFailure"):
            return ""
        cfg = self.config()
        task = self._follow_ups.get(event.session_id)
        if task is None or not task.done():
            return ""  # still searching: the next tool result gets it, the agent never waits
        del self._follow_ups[event.session_id]
        room = self._follow_up_room.pop(event.session_id, cfg.prompt_block_chars)
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.warning("follow-up recall for session %s failed: %r", event.session_id, task.exception())
            return ""
        seen = await self._injected(event.session_id)
        lines = [line for line in task.result() if line.id not in seen]
        text, ids = render_recall_block(lines, room, cfg.prompt_block_lines)
        self._mark_later(event.session_id, ids, written, block=("follow-up", text))
        return hook_output(event.kind, text)

    def _drop_follow_up(self, session_id: str) -> None:
        self._follow_up_room.pop(session_id, None)
        task = self._follow_ups.pop(session_id, None)
        if task is not None:
            task.cancel()

    def _follow_up(self, session_id: str, project: str, prompt: str, room: int) -> None:
        """The prompt's hybrid search, in the background, for `room` characters (none: no search); replaces the
        session's previous one."""
        self._drop_follow_up(session_id)
        if room < MIN_FOLLOW_UP:
            return
        while len(self._follow_ups) >= MAX_FOLLOW_UPS:  # sessions that never made a tool call
            self._drop_follow_up(next(iter(self._follow_ups)))
        self._follow_ups[session_id] = asyncio.create_task(self._search_later(session_id, project, prompt))
        self._follow_up_room[session_id] = room

    async def _search_later(self, session_id: str, project: str, prompt: str) -> list[Line]:
        await asyncio.sleep(FOLLOW_UP_AFTER_S)  # the hook's reply goes out, and its process ends, first
        return await asyncio.wait_for(self._recall_lines(session_id, project, prompt, keyword_only=False),
                                    FOLLOW_UP_TIMEOUT_S)

    async def close(self) -> None:
        """Stop the follow-ups and the recount; let the injected marks commit."""
        for session_id in list(self._follow_ups):
            self._drop_follow_up(session_id)
        if self._recounting is not None:
            self._recounting.cancel()
            await asyncio.gather(self._recounting, return_exceptions=True)
        await asyncio.gather(*self._mark_tasks, return_exceptions=True)

    def _recount_soon(self) -> None:
        """After a recall, the counts it used past their time are counted again, apart and once its hook's reply is
        out (`FOLLOW_UP_AFTER_S`, as a follow-up): never while a hook waits (`retrieval._total`'s `cached`)."""
        if self._recounting is None or self._recounting.done():
            self._recounting = asyncio.create_task(self._recount_later())

    async def _recount_later(self) -> None:
        await asyncio.sleep(FOLLOW_UP_AFTER_S)
        try:
            await self.recount()
        except (LoomdError, sqlite3.Error, ValueError) as exc:  # ValueError: the store closed meanwhile
            log.info("could not count the memories again: %r", exc)

    async def _injected(self, session_id: str) -> set[int]:
        """The memories this session was shown. Read on the loop's thread (`Store.read_here`): a lookup by key, which
        costs less than a trip to the reader's thread and back (a trip of its own waited 0.1-3.5 ms for the reader
        during a catch-up); a read that finds the database busy goes to the reader."""
        sql, params = "SELECT injected FROM sessions WHERE id = ?", (session_id,)
        try:
            row = self.store.read_here(lambda conn: conn.execute(sql, params).fetchone())
            raw = row[0] if row is not None else None
        except sqlite3.OperationalError:
            raw = await self.store.scalar(sql, params)
        return (set(json.loads(raw)) if raw else set()) | set(self._marking.get(session_id, ()))

    def _mark_later(
        self, session_id: str, ids: list[int], written: Awaitable[Any] | None, freeze: str | None = None,
        block: tuple[str, str] | None = None,
    ) -> None:
        """Note `ids` as injected (and `freeze` as the session's start block, `block` as what it was shown: kind,
        text): in memory at once, in the database after the hook has its answer, so the commit's fsync stays off the
        agent's path. A crash before that commit may let a memory be injected once more, or a resumed session's
        start block be rendered anew."""
        if not ids and freeze is None:
            return
        self._marking.setdefault(session_id, []).extend(ids)
        task = asyncio.create_task(self._mark_injected(session_id, ids, written, freeze, block))
        self._mark_tasks.add(task)

        def marked(_: asyncio.Task[None]) -> None:
            self._mark_tasks.discard(task)
            left = self._marking.get(session_id, [])
            for memory_id in ids:
                left.remove(memory_id)
            if not left:
                self._marking.pop(session_id, None)
            if freeze is not None and self._freezing.get(session_id) == freeze:
                del self._freezing[session_id]
            if not task.cancelled() and task.exception() is not None:
                log.warning("could not note what session %s was shown: %s", session_id, task.exception())

        task.add_done_callback(marked)

    async def _mark_injected(
        self, session_id: str, ids: list[int], written: Awaitable[Any] | None = None, freeze: str | None = None,
        block: tuple[str, str] | None = None,
    ) -> None:
        await _durable(written)

        async def note(db: aiosqlite.Connection) -> None:
            if freeze is not None:
                await db.execute("UPDATE sessions SET start_block = ? WHERE id = ? AND start_block IS NULL",
                                 (freeze, session_id))
            if block is not None and block[1]:
                await db.execute("INSERT INTO injections (session_id, ts, kind, text) VALUES (?, ?, ?, ?)",
                                 (session_id, time.time(), *block))
            await _mark(db, session_id, ids)

        # One commit: the block frozen, recorded and its ids marked together; one trip to the writer's thread, so
        # the writer (hooks' commits wait behind it) is held for the statements alone.
        await commit_in_one_trip(self.store, note)

    async def start(
        self, session_id: str, project: str, agent: str, written: Awaitable[Any] | None = None,
        read: StartRead | None = None,
    ) -> tuple[str, list[int]]:
        """Rendered once per session, then returned byte for byte (resume included): the prefix stays cacheable.
        `read`: what was read inside `written` (`start_read`); without it (or if it failed), a read of its own."""
        frozen = self._freezing.get(session_id)
        if frozen is not None:
            return frozen, []
        found: tuple[str | None, list[Line], dict[str, int]] | None = None
        if read is not None:
            if read.in_commit:
                await _durable(written)
            found = read.found
        if found is None:  # the session's frozen block, or what a new one shows: one trip to the reader's thread
            found = await self.store.read(functools.partial(read_start, project, time.time(), session_id))
        frozen, lines, counts = found
        if frozen is not None:
            return frozen, []
        text, ids = render_start_block(_label(project), lines, counts, self.config().start_block_budget(agent))
        if self._freezing.setdefault(session_id, text) != text:
            return self._freezing[session_id], []  # a concurrent start rendered first; its block is the session's
        self._mark_later(session_id, ids, written, freeze=text, block=("start", text))
        return text, ids

    async def preview_start(self, project: str, agent: str) -> tuple[str, list[int]]:
        """The start block a new session of `project` would get now; nothing is frozen or marked."""
        lines, counts = await start_lines(self.store, project)
        return render_start_block(_label(project), lines, counts, self.config().start_block_budget(agent))

    async def compact(
        self, session_id: str, project: str, written: Awaitable[Any] | None = None,
    ) -> tuple[str, list[int]]:
        budget = self.config().reflection_context_max_tokens * 4
        lines = await session_lines(self.store, session_id, project, budget)
        text, ids = render_compact_block(_label(project), lines, budget)
        self._mark_later(session_id, ids, written, block=("compact", text))
        return text, ids

    async def recall(
        self, session_id: str, project: str, prompt: str, inline: bool = True, written: Awaitable[Any] | None = None,
    ) -> tuple[str, list[int]]:
        """Relevant memories for a prompt that this session has not seen yet; nothing rather than noise: only a
        prompt that asks something memory can answer gets a block (`relevance.py`).

        `inline`: the hybrid search, waited for. Otherwise the keyword recall now and the hybrid search as a
        follow-up for the next tool result (when vectors can answer at all), within what the hook's block left of
        the prompt's budget; a keyword recall not done within `prompt_recall_budget_ms` is left, and the whole block
        follows instead (`_recall_in_time`)."""
        said = asked(prompt)
        if said is None:
            self._drop_follow_up(session_id)
            return "", []
        cfg = self.config()
        deferred = not inline and self.semantic()
        # Awaited in this task, not gathered with the injected ids' read in tasks of their own: the search's one trip
        # to the reader's thread is queued at once, and the ids are read after it, on the loop's thread (`_injected`).
        found = self._recall_lines(session_id, project, said, keyword_only=deferred)
        if inline:
            lines = await found
        elif (done := await _recall_in_time(found, cfg.prompt_recall_budget_ms)) is not None:
            lines = done
        else:
            log.info("the keyword recall of a prompt in session %s took over %d ms: its block follows with the next"
                     " tool result", session_id, cfg.prompt_recall_budget_ms)
            self._follow_up(session_id, project, said, cfg.prompt_block_chars)
            return "", []
        seen = await self._injected(session_id)
        text, ids = render_recall_block([line for line in lines if line.id not in seen], cfg.prompt_block_chars,
                                        cfg.prompt_block_lines)
        left = cfg.prompt_block_chars - len(text)
        if deferred:  # started after the keyword recall, whose reads it would otherwise queue behind
            self._follow_up(session_id, project, said, left)
        self._mark_later(session_id, ids, written, block=("prompt", text))
        return text, ids

    async def _recall_lines(self, session_id: str, project: str, prompt: str, keyword_only: bool) -> list[Line]:
        """The prompt's relevant hits from other sessions: hybrid search, or (`keyword_only`) full text with recency
        and recurrence — nothing to embed, and no graph walk (at 10k memories it costs more than the full-text
        search; whether a top hit names one of the prompt's entities is checked on the hit). The keyword budget is
        tighter than search's: the commonest words stop ranking sooner (coverage still counts them), which keeps
        this at ~3 ms with 100k memories."""
        # A session's last steps (`ENDING_ASKED`) are left to search: with no word of the prompt in them, they
        # would take the block's first lines (coding QA dev set: recall .53 -> .52 with them).
        keyword = {"weights": {"vec": 0, "graph": 0}, "tuning": {"fts_budget": PROMPT_FTS_BUDGET, "ending": 0},
                   "shows": keyword_candidate}
        cfg = self.config()
        room = recall_room(cfg.prompt_block_chars, cfg.prompt_block_lines)  # every line its share, the first too
        hits = await self.search(query=prompt[:2000], limit=12, project=project, window_chars=room, lead_chars=room,
                                 cached_counts=True, **(keyword if keyword_only else {"tuning": {"ending": 0}}))
        self._recount_soon()
        hits = [h for h in hits if _foreign(h.memory, session_id)]
        return [_recall_line(h.memory) for h in recalled(hits, cfg.prompt_min_score, prompt)]


async def _recall_in_time(found: Awaitable[list[Line]], budget_ms: int) -> list[Line] | None:
    """The keyword recall's result if it is done within `budget_ms`, else None (it is cancelled). Past the hook's
    deadline the recall was lost; past this budget, set inside that deadline, it follows with the next tool result.
    Not 10 ms by default, though that would hold the hooks bench's UserPromptSubmit to its target more often (its
    answer at p99 under a catch-up: 12-23 ms against 32-43): the prompts that ask memory something are the ones an
    agent may answer with no tool call, and then a block that follows is dropped with the turn."""
    try:
        async with asyncio.timeout(max(budget_ms, 0) / 1000):  # in this task: `wait_for` would start one of its own
            return await found
    except TimeoutError:
        return None


@functools.lru_cache(maxsize=4)  # a hook's prompt is asked about twice: whether its context reads, then its recall
def asked(prompt: str) -> str | None:
    """What the user asked in `prompt` (not a slash command's echo or the IDE's note), if it asks something memory
    can answer (`relevance.asks_memory`); else None: the prompt gets no recall."""
    said = clean_user_text(prompt)
    return None if is_trivial(said) or not asks_memory(said) else said


def _after_compaction(event: Event) -> bool:
    """A SessionStart that resumes a compacted session: it gets the compaction's block, not the start block."""
    return event.payload.get("source") == "compact"


async def _durable(written: Awaitable[Any] | None) -> None:
    """Wait for the event's own write, shielded: a context deadline must never cancel an event's write."""
    if written is not None:
        await asyncio.shield(written)


async def _mark(db: Any, session_id: str, ids: list[int]) -> None:
    """Add `ids` to the session's injected set, inside the caller's transaction."""
    if not ids:
        return
    async with db.execute("SELECT injected FROM sessions WHERE id = ?", (session_id,)) as cur:
        row = await cur.fetchone()
    if row is None:
        return
    merged = sorted(set(json.loads(row[0] or "[]")) | set(ids))
    await db.execute("UPDATE sessions SET injected = ? WHERE id = ?", (json.dumps(merged), session_id))
    marks = ",".join("?" * len(ids))
    # An injected memory is in the working set: GC and the dropper leave it alone.
    await db.execute(f"UPDATE memories SET last_hit = strftime('%s','now') WHERE id IN ({marks})", ids)


def _sql_name(name: str) -> str:
    """A constant name checked to be safe inside an SQL string literal."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a plain name: {name!r}")
    return name


def _label(project: str) -> str:
    """The project's name in a block header (a repository keyed by its root commit: its folder's name)."""
    return project_label(project, project_folder(project))


def _foreign(hit: dict[str, Any], session_id: str) -> bool:
    # This session's own memories are still in the agent's context (a capture of this very prompt among them);
    # after compaction the compact block restores them.
    return hit.get("session_id") != session_id


def _recall_line(hit: dict[str, Any]) -> Line:
    return Line(hit["id"], hit["kind"], hit["created"], hit["text"])


# --- selection ----------------------------------------------------------------------------------------------------

async def start_lines(store: Store, project: str, now: float | None = None) -> tuple[list[Line], dict[str, int]]:
    """Memories for the start block, in priority order, and the project's counts by kind."""
    _, lines, counts = await store.read(functools.partial(read_start, project, now or time.time(), None))
    return lines, counts


def read_start(project: str, now: float, session_id: str | None,
               conn: sqlite3.Connection) -> tuple[str | None, list[Line], dict[str, int]]:
    """On the reader's thread, every read of a start block in one trip: the session's block if it was frozen
    (`session_id`), else the lines a new one shows and the project's counts by kind (`start_lines`)."""
    if session_id is not None:
        row = conn.execute("SELECT start_block FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is not None and row[0] is not None:
            return row[0], [], {}
    # `project = ?` (never `OR scope = 'user'`, which defeats every index): user-scope memories live in project
    # "user" and are read with a second, equally indexed query.
    projects = (project, "user") if project != "user" else (project,)
    base = ("FROM memories WHERE project = ? AND archived_at IS NULL AND superseded_by IS NULL"
            " AND (expires IS NULL OR expires > ?)")
    # The covering (project, kind, archived_at) index answers this without the table, in kind order per project.
    counts: dict[str, int] = {}
    for kind, n in conn.execute(" UNION ALL ".join(
            "SELECT kind, count(*) FROM memories WHERE project = ? AND archived_at IS NULL"
            " AND kind NOT IN ('observation', 'evidence') GROUP BY kind" for _ in projects), projects):
        counts[kind] = counts.get(kind, 0) + n
    # One subquery per kind and project walks the (project, kind, importance, updated) index and stops at 12 rows
    # (a single `kind IN (...)` query would sort every memory of those kinds: hundreds of ms at 100k memories);
    # all of them in one statement.
    parts = [(kind, name) for _group, kinds in START_GROUPS for kind in kinds for name in projects]
    # Each kind is written into the statement, not bound: a `kind = ?` compared against a partial index on
    # `kind = 'evidence'` (m010) makes SQLite prepare the whole statement again on every run (0.9 ms at 22
    # subqueries, against 0.02 ms from its cache). The kinds are START_GROUPS' own names, never user text.
    sql = " UNION ALL ".join(
        f"SELECT * FROM (SELECT * {base} AND kind = '{_sql_name(kind)}'"
        " ORDER BY importance DESC, updated DESC, id DESC LIMIT 12)" for kind, _ in parts)
    by_kind: dict[str, list[Any]] = {}
    for row in conn.execute(sql, [p for _, name in parts for p in (name, now)]):
        by_kind.setdefault(row["kind"], []).append(row)
    # What the user asked for in the project's latest observed sessions (the session starting now, and any too short
    # to have been observed, have nothing to show), in their own words (prompts, the words given with a rejection,
    # notes on an answer; what corrects or qualifies the agent first): read through those few sessions' own rows, so
    # the store's size does not matter.
    asks = conn.execute(
        "SELECT m.* FROM (SELECT id FROM sessions WHERE project = ? AND EXISTS (SELECT 1 FROM memories o"
        " WHERE o.session_id = sessions.id AND o.kind = 'observation') ORDER BY last_seen DESC LIMIT ?) s"
        " JOIN memories m ON m.session_id = s.id WHERE m.kind = 'observation' AND m.archived_at IS NULL"
        " AND m.superseded_by IS NULL AND json_extract(m.meta, '$.by') = 'user'"
        " AND json_extract(m.meta, '$.type') = 'goal'"
        " ORDER BY json_extract(m.meta, '$.steers') IS NULL, m.created DESC, m.id DESC LIMIT ?",
        (project, ASK_SESSIONS, ASK_LINES)).fetchall()
    lines: list[Line] = []
    for group, kinds in START_GROUPS:
        if group == "asks":
            lines.extend(line_of(row) for row in asks)
            continue
        rows = [row for kind in kinds for row in by_kind.get(kind, [])]
        rows.sort(key=lambda r: (-r["importance"], -r["updated"], -r["id"]))
        for row in rows[:12]:
            if row["kind"] == "task" and json.loads(row["meta"] or "{}").get("state", "draft") not in OPEN_STATES:
                continue
            if row["kind"] == "digest":
                # The digest is many lines folded into one memory; one line here points at it.
                lines.append(Line(row["id"], "digest", row["created"], row["text"].split("\n", 1)[0]))
                continue
            lines.append(line_of(row))
    return None, without_contradicted(conn, lines), counts


def without_contradicted(conn: sqlite3.Connection, lines: list[Line]) -> list[Line]:
    """The lines minus each one a newer live memory contradicts (a `contradicts` edge, either way round): the start
    block never shows a rule next to the rule that replaced it."""
    ids = [line.id for line in lines]
    if not ids:
        return lines
    rows = conn.execute(
        "SELECT e.src_id, e.dst_id, a.created, b.created FROM edges e"
        " JOIN memories a ON a.id = e.src_id JOIN memories b ON b.id = e.dst_id"
        " WHERE e.type = 'contradicts' AND e.src_type = 'memory' AND e.dst_type = 'memory'"
        " AND a.archived_at IS NULL AND b.archived_at IS NULL"
        " AND (e.src_id IN (SELECT value FROM json_each(?)) OR e.dst_id IN (SELECT value FROM json_each(?)))",
        [json.dumps(ids), json.dumps(ids)]).fetchall()
    older = {dst if (src_created, src) > (dst_created, dst) else src for src, dst, src_created, dst_created in rows}
    return [line for line in lines if line.id not in older]


async def session_lines(store: Store, session_id: str, project: str, char_budget: int) -> list[Line]:
    """After compaction: the session's own observations and captures, newest last, then the digest."""
    rows = await store.fetchall(
        "SELECT * FROM memories WHERE session_id = ? AND archived_at IS NULL ORDER BY created, id", (session_id,))
    lines = [line_of(r) for r in rows]
    digest = await store.fetchall(
        "SELECT * FROM memories WHERE project = ? AND kind = 'digest' AND archived_at IS NULL"
        " ORDER BY updated DESC LIMIT 1", (project,))
    for row in digest:
        lines.extend(Line(row["id"], "digest", row["created"], part) for part in row["text"].splitlines() if part)
    # Keep the newest that fit.
    kept: list[Line] = []
    used = 0
    for line in reversed(lines):
        used += len(line.text) + 20
        if used > char_budget:
            break
        kept.append(line)
    return list(reversed(kept))
