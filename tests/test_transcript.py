"""Transcript parsing against every real session file in the shared data set, plus the tail reader's edge cases.

The expected counts are computed here by direct JSON inspection (a recursive walk for tool ids, plain field
checks for messages), deliberately not by reusing the module's line handlers.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loomd.ingest.transcript import (
    READ_BLOCK,
    CodexState,
    TranscriptItem,
    detect_format,
    file_objects,
    parse_claude_line,
    parse_codex_line,
    parse_file,
    read_lines,
    read_subagent_meta,
    render_tool_use,
    sniff,
    subagent_files,
)

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LOOMD_TEST_DATA", REPO.parent / "shared" / "data"))
NO_DATA = f"shared transcript data not found at {DATA} (set LOOMD_TEST_DATA)"
CATEGORIES = ("user", "assistant_text", "tool_use", "tool_result", "compact_summary", "summary")
KIND_TO_CATEGORY = {
    "user_message": "user",
    "assistant_message": "assistant_text",
    "tool_use": "tool_use",
    "tool_result": "tool_result",
    "compact_summary": "compact_summary",
    "summary": "summary",
}
CODEX_INJECTED = ("<environment_context>", "<user_instructions>", "# AGENTS.md instructions", "<INSTRUCTIONS>")


# ---------------------------------------------------------------------------------------------------------------
# Discovery and the independent count


def _load_objects(path: Path) -> list[Any]:
    if path.suffix == ".json":
        return json.loads(path.read_bytes())
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _expected_format(path: Path) -> str | None:
    """Classify by content: JSONL files are transcripts; a .json is one only if it is an array of transcript lines."""
    if path.suffix == ".jsonl":
        first = json.loads(path.read_bytes().split(b"\n", 1)[0])
        return "codex" if "payload" in first else "claude"
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_bytes())
    except ValueError:
        return None
    if not isinstance(data, list) or not data or not all(isinstance(o, dict) for o in data):
        return None
    if any("hook_event_name" in o for o in data):
        return None  # disler-style hook logs (pre_tool_use.json, ...), not transcripts
    if all("type" in o for o in data) and any("sessionId" in o for o in data):
        return "claude_array"
    return None


def _discover() -> list[tuple[Path, str]]:
    if not DATA.is_dir():
        return []
    found: list[tuple[Path, str]] = []
    for dirpath, _dirs, files in os.walk(DATA):  # os.walk, unlike glob, enters .sample_session
        for name in sorted(files):
            path = Path(dirpath) / name
            fmt = _expected_format(path)
            if fmt is not None:
                found.append((path, fmt))
    return sorted(found)


def _walk(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def _nonblank(s: Any) -> bool:
    return isinstance(s, str) and bool(s.strip())


def _count_claude(objs: list[dict[str, Any]]) -> dict[str, int]:
    users: set[str] = set()
    texts: set[tuple[str, str]] = set()
    tool_uses: set[str] = set()
    tool_results: set[str] = set()
    compacts: set[str] = set()
    summaries: set[str] = set()
    for o in objs:
        if o.get("isMeta"):
            continue
        t = o.get("type")
        if t == "summary" and _nonblank(o.get("summary")):
            summaries.add(f"{o.get('leafUuid')}|{o['summary']}")
        if t == "system" and o.get("subtype") == "away_summary" and _nonblank(o.get("content")):
            summaries.add(o["uuid"])
        if t == "queue-operation" and o.get("operation") == "remove" and _nonblank(o.get("content")):
            users.add(f"queued|{o.get('timestamp')}|{o['content']}")  # taken into a running turn: no user line
        if t not in ("user", "assistant"):
            continue
        # A different traversal from the module: every dict anywhere under `message`.
        for d in _walk(o.get("message")):
            if d.get("type") == "tool_use":
                tool_uses.add(d["id"])
            elif d.get("type") == "tool_result":
                tool_results.add(d["tool_use_id"])
        content = o["message"]["content"]
        if t == "assistant":
            for b in content if isinstance(content, list) else []:
                if b.get("type") == "text" and _nonblank(b.get("text")):
                    texts.add((o["message"]["id"], b["text"]))
            continue
        has_words = _nonblank(content) or any(
            isinstance(b, dict) and (b.get("type") == "image" or (b.get("type") == "text" and _nonblank(b.get("text"))))
            for b in (content if isinstance(content, list) else [])
        )
        if has_words and o.get("isCompactSummary"):
            compacts.add(o["uuid"])
        elif has_words:
            users.add(o["uuid"])
    return {
        "user": len(users),
        "assistant_text": len(texts),
        "tool_use": len(tool_uses),
        "tool_result": len(tool_results),
        "compact_summary": len(compacts),
        "summary": len(summaries),
    }


def _count_codex(objs: list[dict[str, Any]]) -> dict[str, int]:
    c: Counter[str] = Counter()
    # Each text is written twice, as an event and as a response item; a plan-mode <proposed_plan> only as a response
    # item. The distinct texts: per text, the larger of its two counts.
    events: dict[str, Counter[str]] = {"user": Counter(), "assistant": Counter()}
    responses: dict[str, Counter[str]] = {"user": Counter(), "assistant": Counter()}
    calls: set[str] = set()
    outputs: set[str] = set()
    for o in objs:
        p = o.get("payload") or {}
        if o["type"] == "event_msg" and p.get("type") == "user_message":
            events["user"][p["message"].strip()] += 1
        elif o["type"] == "event_msg" and p.get("type") == "agent_message":
            events["assistant"][p["message"].strip()] += 1
        elif o["type"] == "compacted":
            c["compact_summary"] += 1
        elif o["type"] == "response_item" and p.get("type") == "message":
            text = "".join(part.get("text", "") for part in p["content"])
            if p["role"] == "user" and not text.lstrip().startswith(CODEX_INJECTED):
                responses["user"][text.strip()] += 1
            elif p["role"] == "assistant":
                responses["assistant"][text.strip()] += 1
        elif o["type"] == "response_item" and p.get("type") in ("function_call", "custom_tool_call"):
            calls.add(p["call_id"])
        elif o["type"] == "response_item" and p.get("type") in ("function_call_output", "custom_tool_call_output"):
            outputs.add(p["call_id"])
    # Every prompt has both copies; the copies must agree or the dedupe has nothing sound to compare with.
    assert events["user"] == responses["user"]
    return {
        "user": events["user"].total(),
        "assistant_text": (events["assistant"] | responses["assistant"]).total(),
        "tool_use": len(calls),
        "tool_result": len(outputs),
        "compact_summary": c["compact_summary"],
        "summary": 0,
    }


def _expected_counts(path: Path, fmt: str) -> dict[str, int]:
    objs = _load_objects(path)
    return _count_codex(objs) if fmt == "codex" else _count_claude(objs)


def _got_counts(items: list[TranscriptItem]) -> dict[str, int]:
    c = Counter(KIND_TO_CATEGORY[i.kind] for i in items)
    return {k: c[k] for k in CATEGORIES}


def _parse_raw(path: Path, fmt: str) -> list[TranscriptItem]:
    """Line-by-line parse without parse_file's dedupe, so key collisions stay visible."""
    items: list[TranscriptItem] = []
    state = CodexState()
    for obj in _load_objects(path):
        if fmt == "codex":
            items.extend(parse_codex_line(obj, state))
        else:
            items.extend(parse_claude_line(obj))
    return items


