"""The evidence tier: every step of a session kept searchable as passages, not only what the rules distil.

A step is a user prompt, an assistant message, a tool call with its input and its result, a compaction summary or
a subagent's report (`steps.to_steps` pairs and merges them). Its full text — up to `MAX_ITEM_CHARS`, head and tail
kept — is cut into overlapping passages of at most `PASSAGE_CHARS` at line and word boundaries, each opened by a
short header naming where it came from ("Bash `npm test`:"), so a passage deep in a tool result still says which
command printed it. Each passage is an `evidence` memory linked to its source events: the same FTS5, vector,
graph, recency and recurrence signals find it, and `detail`/`evidence` lead back to the events. Pure functions:
the observer writes them, in the transaction that moves its watermark.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from loomd.ingest.reading import EDIT_TOOLS, clip, only_views_files, short_command
from loomd.workers.steps import Step

PASSAGE_CHARS = 720  # a passage, header included: 5 of them stay within 900 tokens, most far less
OVERLAP_CHARS = 160  # carried over from the passage before, so an answer on a boundary is whole in one of them
MAX_ITEM_CHARS = 16_000  # longer step texts keep their head and tail (the middle of a long log says least)
MIN_PASSAGE_CHARS = 12  # shorter texts ("ok", "y") say nothing on their own
CONTEXT_WINDOW = 2  # passages on each side whose text fills a passage's `ctx`
CONTEXT_CHARS = 600  # of each of them
EVIDENCE_IMPORTANCE = 0.2  # below any distilled memory: when equally relevant, the dense memory wins
_INPUT_FIELDS = ("file_path", "path", "notebook_path", "pattern", "url", "query", "description", "prompt",
                 "old_string", "new_string", "content", "patch", "input", "todos", "questions", "answers", "plan")


@dataclass(frozen=True)
class Evidence:
    text: str
    ts: float
    sources: list[int]
    role: str  # the step's role: user, assistant, run, compact, summary
    head: str  # the header every passage of the step opens with
    part: int  # this passage's place among the step's passages
    context: str = ""  # its neighbours in the session (the full-text index's down-weighted `ctx` column)
    aside: bool = False  # the step says nothing of its own (`is_aside`)

    def meta(self) -> dict[str, object]:
        """What search needs to put the step back together (`search.retrieval.item_windows`) and to weigh it."""
        return {"head": self.head, "part": self.part, **({"aside": True} if self.aside else {})}


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) and "content" in v for v in value):
        # A todo list: one line per item with its state, not a JSON dump repeated at every update.
        return "\n".join(f"[{v.get('status', '?')}] {v['content']}" for v in value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# Claude Code's Read tool numbers every line ("   117→"): the numbers cost tokens and say nothing searchable.
_LINE_NUMBERS = re.compile(r"^ *\d+→", re.MULTILINE)


def tool_input_text(step: Step) -> str:
    """What a tool call asked for, readable: the command line, the file and its change, or the input's fields."""
    inp = step.tool_input
    if step.command:
        return step.command
    if step.tool in EDIT_TOOLS or any(k in inp for k in _INPUT_FIELDS):
        parts = [f"{k}: {_value(inp[k])}" for k in _INPUT_FIELDS if k in inp and inp[k] not in (None, "", [])]
        if parts:
            return "\n".join(parts)
    return _value(inp) if inp else ""


# Tools that only show or list files: what they return is a copy of the repository.
VIEW_TOOLS = frozenset({"Read", "Grep", "Glob", "LS", "NotebookRead", "read_file", "list_dir", "list_files",
                        "view", "view_file", "search_files", "grep_search", "file_search"})

# Tools that only load other tools' definitions (Claude Code's deferred tools): nothing about the project.
LOADER_TOOLS = frozenset({"ToolSearch"})


# An assistant message that only announces what comes next ("Now let me check the logs:").
_ANNOUNCEMENT = re.compile(
    r"^(?:(?:perfect|great|excellent|good|now|ok|okay|alright|got it|you're (?:absolutely )?right)[!,.]?\s+)*"
    r"(?:let me|let's|i'll|i will|i need to|i'm going to|now i'll|next,? i'll|now let me)\b", re.IGNORECASE)
ANNOUNCEMENT_CHARS = 300  # longer messages usually report something too
_SAYS_MORE = re.compile(r"[:;]\s+\S")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def is_aside(step: Step) -> bool:
    """Does this step say nothing of its own? A tool call that only showed or listed files (Read, Grep, `cat`,
    `sed -n`, `rg`, `ls` …: a copy of the repository, long and rich in every term of a question) or loaded tools
    (`LOADER_TOOLS`: the names of the tools it loaded), or an assistant
    message that only announces what it will do next. Their passages rank below what the session found, said and
    did (`search.retrieval`, tuning `aside_prior`)."""
    if step.role == "assistant":
        text = step.text.strip()
        # Only the announcement: nothing after a colon, at most a filler sentence before it ("Perfect! Now let me …").
        return (len(text) <= ANNOUNCEMENT_CHARS and bool(_ANNOUNCEMENT.match(text)) and not _SAYS_MORE.search(text)
                and len(_SENTENCE_END.split(text)) <= 2)
    if step.role != "run":
        return False
    return only_views_files(step.command) if step.command else step.tool in VIEW_TOOLS | LOADER_TOOLS


