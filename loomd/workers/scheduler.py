"""The worker scheduler: APScheduler 3.x `AsyncIOScheduler` on the daemon's own loop, one job per worker.

Each worker is an interval job (`worker_interval_s`, `max_instances=1`, coalescing) that an event can also wake at
once: an EventWriter listener counts each session's new tokens and wakes the observer at `observe_after_tokens`,
at PreCompact and at SessionEnd; an observer run that wrote something wakes the reflector, which wakes the digest
and the dropper. `passive = true` starts no job at all (manual runs still work).

Every run — scheduled, woken or manual — goes through `run()`: it holds the worker's lock (one run at a time,
whatever started it), records itself in `jobs` (start, end, items in/out, outcome, error) and records its own
failure: APScheduler would only log it. At shutdown `stop()` cancels what is running and waits for it; a cancelled
run's open transaction rolls back, so its output and watermark are either committed together or not at all. A
run cut short by a crash stays 'running' in `jobs` and is marked 'interrupted' at the next start.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from loomd.config import Config
from loomd.errors import BadRequest
from loomd.ingest.events import Event
from loomd.offload import Offload
from loomd.store.db import Store
from loomd.store.memories import MemoryWriter
from loomd.store.turns import HOLDER
from loomd.team.sync import SyncEngine
from loomd.workers.base import RunReport, RunRequest, WorkerContext
from loomd.workers.digest import Digest
from loomd.workers.dropper import Dropper
from loomd.workers.gc import GC
from loomd.workers.observer import Observer
from loomd.workers.reflector import Reflector
from loomd.workers.sync import Sync

log = logging.getLogger(__name__)

OBSERVE_NOW = frozenset({"PreCompact", "SessionEnd", "compact_summary"})
STOP_TIMEOUT_S = 10.0
HOLD_RETRY_S = 0.25  # while held, a due run is tried again this much later (a slice of background time is 50 ms)
# ... or sooner: when the hold is a pause in live hooks that will end before that, right after it ends (`resume_in`).


class Worker(Protocol):
    name: str

    async def run(self, ctx: WorkerContext, req: RunRequest, report: RunReport) -> None: ...


WORKERS: tuple[type[Worker], ...] = (Observer, Reflector, Dropper, Digest, GC, Sync)


class Scheduler:
    def __init__(self, store: Store, config: Callable[[], Config], memories: MemoryWriter,
                 offload: Offload | None = None, sync: SyncEngine | None = None) -> None:
        self.store = store
        self.config = config
        self.memories = memories
        self.workers: dict[str, Worker] = {cls.name: cls() for cls in WORKERS}
        self.locks = {name: asyncio.Lock() for name in self.workers}
        self.pending: dict[str, set[str]] = {name: set() for name in self.workers}
        self.unobserved: dict[str, int] = {}
        self.aps: AsyncIOScheduler | None = None
        self.running: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self.ctx = WorkerContext(store, config, memories, self.wake, offload, sync)
        # True while scheduled runs must wait (`loom import` runs, or live hooks arrive: the daemon sets it): to start,
        # and a run already going before each transaction (`WorkerContext.turn`). The workers' text work took as much
        # CPU as the import's own commits; an imported session is observed once the import is done.
        self.hold: Callable[[], bool] = lambda: False
        # Seconds until the hold ends if no hook comes meanwhile, when that is known (None: an import holds them).
        # Tried again only every HOLD_RETRY_S, a held run started anywhere up to that long after the hooks' pause had
        # let it, and so as late as the next hook: with hooks 0.55 s apart, the observer run a PreCompact woke started
        # with the SubagentStop two hooks later, in every round of `bench/hooks.py --background-catchup` (a trace in
        # the closing note of stop 58). Tried the moment the pause allows, a run starts at the pause's beginning.
        self.resume_in: Callable[[], float | None] = lambda: None
        self._retry: dict[str, dt.datetime] = {}  # a held worker's next try, when one is set (`wake`, `_job`)

    @property
    def passive(self) -> bool:
        return bool(self.config().passive)

    async def start(self) -> None:
        async with self.store.atomic() as db:
            await db.execute("UPDATE jobs SET outcome = 'interrupted', ended = ?, error = ? WHERE outcome = 'running'",
                             (time.time(), "the daemon stopped before this run finished; nothing it did was kept"
                                           " beyond its last committed chunk"))
        if self.passive:
            log.info("passive mode: no background workers")
            return
        interval = max(1.0, float(self.config().worker_interval_s))
        self.aps = AsyncIOScheduler(timezone=dt.UTC)
        for name in self.workers:
            seconds = interval
            if name == "sync":  # its own pace, and only with a server to talk to
                if self.ctx.sync is None or not self.ctx.sync.configured:
                    continue
                seconds = max(0.1, float(self.config().shared_interval_s))
            first = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
            self.aps.add_job(self._job, "interval", seconds=seconds, args=[name], id=name, name=name,
                             max_instances=1, coalesce=True, misfire_grace_time=None, next_run_time=first,
                             replace_existing=True)
        self.aps.start()

    async def stop(self) -> None:
        """Shutdown step 3: no new runs; cancel the running ones and wait for their rollbacks."""
        self.stopping = True
        aps, self.aps = self.aps, None
        if aps is not None and aps.running:
            aps.shutdown(wait=False)
        for task in list(self.running):
            task.cancel()
        if self.running:
            done, left = await asyncio.wait(set(self.running), timeout=STOP_TIMEOUT_S)
            if left:
                log.warning("%d worker run(s) did not stop within %.0fs", len(left), STOP_TIMEOUT_S)
        await asyncio.sleep(0)  # let the scheduler's own shutdown callback run on the loop

    # --- triggers --------------------------------------------------------------------------------------------

    def listener(self, events: Sequence[Event]) -> None:
        """EventWriter listener (after commit): count tokens per session; wake the observer when one is due."""
        if self.passive or self.stopping:
            return
        threshold = self.config().observe_after_tokens
        for event in events:
            if not event.stored:
                continue
            sid = event.session_id
            self.unobserved[sid] = self.unobserved.get(sid, 0) + event.tokens
            if event.kind in OBSERVE_NOW or self.unobserved[sid] >= threshold:
                self.unobserved.pop(sid, None)
                self.wake("observer", sid)

    def wake(self, name: str, key: str) -> None:
        """Run worker `name` for `key` (a session or a project) as soon as it is free."""
        if self.passive or self.stopping or self.aps is None or name not in self.pending:
            return
        self.pending[name].add(key)
        if self.locks[name].locked():  # a running job picks the key up when it finishes
            return
        now = dt.datetime.now(dt.UTC)
        if self.hold():
            # A run now would only put itself off (`_job`): it is tried when a held run would try again. An import
            # wakes the observer at most every commit; each pointless run cost a job and two log lines.
            if (retry := self._retry.get(name)) is not None and now < retry:
                return
            self._retry_at(name, now)
            return
        self.aps.modify_job(name, next_run_time=now)

    def _retry_at(self, name: str, now: dt.datetime) -> None:
        assert self.aps is not None
        delay = HOLD_RETRY_S
        if (left := self.resume_in()) is not None:
            delay = min(delay, left)
        self._retry[name] = now + dt.timedelta(seconds=delay)
        self.aps.modify_job(name, next_run_time=self._retry[name])

    async def _job(self, name: str) -> None:
        """The APScheduler entry point: one run, then again while triggers arrived during it."""
        try:
            while not self.stopping:
                if self.hold() and self.aps is not None:
                    # Its keys stay pending; a manual run (`loom workers run`) is not held.
                    self._retry_at(name, dt.datetime.now(dt.UTC))
                    return
                keys = frozenset(self.pending[name])
                self.pending[name].clear()
                await self.run(name, trigger="event" if keys else "interval", keys=keys)
                if not self.pending[name]:
                    break
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # Shutdown: the run recorded itself as cancelled and rolled back; nothing for APScheduler to log.

    # --- runs ------------------------------------------------------------------------------------------------

    async def run(self, name: str, *, session_id: str | None = None, project: str | None = None,
                  dry_run: bool = False, final: bool | None = None, trigger: str = "manual",
                  keys: frozenset[str] = frozenset()) -> dict[str, Any]:
        worker = self.workers.get(name)
        if worker is None:
            raise BadRequest(f"unknown worker '{name}'; one of: {', '.join(self.workers)}")
        req = RunRequest(name, session_id, project, dry_run, final, trigger, keys)
        holder = HOLDER.set(f"worker:{name}")
        try:
            return await self._run(worker, req)
        finally:
            HOLDER.reset(holder)

    async def _run(self, worker: Worker, req: RunRequest) -> dict[str, Any]:
        name, dry_run, trigger = req.worker, req.dry_run, req.trigger
        async with self.locks[name]:
            task = asyncio.current_task()
            if task is not None:
                self.running.add(task)
            report = RunReport()
            started = time.time()
            error: str | None = None
            report.job_id = await self._begin(req, started)
            # A manual run (`loom workers run`: someone waits for it) is never held; a scheduled one yields.
            ctx = self.ctx if trigger == "manual" else replace(self.ctx, hold=self.hold, resume_in=self.resume_in)
            try:
                await worker.run(ctx, req, report)
            except asyncio.CancelledError:
                await self._end(report, "cancelled", "cancelled at shutdown; its open transaction rolled back")
                raise
            except Exception as exc:  # noqa: BLE001 - a worker records its own failure (APScheduler only logs)
                log.error("worker %s failed: %s: %s", name, type(exc).__name__, exc)
                outcome, error = "error", f"{type(exc).__name__}: {exc}"[:2000]
            else:
                outcome = "dry_run" if dry_run else ("ok" if report.items_in or report.items_out else "noop")
                if report.items_out and not dry_run:
                    self.memories.changed()
            finally:
                if task is not None:
                    self.running.discard(task)
            await self._end(report, outcome, error)
        if name == "observer":
            for session in report.detail.get("sessions", []):
                self.unobserved.pop(session, None)
        if trigger == "manual" and self.pending[name] and self.aps is not None and not self.stopping:
            self.aps.modify_job(name, next_run_time=dt.datetime.now(dt.UTC))  # triggers that waited for us
        return {"job_id": report.job_id, "worker": name, "outcome": outcome, "error": error,
                "items_in": report.items_in, "items_out": report.items_out, "dry_run": dry_run,
                "duration_s": round(time.time() - started, 3), "output": report.output, "detail": report.detail}

    async def _begin(self, req: RunRequest, started: float) -> int:
        detail = {"trigger": req.trigger, "dry_run": req.dry_run, "keys": sorted(req.keys)[:20],
                  "project": req.project}
        # A job row's transactions in one trip to the writer's thread, the log's fsync after it (`commit_on_thread`):
        # every run writes two, and through `atomic` each held the writer for a trip per statement and the fsync.
        params = (req.worker, req.session_id, started, "running", req.trigger, _json(detail))

        def insert(conn: sqlite3.Connection) -> int:
            return int(conn.execute("INSERT INTO jobs (worker, session_id, started, outcome, trigger, detail)"
                                    " VALUES (?,?,?,?,?,?)", params).lastrowid or 0)

        job_id, _ = await self.store.commit_on_thread(insert)
        return job_id

    async def _end(self, report: RunReport, outcome: str, error: str | None) -> None:
        params = (time.time(), report.items_in, report.items_out, outcome, error, _json(report.detail), report.job_id)

        def update(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE jobs SET ended = ?, items_in = ?, items_out = ?, outcome = ?, error = ?,"
                         " detail = json_patch(detail, ?) WHERE id = ?", params)

        try:
            await self.store.commit_on_thread(update)
        except Exception as exc:  # noqa: BLE001 - the store may be closing; the run's own output is already safe
            log.warning("could not record the end of job %s (%s): %s", report.job_id, outcome, exc)

    # --- status ----------------------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        out = []
        for name in self.workers:
            last = await self.store.fetchone("SELECT * FROM jobs WHERE worker = ? ORDER BY id DESC LIMIT 1",
                                               (name,))
            failed = await self.store.fetchone(
                "SELECT id, started, error FROM jobs WHERE worker = ? AND outcome = 'error' ORDER BY id DESC LIMIT 1",
                (name,))
            job = self.aps.get_job(name) if self.aps is not None and self.aps.running else None
            next_run = job.next_run_time.timestamp() if job is not None and job.next_run_time else None
            out.append({
                "name": name, "running": self.locks[name].locked(), "pending": sorted(self.pending[name])[:20],
                "next_run": next_run, "last_run": None if last is None else {
                    "job_id": last["id"], "started": last["started"], "ended": last["ended"],
                    "outcome": last["outcome"], "items_in": last["items_in"], "items_out": last["items_out"],
                    "error": last["error"], "trigger": last["trigger"]},
                "last_error": None if failed is None else {"job_id": failed[0], "started": failed[1],
                                                           "error": failed[2]},
            })
        return {"passive": self.passive, "interval_s": self.config().worker_interval_s, "workers": out}


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)
