"""Hook and transcript events -> normalised, redacted, idempotent `Event`s (the writer commits them)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from loomd.errors import BadRequest
from loomd.protocol import ArgSpec
from loomd.redact import redact_value

log = logging.getLogger(__name__)

AGENTS = ("claude", "codex")
LATEST_TS = 32503680000.0  # 3000-01-01: later (or NaN, or infinite) times are input errors
# Events that carry the text worth remembering, and where it sits in the payload.
TEXT_FIELDS = ("prompt", "last_assistant_message", "message", "custom_instructions", "last-assistant-message",
               "compact_summary")


@dataclass
class Event:
    """One normalised event, ready to insert. `key` is the idempotency key; `dedup` merges hook and transcript."""

    key: str
    agent: str
    session_id: str
    kind: str
    source: str
    ts: float
    payload: dict[str, Any]
    cwd: str | None = None
    project: str = ""
    transcript_path: str | None = None
    tool_name: str | None = None
    tool_use_id: str | None = None
    dedup: str | None = None
    id: int | None = None
    stored: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Fields read from JSON text ("\ud800" is valid JSON) may hold a lone surrogate, which SQLite cannot store.
        for name in ("key", "agent", "session_id", "kind", "source", "cwd", "project", "transcript_path", "tool_name",
                     "tool_use_id", "dedup"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.isascii():
                setattr(self, name, without_surrogates(value))

    # Both read the payload, which is final once the event exists (redacted and cut where it was parsed). Cached:
    # the commit and the scheduler's listener both want `tokens`; and `loom import`'s parser processes compute both
    # (`precompute`), so the daemon's commit neither walks nor serialises the payload again.
    @cached_property
    def tokens(self) -> int:
        return max(1, len(event_text(self)) // 4)

    @cached_property
    def payload_json(self) -> str:
        """The payload as the `events` row stores it."""
        return json.dumps(self.payload, ensure_ascii=False)


def precompute(events: Iterable[Event]) -> None:
    """Fill each event's cached `tokens` and `payload_json` here (a parser process), where the CPU is not the
    event loop's: the values travel with the pickled event."""
    for event in events:
        _ = (event.tokens, event.payload_json)  # a cached_property keeps what its first read computed


MAX_DEPTH = 64  # deeper JSON is cut with a marker: every later walk (redaction, capture) then stays bounded
_BREAKS = frozenset(" \t\r\n\"'`,;()[]{}<>|")
CUT_BACKOFF = 512


def clean_cut(text: str, limit: int) -> int:
    """Where to cut `text` at most `limit` long: never inside a word, so no token or key is kept in part.

    Truncation runs before redaction, and half a key no longer looks like a key: `AWS_SECRET_ACCESS_KEY=wJal…`
    cut after 38 of its 40 characters would keep 38. A run longer than CUT_BACKOFF is cut where it stands.
    """
    cut = limit
    if text[cut] in _BREAKS:
        return cut
    while cut > limit - CUT_BACKOFF and cut > 0 and text[cut - 1] not in _BREAKS:
        cut -= 1
    return cut if cut > limit - CUT_BACKOFF and cut > 0 else limit


_SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str) -> str:
    """A lone UTF-16 surrogate (JSON may escape one) becomes U+FFFD: it has no UTF-8 form, so nothing could store
    it. isascii() is a flag check in CPython, so ASCII text costs nothing."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


MAX_LIST = 1000  # items kept of one list; the rest is counted in a marker item
MAX_NODES = 10_000  # values kept of one payload: redaction and capture walk every one, on every event
MAX_PAYLOAD_CHARS = 1_000_000  # characters kept of one payload's strings, all of them together


@dataclass
class Budget:
    """What is left of one payload's node and character allowance while it is walked."""

    nodes: int = MAX_NODES
    chars: int = MAX_PAYLOAD_CHARS


def _cut_string(value: str, limit: int) -> str:
    cut = clean_cut(value, limit) if limit > 0 else 0
    return value[:cut] + f"…[truncated {len(value) - cut} chars]"


