"""The evidence tier (loomd/workers/evidence.py): every step of a session searchable as passages.

Pure passage cutting first, then a real daemon on a real transcript: a line deep inside a long tool result is found
by `search` as an evidence passage, and `evidence` leads from that passage back to its source events."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, need_test_data, serving

from loomd.client import AsyncClient
from loomd.context.render import recall_room
from loomd.daemon import Daemon
from loomd.search.fusion import MAX_QUERY_TERMS, query_terms
from loomd.search.retrieval import Stemmer, _may_stem_to, _stem_keys, dense_wins, held_terms
from loomd.search.windows import GAP, LEAD_CHARS, WINDOW_CHARS, best_windows, merge_passages
from loomd.workers.evidence import MAX_ITEM_CHARS, PASSAGE_CHARS, evidence_of, head_and_tail, passages
from loomd.workers.steps import NO_RESULT, Step

REAL = "daaain-claude-code-log/-Users-dain-workspace-danieldemmel-me-next"


def test_passages_stay_within_size_and_overlap() -> None:
    text = "\n".join(f"line {i}: the build step {i} wrote dist/bundle-{i:04d}.js in {i * 7} ms" for i in range(200))
    out = passages(text, "Bash `npm run build`:")
    assert len(out) > 5
    assert all(len(p) <= PASSAGE_CHARS and p.startswith("Bash `npm run build`: ") for p in out)
    body = [p.removeprefix("Bash `npm run build`: ").splitlines() for p in out]
    for before, after in zip(body, body[1:], strict=False):
        assert before[-1] in after[:3]  # the last lines of one passage open the next: nothing falls between
    assert {ln for b in body for ln in b} == set(text.splitlines())


def test_passages_never_cut_inside_a_word_when_there_is_space() -> None:
    words = [f"src/module_{i}/handler.py" for i in range(120)]
    out = passages(" ".join(words), "Read:")
    pieces = [w for p in out for w in p.removeprefix("Read: ").split()]
    assert set(pieces) == set(words)


def test_a_long_item_keeps_head_and_tail() -> None:
    text = "HEAD " + "x " * 20_000 + " TAIL"
    kept = head_and_tail(text)
    assert len(kept) < MAX_ITEM_CHARS + 100 and kept.startswith("HEAD") and kept.endswith("TAIL")
    assert "chars left out" in kept


def test_a_tool_run_is_its_input_and_its_result_and_a_call_seen_twice_counts_once() -> None:
    edit = Step("run", "The file has been updated.", 1.0, [1], tool="Edit",
                tool_input={"file_path": "app/config.py", "old_string": "RETRIES = 3", "new_string": "RETRIES = 5"},
                call="tu1")
    hook_copy = Step("run", "The file has been updated.", 1.0, [2], tool="Edit", tool_input=edit.tool_input,
                     call="tu1")
    shell = Step("run", "ERROR: unmet peer vitest@^3.2.0", 2.0, [3], tool="Bash", command="pnpm install",
                 failed=True, call="tu2")
    found = evidence_of([edit, hook_copy, shell], {1, 2, 3})
    assert [e.sources for e in found] == [[1], [3]]
    assert "app/config.py" in found[0].text and "RETRIES = 5" in found[0].text and "RETRIES = 3" in found[0].text
    assert found[1].text.startswith("Bash `pnpm install`:") and "unmet peer vitest@^3.2.0" in found[1].text
    assert [e.text for e in evidence_of([edit, shell], {3})] == [found[1].text]  # only steps holding a new event
    assert "RETRIES = 5" in found[1].context  # the passage before it, as context


def test_what_a_step_only_viewed_and_whose_words_a_subagent_prompt_holds() -> None:
    """A passage says where it came from: a subagent's prompt is its parent agent's brief, never "User:"; a step
    that only showed or listed files (Read, `sed -n`, `rg`, `ls`) or loaded tools (ToolSearch), or a message that
    only announces the next step is an aside, which search ranks below what the session said and did
    (`aside_prior`); a step that also changed something, or a message that reports, is not."""
    brief = Step("user", "You are a Go expert tasked with cleaning up unused code.", 1.0, [1], lane="agent-1")
    user = Step("user", "also use tdd and serena and the mcp tools", 2.0, [2])
    read = Step("run", "package main\nfunc main() {}", 3.0, [3], tool="Read", tool_input={"file_path": "main.go"})
    cat = Step("run", "[tool]\nname = 'x'", 4.0, [4], tool="Bash", command="cd app && sed -n '1,40p' pyproject.toml")
    edit = Step("run", "ok", 5.0, [5], tool="Bash", command="sed -i 's/a/b/' f.txt && cat f.txt")
    announce = Step("assistant", "Perfect! Now let me check the remaining lint warnings:", 6.0, [6])
    report = Step("assistant", "Let me summarise: the lint warnings came from generated files; all 12 are fixed.",
                  7.0, [7])
    loader = Step("run", "[tool_reference: WebFetch]", 8.0, [8], tool="ToolSearch",
                  tool_input={"query": "select:WebFetch"})  # Claude Code loading a deferred tool
    found = {e.sources[0]: e for e in evidence_of([brief, user, read, cat, edit, announce, report, loader],
                                                  {1, 2, 3, 4, 5, 6, 7, 8})}
    assert found[1].head == "Subagent task:" and found[2].head == "User:"
    assert [i for i, e in sorted(found.items()) if e.meta().get("aside")] == [3, 4, 6, 8]


def _deep_line(path: Path) -> str:
    """A distinctive line from the middle of the file's longest tool result (read here with plain JSON)."""
    longest = ""
    for raw in path.read_text().splitlines():
        content = (json.loads(raw).get("message") or {}).get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                text = block["content"] if isinstance(block["content"], str) else json.dumps(block["content"])
                longest = max(longest, text, key=len)
    assert len(longest) > 3000
    middle = longest[len(longest) // 2:]
    lines = [re.sub(r"^ *\d+→", "", ln).strip() for ln in middle.splitlines()[1:]]  # Read's numbering is dropped
    return next(ln for ln in lines if len(re.findall(r"[a-z]{3,}", ln)) >= 3)


async def test_a_line_deep_in_a_tool_result_is_found_as_evidence(client: AsyncClient, daemon: Daemon) -> None:
    path = next(need_test_data("transcripts", REAL).glob("*.jsonl"))
    assert daemon.tailer is not None
    imported = await daemon.tailer.import_file(path)
    (session,) = imported["sessions"]
    run = await client.call("workers_run", name="observer", session_id=session, final=True)
    assert run["outcome"] == "ok" and run["detail"]["evidence"] > 0
    line = _deep_line(path)
    project = (await client.call("events", session_id=session, limit=1))["events"][0]["project"]
    found = await client.call("search", query=line, mode="keyword", project=project, limit=5)
    evidence = [r for r in found["results"] if r["kind"] == "evidence" and line in r["text"]]
    assert evidence, (line, [r["text"][:80] for r in found["results"]])
    # The step is a Read, whose passages rank below what the session said (`aside_prior`); without that prior it
    # is the first hit.
    found = await client.call("search", query=line, mode="keyword", project=project, limit=5,
                              tuning={"aside_prior": 1.0})
    evidence = [r for r in found["results"] if r["kind"] == "evidence" and line in r["text"]]
    # The first hit shows up to twice a passage's room of its step (this step is long: it does), the others one.
    first, *rest = found["results"]
    assert first is evidence[0] and WINDOW_CHARS < len(first["text"]) <= LEAD_CHARS
    assert all(len(r["text"]) <= max(WINDOW_CHARS, PASSAGE_CHARS) for r in rest if r["kind"] == "evidence")
    sources = (await client.call("evidence", id=evidence[0]["id"], max_chars=20_000))["memories"][0]["events"]
    assert any(line in e["text"] for e in sources)


def test_a_step_is_put_back_together_and_shows_the_lines_that_match() -> None:
    head = "Bash `nix develop -c lint`:"
    lines = [f"checking module {i} of the flake: ok" for i in range(60)]
    lines[3], lines[50] = "running statix over 12 files", "running deadnix over 12 files"
    texts = passages("\n".join(lines), head)
    assert len(texts) > 2 and not any("statix" in t and "deadnix" in t for t in texts)  # no one passage has both
    assert merge_passages(head, texts) == lines  # the overlap is kept once
    shown = best_windows(head, lines, lambda line: {t for t in ("statix", "deadnix") if t in line})
    assert shown.startswith(head) and "statix" in shown and "deadnix" in shown and GAP in shown
    assert len(shown) <= WINDOW_CHARS
    assert best_windows(head, lines[:3], lambda _: ()) == f"{head} " + "\n".join(lines[:3])  # short: whole


def test_a_window_keeps_the_lines_that_follow_what_matched() -> None:
    """The answer follows the line that names its subject ("… failed" and then "fixed by …"), without the query's
    words: the window is a run from the best-covering line on, not the lines that each hold a word."""
    head = "Compaction summary:"
    lines = [f"- note {i}: the import step ran and logged its output" for i in range(60)]
    lines[20] = "- Import path errors: test files failed to compile"
    lines[21] = "- Fixed by using the full GitHub module path everywhere"
    query = "why did test files fail to compile on import"

    def holds(line: str) -> frozenset[str]:
        return held_terms(query, line)

    shown = best_windows(head, lines, holds)
    assert lines[20] in shown and lines[21] in shown
    assert len(shown) <= WINDOW_CHARS


async def test_a_prompt_recall_shows_a_window_of_each_step_within_its_share(client: AsyncClient,
                                                                            daemon: Daemon) -> None:
    """The per-prompt block holds `prompt_block_lines` hits: a long step shows the window of it that matches the
    prompt, cut to its share of the block, so several hits fit instead of one or two whole passages."""
    path = next(need_test_data("transcripts", REAL).glob("*.jsonl"))
    assert daemon.tailer is not None
    (session,) = (await daemon.tailer.import_file(path))["sessions"]
    assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] == "ok"
    project = (await client.call("events", session_id=session, limit=1))["events"][0]["project"]
    line = _deep_line(path)
    # Asked about: a recall answers questions (context/relevance.py).
    reply = await client.call("context", kind="prompt", session_id="a-later-session", project=project,
                              prompt=f"where did we see {line}?")
    block = reply["text"]
    cfg = daemon.config
    assert block and len(block) <= cfg.prompt_block_chars
    body = block.splitlines()[1:-1]
    assert 1 <= len(body) <= cfg.prompt_block_lines
    room = recall_room(cfg.prompt_block_chars, cfg.prompt_block_lines)
    assert all(len(shown) <= room + len("[V] 2025-01-01  #1234567") for shown in body)
    assert any(line[:60] in shown for shown in body)  # the matching window, from deep inside the step


