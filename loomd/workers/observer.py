"""The observer: a session's unobserved events -> observations and evidence passages, one chunk per transaction.

Due when a session has `observe_after_tokens` of unobserved events, when it ended, compacted or went quiet
(`observe_idle_s` without a new event), or when asked. The watermark `observer:<session>` is the last event id
observed and moves only in the transaction that commits that chunk's observations.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, replace

import aiosqlite

from loomd.errors import ModelError
from loomd.redact import redact_text
from loomd.store.derived import Mentions, mentioned, write_derived
from loomd.store.memories import insert_memory, supersede
from loomd.workers.base import (
    RunReport,
    RunRequest,
    WatermarkMoved,
    WorkerContext,
    get_int_checkpoint,
    progress,
    set_checkpoint,
    write_observation,
)
from loomd.workers.evidence import EVIDENCE_IMPORTANCE, Evidence, evidence_of
from loomd.workers.model import ModelClient, ModelDistiller
from loomd.workers.rules import observe
from loomd.workers.steps import EVENT_COLUMNS, EventRow, Observation, SourceEvent, to_steps

log = logging.getLogger(__name__)

CHUNK_EVENTS = 25
PASSAGES_PER_WRITE = 8  # a chunk's evidence passages per transaction (~0.4 ms each on 2 CPUs, with their entities)
CONTEXT_EVENTS = 200


async def supersede_errors(db: aiosqlite.Connection, session_id: str, failed_events: list[int], fix_id: int) -> int:
    """The session's error observations about the failure a later step fixed (they cite its events) are out of
    date: superseded by the fix, kept, and linked (`supersedes`), so the start block drops them and search ranks
    them below their successor."""
    marks = ",".join("?" * len(failed_events))
    rows = await db.execute_fetchall(
        "SELECT id FROM memories WHERE session_id = ? AND kind = 'observation' AND superseded_by IS NULL"
        " AND json_extract(meta, '$.type') = 'error' AND id IN (SELECT memory_id FROM memory_sources"
        f" WHERE event_id IN ({marks}))", (session_id, *failed_events))
    return len(await supersede(db, fix_id, [row[0] for row in rows]))


def distil_rows(rows: list[EventRow], context: list[EventRow], final: bool,
                observations: list[Observation] | None) -> tuple[list[Observation], list[Evidence], Mentions]:
    """`distil` of events as read (run in the offload process): their payloads are parsed there too, the JSON of up
    to CONTEXT_EVENTS + CHUNK_EVENTS events a chunk, which on the event loop was a millisecond and more of a chunk's
    CPU at the daemon's priority, and sent there as parsed objects, costlier to pickle than their text."""
    return distil([SourceEvent.from_row(r) for r in rows], [SourceEvent.from_row(r) for r in context], final,
                  observations)


def distil(events: list[SourceEvent], context: list[SourceEvent], final: bool,
           observations: list[Observation] | None) -> tuple[list[Observation], list[Evidence], Mentions]:
    """A chunk's text work, pure (run in the offload process): the rules' observations unless the model gave them,
    the evidence passages, their text and context already redacted (`insert_memory(redacted=True)`), and the
    entities each of those texts mentions (`derive` links them without extracting them again on the loop)."""
    if observations is None:
        observations = observe(events, context, final=final)
    steps = to_steps([*context, *events], ended=final)
    # A call the session ended on is written once its end is known, even when an earlier chunk held it (the same
    # passage written again only bumps its row).
    new = {e.id for e in events} | {step.ids[0] for step in steps if step.unanswered}
    evidence = [replace(item, text=redact_text(item.text), context=redact_text(item.context))
                for item in evidence_of(steps, new)]
    texts = [o.text for o in observations] + [e.text for e in evidence]
    return observations, evidence, {text: mentioned(text) for text in texts}


def watermark_name(session_id: str) -> str:
    return f"observer:{session_id}"


