"""Zero-LLM auto-capture: the rules that turn a committed event into a memory, on the ingest path.

Every rule is one row of RULES (name, memory kind, importance, what fires it). They run inside the ingest
transaction (on the writer's thread, in the commit's one trip), so a captured memory commits with its source event
or not at all. Plumbing never fires.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

from loomd.config import Config
from loomd.ingest.events import Event
from loomd.ingest.memoryfiles import FILE_KINDS, Snapshot, snapshot, successor
from loomd.ingest.reading import (
    EDIT_TOOLS,
    PLUMBING,
    SHELL_TOOLS,
    TEST_COMMAND,
    clip,
    clip_ends,
    commit_subject,
    failed_output,
    first_error_line,
    response_text,
    shell_command,
)
from loomd.ingest.sentences import classify_user_sentence, user_sentences
from loomd.store.derived import write_derived
from loomd.store.memories import MemoryWriter, insert_memory, set_archived, supersede

USER_RULE_CHARS = 320  # a rule in the user's words is kept whole more often than a tool's line (blocks clip it again)
# An entry of another tool's memory file is second-hand: its writer typed it a rule, the user did not say it here.
MEMORY_FILE_IMPORTANCE = 0.8
# The rules' state is kept for this many sessions, the most recently active ones: a session idle while this many
# others ran starts afresh if it comes back (a fix then is not linked to a failure seen before). Unbounded, the state
# of every session the daemon ever saw stayed in memory for the daemon's life.
SESSIONS_KEPT = 256


@dataclass
class ToolRun:
    """A finished tool call, whichever source (hook or transcript) delivered it."""

    tool: str
    command: str  # shell command, or "" for non-shell tools
    path: str  # file path for edit tools
    output: str
    failed: bool
    input: dict[str, Any] = field(default_factory=dict)  # the call's own arguments


@dataclass
class SessionMemory:
    """What the rules remember within a session: failing commands, to spot the fix and repeats."""

    failures: dict[str, str] = field(default_factory=dict)  # command key -> first error line
    error_counts: dict[str, int] = field(default_factory=dict)  # normalised error -> times seen
    errors: dict[str, list[int]] = field(default_factory=dict)  # command key -> its "fails repeatedly" memories


@dataclass(frozen=True)
class Capture:
    rule: str
    kind: str
    text: str
    importance: float
    meta: dict[str, str] | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str
    importance: float
    doc: str
    fires: Callable[[ToolRun | None, str | None, SessionMemory], str | None]


# --- parsing helpers (pure) -------------------------------------------------------------------------------------
# What a tool call is (its command line, output, failure, commit subject, first error line) is read by the same
# functions the observer uses (ingest/reading.py); what is here decides only what is worth capturing.

SIGNIFICANT_FILE = re.compile(
    r"(^|/)(pyproject\.toml|setup\.(py|cfg)|requirements[^/]*\.txt|package\.json|tsconfig[^/]*\.json|Cargo\.toml"
    r"|go\.mod|Gemfile|Dockerfile[^/]*|docker-compose[^/]*|compose\.ya?ml|Makefile|CMakeLists\.txt|justfile"
    r"|\.env\.example|README[^/]*|CHANGELOG[^/]*|CONTRIBUTING[^/]*|AGENTS\.md|CLAUDE\.md|[^/]+\.(toml|ini|cfg|ya?ml)"
    r"|\.github/workflows/[^/]+|\.gitlab-ci\.yml|\.circleci/[^/]+|[^/]*migrations?/[^/]+|[^/]+\.sql"
    r"|docs?/[^/]+\.(md|rst|txt))$",
    re.IGNORECASE,
)
TEST_PASS = re.compile(r"\b(\d+ passed|all tests passed|tests? passed|ok \(\d+|PASS\b|test result: ok|0 failed)",
                       re.IGNORECASE)


def command_key(command: str) -> str:
    """Commands that are 'the same command' for fix detection: the first two words, flags dropped."""
    words = [w for w in command.strip().split() if not w.startswith("-")][:3]
    return " ".join(words)


def normalise_error(line: str) -> str:
    """Numbers, paths and quotes vary between repeats of one error; strip them."""
    line = re.sub(r"(/[\w.\-]+)+", "<path>", line)
    line = re.sub(r"\b0x[0-9a-f]+\b|\b\d+\b", "<n>", line)
    return re.sub(r"['\"`].*?['\"`]", "<s>", line).lower()


# --- the rules --------------------------------------------------------------------------------------------------

def _git_commit(run: ToolRun | None, _prompt: str | None, _s: SessionMemory) -> str | None:
    if run is None or run.failed or not run.command:
        return None
    commit = commit_subject(run.command, run.output)
    return f"Committed: {clip(commit[1], 180)}" if commit else None


def _git_history(run: ToolRun | None, _prompt: str | None, _s: SessionMemory) -> str | None:
    if run is None or run.failed or not run.command:
        return None
    c = run.command
    for pattern, label in (
        (r"\bgit\s+merge\s+(?!--abort)([\w./\-]+)", "Merged {}"),
        (r"\bgit\s+rebase\s+(?!--(?:abort|continue|skip))(?:-i\s+)?([\w./\-~^]+)", "Rebased onto {}"),
        (r"\bgit\s+tag\s+(?:-a\s+)?(?!-)([\w./\-]+)", "Tagged {}"),
        (r"\bgit\s+(?:checkout\s+-b|switch\s+-c|branch)\s+(?!-)([\w./\-]+)", "New branch {}"),
        (r"\bgit\s+worktree\s+add\s+(\S+)", "New worktree {}"),
    ):
        match = re.search(pattern, c)
        if match:
            # The whole command line when it did more than that ("git stash -u; git checkout -b x"): what happened
            # to the work in progress is part of the fact.
            done = label.format(match.group(1))
            line = " ".join(c.split())
            return done if line == match.group(0) else f"{done}: `{clip(line, 150)}`"
    return None


def _significant_edit(run: ToolRun | None, _prompt: str | None, _s: SessionMemory) -> str | None:
    if run is None or run.failed or run.tool not in EDIT_TOOLS or not run.path:
        return None
    return f"Edited {run.path}" if SIGNIFICANT_FILE.search(run.path) else None


def _repeated_failure(run: ToolRun | None, _prompt: str | None, s: SessionMemory) -> str | None:
    if run is None or not run.failed or not run.command or PLUMBING.match(run.command):
        return None
    line = first_error_line(run.output)
    if not line:
        return None
    norm = normalise_error(line)
    s.error_counts[norm] = s.error_counts.get(norm, 0) + 1
    if s.error_counts[norm] != 2:  # the second time is a pattern; later repeats bump the same memory
        return None
    return f"Fails repeatedly: `{clip(run.command, 80)}` → {line}"


def _fixed_after_failure(run: ToolRun | None, _prompt: str | None, s: SessionMemory) -> str | None:
    if run is None or not run.command or PLUMBING.match(run.command):
        return None
    key = command_key(run.command)
    if run.failed:
        s.failures.setdefault(key, first_error_line(run.output))
        return None
    error = s.failures.pop(key, None)
    if error is None or TEST_COMMAND.search(run.command):
        return None  # test commands have their own rule
    return f"Works: `{clip(run.command, 120)}` (after failing with: {clip(error, 60)})"


def _tests_green(run: ToolRun | None, _prompt: str | None, s: SessionMemory) -> str | None:
    if run is None or not run.command or not TEST_COMMAND.search(run.command):
        return None
    key = "test:" + command_key(run.command)
    if run.failed:
        s.failures.setdefault(key, first_error_line(run.output))
        return None
    error = s.failures.pop(key, None)
    if error is None:
        return None
    passed = TEST_PASS.search(run.output)
    suffix = f" ({passed.group(0)})" if passed else ""
    return f"Tests green again: `{clip(run.command, 100)}`{suffix}; was failing: {clip(error, 60)}"


def _user_rule(_run: ToolRun | None, prompt: str | None, _s: SessionMemory) -> str | None:
    """The first sentence of the user's own prompt that lays down a rule or states a preference (the observer's
    reading of a user sentence, `loomd.ingest.sentences`)."""
    if not prompt:
        return None
    for sentence in user_sentences(prompt):
        if classify_user_sentence(sentence) in ("constraint", "preference"):
            return clip_ends(sentence, USER_RULE_CHARS)  # what to do often closes a long sentence
    return None


RULES: tuple[Rule, ...] = (
    Rule("git_commit", "decision", 0.7, "`git commit -m` with a subject → [D] the subject", _git_commit),
    Rule("git_history", "fact", 0.5, "merge / rebase / tag / new branch / worktree → [F]", _git_history),
    Rule("significant_edit", "fact", 0.4, "edit of a config, build, CI, docs or migration file → [F]",
         _significant_edit),
    Rule("repeated_failure", "error", 0.6, "the same error (normalised) a second time in a session → [E]",
         _repeated_failure),
    Rule("fixed_after_failure", "procedure", 0.7, "a command that succeeds after it failed → [P]",
         _fixed_after_failure),
    Rule("tests_green", "procedure", 0.7, "a test command passing after it failed → [P]", _tests_green),
    Rule("user_rule", "constraint", 0.9, "a sentence of the user's own prompt that lays down a rule → [C]",
         _user_rule),
)


FIXES = frozenset({"fixed_after_failure", "tests_green"})  # rules that say a failing command works now


def evaluate(run: ToolRun | None, prompt: str | None, state: SessionMemory) -> list[Capture]:
    """Every rule's verdict on one event (pure apart from the session state it updates)."""
    out = []
    for rule in RULES:
        text = rule.fires(run, prompt, state)
        if text:
            kind = "preference" if rule.name == "user_rule" and re.search(r"\bprefer", text, re.I) else rule.kind
            out.append(Capture(rule.name, kind, text, rule.importance))
    return out