async def test_what_a_hook_only_session_read_is_evidence(client: AsyncClient) -> None:
    """A session seen only through its hooks (no transcript): Claude Code's structured tool results — Read's
    {"file": {"content"}}, a subagent's report as content blocks — are the step's text, as in a transcript."""
    logs = need_test_data("transcripts", "CoorpAcademy-serverless-plugins", "logs")
    records = [r for name in ("session_start.json", "user_prompt_submit.json")
               for r in json.loads((logs / name).read_text())]
    for folder in sorted(p for p in logs.iterdir() if p.is_dir()):
        records += [r for f in sorted(folder.glob("*.json")) for r in json.loads(f.read_text())]
    reads = [r for r in records if r.get("hook_event_name") == "PostToolUse" and r.get("tool_name") == "Read"
             and isinstance((r.get("tool_response") or {}).get("file"), dict)]
    assert reads
    session = reads[0]["session_id"]
    for record in sorted((r for r in records if r.get("session_id") == session), key=lambda r: r.get("timestamp", 0)):
        await client.call("hook", event=record["hook_event_name"], agent="claude", raw=json.dumps(record))
    assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] == "ok"
    read = next(r for r in reads if r["session_id"] == session)
    content = read["tool_response"]["file"]["content"]
    line = next(ln for ln in content.splitlines() if len(ln.split()) >= 5)
    found = await client.call("search", query=line, mode="keyword", cwd=read["cwd"], limit=5, kind="evidence")
    assert any(line in r["text"] for r in found["results"]), [r["text"][:120] for r in found["results"]]


