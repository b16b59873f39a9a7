"""Tasks with honest closure: draft -> active -> stable, and `stable` only with evidence of all three kinds."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import aiosqlite

from loomd.errors import BadRequest, NotFound, TaskError
from loomd.redact import redact_text, redact_value
from loomd.store.memories import insert_memory

STATES = ("draft", "active", "stable")
OPEN_STATES = ("draft", "active")
EVIDENCE_KINDS = ("artifact", "evaluation", "memory")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


def new_meta() -> dict[str, Any]:
    return {"state": "draft", "evidence": {k: [] for k in EVIDENCE_KINDS}, "notes": []}


def gaps(meta: dict[str, Any]) -> list[str]:
    """The evidence kinds still missing before the task may be closed."""
    evidence = meta.get("evidence") or {}
    return [kind for kind in EVIDENCE_KINDS if not evidence.get(kind)]


def check_artifact(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRequest("an artifact is a path or a commit id (a non-empty string)")
    value = value.strip()
    if not (_COMMIT.match(value) or "/" in value or "." in value):
        raise BadRequest(f"artifact {value!r} is neither a path nor a commit id")
    return value


def check_evaluation(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("command"), str) or not value["command"].strip():
        raise BadRequest("an evaluation is {'command': str, 'result': str, 'passed': bool}")
    if value.get("passed") is not True:
        raise BadRequest(f"evaluation `{value['command']}` did not pass; only a passing evaluation is evidence")
    return {"command": value["command"].strip(), "result": str(value.get("result", ""))[:500], "passed": True}


async def check_memory_ref(db: aiosqlite.Connection, value: Any, task_id: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest("a memory reference is a memory id (an integer)")
    if value == task_id:
        raise BadRequest("a task cannot be its own evidence")
    async with db.execute("SELECT 1 FROM memories WHERE id = ?", (value,)) as cur:
        if await cur.fetchone() is None:
            raise NotFound(f"memory reference #{value} does not exist")
    return value


async def load(db: aiosqlite.Connection, task_id: int) -> tuple[Any, dict[str, Any]]:
    async with db.execute("SELECT * FROM memories WHERE id = ? AND kind = 'task'", (task_id,)) as cur:
        row = await cur.fetchone()
    if row is None:
        raise NotFound(f"no task #{task_id}")
    return row, json.loads(row["meta"] or "{}") or new_meta()


async def create(db: aiosqlite.Connection, *, title: str, project: str, session_id: str | None,
                 state: str = "draft") -> int:
    if state not in OPEN_STATES:
        raise BadRequest(f"a new task is 'draft' or 'active', not {state!r}")
    meta = new_meta()
    meta["state"] = state
    task_id, is_new = await insert_memory(db, kind="task", text=title, project=project, session_id=session_id,
                                          importance=0.8, origin="task", meta=meta)
    if not is_new:
        raise TaskError(f"task #{task_id} already says this; update it instead")
    return task_id


async def update(db: aiosqlite.Connection, task_id: int, *, state: str | None = None,
                 evidence: dict[str, Any] | None = None, note: str | None = None) -> dict[str, Any]:
    """Add evidence and notes, or move draft -> active. Closing goes through `close`."""
    row, meta = await load(db, task_id)
    if meta["state"] == "stable":
        raise TaskError(f"task #{task_id} is closed (stable); create a new task for further work")
    if state is not None:
        if state == "stable":
            raise BadRequest("use task_close to make a task stable: it checks the evidence")
        if state not in OPEN_STATES:
            raise BadRequest(f"unknown task state {state!r}; one of: {', '.join(STATES)}")
        meta["state"] = state
    for kind, values in (evidence or {}).items():
        if kind not in EVIDENCE_KINDS:
            raise BadRequest(f"unknown evidence kind {kind!r}; one of: {', '.join(EVIDENCE_KINDS)}")
        for value in values if isinstance(values, list) else [values]:
            if kind == "artifact":
                checked: Any = check_artifact(value)
            elif kind == "evaluation":
                checked = check_evaluation(value)
            else:
                checked = await check_memory_ref(db, value, task_id)
            checked = redact_value(checked)  # a command line or a path may carry a token
            if checked not in meta["evidence"][kind]:
                meta["evidence"][kind].append(checked)
    if note:
        meta["notes"].append({"at": time.time(), "text": redact_text(note)[:500]})
    await db.execute("UPDATE memories SET meta = ?, updated = ? WHERE id = ?", (json.dumps(meta), time.time(), task_id))
    return view(row, meta)


async def close(db: aiosqlite.Connection, task_id: int) -> dict[str, Any]:
    row, meta = await load(db, task_id)
    missing = gaps(meta)
    if missing:
        need = {"artifact": "an artifact (a path or commit)", "evaluation": "a passing evaluation (command + result)",
                "memory": "a memory reference (a memory id)"}
        raise TaskError(f"task #{task_id} cannot be closed: missing {', '.join(need[k] for k in missing)}")
    meta["state"] = "stable"
    meta["closed_at"] = time.time()
    await db.execute("UPDATE memories SET meta = ?, updated = ? WHERE id = ?", (json.dumps(meta), time.time(), task_id))
    return view(row, meta)


def view(row: Any, meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "title": row["text"], "project": row["project"], "state": meta["state"],
            "evidence": meta["evidence"], "gaps": gaps(meta), "notes": meta.get("notes", []),
            "created": row["created"]}