# --- wiring into ingest -------------------------------------------------------------------------------------------

async def tool_run(db: aiosqlite.Connection, event: Event,
                   stored: dict[tuple[str, str], Event] | None = None) -> ToolRun | None:
    """A finished tool call from a PostToolUse hook or a transcript tool_result (its input looked up: among
    `stored`, the events this transaction stored by (session, dedup), else in the table)."""
    p = event.payload
    if event.kind in ("PostToolUse", "PostToolUseFailure"):
        tool, tool_input = str(p.get("tool_name") or ""), p.get("tool_input")
        output, flagged = response_text(p.get("tool_response") or p.get("error"))
        flagged = flagged or event.kind == "PostToolUseFailure"
    elif event.kind == "tool_result" and event.tool_use_id:
        dedup = f"tu:{event.tool_use_id}"
        # A session holds one row per tool-call dedup (`writer.insert_events`), so the one stored now is the row the
        # query finds; an import's tool call is nearly always in its result's batch, and the query costs a trip to the
        # writer's thread and a JSON parse.
        if (found := (stored or {}).get((event.session_id, dedup))) is not None:
            use, use_tool = found.payload, found.tool_name
        else:
            async with db.execute("SELECT payload, tool_name FROM events WHERE session_id = ? AND dedup = ? LIMIT 1",
                                  (event.session_id, dedup)) as cur:
                row = await cur.fetchone()
            if row is None:
                return None
            use, use_tool = json.loads(row[0]), row[1]
        tool, tool_input = str(use_tool or use.get("tool_name") or ""), use.get("tool_input")
        output, flagged = str(p.get("text") or ""), bool(p.get("is_error"))
    else:
        return None
    # A hook payload is whatever the agent (or anyone on the socket) sent: tool_input may be any JSON value.
    tool_input = tool_input if isinstance(tool_input, dict) else {}
    command = shell_command(tool_input) if tool in SHELL_TOOLS or "command" in tool_input else ""
    path = str(tool_input.get("file_path") or tool_input.get("path") or tool_input.get("notebook_path") or "")
    if tool == "apply_patch" and not path:
        match = re.search(r"\*\*\* (?:Update|Add) File: (\S+)", str(tool_input.get("input", "")))
        path = match.group(1) if match else ""
    return ToolRun(tool, command, path, output, failed_output(output, flagged), tool_input)


