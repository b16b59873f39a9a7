"""Precise capture: does the user-rule capture keep exactly the sentences where the human user lays down a rule or
states a preference, and nothing from a subagent's brief, a tool result or the agent's own text?

The labels (`tests/capture_labels.json`) name each sentence by where it is, never by its text: a file under
`transcripts/`, its line (1-based: a JSONL file line, a JSON array index, a hook log record), the sentence's index in
`user_sentences(text)`, the source kind and a short sha256 of the sentence (drift check). This script re-reads the
files with its own plain-JSON reader (not loomd's parsers), splits each text with loomd's `user_sentences()` (so a
labelled unit is exactly what the classifier sees), checks the hashes and runs the two paths that capture a user rule:

- `capture`: the ingest-time rule (`loomd.ingest.capture`): the event's prompt text as `prompt_text()` picks it (a
  UserPromptSubmit hook prompt, or a transcript user message that is not a sidechain), then every sentence of it that
  `classify_user_sentence` calls a constraint or a preference;
- `observer`: the observer's user step (`loomd.workers.rules`): a user message on the main lane (`SourceEvent.lane`),
  then the same classification.

Prints one JSON object: precision, recall, F1 and counts per path, per session and per source, and every false
positive and false negative with its text (the text is printed, never stored in the repository).

    python bench/capture.py [--data DIR] [--labels PATH]
    python bench/capture.py --units [--all-sources] > units.jsonl   # every candidate sentence, to label a new set

A different data folder is named by --data or $LOOMD_TEST_DATA (default ../shared/data).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from loomd.ingest.sentences import classify_user_sentence, user_sentences  # noqa: E402

LABELS = REPO / "tests" / "capture_labels.json"
SOURCES = ("user", "subagent", "tool_result", "assistant")
RULE_KINDS = ("constraint", "preference")


def data_dir(arg: str | None = None) -> Path:
    return Path(arg or os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data")


def digest(sentence: str) -> str:
    return hashlib.sha256(sentence.encode()).hexdigest()[:12]


# --- a plain reader of the four file formats ------------------------------------------------------------------

@dataclass(frozen=True)
class Text:
    """One message of one source kind at one place: `line` is 1-based (JSONL line, array index or hook record)."""

    file: str  # relative to transcripts/
    line: int
    source: str  # user | subagent | tool_result | assistant
    text: str
    via: str  # how the pipeline receives it: user_message, UserPromptSubmit, tool_result, assistant_message
    agent: str = "claude"  # claude | codex (the file's format)


_HARNESS_PROMPT = re.compile(r"^\s*(?:<environment_context>|<user_instructions>|<INSTRUCTIONS>|# AGENTS\.md"
                             r"|<permissions instructions>|<turn_aborted>|<user_shell_command>)")


def _records(path: Path) -> list[tuple[int, Any]]:
    """(1-based line or index, record) of a JSONL file or a JSON array; unparsable lines are skipped."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    out.append((n, json.loads(line)))
                except ValueError:
                    continue
        return out
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    return list(enumerate(data, 1)) if isinstance(data, list) else []


def _blocks(content: Any, kind: str) -> str:
    """The joined text of a message's `kind` blocks ("text" or "tool_result"); a string is one text block."""
    if isinstance(content, str):
        return content if kind == "text" else ""
    parts: list[str] = []
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict) or block.get("type") != kind:
            continue
        if kind == "text":
            parts.append(str(block.get("text") or ""))
        else:
            inner = block.get("content")
            parts.append(inner if isinstance(inner, str) else _blocks(inner, "text"))
    return "\n\n".join(p for p in parts if p)


def _claude_texts(rel: str, records: list[tuple[int, Any]], subagent_file: bool) -> Iterator[Text]:
    prompts = set()
    queued: list[tuple[int, str]] = []
    for n, r in records:
        if not isinstance(r, dict):
            continue
        kind = r.get("type")
        message = r.get("message") if isinstance(r.get("message"), dict) else {}
        content = message.get("content")
        if kind == "queue-operation" and r.get("operation") == "enqueue" and isinstance(r.get("content"), str):
            queued.append((n, r["content"]))
        if kind == "assistant":
            text = _blocks(content, "text")
            if text.strip():
                yield Text(rel, n, "assistant", text, "assistant_message")
            continue
        if kind != "user":
            continue
        result = _blocks(content, "tool_result")
        if result.strip():
            yield Text(rel, n, "tool_result", result, "tool_result")
            continue
        text = _blocks(content, "text")
        if not text.strip() or r.get("isMeta") or r.get("isCompactSummary") or r.get("isVisibleInTranscriptOnly"):
            continue
        if r.get("isSidechain") or subagent_file:
            yield Text(rel, n, "subagent", text, "user_message")
            continue
        prompts.add(" ".join(text.split()))
        yield Text(rel, n, "user", text, "user_message")
    # A prompt typed while the agent works is queued; one never delivered as a user line is only in the queue.
    for n, text in queued:
        if " ".join(text.split()) not in prompts:
            yield Text(rel, n, "user", text, "user_message")