def _rel(path: Path) -> str:
    try:
        return path.relative_to(DATA / "transcripts").as_posix()
    except ValueError:
        return path.relative_to(DATA).as_posix()


FILES = _discover()
NO_DATA_PARAM = pytest.param(None, None, id="no-data")
FILE_PARAMS = [pytest.param(p, f, id=_rel(p)) for p, f in FILES] or [NO_DATA_PARAM]
JSONL_PARAMS = [pytest.param(p, f, id=_rel(p)) for p, f in FILES if f in ("claude", "codex")] or [NO_DATA_PARAM]


@pytest.fixture
def data_dir() -> Path:
    if not DATA.is_dir():
        pytest.skip(NO_DATA)
    return DATA


def transcript_count_table() -> list[dict[str, Any]]:
    """Per-file (expected == parsed) counts, for the closing note; computed fresh so any test can report them."""
    rows: list[dict[str, Any]] = []
    for path, fmt in FILES:
        got = _got_counts(parse_file(path))
        rows.append({"file": _rel(path), "format": fmt, **got})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Every real file


@pytest.mark.parametrize(("path", "fmt"), FILE_PARAMS)
def test_real_file_counts_match_independent_count(path: Path | None, fmt: str | None) -> None:
    if path is None or fmt is None:
        pytest.skip(NO_DATA)
    assert detect_format(path) == fmt
    items = parse_file(path)
    expected = _expected_counts(path, fmt)
    assert _got_counts(items) == expected
    assert sum(expected.values()) > 0

    keys = [i.key for i in items]
    assert len(keys) == len(set(keys))
    assert all(i.session_id for i in items)
    assert {i.agent for i in items} == {"codex" if fmt == "codex" else "claude"}

    # Without parse_file's dedupe: a key never names two different items, and no item hides under two keys
    # (distinct raw keys == the independent count).
    by_key: dict[str, TranscriptItem] = {}
    for item in _parse_raw(path, fmt):
        if item.key in by_key:
            assert by_key[item.key].text == item.text, item.key
        by_key.setdefault(item.key, item)
    assert len(by_key) == sum(expected.values())