def new_ids(written: list[tuple[int, bool]]) -> list[int]:
    """The ids `insert_memory` wrote new, of its (id, new) pairs."""
    return [memory_id for memory_id, is_new in written if is_new]


@dataclass
class Chunk:
    """A chunk's output, worked out before any transaction, and how it is written: its evidence passages in parts
    of PASSAGES_PER_WRITE, then its observations with the watermark (`parts`). Each part awaits only `db`
    (`store.trip` runs it on the writer's thread) and commits on its own, so the writer is handed on
    between them; a live hook's commit then waits behind one part, not a whole chunk (30-120 ms after an import).

    A crash between the parts loses nothing and doubles nothing: each passage part commits its passages with what
    is derived from them; the watermark has not moved, so the chunk is observed again, and its passages, found by
    their text, only bump their rows (`insert_memory`); its observations and the watermark commit together."""

    session_id: str
    project: str
    agent: str | None
    origin: str
    watermark: int  # the watermark the chunk was read from
    last_event: int  # the watermark once it is written
    observations: list[Observation]
    evidence: list[Evidence]
    mentions: Mentions
    derive: bool  # write what is derived from the texts (not in a dry run)
    report: RunReport
    events: int

    def parts(self) -> list[Callable[[aiosqlite.Connection], Awaitable[list[tuple[int, bool]]]]]:
        """The chunk's transactions in order, each returning the (id, new) of the memories it wrote; the last one
        writes the observations and moves the watermark."""
        return [*(functools.partial(self.write_passages, self.evidence[start : start + PASSAGES_PER_WRITE])
                  for start in range(0, len(self.evidence), PASSAGES_PER_WRITE)), self.write_observations]

    async def _check(self, db: aiosqlite.Connection) -> None:
        if await get_int_checkpoint(db, watermark_name(self.session_id)) != self.watermark:
            raise WatermarkMoved(f"session {self.session_id}: the observer watermark moved during this run")

    async def write_passages(self, items: list[Evidence], db: aiosqlite.Connection) -> list[tuple[int, bool]]:
        await self._check(db)
        written = [await insert_memory(
            db, kind="evidence", text=item.text, project=self.project, scope="session", session_id=self.session_id,
            agent=self.agent, importance=EVIDENCE_IMPORTANCE, created=item.ts, origin="evidence",
            sources=item.sources, meta=item.meta(), context=item.context, redacted=True) for item in items]
        new = new_ids(written)
        if new and self.derive:
            await write_derived(db, new, self.mentions)
        return written

    async def write_observations(self, db: aiosqlite.Connection) -> list[tuple[int, bool]]:
        await self._check(db)
        written: list[tuple[int, bool]] = []
        for obs in self.observations:
            memory_id, is_new = await write_observation(db, obs, project=self.project, session_id=self.session_id,
                                                        agent=self.agent, origin=self.origin)
            if is_new and obs.meta.get("resolves"):
                await supersede_errors(db, self.session_id, obs.meta["resolves"], memory_id)
            written.append((memory_id, is_new))
        new = new_ids(written)
        if new and self.derive:
            await write_derived(db, new, self.mentions)
        await set_checkpoint(db, watermark_name(self.session_id), str(self.last_event))
        await progress(db, self.report, self.events, len(self.observations))  # reads only its job id
        return written