def test_a_window_shows_the_sentence_of_a_paragraph_that_answers() -> None:
    """Prose comes as paragraphs of one line each: the sentence that answers is shown without the paragraph around
    it, on its own line of the window, not the paragraph cut at the window's end."""
    answer = "My recommendation: build EdgeRunner first, and execute against Pascal."
    paragraph = " ".join(f"Option {i} was weighed against the latency budget and the team's experience with it."
                         for i in range(8)) + " " + answer
    lines = ["**Shortlist**", "1. EdgeRunner: an engine that watches the odds feed and orders when the edge holds.",
             paragraph, "2. Circuit-0: a risk layer for the same feed."]
    shown = best_windows("Assistant:", lines, lambda line: {t for t in ("recommendation", "Pascal", "execute")
                                                            if t in line}, 360)
    assert answer in shown and "Option 0 " not in shown and len(shown) <= 360, shown


def test_words_stemmed_together_are_stemmed_as_one_by_one() -> None:
    """The stemmer takes a batch of new words in one round (`Stemmer.many`): each word still gets exactly its own
    index terms, whatever the others are (a word of several tokens, a word of none, repeats, a cached one)."""
    words = ["running", "foo_bar", "don't", "naïve", "__init__", "x2", "_", "'", "running", "Ações", "v1.2", "ran"]
    alone = Stemmer()
    expected = {w: alone(w) for w in words}
    assert expected["foo_bar"] == ("foo", "bar") and expected["_"] == () and expected["running"] == ("run",)
    together = Stemmer()
    together("ran")  # cached before the batch
    assert together.many(words) == expected
    assert list(together.many(reversed(words))) == list(dict.fromkeys(reversed(words)))  # in the order given
    assert held_terms("running foo_bar", "the foo bar runs") == frozenset({"running", "foo_bar"})


def test_one_stemmer_stems_from_two_threads_at_once() -> None:
    """A search stems on the reader's thread while a prompt's relevance check stems on the loop, through the one
    stemmer and its one scratch table: each call still gets exactly its own words' index terms."""
    import threading

    batches = [[f"{stem}{n}ing {stem}{n}ed" for stem in ("walk", "talk", "jump", "climb")] for n in range(400)]
    expected = [Stemmer().many(batch) for batch in batches]
    shared, wrong = Stemmer(), []

    def stem(part: int) -> None:
        for i in range(part, len(batches), 2):
            got = shared.many(batches[i])
            if got != expected[i]:
                wrong.append((i, got))

    threads = [threading.Thread(target=stem, args=(part,)) for part in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:3]


def test_held_terms_stems_only_the_words_that_can_hold_a_query_term() -> None:
    """A word is stemmed only when one of its index terms may be a query term's (`_may_stem_to`): never is a word
    skipped that holds one. Checked on the words of the shared transcripts, of the embedding model's vocabulary and
    every ASCII word of up to three letters, each against its own index terms; and `held_terms` against stemming
    every word, on real lines."""
    import itertools
    import string

    folder = need_test_data("transcripts")
    words: set[str] = {"".join(p) for n in (1, 2, 3) for p in itertools.product(string.ascii_lowercase, repeat=n)}
    lines: list[str] = []
    for path in sorted(folder.rglob("*.jsonl"))[:40]:
        text = path.read_text(errors="replace")[:400_000]
        words.update(query_terms(text, frozenset(), limit=None))
        lines.extend(line[:400] for line in text.splitlines()[::5][:40])
    vocabulary = json.loads((REPO / "loomd" / "models" / "minilm-tokenizer.json").read_text())["model"]["vocab"]
    words.update(w for w in vocabulary if w.isalpha())
    stemmer = Stemmer()
    stems = stemmer.many(sorted(words))
    # Tokenized as one text (a separator token between the words), as when each word was a row of its own.
    sample = sorted(words)[::8]
    assert [stems[w] for w in sample] == stemmer._a_row_each(sample)
    assert stemmer._as_one_text(["go", "x_" + Stemmer.SEPARATOR]) is None  # a word holding the separator: a row each
    assert Stemmer().many(["going", Stemmer.SEPARATOR + "ing", "key_value"]) == {
        "going": ("go",), Stemmer.SEPARATOR + "ing": stemmer._a_row_each([Stemmer.SEPARATOR + "ing"])[0],
        "key_value": ("kei", "valu")}
    missed = [w for w, own in stems.items() if own and not _may_stem_to(w, _stem_keys(own))]
    assert len(stems) > 20_000 and not missed, missed[:20]

    def every_word(query: str | list[str], text: str) -> frozenset[str]:  # the reference: every word stemmed
        terms = query_terms(query) if isinstance(query, str) else query
        held = {t for own in stemmer.many(query_terms(text, frozenset(), limit=None)).values() for t in own}
        return frozenset(term for term, own in stemmer.many(terms).items() if set(own) <= held)

    queries = [line for line in lines[::7] if query_terms(line)][:40]
    assert len(queries) >= 30
    checked, many = 0, 0
    for query in queries:
        for text in lines[:100]:
            got = held_terms(query, text)
            assert got == every_word(query, text), (query, text)
            checked += bool(got)
        # A memory's words asked of a short prompt (`relevance.echoes`): past MAX_QUERY_TERMS, the prompt's side first.
        terms = query_terms(" ".join(lines[lines.index(query):][:8]), limit=None)
        many += len(terms) > MAX_QUERY_TERMS
        for prompt in ("why does the build fail?", query[:60], "key_value", "_ a b"):
            assert held_terms(terms, prompt) == every_word(terms, prompt), (terms, prompt)
    assert checked > 50  # the texts do hold query terms: the comparison is not between empty sets
    assert many > 10
    assert held_terms("keys buying daily", "Daily key: they buy") == frozenset({"keys", "buying", "daily"})
    # A term with no index term ("_") is held by any text, as the index reads it; the text the short side.
    many_terms = ["_", "keys", "buying", *(f"zz{i}" for i in range(MAX_QUERY_TERMS))]
    assert held_terms(many_terms, "key") == frozenset({"_", "keys"})
    assert held_terms(["_", "keys", "buying"], "key") == frozenset({"_", "keys"})


def test_a_commands_window_always_shows_its_outcome() -> None:
    """The last line of a command's output is what it came to ("Found 38 errors in 5 files"): shown whatever the
    query matched above it; a message's last line is not."""
    lines = [f"src/pkg/module_{i}.py:{i}: error: Missing type parameters for generic type" for i in range(80)]
    lines.append("Found 38 errors in 5 files (checked 12 source files)")

    def holds(line: str) -> frozenset[str]:
        return held_terms("module_3 missing type parameters", line)

    shown = best_windows("Bash `uv run mypy src/`:", lines, holds)
    assert lines[-1] in shown and "module_3.py" in shown and len(shown) <= WINDOW_CHARS
    assert lines[-1] not in best_windows("Assistant:", lines, holds)



