"""Pure parsing of agent session files (Claude Code JSONL, Codex rollouts) into `TranscriptItem`s.

No sockets, no database: the tailer feeds `read_lines` output to `parse_claude_line` / `parse_codex_line` and stores
the items by `key`. See ../shared/design/TRANSCRIPTS.md for the formats.

Key scheme (stable across re-reads; never includes a byte offset or line number):
- `tu:<tool_use id>` / `tr:<tool_use id>` for tool calls and their results (both agents).
- `at:<message.id>:<sha1(text)>` for a Claude assistant text block; one API message is split over several lines
  sharing `message.id` (one block per line), so the content hash, not the block index, tells the blocks apart.
- `u:<uuid>` for a Claude user line, `cs:<uuid>` for a compact summary, `sys:<uuid>` for an away summary,
  `sum:<leafUuid>:<sha1(summary)>` for a `summary` line (these have no uuid and are copied between session files).
- Codex messages carry no id: `cu:`/`ca:`/`cs:` + `<session id>:<sha1(timestamp, text)>`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import msgspec

log = logging.getLogger(__name__)

Agent = Literal["claude", "codex"]
Kind = Literal["user_message", "assistant_message", "tool_use", "tool_result", "compact_summary", "summary"]
Format = Literal["claude", "codex", "claude_array"]

# A tool_use line is a label for search results, not the payload: keep it short.
_TOOL_TEXT_CHARS = 500
_CODEX_TYPES = frozenset({"session_meta", "response_item", "event_msg", "turn_context", "compacted"})
_CLAUDE_TYPES = frozenset(
    "user assistant system summary file-history-snapshot queue-operation progress attachment permission-mode mode"
    " last-prompt".split()
)
# Codex injects these as role=user messages before the first real prompt; they are config, not conversation.
_CODEX_INJECTED_PREFIXES = (
    "<environment_context>",
    "<user_instructions>",
    "# AGENTS.md instructions",
    "<INSTRUCTIONS>",
    "<turn_aborted>",
)
_PATCH_FILE_RE = re.compile(r"^\*\*\* (?:Add|Update|Delete) File: (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class TranscriptItem:
    agent: Agent
    session_id: str
    kind: Kind
    ts: float
    text: str
    key: str
    tool_name: str | None = None
    tool_use_id: str | None = None
    tool_input: dict[str, Any] | None = None
    is_error: bool = False
    message_id: str | None = None
    uuid: str | None = None
    is_sidechain: bool = False
    agent_id: str | None = None
    cwd: str | None = None


@dataclass
class CodexState:
    """What later Codex lines need from earlier ones. Plain data, so a tailer can persist it next to its offset."""

    session_id: str = ""
    cwd: str | None = None
    # role -> "<source>:<digest>" of the last message emitted for that role; Codex writes each user/assistant text
    # twice (response_item and event_msg), and the second copy is dropped when it matches from the other source.
    recent: dict[str, str] = field(default_factory=dict)


_DECODER = msgspec.json.Decoder()


def loads(raw: bytes | str) -> Any:
    """`json.loads`, in a third of its time: a transcript line is decoded by msgspec (exact on every value json
    gives: integers of any size, correctly rounded floats), and by json itself where msgspec refuses what json
    accepts (a lone surrogate escape, NaN, a BOM, 1e400), so each line decodes to the very same value or fails
    with the same ValueError. (A str holding a lone surrogate has no UTF-8 for msgspec to read: json's too.)"""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeEncodeError):
        return json.loads(raw)


def _digest(*parts: str, n: int = 16) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:n]


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[truncated {len(text) - limit} chars]"


