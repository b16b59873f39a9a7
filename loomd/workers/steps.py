"""Events as the observer sees them: stored rows -> ordered steps (a user turn, an assistant message, a tool run).

Hook and transcript copies of one thing merge; a tool call is paired with its result. What a command line does
(`command_heads`), how it failed, what it committed is read by `loomd.ingest.reading`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loomd.ingest.reading import SHELL_TOOLS, failed_output, response_text, shell_command
from loomd.store.memories import content_hash

# --- events as the observer sees them -------------------------------------------------------------------------

# The columns an event is read with (`SourceEvent.from_row`), in order.
EVENT_COLUMNS = "id, session_id, kind, ts, agent, project, tool_name, tool_use_id, payload"


class EventRow(NamedTuple):
    """One event as read with EVENT_COLUMNS, its payload still JSON text: what the observer reads and sends to the
    offload process, where `SourceEvent.from_row` parses it."""

    id: int
    session_id: str
    kind: str
    ts: float
    agent: str | None
    project: str | None
    tool_name: str | None
    tool_use_id: str | None
    payload: str | None


@dataclass
class SourceEvent:
    """One stored event (a row of `events`), payload decoded."""

    id: int
    session_id: str
    kind: str
    ts: float
    agent: str
    project: str
    tool_name: str | None
    tool_use_id: str | None
    payload: dict[str, Any]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> SourceEvent:
        """An event as read by `EVENT_COLUMNS` (a row or a plain tuple of it, in that order)."""
        event_id, session_id, kind, ts, agent, project, tool_name, tool_use_id, raw = row
        try:
            payload = json.loads(raw)
        except (TypeError, ValueError):
            payload = {}
        return cls(int(event_id), session_id, kind, float(ts), agent, project, tool_name, tool_use_id,
                   payload if isinstance(payload, dict) else {})

    @property
    def lane(self) -> str:
        """'main', or the subagent's id: a subagent's turns interleave with the parent's in one session."""
        if self.payload.get("is_sidechain") or self.payload.get("agent_id"):
            return str(self.payload.get("agent_id") or "sidechain")
        return "main"


@dataclass
class Observation:
    type: str
    text: str
    ts: float
    sources: list[int]
    importance: float = 0.5
    meta: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, "text": self.text, "ts": self.ts, "sources": self.sources,
                "importance": self.importance, "meta": self.meta}


@dataclass
class Step:
    role: str  # user | assistant | run | compact | summary | marker
    text: str
    ts: float
    ids: list[int]
    lane: str = "main"
    tool: str = ""
    tool_input: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    failed: bool = False
    rejected: bool = False
    final: bool = False  # an assistant message known to end its turn (Stop hook)
    call: str = ""  # a tool run's tool_use_id: its hook and transcript copies share it
    unanswered: bool = False  # a call the session ended on, with no result (`to_steps(ended=True)`)


_REJECTED = re.compile(r"The user doesn't want to (?:proceed with this tool use|take this action)|"
                       r"\[Request interrupted by user|tool use was rejected", re.IGNORECASE)


NO_RESULT = "(no result recorded)"  # a call the session ended on: the transcript holds no result for it


def to_steps(events: Sequence[SourceEvent], ended: bool = False) -> list[Step]:
    """Pair calls with results, merge hook and transcript copies, and drop what carries no meaning.

    `ended` (the session ended or went quiet): a call still without its result is a step of its own, with
    `NO_RESULT` — the command a session ended on (an export, a deploy) is often what a later agent asks about.
    Before that, the result may still come, and the call waits for it."""
    uses: dict[str, SourceEvent] = {}
    steps: list[Step] = []
    seen_text: dict[str, Step] = {}
    for ev in sorted(events, key=lambda e: e.id):
        p, kind = ev.payload, ev.kind
        if kind in ("tool_use", "PreToolUse"):
            if ev.tool_use_id:
                uses[ev.tool_use_id] = ev
            continue
        if kind in ("tool_result", "PostToolUse", "PostToolUseFailure"):
            use = uses.pop(ev.tool_use_id or "", None)
            if kind == "tool_result":
                if use is None:
                    continue  # a result whose call we never saw: nothing to say about it
                steps.append(_run(ev, use.tool_name or "", use.payload.get("tool_input"), str(p.get("text") or ""),
                                  bool(p.get("is_error")), [use.id, ev.id]))
            else:  # the hook's copy carries the call's input itself
                output, flagged = response_text(p.get("tool_response") or p.get("error"))
                steps.append(_run(ev, ev.tool_name or str(p.get("tool_name") or ""), p.get("tool_input"), output,
                                  flagged or kind == "PostToolUseFailure", [ev.id]))
            continue
        text, role, final = "", "", False
        if kind in ("user_message", "UserPromptSubmit"):
            role, text = "user", str(p.get("text") if kind == "user_message" else p.get("prompt") or "")
        elif kind == "assistant_message":
            role, text = "assistant", str(p.get("text") or "")
        elif kind in ("Stop", "SubagentStop", "TurnComplete"):
            role, final = "assistant", True
            text = str(p.get("last_assistant_message") or p.get("last-assistant-message") or "")
        elif kind == "compact_summary":
            role, text = "compact", str(p.get("text") or "")
        elif kind == "PostCompact":  # the hook form of the same summary (Claude Code 2.1)
            role, text = "compact", str(p.get("compact_summary") or "")
        elif kind == "summary":
            role, text = "summary", str(p.get("text") or "")
        elif kind == "PreCompact":
            role, text = "marker", str(p.get("custom_instructions") or "")
        if not role or not text.strip():
            continue
        digest = f"{role}:{content_hash(text)[:16]}"
        if digest in seen_text and role in ("assistant", "user", "summary"):
            earlier = seen_text[digest]
            earlier.ids.append(ev.id)
            earlier.final = earlier.final or final
            continue
        step = Step(role, text, ev.ts, [ev.id], ev.lane, final=final)
        seen_text[digest] = step
        steps.append(step)
    if ended:
        for use in uses.values():
            at = next((i for i, step in enumerate(steps) if max(step.ids) > use.id), len(steps))
            steps.insert(at, _run(use, use.tool_name or "", use.payload.get("tool_input"), NO_RESULT, False, [use.id],
                                  unanswered=True))
    return steps


def _run(ev: SourceEvent, tool: str, tool_input: Any, output: str, flagged: bool, ids: list[int],
         unanswered: bool = False) -> Step:
    """A tool run's step: the call's input, what it returned, whether it failed or the user rejected it."""
    tool_input = tool_input if isinstance(tool_input, dict) else {}
    command = shell_command(tool_input) if tool in SHELL_TOOLS or "cmd" in tool_input else ""
    return Step("run", output, ev.ts, ids, ev.lane, tool, tool_input, command,
                failed=failed_output(output, flagged), rejected=bool(_REJECTED.search(output[:400])),
                call=ev.tool_use_id or "", unanswered=unanswered)