def test_a_summary_that_says_less_than_its_passage_does_not_take_its_slot() -> None:
    """A distilled memory and the passage it came from share one slot: the one that holds more of what is asked
    takes it. The real cases (a dev-set session each): a report's first sentence against the report, a procedure
    that names a lint finding and its fix against the bare output of the command that later passed."""
    terms = query_terms("Which source files launch Claude Code with a permission flag and would all need changing?")
    report = {"text": "Reported: I've thoroughly investigated how Claude sessions are launched in dmux.", "score": 0.05}
    passage = {"text": "Assistant: The 3 launch points pass --permission-mode=acceptEdits: paneCreation.ts,"
                       " conflictResolutionPane.ts and MergePane.tsx; each would need the new permission flag.",
               "score": 0.05}
    assert not dense_wins(terms, report, passage)
    terms = query_terms("Which ruff finding kept coming back after almost every file the agent wrote?")
    works = {"text": "Works: `uv run ruff check --fix src/` (after failing with: W292 [*] No newline at end of file)",
             "score": 0.02}
    output = {"text": "Bash `uv run ruff check src/`: (Final full lint check)\nAll checks passed!", "score": 0.05}
    assert dense_wins(terms, works, output)  # more of the question's words, though a lower score
    same = {"text": "Bash `uv run ruff check src/`: All checks passed, no finding came back", "score": 0.05}
    assert dense_wins(terms, {**same, "score": 0.046}, same) and not dense_wins(terms, {**same, "score": 0.03}, same)


# --- ranking the evidence: views of files, the user's own words, repeated windows ----------------------------------

VIEWS_CWD = "/tmp/loomd-views-project"


async def _session(client: AsyncClient, session: str, records: list[dict[str, Any]]) -> str:
    """Send a hook-only session as the shim would, observe it to its end; its project."""
    for i, record in enumerate(records):
        body = {"session_id": session, "transcript_path": f"/tmp/{session}.jsonl", "cwd": VIEWS_CWD,
                "timestamp": 1_750_000_000 + i, **record}
        await client.call("hook", event=record["hook_event_name"], agent="claude", raw=json.dumps(body))
    assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] == "ok"
    return str((await client.call("events", session_id=session, limit=1))["events"][0]["project"])


def _read(path: str, content: str) -> dict[str, Any]:
    return {"hook_event_name": "PostToolUse", "tool_name": "Read", "tool_input": {"file_path": path},
            "tool_response": {"type": "text", "file": {"filePath": path, "content": content}}}


def _said(text: str) -> dict[str, Any]:
    return {"hook_event_name": "Stop", "stop_hook_active": False, "last_assistant_message": text}


async def test_a_view_of_a_file_ranks_below_what_the_session_said_about_it(client: AsyncClient) -> None:
    """A Read returns a copy of the repository: long and rich in every term of the question. What the session
    concluded from it is the answer; the view keeps a share of its score (`aside_prior`)."""
    doc = "\n".join(["# Uploader retry budget", "The uploader retries a failed upload up to the retry budget.",
                     "Each retry of the uploader waits longer: exponential backoff between uploads.",
                     "The retry budget of the uploader is set in config/uploader.toml (retry budget = 3).",
                     "Why the uploader times out: a slow link; raising the retry budget of the uploader helps."])
    project = await _session(client, "views-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "the nightly upload job keeps failing, look into it"},
        _read("docs/uploader.md", doc),
        _said("Found it: the nightly uploads timed out on the slow link, so I raised the uploader's retry budget "
              "from 3 to 8 in config/uploader.toml."),
    ])
    query = "why did the uploader time out and what retry budget fixed it"
    ranked = (await client.call("search", query=query, mode="keyword", project=project, limit=5))["results"]
    assert "from 3 to 8" in ranked[0]["text"], ranked
    plain = (await client.call("search", query=query, mode="keyword", project=project, limit=5,
                               tuning={"aside_prior": 1.0}))["results"]
    assert plain[0]["text"].startswith("Read docs/uploader.md:"), plain  # without the prior the view wins


def _grep(pattern: str, output: str) -> dict[str, Any]:
    return {"hook_event_name": "PostToolUse", "tool_name": "Grep", "tool_input": {"pattern": pattern, "path": "src"},
            "tool_response": {"mode": "content", "content": output, "numFiles": 2}}


async def test_asked_where_the_code_does_something_a_view_of_it_answers(client: AsyncClient) -> None:
    """"Where is …?", "how are … wired?": the question asks what the code says, so a view of it (a Read, a Grep) is
    the answer and keeps its whole score (`code_views`); asked anything else it stays an aside."""
    project = await _session(client, "views-code", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "give the dashboard a warmer palette"},
        _grep("theme", "src/app/layout.tsx: <body className={theme}> dashboard palette theme colors wired here\n"
                       "src/app/globals.css: .theme-warm { --color-primary: #f97316 } dashboard palette colors"),
        _said("The dashboard palette is done: the warm colors are in, the dashboard looks warmer now."),
    ])
    for query in ("How are the dashboard palette colors wired?", "Where are the dashboard palette colors set?"):
        ranked = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
        assert "<body className={theme}>" in ranked[0]["text"], (query, ranked)
        off = (await client.call("search", query=query, mode="keyword", project=project, limit=3,
                                 tuning={"code_views": 0}))["results"]
        assert "<body className={theme}>" not in off[0]["text"], (query, off)  # an aside, as before
    other = "Did the dashboard palette colors get warmer?"
    ranked = (await client.call("search", query=other, mode="keyword", project=project, limit=3))["results"]
    assert "<body className={theme}>" not in ranked[0]["text"], ranked


async def test_asked_how_to_start_it_a_view_of_the_manifest_answers(client: AsyncClient) -> None:
    """"How is the web app started in development?": the project's manifest (`package.json`'s scripts) holds the
    commands; a view of it keeps its whole score (`manifests`), a view of another file stays an aside."""
    scripts = ('{\n"name": "arcade-web",\n"scripts": {\n"dev": "next dev --turbopack",\n'
               '"redis:start": "docker-compose up -d",\n"build": "next build"\n}\n}')
    project = await _session(client, "views-manifest", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "collect the facts for the grant form"},
        _read("web/package.json", scripts + "\nweb app development redis started"),
        _said("The web app is a Next.js app; in development it is started with the dev server, and redis is used."),
    ])
    query = "How is the web app started in development, and how is its redis brought up?"
    ranked = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
    assert "next dev --turbopack" in ranked[0]["text"], ranked
    off = (await client.call("search", query=query, mode="keyword", project=project, limit=3,
                             tuning={"manifests": 0}))["results"]
    assert "next dev --turbopack" not in off[0]["text"], off