def _codex_texts(rel: str, records: list[tuple[int, Any]]) -> Iterator[Text]:
    typed = any(isinstance(r, dict) and r.get("type") == "event_msg" and isinstance(r.get("payload"), dict)
                and r["payload"].get("type") == "user_message" for _, r in records)
    for n, r in records:
        if not isinstance(r, dict) or not isinstance(r.get("payload"), dict):
            continue
        p = r["payload"]
        if r.get("type") == "event_msg" and p.get("type") == "user_message":
            text = str(p.get("message") or "")
            if text.strip() and not _HARNESS_PROMPT.match(text):
                yield Text(rel, n, "user", text, "user_message", "codex")
        elif r.get("type") == "response_item" and p.get("type") == "message":
            texts = [str(b.get("text") or "") for b in p.get("content") or [] if isinstance(b, dict)]
            text = "\n\n".join(t for t in texts if t)
            if p.get("role") == "assistant" and text.strip():
                yield Text(rel, n, "assistant", text, "assistant_message", "codex")
            elif p.get("role") == "user" and not typed and text.strip() and not _HARNESS_PROMPT.match(text):
                yield Text(rel, n, "user", text, "user_message", "codex")
        elif r.get("type") == "response_item" and p.get("type") in ("function_call_output", "custom_tool_call_output"):
            out = p.get("output")
            text = out if isinstance(out, str) else json.dumps(out)
            if text.strip():
                yield Text(rel, n, "tool_result", text, "tool_result", "codex")


def _same_prompt(text: str) -> str:
    """What a hook prompt and its transcript line share: the words after the tags (a slash command's name, echoed
    differently by each, is left out), the last 150 characters of them."""
    return " ".join(re.sub(r"<[^>]*>", " ", text).split())[-150:]


def _hook_texts(rel: str, records: list[tuple[int, Any]], known: set[str]) -> Iterator[Text]:
    for n, r in records:
        if isinstance(r, dict) and r.get("hook_event_name") == "UserPromptSubmit" and isinstance(r.get("prompt"), str):
            if _same_prompt(r["prompt"]) not in known:  # the same prompt already read from its transcript
                yield Text(rel, n, "user", r["prompt"], "UserPromptSubmit")


def read_texts(transcripts: Path) -> list[Text]:
    """Every user, subagent, tool-result and assistant text of every session file under `transcripts`."""
    files = sorted(p for p in transcripts.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")
                   and p.name != "INVENTORY.json" and not p.name.endswith(".meta.json"))
    out: list[Text] = []
    hook_logs: list[tuple[str, list[tuple[int, Any]]]] = []
    for path in files:
        rel = path.relative_to(transcripts).as_posix()
        records = _records(path)
        if path.name == "user_prompt_submit.json":
            hook_logs.append((rel, records))
        elif any(isinstance(r, dict) and r.get("type") in ("session_meta", "response_item", "event_msg")
                 for _, r in records[:5]):
            out.extend(_codex_texts(rel, records))
        elif any(isinstance(r, dict) and r.get("type") in ("user", "assistant") for _, r in records):
            out.extend(_claude_texts(rel, records, "/subagents/" in rel or path.name.startswith("agent-")))
    for rel, records in hook_logs:
        top = rel.split("/", 1)[0]
        known = {_same_prompt(t.text) for t in out if t.source == "user" and t.file.split("/", 1)[0] == top}
        out.extend(_hook_texts(rel, records, known))
    return out


@dataclass(frozen=True)
class Unit:
    """One candidate sentence: what the classifier sees."""

    text: Text
    index: int
    sentence: str

    @property
    def key(self) -> tuple[str, int, int, str]:
        return (self.text.file, self.text.line, self.index, self.text.source)


def units_of(text: Text) -> list[Unit]:
    return [Unit(text, i, s) for i, s in enumerate(user_sentences(text.text))]


# --- the two capture paths ------------------------------------------------------------------------------------

def capture_accepts(text: Text) -> bool:
    """The ingest-time rule's source filter, run on the event this text arrives as."""
    from loomd.ingest.capture import prompt_text
    from loomd.ingest.events import Event

    payload: dict[str, Any] = {"prompt": text.text} if text.via == "UserPromptSubmit" else {"text": text.text}
    if text.source == "subagent":
        payload["is_sidechain"] = True
    event = Event(key="bench", agent="claude", session_id="bench", kind=text.via, source="bench", ts=0.0,
                  payload=payload)
    return prompt_text(event) is not None


def observer_accepts(text: Text) -> bool:
    """The observer reads a user rule only from a user step on the main lane."""
    from loomd.workers.steps import SourceEvent

    payload: dict[str, Any] = {"text": text.text, "is_sidechain": text.source == "subagent"}
    event = SourceEvent(0, "bench", text.via, 0.0, "claude", "bench", None, None, payload)
    return text.via in ("user_message", "UserPromptSubmit") and event.lane == "main"


