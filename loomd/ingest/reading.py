"""What a tool call means: its command line, its output, whether it failed, what it committed, which line names
the error; which commands are plumbing. Read the same way at ingest (capture rules) and by the observer."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

CLIP_CHARS = 200
CODE_SLACK = 100  # see `clip`


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """One line, at most `limit` characters, cut at a word boundary (an ellipsis marks the cut): never inside a
    path, a command or an identifier, unless one word alone is longer than half the room. A `code span` the cut
    would open is finished when it closes within CODE_SLACK more characters (the fix in "Fixed by adding
    `if resp != nil { defer resp.Body.Close() }`" is the point of the line), else the cut moves before it."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    if cut > limit // 2 and text.count("`", 0, cut) % 2:
        opened, closed = text.rfind("`", 0, cut), text.find("`", cut)
        if 0 <= closed < limit + CODE_SLACK:
            return text if closed == len(text) - 1 else text[: closed + 1] + "…"
        if opened > limit // 2:
            cut = opened
    return (text[:cut].rstrip(" ,;:") if cut > limit // 2 else text[: limit - 1].rstrip()) + "…"


def clip_ends(text: str, limit: int = CLIP_CHARS) -> str:
    """Like `clip`, but a long text keeps its start and its end around the cut: a person's long request opens with
    its context and closes with what to do ("… let's make a PR to bump to node 22 then 24 if possible")."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    end_room = (limit - 3) * 2 // 5
    start = clip(text, limit - 3 - end_room).removesuffix("…")
    end = text[len(text) - end_room:]
    cut = end.find(" ")
    end = end[cut + 1:] if 0 <= cut < end_room // 2 else end
    return f"{start} … {end}"


def tick(command: str, limit: int = 80) -> str:
    return "`" + clip(command.replace("`", "'"), limit) + "`"


# Codex's code mode runs its shell through `exec`, a JavaScript snippet calling `tools.exec_command({cmd})`.
SHELL_TOOLS = frozenset({"Bash", "bash", "shell", "shell_command", "exec_command", "local_shell", "container.exec",
                         "run_command", "exec"})
EDIT_TOOLS = frozenset({"Edit", "MultiEdit", "Write", "NotebookEdit", "apply_patch", "edit_file", "write_file"})


def shell_command(tool_input: Any) -> str:
    """The command line of a shell tool call (Claude `command`, Codex `cmd` or argv lists, the commands of a Codex
    code-mode script, one a line)."""
    if not isinstance(tool_input, dict):
        return ""
    cmd = tool_input.get("command", tool_input.get("cmd", ""))
    script = tool_input.get("input")
    if not cmd and isinstance(script, str):
        return "\n".join(script_commands(script))
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        if len(cmd) == 3 and cmd[0].rsplit("/", 1)[-1] in ("bash", "sh", "zsh") and cmd[1] in ("-lc", "-c"):
            return cmd[2]
        return shlex.join(cmd)
    return cmd if isinstance(cmd, str) else ""


_SCRIPT_SHELL = re.compile(r"\btools\.(?:exec_command|shell_command|shell)\s*\(")
# The `cmd` of an argument object, JSON (`"cmd":"…"`) or JavaScript (`cmd:"…"`), as a JSON string literal.
_SCRIPT_CMD = re.compile(r'(?:"cmd"|\bcmd)\s*:\s*("(?:[^"\\\n]|\\.)*")')


def script_commands(script: str) -> list[str]:
    """The command lines a Codex code-mode script runs: each `cmd: "…"` string of a script that calls
    `tools.exec_command`; a command built from variables at run time names nothing here."""
    if not _SCRIPT_SHELL.search(script):
        return []
    found: list[str] = []
    for match in _SCRIPT_CMD.finditer(script):
        try:
            command = json.loads(match.group(1))
        except ValueError:
            continue
        if command.strip():
            found.append(command)
    return found


_EXIT = re.compile(r'(?:^\s*Exit code:?\s*|"exit_code"\s*:\s*|exit (?:status|code) )(-?\d+)', re.IGNORECASE)


def response_text(response: Any) -> tuple[str, bool]:
    """The readable output of a tool call (hook `tool_response` of any shape), and whether it says it failed."""
    if isinstance(response, str):
        return response, False
    if isinstance(response, dict):
        parts = [response[k] for k in ("stdout", "stderr", "output", "error", "content", "message", "result")
                 if isinstance(response.get(k), str) and response[k]]
        flagged = bool(response.get("is_error") or response.get("isError") or response.get("success") is False
                       or (isinstance(response.get("exit_code"), int) and response["exit_code"] != 0))
        # Claude Code's structured results: Read's {"file": {"content"}}, a subagent's report as content blocks,
        # Glob's and Grep's file lists. What the agent read or was told is what a later question asks about.
        read = response.get("file")
        if isinstance(read, dict) and isinstance(read.get("content"), str):
            parts.append(read["content"])
        if isinstance(response.get("content"), list):
            parts.append(response_text(response["content"])[0])
        names = response.get("filenames")
        if isinstance(names, list) and not parts:
            parts.append("\n".join(str(n) for n in names))
        if not parts and isinstance(response.get("filePath"), str):
            parts.append(f"File {response.get('type', 'written')}: {response['filePath']}")
        return "\n".join(p for p in parts if p), flagged
    if isinstance(response, list):
        return "\n".join(str(b.get("text", "")) for b in response if isinstance(b, dict)), False
    return "", False


def failed_output(output: str, flagged: bool) -> bool:
    if flagged:
        return True
    head = output[:2000]
    # Every branch of _EXIT holds `exit`, in any case (`İ` and `ı` also match its `i`): without it, no scan (the
    # case-insensitive scan cost 35 us on a 2 KB output, every tool call).
    if "exit" not in head.lower() and "\u0130" not in head and "\u0131" not in head:
        return False
    match = _EXIT.search(head)
    return bool(match and match.group(1) != "0")


# --- commands --------------------------------------------------------------------------------------------------

_SEGMENT_SPLIT = re.compile(r"&&|\|\||;|\||\n|\(|\)|\$\(")
_NOISE_PROGRAMS = frozenset({"cd", "source", ".", "export", "unset", "echo", "sleep", "set", "true", "false", "env",
                             "time", "sudo", "exec", "then", "do", "done", "fi", "if", "else"})
_MULTI = frozenset({"git", "gh", "npm", "pnpm", "yarn", "bun", "uv", "cargo", "go", "docker", "kubectl", "pip",
                    "pip3", "poetry", "pdm", "make", "npx", "uvx", "python", "python3", "brew", "apt", "dotnet"})
# Commands that only look around, move the shell or sync with a remote: their failures (an empty grep, `ls` of a
# missing folder, a rejected push) say nothing worth keeping, and they never make a procedure. A `git commit` with
# no message of its own (an editor, --amend) says nothing either. The one list for capture and the observer.
PLUMBING = re.compile(
    r"^\s*(?:ls|ll|cd|pwd|cat|head|tail|less|wc|tree|which|whoami|find|rg|grep|sed\s+-n|awk|echo|stat|file|du|df|"
    r"jq|sleep|date|clear|history|env|printenv|true"
    r"|git\s+(?:status|log|diff|show|branch|remote|push|pull|fetch|stash|add|restore|config|checkout\s+(?!-b)\S+$)"
    r"|git\s+commit\b(?!.*\s(?:-\w*m|--message)\b))\b")


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
# A checker's own diagnostic line: a rule code ("W292 …", "E501 …"), "error[E0308]: …", "path:12:3: …".
_DIAGNOSTIC = re.compile(r"^(?:[A-Z]{1,5}\d{2,5}\b(?!-)|error(?:\[\w+\])?:|[\w./\\-]+\.\w+(?::\d+){1,2}:?\s|"
                         r"[\w./\\-]+\.\w+\(\d+,\d+\):)")
_BANNER = re.compile(r"^[=\-*#_ ]*(?:found \d+ (?:errors?|problems?|issues?)(?: in \d+ files?)?|"
                     r"\d+ (?:errors?|problems?|warnings?)(?: (?:found|generated))?|short test summary info|"
                     r"failures|errors|\[\*\] \d+ fixable.*|\d+ failed(?:, \d+ \w+)*(?: in [\d.]+s)?)[.!]?[=\-*#_ ]*$",
                     re.IGNORECASE)
_COMMIT_RESULT = re.compile(r"^\[([\w./+-]+)(?: \(root-commit\))? ([0-9a-f]{7,40})\] (.+)$", re.MULTILINE)
PR_URL = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/pull/\d+")


def _segments(command: str) -> list[list[str]]:
    """The words of each simple command of a command line (its first line, before any heredoc), from the program
    on: variable assignments and noise (`sudo`, `time`, `echo` …) dropped, segments that only move the shell
    (`cd`, `source`, `export`) left out."""
    out: list[list[str]] = []
    for segment in _SEGMENT_SPLIT.split(command.split("<<", 1)[0]):
        words = [w for w in segment.strip().split() if w]
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]) or words[0] in _NOISE_PROGRAMS):
            if words[0] in ("source", ".", "cd", "unset", "export"):
                words = []
                break
            words = words[1:]
        if words:
            out.append([words[0].rsplit("/", 1)[-1], *words[1:]])
    return out


def command_heads(command: str) -> set[str]:
    """'git commit', 'pytest', 'npm run' …: what makes two command lines 'the same command'."""
    heads: set[str] = set()
    for prog, *args in _segments(command):
        if PLUMBING.match(prog) or prog in ("head", "tail", "xargs", "tee", "sort", "uniq", "cut", "tr"):
            continue
        rest = [w for w in args if not w.startswith("-") or w == "-m"]
        if prog in _MULTI and len(rest) > 1 and rest[0] in ("run", "exec", "x", "-m", "test"):
            heads.add(f"{prog} {rest[0]} {rest[1]}")
        else:
            heads.add(f"{prog} {rest[0]}" if prog in _MULTI and rest else prog)
    return heads


# Programs that only show files or list them (filters of their output included): what they print is a copy of
# the repository, which a later agent can read itself.
_VIEWERS = frozenset({"cat", "head", "tail", "less", "more", "bat", "nl", "sed", "awk", "rg", "grep", "egrep", "find",
                      "fd", "ls", "ll", "tree", "wc", "stat", "file", "sort", "uniq", "cut", "tr", "xargs", "jq",
                      "printf", "pwd", "test", "Get-Content", "gc", "type", "Select-String", "Get-ChildItem", "dir",
                      "Get-Item", "Select-Object"})


def only_views_files(command: str) -> bool:
    """Does this command line only show or list files (`cat`, `sed -n`, `rg`, `ls`, PowerShell's `Get-Content` …)?
    A `sed` that edits in place (`-i`) changes them."""
    segments = _segments(command)
    return bool(segments) and all(
        prog in _VIEWERS and not (prog == "sed" and any(a.startswith("-i") for a in args))
        for prog, *args in segments)


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
    # A count or a banner ("Found 1 error.", "===== FAILURES =====") says that something failed, not what.
    named = [ln for ln in lines if not _BANNER.match(ln)]
    for ln in named:
        if _DIAGNOSTIC.match(ln) or _ERROR_LINE.search(ln):
            return clip(re.sub(r"</?tool_use_error>", "", ln), 140)
    return clip((named or lines)[0], 140) if lines else ""


def commit_subject(command: str, output: str) -> tuple[str, str, str] | None:
    """(sha, subject, branch) of a `git commit`, from git's own `[branch sha] subject` line, else from the command's
    message (`-m "…"`, `-am '…'`, or a heredoc `-m "$(cat <<'EOF' … EOF)"`); sha and branch are "" when only the
    command said it."""
    if not re.search(r"\bgit\b(?:\s+-\S+(?:\s+\S+)?)*\s+commit\b", command):
        return None
    match = _COMMIT_RESULT.search(output)
    if match:
        return match.group(2)[:7], match.group(3).strip(), match.group(1)
    subject = ""
    message = re.search(r"""(?:\s-[a-zA-Z]*m|--message)(?:=|\s+)(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|(\S+))""", command)
    if message:
        subject = next(g for g in message.groups() if g is not None)
    if not message or subject.startswith("$"):  # `-m "$(cat <<EOF …"`; a bare `"$MSG"` says nothing
        heredoc = re.search(r"<<'?(\w+)'?\s*\n(.*?)\n\s*\1", command, re.DOTALL)
        subject = heredoc.group(2) if heredoc else ""
    subject = subject.replace("\\n", "\n").strip()
    return ("", subject.splitlines()[0].strip(), "") if subject else None


def test_summary(output: str) -> str:
    found = _TEST_SUMMARY.findall(output[-4000:])
    return clip(found[-1], 80) if found else ""