async def test_two_steps_that_show_the_same_window_take_one_slot(client: AsyncClient) -> None:
    """Two steps repeating one block (a commit message drafted, then reported): their passages differ, the windows
    shown are the same; one slot, the other collapsed into it, and the next hit moves up."""
    block = ["Changes:", "- Add skipPermissions to DmuxSettings with a clear warning label",
             "- Update all 3 Claude launch points to respect the setting",
             "- Disable autoApproveTrustPrompt when skipPermissions is on"]
    first = [f"Step {i}: read src/module_{i}.ts and noted its exports for the settings refactor" for i in range(14)]
    second = [f"Check {i}: ran the build for package {i} and it finished without warnings" for i in range(14)]
    project = await _session(client, "dup-1", [
        _said("\n".join([*first, *block])),
        _said("\n".join([*second, *block])),
        _said("The trust prompt step is skipped when skipPermissions is on, since the flag already skips prompts."),
    ])
    query = "what happens to autoApproveTrustPrompt when skipPermissions is on"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
    shown = [r for r in results if "Disable autoApproveTrustPrompt" in r["text"]]
    assert len(shown) == 1 and shown[0]["collapsed"], results
    assert any("trust prompt step is skipped" in r["text"] for r in results)


async def test_an_observation_shows_the_lines_of_its_step_that_match(client: AsyncClient) -> None:
    """An observation is a clip of its step ("Reported: <first sentence>"); when it takes the step's slot, it shows
    the step's lines that match the query in the room a passage would have: here the line that answers."""
    filler = [f"- checked module {i} of the settings screen: nothing to change" for i in range(40)]
    report = "\n".join([
        "Reviewed the release checklist for the uploader service.", *filler,
        "- Release checklist, last step: sign the uploader tag with ops/keys/release.asc before pushing it."])
    project = await _session(client, "clip-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "go over what a release of the uploader needs"},
        _said(report),
        {"hook_event_name": "UserPromptSubmit", "prompt": "thanks, now bump the version in package.json"},
        _said("Bumped the version in package.json to 2.4.1."),
    ])
    query = "release checklist of the uploader service"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
    (clip,) = [r for r in results if r["text"].startswith("Reported: Reviewed the release checklist")]
    assert clip["kind"] == "observation" and clip["collapsed"], results  # the report's passage took no slot
    assert "ops/keys/release.asc" in clip["text"] and "module 3 " not in clip["text"], clip["text"]
    assert len(clip["text"]) <= LEAD_CHARS


def _edit(path: str, old: str, new: str) -> dict[str, Any]:
    return {"hook_event_name": "PostToolUse", "tool_name": "Edit",
            "tool_input": {"file_path": path, "old_string": old, "new_string": new},
            "tool_response": {"filePath": path, "oldString": old, "newString": new}}


async def test_an_observation_of_two_edits_shows_the_lines_of_both(client: AsyncClient) -> None:
    """"Edited a, b" clips the first change only; the second file's change is as often the answer, and it is shown
    too while the hit has room (a real session bumped Node in .travis.yml, then pinned it in .nvmrc)."""
    project = await _session(client, "clip-2", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "bump node to 24 in CI and pin it locally"},
        _edit("/repo/.travis.yml", 'node_js:\n  - "20"\n  - "18"', 'node_js:\n  - "24"\n  - "22"'),
        _edit("/repo/.nvmrc", "v18.18.2", "v24.17.0"),
        _said("CI now tests Node 24 and 22, and .nvmrc pins v24.17.0."),
    ])
    query = "which node versions does travis test, and what does nvmrc pin"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=5))["results"]
    (clip,) = [r for r in results if r["kind"] == "observation" and r["text"].startswith("Edited /repo/.travis.yml")]
    assert '"24"' in clip["text"] and "v24.17.0" in clip["text"], clip["text"]


async def test_a_users_ask_shows_what_the_agent_answered(client: AsyncClient) -> None:
    """"User asked: …" is found by the question's words; the turn's answer (the agent's last message before the user
    spoke again) is what a later agent wants, and the ask shows its lines (a real session asked for a balanced
    opinion; the compromise was in the reply)."""
    project = await _session(client, "ask-1", [
        {"hook_event_name": "UserPromptSubmit",
         "prompt": "Can you write a balanced opinion on splitting dev-docs from work folders?"},
        _said("Here is the balanced view. The split helps once the project is stable.\n"
              "Compromise: keep one tree and adopt a naming convention instead of a second directory structure."),
        {"hook_event_name": "UserPromptSubmit", "prompt": "thanks, now bump the version in package.json"},
        _said("Bumped the version in package.json to 2.4.1."),
    ])
    query = "balanced opinion on splitting dev-docs from work folders"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=5))["results"]
    (ask,) = [r for r in results if r["kind"] == "observation" and r["text"].startswith("User asked: Can you write")]
    assert "naming convention instead of a second directory structure" in ask["text"], ask["text"]
    assert "2.4.1" not in ask["text"]  # the next turn's answer is not this ask's


async def test_an_observation_that_repeats_a_hit_above_it_takes_no_slot(client: AsyncClient) -> None:
    """Two turns report the same thing in nearly the same words: the second observation repeats the first by what it
    says itself — the different lines of its own step it would show do not make it new."""
    said = "the interactive style guide showcase for the design system is at docs/showcase.html with every component"
    details = [f"- section {i}: {word} examples with live previews" for i, word in
               enumerate(["buttons", "forms", "tables", "cards", "modals", "tabs", "alerts", "badges"] * 3)]
    others = [f"- checked page {i}: layout renders in every browser" for i in range(24)]
    project = await _session(client, "rep-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "build the showcase page for the design system"},
        _said("\n".join([f"Created {said}.", *details])),
        {"hook_event_name": "UserPromptSubmit", "prompt": "is the showcase done? check the layout"},
        _said("\n".join([f"Confirmed: {said}.", *others])),
        {"hook_event_name": "UserPromptSubmit", "prompt": "thanks, now bump the version in package.json"},
        _said("Bumped the version in package.json to 2.4.1."),
    ])
    query = "where is the interactive style guide showcase of the design system"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=5))["results"]
    reports = [r for r in results if r["kind"] == "observation" and said in r["text"]]
    assert len(reports) == 1 and reports[0]["collapsed"], [(r["kind"], r["text"][:90]) for r in results]



