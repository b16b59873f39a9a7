"""The observer's rules: walk a session's steps in order and note what a careful reader would keep.

What the user asked for and insisted on, what was decided and why, what failed and what fixed it, what went green,
what was committed, what the agent reported at the end of each turn, and — when the session is over — what was
left open. Observations are anchored on new steps only; earlier steps (the context) serve pairing and history.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loomd.ingest.reading import (
    EDIT_TOOLS,
    PLUMBING,
    PR_URL,
    PROCEDURE_COMMAND,
    TEST_COMMAND,
    TEST_FAILED,
    clip,
    command_heads,
    commit_subject,
    first_error_line,
    short_command,
    test_summary,
    tick,
)
from loomd.ingest.sentences import ACK, classify_user_sentence, clean_user_text, sentences, user_sentences
from loomd.workers.steps import Observation, SourceEvent, Step, to_steps
from loomd.workers.text import FILLER, classify_assistant_sentence, content_words, jaccard, summary_sentence

# Failures of the environment, not of the code: a command that then works differently is a lesson.
ENVIRONMENT = re.compile(
    r"command not found|not found in path|no such file|not installed|no module named|cannot find module|"
    r"permission denied|unauthori[sz]ed|forbidden|\b40[13]\b|credentials|token|not recognized|enoent|"
    r"could not resolve|connection refused|timed? ?out|already exists|would be overwritten|not a git repository|"
    r"unknown (?:option|command|flag)|invalid option|usage:|requires? (?:python|node|version)|not supported|"
    r"locked|in use|address already|is not (?:set|defined)|missing (?:env|variable|dependency)", re.IGNORECASE)
TYPES = ("constraint", "preference", "goal", "decision", "finding", "progress", "error", "pitfall", "procedure",
         "blocker", "todo", "topic")
IMPORTANCE = {"constraint": 0.9, "preference": 0.85, "decision": 0.7, "pitfall": 0.75, "procedure": 0.65,
              "finding": 0.6, "blocker": 0.6, "todo": 0.6, "goal": 0.55, "error": 0.5, "progress": 0.4, "topic": 0.3}



# The words a user typed when rejecting a tool call, as Claude Code quotes them in the call's result.
_USER_SAID = re.compile(r"the user said:\s*\n(.+?)(?:\n\s*\nNote: The user's next message|\Z)",
                        re.IGNORECASE | re.DOTALL)


def _questions(tool_input: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The questions a tool put to the user (AskUserQuestion, Codex's request_user_input), by their text."""
    found = tool_input.get("questions")
    return {str(q.get("question") or q.get("header") or q.get("id")): q
            for q in (found if isinstance(found, list) else []) if isinstance(q, dict)}


def _option(question: dict[str, Any], answer: str) -> str:
    """A chosen option with its own words ("Option C: Extra field: keeps the archive, flags it"), not the label
    alone: the label says nothing once the question is gone."""
    described = {str(o.get("label")): str(o.get("description") or "")
                 for o in question.get("options") or [] if isinstance(o, dict)}
    return f"{answer}: {clip(described[answer], 60)}" if described.get(answer) else answer


MAX_QUOTED_PROMPTS = 12  # of a compaction summary's "All user messages" (the newest part is in the transcript)
_COMPACT_SECTIONS = {
    "primary request and intent": "goal", "pending tasks": "todo", "current work": "progress",
    "optional next step": "todo", "errors and fixes": "pitfall", "problem solving": "finding",
}


@dataclass
class _Failure:
    step: Step
    line: str
    at: int  # the lane's run counter when it failed
    why: str = ""
    tests_ran: bool = False  # the tests ran and some failed (not: the runner could not start)


def _bare(command: str) -> str:
    return " ".join(command.replace("(", " ").replace(")", " ").split())


def _same_job(failed: str, fixed: str) -> bool:
    """Is `fixed` another attempt at what `failed` tried (not just any later command sharing a program)?"""
    core = failed.strip().split("\n", 1)[0]
    if len(core) >= 3 and core in fixed:
        return True
    return jaccard(content_words(failed.split("<<", 1)[0]), content_words(fixed.split("<<", 1)[0])) >= 0.4