def _clip_values(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return _clip(value, limit)
    if isinstance(value, dict):
        return {k: _clip_values(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_clip_values(v, limit) for v in value]
    return value


def _ts(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return 0.0
    return 0.0


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _command_text(cmd: Any) -> str | None:
    if isinstance(cmd, str):
        return cmd
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        # Codex wraps every shell call as ["bash", "-lc", "<script>"]; the script is what matters.
        if len(cmd) == 3 and cmd[0].rsplit("/", 1)[-1] in ("bash", "sh", "zsh") and cmd[1] in ("-lc", "-c"):
            return cmd[2]
        return shlex.join(cmd)
    return None


def render_tool_use(name: str, tool_input: Any) -> str:
    """A one-line label for a tool call, e.g. `Bash: ls -la` or `Edit: src/app.py`."""
    inp = tool_input if isinstance(tool_input, dict) else {}
    detail: str | None = None
    command = _command_text(inp.get("command", inp.get("cmd")))
    patch = inp.get("input")
    if command is not None:
        detail = command
    elif isinstance(patch, str) and "*** Begin Patch" in patch:
        detail = ", ".join(_PATCH_FILE_RE.findall(patch)) or "patch"
    else:
        labels = ("file_path", "notebook_path", "filePath", "pattern", "path", "url", "query", "description", "skill")
        for field_name in labels:
            val = inp.get(field_name)
            if isinstance(val, str) and val:
                detail = val
                if field_name == "pattern" and isinstance(inp.get("path"), str):
                    detail = f"{val} in {inp['path']}"
                break
    if detail is None:
        if isinstance(inp.get("todos"), list):
            detail = f"{len(inp['todos'])} todos"
        elif isinstance(inp.get("plan"), list):
            detail = f"{len(inp['plan'])} steps"
        else:
            detail = json.dumps(inp, ensure_ascii=False, sort_keys=True) if inp else ""
    return _clip(f"{name}: {detail}" if detail else name, _TOOL_TEXT_CHARS)


def _summarize_tool_use_result(tur: Any) -> str:
    # toolUseResult can hold whole files (Edit's originalFile); only a few flags are worth a line of text.
    if not isinstance(tur, dict):
        return ""
    bits: list[str] = []
    if isinstance(tur.get("returnCodeInterpretation"), str):
        bits.append(tur["returnCodeInterpretation"])
    if tur.get("interrupted") is True:
        bits.append("[interrupted]")
    if isinstance(tur.get("persistedOutputPath"), str):
        bits.append(f"[output saved to {tur['persistedOutputPath']}]")
    return " ".join(bits)


def _block_text(content: Any) -> str:
    """Text of a str-or-blocks content; images and documents become placeholders, their bytes are dropped."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        if not isinstance(block, dict):
            continue
        btype = block.get("type")
        if btype in ("text", "input_text", "output_text") and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif btype in ("image", "input_image"):
            parts.append("[image]")
        elif btype == "document":
            parts.append("[document]")
        elif btype == "tool_reference":
            parts.append(f"[tool_reference: {block.get('tool_name', '?')}]")
    return "\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------------------------
# Claude Code


def parse_claude_line(obj: dict[str, Any], *, max_chars: int = 4000) -> list[TranscriptItem]:
    """Items carried by one Claude Code transcript line (JSONL line or chat.json array element)."""
    if not isinstance(obj, dict) or obj.get("isMeta") is True:
        return []
    ltype = obj.get("type")
    base: dict[str, Any] = {
        "agent": "claude",
        "session_id": obj.get("sessionId") if isinstance(obj.get("sessionId"), str) else "",
        "ts": _ts(obj.get("timestamp")),
        "uuid": _str_or_none(obj.get("uuid")),
        "is_sidechain": obj.get("isSidechain") is True,
        "agent_id": _str_or_none(obj.get("agentId")),
        "cwd": _str_or_none(obj.get("cwd")),
    }
    if ltype == "user":
        return _claude_user(obj, base, max_chars)
    if ltype == "assistant":
        return _claude_assistant(obj, base, max_chars)
    if ltype == "summary":
        summary = obj.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            return []
        leaf = obj.get("leafUuid") if isinstance(obj.get("leafUuid"), str) else ""
        return [TranscriptItem(kind="summary", text=summary, key=f"sum:{leaf}:{_digest(summary, n=12)}", **base)]
    if ltype == "system" and obj.get("subtype") == "away_summary":
        content = obj.get("content")
        if not isinstance(content, str) or not content.strip():
            return []
        return [TranscriptItem(kind="summary", text=content, key=_line_key("sys", obj, content), **base)]
    if ltype == "queue-operation" and obj.get("operation") == "remove":
        # Older Claude Code: a prompt typed while the agent was busy is queued ("enqueue") and then either sent as
        # its own user line ("dequeue") or taken into the running turn ("remove"), which writes no user line: the
        # queue line is then the only copy of the user's words.
        prompt = _block_text(obj.get("content"))
        if prompt.strip():
            return [TranscriptItem(kind="user_message", text=prompt, key=_line_key("uq", obj, prompt), **base)]
        return []
    if ltype == "attachment":
        att = obj.get("attachment")
        # A prompt typed while the agent was busy is stored only as this attachment. Every other attachment is
        # harness context (file bodies, tool listings, our own hook output echoed back) and is skipped.
        if isinstance(att, dict) and att.get("type") == "queued_command":
            prompt = _block_text(att.get("prompt"))
            if prompt.strip():
                return [TranscriptItem(kind="user_message", text=prompt, key=_line_key("u", obj, prompt), **base)]
    return []


def _line_key(prefix: str, obj: dict[str, Any], text: str) -> str:
    uuid = obj.get("uuid")
    if isinstance(uuid, str) and uuid:
        return f"{prefix}:{uuid}"
    sid = _str_or_none(obj.get("sessionId")) or ""
    return f"{prefix}:h:{_digest(sid, str(obj.get('timestamp', '')), text, n=20)}"


def _claude_user(obj: dict[str, Any], base: dict[str, Any], max_chars: int) -> list[TranscriptItem]:
    message = obj.get("message")
    if not isinstance(message, dict):
        return []
    content = message.get("content")
    items: list[TranscriptItem] = []
    rest: list[Any] = []
    blocks = content if isinstance(content, list) else [content]
    for idx, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            items.append(_claude_tool_result(obj, block, idx, base, max_chars))
        else:
            rest.append(block)
    text = _block_text(rest)
    if text.strip():
        if obj.get("isCompactSummary") is True:
            items.append(TranscriptItem(kind="compact_summary", text=text, key=_line_key("cs", obj, text), **base))
        else:
            items.append(TranscriptItem(kind="user_message", text=text, key=_line_key("u", obj, text), **base))
    return items


def _claude_tool_result(
    obj: dict[str, Any], block: dict[str, Any], idx: int, base: dict[str, Any], max_chars: int
) -> TranscriptItem:
    tool_use_id = _str_or_none(block.get("tool_use_id"))
    text = _block_text(block.get("content"))
    if not text.strip():
        text = _summarize_tool_use_result(obj.get("toolUseResult"))
    key = f"tr:{tool_use_id}" if tool_use_id else f"{_line_key('tr', obj, text)}:{idx}"
    return TranscriptItem(
        kind="tool_result",
        text=_clip(text, max_chars),
        key=key,
        tool_use_id=tool_use_id,
        is_error=block.get("is_error") is True,
        **base,
    )


def _claude_assistant(obj: dict[str, Any], base: dict[str, Any], max_chars: int) -> list[TranscriptItem]:
    message = obj.get("message")
    if not isinstance(message, dict):
        return []
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return []
    message_id = _str_or_none(message.get("id"))
    # Without message.id the line uuid is the next most stable anchor.
    anchor = message_id or _line_key("l", obj, json.dumps(content, sort_keys=True, default=str))
    items: list[TranscriptItem] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        btype = block.get("type")
        if btype == "text":
            text = block.get("text")
            if isinstance(text, str) and text.strip():
                items.append(
                    TranscriptItem(
                        kind="assistant_message",
                        text=text,
                        key=f"at:{anchor}:{_digest(text)}",
                        message_id=message_id,
                        **base,
                    )
                )
        elif btype in ("tool_use", "server_tool_use"):
            name = _str_or_none(block.get("name")) or "?"
            raw_input = block.get("input")
            tool_input = raw_input if isinstance(raw_input, dict) else {}
            tid = _str_or_none(block.get("id"))
            key = f"tu:{tid}" if tid else f"tu:{anchor}:{_digest(name, json.dumps(tool_input, sort_keys=True))}"
            items.append(
                TranscriptItem(
                    kind="tool_use",
                    text=render_tool_use(name, tool_input),
                    key=key,
                    tool_name=name,
                    tool_use_id=tid,
                    tool_input=_clip_values(tool_input, max_chars),
                    message_id=message_id,
                    **base,
                )
            )
        elif btype == "web_search_tool_result":
            tid = _str_or_none(block.get("tool_use_id"))
            if tid:
                text = _clip(json.dumps(block.get("content"), ensure_ascii=False, default=str), max_chars)
                items.append(
                    TranscriptItem(
                        kind="tool_result", text=text, key=f"tr:{tid}", tool_use_id=tid, message_id=message_id, **base
                    )
                )
        # thinking / redacted_thinking: chain of thought is deliberately not stored.
    return items


# ---------------------------------------------------------------------------------------------------------------
# Codex


def parse_codex_line(obj: dict[str, Any], state: CodexState, *, max_chars: int = 4000) -> list[TranscriptItem]:
    """Items carried by one Codex rollout line; updates `state` (session id, cwd, duplicate tracking)."""
    if not isinstance(obj, dict):
        return []
    ltype = obj.get("type")
    payload = obj.get("payload")
    if not isinstance(payload, dict):
        return []
    ts_raw = obj.get("timestamp")
    ts_str = ts_raw if isinstance(ts_raw, str) else str(ts_raw or "")
    if ltype == "session_meta":
        if isinstance(payload.get("id"), str):
            state.session_id = payload["id"]
        if isinstance(payload.get("cwd"), str):
            state.cwd = payload["cwd"]
        return []
    if ltype == "turn_context":
        if isinstance(payload.get("cwd"), str):
            state.cwd = payload["cwd"]
        return []
    base: dict[str, Any] = {"agent": "codex", "session_id": state.session_id, "ts": _ts(ts_raw), "cwd": state.cwd}
    ptype = payload.get("type")
    if ltype == "compacted":
        text = payload.get("message")
        if isinstance(text, str) and text.strip():
            key = f"cs:{state.session_id}:{_digest(ts_str, text)}"
            return [TranscriptItem(kind="compact_summary", text=text, key=key, **base)]
        return []
    if ltype == "event_msg":
        if ptype == "user_message":
            return _codex_message(state, "user", "ev", payload.get("message"), ts_str, base)
        if ptype == "agent_message":
            return _codex_message(state, "assistant", "ev", payload.get("message"), ts_str, base)
        return []
    if ltype != "response_item":
        return []
    if ptype == "message":
        role = payload.get("role")
        if role in ("user", "assistant"):
            return _codex_message(state, role, "ri", payload.get("content"), ts_str, base)
        return []  # developer/system: instructions and our own hook context, not conversation
    if ptype in ("function_call", "custom_tool_call", "local_shell_call"):
        return [_codex_tool_use(payload, base, max_chars)]
    if ptype in ("function_call_output", "custom_tool_call_output"):
        return [_codex_tool_result(payload, base, max_chars)]
    return []  # reasoning (encrypted chain of thought), ghost_snapshot, web_search_call, ...


def _codex_message(
    state: CodexState, role: str, source: str, content: Any, ts_str: str, base: dict[str, Any]
) -> list[TranscriptItem]:
    text = _block_text(content)
    if not text.strip() or (role == "user" and text.lstrip().startswith(_CODEX_INJECTED_PREFIXES)):
        return []
    # Compare only the words: the event copy lists images separately, the response item inlines them.
    digest = _digest(text.replace("[image]", "").strip())
    previous = state.recent.get(role)
    if previous is not None and previous != f"{source}:{digest}" and previous.endswith(f":{digest}"):
        del state.recent[role]
        return []
    state.recent[role] = f"{source}:{digest}"
    prefix = "cu" if role == "user" else "ca"
    kind: Kind = "user_message" if role == "user" else "assistant_message"
    return [TranscriptItem(kind=kind, text=text, key=f"{prefix}:{state.session_id}:{_digest(ts_str, text)}", **base)]


def _codex_tool_use(payload: dict[str, Any], base: dict[str, Any], max_chars: int) -> TranscriptItem:
    ptype = payload.get("type")
    call_id = _str_or_none(payload.get("call_id")) or _str_or_none(payload.get("id"))
    name = _str_or_none(payload.get("name")) or "?"
    tool_input: dict[str, Any]
    if ptype == "function_call":
        args = payload.get("arguments")
        try:
            parsed = loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = None
        tool_input = parsed if isinstance(parsed, dict) else {"arguments": args}
    elif ptype == "custom_tool_call":
        tool_input = {"input": payload.get("input")}
    else:  # local_shell_call
        name = "shell"
        action = payload.get("action")
        tool_input = action if isinstance(action, dict) else {}
    key = f"tu:{call_id}" if call_id else f"tu:{base['session_id']}:{_digest(str(base['ts']), name, str(tool_input))}"
    return TranscriptItem(
        kind="tool_use",
        text=render_tool_use(name, tool_input),
        key=key,
        tool_name=name,
        tool_use_id=call_id,
        tool_input=_clip_values(tool_input, max_chars),
        **base,
    )


def _codex_tool_result(payload: dict[str, Any], base: dict[str, Any], max_chars: int) -> TranscriptItem:
    call_id = _str_or_none(payload.get("call_id"))
    output = payload.get("output")
    is_error = False
    if isinstance(output, str):
        text = output
        # Older rollouts wrap shell output as a JSON string {"output": ..., "metadata": {"exit_code": ...}}.
        if output.startswith("{"):
            try:
                wrapped = loads(output)
            except ValueError:
                wrapped = None
            if isinstance(wrapped, dict) and isinstance(wrapped.get("output"), str):
                text = wrapped["output"]
                meta = wrapped.get("metadata")
                if isinstance(meta, dict) and isinstance(meta.get("exit_code"), int):
                    is_error = meta["exit_code"] != 0
    elif isinstance(output, dict):
        text = _block_text(output.get("content"))
        is_error = output.get("success") is False
    else:
        text = _block_text(output)
    key = f"tr:{call_id}" if call_id else f"tr:{base['session_id']}:{_digest(str(base['ts']), text)}"
    return TranscriptItem(
        kind="tool_result", text=_clip(text, max_chars), key=key, tool_use_id=call_id, is_error=is_error, **base
    )


# ---------------------------------------------------------------------------------------------------------------
# Files


def read_lines(path: Path, offset: int, *, max_bytes: int = 4 << 20) -> tuple[list[dict[str, Any]], int]:
    """JSON objects of the complete (newline-terminated) lines from byte `offset`, and the offset after them.

    Reads about `max_bytes` per call but always finishes a line it started, so one huge line cannot stall the
    tailer. A file shorter than `offset` was truncated or replaced, so reading restarts at 0. Lines that are not
    JSON objects are skipped with a warning; their bytes are still consumed.
    """
    with path.open("rb") as fh:
        size = fh.seek(0, 2)
        if offset > size or offset < 0:
            log.warning("%s shrank below offset %d (size %d); rereading from 0", path, offset, size)
            offset = 0
        fh.seek(offset)
        buf = fh.read(max_bytes)
        end = buf.rfind(b"\n")
        while end < 0 and len(buf) < size - offset:
            more = fh.read(max_bytes)
            if not more:
                break
            nl = more.find(b"\n")
            if nl >= 0:
                end = len(buf) + nl
            buf += more
    if end < 0:
        return [], offset
    objs, bad = decode_lines(buf[: end + 1].split(b"\n"))
    if bad:
        log.warning("skipped %d unparsable lines in %s", bad, path)
    return objs, offset + end + 1


def decode_lines(lines: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of JSONL lines, in order, and how many lines were neither blank nor a JSON object."""
    objs: list[dict[str, Any]] = []
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        obj = loads_object(raw)
        if obj is None:
            bad += 1
        else:
            objs.append(obj)
    return objs, bad


def loads_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object one line holds (decoded by `loads`); None for anything else."""
    try:
        obj = loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


# How one line or array element bears on the format of its file.
_Verdict = Literal["claude", "codex", "unknown", "foreign"]
READ_BLOCK = 1 << 20  # the buffer `file_objects` reads a whole file through
HEAD_KEPT = 1 << 20  # bytes of a file's first lines whose objects `sniff` keeps for `file_objects`
_SNIFF_LINES = 50  # known lines a JSONL file is judged on ...
_SNIFF_MAX_LINES = 1000  # ... looked for among at most this many (unknown kinds do not count)


def _classify_obj(obj: Any) -> _Verdict | None:
    """`claude`/`codex`: a line that format writes. `unknown`: a typed line of a kind this version does not know
    (agents add line types all the time, e.g. Claude Code's `file-history-delta`): harmless, the parsers skip it.
    `foreign`: a line no transcript holds (a hook payload, an object without a `type`), which rules the file out.
    None for a non-object, which the readers skip as well."""
    if not isinstance(obj, dict):
        return None
    if "hook_event_name" in obj:
        return "foreign"
    ltype = obj.get("type")
    if ltype in _CODEX_TYPES and "payload" in obj:
        return "codex"
    if ltype in _CLAUDE_TYPES or ("sessionId" in obj and "uuid" in obj):
        return "claude"
    return "unknown" if isinstance(ltype, str) and ltype else "foreign"


def _decide(verdicts: set[_Verdict | None]) -> Literal["claude", "codex"] | None:
    """The format that lines of exactly one format are present for, and nothing contradicts; else None."""
    known = verdicts & {"claude", "codex"}
    if len(known) != 1 or "foreign" in verdicts:
        return None
    return "claude" if "claude" in known else "codex"


def detect_format(path: Path) -> Format | None:
    """Which transcript format a file holds; None for hook logs, metadata and anything else.

    A transcript has lines of one known format (Claude Code or Codex) and no line that belongs to neither: line
    types this version does not know yet are skipped, not held against the file. A JSON array (chat.json) is judged
    on all its elements, a JSONL file on its first 50 lines of a known kind.
    """
    return sniff(path)[0]


def sniff(path: Path) -> tuple[Format | None, list[dict[str, Any] | None]]:
    """`detect_format`, and what it decoded of a JSONL file's first lines, for `file_objects` to pass on instead of
    decoding them again: the object of each newline-terminated line in order (None for one that holds none), up to
    HEAD_KEPT bytes of them (a first line can carry a base64 screenshot: the parser holds no more than that twice)."""
    head: list[dict[str, Any] | None] = []
    try:
        with path.open("rb") as fh:
            first = fh.read(4096).lstrip()[:1]
    except OSError:
        return None, head
    if first == b"[":
        # chat.json style: the JSONL turned into one array when the session stops.
        try:
            data = loads(path.read_bytes())
        except (OSError, ValueError):
            return None, head
        if not isinstance(data, list):
            return None, head
        return "claude_array" if _decide({_classify_obj(o) for o in data}) == "claude" else None, head
    if first != b"{":
        return None, head
    verdicts: set[_Verdict | None] = set()
    known = 0
    room: int | None = HEAD_KEPT  # None once a line was not kept: `head` is the file's first lines, without a gap
    with path.open("rb") as fh:
        # Whole lines, however long: a first user line can carry a base64 screenshot.
        for _, raw in zip(range(_SNIFF_MAX_LINES), fh, strict=False):
            try:
                value = loads(raw)
            except ValueError:
                value = None  # a torn or partial line: no verdict, as for a line that holds no object
            if room is not None and len(raw) <= room and raw.endswith(b"\n"):
                head.append(value if isinstance(value, dict) else None)
                room -= len(raw)
            else:
                room = None
            verdict = _classify_obj(value)
            verdicts.add(verdict)
            known += verdict in ("claude", "codex", "foreign")
            if known >= _SNIFF_LINES or "foreign" in verdicts:
                break
    return _decide(verdicts), head


_ROLLOUT_UUID_RE = re.compile(r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\.jsonl$")


def codex_state_for(path: Path) -> CodexState:
    """A Codex rollout's parse state to begin with: the file's name ends in the session uuid (session_meta on line 1
    normally confirms it)."""
    m = _ROLLOUT_UUID_RE.search(path.name)
    return CodexState(session_id=m.group(1) if m else "")


def file_objects(path: Path, head: list[dict[str, Any] | None] | None = None) -> Iterator[dict[str, Any]]:
    """The JSON objects of a whole JSONL file's lines, in order, decoded a line at a time as they are read (a line
    that is not a JSON object is skipped with a warning, as `read_lines` does). A finished file may lack its final
    newline: the tailer waits for it, a one-shot read need not (a last line that does not parse is the end of a file
    cut mid-write, not worth a warning). `head`: what `sniff` decoded of the first lines, passed on instead of
    decoded again (and let go of: the list is emptied).

    Each line is the one copy of its bytes, made from the file's buffer: read a block at a time, then cut and split,
    the bytes were copied four times, a third of the parser's time to decode a file."""
    bad = 0
    decoded = head if head is not None else []
    decoded.reverse()
    with path.open("rb", buffering=READ_BLOCK) as fh:
        for raw in fh:
            last = not raw.endswith(b"\n")
            obj = decoded.pop() if decoded else loads_object(raw.strip() if last else raw)
            if obj is not None:
                yield obj
            elif not last and raw.strip():
                bad += 1  # neither blank nor a JSON object
    if bad:
        log.warning("skipped %d unparsable lines in %s", bad, path)


def _subagent_id(path: Path) -> str | None:
    if path.name.startswith("agent-") and path.suffix == ".jsonl":
        return path.stem.removeprefix("agent-")
    return None


def parse_file(path: Path, *, max_chars: int = 4000) -> list[TranscriptItem]:
    """All items of one session file, deduplicated by key (first occurrence wins), in file order.

    Subagent files (`agent-<id>.jsonl`) yield sidechain items with `agent_id` set; a main transcript does not pull
    in its subagent files, see `subagent_files`. Lines without a session id (`summary`) get the file's session id.
    """
    fmt, head = sniff(path)
    items: list[TranscriptItem] = []
    if fmt == "codex":
        state = codex_state_for(path)
        for obj in file_objects(path, head):
            items.extend(parse_codex_line(obj, state, max_chars=max_chars))
    elif fmt in ("claude", "claude_array"):
        objs = loads(path.read_bytes()) if fmt == "claude_array" else file_objects(path, head)
        for obj in objs:
            items.extend(parse_claude_line(obj, max_chars=max_chars))
        fallback = next((i.session_id for i in items if i.session_id), "") or path.stem
        sub_id = _subagent_id(path)
        fixed: list[TranscriptItem] = []
        for item in items:
            if not item.session_id:
                item = replace(item, session_id=fallback)
            if sub_id is not None and (not item.is_sidechain or item.agent_id is None):
                item = replace(item, is_sidechain=True, agent_id=item.agent_id or sub_id)
            fixed.append(item)
        items = fixed
    seen: set[str] = set()
    unique: list[TranscriptItem] = []
    for item in items:
        if item.key not in seen:
            seen.add(item.key)
            unique.append(item)
    return unique


def _first_session_id(path: Path) -> str | None:
    try:
        with path.open("rb") as fh:
            for _, raw in zip(range(20), fh, strict=False):
                try:
                    obj = loads(raw)
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("sessionId"), str):
                    return obj["sessionId"]
    except OSError:
        return None
    return None


def subagent_files(main_transcript: Path) -> list[Path]:
    """Subagent transcripts of a Claude session file, sorted by path.

    2.1.x writes `<session>/subagents/agent-<id>.jsonl`; 2.0.x wrote `agent-<id>.jsonl` next to the session file,
    shared by every session of the project, so those are matched on their `sessionId`.
    """
    session_id = main_transcript.stem
    found: set[Path] = set()
    subdir = main_transcript.parent / session_id / "subagents"
    if subdir.is_dir():
        found.update(p for p in subdir.glob("agent-*.jsonl") if p.is_file())
    for sibling in main_transcript.parent.glob("agent-*.jsonl"):
        if sibling.is_file() and _first_session_id(sibling) == session_id:
            found.add(sibling)
    return sorted(found)


def read_subagent_meta(subagent_file: Path) -> dict[str, Any]:
    """The `agent-<id>.meta.json` next to a subagent transcript ({agentType, description, ...}); {} if absent."""
    meta_path = subagent_file.with_name(subagent_file.stem + ".meta.json")
    try:
        data = json.loads(meta_path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