async def _codex_export_session(daemon: Daemon, client: AsyncClient) -> tuple[str, str]:
    """The real Codex session that ends on the command exporting it, imported: its id and its project."""
    path = need_test_data("transcripts", "kunalcode12-Empire-of-bits-vorld") / "codex-session.jsonl"
    assert daemon.tailer is not None
    (session,) = (await daemon.tailer.import_file(path))["sessions"]
    return session, str((await client.call("events", session_id=session, limit=1))["events"][0]["project"])


async def _ended(client: AsyncClient, session: str) -> None:
    """The session's end as Codex's hook says it, and the observer's run over the ended session."""
    await client.call("hook", event="SessionEnd", agent="codex",
                      raw=json.dumps({"session_id": session, "hook_event_name": "SessionEnd", "reason": "exit"}))
    assert (await client.call("workers_run", name="observer", session_id=session, final=True))["outcome"] == "ok"


async def test_a_call_the_session_ended_on_is_evidence(home: Path, sock_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real Codex session ends on the command that exported it: the transcript holds the call and no result. While
    the session may go on, the call waits for its result; once it is over, the call is a passage of its own."""
    monkeypatch.setenv("LOOMD_PASSIVE", "1")  # the observer runs when asked, nothing behind the test's back
    monkeypatch.setenv("LOOMD_EMBEDDER", "none")
    async with serving(sock_path) as daemon, AsyncClient(sock_path) as client:
        session, project = await _codex_export_session(daemon, client)

        async def found() -> list[str]:
            hits = await client.call("search", query="Copy-Item codex-session.jsonl", mode="keyword",
                                     project=project)
            return [r["text"] for r in hits["results"] if r["kind"] == "evidence" and "Copy-Item" in r["text"]]

        assert (await client.call("workers_run", name="observer", session_id=session, final=False))["outcome"] == "ok"
        assert await found() == []
        await _ended(client, session)
        (text,) = await found()
        assert text.startswith("shell_command `") and NO_RESULT in text


async def test_asked_where_work_stopped_the_sessions_last_steps_answer(home: Path, sock_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """"Where did the grant work stop?" shares no word with how the real Codex session ended (it exported itself):
    asked where work stopped, the last steps of the session the best hits come from rank as a signal of their own."""
    monkeypatch.setenv("LOOMD_PASSIVE", "1")
    monkeypatch.setenv("LOOMD_EMBEDDER", "none")
    async with serving(sock_path) as daemon, AsyncClient(sock_path) as client:
        session, project = await _codex_export_session(daemon, client)
        await _ended(client, session)

        async def top(query: str, **args: Any) -> list[str]:
            hits = await client.call("search", query=query, project=project, limit=3, explain=True, **args)
            return [r["text"] for r in hits["results"]]

        asked = "Where did the grant application work stop?"
        assert any("Copy-Item" in text for text in await top(asked))
        assert any("Copy-Item" in text for text in await top(asked, floor=True))  # what `loom search` shows
        # Off, or asked about the grant without asking where it stopped: the export is not what answers.
        assert not any("Copy-Item" in text for text in await top(asked, tuning={"ending": 0}))
        assert not any("Copy-Item" in text for text in await top("What does the grant application say?"))


def _turns(sid: str, cwd: str, turns: list[tuple[str, Any]]) -> str:
    """A Claude Code transcript (JSONL) of `turns`: ("user", text), ("said", text), ("run", (command, output,
    failed)) — each run a tool call and its result."""
    records: list[dict[str, Any]] = []

    def record(kind: str, content: Any, **more: Any) -> None:
        n = len(records) + 1
        records.append({"type": kind, "sessionId": sid, "uuid": f"u{n}", "timestamp": f"2026-01-02T03:04:{n:02d}Z",
                        "cwd": cwd, "isSidechain": False, "message": {"role": kind, "content": content, **more}})

    for role, value in turns:
        if role == "user":
            record("user", value)
        elif role == "said":
            record("assistant", [{"type": "text", "text": value}], id=f"m{len(records)}")
        else:
            command, output, failed = value
            tool = f"t{len(records)}"
            record("assistant", [{"type": "tool_use", "id": tool, "name": "Bash", "input": {"command": command}}],
                   id=f"m{len(records)}")
            record("user", [{"type": "tool_result", "tool_use_id": tool, "content": output, "is_error": failed}])
    return "".join(json.dumps(r) + "\n" for r in records)


async def _imported(daemon: Daemon, client: AsyncClient, path: Path, sid: str) -> str:
    """Import a transcript file, observe its session to its end; its project."""
    assert daemon.tailer is not None
    await daemon.tailer.import_file(path)
    assert (await client.call("workers_run", name="observer", session_id=sid, final=True))["outcome"] == "ok"
    return str((await client.call("events", session_id=sid, limit=1))["events"][0]["project"])


async def test_an_announcement_shows_what_it_led_to(home: Path, sock_path: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """"…but let me check the specific test to understand:" ranks for the question's words and says nothing; the
    agent's next message is what the check found (a real session: the monitoring tests pass one by one), or, when
    that one announces again, the one after it. The hit shows their matching lines. So does a failed run's note: what
    the agent made of the failure."""
    monkeypatch.setenv("LOOMD_PASSIVE", "1")
    monkeypatch.setenv("LOOMD_EMBEDDER", "none")
    sid = "announce-1"
    path = tmp_path / f"{sid}.jsonl"
    path.write_text(_turns(sid, "/tmp/loomd-announce-project", [
        ("user", "run the whole test suite and fix what fails"),
        ("said", "There's a test failure in the monitoring package, but let me check the specific test to understand:"),
        ("run", ("go test ./internal/monitoring", "FAIL internal/monitoring 0.9s", True)),
        ("said", "I can see the individual test cases pass, but the overall run fails. Let me run them one by one:"),
        ("run", ("go test ./internal/monitoring -run TestMonitoring -p 1", "ok  internal/monitoring 0.4s", False)),
        ("said", "The monitoring middleware tests pass when run one at a time; only the full parallel run fails, on a"
                 " port clash.\nSo the monitoring suite is flaky under parallel runs, not broken."),
        ("run", ("pnpm typecheck", "src/cli.ts(350,27): error TS2345: Argument of type 'Effect' is not assignable",
                 True)),
        ("said", "The cli.ts errors are in the existing codebase, not in the new SDK; moving on to the docs."),
        ("user", "good, now bump the version in package.json"),
        ("said", "Bumped the version in package.json to 2.4.1."),
    ]))
    async with serving(sock_path) as daemon, AsyncClient(sock_path) as client:
        project = await _imported(daemon, client, path, sid)

        async def hits(query: str) -> list[dict[str, Any]]:
            return list((await client.call("search", query=query, mode="keyword", project=project,
                                           limit=3))["results"])

        (hit,) = [r for r in await hits("test failure in the monitoring package")
                  if r["text"].startswith("Assistant: There's a test failure")]
        assert "pass when run one at a time" in hit["text"] and "2.4.1" not in hit["text"], hit["text"]
        found = await hits("does pnpm typecheck pass")
        notes = [r for r in found if r["kind"] == "observation" and r["text"].startswith("`pnpm typecheck` failed:")]
        assert len(notes) == 1, [r["text"][:80] for r in found]
        assert "existing codebase, not in the new SDK" in notes[0]["text"], notes[0]["text"]


async def test_of_two_near_copies_the_later_one_takes_the_slot(client: AsyncClient) -> None:
    """A file written twice, the second time with one line more: the passages are near copies and take one slot.
    The later one is what the session went on with; it shows, the earlier is collapsed into it, though the earlier
    (shorter) ranks first by its words."""
    body = ["def export_orders(batch, target):", '    """Export one batch of orders to the target warehouse."""',
            "    rows = validate_orders(batch)", "    payload = encode_rows(rows, schema=ORDER_SCHEMA)",
            "    client = warehouse_client(target, retries=3)", "    receipt = client.upload(payload)",
            "    audit_log.record(batch.id, receipt.id)", "    return receipt"]
    project = await _session(client, "copies-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "write the order export"},
        _write("src/export.py", "\n".join(body)),
        _write("src/export.py", "\n".join([*body[:5], "    # the upload is not wired up: nothing is sent yet",
                                            *body[5:]])),
    ])
    query = "does export_orders upload the batch of orders to the warehouse"
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=5))["results"]
    copies = [r for r in results if r["kind"] == "evidence" and "export_orders" in r["text"]]
    assert len(copies) == 1 and copies[0]["collapsed"], [(r["kind"], r["text"][:80]) for r in results]
    assert "nothing is sent yet" in copies[0]["text"], copies[0]


def _write(path: str, content: str) -> dict[str, Any]:
    return {"hook_event_name": "PostToolUse", "tool_name": "Write",
            "tool_input": {"file_path": path, "content": content},
            "tool_response": {"type": "create", "filePath": path}}


async def _voice_session(client: AsyncClient) -> str:
    """A session whose user, as the export pipeline work started, asked for a way of working in words of their own."""
    return await _session(client, "voice-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "build the order export pipeline for the warehouse"},
        _write("src/export.py", "def export_pipeline(orders):\n    return [encode(o) for o in orders]"),
        {"hook_event_name": "UserPromptSubmit", "prompt": "also use tdd and keep commits small please"},
        _said("Starting the export pipeline again, tests first this time: tests/test_export.py covers the encoder."),
        _write("tests/test_export.py", "def test_export_pipeline():\n    assert export_pipeline([]) == []"),
        {"hook_event_name": "UserPromptSubmit", "prompt": "now wire it into the nightly job"},
        _said("Wired into the nightly job."),
    ])


VOICE_ASKED = "Which way of working did the user ask for while the export pipeline was being written?"


async def test_asked_what_the_user_wanted_their_words_around_the_work_answer(client: AsyncClient) -> None:
    """"Which way of working did the user ask for …?": the user's words said as the work started share no word with
    the question; they are found next to the work the question's words find."""
    project = await _voice_session(client)
    query = VOICE_ASKED
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
    assert any("use tdd" in r["text"] for r in results), [(r["kind"], r["text"][:80]) for r in results]
    floored = (await client.call("search", query=query, mode="keyword", project=project, limit=3, floor=True))
    assert any("use tdd" in r["text"] for r in floored["results"]), floored  # about the query, by what it answers
    off = (await client.call("search", query=query, mode="keyword", project=project, limit=3,
                             tuning={"voice": 0}))["results"]
    assert not any("use tdd" in r["text"] for r in off), [(r["kind"], r["text"]) for r in off]


async def test_asked_what_the_user_wanted_their_words_outrank_what_was_done(client: AsyncClient) -> None:
    """"May the agent patch the generated files?": the agent's work on those files holds the question's words; the
    user's rule about it holds none. What was not said by the user loses a share of its score (`unvoiced`), so the
    rule ranks above the work."""
    project = await _session(client, "voice-rule", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "fix the lint errors"},
        _said("The lint errors show up in the generated templ files; I will patch those generated files directly."),
        _said("Patched the generated templ files directly: the lint errors in form_templ.go are gone."),
        {"hook_event_name": "UserPromptSubmit", "prompt": "keep going"},
        _said("Patched two more generated templ files directly; reran lint, no errors left."),
        {"hook_event_name": "UserPromptSubmit", "prompt": "why tf are you editing generated code!"},
        _said("Reverted; regenerating with templ generate instead."),
        {"hook_event_name": "UserPromptSubmit", "prompt": "thanks, commit that"},
        _said("Committed."),
    ])
    query = "When lint errors show up in the templ output files, may the agent patch those files directly?"

    async def above(tuning: dict[str, float]) -> list[str]:
        """The hits ranked above the user's rule (the neighbours' column left out: in a session this short every
        step is the rule's neighbour)."""
        texts = [r["text"] for r in (await client.call("search", query=query, mode="hybrid", project=project,
                                                       limit=10, tuning={"ctx_weight": 0, **tuning}))["results"]]
        return texts[:texts.index("why tf are you editing generated code!")]

    assert all(text.startswith("User:") for text in await above({}))  # only what the user said
    # By the words and the framing alone, what the agent did and reported ranks above the rule.
    assert any(not text.startswith("User:") for text in await above({"unvoiced": 0}))