@pytest.mark.parametrize(("path", "fmt"), FILE_PARAMS)
def test_real_file_reparse_is_identical(path: Path | None, fmt: str | None) -> None:
    if path is None or fmt is None:
        pytest.skip(NO_DATA)
    first = parse_file(path)
    second = parse_file(path)
    assert [i.key for i in first] == [i.key for i in second]
    assert first == second


@pytest.mark.parametrize(("path", "fmt"), FILE_PARAMS)
def test_real_file_content_rules(path: Path | None, fmt: str | None) -> None:
    if path is None or fmt is None:
        pytest.skip(NO_DATA)
    objs = _load_objects(path)
    items = parse_file(path, max_chars=300)
    texts = [i.text for i in items]
    # Chain of thought is not stored: no thinking block text appears in any item.
    thinking = [d["thinking"] for d in _walk(objs) if d.get("type") == "thinking" and _nonblank(d.get("thinking"))]
    for thought in thinking:
        assert not any(thought.strip() in t for t in texts)
    # Base64 image bytes never reach an item; the image shows as a placeholder.
    images = [d["source"]["data"] for d in _walk(objs) if d.get("type") == "image" and "data" in d.get("source", {})]
    # ... unless the line is harness input (isMeta, e.g. an expanded skill prompt), which is not stored at all.
    shown = [d["source"]["data"] for o in objs if not (isinstance(o, dict) and o.get("isMeta")) for d in _walk(o)
             if d.get("type") == "image" and "data" in d.get("source", {})]
    for data in images:
        assert not any(data[:200] in t for t in texts)
    if shown:
        assert any("[image]" in t for t in texts)
    for item in items:
        if item.kind == "tool_result":
            body, marker, rest = item.text.partition("…[truncated ")
            assert len(body) <= 300
            assert not marker or rest.endswith(" chars]")
        if item.kind == "tool_use":
            assert item.tool_name and item.tool_use_id and item.key == f"tu:{item.tool_use_id}"
            assert item.text.startswith(item.tool_name)
            assert isinstance(item.tool_input, dict)
            assert all(len(v) <= 300 + 40 for v in item.tool_input.values() if isinstance(v, str))
        if item.kind == "tool_result":
            assert item.key == f"tr:{item.tool_use_id}"
    # Every tool result belongs to a tool call of the same file in this data.
    uses = {i.tool_use_id for i in items if i.kind == "tool_use"}
    assert {i.tool_use_id for i in items if i.kind == "tool_result"} <= uses


