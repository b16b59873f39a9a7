"""Events as the observer sees them: stored rows -> ordered steps (a user turn, an assistant message, a tool run).

Hook and transcript copies of one thing merge; a tool call is paired with its result; what a command line does
(`command_heads`), how it failed (`first_error_line`), what it committed (`commit_subject`) is read here.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .text import clip, short_hash

SHELL_TOOLS = frozenset({"Bash", "bash", "shell", "exec_command", "local_shell", "container.exec", "run_command"})
EDIT_TOOLS = frozenset({"Edit", "MultiEdit", "Write", "NotebookEdit", "apply_patch", "edit_file", "write_file"})


# --- events as the observer sees them -------------------------------------------------------------------------

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
    def from_row(cls, row: Any) -> SourceEvent:
        try:
            payload = json.loads(row["payload"])
        except (TypeError, ValueError):
            payload = {}
        return cls(int(row["id"]), row["session_id"], row["kind"], float(row["ts"]), row["agent"], row["project"],
                   row["tool_name"], row["tool_use_id"], payload if isinstance(payload, dict) else {})

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


def shell_command(tool_input: Any) -> str:
    """The command line of a shell tool call (Claude `command`, Codex `cmd` or argv lists)."""
    if not isinstance(tool_input, dict):
        return ""
    cmd = tool_input.get("command", tool_input.get("cmd", ""))
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        if len(cmd) == 3 and cmd[0].rsplit("/", 1)[-1] in ("bash", "sh", "zsh") and cmd[1] in ("-lc", "-c"):
            return cmd[2]
        return shlex.join(cmd)
    return cmd if isinstance(cmd, str) else ""


_EXIT = re.compile(r'(?:^\s*Exit code:?\s*|"exit_code"\s*:\s*|exit (?:status|code) )(-?\d+)', re.IGNORECASE)
_REJECTED = re.compile(r"The user doesn't want to (?:proceed with this tool use|take this action)|"
                       r"\[Request interrupted by user|tool use was rejected", re.IGNORECASE)


def response_text(response: Any) -> tuple[str, bool]:
    """The readable output of a tool call (hook `tool_response` of any shape), and whether it says it failed."""
    if isinstance(response, str):
        return response, False
    if isinstance(response, dict):
        parts = [response[k] for k in ("stdout", "stderr", "output", "error", "content", "message", "result")
                 if isinstance(response.get(k), str) and response[k]]
        flagged = bool(response.get("is_error") or response.get("isError") or response.get("success") is False
                       or (isinstance(response.get("exit_code"), int) and response["exit_code"] != 0))
        if not parts and isinstance(response.get("filePath"), str):
            parts.append(f"File {response.get('type', 'written')}: {response['filePath']}")
        return "\n".join(parts), flagged
    if isinstance(response, list):
        return "\n".join(str(b.get("text", "")) for b in response if isinstance(b, dict)), False
    return "", False


def failed_output(output: str, flagged: bool) -> bool:
    if flagged:
        return True
    match = _EXIT.search(output[:2000])
    return bool(match and match.group(1) != "0")


def to_steps(events: Sequence[SourceEvent]) -> list[Step]:
    """Pair calls with results, merge hook and transcript copies, and drop what carries no meaning."""
    uses: dict[str, SourceEvent] = {}
    steps: list[Step] = []
    seen_text: dict[str, Step] = {}
    for ev in sorted(events, key=lambda e: e.id):
        p, kind = ev.payload, ev.kind
        if kind == "tool_use":
            if ev.tool_use_id:
                uses[ev.tool_use_id] = ev
            continue
        if kind in ("tool_result", "PostToolUse", "PostToolUseFailure"):
            if kind == "tool_result":
                use = uses.pop(ev.tool_use_id or "", None)
                if use is None:
                    continue  # a result whose call we never saw: nothing to say about it
                tool, tool_input = use.tool_name or "", use.payload.get("tool_input") or {}
                output, flagged = str(p.get("text") or ""), bool(p.get("is_error"))
                ids = [use.id, ev.id]
            else:
                tool, tool_input = ev.tool_name or str(p.get("tool_name") or ""), p.get("tool_input") or {}
                output, flagged = response_text(p.get("tool_response") or p.get("error"))
                flagged = flagged or kind == "PostToolUseFailure"
                ids = [ev.id]
            tool_input = tool_input if isinstance(tool_input, dict) else {}
            command = shell_command(tool_input) if tool in SHELL_TOOLS or "cmd" in tool_input else ""
            steps.append(Step("run", output, ev.ts, ids, ev.lane, tool, tool_input, command,
                              failed=failed_output(output, flagged), rejected=bool(_REJECTED.search(output[:400]))))
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
        digest = f"{role}:{short_hash(text)}"
        if digest in seen_text and role in ("assistant", "user", "summary"):
            earlier = seen_text[digest]
            earlier.ids.append(ev.id)
            earlier.final = earlier.final or final
            continue
        step = Step(role, text, ev.ts, [ev.id], ev.lane, final=final)
        seen_text[digest] = step
        steps.append(step)
    return steps


# --- commands --------------------------------------------------------------------------------------------------

_SEGMENT_SPLIT = re.compile(r"&&|\|\||;|\||\n|\(|\)|\$\(")
_NOISE_PROGRAMS = frozenset({"cd", "source", ".", "export", "unset", "echo", "sleep", "set", "true", "false", "env",
                             "time", "sudo", "exec", "then", "do", "done", "fi", "if", "else"})
_MULTI = frozenset({"git", "gh", "npm", "pnpm", "yarn", "bun", "uv", "cargo", "go", "docker", "kubectl", "pip",
                    "pip3", "poetry", "pdm", "make", "npx", "uvx", "python", "python3", "brew", "apt", "dotnet"})
PLUMBING = re.compile(r"^\s*(?:ls|ll|cat|head|tail|less|pwd|wc|tree|which|whoami|find|rg|grep|sed\s+-n|awk|"
                      r"echo|stat|file|du|df|jq|sleep|date|git\s+(?:status|log|diff|show|branch|remote))\b")
TEST_COMMAND = re.compile(
    r"\b(pytest|py\.test|tox|nox|unittest|(?:npm|pnpm|yarn|bun)\s+(?:run\s+)?test|jest|vitest|mocha|ava|"
    r"cargo\s+(?:test|nextest)|go\s+test|mvn\s+(?:test|verify)|gradlew?\s+test|make\s+(?:test|check)|ctest|"
    r"rspec|phpunit|dotnet\s+test|deno\s+test)\b")
PROCEDURE_COMMAND = re.compile(
    r"\b((?:npm|pnpm|yarn|bun)\s+(?:run\s+\w[\w:-]*|install|i|ci|dev|build|start|add)|make\s+\w+|"
    r"cargo\s+(?:build|run|check|clippy|fmt)|go\s+(?:build|run|vet)|uv\s+(?:run|sync|pip\s+install|add)|"
    r"pip3?\s+install|poetry\s+(?:install|run)|ruff\s+(?:check|format)|mypy|pyright|black|eslint|prettier|tsc|"
    r"docker(?:\s+compose|-compose)?\s+(?:build|up|run)|act\b|vite\b|rackup|alembic\s+upgrade|"
    r"python3?\s+-m\s+\w+|npx\s+\w+)")
_TEST_SUMMARY = re.compile(
    r"(\d+ (?:passed|failed|error(?:s)?|skipped)(?:, \d+ (?:passed|failed|errors?|skipped|deselected|warnings?))*"
    r"|Tests?:?\s+(?:\d+ \w+ \| )*\d+ (?:passed|failed)(?: \| \d+ \w+)*(?: \(\d+\)|, \d+ total)?"
    r"|test result: \w+\. \d+ passed; \d+ failed|All \d+ tests? pass\w*)", re.IGNORECASE)
TEST_FAILED = re.compile(r"\b(\d+ failed|FAILED\b|FAIL\b|failures?=|\d+ errors?\b|Tests:.*failed)", re.IGNORECASE)
_ERROR_LINE = re.compile(r"(error|exception|failed|failure|fatal|cannot|could not|can't|not found|no such|denied|"
                         r"invalid|unknown|refused|timed? ?out|panic|unauthori[sz]ed|forbidden|missing|conflict|"
                         r"\b(?:HTTP|status)[ :/]*[45]\d\d\b)", re.IGNORECASE)
_COMMIT_RESULT = re.compile(r"^\[([\w./+-]+)(?: \(root-commit\))? ([0-9a-f]{7,40})\] (.+)$", re.MULTILINE)
PR_URL = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/pull/\d+")


def command_heads(command: str) -> set[str]:
    """'git commit', 'pytest', 'npm run' …: what makes two command lines 'the same command'."""
    heads: set[str] = set()
    first_line = command.split("<<", 1)[0]
    for segment in _SEGMENT_SPLIT.split(first_line):
        words = [w for w in segment.strip().split() if w]
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]) or words[0] in _NOISE_PROGRAMS):
            if words[0] in ("source", ".", "cd", "unset", "export"):
                words = []
                break
            words = words[1:]
        if not words:
            continue
        prog = words[0].rsplit("/", 1)[-1]
        if PLUMBING.match(prog) or prog in ("head", "tail", "xargs", "tee", "sort", "uniq", "cut", "tr"):
            continue
        rest = [w for w in words[1:] if not w.startswith("-") or w == "-m"]
        if prog in _MULTI and len(rest) > 1 and rest[0] in ("run", "exec", "x", "-m", "test"):
            heads.add(f"{prog} {rest[0]} {rest[1]}")
        else:
            heads.add(f"{prog} {rest[0]}" if prog in _MULTI and rest else prog)
    return heads


def short_command(command: str, limit: int = 80) -> str:
    first = command.strip().split("\n", 1)[0]
    if "<<" in first:
        first = first.split("<<", 1)[0].rstrip() + " <<…"
    return clip(first, limit)


def first_error_line(output: str) -> str:
    """The line that says what went wrong: the exception of a traceback, else the first line naming an error."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not re.match(r"^(Exit code:?\s*-?\d+|Wall time|Output:|<tool_use_error>|"
                                                r"</?[a-z_-]+>$|\s*\^+\s*$|at\s|File \")", ln)]
    if any(ln.startswith("Traceback") for ln in lines):
        for ln in reversed(lines):
            if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", ln):
                return clip(ln, 140)
    for ln in lines:
        if _ERROR_LINE.search(ln):
            return clip(re.sub(r"</?tool_use_error>", "", ln), 140)
    return clip(lines[0], 140) if lines else ""