async def test_a_prompt_asking_what_the_user_wanted_recalls_their_words(client: AsyncClient) -> None:
    """The per-prompt recall shows the user's words the search ranks for such a prompt, though neither the vectors
    nor the keywords found them (context/relevance.py)."""
    project = await _voice_session(client)
    reply = await client.call("context", kind="prompt", session_id="a-later-session", project=project,
                              prompt=VOICE_ASKED)
    assert "use tdd" in reply["text"], reply["text"]


def _bash(command: str, stdout: str, description: str = "") -> dict[str, Any]:
    return {"hook_event_name": "PostToolUse", "tool_name": "Bash",
            "tool_input": {"command": command, **({"description": description} if description else {})},
            "tool_response": {"stdout": stdout, "stderr": "", "exit_code": 0}}


async def test_asked_how_to_run_the_tests_the_run_that_worked_answers(client: AsyncClient) -> None:
    """"How do I run the exporter test suite?": the steps that only name the project and its tests (making the
    folders, listing them) hold the question's words as well as the command that passed; the run that worked ranks
    first."""
    project = await _session(client, "worked-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "set up the exporter package with a test suite"},
        _bash("mkdir -p /tmp/exporter/src/exporter /tmp/exporter/tests", "",
              "Create the exporter package and its test suite folders"),
        _bash("ls /tmp/exporter/tests", "test_exporter.py\ntest_exporter_suite.py", "List the exporter test suite"),
        _bash("PYTHONPATH=src python3 -m pytest tests/ -q", "12 passed in 0.31s"),
    ])
    await _first_by_its_ranking(client, project, "How do I run the exporter test suite?", "worked",
                                "PYTHONPATH=src python3 -m pytest tests/")