# The user's request to change how something is: "let's modify the link button to be classic blue", "make the
# sidebar more compact", "change the port to 8080" (not "make sure …", not a question).
CHANGE_REQUEST = re.compile(
    r"^(?:(?:ok(?:ay)?|alright|now|great|cool|nice|perfect|good|thanks)[,.!]*\s+)?(?:let'?s\s+|please\s+)?"
    r"(?:make|change|modify|set|switch|turn|update|recolou?r)\s+(?!sure\b)[^?]{2,80}?\s+"
    r"(?:to be|to|into|as|more|less|a bit)\s+[^?]{2,80}$", re.IGNORECASE)


@dataclass
class _Lane:
    """Per lane (main thread or one subagent) state while walking a session."""

    failures: dict[str, _Failure] = field(default_factory=dict)
    rejected: Step | None = None
    rejected_left: int = 0
    last_assistant: Step | None = None
    answered: Step | None = None  # the assistant message the user's current turn answers
    awaiting_why: _Failure | None = None
    created: list[tuple[str, Step]] = field(default_factory=list)
    edited: list[tuple[str, Step]] = field(default_factory=list)
    todos: tuple[Step, list[tuple[str, str]]] | None = None
    runs: int = 0
    last_ask: Step | None = None  # the user's latest prompt (main lane)
    last_said: Step | None = None  # the agent's latest message, kept past the end of its turn
    change: str = ""  # the user's request of this turn to change how something is ("make the links blue")


