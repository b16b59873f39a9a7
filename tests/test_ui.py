"""The web viewer (`loom ui`) in real headless Chromium (Selenium + Debian's chromium-driver) against a real daemon
holding a replayed real session; the review ops it is built on, through the socket.

One daemon, one viewer and one browser for the whole module. `LOOMD_UI_SCREENSHOTS=docs` saves the README's
screenshots of the populated store's pages into that folder."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, DaemonProcess, need_test_data

from loomd.client import Client, RemoteError
from loomd.search import browse
from loomd.store.db import Store

REAL = "daaain-claude-code-log/-Users-dain-workspace-JSSoundRecorder"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
# Without the background-networking flags Chromium's own connections get refused in a sandboxed CI box.
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900")
SHOTS = os.environ.get("LOOMD_UI_SCREENSHOTS")
SECRET = "sk-ui-test-0123456789abcdef"


@dataclass
class Viewer:
    daemon: DaemonProcess
    proc: subprocess.Popen[str]
    url: str  # the printed URL, token included
    base: str
    session: str
    project: str

    def call(self, op: str, **args: Any) -> Any:
        with Client(self.daemon.sock, timeout=30) as client:
            return client.call(op, args)


@pytest.fixture(scope="module")
def viewer() -> Iterator[Viewer]:
    """A real daemon holding one replayed real session (observed and reflected), and `loom ui` serving it."""
    transcript = next(need_test_data("transcripts", REAL).glob("*.jsonl"))
    home = Path(tempfile.mkdtemp(prefix="lmui", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_") or k == "LOOMD_TEST_DATA"}
    env.update(LOOMD_HOME=str(home), LOOMD_EMBEDDER=os.environ.get("LOOMD_TEST_EMBEDDER", "local"),
               LOOMD_PASSIVE="1", LOOMD_TAIL_TRANSCRIPTS="0", LOOMD_CODEX_HOME=str(home / "codex-home"),
               LOOMD_MODEL_KEY=SECRET,  # no `model_api`: the key is never used, only shown masked
               LOOMD_PROMPT_RECALL_BUDGET_MS=os.environ["LOOMD_PROMPT_RECALL_BUDGET_MS"])  # conftest: not timed
    daemon = DaemonProcess(home, env)
    daemon.env = env
    daemon.start()
    proc: subprocess.Popen[str] | None = None
    try:
        with Client(daemon.sock, timeout=120) as c:
            (session,) = c.call("import_file", {"path": str(transcript)})["sessions"]
            c.call("workers_run", {"name": "observer", "session_id": session, "final": True})
            c.call("workers_run", {"name": "reflector"})
            project = c.call("events", {"session_id": session, "limit": 1})["events"][0]["project"]
            c.call("context", {"kind": "start", "session_id": session, "project": project})
        proc = subprocess.Popen(
            [sys.executable, "-c", "from loomd.cli import main; main()", "ui", "--no-browser"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+)/\?token=\S+", line)
        assert found, line
        yield Viewer(daemon, proc, found.group(0), found.group(1), session, project)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        daemon.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(viewer: Viewer) -> Iterator[Any]:
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lmchrome")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.get(viewer.url)  # trades the token for the cookie
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def shot(driver: Any, name: str) -> None:
    if SHOTS:
        folder = Path(SHOTS) if Path(SHOTS).is_absolute() else REPO / SHOTS
        folder.mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return Math.min(document.body.scrollHeight, 1800)")
        driver.set_window_size(1280, max(700, height))
        driver.save_screenshot(str(folder / f"ui-{name}.png"))
        driver.set_window_size(1280, 900)


def submit(driver: Any, element: Any) -> None:
    """Click a submit button (or submit a field's form) and wait for the page that answers it."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")
    if element.tag_name == "button":
        element.click()
    else:
        element.submit()
    # Chrome may answer a look at a node of the page being replaced with "Node with given id does not belong to the
    # document" (an unknown error, not StaleElementReference): that node is gone too, so the wait asks again.
    WebDriverWait(driver, 10, ignored_exceptions=[WebDriverException]).until(expected_conditions.staleness_of(old))


def h1(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "h1").text)