def clean_strings(value: Any, max_chars: int, depth: int = 0, budget: Budget | None = None) -> Any:
    """Cut long strings and too-deep branches with a marker (oversized output is kept in part, never rejected), and
    replace lone surrogates, in keys and values alike.

    The walk is bounded: past `budget` (MAX_NODES values, MAX_PAYLOAD_CHARS characters) a map keeps a marker key
    `…` saying how many keys were cut, a list a marker item, a string its truncation mark; nothing later (redaction,
    capture, the stored row) ever sees more than that. Each nested map or list may use only its fair share of what
    is left, so one huge `tool_input` cannot crowd out the `tool_response` after it.
    """
    budget = budget if budget is not None else Budget()
    budget.nodes -= 1
    if isinstance(value, str):
        value = without_surrogates(value)
        limit = min(max_chars, max(budget.chars, 0))
        if len(value) > limit:
            value = _cut_string(value, limit)
        budget.chars -= len(value)
        return value
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        return f"…[truncated: nested deeper than {MAX_DEPTH} levels]"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        containers = _containers(value.values(), budget)
        for k, v in value.items():
            if budget.nodes <= 0 or budget.chars <= 0:
                out["…"] = f"…[truncated: {len(value) - len(out)} more keys]"
                break
            key = without_surrogates(str(k))
            budget.chars -= len(key)
            out[key] = _clean_child(v, max_chars, depth, budget, containers)
            containers -= isinstance(v, dict | list)
        return out
    if isinstance(value, list):
        items: list[Any] = []
        containers = _containers(value, budget)
        for v in value:
            if len(items) >= MAX_LIST or budget.nodes <= 0 or budget.chars <= 0:
                items.append(f"…[truncated: {len(value) - len(items)} more items]")
                break
            items.append(_clean_child(v, max_chars, depth, budget, containers))
            containers -= isinstance(v, dict | list)
        return items
    return value


def _containers(values: Iterable[Any], budget: Budget) -> int:
    """How many of the first values (as many as the budget could visit) are maps or lists."""
    return sum(isinstance(v, dict | list) for v in itertools.islice(values, max(budget.nodes, 0)))


def _clean_child(value: Any, max_chars: int, depth: int, budget: Budget, containers: int) -> Any:
    if not isinstance(value, dict | list) or containers <= 1:
        return clean_strings(value, max_chars, depth + 1, budget)
    share = Budget(budget.nodes // containers, budget.chars // containers)
    nodes, chars = share.nodes, share.chars
    cleaned = clean_strings(value, max_chars, depth + 1, share)
    budget.nodes -= nodes - share.nodes
    budget.chars -= chars - share.chars
    return cleaned


def detect_agent(hint: str, payload: dict[str, Any]) -> str:
    if hint in AGENTS:
        return hint
    transcript = str(payload.get("transcript_path") or "")
    if "turn_id" in payload or "thread-id" in payload or "/rollout-" in transcript or "/.codex/" in transcript:
        return "codex"
    return "claude"


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:20]


PROMPT_MARK = "p:"
BOTH_COPIES = ":both"


def prompt_dedup(text: str) -> str:
    """Hook prompts and transcript user lines of one session pair up on this (`EventWriter`: by identity, not by
    text alone; a row whose hook and transcript copies have both arrived carries `paired_dedup` of it)."""
    return PROMPT_MARK + _short_hash(" ".join(text.split()))


def paired_dedup(dedup: str) -> str:
    return dedup + BOTH_COPIES