class RuleObserver:
    """Walks context + new steps in order; emits observations anchored on new steps only."""

    def __init__(self, new_ids: Iterable[int], final: bool) -> None:
        self.new_ids = set(new_ids)
        self.final = final
        self.out: list[Observation] = []
        self.lanes: dict[str, _Lane] = {}
        self.procedures: dict[str, tuple[Step, int, str]] = {}  # command -> (last step, new runs, summary)
        # command -> events of earlier failures of it that a later run of it got past (the error is out of date)
        self.resolved: dict[str, list[int]] = {}

    def is_new(self, step: Step) -> bool:
        return step.ids[-1] in self.new_ids

    def emit(self, kind: str, text: str, anchor: Step, sources: Iterable[Step] = (), **meta: Any) -> None:
        if not self.is_new(anchor) or not text.strip():
            return
        ids = sorted({i for s in (anchor, *sources) for i in s.ids})
        self.out.append(Observation(kind, clip(text), anchor.ts, ids, IMPORTANCE[kind],
                                    {k: v for k, v in meta.items() if v not in (None, "", [])}))

    def run(self, steps: Sequence[Step]) -> list[Observation]:
        for step in steps:
            lane = self.lanes.setdefault(step.lane, _Lane())
            handler = getattr(self, f"on_{step.role}")
            handler(step, lane)
        for name, lane in self.lanes.items():
            self.close_turn(lane, sidechain=name != "main")
            if self.final:
                self.open_todos(lane)
        if self.final and steps and "main" in self.lanes:
            self.stopped(self.lanes["main"], steps[-1])
        for command, (step, runs, summary) in self.procedures.items():
            label = "Tests pass" if TEST_COMMAND.search(command) else "Works"
            # Claude's Bash calls say what they are for: "which command does what" is the point of a procedure.
            what = str(step.tool_input.get("description") or "").strip()
            what = f" ({clip(what, 60)})" if what and len(command) < 130 else ""
            self.emit("procedure", f"{label}: {tick(command, 150)}{what}", step, command=command, runs=runs,
                      summary=summary, resolves=self.resolved.get(command))
        return dedupe(self.out)

    # --- turns ---------------------------------------------------------------------------------------------

    def on_user(self, step: Step, lane: _Lane) -> None:
        lane.answered = lane.last_assistant  # what a short "ok, let's do that" answers
        self.close_turn(lane, sidechain=step.lane != "main")
        lane.rejected = None
        found = user_sentences(step.text)
        if step.lane != "main":
            # A subagent's prompt is the parent agent's brief, not the user's voice: keep only what it asks.
            brief = [s for s in found if not re.match(r"^(?:you are|you're|context\b)", s, re.IGNORECASE)]
            if brief:
                self.emit("goal", f"Subagent task: {' '.join(brief[:2])}", step, lane=step.lane)
            return
        lane.last_ask = step
        self.user_voice(step.text, step, "User asked")
        words = " ".join(clean_user_text(step.text).split())
        lane.change = words if len(words) <= 160 and CHANGE_REQUEST.match(words) else ""

    def user_voice(self, text: str, step: Step, lead: str, steers: bool = False) -> None:
        """The human user's own words (a prompt, the words given with a rejected call, a note on an answer):
        sentences that state a rule or a preference as such, and what they asked for in their words. `steers`: the
        words correct or qualify what the agent proposed (a rejection's words, a note beside an option), which the
        start block shows before plain asks."""
        found = user_sentences(text)
        classified = 0
        answered = self.lanes.get(step.lane, _Lane()).answered
        for sentence in found:
            kind = classify_user_sentence(sentence)
            if kind:
                classified += 1
                # A short choice names its object by pointing ("let's use this one"): say what it answered.
                on = summary_sentence(answered.text) if kind == "decision" and answered and len(sentence) < 100 else ""
                self.emit(kind, f"{sentence} (on: {on})" if on else sentence, step, by="user")
        # The whole text, not only its sentences: a long run-on prompt is one "sentence" too long to classify, and
        # still what the user asked for.
        words = " ".join(clean_user_text(text).split())
        if len(words.split()) >= 5 and not ACK.match(words) and (classified < len(found) or not found):
            self.emit("goal", f"{lead}: {words}", step, by="user", steers=steers or None)

    def on_assistant(self, step: Step, lane: _Lane) -> None:
        if lane.awaiting_why is not None:
            first = summary_sentence(step.text)
            if first and len(first) <= 140:
                lane.awaiting_why.why = first
            lane.awaiting_why = None
        taken = 0
        for sentence in sentences(step.text, prose_only=True):
            kind = classify_assistant_sentence(sentence)
            if kind and taken < 3:
                taken += 1
                self.emit(kind, FILLER.sub("", sentence), step, by="assistant")
        lane.last_assistant = lane.last_said = step
        if step.final:
            self.close_turn(lane, sidechain=step.lane != "main")

    def close_turn(self, lane: _Lane, *, sidechain: bool) -> None:
        """The end of a turn: what the last assistant message reports, which files it changed."""
        last = lane.last_assistant
        if last is not None:
            report = summary_sentence(last.text)
            said = {o.text.lower() for o in self.out}
            if report and clip(report).lower() not in said:
                prefix = "Subagent reported: " if sidechain else "Reported: "
                self.emit("progress", prefix + report, last)
            # A change the user asked for, with what it became: "make the link button classic blue" is a choice
            # whose object is in the report of it ("now uses #0066cc, #004499 on hover").
            if lane.change and report and content_words(lane.change) & content_words(report):
                self.emit("decision", f"{clip(lane.change, 100)} → {report}", last, by="user")
            lane.change = ""
        if lane.created:
            paths = list(dict.fromkeys(p for p, _ in lane.created))
            self.emit("progress", "Created " + ", ".join(paths[:6]), lane.created[-1][1],
                      [s for _, s in lane.created], files=paths[:20])
        if lane.edited:
            paths = list(dict.fromkeys(p for p, _ in lane.edited))
            self.emit("progress", "Edited " + ", ".join(paths[:6]), lane.edited[-1][1],
                      [s for _, s in lane.edited], files=paths[:20])
        lane.last_assistant, lane.created, lane.edited = None, [], []

    def stopped(self, lane: _Lane, end: Step) -> None:
        """Where the session stopped: the user's last request and the agent's last words, noted on its last step.
        "Where did we leave off" is a next session's first question, and the last turn is rarely summarised."""
        ask = " ".join(clean_user_text(lane.last_ask.text).split()) if lane.last_ask else ""
        said = " ".join(lane.last_said.text.split()) if lane.last_said else ""
        if not (ask or said):
            return
        parts = [f"the user last asked: {clip(ask, 80)}" if ask else "", f"the agent last said: {said}" if said else ""]
        self.emit("progress", "Session stopped; " + "; ".join(p for p in parts if p), end,
                  [s for s in (lane.last_ask, lane.last_said) if s is not None], ending=True)

    def open_todos(self, lane: _Lane) -> None:
        if lane.todos is None:
            return
        step, items = lane.todos
        for status, text in items:
            if status in ("pending", "in_progress"):
                self.emit("todo", f"Unfinished ({status.replace('_', ' ')}): {text}", step)

    def on_compact(self, step: Step, lane: _Lane) -> None:
        """The agent's own compaction summary: its intent, open tasks, current work, errors and fixes."""
        items: list[tuple[str, str]] = []  # (section, text); nested bullets fold into their parent
        said: list[str] = []  # Claude Code quotes every user message of the summarised part: the user's own words
        section, indent = "", -1
        for raw in step.text.splitlines():
            head = re.match(r"^\s*\d+\.\s+([A-Za-z ]+):?\s*$", raw)
            if head:
                section, indent = head.group(1).strip().lower(), -1
                continue
            bullet = re.match(r"^(\s*)[-*]\s+(.+)$", raw)
            if bullet and section == "all user messages":
                said.append(bullet.group(2).strip().strip('"'))
            if not bullet or section not in _COMPACT_SECTIONS:
                continue
            depth, text = len(bullet.group(1)), bullet.group(2).strip().strip('"')
            if indent < 0 or depth <= indent:
                indent = depth
                items.append((section, text))
            elif items and items[-1][0] == section:
                parent = items[-1][1]
                items[-1] = (section, f"{parent} {text}" if parent.endswith(":") else f"{parent}; {text}")
        counts: dict[str, int] = {}
        for section, text in items:
            if len(text) < 15 or re.match(r"^none\b", text, re.IGNORECASE) or counts.get(section, 0) >= 3:
                continue
            counts[section] = counts.get(section, 0) + 1
            self.emit(_COMPACT_SECTIONS[section], f"Before compaction: {text}", step, section=section)
        for text in said[-MAX_QUOTED_PROMPTS:]:
            self.user_voice(text, step, "User asked (before compaction)")
        if not counts:
            first = summary_sentence(step.text)
            if first:
                self.emit("progress", f"Compaction summary: {first}", step)

    def on_summary(self, step: Step, lane: _Lane) -> None:
        text = " ".join(step.text.split())
        text = re.sub(r"\s*\(disable recaps in /config\)\s*$", "", text)
        if len(text) > 100:
            self.emit("progress", f"Recap: {text}", step)
        else:
            self.emit("topic", f"Session topic: {text}", step)

    def on_marker(self, step: Step, lane: _Lane) -> None:
        for sentence in user_sentences(step.text):
            kind = classify_user_sentence(sentence) or "goal"
            self.emit(kind, f"Compaction instructions: {sentence}", step, by="user")

    # --- tool runs -----------------------------------------------------------------------------------------

    def on_run(self, step: Step, lane: _Lane) -> None:
        if step.rejected:
            self.on_rejected(step, lane)
            return
        tool = step.tool
        if lane.rejected is not None and not step.failed:
            self.after_rejection(step, lane)
        if tool == "AskUserQuestion":
            asked = _questions(step.tool_input)
            for question, answer in re.findall(r'"([^"]{5,300})"="([^"]{1,200})"', step.text):
                self.emit("decision", f'User chose "{_option(asked.get(question, {}), answer)}" for: {question}', step,
                          by="user")
            return
        if tool == "request_user_input":
            self.on_answers(step)
            return
        if tool == "ExitPlanMode":
            if re.search(r"User has approved your plan", step.text):
                plan = str(step.tool_input.get("plan") or "")
                title = re.search(r"^#+\s*(?:Plan:\s*)?(.+)$", plan, re.MULTILINE)
                self.emit("decision", f"Plan approved: {title.group(1) if title else clip(plan, 120)}", step,
                          by="user")
            return
        if tool in ("TodoWrite", "update_plan"):
            items = step.tool_input.get("todos") or step.tool_input.get("plan") or []
            parsed = [(str(i.get("status", "")), str(i.get("content") or i.get("step") or ""))
                      for i in (items if isinstance(items, list) else []) if isinstance(i, dict)]
            lane.todos = (step, [(s, t) for s, t in parsed if t])
            return
        patch = str(step.tool_input.get("input", "")) + step.command
        if (tool in EDIT_TOOLS or "*** Begin Patch" in patch) and not step.failed:
            paths = re.findall(r"\*\*\* (Add|Update|Delete) File: (\S+)", patch)
            path = str(step.tool_input.get("file_path") or step.tool_input.get("path") or "")
            for verb, name in paths or [("Write" if tool == "Write" else "Update", path)]:
                if not name:
                    continue
                created = verb == "Add" or (verb == "Write" and "created" in step.text.lower())
                (lane.created if created else lane.edited).append((name, step))
            return
        if step.command:
            self.on_command(step, lane)
        elif step.failed and tool.startswith("mcp__"):
            # Built-in tools fail mechanically (a stale edit, a missing file) and the agent retries; an
            # integration failing says something about the environment.
            line = first_error_line(step.text)
            if line:
                self.emit("error", f"{tool} failed: {line}", step, tool=tool)

    def on_answers(self, step: Step) -> None:
        """Codex's questions to the user: each choice with its question and the option's own words, and the notes
        the user typed beside an option in their own voice."""
        asked = {str(q.get("id")): q for q in _questions(step.tool_input).values()}
        try:
            answers = json.loads(step.text).get("answers")
        except (ValueError, AttributeError):
            return
        for qid, entry in (answers.items() if isinstance(answers, dict) else ()):
            picked = entry.get("answers") if isinstance(entry, dict) else None
            question = asked.get(str(qid), {})
            for answer in picked if isinstance(picked, list) else []:
                answer = str(answer)
                if answer.startswith("user_note:"):
                    if step.lane == "main":
                        self.user_voice(answer.removeprefix("user_note:"), step, "User noted", steers=True)
                    continue
                about = question.get("question") or question.get("header") or qid
                self.emit("decision", f'User chose "{_option(question, answer)}" for: {about}', step, by="user")

    def on_rejected(self, step: Step, lane: _Lane) -> None:
        said = _USER_SAID.search(step.text)
        if said and step.lane == "main":
            # Claude Code hands the user's words given with a rejection back to the agent inside the result.
            self.user_voice(said.group(1), step, f"User said instead of {step.tool or 'the call'}", steers=True)
        if lane.rejected is None and "right now" not in step.text[:200]:
            lane.rejected, lane.rejected_left = step, 6

    def after_rejection(self, step: Step, lane: _Lane) -> None:
        rejected = lane.rejected
        assert rejected is not None
        lane.rejected_left -= 1
        if lane.rejected_left <= 0:
            lane.rejected = None
            return
        if rejected.tool != step.tool or not rejected.command or not step.command:
            return
        before, after = command_heads(rejected.command), command_heads(step.command)
        words_before, words_after = content_words(rejected.command), content_words(step.command)
        if before & after or jaccard(words_before, words_after) >= 0.3 or {
                h.split()[-1] for h in before} & {h.split()[-1] for h in after}:
            self.emit("preference", f"User rejected {tick(short_command(rejected.command, 60))}; "
                                    f"{tick(short_command(step.command, 60))} was used instead", step, [rejected],
                      by="user")
            lane.rejected = None

    def on_command(self, step: Step, lane: _Lane) -> None:
        lane.runs += 1
        command, heads = step.command, command_heads(step.command)
        plumbing = bool(PLUMBING.match(command))
        is_test = bool(TEST_COMMAND.search(command.split("<<", 1)[0]))
        if plumbing and step.failed:
            return  # `ls` of a missing folder, an empty grep: looking around, not a failure worth keeping
        if step.failed or (is_test and TEST_FAILED.search(test_summary(step.text) or "")):
            line = first_error_line(step.text)
            ran = is_test and bool(test_summary(step.text))
            if ran:
                failing = re.search(r"^FAILED (\S+)", step.text, re.MULTILINE)
                line = clip(f"{test_summary(step.text)} {failing.group(1) if failing else ''}".strip(), 120)
            failure = _Failure(step, line, lane.runs, tests_ran=ran)
            for head in heads or {command}:
                lane.failures.setdefault(head, failure)
            lane.awaiting_why = failure
            if not plumbing and line:
                self.emit("error", f"{tick(short_command(command, 70))} failed: {line}", step, command=command)
            return
        fixed = next((lane.failures[h] for h in heads if h in lane.failures), None)
        if fixed is not None and (lane.runs - fixed.at > 12 or not _same_job(fixed.step.command, command)):
            fixed = None  # a later command of the same program, not another go at the failed one
        for head, failure in list(lane.failures.items()):
            if failure is fixed or lane.runs - failure.at > 12:
                del lane.failures[head]
        # Output cut by a pipe proves nothing about the run — but a `| tail -n` keeps the end, where a runner's
        # summary and a command's outcome are (agents pipe long test output through it).
        filtered = bool(re.search(r"\|\s*(?:grep|rg|head)\b", command))
        summary = test_summary(step.text) if is_test and not filtered else ""
        if fixed is not None and not plumbing:
            if is_test and filtered:
                pass  # the output was cut by a pipe: it proves nothing about the tests
            elif is_test and fixed.tests_ran:
                self.emit("progress", f"Tests green: {tick(short_command(command, 70))}"
                                      f"{' (' + summary + ')' if summary else ''}; was failing: {fixed.line}",
                          step, [fixed.step], command=command, resolves=fixed.step.ids)
            elif short_command(fixed.step.command) != short_command(command) and (
                    ENVIRONMENT.search(fixed.line) or _bare(fixed.step.command) not in _bare(command)):
                # A different command line, or the same one after the environment was fixed: a pitfall. The same
                # command passing after code edits is just work getting done (the edits are their own notes).
                why = f" ({fixed.why})" if fixed.why else ""
                self.emit("pitfall", f"{tick(short_command(fixed.step.command, 50))} failed ({clip(fixed.line, 70)}); "
                                     f"{tick(short_command(command, 70))} worked{why}", step, [fixed.step],
                          failed=fixed.step.command, fixed=command, resolves=fixed.step.ids)
        if fixed is not None and not plumbing and not filtered:
            self.resolved.setdefault(short_command(command, 150), []).extend(fixed.step.ids)
        commit = commit_subject(command, step.text)
        if commit:
            sha, subject, branch = commit
            # git's own `[branch sha]` when it printed one: where the work went is half of what a commit says.
            ref = f" [{branch} {sha}]" if branch else f" {sha}" if sha else ""
            self.emit("decision", f"Committed{ref}: {subject}", step, commit=sha or None, branch=branch or None)
            return
        url = PR_URL.search(step.text) if re.search(r"\bgh\s+pr\s+create\b", command) else None
        if url:
            self.emit("progress", f"Opened pull request {url.group(0)}", step)
            return
        first_line = command.split("<<", 1)[0]
        if (not plumbing and not filtered and len(first_line) <= 160
                and (is_test or PROCEDURE_COMMAND.search(first_line))):
            key = short_command(command, 150)
            if self.is_new(step):  # earlier runs were counted when their own batch was observed
                _, runs, _ = self.procedures.get(key, (step, 0, ""))
                self.procedures[key] = (step, runs + 1, summary)


def dedupe(observations: Sequence[Observation]) -> list[Observation]:
    """One observation per (type, text) within a pass; sources merge."""
    out: dict[tuple[str, str], Observation] = {}
    for obs in observations:
        key = (obs.type, obs.text.lower())
        if key in out:
            merged = out[key]
            merged.sources = sorted(set(merged.sources) | set(obs.sources))
        else:
            out[key] = obs
    return list(out.values())


def observe(events: Sequence[SourceEvent], context: Sequence[SourceEvent] = (), *,
            final: bool = False) -> list[Observation]:
    """The rule-based observer: observations for `events`, with `context` (earlier events) for pairing only."""
    steps = to_steps([*context, *events])
    return RuleObserver((e.id for e in events), final).run(steps)