def distilled(viewer: Viewer) -> list[dict[str, Any]]:
    return viewer.call("memories", project=viewer.project, limit=200)["memories"]


def test_every_page_opens_with_the_replayed_session(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    memories = distilled(viewer)
    assert memories, "the replayed session left no memory to show"
    pages = {"/": "Memories", "/review": "Review", "/sessions": "Sessions", "/tasks": "Tasks",
             "/workers": "Workers", "/stats": "Stats", "/config": "Config",
             f"/memory/{memories[0]['id']}": f"Memory #{memories[0]['id']}",
             f"/session/{viewer.session}": f"Session {viewer.session}"}
    for path, title in pages.items():
        browser.get(viewer.base + path)
        assert h1(browser) == title, (path, browser.page_source[:500])
    browser.get(viewer.base + "/")
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.memories tbody tr")) == min(50, len(memories))
    shot(browser, "memories")
    browser.get(f"{viewer.base}/session/{viewer.session}")
    # The start block the session was given, the memories it showed, and its events with tool results folded.
    assert "[LOOM]" in browser.find_element(By.CSS_SELECTOR, "pre.block").text
    assert browser.find_elements(By.CSS_SELECTOR, ".timeline details")
    shot(browser, "session")
    # A distilled memory's page: its provenance down to the source events it came from.
    reflected = next(m for m in memories if m["origin"] == "reflector")
    browser.get(f"{viewer.base}/memory/{reflected['id']}")
    assert browser.find_elements(By.CSS_SELECTOR, "div.event pre"), "no source event shown"
    shot(browser, "detail")
    browser.get(viewer.base + "/stats")
    assert browser.find_elements(By.CSS_SELECTOR, "svg.chart rect")
    shot(browser, "stats")
    browser.get(viewer.base + "/workers")
    assert "observer" in browser.find_element(By.TAG_NAME, "table").text
    browser.get(viewer.base + "/config")
    assert SECRET not in browser.page_source
    row = next(r for r in browser.find_elements(By.CSS_SELECTOR, "table.config tr") if "model_key" in r.text)
    assert '"***"' in row.text and "env LOOMD_MODEL_KEY" in row.text


def test_a_sessions_page_shows_every_block_it_was_given(viewer: Viewer, browser: Any) -> None:
    """A later session in the same folder, through the hooks as the shim sends them: its start block and the recall
    block of its prompt are recorded as the agent got them, and its page shows both with their token cost."""
    from selenium.webdriver.common.by import By

    cwd = viewer.call("session", session_id=viewer.session)["session"]["cwd"]
    later = "ui-later-session"

    def hook(event: str, **extra: Any) -> str:
        raw = json.dumps({"session_id": later, "transcript_path": f"/tmp/{later}.jsonl", "cwd": cwd,
                          "hook_event_name": event, **extra})
        reply = viewer.call("hook", raw=raw, event=event, agent="claude", context=True, deadline_ms=5000)
        assert reply["stdout"], (event, reply)
        return str(json.loads(reply["stdout"])["hookSpecificOutput"]["additionalContext"])

    shown = {"SessionStart": hook("SessionStart", source="startup")}
    # A question that quotes a passage of the earlier session (evidence: never in a start block, so not held back as
    # shown already; a recall answers questions, context/relevance.py).
    asked = viewer.call("memories", project=viewer.project, kind="evidence", limit=1)["memories"][0]
    quoted = " ".join(asked["text"][:150].split())  # a part: a hit that only says the prompt back is not shown
    shown["UserPromptSubmit"] = hook("UserPromptSubmit", prompt=f"where did the earlier session see {quoted}?")
    deadline = time.monotonic() + 10  # the record commits after the hook's answer, off the agent's path
    while len(blocks := viewer.call("session", session_id=later)["blocks"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(b["kind"], b["text"]) for b in blocks] == [("start", shown["SessionStart"]),
                                                        ("prompt", shown["UserPromptSubmit"])]
    assert f"#{asked['id']}" in shown["UserPromptSubmit"]
    browser.get(f"{viewer.base}/session/{later}")
    titles = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "h3")]
    assert any(t.startswith("Start block") for t in titles) and any(t.startswith("Recall on a prompt") for t in titles)
    assert shown["UserPromptSubmit"].splitlines()[1] in browser.find_elements(By.CSS_SELECTOR, "pre.block")[1].text