def commit_subject(command: str, output: str) -> tuple[str, str] | None:
    """(sha, subject) of a `git commit`, from git's own `[branch sha] subject` line, else from the command's message
    (`-m "…"`, `-am '…'`, or a heredoc `-m "$(cat <<'EOF' … EOF)"`); sha is "" when only the command said it."""
    if not re.search(r"\bgit\b(?:\s+-\S+(?:\s+\S+)?)*\s+commit\b", command):
        return None
    match = _COMMIT_RESULT.search(output)
    if match:
        return match.group(2)[:7], match.group(3).strip()
    subject = ""
    message = re.search(r"""(?:\s-[a-zA-Z]*m|--message)(?:=|\s+)(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|(\S+))""", command)
    if message:
        subject = next(g for g in message.groups() if g is not None)
    if not message or subject.startswith("$"):  # `-m "$(cat <<EOF …"`; a bare `"$MSG"` says nothing
        heredoc = re.search(r"<<'?(\w+)'?\s*\n(.*?)\n\s*\1", command, re.DOTALL)
        subject = heredoc.group(2) if heredoc else ""
    subject = subject.replace("\\n", "\n").strip()
    return ("", subject.splitlines()[0].strip()) if subject else None


def test_summary(output: str) -> str:
    found = _TEST_SUMMARY.findall(output[-4000:])
    return clip(found[-1], 80) if found else ""
