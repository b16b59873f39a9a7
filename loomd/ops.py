"""The socket ops: one `handle_<op>` coroutine each, validating its arguments and returning plain data."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomd import __version__
from loomd.config import Config
from loomd.context.planner import Planner, StartRead
from loomd.errors import BadRequest, Busy, SharedError
from loomd.ingest.events import INGEST_ARGS, LATEST_TS, Event, sent_at
from loomd.ingest.history import HistoryImporter
from loomd.ingest.journal import Entry, HookJournal
from loomd.ingest.project import project_of
from loomd.ingest.writer import EventWriter, LiveTraffic
from loomd.protocol import REQUIRED, ArgSpec, takes
from loomd.search import browse
from loomd.search.floor import Floor, apply_floor, top_signal
from loomd.search.retrieval import SearchContext, search_hits
from loomd.search.views import event_view, evidence, timeline
from loomd.store import review, tasks
from loomd.store.db import Store
from loomd.store.memories import SCOPES, MemoryWriter, fetch_memories, insert_memory, set_archived
from loomd.store.projects import list_projects
from loomd.store.purge import describe, purge, select
from loomd.team.search import SharedSearch
from loomd.team.sync import SyncEngine
from loomd.workers.model import BUDGET_CHECKPOINT
from loomd.workers.scheduler import Scheduler


def _page(a: dict[str, Any], top: int = 500) -> None:
    if not (1 <= a["limit"] <= top and a["offset"] >= 0):
        raise BadRequest(f"'limit' must be 1-{top} and 'offset' at least 0")


def _after_settled(journal: HookJournal, handler: Callable[[dict[str, Any]], Awaitable[Any]],
                   ) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    async def settled_first(a: dict[str, Any]) -> Any:
        await journal.settled()
        return await handler(a)

    return settled_first


def _ids(value: Any) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest("'id' must be an integer or a non-empty list of integers")
    return ids


@dataclass
class Services:
    """What the ops work with: the narrow services the daemon wires, never the daemon itself."""

    config: Callable[[], Config]
    store: Store
    writer: EventWriter
    memories: MemoryWriter
    planner: Planner
    search: Callable[[], SearchContext]
    scheduler: Scheduler
    # The running daemon's own facts for `status`: pid, uptime, socket, spool backlog and spool health, in-flight
    # requests, embedder and tailer state, and the health of each background task.
    runtime: Callable[[], dict[str, Any]]
    history: HistoryImporter  # `loom import`: the scan of existing Claude Code / Codex history, one file at a time
    journal: HookJournal | None = None  # hooks answered once journaled, committed after (None: after their commit)
    sync: SyncEngine | None = None  # shared memory on PostgreSQL (loomd/team/)
    shared_search: SharedSearch | None = None


class Ops:
    """Every `handle_<op>`, over the services."""

    def __init__(self, services: Services) -> None:
        self.s = services
        # A hook that comes among others (in flight, or just before it) skips the journal (`HookJournal.append`).
        self.hooks_in_flight = 0
        self.hook_arrivals = LiveTraffic()

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        found = {name[len("handle_"):]: getattr(self, name) for name in dir(self) if name.startswith("handle_")}
        journal = self.s.journal
        if journal is None:
            return found
        # Every op but a hook and a ping first waits for the commits of the hooks answered already: a script that
        # sends a hook and then asks for its events or counts finds them, as when a hook's answer waited for its
        # commit. (A commit held up fails within `busy_timeout_ms`, and the wait with it.)
        return {op: handler if op in ("hook", "ping") else _after_settled(journal, handler)
                for op, handler in found.items()}

    @classmethod
    def specs(cls) -> dict[str, ArgSpec]:
        """Every op and the arguments it takes (name -> (type, default)): the protocol describing itself."""
        return {name[len("handle_"):]: getattr(cls, name).spec for name in dir(cls) if name.startswith("handle_")}

    @takes({})
    async def handle_ping(self, a: dict[str, Any]) -> dict[str, Any]:
        return {"pong": True, "version": __version__, "time": time.time()}

    @takes({})
    async def handle_status(self, a: dict[str, Any]) -> dict[str, Any]:
        db = self.s.config().paths.db
        size = sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists())
        run = self.s.runtime()
        return {
            "version": __version__, "pid": run["pid"], "uptime_s": run["uptime_s"],
            "socket": run["socket"], "db": str(db), "db_bytes": size,
            "counts": await self._counts(), "spool_backlog": run["spool_backlog"],
            "queue_depth": self.s.writer.depth, "inflight": run["inflight"],
            "embedder": run["embedder"], "versions": await self.s.store.versions(),
            "tailer": run["tailer"], "tailers": run["tailer"], "spool": run["spool"], "tasks": run["tasks"],
            "storage": self._storage(db), "offload": run["offload"], "import": run["import"],
            "journal": run["journal"],
            "writer": {"waiting": self.s.store.write_waiting, "holds": self.s.store.holds.summary(),
                       "gave_way": self.s.store.gave_way,
                       "paced": {"rests": self.s.writer.live.rests, "rested_s": round(self.s.writer.live.rested_s, 3)}},
            "shared": await self.s.sync.status() if self.s.sync is not None else {"configured": False},
            "service": run["service"], "memory": run["memory"], "time_slice_ns": run["time_slice_ns"],
            "scheduling_group": run["scheduling_group"], "threads": run["threads"],
        }

    def _storage(self, db: Path) -> dict[str, Any]:
        """What could not be stored (never silent), and the free space that is usually why."""
        losses = self.s.writer.losses
        try:
            free: int | None = shutil.disk_usage(db.parent).free
        except OSError:
            free = None
        return {"commit_failed": losses.failed, "busy_refused": losses.busy, "recent_errors": list(losses.recent),
                "free_bytes": free, "parsed_in_child": self.s.writer.parser.in_process,
                "commits": self.s.writer.commits, "events_committed": self.s.writer.committed,
                "log_syncs": self.s.store.wal.syncs,
                "log_checkpoints": {**self.s.store.checkpoints.status(), "restarts": self.s.store.restarts}}

    async def _counts(self) -> dict[str, int]:
        row = await self.s.store.fetchone(
            "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM sessions),"
            " (SELECT count(*) FROM memories WHERE archived_at IS NULL),"
            " (SELECT count(*) FROM memories WHERE archived_at IS NOT NULL)"
        )
        assert row is not None
        return {"events": row[0], "sessions": row[1], "memories": row[2], "archived": row[3]}

    @takes({"project": (str, None)})
    async def handle_stats(self, a: dict[str, Any]) -> dict[str, Any]:
        where, params = ("WHERE project = ?", [a["project"]]) if a["project"] else ("", [])
        kinds = await self.s.store.fetchall(
            f"SELECT kind, sum(archived_at IS NULL), sum(archived_at IS NOT NULL) FROM memories {where}"
            " GROUP BY kind ORDER BY kind", params)
        events = await self.s.store.fetchall(
            f"SELECT agent, kind, count(*) FROM events {where} GROUP BY agent, kind ORDER BY agent, kind", params)
        return {
            "counts": await self._counts(),
            "memories": {r[0]: {"active": r[1], "archived": r[2]} for r in kinds},
            "events": [{"agent": r[0], "kind": r[1], "count": r[2]} for r in events],
        }

    @takes({})
    async def handle_config(self, a: dict[str, Any]) -> dict[str, Any]:
        return self.s.config().public()

    @takes({
        "agent": (str, "auto"), "event": (str, ""), "raw": ((bytes, str), REQUIRED), "eid": (str, None),
        "context": (bool, False), "deadline_ms": (int, None), "sent_at": (int, None),
    })
    async def handle_hook(self, a: dict[str, Any]) -> dict[str, Any]:
        """A raw hook event from the shim: store it durably, then answer with what to print (maybe nothing)."""
        self.hooks_in_flight += 1
        self.hook_arrivals.arrived()
        try:
            return await self._hook(a)
        finally:
            self.hooks_in_flight -= 1

    async def _hook(self, a: dict[str, Any]) -> dict[str, Any]:
        event = await self.s.writer.parser.hook(a["agent"], a["event"], a["raw"], a["eid"],
                                                max_chars=self.s.config().max_tool_output_chars,
                                                now=sent_at(a["sent_at"]))
        start = self.s.planner.start_read(event) if a["context"] else None
        if self.s.journal is not None:
            if not event.project:  # resolved before the record is written: a replay commits the same project
                event.project = await project_of(event.cwd)
            # Together: another hook is in flight (waiting for a commit, or its context), or came just before this
            # one (handled at once, each in one turn of the loop, as the hooks of many agents or of a replay are).
            together = self.hooks_in_flight > 1 or not self.hook_arrivals.alone
            entry = self.s.journal.append(event, together=together)
            if entry is not None:
                return await self._journaled(a, event, entry, start)
        # The context is read while the event commits; the reply (the ack) waits for the commit. A hook with nothing to
        # read is committed right here when it came alone (`EventWriter.enqueue`, `here`), and so is a new session's,
        # whose start block is read inside that commit.
        reads = a["context"] and self.s.planner.reads(event)
        written = await self.s.writer.enqueue([event], here=not reads, also=start)
        try:
            if a["context"]:
                stdout = await self.s.planner.for_hook(
                    event, a["deadline_ms"] or self.s.config().context_deadline_ms, written, start)
            else:
                stdout = await self.s.planner.after_event(event, written)
        finally:
            await asyncio.shield(written)
        return {"stored": int(event.stored), "stdout": stdout}

    async def _journaled(self, a: dict[str, Any], event: Event, entry: Entry, start: StartRead | None,
                         ) -> dict[str, Any]:
        """A hook the journal holds: answered once its record is synced, committed after (`ingest/journal.py`).
        `stored` is 1, "durable": whether it was new is known at its commit.

        A hook with nothing to read meanwhile queues its commit only after the sync, which runs right here
        (`sync_here`): the writer's task, woken by the commit, would otherwise run it (on the loop's thread) before
        this request's reply is written. A new session's start block is read here, on the loop's thread
        (`StartRead.read_here`). A prompt that asks memory something, and a compaction's block, read on the reader's
        thread while the record is synced on another (`sync_soon`): their marks need the commit's future, and the
        first read is queued before the sync runs."""
        journal = self.s.journal
        assert journal is not None
        deadline = a["deadline_ms"] or self.s.config().context_deadline_ms
        if a["context"] and self.s.planner.reads(event):
            written = await journal.commit(entry, [event])
            reading = asyncio.ensure_future(self.s.planner.for_hook(event, deadline, written))
            journal.sync_soon()
            try:
                await self._journal_synced(entry, event, written)
                return {"stored": 1, "stdout": await reading}
            finally:
                if not reading.done():
                    reading.cancel()
        if start is not None:
            start.read_here(self.s.store)
        journal.sync_here()
        written = await self._journal_synced(entry, event, None)
        if a["context"]:
            return {"stored": 1, "stdout": await self.s.planner.for_hook(event, deadline, written, start)}
        return {"stored": 1, "stdout": await self.s.planner.after_event(event, written)}

    async def _journal_synced(self, entry: Entry, event: Event, written: asyncio.Future[list[Event]] | None,
                              ) -> asyncio.Future[list[Event]]:
        """Wait for the entry's sync, then (unless `written`) queue its commit; if the journal failed the sync (it
        says so once), wait for that commit instead: the event is durable through the store."""
        journal = self.s.journal
        assert journal is not None
        try:
            await entry.synced
        except OSError:
            written = written or await journal.commit(entry, [event])
            await asyncio.shield(written)
        return written or await journal.commit(entry, [event])

    @takes({"sources": (list, ["claude", "codex"]), "claude_dir": (str, None), "codex_dir": (str, None),
            "since": (float, None), "project": (str, None)})
    async def handle_import_scan(self, a: dict[str, Any]) -> dict[str, Any]:
        """What `loom import` would read: each transcript file found, and a summary; reads and writes nothing else."""
        if not all(isinstance(s, str) and s for s in a["sources"]):
            raise BadRequest("'sources' must be a list of 'claude', 'codex' or absolute paths")
        return await self.s.history.scan(a["sources"], claude_dir=a["claude_dir"], codex_dir=a["codex_dir"],
                                         since=a["since"], project=a["project"])

    @takes({"path": (str, REQUIRED), "force": (bool, False)})
    async def handle_import_file(self, a: dict[str, Any]) -> dict[str, Any]:
        """Import one transcript file through the tailer's parsers; a file imported before (unchanged) is skipped."""
        return await self.s.history.import_path(a["path"], force=a["force"])

    @takes(INGEST_ARGS)
    async def handle_ingest(self, a: dict[str, Any]) -> dict[str, Any]:
        """One event or a batch: raw hook bytes plus agent and event name, or already-normalised events."""
        events = await self.s.writer.submit_args(a, max_chars=self.s.config().max_tool_output_chars)
        return {"accepted": len(events), "stored": sum(e.stored for e in events),
                "ids": [e.id for e in events]}

    @takes({
        "text": (str, REQUIRED), "kind": (str, "fact"), "scope": (str, "project"), "tags": (list, []),
        "importance": (float, 0.7), "expires": (float, None), "ttl_days": (float, None), "cwd": (str, None),
        "project": (str, None), "session_id": (str, None), "created": (float, None),
    })
    async def handle_store(self, a: dict[str, Any]) -> dict[str, Any]:
        if a["scope"] not in SCOPES:
            raise BadRequest(f"unknown scope '{a['scope']}'; one of: {', '.join(SCOPES)}")
        if not all(isinstance(t, str) for t in a["tags"]):
            raise BadRequest("'tags' must be a list of strings")
        if not 0.0 <= a["importance"] <= 1.0:
            raise BadRequest("'importance' must be between 0 and 1")
        for name, top in (("created", LATEST_TS), ("expires", LATEST_TS), ("ttl_days", 365_000.0)):
            if a[name] is not None and not 0 <= a[name] <= top:
                raise BadRequest(f"'{name}' must be between 0 and {top:.0f}")
        project = a["project"] or ("user" if a["scope"] == "user" else await project_of(a["cwd"]))
        expires = a["expires"] or (time.time() + a["ttl_days"] * 86400 if a["ttl_days"] else None)
        async with self.s.memories.atomic() as db:
            memory_id, is_new = await insert_memory(
                db, kind=a["kind"], text=a["text"], project=project, scope=a["scope"], tags=a["tags"],
                importance=a["importance"], expires=expires, session_id=a["session_id"], origin="store",
                created=a["created"],
            )
            await self.s.memories.derive(db, [memory_id])
        return {"id": memory_id, "created": is_new, "project": project}

    @takes({
        "query": (str, REQUIRED), "limit": (int, 10), "mode": (str, "hybrid"), "project": (str, None),
        "cwd": (str, None), "scope": (str, None), "kind": ((str, list), None), "since": (float, None),
        "until": (float, None), "session_id": (str, None), "include_archived": (bool, False),
        "explain": (bool, False), "weights": (dict, None), "tuning": (dict, None), "floor": (bool, False),
    })
    async def handle_search(self, a: dict[str, Any]) -> dict[str, Any]:
        """Fused search; each item says its `why` (the top signal and its raw score). `floor`: drop the hits that
        are not about the query (search/floor.py), counted in `below_floor`. `scope: "shared"` asks the team's
        server instead of the local store (which already holds what was pulled)."""
        if not 1 <= a["limit"] <= 200:
            raise BadRequest("'limit' must be between 1 and 200")
        if a["project"] is None and a["cwd"]:
            a["project"] = await project_of(a["cwd"])
        a.pop("cwd")
        if a["scope"] == "shared":
            return await self._search_shared(a)
        floor, explain = a.pop("floor"), a.pop("explain")
        report: dict[str, Any] = {}
        hits = await search_hits(self.s.search(), **a, report=report)
        below = 0
        if floor:
            cfg = self.s.config()
            hits, below = apply_floor(hits, a["query"], Floor(cfg.search_min_cosine, cfg.search_min_terms))
        results = []
        for hit in hits:
            item = hit.as_dict(explain)
            top = top_signal(hit)
            item["why"] = {"signal": top[0], "score": round(top[1], 4)} if top else None
            results.append(item)
        reply: dict[str, Any] = {"results": results, "count": len(results), "project": a["project"]}
        if floor:
            reply["below_floor"] = below
        if explain or report.get("notes"):
            reply.update(report)
        return reply

    async def _search_shared(self, a: dict[str, Any]) -> dict[str, Any]:
        shared = self.s.shared_search
        if shared is None or self.s.sync is None or not self.s.sync.configured:
            raise SharedError("no shared server configured: set [shared] dsn in the config file or LOOMD_SHARED_DSN")
        vectors = self.s.search().vectors
        embedded = await vectors.embed_query(a["query"], a["project"]) if vectors is not None else None
        vector, model = embedded if embedded is not None else (None, None)
        return await shared.search(a["query"], vector, model, limit=a["limit"], project=a["project"], kind=a["kind"],
                                   include_archived=a["include_archived"])

    @takes({"remote": (bool, False)})
    async def handle_shared_status(self, a: dict[str, Any]) -> dict[str, Any]:
        """Sync health and lag (push queue and its age, last push and pull, last error); `remote`: ask the server
        too (our role, the rows it lets us see, the pull backlog)."""
        if self.s.sync is None:
            return {"configured": False}
        status = await self.s.sync.status()
        if a["remote"] and status["configured"]:
            try:
                status["server"] = await self.s.sync.remote_status()
            except SharedError as exc:  # the server down is what this op is asked about: said, not raised
                status["server"] = {"error": str(exc)}
        return status

    @takes({"push": (bool, True), "pull": (bool, True)})
    async def handle_shared_sync(self, a: dict[str, Any]) -> dict[str, Any]:
        """One sync cycle now (`loom shared push|pull --now`), whatever the backoff; waits for it."""
        if self.s.sync is None:
            raise SharedError("no shared server configured: set [shared] dsn in the config file or LOOMD_SHARED_DSN")
        return await self.s.sync.run(push=a["push"], pull=a["pull"], force=True)

    @takes({
        "id": (int, None), "entity": (str, None), "before": (int, 5), "after": (int, 5), "limit": (int, 20),
        "project": (str, None), "cwd": (str, None), "scope": (str, None), "kind": ((str, list), None),
        "since": (float, None), "until": (float, None), "session_id": (str, None),
        "include_archived": (bool, False),
    })
    async def handle_timeline(self, a: dict[str, Any]) -> dict[str, Any]:
        """Memories in time order around one memory (`id`) or naming an `entity`, else the newest."""
        if not (0 <= a["before"] <= 200 and 0 <= a["after"] <= 200 and 1 <= a["limit"] <= 500):
            raise BadRequest("'before' and 'after' must be 0-200, 'limit' 1-500")
        if a["project"] is None and a["cwd"] and a["id"] is None:
            a["project"] = await project_of(a["cwd"])
        a.pop("cwd")
        return await timeline(self.s.store, memory_id=a.pop("id"), **a)

    @takes({"id": ((int, list), REQUIRED), "max_chars": (int, 600), "limit": (int, 20)})
    async def handle_evidence(self, a: dict[str, Any]) -> dict[str, Any]:
        """A memory's source events with their text (cut at `max_chars`)."""
        if not (1 <= a["max_chars"] <= 20_000 and 1 <= a["limit"] <= 500):
            raise BadRequest("'max_chars' must be 1-20000 and 'limit' 1-500")
        return {"memories": await evidence(self.s.store, _ids(a["id"]), max_chars=a["max_chars"], limit=a["limit"])}

    @takes({"id": ((int, list), REQUIRED), "sources": (bool, True)})
    async def handle_detail(self, a: dict[str, Any]) -> dict[str, Any]:
        ids = _ids(a["id"])
        items = await fetch_memories(self.s.store, ids)
        if a["sources"]:
            for item in items:
                rows = await self.s.store.fetchall(
                    "SELECT e.id, e.kind, e.session_id, e.ts FROM memory_sources s JOIN events e ON e.id = s.event_id"
                    " WHERE s.memory_id = ? ORDER BY e.id LIMIT 50", (item["id"],))
                item["sources"] = [{"event_id": r[0], "kind": r[1], "session_id": r[2], "ts": r[3]} for r in rows]
        return {"memories": items}

    @takes({"id": ((int, list), REQUIRED), "reason": (str, "forget")})
    async def handle_forget(self, a: dict[str, Any]) -> dict[str, Any]:
        async with self.s.memories.atomic() as db:
            changed = await set_archived(db, _ids(a["id"]), True, a["reason"])
        return {"archived": changed}

    @takes({"id": ((int, list), None), "session_id": (str, None), "project": (str, None), "match": (str, None),
            "confirm": (bool, False)})
    async def handle_purge(self, a: dict[str, Any]) -> dict[str, Any]:
        """Remove text from the database file for good (store/purge.py). Without `confirm`: only what would go."""
        criteria = {"ids": _ids(a["id"]) if a["id"] is not None else [], "session_id": a["session_id"],
                    "project": a["project"], "match": a["match"]}
        if not a["confirm"]:
            reader = self.s.store.reader
            return {"purged": False, "plan": await describe(reader, await select(reader, **criteria))}
        return {"purged": True, **await purge(self.s.store, self.s.memories.gone, **criteria)}

    @takes({"id": ((int, list), REQUIRED)})
    async def handle_restore(self, a: dict[str, Any]) -> dict[str, Any]:
        async with self.s.memories.atomic() as db:
            changed = await set_archived(db, _ids(a["id"]), False)
        return {"restored": changed}

    @takes({"cwd": (str, None)})
    async def handle_projects(self, a: dict[str, Any]) -> dict[str, Any]:
        """Every project key: sessions, memories, evidence passages, archived, last folder and last activity; with
        `cwd`, also the key of that folder (`here`)."""
        reply: dict[str, Any] = {"projects": await list_projects(self.s.store)}
        if a["cwd"]:
            reply["here"] = await project_of(a["cwd"])
        return reply

    @takes({"limit": (int, 20), "session_id": (str, None), "after_id": (int, 0), "max_chars": (int, 300)})
    async def handle_events(self, a: dict[str, Any]) -> dict[str, Any]:
        """The newest raw events, each with its `text` as the workers read it (cut at `max_chars`)."""
        if not 1 <= a["max_chars"] <= 20_000:
            raise BadRequest("'max_chars' must be 1-20000")
        where, params = "WHERE id > ?", [a["after_id"]]
        if a["session_id"]:
            where += " AND session_id = ?"
            params.append(a["session_id"])
        rows = await self.s.store.fetchall(
            f"SELECT * FROM events {where} ORDER BY id DESC LIMIT ?", [*params, max(1, min(a["limit"], 500))])
        return {"events": [
            {"id": r["id"], "agent": r["agent"], "session_id": r["session_id"], "project": r["project"],
             "kind": r["kind"], "source": r["source"], "ts": r["ts"], "tool_name": r["tool_name"],
             "payload": r["payload"][:2000], "text": event_view(r, a["max_chars"])["text"]} for r in reversed(rows)
        ]}

    @takes({
        "kind": (str, "start"), "session_id": (str, None), "cwd": (str, None), "project": (str, None),
        "prompt": (str, None), "agent": (str, "claude"), "deadline_ms": (int, 2000),
    })
    async def handle_context(self, a: dict[str, Any]) -> dict[str, Any]:
        """The block a hook would inject: `start` (frozen per session), `compact`, or `prompt` recall."""
        project = a["project"] or await project_of(a["cwd"])
        planner = self.s.planner
        if a["kind"] == "start" and a["session_id"] is None:
            text, ids = await planner.preview_start(project, a["agent"])
            return {"text": text, "ids": ids, "project": project}
        if a["session_id"] is None:
            raise BadRequest(f"context kind '{a['kind']}' needs a session_id")
        await self._ensure_session(a["session_id"], a["agent"], project, a["cwd"])
        if a["kind"] == "start":
            coro = planner.start(a["session_id"], project, a["agent"])
        elif a["kind"] == "compact":
            coro = planner.compact(a["session_id"], project)
        elif a["kind"] == "prompt":
            if not a["prompt"]:
                raise BadRequest("context kind 'prompt' needs a prompt")
            coro = planner.recall(a["session_id"], project, a["prompt"])
        else:
            raise BadRequest(f"unknown context kind '{a['kind']}'; one of: start, compact, prompt")
        try:
            text, ids = await asyncio.wait_for(coro, a["deadline_ms"] / 1000)
        except TimeoutError:
            raise Busy(f"context did not fit its {a['deadline_ms']} ms deadline") from None
        return {"text": text, "ids": ids, "project": project}

    async def _ensure_session(self, session_id: str, agent: str, project: str, cwd: str | None) -> None:
        async with self.s.store.atomic() as db:
            now = time.time()
            await db.execute(
                "INSERT INTO sessions (id, agent, project, cwd, started, last_seen) VALUES (?,?,?,?,?,?)"
                " ON CONFLICT(id) DO NOTHING", (session_id, agent, project, cwd, now, now))

    @takes({"title": (str, REQUIRED), "cwd": (str, None), "project": (str, None),
                             "session_id": (str, None), "state": (str, "active")})
    async def handle_task_create(self, a: dict[str, Any]) -> dict[str, Any]:
        project = a["project"] or await project_of(a["cwd"])
        async with self.s.memories.atomic() as db:
            task_id = await tasks.create(db, title=a["title"], project=project, session_id=a["session_id"],
                                         state=a["state"])
            await self.s.memories.derive(db, [task_id])
            row, meta = await tasks.load(db, task_id)
            view = tasks.view(row, meta)
        return view

    @takes({"id": (int, REQUIRED), "state": (str, None), "evidence": (dict, None),
                             "note": (str, None)})
    async def handle_task_update(self, a: dict[str, Any]) -> dict[str, Any]:
        async with self.s.store.atomic() as db:
            return await tasks.update(db, a["id"], state=a["state"], evidence=a["evidence"], note=a["note"])

    @takes({"id": (int, REQUIRED), "evidence": (dict, None)})
    async def handle_task_close(self, a: dict[str, Any]) -> dict[str, Any]:
        """Close (make stable) only with an artifact, a passing evaluation and a memory reference."""
        async with self.s.store.atomic() as db:
            if a["evidence"]:
                await tasks.update(db, a["id"], evidence=a["evidence"])
            return await tasks.close(db, a["id"])

    @takes({"cwd": (str, None), "project": (str, None), "state": (str, None),
                             "all_projects": (bool, False)})
    async def handle_task_list(self, a: dict[str, Any]) -> dict[str, Any]:
        where, params = "kind = 'task' AND archived_at IS NULL", []
        if not a["all_projects"]:
            where += " AND project = ?"
            params.append(a["project"] or await project_of(a["cwd"]))
        rows = await self.s.store.fetchall(f"SELECT * FROM memories WHERE {where} ORDER BY id", params)
        views = [tasks.view(r, json.loads(r["meta"] or "{}") or tasks.new_meta()) for r in rows]
        if a["state"]:
            views = [v for v in views if v["state"] == a["state"]]
        return {"tasks": views}

    @takes({})
    async def handle_workers(self, a: dict[str, Any]) -> dict[str, Any]:
        """The memory workers: last run and outcome, next run, pending triggers; today's model budget."""
        status = await self.s.scheduler.status()
        raw = await self.s.store.scalar("SELECT value FROM checkpoints WHERE name = ?", (BUDGET_CHECKPOINT,))
        cfg = self.s.config()
        status["model"] = {"api": cfg.model_api or None, "model": cfg.model_name or None,
                           "daily_tokens": cfg.model_daily_tokens, "usage": json.loads(raw) if raw else None}
        return status

    @takes({"name": (str, REQUIRED), "session_id": (str, None), "project": (str, None),
                             "dry_run": (bool, False), "final": (bool, None)})
    async def handle_workers_run(self, a: dict[str, Any]) -> dict[str, Any]:
        """Run one worker now (`dry_run`: report what it would write, write nothing); waits for it to finish."""
        return await self.s.scheduler.run(a["name"], session_id=a["session_id"], project=a["project"],
                                          dry_run=a["dry_run"], final=a["final"])

    @takes({"project": (str, None), "kind": (str, None), "scope": (str, None), "state": (str, "active"),
            "limit": (int, 50), "offset": (int, 0)})
    async def handle_memories(self, a: dict[str, Any]) -> dict[str, Any]:
        """A page of memories by filter (`state` active/archived/superseded/all; no `kind`: all but evidence),
        newest first, with how many match."""
        _page(a)
        return await browse.list_memories(self.s.store, **a)

    @takes({"id": (int, REQUIRED)})
    async def handle_links(self, a: dict[str, Any]) -> dict[str, Any]:
        """A memory's edges, supersession chain, the sessions it was injected into, edit trail and merges."""
        return await browse.memory_links(self.s.store, a["id"])

    @takes({"project": (str, None), "limit": (int, 50), "offset": (int, 0)})
    async def handle_sessions(self, a: dict[str, Any]) -> dict[str, Any]:
        """A page of sessions, last seen first, with their counts and block token costs."""
        _page(a)
        return await browse.list_sessions(self.s.store, **a)

    @takes({"session_id": (str, REQUIRED), "limit": (int, 100), "offset": (int, 0), "max_chars": (int, 4000)})
    async def handle_session(self, a: dict[str, Any]) -> dict[str, Any]:
        """One session: a page of its events, its observations and memories, the blocks and memories injected."""
        _page(a)
        if not 1 <= a["max_chars"] <= 20_000:
            raise BadRequest("'max_chars' must be 1-20000")
        return await browse.session_view(self.s.store, a.pop("session_id"), **a)

    @takes({"worker": (str, None), "outcome": (str, None), "limit": (int, 50)})
    async def handle_jobs(self, a: dict[str, Any]) -> dict[str, Any]:
        """The newest worker runs (filter by `worker`, `outcome`), each with its error and detail."""
        if not 1 <= a["limit"] <= 500:
            raise BadRequest("'limit' must be 1-500")
        return {"jobs": await browse.list_jobs(self.s.store, **a)}

    @takes({"project": (str, None), "days": (int, 60), "sessions": (int, 30)})
    async def handle_series(self, a: dict[str, Any]) -> dict[str, Any]:
        """The stats series: memories per day by kind, tokens injected per session, top recalled, growth."""
        if not (1 <= a["days"] <= 3650 and 1 <= a["sessions"] <= 500):
            raise BadRequest("'days' must be 1-3650 and 'sessions' 1-500")
        return await browse.stats_series(self.s.store, **a)

    @takes({"project": (str, None), "limit": (int, 50), "offset": (int, 0)})
    async def handle_review(self, a: dict[str, Any]) -> dict[str, Any]:
        """The review queue: what the workers and capture rules wrote that no one has reviewed, newest first."""
        _page(a)
        return await browse.review_queue(self.s.store, **a)

    @takes({"id": ((int, list), REQUIRED)})
    async def handle_approve(self, a: dict[str, Any]) -> dict[str, Any]:
        """Mark memories reviewed as they are: they leave the review queue."""
        async with self.s.store.atomic() as db:
            return {"approved": await review.approve(db, _ids(a["id"]))}

    @takes({"id": (int, REQUIRED), "text": (str, None), "kind": (str, None), "reason": (str, "edit")})
    async def handle_edit(self, a: dict[str, Any]) -> dict[str, Any]:
        """Replace a memory's text and/or kind; the old ones are kept in its `edits` trail, its entities, neighbour
        context and vector follow the new text (re-embedded by the back-fill)."""
        if a["text"] is None and a["kind"] is None:
            raise BadRequest("edit needs a 'text' or a 'kind'")
        async with self.s.memories.atomic() as db:
            changed = await review.edit(db, a["id"], a["text"], a["kind"], a["reason"])
            if changed:
                await self.s.memories.derive(db, [a["id"]])
        (memory,) = await fetch_memories(self.s.store, [a["id"]])
        return {"changed": changed, "memory": memory}

    @takes({"id": (int, REQUIRED), "other": ((int, list), REQUIRED), "text": (str, None)})
    async def handle_merge(self, a: dict[str, Any]) -> dict[str, Any]:
        """Fold `other` into `id`: sources and hits join it, the others are superseded by it and archived; `text`
        replaces its text (kept in its edit trail)."""
        async with self.s.memories.atomic() as db:
            result = await review.merge(db, a["id"], _ids(a["other"]), a["text"])
            if result["edited"]:
                await self.s.memories.derive(db, [a["id"]])
        return result

    @takes({"id": (int, REQUIRED), "old": ((int, list), REQUIRED)})
    async def handle_supersede(self, a: dict[str, Any]) -> dict[str, Any]:
        """Mark memory `id` as superseding `old` (kept, out of date, in its chain; no longer injected)."""
        async with self.s.memories.atomic() as db:
            return {"superseded": await review.mark_superseding(db, a["id"], _ids(a["old"]))}
