"""Another tool's memory file, as the agent read (or wrote) it: its typed entries (a preference, a decision, a known
issue …), each to become a memory of the matching kind.

Agents' plugins keep memory files of their own: a JSON list of entries typed by their writer
(`.claude/memories/project_memory.json`: `{"type": "preference", "content": "…"}`, or `{"preferences": ["…"]}`), or
markdown files with a `type:` front matter (Claude Code's auto memory: `type: feedback`). What such a file says is a
rule or a decision someone already wrote down and typed; when the agent reads one (the Read tool, `cat`), loomd
keeps its entries under their writer's type, so the next session's start block shows them as it shows the user's own
rules. Untyped text (CLAUDE.md, AGENTS.md, a README) is not read here: the agent loads or reads it itself, and a
sentence of it is no more a rule than a line of code.

A whole read (or a Write of the whole file) is the file as it is now: an entry captured from an earlier version that
it no longer holds is out of date (its writer consolidated or dropped it), and the capture retires it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loomd.ingest.reading import clip_ends, only_views_files
from loomd.ingest.sentences import sentences

READ_TOOLS = frozenset({"Read", "read_file", "ReadFile", "view", "view_file"})
WRITE_TOOLS = frozenset({"Write", "write_file", "create_file"})  # the whole file in the call's input
# A shell command that prints one whole file and nothing else (no pipe, no filter, no redirection).
_WHOLE_SHOW = re.compile(r"^\s*(?:cat|bat|type|gc|Get-Content)(?:\s+-\w+)*\s+(\S+)\s*$")
# A memory store names itself so (`memory/`, `.claude/memories/`, `memory-bank/`, `project_memory.json`,
# `MEMORY.md`); a fixture of one (tests, examples) holds made-up entries.
_MEMORY_PATH = re.compile(r"memor(?:y|ies)", re.IGNORECASE)
_FIXTURE_DIR = re.compile(r"(?:^|/)(?:tests?|__tests__|spec|fixtures?|examples?|testdata|samples?)/", re.IGNORECASE)
# The writer's type, by its words ("tech_decision", "user-preference", "Known issue"), to a memory kind; the first
# row that holds one of its words wins. Types of no row ("message", "completed_feature", "in_progress", "user",
# "project", "reference") are a chat log, a status or a note: not kept from here.
TYPE_KINDS: tuple[tuple[frozenset[str], str], ...] = tuple(
    (frozenset(words.split()), kind)
    for words, kind in (
        ("preference preferences convention conventions style feedback", "preference"),
        ("constraint constraints rule rules requirement requirements guideline guidelines policy", "constraint"),
        ("decision decisions choice choices adr", "decision"),
        ("issue issues bug bugs pitfall pitfalls gotcha gotchas problem problems", "error"),
        ("lesson lessons learning learnings insight insights correction corrections", "insight"),
        ("procedure procedures workflow workflows howto recipe recipes", "procedure"),
    )
)
FILE_KINDS = tuple(sorted({kind for _, kind in TYPE_KINDS}))  # every kind a memory file yields
RULE_KINDS = frozenset({"preference", "constraint"})
_TYPE_FIELDS = ("type", "kind", "category", "memory_type")
_TEXT_FIELDS = ("content", "text", "memory", "description", "value", "note", "summary", "rule", "body")
MAX_ENTRIES = 24  # of one read: the session's capture rate (`capture_rate_per_session`) is shared with every rule
ENTRY_CHARS = 400
MIN_CHARS = 12
RULE_LINE = 130  # a rule longer than a start-block line shows is kept one sentence a memory (see `entries`)
_LINE_NUMBER = re.compile(r"^\s*\d+(?:→|\t)", re.MULTILINE)  # Claude's Read output, `cat -n`
_FLAT_OBJECT = re.compile(r"\{[^{}]*\}")
_FRONT_MATTER = re.compile(r"\A\s*---\s*\n(.*?)\n---\s*\n?(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class Entry:
    kind: str
    text: str
    type: str  # the writer's own word for it


@dataclass(frozen=True)
class Snapshot:
    """What one tool call showed of a memory file: its typed entries, and whether they are all it holds now."""

    file: str
    entries: list[Entry]
    whole: bool


def kind_of(type_name: str) -> str | None:
    words = set(re.split(r"[^a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", type_name).lower())) - {""}
    return next((kind for names, kind in TYPE_KINDS if names & words), None)


def is_memory_path(path: str) -> bool:
    path = path.replace("\\", "/")
    return bool(_MEMORY_PATH.search(path)) and not _FIXTURE_DIR.search(path)


def read_memory_path(tool: str, path: str, command: str) -> str:
    """The memory file a tool call only read (the Read tool, or a shell command that only shows files), or ""."""
    if tool in READ_TOOLS:
        return path if is_memory_path(path) else ""
    # Every shell call of every session comes here: a word test first, the command parsed only when it may be one.
    if not command or not _MEMORY_PATH.search(command) or not only_views_files(command):
        return ""
    return next((w.strip("'\"") for w in command.split() if is_memory_path(w.strip("'\""))), "")


def file_text(output: str) -> str:
    """The file's own text in a tool's output: line numbers (`     1→`) and the harness's trailing reminder off."""
    output = re.sub(r"<system-reminder>.*?(?:</system-reminder>|\Z)", "", output, flags=re.DOTALL)
    lines = output.splitlines()
    numbered = sum(1 for ln in lines if _LINE_NUMBER.match(ln))
    if lines and numbered * 2 >= len(lines):
        output = _LINE_NUMBER.sub("", output)
    return output


