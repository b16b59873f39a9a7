"""Passages, not blobs: an evidence hit shows the windows of its whole step that match the query.

A step (a tool call with its result, a long message) is stored as overlapping passages (`workers/evidence.py`);
the best-ranked passage stands for the step in the results, and what it shows is taken from the whole step: the
lines that hold the most query terms, in their order, with their neighbours while room is left, within the
passage budget. So an answer whose words are spread over a long tool result (the command in its first line, the
checker names far below) comes back as one hit of the same size as a passage.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

WINDOW_CHARS = 720  # what one evidence hit may show, header included (the size of a passage)
GAP = "…"


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


def best_windows(head: str, lines: Sequence[str], holds: Callable[[str], int], budget: int = WINDOW_CHARS) -> str:
    """`head` and the lines that hold the most query terms (`holds(line)` counts them), then their neighbours,
    in their order, within `budget` characters; `…` marks what was left out."""
    room = budget - len(head) - 1
    if sum(len(line) + 1 for line in lines) <= room:
        return f"{head} " + "\n".join(lines)
    scores = [holds(line) for line in lines]
    chosen: set[int] = set()
    used = 0

    def take(i: int) -> bool:
        nonlocal used
        cost = len(lines[i]) + 3  # the newline and a possible gap mark
        if i in chosen or used + cost > room:
            return False
        chosen.add(i)
        used += cost
        return True

    for i in sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i)):
        take(i)
    for distance in range(1, len(lines)):  # context around what matched, nearest first
        for i in sorted(chosen):
            for j in (i - distance, i + distance):
                if 0 <= j < len(lines):
                    take(j)
        if used >= room - 20:
            break
    if not chosen:
        return f"{head} " + "\n".join(lines)[:room]
    out: list[str] = []
    previous = -1
    for i in sorted(chosen):
        if previous >= 0 and i != previous + 1 or previous < 0 and i > 0:
            out.append(GAP)
        out.append(lines[i])
        previous = i
    if previous < len(lines) - 1:
        out.append(GAP)
    return f"{head} " + "\n".join(out)


def passage_head(meta: Any) -> str | None:
    """The header a passage's step opens with, from its `meta` column (None for a passage stored before)."""
    try:
        value = json.loads(meta or "{}").get("head")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None
