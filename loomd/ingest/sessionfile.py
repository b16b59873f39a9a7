"""A transcript's items as the redacted `Event`s they are stored as: the tailer's chunks, and whole files read at
once (`read_session_file`: the tailer's `import_file`, and `loom import`'s parser processes).

Kept apart from the tailer so that a parser process imports only this, the transcript parsers, the event model and
redaction (not the tailer's watcher, the writer or the store): a lighter process to start, and less resident
memory for each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from loomd.errors import BadRequest, NotFound
from loomd.ingest.events import Event, clean_strings, precompute, prompt_dedup
from loomd.ingest.transcript import (
    CodexState,
    Format,
    TranscriptItem,
    codex_state_for,
    file_objects,
    loads,
    parse_claude_line,
    parse_codex_line,
    read_subagent_meta,
    sniff,
)
from loomd.redact import redact_value


def to_event(
    item: TranscriptItem, *, session_id: str, cwd: str | None, max_chars: int, transcript_path: str | None = None,
    subagent: str | None = None, meta: dict[str, str] | None = None,
) -> Event:
    """The stored form of one transcript item; `dedup` lets hook and transcript copies of one thing merge."""
    sidechain = item.is_sidechain or subagent is not None
    raw: dict[str, Any] = {
        "text": item.text, "tool_name": item.tool_name, "tool_input": item.tool_input, "is_error": item.is_error,
        "uuid": item.uuid, "message_id": item.message_id, "is_sidechain": sidechain,
        "agent_id": item.agent_id or subagent,
    }
    if sidechain and meta:
        raw["agent_type"], raw["agent_description"] = meta.get("agentType"), meta.get("description")
    payload = redact_value(clean_strings({k: v for k, v in raw.items() if v not in (None, "", False, {}, [])},
                                            max_chars))
    assert isinstance(payload, dict)
    if item.kind == "user_message":
        # The UserPromptSubmit hook hashes its prompt after truncation and redaction; hash the same form of the text.
        dedup = prompt_dedup(str(payload.get("text", "")))
    else:
        dedup = item.key
    return Event(
        key=f"t:{session_id}:{item.key}", agent=item.agent, session_id=session_id, kind=item.kind,
        source="transcript", ts=item.ts or time.time(), payload=payload, cwd=item.cwd or cwd,
        transcript_path=transcript_path, tool_name=item.tool_name, tool_use_id=item.tool_use_id, dedup=dedup,
    )


def parse_line(obj: dict[str, Any], fmt: Format, state: CodexState, max_chars: int) -> list[TranscriptItem]:
    """One transcript line's items, each text kept up to `max_tool_output_chars` (the hooks' limit too)."""
    if fmt == "codex":
        return parse_codex_line(obj, state, max_chars=max_chars)
    return parse_claude_line(obj, max_chars=max_chars)


def read_session_file(p: Path, session_id: str | None, cwd: str | None, limit: int) -> tuple[Format, list[Event]]:
    """A whole session file's events, parsed and redacted as tailing does (blocking; `loom import` runs it in a
    child process): a chat.json array, or a JSONL file whose last line may lack its newline.

    A JSONL file is parsed a line at a time as it is read: only its items are held, never every line's decoded
    object at once (a parser process's resident memory is about its events, not the file)."""
    p = p.expanduser()
    if not p.is_file():
        raise NotFound(f"no such file: {p}")
    fmt, head = sniff(p)
    if fmt is None:
        raise BadRequest(f"{p} is not a Claude or Codex transcript")
    state = codex_state_for(p)
    try:
        if fmt == "claude_array":
            data = loads(p.read_bytes())
            items = [i for o in data if isinstance(o, dict) for i in parse_line(o, fmt, state, limit)]
            del data
        else:
            items = [i for o in file_objects(p, head) for i in parse_line(o, fmt, state, limit)]
    except OSError as exc:
        raise BadRequest(f"cannot read {p}: {exc.strerror or exc}") from exc
    fallback = session_id or next((i.session_id for i in items if i.session_id), "") or p.stem
    subagent = p.stem.removeprefix("agent-") if p.name.startswith("agent-") and fmt == "claude" else None
    meta = read_subagent_meta(p) if subagent else {}
    events: list[Event] = []
    items.reverse()
    while items:  # each item let go once it is an event: a parser holds one form of the file, not both
        item = items.pop()
        events.append(to_event(item, session_id=session_id or item.session_id or fallback, cwd=cwd,
                               max_chars=limit, subagent=subagent, meta=meta))
    precompute(events)
    return fmt, events
