"""Every background task of the daemon is supervised (loomd/supervisor.py): a failure is logged, shown by `status`
and by `loom doctor` (FAIL while it fails, WARN once it runs again), and the task is restarted with backoff instead
of staying dead. The failure here is a real one: the spool folder is swapped for a symlink while the daemon runs."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import msgpack
from test_spool import publish, shim_spool, until

from loomd.client import AsyncClient
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.installer.doctor import Finding, run_checks


async def doctor(home: Path) -> dict[str, Finding]:
    env = {**os.environ, "LOOMD_HOME": str(home)}
    findings = await asyncio.to_thread(run_checks, load_config(env), env)
    return {f.name: f for f in findings}


async def spool_task(client: AsyncClient) -> dict[str, Any]:
    task: dict[str, Any] = (await client.call("status"))["tasks"]["spool"]
    return task


async def test_a_failing_background_task_is_shown_restarted_and_recovers(
    daemon: Daemon, client: AsyncClient, home: Path
) -> None:
    spool = home / "spool"
    elsewhere = Path(tempfile.mkdtemp(prefix="lw", dir="/tmp"))
    os.chmod(elsewhere, 0o755)
    try:
        shutil.rmtree(spool)
        spool.symlink_to(elsewhere)  # the watched folder is gone; what stands there now is not loomd's to use
        state: dict[str, Any] = {}

        async def failing() -> bool:
            state.update(await spool_task(client))
            return state["state"] == "backoff" and "symlink" in (state["last_error"] or "")

        for _ in range(400):
            if await failing():
                break
            await asyncio.sleep(0.05)
        assert state["state"] == "backoff" and state["failures"] >= 1, state
        found = await doctor(home)
        tasks = found["background tasks"]
        assert tasks.status == "FAIL" and "spool is failing" in tasks.detail, tasks
        assert tasks.fix == found["permissions"].fix and tasks.fix.startswith(f"rm {spool}"), (tasks, found)
        # the fix line, as the user would run it
        await asyncio.to_thread(subprocess.run, ["sh", "-c", tasks.fix], check=True, timeout=30)
        for _ in range(1200):  # the next restart (backoff doubles from 1 s) recreates the folder and watches it
            if (await spool_task(client))["state"] == "running" and spool.is_dir() and not spool.is_symlink():
                break
            await asyncio.sleep(0.05)
        data = shim_spool("Stop", "sv-after")
        path = publish(spool, msgpack.unpackb(data)["eid"], data)
        await until(lambda: not path.exists(), within_s=20)
        events = (await client.call("events", {"session_id": "sv-after", "limit": 5}))["events"]
        assert [e["kind"] for e in events] == ["Stop"]
        task = await spool_task(client)
        assert task["state"] == "running" and task["failures"] >= 1 and task["last_error"], task
        assert (await doctor(home))["background tasks"].status == "WARN"
        assert stat.S_IMODE(os.stat(elsewhere).st_mode) == 0o755 and os.listdir(elsewhere) == []
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