@pytest.mark.parametrize(("path", "fmt"), JSONL_PARAMS)
def test_real_file_read_in_two_chunks(path: Path | None, fmt: str | None) -> None:
    if path is None or fmt is None:
        pytest.skip(NO_DATA)
    size = path.stat().st_size
    whole, end = read_lines(path, 0, max_bytes=size + 1)
    assert end == size
    assert whole == _load_objects(path)
    # max_bytes = half the file puts the first stop mid-line; the reader must stop at the line before it.
    first, mid = read_lines(path, 0, max_bytes=max(1, size // 2))
    assert 0 < mid < size
    assert path.read_bytes()[mid - 1 : mid] == b"\n"
    second, end2 = read_lines(path, mid)
    assert end2 == size
    assert first + second == whole

    state = CodexState()
    chunked: list[TranscriptItem] = []
    for batch in (first, second):
        for obj in batch:
            chunked.extend(parse_codex_line(obj, state) if fmt == "codex" else parse_claude_line(obj))
    assert [i.key for i in chunked] == [i.key for i in _parse_raw(path, fmt)]


@pytest.mark.parametrize(("path", "fmt"), JSONL_PARAMS)
def test_real_file_small_reads_cover_long_lines(path: Path | None, fmt: str | None) -> None:
    if path is None or fmt is None:
        pytest.skip(NO_DATA)
    # 4 KiB is far below the longest lines (a 548 KB screenshot line), which must still come out whole.
    offset, objs, calls = 0, [], 0
    while True:
        batch, new_offset = read_lines(path, offset, max_bytes=4096)
        calls += 1
        objs.extend(batch)
        if new_offset == offset:
            break
        offset = new_offset
    assert offset == path.stat().st_size
    assert objs == _load_objects(path)
    assert calls > 1


def _short(name: str) -> str:
    return re.sub(r"([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", r"\1…", name)


def test_count_table_report(data_dir: Path, record_property: pytest.RecordProperty) -> None:
    rows = transcript_count_table()
    assert rows
    record_property("transcript_counts", json.dumps(rows))
    lines = ["", "| file | format | " + " | ".join(CATEGORIES) + " |", "|---|---|" + "---:|" * len(CATEGORIES)]
    for r in rows:
        lines.append(f"| {_short(r['file'])} | {r['format']} | " + " | ".join(str(r[c]) for c in CATEGORIES) + " |")
    totals = " | ".join(str(sum(r[c] for r in rows)) for c in CATEGORIES)
    lines.append(f"| **total ({len(rows)} files)** | | {totals} |")
    # Shown with `pytest -s`; the lead pastes it into the closing note.
    sys.stdout.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Layout of the real data: formats, subagents


def test_data_set_is_complete(data_dir: Path) -> None:
    formats = Counter(f for _, f in FILES)
    assert formats == {"claude": 16, "codex": 4, "claude_array": 10}
    hook_logs = [p for p in (data_dir / "transcripts").rglob("*.json") if p.name.endswith("_use.json")]
    assert hook_logs
    for p in hook_logs:
        assert detect_format(p) is None
    assert detect_format(data_dir / "transcripts" / "INVENTORY.json") is None


def test_subagent_files_and_meta(data_dir: Path) -> None:
    root = data_dir / "transcripts" / "daaain-claude-code-log"
    main = root / "-experiments-worktrees" / "ef958aa1-0e93-49f0-bb71-150f63befcd1.jsonl"
    subs = subagent_files(main)
    assert len(subs) == 6
    assert all(p.parent.name == "subagents" for p in subs)
    for sub in subs:
        meta = read_subagent_meta(sub)
        assert meta["agentType"] and meta["description"]
        agent_id = sub.stem.removeprefix("agent-")
        items = parse_file(sub)
        assert items and all(i.is_sidechain and i.agent_id == agent_id for i in items)
        assert all(i.session_id == main.stem for i in items)
    # 2.0.x: a sibling agent file, matched by its sessionId.
    deep = root / "-src-deep-manifest" / "a7da6a22-facc-4fcd-8bab-f83c87862004.jsonl"
    assert [p.name for p in subagent_files(deep)] == ["agent-c8d9b115.jsonl"]
    assert [
        p.name
        for p in subagent_files(root / "-src-experiments-claude_p" / "29ccd257-68b1-427f-ae5f-6524b7cb6f20.jsonl")
    ] == ["agent-a2271d1.jsonl"]
    assert (
        subagent_files(root / "-Users-dain-workspace-JSSoundRecorder" / "7acd37a8-2745-4b58-a8a9-46164b22ad9e.jsonl")
        == []
    )
    assert read_subagent_meta(deep) == {}


def test_inline_sidechains_and_compaction(data_dir: Path) -> None:
    items = parse_file(data_dir / "transcripts" / "kesslerio-attio-mcp-server" / "logs" / "chat.json")
    sessions = Counter(i.session_id for i in items)
    assert len(sessions) == 2
    assert any(i.is_sidechain for i in items) and any(not i.is_sidechain for i in items)
    (compact,) = [i for i in items if i.kind == "compact_summary"]
    assert compact.text.startswith("This session is being continued")


def test_codex_injected_context_and_reasoning_skipped(data_dir: Path) -> None:
    path = next(p for p, f in FILES if f == "codex" and "rollout-" in p.name)
    items = parse_file(path)
    assert not any("<environment_context>" in i.text for i in items)
    assert items[0].session_id == "019a93b9-f380-7600-98ff-940e6b99603c"
    assert items[0].cwd == "/home/user/projects/temp/chatbot-ui"
    shell = next(i for i in items if i.kind == "tool_use")
    assert shell.text == "shell: ls" and shell.tool_input == {
        "command": ["bash", "-lc", "ls"],
        "workdir": "/home/user/projects/temp/chatbot-ui",
    }
    # Reasoning summaries ("**Planning repository inspection**") are chain of thought too.
    assert not any("Planning repository inspection" in i.text for i in items)
    assert any(i.is_error for i in items if i.kind == "tool_result")


# ---------------------------------------------------------------------------------------------------------------
# The reader, on small synthetic files (no shared data needed)


def _line(n: int) -> bytes:
    obj = {"type": "user", "uuid": f"u{n}", "sessionId": "s", "message": {"role": "user", "content": f"hello {n}"}}
    return json.dumps(obj).encode() + b"\n"


def test_truncated_last_line_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    third = _line(3)
    path.write_bytes(_line(1) + _line(2) + third[:20])
    objs, offset = read_lines(path, 0)
    assert [o["uuid"] for o in objs] == ["u1", "u2"]
    assert offset == len(_line(1) + _line(2))
    # Complete JSON but no newline yet: still not consumed, the writer may be mid-line.
    path.write_bytes(_line(1) + _line(2) + third[:-1])
    assert read_lines(path, offset) == ([], offset)
    with path.open("ab") as fh:
        fh.write(b"\n")
    objs, offset2 = read_lines(path, offset)
    assert [o["uuid"] for o in objs] == ["u3"]
    assert offset2 == path.stat().st_size


def test_rotated_file_restarts_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(_line(1) + _line(2) + _line(3))
    _, offset = read_lines(path, 0)
    path.write_bytes(_line(9))
    objs, new_offset = read_lines(path, offset)
    assert [o["uuid"] for o in objs] == ["u9"]
    assert new_offset == len(_line(9))


def test_bad_lines_are_skipped_and_consumed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(_line(1) + b"{not json\n" + b"[1, 2]\n" + b"\n" + _line(2))
    objs, offset = read_lines(path, 0)
    assert [o["uuid"] for o in objs] == ["u1", "u2"]
    assert offset == path.stat().st_size
    assert "skipped 2 unparsable lines" in caplog.text


def test_a_whole_file_is_read_line_by_line_as_the_tailer_reads_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`file_objects` (a one-shot import) takes what `read_lines` takes: bad and blank lines skipped, the bad ones
    counted, a line longer than its read buffer whole, a CRLF line; and a last line without its newline, unless
    it was cut mid-write (then not counted as bad). What `sniff` decoded of the first lines is passed on as is."""
    long = json.dumps({"type": "user", "uuid": "big", "sessionId": "s", "text": "x" * (2 * READ_BLOCK)}).encode()
    body = _line(1) + b"{not json\n" + b"[1, 2]\n" + b"\n  \n" + long + b"\n" + _line(2)[:-1] + b"\r\n"
    path = tmp_path / "s.jsonl"
    path.write_bytes(body + _line(3)[:-1])
    assert [o["uuid"] for o in file_objects(path)] == ["u1", "big", "u2", "u3"]
    assert list(file_objects(path))[:-1] == read_lines(path, 0)[0]
    fmt, head = sniff(path)  # the lines before the long one, decoded once: passed on as they are
    assert fmt == "claude" and len(head) == 5 and head[1] is None
    assert list(file_objects(path, head)) == list(file_objects(path)) and head == []
    assert "skipped 2 unparsable lines" in caplog.text
    caplog.clear()
    path.write_bytes(_line(1) + _line(2)[:20])
    assert [o["uuid"] for o in file_objects(path)] == ["u1"]
    assert "unparsable" not in caplog.text


def test_empty_and_unchanged_file(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"")
    assert read_lines(path, 0) == ([], 0)
    path.write_bytes(_line(1))
    _, offset = read_lines(path, 0)
    assert read_lines(path, offset) == ([], offset)


def test_detect_format_and_parse_file_synthetic(tmp_path: Path) -> None:
    jsonl = tmp_path / "abc.jsonl"
    jsonl.write_bytes(_line(1) + _line(2)[:-1])  # final line without newline: parse_file still takes it
    assert detect_format(jsonl) == "claude"
    assert [i.key for i in parse_file(jsonl)] == ["u:u1", "u:u2"]
    arr = tmp_path / "chat.json"
    arr.write_text(json.dumps([json.loads(_line(1)), {"type": "summary", "summary": "S", "leafUuid": "u1"}]))
    assert detect_format(arr) == "claude_array"
    items = parse_file(arr)
    assert [i.kind for i in items] == ["user_message", "summary"]
    assert items[1].session_id == "s"  # summary lines carry no sessionId; the file's is used
    hooks = tmp_path / "pre_tool_use.json"
    hooks.write_text(json.dumps([{"session_id": "s", "hook_event_name": "PreToolUse", "tool_name": "Bash"}]))
    assert detect_format(hooks) is None
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"a": 1}))
    assert detect_format(other) is None


def test_detect_format_skips_unknown_line_types(tmp_path: Path) -> None:
    """Agents keep adding line types: a file is judged by the lines it knows and refused only on a contradiction."""
    user = json.loads(_line(1))
    unknown = [{"type": f"future-kind-{i}", "messageId": f"m{i}"} for i in range(60)]  # more than one sniff window
    codex = {"type": "session_meta", "payload": {"id": "x"}}
    hook = {"session_id": "s", "hook_event_name": "PostToolUse", "tool_name": "Bash"}

    def array(objs: list[Any]) -> Path:
        path = tmp_path / "chat.json"
        path.write_text(json.dumps(objs))
        return path

    def jsonl(objs: list[Any]) -> Path:
        path = tmp_path / "s.jsonl"
        path.write_text("".join(json.dumps(o) + "\n" for o in objs))
        return path

    assert detect_format(array([*unknown, user])) == "claude_array"
    assert [i.key for i in parse_file(array([*unknown, user]))] == ["u:u1"]
    assert detect_format(array(unknown)) is None  # nothing known: no evidence it is a transcript
    assert detect_format(array([user, hook])) is None  # a hook payload is no transcript line
    assert detect_format(array([user, codex])) is None  # two formats in one file
    assert detect_format(array([user, {"text": "no type"}])) is None
    assert detect_format(array([user, "a string", 3])) == "claude_array"  # non-objects are skipped by every reader
    assert detect_format(array([])) is None
    assert detect_format(jsonl([*unknown, user])) == "claude"
    assert detect_format(jsonl([codex, {"type": "new_codex_line", "payload": {}}])) == "codex"
    assert detect_format(jsonl([user, hook])) is None
    assert detect_format(jsonl(unknown)) is None


# ---------------------------------------------------------------------------------------------------------------
# Line parsers, synthetic


def _assistant(msg_id: str, block: dict[str, Any], uuid: str) -> dict[str, Any]:
    return {
        "type": "assistant",
        "uuid": uuid,
        "sessionId": "s",
        "timestamp": "2025-01-02T03:04:05.500Z",
        "message": {"id": msg_id, "role": "assistant", "content": [block]},
    }


def test_claude_split_assistant_message() -> None:
    lines = [
        _assistant("msg_1", {"type": "thinking", "thinking": "secret plan", "signature": "x"}, "a1"),
        _assistant("msg_1", {"type": "text", "text": "Looking."}, "a2"),
        _assistant("msg_1", {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}, "a3"),
        _assistant(
            "msg_1", {"type": "tool_use", "id": "toolu_2", "name": "Edit", "input": {"file_path": "a.py"}}, "a4"
        ),
        _assistant("msg_1", {"type": "text", "text": "  "}, "a5"),
    ]
    items = [i for line in lines for i in parse_claude_line(line)]
    assert [(i.kind, i.text) for i in items] == [
        ("assistant_message", "Looking."),
        ("tool_use", "Bash: ls"),
        ("tool_use", "Edit: a.py"),
    ]
    assert items[0].key.startswith("at:msg_1:") and items[0].message_id == "msg_1"
    assert [i.key for i in items[1:]] == ["tu:toolu_1", "tu:toolu_2"]
    assert items[0].ts == 1735787045.5
    # The same block re-sent on another line (a resumed copy) keeps its key.
    again = parse_claude_line(_assistant("msg_1", {"type": "text", "text": "Looking."}, "zz"))
    assert again[0].key == items[0].key
    other = parse_claude_line(_assistant("msg_2", {"type": "text", "text": "Looking."}, "a6"))
    assert other[0].key != items[0].key


def test_claude_user_lines() -> None:
    base = {"type": "user", "sessionId": "s", "uuid": "u1", "cwd": "/p", "timestamp": "2025-01-01T00:00:00Z"}
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo" * 100}}
    (item,) = parse_claude_line(
        {**base, "message": {"role": "user", "content": [img, {"type": "text", "text": "see"}]}}
    )
    assert item.kind == "user_message" and item.text == "[image]\nsee" and item.key == "u:u1" and item.cwd == "/p"
    assert parse_claude_line({**base, "isMeta": True, "message": {"role": "user", "content": "Caveat"}}) == []
    assert parse_claude_line({**base, "message": {"role": "user", "content": "   "}}) == []
    (cs,) = parse_claude_line(
        {**base, "isCompactSummary": True, "message": {"role": "user", "content": "This session"}}
    )
    assert cs.kind == "compact_summary" and cs.key == "cs:u1"

    result = {
        **base,
        "toolUseResult": {"stdout": "x" * 100_000, "originalFile": "y" * 100_000},
        "message": {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "z" * 5000, "is_error": True},
                {"type": "text", "text": "and also this"},
            ],
        },
    }
    tr, extra = parse_claude_line(result, max_chars=100)
    assert tr.kind == "tool_result" and tr.key == "tr:toolu_9" and tr.is_error
    assert tr.text == "z" * 100 + "…[truncated 4900 chars]"
    assert extra.kind == "user_message" and extra.text == "and also this"
    # An empty tool_result gets a one-line summary of toolUseResult, never the whole object.
    empty = {
        **base,
        "toolUseResult": {
            "stdout": "",
            "stderr": "",
            "interrupted": False,
            "returnCodeInterpretation": "No matches found",
        },
        "message": {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_8", "content": ""}]},
    }
    assert parse_claude_line(empty)[0].text == "No matches found"


def test_claude_other_line_types() -> None:
    summary = {"type": "summary", "summary": "Fixing the parser", "leafUuid": "leaf"}
    (s,) = parse_claude_line(summary)
    assert s.kind == "summary" and s.key.startswith("sum:leaf:") and s.ts == 0.0
    away = {"type": "system", "subtype": "away_summary", "content": "Recap.", "uuid": "sy1", "sessionId": "s"}
    assert parse_claude_line(away)[0].key == "sys:sy1"
    queued = {"type": "attachment", "uuid": "q1", "attachment": {"type": "queued_command", "prompt": "also do X"}}
    assert parse_claude_line(queued)[0].kind == "user_message"
    # Taken into the running turn: the queue line is the only copy; sent on its own (dequeue) it has a user line.
    taken = {"type": "queue-operation", "operation": "remove", "timestamp": "2025-11-22T20:49:51.686Z",
             "sessionId": "s", "content": "also use tdd and the mcp tools"}
    (t,) = parse_claude_line(taken)
    assert t.kind == "user_message" and t.text == "also use tdd and the mcp tools" and t.key.startswith("uq:h:")
    for skipped in (
        {"type": "attachment", "uuid": "h1", "attachment": {"type": "hook_additional_context", "content": ["ctx"]}},
        {"type": "system", "subtype": "stop_hook_summary", "uuid": "x"},
        {"type": "system", "content": "SessionStart:compact completed", "uuid": "y"},
        {"type": "file-history-snapshot", "messageId": "m"},
        {"type": "queue-operation", "operation": "enqueue", "content": [{"type": "text", "text": "/init"}]},
        {"type": "queue-operation", "operation": "enqueue", "content": "sent later as its own user line"},
        {"type": "queue-operation", "operation": "dequeue"},
        {"type": "progress", "data": {}},
        {"type": "last-prompt", "lastPrompt": "hi"},
        {"type": "brand-new-type", "content": "?"},
        {"type": "assistant", "message": "not a dict"},
    ):
        assert parse_claude_line(skipped) == []


def _codex(ltype: str, payload: dict[str, Any], ts: str = "2025-11-17T21:32:46.911Z") -> dict[str, Any]:
    return {"timestamp": ts, "type": ltype, "payload": payload}


def test_codex_dedupe_and_tools() -> None:
    state = CodexState()
    prompt = "fix the bug"
    lines = [
        _codex("session_meta", {"id": "sess-1", "cwd": "/w"}),
        _codex(
            "response_item", {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]}
        ),
        _codex(
            "response_item",
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "# AGENTS.md instructions for /w"}],
            },
        ),
        _codex(
            "response_item",
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "<environment_context>x</environment_context>"}],
            },
        ),
        _codex(
            "response_item", {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}
        ),
        _codex("event_msg", {"type": "user_message", "message": prompt, "images": []}),
        _codex(
            "response_item",
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}], "encrypted_content": "gAAA"},
        ),
        _codex("event_msg", {"type": "agent_reasoning", "text": "hmm"}),
        _codex(
            "response_item",
            {
                "type": "function_call",
                "name": "shell",
                "arguments": '{"command":["bash","-lc","pytest -q"]}',
                "call_id": "call_1",
            },
        ),
        _codex(
            "response_item",
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": '{"output":"1 failed","metadata":{"exit_code":1}}',
            },
        ),
        _codex("event_msg", {"type": "agent_message", "message": "Fixed."}),
        _codex(
            "response_item",
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]},
        ),
        _codex(
            "response_item",
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
            ts="2025-11-17T22:00:00Z",
        ),
        _codex("event_msg", {"type": "user_message", "message": prompt}, ts="2025-11-17T22:00:00Z"),
        _codex("compacted", {"message": "Summary of the work so far."}),
    ]
    items = [i for line in lines for i in parse_codex_line(line, state)]
    assert [(i.kind, i.text) for i in items] == [
        ("user_message", prompt),
        ("tool_use", "shell: pytest -q"),
        ("tool_result", "1 failed"),
        ("assistant_message", "Fixed."),
        ("user_message", prompt),  # the same words typed again later are a new message
        ("compact_summary", "Summary of the work so far."),
    ]
    assert all(i.session_id == "sess-1" and i.cwd == "/w" and i.agent == "codex" for i in items)
    assert items[1].tool_input == {"command": ["bash", "-lc", "pytest -q"]} and items[1].key == "tu:call_1"
    assert items[2].is_error and items[2].key == "tr:call_1"
    assert len({i.key for i in items}) == len(items)


def test_render_tool_use() -> None:
    assert render_tool_use("Grep", {"pattern": "def x", "path": "src"}) == "Grep: def x in src"
    assert render_tool_use(
        "apply_patch", {"input": "*** Begin Patch\n*** Update File: a.py\n*** Add File: b.py\n"}
    ) == ("apply_patch: a.py, b.py")
    assert render_tool_use("TodoWrite", {"todos": [{}, {}]}) == "TodoWrite: 2 todos"
    assert render_tool_use("mcp__x__y", {"n": 1}) == 'mcp__x__y: {"n": 1}'
    long = render_tool_use("Bash", {"command": "x" * 2000})
    assert long.endswith("…[truncated 1506 chars]")