class Observer:
    name = "observer"

    def __init__(self) -> None:
        self.failed: set[str] = set()  # sessions whose observation raised (their traceback is logged once)

    async def _write(self, ctx: WorkerContext, chunk: Chunk, dry_run: bool) -> list[list[tuple[int, bool]]]:
        """The chunk's parts, each a transaction of its own in one trip to the writer's thread; a dry run's in one
        transaction, rolled back, so that each part sees what the ones before it would have written."""
        if dry_run:
            async def every_part(db: aiosqlite.Connection) -> list[list[tuple[int, bool]]]:
                return [await part(db) for part in chunk.parts()]

            return await ctx.commit(dry_run, every_part)
        out: list[list[tuple[int, bool]]] = []
        for part in chunk.parts():
            # The observer's are most of a catch-up's transactions (3.6 ms at the median after an import, 8 at p90),
            # and only statements: they give way to a hook's commit.
            written = await ctx.commit(dry_run, part, yields=True)
            if new := new_ids(written):
                ctx.memories.mark_stale(new)  # for the back-fill
            out.append(written)
        return out

    async def due_sessions(self, ctx: WorkerContext, woken: frozenset[str]) -> list[str]:
        """The sessions with events past their watermark that are due: woken, ended, quiet for observe_idle_s, or
        with observe_after_tokens pending. Every run asks this first, so it reads a session's index entries, not its
        events: whether any is pending and its last one (by id, as received), then pending tokens only for the few
        sessions that need the count (live, unended ones). Summing every session's pending tokens and taking the max
        of every event's arrival read each event of the store: 16 ms a run at 27k events, in the CPU the hook that
        came then waited for (0.25 ms now)."""
        cfg = ctx.config()
        idle_before = time.time() - cfg.observe_idle_s
        rows = await ctx.store.fetchall(
            "SELECT s.id, s.ended, coalesce(CAST(c.value AS INTEGER), 0) AS wm,"
            " EXISTS (SELECT 1 FROM events e WHERE e.session_id = s.id"
            "   AND e.id > coalesce(CAST(c.value AS INTEGER), 0)) AS pending,"
            " (SELECT e.received FROM events e WHERE e.session_id = s.id ORDER BY e.id DESC LIMIT 1) AS last_received"
            " FROM sessions s LEFT JOIN checkpoints c ON c.name = 'observer:' || s.id", background=True)
        due: list[str] = []
        counted: list[tuple[str, int]] = []  # pending, but due only with enough tokens
        for row in rows:
            if not row["pending"]:
                continue
            quiet = row["last_received"] is not None and row["last_received"] < idle_before
            if row["id"] in woken or row["ended"] is not None or quiet:
                due.append(str(row["id"]))
            else:
                counted.append((str(row["id"]), int(row["wm"])))
        if counted:
            tokens = await ctx.store.fetchall(
                "SELECT j.value ->> 0, (SELECT coalesce(sum(e.tokens), 0) FROM events e"
                "   WHERE e.session_id = j.value ->> 0 AND e.id > j.value ->> 1)"
                " FROM json_each(?) j", (json.dumps(counted),), background=True)
            due += [str(sid) for sid, pending in tokens if pending >= cfg.observe_after_tokens]
        chosen = set(due)
        return [sid for sid in (str(row["id"]) for row in rows) if sid in chosen]  # in the sessions' order

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None:
        """The due sessions' chunks, written in order, each chunk's reads and text work done while the one before it
        is written (`Ahead`): the text work runs in the offload process and the writes on the writer's thread, so
        a run takes about the longer of the two, not their sum. What is written, and in which order, is the same."""
        sessions = [req.session_id] if req.session_id else await self.due_sessions(ctx, req.keys)
        ahead = Ahead(self, ctx, req, report, self._model(ctx, report), sessions)
        upcoming = asyncio.ensure_future(ahead.next())
        wrote = 0  # new observations of the session being written
        try:
            chunk = await upcoming
            while chunk is not None:
                upcoming = asyncio.ensure_future(ahead.next())
                try:
                    wrote += await self._commit(ctx, chunk, req)
                except WatermarkMoved:
                    raise
                except Exception as exc:  # noqa: BLE001 - as in `Ahead.next`: the session is skipped, the run goes on
                    self._skip(chunk.session_id, exc, req, report)
                    following = await upcoming
                    if following is not None and following.session_id == chunk.session_id:
                        await ahead.drop(chunk.session_id)  # it was read ahead of a chunk that is not written
                        following = await ahead.next()
                    chunk, wrote = following, 0
                    continue
                following = await upcoming
                if following is None or following.session_id != chunk.session_id:
                    if wrote and not req.dry_run:
                        ctx.wake("reflector", chunk.project)  # the session is done and its observations committed
                    wrote = 0
                chunk = following
        finally:
            if not upcoming.done():
                upcoming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await upcoming
            await ahead.close()

    def _skip(self, session_id: str, exc: Exception, req: RunRequest, report: RunReport) -> None:
        """One session's failure: raised when it is the one session asked for, else logged and noted, and the run
        goes on (one session's bad event must not stall every other session)."""
        if req.session_id:
            raise exc
        # Its watermark stays, so a fixed daemon observes it later; the traceback once per daemon run.
        log.error("observer: session %s skipped: %s: %s", session_id, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__) if session_id not in self.failed else None)
        self.failed.add(session_id)
        report.note("sessions_failed", f"{session_id}: {type(exc).__name__}: {exc}"[:300])

    def _model(self, ctx: WorkerContext, report: RunReport) -> ModelDistiller | None:
        cfg = ctx.config()
        try:
            client = ModelClient.from_config(cfg)
        except ModelError as exc:
            report.detail["model"] = f"misconfigured, rules used: {exc}"
            return None
        return None if client is None else ModelDistiller(client, cfg.model_daily_tokens, ctx.store)

    async def _final(self, ctx: WorkerContext, session_id: str, req: RunRequest) -> bool:
        if req.final is not None:
            return req.final
        row = await ctx.store.fetchone(
            "SELECT s.ended, (SELECT max(received) FROM events WHERE session_id = s.id) FROM sessions s"
            " WHERE s.id = ?", (session_id,), background=True)
        if row is None:
            return False
        return row[0] is not None or (row[1] is not None and row[1] < time.time() - ctx.config().observe_idle_s)

    async def _window(self, ctx: WorkerContext, session_id: str, watermark: int) -> list[EventRow]:
        """The session's last CONTEXT_EVENTS events up to `watermark`, oldest first: a chunk's context."""
        rows = await ctx.store.fetchall(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ? AND id <= ? ORDER BY id DESC LIMIT ?",
            (session_id, watermark, CONTEXT_EVENTS), background=True)
        return [EventRow._make(r) for r in reversed(rows)]

    async def _context(self, ctx: WorkerContext, session_id: str, window: list[EventRow],
                       events: list[EventRow]) -> list[EventRow]:
        """A chunk's context, in event order: the `window` of earlier events (the history of failures), and the calls
        of the chunk's tool results that are older than it (pairing a result with its call)."""
        wanted = {f"tu:{e.tool_use_id}" for e in events if e.kind == "tool_result" and e.tool_use_id}
        if not wanted:
            return window
        have = {e.id for e in window} | {e.id for e in events}
        marks = ",".join("?" * len(wanted))
        rows = await ctx.store.fetchall(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ? AND dedup IN ({marks})",
            (session_id, *sorted(wanted)), background=True)
        older = [EventRow._make(r) for r in rows if r["id"] not in have]
        return sorted([*window, *older], key=lambda e: e.id) if older else window

    async def chunks(self, ctx: WorkerContext, session_id: str, req: RunRequest, report: RunReport,
                     model: ModelDistiller | None) -> AsyncGenerator[Chunk, None]:
        """The session's unobserved events, chunk after chunk, each read and distilled (nothing written): the
        watermark each one is read from is the one the chunk before it moves to once written."""
        session = await ctx.store.fetchone("SELECT project, agent FROM sessions WHERE id = ?", (session_id,),
                                           background=True)
        if session is None:
            return
        project, agent = session["project"], session["agent"]
        final = await self._final(ctx, session_id, req)
        watermark = await get_int_checkpoint(ctx.store.background, watermark_name(session_id))
        window: list[EventRow] | None = None
        while True:
            events = [EventRow._make(r) for r in await ctx.store.fetchall(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ? AND id > ? ORDER BY id LIMIT ?",
                (session_id, watermark, CHUNK_EVENTS), background=True)]
            if not events:
                return
            last_chunk = len(events) < CHUNK_EVENTS
            # A session's first line may carry no cwd (a transcript `summary`): its events know the project better.
            known = Counter(e.project for e in events if e.project and e.project != "unknown")
            project = known.most_common(1)[0][0] if known else project
            # Read once a session: the next chunk's window is this one's and this chunk's events, the last
            # CONTEXT_EVENTS of them (each chunk read it again, CONTEXT_EVENTS rows for CHUNK_EVENTS new ones).
            if window is None:
                window = await self._window(ctx, session_id, watermark)
            context = await self._context(ctx, session_id, window, events)
            observations, origin = None, "observer"
            if model is not None:
                observations = await model.observe([SourceEvent.from_row(e) for e in events],
                                                   [SourceEvent.from_row(e) for e in context])
                if observations is None:
                    report.note("model_fallback", model.last_error)
                else:
                    origin = "observer:model"
            if ctx.offload is None:
                kept, evidence, mentions = distil_rows(events, context, final and last_chunk, observations)
            else:  # the CPU-heavy part, in the offload process; if it dies, this chunk waits for the next run
                kept, evidence, mentions = await ctx.offload.call("work", distil_rows, events, context,
                                                                  final and last_chunk, observations)
            yield Chunk(session_id, project, agent, origin, watermark, events[-1].id, kept, evidence, mentions,
                        derive=not req.dry_run, report=report, events=len(events))
            watermark = events[-1].id
            window = [*window, *events][-CONTEXT_EVENTS:]
            if last_chunk:
                return

    async def _commit(self, ctx: WorkerContext, chunk: Chunk, req: RunRequest) -> int:
        """Write one chunk and report it; the observations it wrote new."""
        report = chunk.report
        *passage_parts, written = await self._write(ctx, chunk, req.dry_run)
        passages = [memory_id for part in passage_parts for memory_id in new_ids(part)]
        for obs, (memory_id, is_new) in zip(chunk.observations, written, strict=True):
            report.wrote("observation" if is_new else "observation_seen_again", id=memory_id,
                         session_id=chunk.session_id, type=obs.type, text=obs.text, sources=obs.sources)
        report.detail["evidence"] = report.detail.get("evidence", 0) + len(passages)
        report.items_in += chunk.events
        report.note("sessions", chunk.session_id)
        return len(new_ids(written))


