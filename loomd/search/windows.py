"""Passages, not blobs: an evidence hit shows the windows of its whole step that match the query.

A step (a tool call with its result, a long message) is stored as overlapping passages (`workers/evidence.py`);
the best-ranked passage stands for the step in the results, and what it shows is taken from the whole step: the
lines that hold the most query terms, in their order, with their neighbours while room is left, within the
passage budget. So an answer whose words are spread over a long tool result (the command in its first line, the
checker names far below) comes back as one hit of the same size as a passage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

WINDOW_CHARS = 720  # what one evidence hit may show, header included (the size of a passage)
# The first hit may show twice that, as a search engine gives its best result the longest snippet: the answer is
# most often there, and a step's lines around the best run hold it when one passage's room does not (coding QA dev
# set, same store: all@1 .23 → .26, all@5 .54 → .56 for +84 tokens in the top 5; 3× gained nothing more).
LEAD_CHARS = 2 * WINDOW_CHARS
GAP = "…"
# An evidence header that names a command (`workers/evidence.py`'s `header`: "Bash `pytest -x`:").
COMMAND_HEAD = re.compile(r"^\S+ `.+`:$")
LONG_LINE = 400  # a line longer than this (a paragraph) is weighed sentence by sentence (coding QA: 240-600 alike)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
RUN_SHARE = 0.8  # of a window's room, for its one run of lines; the rest for lines holding terms the run missed


def merge_passages(head: str, texts: Sequence[str]) -> list[str]:
    """The step's lines, from its passages in order (each opens with `head`; consecutive ones overlap by whole
    lines, which are kept once)."""
    lines: list[str] = []
    for text in texts:
        body = text[len(head) + 1:] if text.startswith(head + " ") else text
        part = body.split("\n")
        overlap = next((k for k in range(min(len(part), len(lines)), 0, -1) if lines[-k:] == part[:k]), 0)
        lines += part[overlap:]
    return lines


def best_windows(head: str, lines: Sequence[str], holds: Callable[[str], Collection[str]],
                 budget: int = WINDOW_CHARS) -> str:
    """The window for `head`'s step (`window_lines`); a command's last line is its outcome ("Found 38 errors in 5
    files", "76 passed, 2 failed") and is always shown. A long line (a paragraph of prose) is weighed sentence by
    sentence: the one that answers can be shown without the paragraph around it."""
    units: list[str] = []
    joins: list[bool] = []  # does the unit go on the line of the one before it
    for line in lines:
        parts = _SENTENCE_END.split(line) if len(line) > LONG_LINE else [line]
        units += parts
        joins += [False] + [True] * (len(parts) - 1)
    outcome = next((i for i in range(len(units) - 1, -1, -1) if units[i].strip() and not joins[i]), None) \
        if COMMAND_HEAD.match(head) else None
    return window_lines(head, units, holds, budget, outcome, joins)


def window_lines(head: str, lines: Sequence[str], holds: Callable[[str], Collection[str]], budget: int,
                 outcome: int | None = None, joins: Sequence[bool] = ()) -> str:
    """`head` and a window of the step's lines within `budget` characters; `…` marks what was left out.

    Most of the room goes to one run of lines: the one that, starting a line before a line that holds query terms
    (`holds(line)` names them), covers the most distinct terms — an answer follows the line that names its subject
    (an error and then "fixed by", a heading and then its bullets, a command and then its output). What room is
    left takes the lines holding terms the run missed (a checker named far below the command), then the run goes on.
    `outcome`, a line always shown (cut to a quarter of the room if the window did not reach it). `joins[i]`: line
    `i` goes on the line before it (a sentence of a paragraph), after a space rather than a newline.
    """
    room = budget - len(head) - 1
    glue = [" " if i < len(joins) and joins[i] else "\n" for i in range(len(lines))]
    if sum(len(line) + 1 for line in lines) <= room:
        return f"{head} " + "".join(glue[i] + line if i else line for i, line in enumerate(lines))
    held = [frozenset(holds(line)) for line in lines]

    def cost(i: int) -> int:
        return min(len(lines[i]), room) + 3  # the newline and a possible gap mark

    short = room // 4  # what the outcome line may take when the window did not reach it
    if outcome is not None:
        room -= min(len(lines[outcome]), short) + 3
    run_room = RUN_SHARE * room
    best, start = -1, 0
    for anchor in (i for i, terms in enumerate(held) if terms):
        first = max(0, anchor - 1)
        covered: set[str] = set()
        used, i = 0, first
        while i < len(lines) and used + cost(i) <= run_room:
            used += cost(i)
            covered |= held[i]
            i += 1
        if len(covered) > best:
            best, start = len(covered), first
    chosen = {start}
    used, covered, i = cost(start), set(held[start]), start + 1
    while i < len(lines) and used + cost(i) <= run_room:
        chosen.add(i)
        used += cost(i)
        covered |= held[i]
        i += 1
    for j in sorted((j for j in range(len(lines)) if held[j] - covered), key=lambda j: (-len(held[j] - covered), j)):
        if held[j] - covered and used + cost(j) <= room:
            chosen.add(j)
            used += cost(j)
            covered |= held[j]
    while i < len(lines) and used + cost(i) <= room:
        if i not in chosen:
            chosen.add(i)
            used += cost(i)
        i += 1
    added = outcome if outcome is not None and outcome not in chosen else None
    if added is not None:
        chosen.add(added)
    out = ""
    previous = -1
    for i in sorted(chosen):
        text = lines[i][:short] if i == added else lines[i][:room]
        if previous >= 0 and i != previous + 1 or previous < 0 and i > 0:
            out += ("\n" if out else "") + GAP + "\n" + text
        else:
            out += (glue[i] if out else "") + text
        previous = i
    if previous < len(lines) - 1:
        out += "\n" + GAP
    return f"{head} {out}"


def passage_head(meta: Any) -> str | None:
    """The header a passage's step opens with, from its `meta` column (None for a passage stored before)."""
    try:
        value = json.loads(meta or "{}").get("head")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None