def entries(text: str) -> tuple[list[Entry], bool]:
    """The typed entries of a memory file's text (JSON, else markdown with a `type:` front matter), deduplicated,
    at most MAX_ENTRIES; and whether the text parsed whole (a JSON document with nothing after it, a markdown file
    with its front matter). A rule entry too long for one start-block line is kept a sentence an entry: a curated
    file bundles several rules into one ("Version in the header badge. Changelog each version. Bug fixes use .1
    increments."), and a clipped line would lose the middle ones."""
    complete, json_found = _json_entries(text)
    found = json_found or list(_markdown_entries(text))
    complete = complete if json_found else bool(found)
    out: list[Entry] = []
    seen: set[str] = set()
    for type_name, content in found:
        kind = kind_of(type_name)
        content = " ".join(content.split())
        if kind is None or len(content) < MIN_CHARS:
            continue
        parts = sentences(content) if kind in RULE_KINDS and len(content) > RULE_LINE else [content]
        for part in parts or [content]:
            key = part.lower()
            if len(part) >= MIN_CHARS and key not in seen:
                seen.add(key)
                out.append(Entry(kind, clip_ends(part, ENTRY_CHARS), type_name))
        if len(out) >= MAX_ENTRIES:
            return out[:MAX_ENTRIES], False
    return out, complete


def _json_entries(text: str) -> tuple[bool, list[tuple[str, str]]]:
    """(the document parsed whole, its typed entries)."""
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        return False, []
    try:
        document, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        # Cut short (a Read with a limit, a bounded payload): the entries that arrived whole are flat objects.
        found: list[tuple[str, str]] = []
        for match in _FLAT_OBJECT.finditer(text):
            try:
                obj = json.loads(match.group(0))
            except ValueError:
                continue
            found.extend(_walk(obj, 0))
        return False, found
    return not text[end:].strip(), list(_walk(document, 0))


def _walk(node: Any, depth: int) -> Iterator[tuple[str, str]]:
    if depth > 6:
        return
    if isinstance(node, list):
        for item in node:
            yield from _walk(item, depth + 1)
        return
    if not isinstance(node, dict):
        return
    type_name = next((node[f] for f in _TYPE_FIELDS if isinstance(node.get(f), str)), None)
    content = next((node[f] for f in _TEXT_FIELDS if isinstance(node.get(f), str)), None)
    if type_name is not None and content is not None:
        yield type_name, content
        return
    for key, value in node.items():
        # `{"preferences": ["…", "…"]}`: the key types the strings it lists.
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and kind_of(str(key)):
            yield from ((str(key), v) for v in value)
        else:
            yield from _walk(value, depth + 1)


def _markdown_entries(text: str) -> Iterator[tuple[str, str]]:
    match = _FRONT_MATTER.match(text)
    if not match:
        return
    fields = dict(re.findall(r"^(\w+):\s*(.+?)\s*$", match.group(1), re.MULTILINE))
    type_name = fields.get("type", "").strip("'\"")
    if not type_name:
        return
    body = [ln.strip() for ln in match.group(2).split("\n\n") if ln.strip()]
    content = body[0] if body else fields.get("description", "")
    yield type_name, content


def snapshot(tool: str, path: str, command: str, tool_input: dict[str, Any], output: str) -> Snapshot | None:
    """The memory file a finished tool call read or wrote whole, and its typed entries; None for any other call.
    `whole`: the entries are everything the file holds now (a Read without offset or limit whose text parsed whole,
    a plain `cat` of it, a Write of it), so an entry of an earlier version missing here is gone from the file."""
    if tool in WRITE_TOOLS:
        content = tool_input.get("content")
        if not is_memory_path(path) or not isinstance(content, str):
            return None
        found, complete = entries(content)
        return Snapshot(path, found, complete)
    file = read_memory_path(tool, path, command)
    if not file:
        return None
    found, complete = entries(file_text(output))
    if tool in READ_TOOLS:
        first = _LINE_NUMBER.search(output)
        windowed = bool(tool_input.get("offset") or tool_input.get("limit"))
        whole = complete and not windowed and (first is None or first.group(0).strip().rstrip("→") == "1")
    else:
        whole = complete and bool(_WHOLE_SHOW.match(command)) and "\n" not in command.strip()
    return Snapshot(file, found, whole)


def successor(text: str, kind: str, current: list[tuple[int, str, str]]) -> int | None:
    """The entry of the file's current version that an entry gone from it became: of the same kind, the one sharing
    the most words with it (a consolidated or reworded entry); None when the file holds none of its kind."""
    words = set(re.findall(r"\w+", text.lower()))
    same = [(memory_id, set(re.findall(r"\w+", new_text.lower()))) for memory_id, new_kind, new_text in current
            if new_kind == kind]
    if not same:
        return None
    # The first of equals wins (max keeps the first).
    return max(same, key=lambda c: len(words & c[1]) / max(1, len(words | c[1])))[0]
