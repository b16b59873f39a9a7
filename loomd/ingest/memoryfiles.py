"""Another tool's memory file, as the agent read it: its typed entries (a preference, a decision, a known issue …),
each to become a memory of the matching kind.

Agents' plugins keep memory files of their own: a JSON list of entries typed by their writer
(`.claude/memories/project_memory.json`: `{"type": "preference", "content": "…"}`, or `{"preferences": ["…"]}`), or
markdown files with a `type:` front matter (Claude Code's auto memory: `type: feedback`). What such a file says is a
rule or a decision someone already wrote down and typed; when the agent reads one (the Read tool, `cat`), loomd
keeps its entries under their writer's type, so the next session's start block shows them as it shows the user's own
rules. Untyped text (CLAUDE.md, AGENTS.md, a README) is not read here: the agent loads or reads it itself, and a
sentence of it is no more a rule than a line of code.
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
    if not command or not only_views_files(command):
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


def entries(output: str) -> list[Entry]:
    """The typed entries of a memory file's text (JSON, else markdown with a `type:` front matter), deduplicated,
    at most MAX_ENTRIES. A rule entry too long for one start-block line is kept a sentence an entry: a curated file
    bundles several rules into one entry ("Version in the header badge. Changelog each version. Bug fixes use .1
    increments."), and a clipped line would lose the middle ones."""
    text = file_text(output)
    found = list(_json_entries(text)) or list(_markdown_entries(text))
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
            return out[:MAX_ENTRIES]
    return out


def _json_entries(text: str) -> Iterator[tuple[str, str]]:
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        return
    try:
        document, _ = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        # Cut short (a Read with a limit, a bounded payload): the entries that arrived whole are flat objects.
        for match in _FLAT_OBJECT.finditer(text):
            try:
                obj = json.loads(match.group(0))
            except ValueError:
                continue
            yield from _walk(obj, 0)
        return
    yield from _walk(document, 0)


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


def read_entries(tool: str, path: str, command: str, output: str) -> tuple[str, list[Entry]]:
    """The memory file a finished tool call read and its typed entries, or ("", [])."""
    file = read_memory_path(tool, path, command)
    return (file, entries(output)) if file else ("", [])
