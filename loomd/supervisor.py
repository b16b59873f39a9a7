"""The daemon's long-running background tasks, each restarted with backoff when it fails.

A task that raises is logged, shown by `status` (and so by `loom doctor`) and started again after a delay that
doubles with each failure in a row, up to MAX_BACKOFF_S; a run that lasted STEADY_S resets the delay. A task that
returns has nothing (more) to do (tailing switched off, no embedder): it is shown as finished, not restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from loomd.redact import redact_text

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
STEADY_S = 60.0  # a run this long counts as healthy: the next failure starts the backoff afresh


@dataclass
class TaskHealth:
    """One supervised task as `status` shows it."""

    name: str
    state: str = "starting"  # running | backoff (failed, waiting to restart) | finished | stopped
    failures: int = 0
    in_a_row: int = 0
    last_error: str | None = None
    last_failed_at: float | None = None
    restart_at: float | None = None

    def public(self) -> dict[str, Any]:
        return {"state": self.state, "failures": self.failures, "failures_in_a_row": self.in_a_row,
                "last_error": self.last_error, "last_failed_at": self.last_failed_at,
                "restart_in_s": None if self.restart_at is None else max(0.0, round(self.restart_at - time.time(), 1))}


class Supervisor:
    """Runs `make()` for each named task until `stop` is set, restarting it after failures."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.health: dict[str, TaskHealth] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.health[name] = TaskHealth(name)
        self.tasks.append(asyncio.create_task(self._keep(name, make), name=name))

    def status(self) -> dict[str, dict[str, Any]]:
        return {name: h.public() for name, h in self.health.items()}

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _keep(self, name: str, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        health = self.health[name]
        delay = FIRST_BACKOFF_S
        while not self.stop.is_set():
            health.state, health.restart_at = "running", None
            began = time.monotonic()
            try:
                await make()
            except asyncio.CancelledError:
                health.state = "stopped"
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a background task is recorded and retried
                error = redact_text(f"{type(exc).__name__}: {exc}")[:500]
                log.debug("background task %s failed", name, exc_info=True)
            else:
                health.state = "stopped" if self.stop.is_set() else "finished"
                return
            if time.monotonic() - began >= STEADY_S:
                delay, health.in_a_row = FIRST_BACKOFF_S, 0
            health.failures += 1
            health.in_a_row += 1
            health.last_error, health.last_failed_at = error, time.time()
            health.state, health.restart_at = "backoff", time.time() + delay
            log.error("background task %s failed (%d in a row), restarting in %.0fs: %s",
                      name, health.in_a_row, delay, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
        health.state, health.restart_at = "stopped", None