class Ahead:
    """A run's chunks in order, session after session (`Observer.chunks`), read and distilled one ahead of the
    writes. A session whose reads or text work fail is skipped (`Observer._skip`), as is the rest of one whose
    chunk failed to write (`drop`)."""

    def __init__(self, observer: Observer, ctx: WorkerContext, req: RunRequest, report: RunReport,
                 model: ModelDistiller | None, sessions: list[str]) -> None:
        self.observer, self.ctx, self.req, self.report, self.model = observer, ctx, req, report, model
        self.sessions = iter(sessions)
        self.current: tuple[str, AsyncGenerator[Chunk, None]] | None = None

    async def next(self) -> Chunk | None:
        while True:
            if self.current is None:
                session_id = next(self.sessions, None)
                if session_id is None:
                    return None
                self.current = (session_id, self.observer.chunks(self.ctx, session_id, self.req, self.report,
                                                                 self.model))
            session_id, chunks = self.current
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                self.current = None
                continue
            except WatermarkMoved:
                raise
            except Exception as exc:  # noqa: BLE001 - one session's bad event must not stall every other session
                self.current = None
                self.observer._skip(session_id, exc, self.req, self.report)
                continue
            return chunk

    async def drop(self, session_id: str) -> None:
        """The rest of this session is not read on."""
        if self.current is not None and self.current[0] == session_id:
            await self.close()

    async def close(self) -> None:
        if self.current is not None:
            _, chunks = self.current
            self.current = None
            await chunks.aclose()