async def test_asked_anything_but_how_to_run_a_note_that_a_run_passed_ranks_below_what_was_found(
        client: AsyncClient) -> None:
    """"Is the monitoring test suite reliable?": the observer's note that `go test ./internal/monitoring` passed is
    short and holds the question's words; what the session found about the suite is the answer. The note keeps a
    share of its score (`passed_runs`); asked how to run the suite, it does not."""
    project = await _session(client, "passed-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "check the monitoring package"},
        _bash("go test -v ./internal/monitoring", "\n".join(
            f"=== RUN   TestHandler{i}\n--- PASS: TestHandler{i} (0.0{i}s)" for i in range(40))
            + "\nok  \tgithub.com/acme/app/internal/monitoring\t0.41s", "Run the monitoring test suite"),
        _said("Interesting: the monitoring tests pass when run one at a time but fail within the whole run, so they "
              "are flaky; a race on the shared metrics registry."),
    ])
    query = "Is the monitoring package's test suite reliable?"
    flaky = "so they are flaky"

    async def first(tuning: dict[str, float]) -> str:
        results = (await client.call("search", query=query, mode="keyword", project=project, limit=3,
                                     tuning={"ctx_weight": 0, **tuning}))["results"]
        return str(results[0]["text"])

    assert flaky in await first({})
    assert (await first({"passed_runs": 0})).startswith("Tests pass:")  # by its words the note wins
    asked_to_run = (await client.call("search", query="How do I run the monitoring package's test suite?",
                                      mode="keyword", project=project, limit=3))["results"]
    assert asked_to_run[0]["text"].startswith("Tests pass:"), [r["text"][:80] for r in asked_to_run]


async def test_asked_what_the_fix_was_the_edit_made_after_answers(client: AsyncClient) -> None:
    """"… could not be installed. What was the fix?": the failure and the report of it hold the question's words;
    the change made right after them is the answer."""
    project = await _session(client, "fix-1", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "install the graph dependency and wire the agent"},
        {**_bash("pnpm add graphkit", "ERR_PNPM_FETCH_404 graphkit: the dependency could not be installed"),
         "tool_response": {"stdout": "", "stderr": "ERR_PNPM_FETCH_404 graphkit: the dependency could not be installed",
                           "exit_code": 1}},
        _said("The graphkit dependency could not be installed: the registry has no such package."),
        {"hook_event_name": "PostToolUse", "tool_name": "Edit",
         "tool_input": {"file_path": "package.json", "old_string": '"graphkit": "^0.24.0"',
                        "new_string": '"@graph/kit": "^1.0.2"'},
         "tool_response": {"filePath": "package.json"}},
        _bash("pnpm install", "Done in 2.1s", "Install the corrected package"),
    ])
    await _first_by_its_ranking(client, project, "The graphkit dependency could not be installed. What was the fix?",
                                "fix", '"@graph/kit": "^1.0.2"')


async def _first_by_its_ranking(client: AsyncClient, project: str, query: str, ranking: str, answer: str) -> None:
    """The hit showing `answer` is first, and by its words alone (the question form's `ranking` off) it is not."""
    results = (await client.call("search", query=query, mode="keyword", project=project, limit=3))["results"]
    assert answer in results[0]["text"], [r["text"][:80] for r in results]
    off = (await client.call("search", query=query, mode="keyword", project=project, limit=3,
                             tuning={ranking: 0}))["results"]
    assert answer not in off[0]["text"], [r["text"][:80] for r in off]


async def test_the_edit_that_fixed_it_stays_above_the_floor(client: AsyncClient) -> None:
    """The change made right after a failure need not hold a word of the question: for a question about what fixed
    the failure it is about the query all the same (search/floor.py)."""
    project = await _session(client, "fix-2", [
        {"hook_event_name": "UserPromptSubmit", "prompt": "install the graph dependency and wire the agent"},
        {**_bash("pnpm add graphkit", ""),
         "tool_response": {"stdout": "", "stderr": "ERR_PNPM_FETCH_404 graphkit: the dependency could not be installed",
                           "exit_code": 1}},
        {"hook_event_name": "PostToolUse", "tool_name": "Edit",
         "tool_input": {"file_path": "package.json", "old_string": '"gk": "^0"', "new_string": '"@graph/kit": "^1"'},
         "tool_response": {"filePath": "package.json"}},
    ])
    query = "The graphkit dependency could not be installed. What was the fix?"
    floored = await client.call("search", query=query, mode="keyword", project=project, limit=3, floor=True)
    assert any("@graph/kit" in r["text"] for r in floored["results"]), floored