def prompt_text(event: Event) -> str | None:
    """The human user's prompt; a subagent's task prompt (a sidechain user line) is the agent's words, not theirs."""
    if event.kind == "UserPromptSubmit" and isinstance(event.payload.get("prompt"), str):
        return event.payload["prompt"]
    if event.kind == "user_message" and isinstance(event.payload.get("text"), str) \
            and not (event.payload.get("is_sidechain") or event.payload.get("agent_id")):
        return event.payload["text"]
    return None


class Capturer:
    """The ingest processor: applies RULES to each stored event, within a per-session rate limit."""

    def __init__(self, rate_per_session: int, memories: MemoryWriter,
                 config: Callable[[], Config] | None = None) -> None:
        self.rate = rate_per_session
        self.memories = memories
        self.config = config  # `auto_capture` and `extract_off`, read per batch (SIGHUP reloads them)
        self.sessions: dict[str, SessionMemory] = {}
        self.fired: dict[str, int] = {}
        # Memories written by the commit that runs (on the writer's thread): their vectors are due once it is over.
        self.written: list[int] = []

    def listener(self, _events: Sequence[Event]) -> None:
        """EventWriter listener (after a commit, on the loop): what the commit captured gets its vectors."""
        if self.written:
            ids, self.written = self.written, []
            self.memories.mark_stale(ids)

    async def __call__(self, db: aiosqlite.Connection, events: Sequence[Event]) -> None:
        cfg = self.config() if self.config is not None else None
        settings: dict[str, tuple[Config | None, frozenset[str]]] = {}  # per project, read once per batch
        stored = {(e.session_id, e.dedup): e for e in events if e.dedup and e.dedup.startswith("tu:")}
        for event in events:
            if (setting := settings.get(event.project)) is None:
                own = cfg.for_project(event.project) if cfg is not None else None  # `[project."<key>"]` first
                setting = settings[event.project] = (own, own.kinds_off() if own is not None else frozenset())
            own, off = setting
            if own is not None and not own.auto_capture:
                continue
            run = await tool_run(db, event, stored)
            prompt = prompt_text(event)
            if run is None and prompt is None:
                continue
            state = self._state(event.session_id)
            for capture in evaluate(run, prompt, state):
                if capture.kind in off:
                    continue
                memory_id = await self._store(db, event, capture)
                if memory_id is None or run is None:
                    continue
                if capture.rule == "repeated_failure":
                    state.errors.setdefault(command_key(run.command), []).append(memory_id)
                elif capture.rule in FIXES:
                    # The command works now: what was noted as failing repeatedly is out of date.
                    await supersede(db, memory_id, state.errors.pop(command_key(run.command), []))
            if run is not None and not run.failed \
                    and (shown := snapshot(run.tool, run.path, run.command, run.input, run.output)) is not None:
                await self._memory_file(db, event, shown, off)

    def _state(self, session_id: str) -> SessionMemory:
        """The session's rule state, made the most recent (dicts keep insertion order); the least recent goes past
        SESSIONS_KEPT."""
        state = self.sessions.pop(session_id, None)
        self.sessions[session_id] = state = state if state is not None else SessionMemory()
        if len(self.sessions) > SESSIONS_KEPT:
            del self.sessions[next(iter(self.sessions))]
        return state

    async def _memory_file(self, db: aiosqlite.Connection, event: Event, shown: Snapshot,
                           off: frozenset[str]) -> None:
        """A memory file another tool keeps, read (or written) by the agent: each typed entry under its writer's type,
        the file named as where it came from (`loomd.ingest.memoryfiles`). When the call showed the whole file, what
        was captured from it before and it no longer holds is out of date: superseded by the entry it became (same
        kind, most words shared), archived when the file holds nothing of its kind any more."""
        current: list[tuple[int, str, str]] = []
        known = shown.whole  # every entry the file holds is a memory now (none turned off, none over the rate)
        for entry in shown.entries:
            capture = Capture("memory_file", entry.kind, entry.text, MEMORY_FILE_IMPORTANCE,
                              {"file": shown.file, "type": entry.type})
            memory_id = None if entry.kind in off else await self._store(db, event, capture)
            if memory_id is None:
                known = False
                continue
            current.append((memory_id, entry.kind, entry.text))
        if not known:
            return
        marks = ",".join("?" * len(FILE_KINDS))
        # The project's (project, kind) index narrows this to the kinds a memory file yields.
        earlier = await db.execute_fetchall(
            f"SELECT id, kind, text FROM memories WHERE project = ? AND kind IN ({marks})"
            " AND origin = 'capture:memory_file' AND archived_at IS NULL AND superseded_by IS NULL"
            " AND json_extract(meta, '$.file') = ?", (event.project, *FILE_KINDS, shown.file))
        kept = {memory_id for memory_id, _, _ in current}
        for old_id, kind, text in earlier:
            if old_id in kept:
                continue
            if (new_id := successor(text, kind, current)) is not None:
                await supersede(db, new_id, [old_id])
            else:
                await set_archived(db, [old_id], True, f"gone from {shown.file}")

    async def _store(self, db: aiosqlite.Connection, event: Event, capture: Capture) -> int | None:
        rows = list(await db.execute_fetchall("SELECT captures FROM sessions WHERE id = ?", (event.session_id,)))
        if rows and rows[0][0] >= self.rate:
            return None
        memory_id, is_new = await insert_memory(
            db, kind=capture.kind, text=capture.text, project=event.project, session_id=event.session_id,
            agent=event.agent, importance=capture.importance, created=event.ts, origin=f"capture:{capture.rule}",
            meta=capture.meta, sources=[event.id] if event.id else [],
        )
        if is_new:
            await db.execute("UPDATE sessions SET captures = captures + 1 WHERE id = ?", (event.session_id,))
            await write_derived(db, [memory_id])
            self.written.append(memory_id)
            self.fired[capture.rule] = self.fired.get(capture.rule, 0) + 1
        return memory_id
