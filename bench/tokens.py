"""Token economy: replay every real session through the hook path and count what loomd injects.

Each session file under the transcripts folder is replayed in time order, as the hooks would have delivered it:
SessionStart, one UserPromptSubmit per user message, Pre/PostToolUse per tool call, SessionStart(compact) at a
compaction summary, Stop, SessionEnd. After each prompt the replay pauses `--think-ms` (the model's time before its
first tool call; default 100 ms, far less than any real model takes) so the prompt's background semantic recall can
arrive with the next tool result, as it would. Prints one JSON object: per session the tokens injected at start,
per prompt (in the hook, and with the following tool result), after compaction, duplicates (an id injected twice in
one session; must be 0), and the injected share of the session's own tokens. Tokens are chars/4. `--again` then
replays every session once more as a later session of its project (`again` in the output): the first pass recalls
little, no session before it sharing its project; the second is what a project with a memory pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd.client import Client, wait_until_serving  # noqa: E402
from loomd.ingest.transcript import TranscriptItem, detect_format, parse_file  # noqa: E402

ID = re.compile(r" #(\d+)$", re.MULTILINE)  # the id closing each line, not a "#12" inside memory text


def tokens(text: str) -> int:
    return (len(text) + 3) // 4


def sessions(root: Path) -> list[tuple[Path, list[TranscriptItem]]]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".jsonl", ".json") or "/subagents/" in str(path) or path.name.startswith("agent-"):
            continue
        if detect_format(path) is None:
            continue
        items = [i for i in parse_file(path) if not i.is_sidechain]
        if items:
            out.append((path, items))
    # Time order across files, so later sessions of a project find what earlier ones left.
    return sorted(out, key=lambda s: min((i.ts for i in s[1] if i.ts), default=0.0))


def start_daemon(home: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LOOMD_HOME": str(home), "LOOMD_TAIL_TRANSCRIPTS": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(home / "daemon.log", "wb"), cwd=REPO)
    if wait_until_serving(home / "loomd.sock", 30, lambda: proc.poll() is None):
        return proc
    proc.kill()
    raise SystemExit(f"daemon did not start: {(home / 'daemon.log').read_text()[-2000:]}")


class Replay:
    def __init__(self, client: Client, think_ms: float) -> None:
        self.client = client
        self.think_s = think_ms / 1000
        self.n = 0

    def hook(self, event: str, body: dict[str, Any], context: bool = False) -> str:
        self.n += 1
        reply = self.client.call("hook", raw=json.dumps(body).encode(), event=event, eid=f"bench-{self.n}",
                                 context=context, deadline_ms=2000)
        if not reply["stdout"]:
            return ""
        return json.loads(reply["stdout"])["hookSpecificOutput"]["additionalContext"]

    def session(self, path: Path, items: list[TranscriptItem], again: bool = False) -> dict[str, Any]:
        sid = items[0].session_id or path.stem
        if again:  # the same work done again in a later session: every earlier session's memory is there to recall
            sid = f"again-{sid}"
        cwd = next((i.cwd for i in items if i.cwd), "/replay/" + path.parent.name)
        agent = items[0].agent
        base = {"session_id": sid, "transcript_path": str(path), "cwd": cwd}
        if agent == "codex":
            base["turn_id"] = "replay"
        own = sum(tokens(i.text) for i in items)
        start = self.hook("SessionStart", {**base, "hook_event_name": "SessionStart", "source": "startup"}, True)
        injected_ids = [int(x) for x in ID.findall(start)]
        prompts: list[dict[str, Any]] = []
        compact_tokens = 0
        # The last assistant message before each user message (and the session's last one) ends a turn.
        turn_ends: set[int] = set()
        last = None
        for n, item in enumerate(items):
            if item.kind == "user_message" and last is not None:
                turn_ends.add(last)
            elif item.kind == "assistant_message":
                last = n
        if last is not None:
            turn_ends.add(last)
        for n, item in enumerate(items):
            if item.kind == "user_message":
                block = self.hook("UserPromptSubmit", {**base, "hook_event_name": "UserPromptSubmit",
                                                       "prompt": item.text}, True)
                prompts.append({"prompt": item.text[:120], "tokens": tokens(block), "block": block,
                                "follow_up_tokens": 0, "follow_up": ""})
                injected_ids += [int(x) for x in ID.findall(block)]
                time.sleep(self.think_s)
            elif item.kind == "tool_use" and item.tool_use_id:
                self.hook("PreToolUse", {**base, "hook_event_name": "PreToolUse", "tool_name": item.tool_name,
                                         "tool_input": item.tool_input or {}, "tool_use_id": item.tool_use_id})
                self._pending = item
            elif item.kind == "tool_result" and item.tool_use_id:
                use = getattr(self, "_pending", None)
                tool_input = use.tool_input if use and use.tool_use_id == item.tool_use_id else {}
                response: Any = item.text if agent == "codex" else {"stdout": item.text, "stderr": "",
                                                                      "is_error": item.is_error}
                event = "PostToolUseFailure" if item.is_error and agent == "claude" else "PostToolUse"
                body = {**base, "hook_event_name": event, "tool_name": item.tool_name or (use.tool_name if use else ""),
                        "tool_input": tool_input or {}, "tool_use_id": item.tool_use_id}
                body["error" if event == "PostToolUseFailure" else "tool_response"] = response
                follow_up = self.hook(event, body)
                if follow_up and prompts:  # the semantic rest of the last prompt's recall
                    prompts[-1]["follow_up"] += follow_up
                    prompts[-1]["follow_up_tokens"] += tokens(follow_up)
            elif item.kind == "compact_summary":
                self.hook("PreCompact", {**base, "hook_event_name": "PreCompact", "trigger": "auto",
                                         "custom_instructions": ""})
                block = self.hook("SessionStart", {**base, "hook_event_name": "SessionStart", "source": "compact"},
                                  True)
                compact_tokens += tokens(block)
            elif item.kind == "assistant_message" and n in turn_ends:  # Stop fires once, when the turn ends
                self.hook("Stop", {**base, "hook_event_name": "Stop", "stop_hook_active": False,
                                   "last_assistant_message": item.text})
        self.hook("SessionEnd", {**base, "hook_event_name": "SessionEnd", "reason": "other"})
        start_ids = [int(x) for x in ID.findall(start)]
        prompt_ids = [int(x) for p in prompts for x in ID.findall(p["block"] + "\n" + p["follow_up"])]
        duplicates = len(prompt_ids) - len(set(prompt_ids)) + len(set(prompt_ids) & set(start_ids))
        in_hook = sum(p["tokens"] for p in prompts)
        follow_ups = sum(p["follow_up_tokens"] for p in prompts)
        total = tokens(start) + in_hook + follow_ups + compact_tokens
        return {
            "file": str(path.relative_to(path.parents[2])) if len(path.parents) > 2 else path.name,
            "agent": agent, "items": len(items), "own_tokens": own, "start_tokens": tokens(start),
            "prompts": len(prompts), "prompts_with_recall": sum(1 for p in prompts if p["tokens"]),
            "prompts_with_follow_up": sum(1 for p in prompts if p["follow_up_tokens"]),
            "prompt_tokens": in_hook, "follow_up_tokens": follow_ups, "compact_tokens": compact_tokens,
            "injected_tokens": total, "share_of_own": round(total / own, 4) if own else 0.0,
            "duplicates": duplicates, "start_block": start,
            "recall_examples": [p for p in prompts if p["tokens"] or p["follow_up_tokens"]][:3],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data"))
    parser.add_argument("--quick", action="store_true", help="the first five sessions only")
    parser.add_argument("--show", action="store_true", help="include the blocks themselves")
    parser.add_argument("--think-ms", type=float, default=100.0, help="pause after each prompt (the model's time)")
    parser.add_argument("--again", action="store_true",
                        help="then replay every session again as a later session, and count that pass apart")
    args = parser.parse_args()
    found = sessions(args.data / "transcripts")
    if args.quick:
        found = found[:5]
    with tempfile.TemporaryDirectory(prefix="lmt", dir="/tmp") as tmp:
        home = Path(tmp)
        proc = start_daemon(home)
        try:
            with Client(home / "loomd.sock", timeout=60) as client:
                replay = Replay(client, args.think_ms)
                rows = [replay.session(path, items) for path, items in found]
                # Each session's work again, in a later session: what the prompts' recall injects once the project has
                # a memory (the first pass recalls little: no session before it shares its project).
                again = [replay.session(path, items, again=True) for path, items in found] if args.again else []
                # What the next session of each project would be handed at its start.
                for row, (path, items) in zip(rows, found, strict=True):
                    cwd = next((i.cwd for i in items if i.cwd), "/replay/" + path.parent.name)
                    block = replay.hook("SessionStart", {"session_id": f"next-{path.stem}", "cwd": cwd,
                                                         "transcript_path": "/nonexistent.jsonl",
                                                         "hook_event_name": "SessionStart", "source": "startup"},
                                        True)
                    row["next_session_start_tokens"] = tokens(block)
                    row["next_session_start"] = block
                stats = client.call("stats")
        finally:
            proc.terminate()
            proc.wait(30)
    if not args.show:
        for row in (*rows, *again):
            for key in ("start_block", "recall_examples", "next_session_start"):
                row.pop(key, None)
    print(json.dumps({
        "bench": "tokens", "machine": platform.machine(), "python": platform.python_version(),
        "think_ms": args.think_ms, "sessions": len(rows), "totals": summed(rows), "memories": stats["memories"],
        "per_session": rows,
        **({"again": {"totals": summed(again), "per_session": again}} if args.again else {}),
    }, indent=2, ensure_ascii=False))


def summed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {k: sum(r[k] for r in rows) for k in (
        "own_tokens", "start_tokens", "prompt_tokens", "follow_up_tokens", "compact_tokens", "injected_tokens",
        "duplicates", "prompts", "prompts_with_recall", "prompts_with_follow_up")}
    totals["share_of_own"] = round(totals["injected_tokens"] / max(1, totals["own_tokens"]), 4)
    return totals


if __name__ == "__main__":
    main()