def test_search_shows_each_signals_share(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    word = max(re.findall(r"[A-Za-z]{6,}", distilled(viewer)[0]["text"]), key=len)
    browser.get(viewer.base + "/")
    box = browser.find_element(By.NAME, "q")
    box.send_keys(word)
    submit(browser, box)
    assert "hits for" in browser.find_element(By.CSS_SELECTOR, "p.meta").text
    rows = browser.find_elements(By.CSS_SELECTOR, "table.memories tbody tr")
    assert rows and word.lower() in browser.find_element(By.CSS_SELECTOR, "table.memories").text.lower()
    assert rows[0].find_elements(By.CSS_SELECTOR, ".bars span"), "no signal bar"
    assert "fts" in rows[0].find_element(By.CSS_SELECTOR, ".legend").text


def test_edit_shows_in_detail_and_the_next_start_block(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    made = viewer.call("store", text="Deploy with the staging script first", kind="constraint",
                       project=viewer.project)
    browser.get(f"{viewer.base}/memory/{made['id']}")
    text = browser.find_element(By.CSS_SELECTOR, "form.edit textarea")
    text.clear()
    text.send_keys("Deploy with ./scripts/stage.sh before production, never straight to prod")
    submit(browser, browser.find_element(By.CSS_SELECTOR, "form.edit button"))
    assert "never straight to prod" in browser.find_element(By.CSS_SELECTOR, "blockquote.text").text
    (memory,) = viewer.call("detail", id=made["id"])["memories"]
    assert memory["text"] == "Deploy with ./scripts/stage.sh before production, never straight to prod"
    assert viewer.call("links", id=made["id"])["edits"][0]["text"] == "Deploy with the staging script first"
    block = viewer.call("context", kind="start", session_id="after-edit", project=viewer.project)["text"]
    assert "never straight to prod" in block and "staging script first" not in block


def test_archive_and_restore_by_button(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    made = viewer.call("store", text="The cache lives in Redis 7", kind="fact", project=viewer.project)
    browser.get(f"{viewer.base}/memory/{made['id']}")
    submit(browser, browser.find_element(By.CSS_SELECTOR, "#edit button.archive"))
    assert viewer.call("detail", id=made["id"])["memories"][0]["archived_at"] is not None
    assert "archived" in browser.find_element(By.CSS_SELECTOR, "table.facts").text
    submit(browser, browser.find_element(By.CSS_SELECTOR, "#edit button.restore"))
    assert viewer.call("detail", id=made["id"])["memories"][0]["archived_at"] is None


def test_merge_from_the_memory_page(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    keep = viewer.call("store", text="CI runs on GitHub Actions", kind="fact", project=viewer.project)["id"]
    other = viewer.call("store", text="The CI pipeline is GitHub Actions", kind="fact", project=viewer.project)["id"]
    browser.get(f"{viewer.base}/memory/{keep}")
    field = browser.find_element(By.NAME, "other")
    field.send_keys(f"#{other}")
    submit(browser, field)
    (gone,) = viewer.call("detail", id=other)["memories"]
    assert gone["superseded_by"] == keep and gone["archived_at"] is not None
    assert viewer.call("links", id=keep)["merged_from"] == [other]
    assert f"#{other}" in browser.find_element(By.TAG_NAME, "main").text


def test_review_queue_by_keyboard(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    queue = viewer.call("review", project=viewer.project, limit=3)["memories"]
    assert len(queue) >= 2, "the replayed session left fewer than two memories to review"
    browser.get(viewer.base + "/review")
    shot(browser, "review")
    cards = browser.find_elements(By.CSS_SELECTOR, "ol.queue .card")
    assert cards[0].get_attribute("data-id") == str(queue[0]["id"]) and "sel" in cards[0].get_attribute("class")
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys("a")  # approve the first; the selection moves on
    WebDriverWait(browser, 10).until(lambda d: "done" in cards[0].get_attribute("class"))
    body.send_keys("k", "j", "x")  # up, down again, archive the second
    WebDriverWait(browser, 10).until(lambda d: "done" in cards[1].get_attribute("class"))
    body.send_keys(Keys.ESCAPE)
    left = {m["id"] for m in viewer.call("review", project=viewer.project, limit=200)["memories"]}
    assert queue[0]["id"] not in left and queue[1]["id"] not in left
    first, second = viewer.call("detail", id=[queue[0]["id"], queue[1]["id"]])["memories"]
    assert first["archived_at"] is None and second["archived_at"] is not None


def _get(url: str, headers: dict[str, str] | None = None, data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_request_without_the_token_is_refused(viewer: Viewer) -> None:
    assert _get(viewer.base + "/") == 401
    assert _get(viewer.base + "/memory/1") == 401
    assert _get(viewer.base + "/?token=wrong") == 401
    assert _get(viewer.base + "/", {"Cookie": "loomd_ui=wrong"}) == 401
    token = viewer.url.rsplit("token=", 1)[1]
    conn = http.client.HTTPConnection(viewer.base.removeprefix("http://"), timeout=10)
    conn.request("GET", f"/sessions?token={token}")
    first = conn.getresponse()
    cookie = first.getheader("set-cookie") or ""
    assert first.status == 303 and first.getheader("location") == "/sessions"  # the token leaves the address bar
    assert f"loomd_ui={token}" in cookie and "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    conn.close()
    assert _get(viewer.base + "/", {"Cookie": f"loomd_ui={token}"}) == 200
    # A page reached under another host name (DNS rebinding) is refused even with the cookie.
    assert _get(viewer.base + "/", {"Cookie": f"loomd_ui={token}", "Host": "attacker.example"}) == 403


def test_a_cross_site_post_is_refused(viewer: Viewer, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    target = viewer.call("store", text="Keep the audit log for 90 days", kind="fact", project=viewer.project)["id"]
    form = (f'<form id="f" method="post" action="{viewer.base}/memory/{target}/archive">'
            '<input name="csrf" value="guess"></form><script>document.getElementById("f").submit()</script>')

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(form.encode())

        def log_message(self, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://localhost:{server.server_address[1]}/")
        WebDriverWait(browser, 10).until(lambda d: d.current_url.startswith(viewer.base))
        assert "401" in browser.find_element(By.TAG_NAME, "body").text
    finally:
        server.shutdown()
        server.server_close()
    token = viewer.url.rsplit("token=", 1)[1]
    cookie = {"Cookie": f"loomd_ui={token}"}
    url = f"{viewer.base}/memory/{target}/archive"
    assert _get(url, {**cookie, "Origin": "http://evil.example"}, b"csrf=x") == 403
    assert _get(url, {**cookie, "Origin": viewer.base}, b"csrf=wrong") == 403
    assert viewer.call("detail", id=target)["memories"][0]["archived_at"] is None


def test_the_server_listens_on_loopback_only(viewer: Viewer) -> None:
    port = int(viewer.base.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1 (little-endian), and nothing else


def test_review_ops_keep_the_audit_trail_and_refuse_nonsense(viewer: Viewer) -> None:
    a = viewer.call("store", text="Use pnpm for the web app", kind="decision", project=viewer.project)["id"]
    b = viewer.call("store", text="The web app moved to bun", kind="decision", project=viewer.project)["id"]
    assert viewer.call("edit", id=a, kind="preference")["memory"]["kind"] == "preference"
    assert viewer.call("edit", id=a, text="Use pnpm for the web app")["changed"] is False
    assert viewer.call("supersede", id=b, old=[a]) == {"superseded": [a]}
    assert [m["id"] for m in viewer.call("links", id=a)["chain"]] == [a, b]
    assert viewer.call("detail", id=a)["memories"][0]["superseded_by"] == b
    for op, args, code in (("edit", {"id": 10**9, "text": "x"}, "not_found"), ("edit", {"id": a}, "bad_request"),
                           ("edit", {"id": a, "text": "   "}, "bad_request"),
                           ("merge", {"id": a, "other": [a]}, "bad_request"),
                           ("supersede", {"id": a, "old": [a]}, "bad_request"),
                           ("approve", {"id": [a, 10**9]}, "not_found")):
        with pytest.raises(RemoteError) as err:
            viewer.call(op, **args)
        assert err.value.code == code, (op, args)
    started = time.time()
    assert viewer.call("approve", id=[b])["approved"] == 1
    assert viewer.call("review", project=viewer.project)["last_review"] >= started


def test_the_cli_reviews_edits_and_merges(viewer: Viewer) -> None:
    from click.testing import CliRunner

    from loomd.cli import main as cli_main

    env = {"LOOMD_HOME": str(viewer.daemon.home)}
    a = viewer.call("store", text="Releases are cut on Fridays", kind="decision", project=viewer.project)["id"]
    b = viewer.call("store", text="We cut releases every Friday", kind="decision", project=viewer.project)["id"]

    def loom(*args: str) -> str:
        result = CliRunner().invoke(cli_main, list(args), env=env)
        assert result.exit_code == 0, result.output
        return str(result.output)

    queued = viewer.call("review", project=viewer.project, limit=1)["memories"][0]
    assert f"#{queued['id']}" in loom("review", "--project", viewer.project, "--limit", "1")
    assert "approved 1" in loom("review", "--approve", str(queued["id"]))
    assert "edited" in loom("edit", str(a), "Releases are cut on Thursdays", "--reason", "moved")
    assert viewer.call("links", id=a)["edits"][-1]["reason"] == "moved"
    assert f"merged #{b} into #{a}" in loom("merge", str(a), str(b))
    assert f"#{a} supersedes nothing new" in loom("supersede", str(a), str(b))  # the merge already did


async def test_the_viewers_lists_read_an_index_range_not_the_whole_table(store: Store) -> None:
    """At 100k memories a whole-table scan costs 0.1-0.7 s a page: every list query must stop at its page (an index
    in id order, or m006's partial indexes), whatever the filters. Checked on SQLite's own plan, not on a clock."""
    statements: list[str] = []
    await store.reader.set_trace_callback(statements.append)
    for state in browse.STATES:
        await browse.list_memories(store, state=state)
        await browse.list_memories(store, state=state, project="p")
        await browse.list_memories(store, state=state, project="p", kind="decision")
    await browse.review_queue(store)
    await browse.review_queue(store, project="p")
    await browse.list_sessions(store, project="p")
    await store.reader.set_trace_callback(None)
    scans = {}
    for sql in statements:
        if "FROM memories" in sql and "EXPLAIN" not in sql:
            plan = [r[3] for r in await store.fetchall("EXPLAIN QUERY PLAN " + sql)]
            # A plain SCAN walks ids newest first and stops at the page; an index range or a partial index too.
            # A search by project then a sort reads every memory of the project.
            if any("TEMP B-TREE" in step for step in plan) or any("memories_hash" in step for step in plan):
                scans[sql] = plan
    assert not scans, scans