def parse_hook(
    agent_hint: str, event_name: str, raw: bytes | str, eid: str | None, *, max_chars: int, now: float | None = None
) -> Event:
    """Turn the bytes a hook received into an Event; the shim parsed nothing, so every check happens here."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # One bad byte (a tool's binary output, a cut multi-byte character) must not cost the whole event:
            # each invalid byte becomes U+FFFD, as in the transcripts.
            text = raw.decode("utf-8", "replace")
            log.info("hook payload is not valid UTF-8 (first bad byte at %d); kept with U+FFFD for each bad byte",
                     exc.start)
    else:
        text = raw
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"hook payload is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(payload, dict):
        raise BadRequest(f"hook payload must be a JSON object, got {type(payload).__name__}")
    agent = detect_agent(agent_hint, payload)
    kind = str(payload.get("hook_event_name") or event_name or "")
    if payload.get("type") == "agent-turn-complete" or event_name == "notify":
        kind = "TurnComplete"
    if not kind:
        raise BadRequest("hook event name missing: pass 'event' or include 'hook_event_name'")
    session_id = str(payload.get("session_id") or payload.get("thread-id") or "")
    if not session_id:
        raise BadRequest("hook payload has no session_id")
    payload = redact_value(clean_strings(payload, max_chars))
    assert isinstance(payload, dict)
    tool_use_id = payload.get("tool_use_id")
    tool_use_id = str(tool_use_id) if tool_use_id else None
    dedup = None
    if tool_use_id and kind == "PostToolUse":
        dedup = f"tr:{tool_use_id}"
    elif tool_use_id and kind == "PreToolUse":
        dedup = f"tu:{tool_use_id}"
    elif kind == "UserPromptSubmit" and isinstance(payload.get("prompt"), str):
        dedup = prompt_dedup(payload["prompt"])
    key = f"eid:{eid}" if eid else "h:" + hashlib.sha256(
        f"{agent}\0{kind}\0".encode() + (raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    ).hexdigest()
    return Event(
        key=key, agent=agent, session_id=session_id, kind=kind, source="hook",
        ts=time.time() if now is None else now, payload=payload,
        cwd=str(payload["cwd"]) if payload.get("cwd") else None,
        transcript_path=str(payload["transcript_path"]) if payload.get("transcript_path") else None,
        tool_name=str(payload["tool_name"]) if payload.get("tool_name") else None,
        tool_use_id=tool_use_id, dedup=dedup,
    )


_EVENT_SPEC: dict[str, type | tuple[type, ...]] = {
    "agent": str, "session_id": str, "kind": str, "payload": dict, "ts": (int, float), "cwd": str, "key": str,
    "project": str, "tool_name": str, "tool_use_id": str, "source": str, "transcript_path": str,
}


def parse_normalised(obj: Any, *, max_chars: int) -> Event:
    """An event a script or the transcript tailer already shaped: validate its fields and types."""
    if not isinstance(obj, dict):
        raise BadRequest(f"an event must be a map, got {type(obj).__name__}")
    for name, kind in _EVENT_SPEC.items():
        if name in obj and obj[name] is not None and not isinstance(obj[name], kind):
            raise BadRequest(f"event field '{name}' has the wrong type ({type(obj[name]).__name__})")
    unknown = set(obj) - set(_EVENT_SPEC) - {"dedup"}
    if unknown:
        raise BadRequest(f"unknown event field(s): {', '.join(sorted(map(str, unknown)))}")
    for name in ("session_id", "kind"):
        if not obj.get(name):
            raise BadRequest(f"event field '{name}' is required")
    if obj.get("ts") is not None and not 0 <= obj["ts"] <= LATEST_TS:
        raise BadRequest(f"event field 'ts' must be a Unix time between 0 and {LATEST_TS:.0f}")
    payload = redact_value(clean_strings(obj.get("payload") or {}, max_chars))
    assert isinstance(payload, dict)
    agent = str(obj.get("agent") or "script")
    body = json.dumps(payload, sort_keys=True, ensure_ascii=False)
    key = obj.get("key") or "n:" + _short_hash(f"{agent}\0{obj['session_id']}\0{obj['kind']}\0{obj.get('ts')}\0{body}")
    return Event(
        key=str(key), agent=agent, session_id=str(obj["session_id"]), kind=str(obj["kind"]),
        source=str(obj.get("source") or "script"), ts=float(obj.get("ts") or time.time()), payload=payload,
        cwd=obj.get("cwd"), project=str(obj.get("project") or ""), transcript_path=obj.get("transcript_path"),
        tool_name=obj.get("tool_name"), tool_use_id=obj.get("tool_use_id"), dedup=obj.get("dedup"),
    )


def event_text(event: Event) -> str:
    """The human-meaningful text of an event, for token counts, capture and the observer."""
    p = event.payload
    parts: list[str] = []
    for name in TEXT_FIELDS:
        if isinstance(p.get(name), str):
            parts.append(p[name])
    if isinstance(p.get("text"), str):
        parts.append(p["text"])
    if event.tool_name:
        parts.append(f"{event.tool_name}: {json.dumps(p.get('tool_input'), ensure_ascii=False)[:500]}")
    response = p.get("tool_response")
    if isinstance(response, str):
        parts.append(response[:2000])
    elif isinstance(response, dict):
        for name in ("stdout", "stderr", "output", "error", "content"):
            if isinstance(response.get(name), str):
                parts.append(response[name][:2000])
    return "\n".join(parts)


MAX_BATCH = 1000
INGEST_ARGS: ArgSpec = {
    "raw": ((bytes, str), None), "agent": (str, "auto"), "event": (str, ""), "eid": (str, None),
    "events": (list, None), "item": (dict, None), "sent_at": (int, None),
}


def sent_at(ms: int | None) -> float | None:
    """The shim's send time (ms) as the event's time: a spooled event keeps when it happened, not when replayed."""
    return ms / 1000 if ms is not None and 0 < ms <= LATEST_TS * 1000 else None