def header(step: Step) -> str:
    """Where a passage comes from, in a few words."""
    if step.role == "run":
        if step.command:
            return f"{step.tool or 'shell'} `{short_command(step.command, 70)}`:"
        target = step.tool_input.get("file_path") or step.tool_input.get("path") or ""
        return f"{step.tool} {clip(str(target), 70)}:" if target else f"{step.tool}:"
    if step.role == "user" and step.lane != "main":
        return "Subagent task:"  # a subagent's prompt is the parent agent's brief, not the user's voice
    return {"user": "User:", "assistant": "Assistant:", "compact": "Compaction summary:",
            "summary": "Summary:"}.get(step.role, f"{step.role}:")


def step_text(step: Step) -> str:
    """A step's whole text: a tool call's input joined with its result."""
    if step.role != "run":
        return step.text
    asked = tool_input_text(step)
    if step.command:  # the header names the command; a long one (a heredoc) still keeps its body here
        asked = step.command if len(step.command) > 70 else ""
        why = step.tool_input.get("description")  # Claude's Bash says what the command is for
        if isinstance(why, str) and why.strip():
            asked = f"({why.strip()})" + (f"\n{asked}" if asked else "")
    result = ("(failed) " if step.failed else "") + _LINE_NUMBERS.sub("", step.text)
    return "\n".join(part for part in (asked, result) if part.strip())


def head_and_tail(text: str, limit: int = MAX_ITEM_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n…[{len(text) - limit} chars left out]…\n{text[-half:]}"


_BREAK = re.compile(r"\s")


def _split_long(line: str, width: int) -> list[str]:
    """A line wider than `width`, cut at whitespace (never inside a word, path or hash when there is a space)."""
    out = []
    while len(line) > width:
        cut = max((m.start() for m in _BREAK.finditer(line, 0, width + 1)), default=-1)
        if cut <= width // 3:
            cut = width  # one unbroken token (minified code, a base64 run): cut it
        out.append(line[:cut].rstrip())
        line = line[cut:].lstrip()
    if line:
        out.append(line)
    return out


def passages(text: str, head: str, *, size: int = PASSAGE_CHARS, overlap: int = OVERLAP_CHARS) -> list[str]:
    """`text` as passages of at most `size` characters, each opened by `head`; consecutive passages share up to
    `overlap` characters of whole lines."""
    body = size - len(head) - 1
    lines = [piece for raw in text.splitlines() if raw.strip() for piece in _split_long(raw.strip(), body)]
    out: list[str] = []
    current: list[str] = []
    used = 0
    for line in lines:
        if current and used + len(line) + 1 > body:
            out.append(f"{head} " + "\n".join(current))
            kept: list[str] = []
            carried = 0
            for previous in reversed(current):
                if carried + len(previous) + 1 > overlap:
                    break
                kept.insert(0, previous)
                carried += len(previous) + 1
            current, used = kept, carried
        current.append(line)
        used += len(line) + 1
    if current:
        out.append(f"{head} " + "\n".join(current))
    return out


def evidence_of(steps: Sequence[Step], new_ids: set[int]) -> list[Evidence]:
    """Passages for the steps that hold a new event (earlier steps were written by an earlier run). A tool call
    seen twice (its hook and its transcript copy) is kept once, by the fuller text."""
    by_call: dict[str, Step] = {}
    chosen: list[Step] = []
    for step in steps:
        if step.role not in ("user", "assistant", "run", "compact", "summary") or not new_ids.intersection(step.ids):
            continue
        call = step.call if step.role == "run" else ""
        if call and call in by_call:
            if len(step.text) > len(by_call[call].text):
                chosen[chosen.index(by_call[call])] = step
                by_call[call] = step
            continue
        if call:
            by_call[call] = step
        chosen.append(step)
    out = []
    for step in chosen:
        text = head_and_tail(step_text(step))
        if len(text.strip()) < MIN_PASSAGE_CHARS:
            continue
        head = header(step)
        aside = is_aside(step)
        out += [Evidence(p, step.ts, list(step.ids), step.role, head, i, aside=aside)
                for i, p in enumerate(passages(text, head))]
    return with_context(out)


def with_context(found: list[Evidence], window: int = CONTEXT_WINDOW) -> list[Evidence]:
    """Each passage's `ctx`: the text of up to `window` passages before and after it in the session's order (the
    command before a result, the question before an answer), so the full-text index reads a passage with what
    surrounds it, at a lower weight than its own words."""
    return [replace(item, context=" ".join(other.text[:CONTEXT_CHARS] for other in
                                           (*found[max(0, i - window):i], *found[i + 1:i + 1 + window])))
            for i, item in enumerate(found)]