def predicted(unit: Unit, accepts: Callable[[Text], bool]) -> bool:
    return accepts(unit.text) and classify_user_sentence(unit.sentence) in RULE_KINDS


# --- scoring --------------------------------------------------------------------------------------------------

def load_labels(path: Path = LABELS) -> dict[str, Any]:
    return json.loads(path.read_text())


def labelled_units(labels: dict[str, Any], transcripts: Path) -> tuple[list[tuple[Unit, str]], list[dict[str, Any]]]:
    """(unit, label) for every labelled sentence found unchanged, and the labels that drifted or vanished."""
    by_place: dict[tuple[str, int, str], Text] = {}
    for t in read_texts(transcripts):
        by_place.setdefault((t.file, t.line, t.source), t)
    found: list[tuple[Unit, str]] = []
    drift: list[dict[str, Any]] = []
    for item in labels["sentences"]:
        text = by_place.get((item["file"], item["line"], item["source"]))
        units = units_of(text) if text else []
        unit = units[item["sentence"]] if item["sentence"] < len(units) else None
        if unit is None or digest(unit.sentence) != item["sha"]:
            drift.append(item)
        else:
            found.append((unit, item["label"]))
    return found, drift


def score(pairs: list[tuple[bool, bool]]) -> dict[str, Any]:
    """pairs: (gold is a rule, predicted a rule)."""
    tp = sum(g and p for g, p in pairs)
    fp = sum(p and not g for g, p in pairs)
    fn = sum(g and not p for g, p in pairs)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": round(precision, 3), "recall": round(recall, 3), "f1": round(f1, 3), "tp": tp, "fp": fp,
            "fn": fn, "n": len(pairs)}


def evaluate(found: list[tuple[Unit, str]], accepts: Callable[[Text], bool]) -> dict[str, Any]:
    rows = [(u, label == "rule", predicted(u, accepts)) for u, label in found]
    sessions: dict[str, list[tuple[bool, bool]]] = {}
    sources: dict[str, list[tuple[bool, bool]]] = {}
    for u, gold, pred in rows:
        sessions.setdefault(u.text.file, []).append((gold, pred))
        sources.setdefault(u.text.source, []).append((gold, pred))

    def show(u: Unit) -> dict[str, Any]:
        return {"file": u.text.file, "line": u.text.line, "sentence": u.index, "source": u.text.source,
                "kind": classify_user_sentence(u.sentence), "text": u.sentence}

    return {
        **score([(g, p) for _, g, p in rows]),
        "by_source": {k: score(v) for k, v in sorted(sources.items())},
        "by_session": {k: score(v) for k, v in sorted(sessions.items())},
        "false_positives": [show(u) for u, g, p in rows if p and not g],
        "false_negatives": [show(u) for u, g, p in rows if g and not p],
    }


def report(labels_path: Path, transcripts: Path) -> dict[str, Any]:
    labels = load_labels(labels_path)
    found, drift = labelled_units(labels, transcripts)
    counts = Counter((u.text.source, label) for u, label in found)
    capture = evaluate(found, capture_accepts)
    observer = evaluate(found, observer_accepts)
    same = [(u.key, predicted(u, capture_accepts)) for u, _ in found] == \
        [(u.key, predicted(u, observer_accepts)) for u, _ in found]
    return {
        "labels": str(labels_path), "data": str(transcripts),
        "sentences": len(found), "rules": sum(label == "rule" for _, label in found),
        "by_source": {f"{s}/{label}": n for (s, label), n in sorted(counts.items())},
        "drifted": [{k: item[k] for k in ("file", "line", "sentence", "source")} for item in drift],
        "capture": capture,
        "observer": "same predictions as capture" if same else observer,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="the shared data folder (holds transcripts/)")
    ap.add_argument("--labels", default=str(LABELS))
    ap.add_argument("--units", action="store_true", help="list every candidate user and subagent sentence as JSONL")
    ap.add_argument("--all-sources", action="store_true", help="with --units: tool results and assistant text too")
    args = ap.parse_args()
    transcripts = data_dir(args.data) / "transcripts"
    if not transcripts.is_dir():
        sys.exit(f"no transcripts under {transcripts} (set --data or LOOMD_TEST_DATA)")
    if args.units:
        for text in read_texts(transcripts):
            if text.source in ("user", "subagent") or args.all_sources:
                for u in units_of(text):
                    print(json.dumps({"file": text.file, "line": text.line, "sentence": u.index,
                                      "source": text.source, "sha": digest(u.sentence),
                                      "kind": classify_user_sentence(u.sentence), "text": u.sentence},
                                     ensure_ascii=False))
        return
    print(json.dumps(report(Path(args.labels), transcripts), indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
