"""Coding-session memory QA (../shared/data/CODING-QA.md) through the daemon's own API, next to a same-run BM25.

Every session the question set names is replayed into one real daemon (`python -m loomd serve` on a private
LOOMD_HOME, passive workers, local embedder on, transcript tailing on with a private CODEX_HOME): a transcript is
named to the tailer by a SessionStart hook carrying its `transcript_path` (subagent files by SubagentStop's
`agent_transcript_path`), exactly as a live agent names it, and read to its end; a hook-only session's payload logs
go through the `hook` op as the shim sends them. Then the workers run as at the end of a session: the observer
(final) per session; once the vector back-fill has caught up, the reflector and the digest per project; and the
back-fill is waited for again.

Each question is asked three ways in its session's project (the project most of the session's events carry; the
session's row keeps its first event's, and Claude's `cwd` follows the agent's `cd`, so the two can differ):
- `search` (hybrid, limit 10): all@k / any@k for k = 1, 3, 5, 10 and tok@5, as CODING-QA.md defines them;
- `context` kind `prompt` (a fresh session per question): does the recall block hold every answer key; its tokens;
- `context` kind `start` (a fresh session per project): the share of preference questions whose every key is in it.

The baseline is computed in this run from the raw files, with its own parsing (not loomd's): an in-memory SQLite
FTS5 index per session (porter tokenizer) over the memory items CODING-QA.md defines, queried with an OR of the
question's non-stopword terms, BM25 order, tool items cut to 600 characters (and, for reference, not cut).

For each miss the full JSON says where the answer was lost: `stored` (some active memory of the project holds all
keys: a ranking loss) and `in_events` (some event of the session holds all keys: lost at distillation, else at
ingest). Those two checks read the database file read-only; everything else goes through the socket.

Prints the summary as one JSON object on stdout and markdown tables on stderr; --json also writes the full result,
with every question's top results, to a file.

    python bench/codingqa.py [--qa PATH] [--data DIR] [--json OUT] [--only SESSION_ID[,SESSION_ID]] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd.client import Client  # noqa: E402

SHARED = Path(os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data")
KS = (1, 3, 5, 10)
TYPES = ("decision", "procedure", "pitfall", "fact", "preference", "state")
TOOL_CUT = 600
SEARCH_LIMIT = 10
CONTEXT_DEADLINE_MS = 10_000  # generous: this measures what the block holds; the latency is reported next to it
REFERENCE = {  # CODING-QA.md, "Reference point"
    "BM25, tool items cut to 600 chars": {"all@1": .28, "all@3": .46, "all@5": .58, "all@10": .66, "any@10": .74,
                                          "tok@5": 957},
    "BM25, tool items not cut": {"all@1": .36, "all@3": .52, "all@5": .57, "all@10": .76, "any@10": .85,
                                 "tok@5": 4687},
}
STOPWORDS = frozenset("""
a about above after again against all also am an and any are aren as at be because been before being below between
both but by can could did didn do does doesn doing don down during each few for from further had has have having he
her here hers herself him himself his how i if in into is isn it its itself just let me more most my myself no nor not
now of off on once only or other our ours ourselves out over own same she should so some such than that the their
theirs them themselves then there these they this those through to too under until up very was wasn we were weren
what when where which while who whom why will with won would you your yours yourself yourselves
""".split())


# ---------------------------------------------------------------------------------------------------------------
# The question set


@dataclass
class Session:
    id: str
    agent: str  # "claude" or "codex", as loomd names them
    format: str
    files: list[Path]  # transcripts: the main file first, then subagent files
    hook_files: list[Path]
    hook_session: str | None
    questions: list[dict[str, Any]] = field(default_factory=list)
    session_id: str = ""  # loomd's session id for it
    cwd: str | None = None
    project: str = ""
    replay: dict[str, Any] = field(default_factory=dict)


def load_set(qa_path: Path, transcripts: Path, only: set[str]) -> list[Session]:
    qa = json.loads(qa_path.read_bytes())
    sessions: list[Session] = []
    by_file: dict[str, Session] = {}
    for s in qa["sessions"]:
        if only and s["id"] not in only:
            continue
        files = [] if s["format"] == "hooks" else [s["path"], *s.get("subagent_files", [])]
        session = Session(s["id"], "codex" if s["agent"] == "codex" else "claude", s["format"],
                          [transcripts / f for f in files], [transcripts / f for f in s.get("hook_files", [])],
                          s.get("session_id"))
        sessions.append(session)
        for f in [*files, *s.get("hook_files", [])]:
            by_file[f] = session
    for q in qa["questions"]:
        owner = by_file.get(q["session"])
        if owner is not None:
            owner.questions.append(q)
        elif not only:
            raise SystemExit(f"question {q['id']} names {q['session']}, which no session of the set holds")
    return sessions


def read_objects(path: Path) -> list[dict[str, Any]]:
    """A JSON array (chat.json, hook logs) or JSONL, as a list of objects; anything else in it is skipped."""
    raw = path.read_bytes()
    if raw.lstrip()[:1] == b"[":
        data = json.loads(raw)
        return [o for o in data if isinstance(o, dict)]
    out = []
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def identity(session: Session) -> tuple[str, str | None]:
    """The session id and working directory the raw file declares (what a live hook would carry)."""
    if session.format == "hooks":
        assert session.hook_session is not None
        for path in session.hook_files:
            for o in read_objects(path):
                if o.get("session_id") == session.hook_session and isinstance(o.get("cwd"), str):
                    return session.hook_session, o["cwd"]
        return session.hook_session, None
    objs = read_objects(session.files[0])
    if session.agent == "codex":
        meta = next((_dict(o.get("payload")) for o in objs if o.get("type") == "session_meta"), {})
        return str(meta.get("id") or session.files[0].stem), meta.get("cwd")
    sid = next((o["sessionId"] for o in objs if isinstance(o.get("sessionId"), str)), session.files[0].stem)
    cwd = next((o["cwd"] for o in objs if isinstance(o.get("cwd"), str)), None)
    return sid, cwd


# ---------------------------------------------------------------------------------------------------------------
# The baseline: memory items as CODING-QA.md defines them, parsed here, and an FTS5 BM25 index per session


@dataclass
class Item:
    kind: str  # user, assistant, tool, summary
    text: str


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    if isinstance(content, dict) and "content" in content:
        return _text_of(content["content"])
    return ""


def _tool(name: Any, tool_input: Any, result: str) -> Item:
    shown = tool_input if isinstance(tool_input, str) else json.dumps(tool_input, ensure_ascii=False)
    return Item("tool", f"[tool {name}] {shown} -> {result}")


def claude_items(objs: Iterable[dict[str, Any]]) -> list[Item]:
    """User prompts (compaction summaries too; isMeta skipped), assistant text per message.id, tool call + result,
    `summary` lines. Queue-operation lines and thinking are not items."""
    prompts: list[Item] = []
    texts: dict[str, list[str]] = {}
    calls: dict[str, tuple[Any, Any]] = {}
    results: dict[str, str] = {}
    for o in objs:
        kind = o.get("type")
        if kind == "summary" and isinstance(o.get("summary"), str) and o["summary"].strip():
            prompts.append(Item("summary", o["summary"]))
        if o.get("isMeta") is True or kind not in ("user", "assistant"):
            continue
        message = _dict(o.get("message"))
        content = message.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        if kind == "user":
            words = []
            for b in blocks:
                if not isinstance(b, dict):
                    continue
                if b.get("type") == "tool_result":
                    results[str(b.get("tool_use_id"))] = _text_of(b.get("content"))
                elif b.get("type") == "text" and isinstance(b.get("text"), str):
                    words.append(b["text"])
            text = "\n".join(words)
            if text.strip():
                prompts.append(Item("user", text))
            continue
        key = str(message.get("id") or o.get("uuid"))
        for b in blocks:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"].strip():
                texts.setdefault(key, []).append(b["text"])
            elif b.get("type") in ("tool_use", "server_tool_use"):
                calls[str(b.get("id"))] = (b.get("name"), b.get("input"))
    items = prompts + [Item("assistant", "\n".join(parts)) for parts in texts.values()]
    items += [_tool(name, tool_input, results.get(tid, "")) for tid, (name, tool_input) in calls.items()]
    return items


def codex_items(objs: Iterable[dict[str, Any]]) -> list[Item]:
    """user_message / agent_message events; function and custom tool calls joined with their output by call_id."""
    items: list[Item] = []
    calls: dict[str, tuple[Any, Any]] = {}
    outputs: dict[str, str] = {}
    for o in objs:
        p = _dict(o.get("payload"))
        kind, ptype = o.get("type"), p.get("type")
        if kind == "event_msg" and ptype in ("user_message", "agent_message") and isinstance(p.get("message"), str):
            if p["message"].strip():
                items.append(Item("user" if ptype == "user_message" else "assistant", p["message"]))
        elif kind == "response_item" and ptype == "function_call":
            calls[str(p.get("call_id"))] = (p.get("name"), p.get("arguments"))
        elif kind == "response_item" and ptype == "custom_tool_call":
            calls[str(p.get("call_id"))] = (p.get("name"), p.get("input"))
        elif kind == "response_item" and ptype in ("function_call_output", "custom_tool_call_output"):
            out = p.get("output")
            outputs[str(p.get("call_id"))] = out if isinstance(out, str) else _text_of(out)
    items += [_tool(name, args, outputs.get(cid, "")) for cid, (name, args) in calls.items()]
    return items


def hook_items(records: Iterable[dict[str, Any]], session_id: str) -> list[Item]:
    """UserPromptSubmit prompts, PostToolUse input -> response, Stop/SubagentStop last assistant message."""
    items: list[Item] = []
    for r in records:
        if r.get("session_id") != session_id:
            continue
        event = r.get("hook_event_name")
        if event == "UserPromptSubmit" and isinstance(r.get("prompt"), str):
            items.append(Item("user", r["prompt"]))
        elif event == "PostToolUse":
            resp = r.get("tool_response")
            if isinstance(resp, dict) and r.get("tool_name") == "Bash":
                shown = "\n".join(str(resp.get(k) or "") for k in ("stdout", "stderr")).strip()
            elif isinstance(resp, dict) and isinstance(resp.get("file"), dict) and "content" in resp["file"]:
                shown = str(resp["file"]["content"])
            else:
                shown = resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False)
            items.append(_tool(r.get("tool_name"), r.get("tool_input"), shown))
        elif event in ("Stop", "SubagentStop") and isinstance(r.get("last_assistant_message"), str):
            items.append(Item("assistant", r["last_assistant_message"]))
    return items


def session_items(session: Session) -> list[Item]:
    if session.format == "hooks":
        assert session.hook_session is not None
        return [i for p in session.hook_files for i in hook_items(read_objects(p), session.hook_session)]
    parse = codex_items if session.agent == "codex" else claude_items
    return [i for p in session.files for i in parse(read_objects(p))]


def query_terms(question: str) -> list[str]:
    terms: list[str] = []
    for word in re.findall(r"\w+", question.lower()):
        if word not in STOPWORDS and word not in terms:
            terms.append(word)
    return terms


class Bm25:
    """One session's items in an in-memory FTS5 table; `search` ranks by bm25 (the OR of the question's terms)."""

    def __init__(self, items: list[Item], cut: int | None) -> None:
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE VIRTUAL TABLE items USING fts5(text, kind UNINDEXED, tokenize='porter unicode61')")
        rows = [((i.text[:cut] if cut and i.kind == "tool" else i.text), i.kind) for i in items]
        self.db.executemany("INSERT INTO items (text, kind) VALUES (?, ?)", rows)

    def search(self, question: str, limit: int) -> list[str]:
        terms = query_terms(question)
        if not terms:
            return []
        match = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
        rows = self.db.execute("SELECT text FROM items WHERE items MATCH ? ORDER BY bm25(items) LIMIT ?",
                               (match, limit)).fetchall()
        return [r[0] for r in rows]


# ---------------------------------------------------------------------------------------------------------------
# Scoring


def has_all(text: str, keys: list[str]) -> bool:
    low = text.lower()
    return all(k.lower() in low for k in keys)


def has_any(text: str, keys: list[str]) -> bool:
    low = text.lower()
    return any(k.lower() in low for k in keys)


def first_rank(texts: list[str], keys: list[str], every: bool) -> int | None:
    for n, text in enumerate(texts, 1):
        if (has_all if every else has_any)(text, keys):
            return n
    return None


def score_row(q: dict[str, Any], session: Session, texts: list[str]) -> dict[str, Any]:
    keys = q["answer_keys"]
    rank_all, rank_any = first_rank(texts, keys, True), first_rank(texts, keys, False)
    row: dict[str, Any] = {"id": q["id"], "type": q["type"], "session": session.id,
                           "rank_all": rank_all, "rank_any": rank_any,
                           "tok5": sum(len(t) for t in texts[:5]) / 4}
    for k in KS:
        row[f"all@{k}"] = int(rank_all is not None and rank_all <= k)
        row[f"any@{k}"] = int(rank_any is not None and rank_any <= k)
    return row


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(rows)}
    for prefix in ("all", "any"):
        for k in KS:
            out[f"{prefix}@{k}"] = round(statistics.fmean(r[f"{prefix}@{k}"] for r in rows), 3)
    out["tok@5"] = round(statistics.fmean(r["tok5"] for r in rows))
    return out


def tables(rows: list[dict[str, Any]], sessions: list[Session]) -> dict[str, Any]:
    return {
        "overall": table(rows),
        "by_type": {t: table([r for r in rows if r["type"] == t]) for t in TYPES if any(r["type"] == t for r in rows)},
        "by_session": {s.id: table([r for r in rows if r["session"] == s.id]) for s in sessions},
    }


# ---------------------------------------------------------------------------------------------------------------
# The daemon


class Daemon:
    """`python -m loomd serve` on a private LOOMD_HOME, stopped with SIGTERM, its folder removed unless kept."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home or Path(tempfile.mkdtemp(prefix="lmq", dir="/tmp"))
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_")}
        env.update({"LOOMD_HOME": str(self.home), "LOOMD_EMBEDDER": "local", "LOOMD_PASSIVE": "1",
                    "LOOMD_TAIL_TRANSCRIPTS": "1", "LOOMD_CODEX_HOME": str(self.home / "codex"),
                    "LOOMD_LOG_LEVEL": "WARNING"})
        self.log = open(self.home / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=REPO)
        self.client = Client(self.home / "loomd.sock", timeout=3600)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {(self.home / 'daemon.log').read_text()[-2000:]}")
            try:
                self.client.call("ping")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        return self.client.call(op, args or {})

    def hook(self, agent: str, payload: dict[str, Any]) -> dict[str, Any]:
        event = str(payload["hook_event_name"])
        reply: dict[str, Any] = self.call("hook", {"agent": agent, "event": event,
                                                   "raw": json.dumps(payload, ensure_ascii=False)})
        return reply

    def wait_read(self, paths: list[Path], timeout: float = 600) -> list[dict[str, Any]]:
        """Until the tailer has read every one of `paths` to its end; their follower rows."""
        want = {str(p): p.stat().st_size for p in paths}
        deadline = time.monotonic() + timeout
        while True:
            tailer = self.call("status")["tailer"]
            rows = {f["path"]: f for f in tailer["followed"] if f["path"] in want}
            failed = [f for f in rows.values() if f["state"] == "error"]
            if failed:
                raise RuntimeError(f"the tailer could not read {failed}")
            if len(rows) == len(want) and all(rows[p]["offset"] == size for p, size in want.items()):
                return [rows[str(p)] for p in paths]
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tailer did not read {sorted(want)} within {timeout}s: {list(rows.values())}")
            time.sleep(0.05)

    def wait_caught_up(self, timeout: float = 3600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status: dict[str, Any] = self.call("status")["embedder"]
            if status["caught_up"] and status["state"] != "loading":
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"back-fill did not finish: {status}")
            time.sleep(0.2)

    def sql(self, query: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """Read-only, for the diagnostics the socket has no op for (a separate process: WAL locking holds)."""
        conn = sqlite3.connect(f"file:{self.home / 'loomd.db'}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute(query, tuple(params)).fetchall()
        finally:
            conn.close()

    def stop(self, keep: bool = False) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()
        if keep:
            sys.stderr.write(f"kept the daemon's LOOMD_HOME: {self.home}\n")
        else:
            shutil.rmtree(self.home, ignore_errors=True)


def replay(daemon: Daemon, session: Session) -> None:
    """Feed one session as a live agent would, then run its observer; timings into `session.replay`."""
    started = time.monotonic()
    sid, cwd = identity(session)
    session.session_id, session.cwd = sid, cwd
    sent = 0
    if session.format == "hooks":
        assert session.hook_session is not None
        for path in session.hook_files:
            for record in read_objects(path):
                if record.get("session_id") == session.hook_session and record.get("hook_event_name"):
                    daemon.hook("claude", record)
                    sent += 1
        read: list[dict[str, Any]] = []
    else:
        main, *subagents = session.files
        base = {"session_id": sid, "transcript_path": str(main), "cwd": cwd}
        daemon.hook(session.agent, {**base, "hook_event_name": "SessionStart", "source": "startup"})
        for sub in subagents:
            daemon.hook(session.agent, {**base, "hook_event_name": "SubagentStop", "stop_hook_active": False,
                                        "agent_id": sub.stem.removeprefix("agent-"),
                                        "agent_transcript_path": str(sub)})
        read = daemon.wait_read(session.files)
    ingest_s = time.monotonic() - started
    t = time.monotonic()
    run = daemon.call("workers_run", {"name": "observer", "session_id": sid, "final": True})
    session.replay = {"session_id": sid, "ingest_s": round(ingest_s, 2), "observer_s": round(time.monotonic() - t, 2),
                      "observer": run.get("outcome"), "observer_error": run.get("error"),
                      "hooks_sent": sent, "files": [{"path": f["path"], "format": f["format"], "events": f["events"]}
                                                    for f in read]}


def describe_store(daemon: Daemon, sessions: list[Session]) -> dict[str, Any]:
    """Each session's project: the one most of its events carry (a session's row keeps the project of its first event,
    and Claude's `cwd` follows the agent's `cd`); its row's project and how its events and memories spread too."""
    for s in sessions:
        row = daemon.sql("SELECT project FROM sessions WHERE id = ?", (s.session_id,))
        spread = daemon.sql("SELECT project, count(*) FROM events WHERE session_id = ? GROUP BY project"
                            " ORDER BY count(*) DESC, project", (s.session_id,))
        s.project = spread[0][0] if spread else row[0][0] if row else ""
        memories = daemon.sql("SELECT project, kind, count(*) FROM memories WHERE session_id = ?"
                              " AND archived_at IS NULL GROUP BY project, kind ORDER BY project, kind", (s.session_id,))
        by_project: dict[str, dict[str, int]] = defaultdict(dict)
        for project, kind, n in memories:
            by_project[project][kind] = n
        s.replay.update({"events": sum(n for _p, n in spread), "project": s.project,
                         "session_row_project": row[0][0] if row else None, "events_by_project": dict(spread),
                         "memories_by_project": dict(by_project)})
    status = daemon.call("status")
    events = status["counts"]["events"]
    return {"db_bytes": status["db_bytes"], "events": events, "sessions": status["counts"]["sessions"],
            "memories": status["counts"]["memories"], "archived": status["counts"]["archived"],
            "bytes_per_event": round(status["db_bytes"] / events) if events else None,
            "embedder": {k: status["embedder"].get(k) for k in ("state", "model", "vectors", "caught_up")}}


def where_lost(daemon: Daemon, session: Session, keys: list[str]) -> dict[str, bool]:
    """Whether some active memory of the project holds every key, and whether some event of the session does (a tool
    call and its result count as one, as in the question set's items)."""
    memories = daemon.sql("SELECT text FROM memories WHERE (project = ? OR scope = 'user') AND archived_at IS NULL",
                          (session.project,))
    texts: list[str] = []
    calls: dict[str, list[str]] = defaultdict(list)
    for tool_use_id, payload in daemon.sql("SELECT tool_use_id, payload FROM events WHERE session_id = ? ORDER BY id",
                                           (session.session_id,)):
        text = "\n".join(_strings(json.loads(payload)))
        texts.append(text)
        if tool_use_id:
            calls[tool_use_id].append(text)
    texts += ["\n".join(parts) for parts in calls.values() if len(parts) > 1]
    return {"stored": any(has_all(t, keys) for (t,) in memories), "in_events": any(has_all(t, keys) for t in texts)}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


# ---------------------------------------------------------------------------------------------------------------
# Asking


def ask(daemon: Daemon, sessions: list[Session], search_args: dict[str, Any] | None = None) -> dict[str, Any]:
    search_rows: list[dict[str, Any]] = []
    recall_rows: list[dict[str, Any]] = []
    detail: list[dict[str, Any]] = []
    for s in sessions:
        for q in s.questions:
            keys = q["answer_keys"]
            t = time.perf_counter()
            reply = daemon.call("search", {"query": q["question"], "project": s.project, "limit": SEARCH_LIMIT,
                                           "mode": "hybrid", **(search_args or {})})
            search_ms = (time.perf_counter() - t) * 1000
            results = reply["results"]
            texts = [r["text"] for r in results]
            row = score_row(q, s, texts)
            search_rows.append(row)
            t = time.perf_counter()
            block, timed_out = "", False
            try:
                ctx = daemon.call("context", {"kind": "prompt", "session_id": f"codingqa-{uuid.uuid4()}",
                                              "project": s.project, "prompt": q["question"], "agent": s.agent,
                                              "deadline_ms": CONTEXT_DEADLINE_MS})
                block = ctx["text"] or ""
            except Exception as exc:  # noqa: BLE001 - a Busy (deadline) reply counts as an empty block
                timed_out = "deadline" in str(exc)
                if not timed_out:
                    raise
            recall_ms = (time.perf_counter() - t) * 1000
            recall = {"id": q["id"], "type": q["type"], "session": s.id, "hit": int(has_all(block, keys)),
                      "any": int(has_any(block, keys)), "tokens": len(block) / 4, "empty": int(not block.strip()),
                      "timed_out": int(timed_out), "ms": recall_ms}
            recall_rows.append(recall)
            item = {"id": q["id"], "type": q["type"], "session": s.id, "question": q["question"], "keys": keys,
                    "evidence_source": q.get("evidence_source"), "rank_all": row["rank_all"],
                    "rank_any": row["rank_any"], "recall_hit": bool(recall["hit"]), "recall_block": block,
                    "search_ms": round(search_ms, 1),
                    "top": [{"id": r["id"], "kind": r["kind"], "origin": r.get("origin"), "text": r["text"][:400],
                             "collapsed": r.get("collapsed", [])} for r in results[:5]]}
            if row["rank_all"] is None:
                item.update(where_lost(daemon, s, keys))
            detail.append(item)
    return {"search_rows": search_rows, "recall_rows": recall_rows, "detail": detail}


def recall_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"n": len(rs), "hit": round(statistics.fmean(r["hit"] for r in rs), 3),
                "any": round(statistics.fmean(r["any"] for r in rs), 3),
                "tokens_mean": round(statistics.fmean(r["tokens"] for r in rs)),
                "empty": sum(r["empty"] for r in rs)}

    ms = sorted(r["ms"] for r in rows)
    return {**part(rows), "timed_out": sum(r["timed_out"] for r in rows),
            "ms_p50": round(statistics.median(ms), 1), "ms_max": round(ms[-1], 1),
            "by_type": {t: part([r for r in rows if r["type"] == t])
                        for t in TYPES if any(r["type"] == t for r in rows)}}


def start_blocks(daemon: Daemon, sessions: list[Session]) -> dict[str, Any]:
    """A new session's start block per project; which preference (and other) questions of its sessions it answers."""
    by_project: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        by_project[s.project].append(s)
    blocks: dict[str, Any] = {}
    pref_hits = pref_n = all_hits = all_n = 0
    for project, members in by_project.items():
        agent = "codex" if all(m.agent == "codex" for m in members) else "claude"
        reply = daemon.call("context", {"kind": "start", "session_id": f"codingqa-start-{uuid.uuid4()}",
                                        "project": project, "agent": agent, "deadline_ms": CONTEXT_DEADLINE_MS})
        text = reply["text"] or ""
        questions = [q for m in members for q in m.questions]
        prefs = [q for q in questions if q["type"] == "preference"]
        hit_prefs = [q["id"] for q in prefs if has_all(text, q["answer_keys"])]
        hit_all = [q["id"] for q in questions if has_all(text, q["answer_keys"])]
        pref_hits, pref_n = pref_hits + len(hit_prefs), pref_n + len(prefs)
        all_hits, all_n = all_hits + len(hit_all), all_n + len(questions)
        blocks[project] = {"sessions": [m.id for m in members], "tokens": round(len(text) / 4),
                           "preference_questions": len(prefs), "preference_hits": hit_prefs,
                           "questions": len(questions), "hits": hit_all, "text": text}
    tokens = [b["tokens"] for b in blocks.values()]
    return {"preference_coverage": round(pref_hits / pref_n, 3) if pref_n else None, "preference_n": pref_n,
            "all_types_coverage": round(all_hits / all_n, 3) if all_n else None, "questions": all_n,
            "tokens_mean": round(statistics.fmean(tokens)) if tokens else 0, "tokens_max": max(tokens, default=0),
            "projects": blocks}


# ---------------------------------------------------------------------------------------------------------------
# Output


def markdown(summary: dict[str, Any]) -> str:
    methods: dict[str, Any] = summary["methods"]
    cols = [*(f"all@{k}" for k in KS), *(f"any@{k}" for k in KS), "tok@5"]
    out = ["| method | n | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for name, res in methods.items():
        o = res["overall"]
        out.append(f"| {name} | {o['n']} | " + " | ".join(_cell(o.get(c)) for c in cols) + " |")
    for name, ref in REFERENCE.items():
        out.append(f"| reference: {name} | 100 | " + " | ".join(_cell(ref.get(c)) for c in cols) + " |")
    for group in ("by_type", "by_session"):
        out += ["", f"all@5 / any@5 / tok@5 {group.replace('_', ' ')}:", "",
                "| " + group[3:] + " | n | " + " | ".join(methods) + " |", "|---|---:|" + "---|" * len(methods)]
        first = next(iter(methods.values()))
        for key, row in first[group].items():
            cells = [f"{m[group][key].get('all@5', 0):.2f} / {m[group][key].get('any@5', 0):.2f} / "
                     f"{m[group][key].get('tok@5', 0)}" for m in methods.values()]
            out.append(f"| {key} | {row['n']} | " + " | ".join(cells) + " |")
    r = summary["recall_block"]
    out += ["", f"recall block (context kind prompt): hit {r['hit']:.2f} (any key {r['any']:.2f}), "
                f"{r['tokens_mean']} tokens mean, {r['empty']} empty, {r['timed_out']} past the deadline, "
                f"p50 {r['ms_p50']} ms, max {r['ms_max']} ms",
            "", "| type | n | hit | any | tokens |", "|---|---:|---:|---:|---:|"]
    out += [f"| {t} | {v['n']} | {v['hit']:.2f} | {v['any']:.2f} | {v['tokens_mean']} |"
            for t, v in r["by_type"].items()]
    st = summary["start_block"]
    out += ["", f"start block (context kind start, new session): preference coverage {_cell(st['preference_coverage'])}"
                f" of {st['preference_n']}, all types {_cell(st['all_types_coverage'])} of {st['questions']}, "
                f"{st['tokens_mean']} tokens mean (max {st['tokens_max']})"]
    out += ["", "| session | events | project asked (most events) | ingest s | observer s | events by project |",
            "|---|---:|---|---:|---:|---|"]
    for sid, rep in summary["replay"]["sessions"].items():
        spread = ", ".join(f"{n}" for n in rep["events_by_project"].values())
        out.append(f"| {sid} | {rep['events']} | {rep['project']} | {rep['ingest_s']} | {rep['observer_s']} | "
                   f"{spread} |")
    st_ = summary["store"]
    out += ["", f"store: {st_['db_bytes']} bytes, {st_['events']} events, {st_['bytes_per_event']} bytes/event, "
                f"{st_['memories']} memories; replay {summary['replay']['seconds']} s, total {summary['seconds']} s"]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) and v <= 1 else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qa", type=Path, default=SHARED / "coding-qa-dev.json", help="the question set")
    parser.add_argument("--data", type=Path, default=None,
                        help="the folder of session files (default: transcripts/ next to --qa)")
    parser.add_argument("--json", type=Path, help="also write the full result (every question) to this file")
    parser.add_argument("--only", default="", help="session ids of the set, comma-separated (default: all)")
    parser.add_argument("--search-args", default="",
                        help="extra arguments of the search op as JSON (e.g. weights, tuning), to compare settings")
    parser.add_argument("--keep", action="store_true", help="keep the daemon's LOOMD_HOME")
    parser.add_argument("--home", type=Path, default=None,
                        help="ask a store replayed before (a LOOMD_HOME kept with --keep): no replay, search only")
    args = parser.parse_args(argv)
    data = args.data or args.qa.parent / "transcripts"
    if not args.qa.is_file() or not data.is_dir():
        sys.stderr.write(f"no question set at {args.qa} or no sessions at {data} (set LOOMD_TEST_DATA)\n")
        return 2
    started = time.time()
    sessions = load_set(args.qa, data, {s for s in args.only.split(",") if s})
    if not sessions:
        sys.stderr.write(f"no session of {args.qa} matches --only {args.only}\n")
        return 2
    questions = [q for s in sessions for q in s.questions]

    # Baseline first: it needs no daemon.
    bm25_rows: dict[str, list[dict[str, Any]]] = {"BM25, tool items cut to 600 chars": [],
                                                  "BM25, tool items not cut": []}
    items_per_session: dict[str, int] = {}
    for s in sessions:
        items = session_items(s)
        items_per_session[s.id] = len(items)
        for rows, cut in zip(bm25_rows.values(), (TOOL_CUT, None), strict=True):
            index = Bm25(items, cut)
            rows += [score_row(q, s, index.search(q["question"], SEARCH_LIMIT)) for q in s.questions]

    reuse = args.home is not None and (args.home / "loomd.db").exists()
    daemon = Daemon(args.home)
    try:
        t0 = time.monotonic()
        for s in sessions:
            if reuse:
                s.session_id, s.cwd = identity(s)
                s.replay = {"session_id": s.session_id, "ingest_s": 0.0, "observer_s": 0.0, "observer": "reused",
                            "observer_error": None, "hooks_sent": 0, "files": []}
                continue
            replay(daemon, s)
            sys.stderr.write(f"replayed {s.id}: {s.replay['ingest_s']} s ingest, {s.replay['observer_s']} s observer\n")
        store_projects = [] if reuse else sorted({p for (p,) in daemon.sql("SELECT DISTINCT project FROM memories")})
        t = time.monotonic()
        if store_projects:
            # The reflector compares memories by their vectors when both have one: run it on a store the back-fill
            # has caught up with, as a live daemon's schedule does, not on whichever vectors a race left.
            daemon.wait_caught_up()
        first_backfill_s = time.monotonic() - t
        project_runs = []
        for project in store_projects:
            for worker in ("reflector", "digest"):
                t = time.monotonic()
                run = daemon.call("workers_run", {"name": worker, "project": project})
                project_runs.append({"worker": worker, "project": project, "outcome": run.get("outcome"),
                                     "error": run.get("error"), "seconds": round(time.monotonic() - t, 2)})
        replayed_s = sum(s.replay["ingest_s"] + s.replay["observer_s"] for s in sessions)
        workers_s = time.monotonic() - t0 - replayed_s - first_backfill_s
        t = time.monotonic()
        embedder = daemon.wait_caught_up()
        backfill_s = time.monotonic() - t
        replay_s = time.monotonic() - t0
        store = describe_store(daemon, sessions)
        t = time.monotonic()
        asked = ask(daemon, sessions, json.loads(args.search_args) if args.search_args else None)
        start = start_blocks(daemon, sessions)
        ask_s = time.monotonic() - t
    finally:
        daemon.stop(keep=args.keep or args.home is not None)

    methods = {"loomd search (hybrid)": tables(asked["search_rows"], sessions),
               **{name: tables(rows, sessions) for name, rows in bm25_rows.items()}}
    failed = [r for r in project_runs if r["outcome"] == "error"]
    failed += [{"worker": "observer", "session": s.id, "error": s.replay["observer_error"]}
               for s in sessions if s.replay["observer"] == "error"]
    misses = [d for d in asked["detail"] if d["rank_all"] is None]
    summary: dict[str, Any] = {
        "bench": "codingqa",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "parameters": {"qa": str(args.qa), "data": str(data), "sessions": [s.id for s in sessions],
                       "questions": len(questions), "search": {"mode": "hybrid", "limit": SEARCH_LIMIT},
                       "context_deadline_ms": CONTEXT_DEADLINE_MS, "bm25_tool_cut": TOOL_CUT},
        "methods": methods,
        "reference": REFERENCE,
        "recall_block": recall_summary(asked["recall_rows"]),
        "start_block": {k: v for k, v in start.items() if k != "projects"} | {
            "projects": {p: {k: v for k, v in b.items() if k != "text"} for p, b in start["projects"].items()}},
        "misses": {"n": len(misses),
                   "answer_in_a_memory_of_the_project": sum(1 for d in misses if d.get("stored")),
                   "answer_only_in_events": sum(1 for d in misses if not d.get("stored") and d.get("in_events")),
                   "answer_in_no_event": sum(1 for d in misses if not d.get("in_events"))},
        "replay": {"seconds": round(replay_s, 1), "reflector_digest_s": round(workers_s, 1),
                   "backfill_before_reflector_s": round(first_backfill_s, 1),
                   "backfill_wait_s": round(backfill_s, 1), "ask_s": round(ask_s, 1),
                   "vectors": embedder.get("vectors"), "failed_runs": failed,
                   "sessions": {s.id: s.replay for s in sessions}},
        "store": store,
        "baseline_items": items_per_session,
        "seconds": round(time.time() - started, 1),
    }
    print(markdown(summary), file=sys.stderr)
    print(json.dumps(summary, indent=1))
    if args.json:
        full = {**summary, "questions": asked["detail"], "project_runs": project_runs,
                "start_block_texts": {p: b["text"] for p, b in start["projects"].items()}}
        args.json.write_text(json.dumps(full, indent=1, ensure_ascii=False))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
