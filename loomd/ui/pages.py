"""The viewer's pages: each asks the daemon (socket ops only) and renders HTML on the server."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Mapping
from typing import Any

from loomd.ui.charts import line, stacked_bars
from loomd.ui.html import (
    KINDS,
    day,
    esc,
    kind_badge,
    memory_actions,
    memory_link,
    page,
    pager,
    project_cell,
    select,
    share_bars,
    state_of,
    table,
    when,
)

PAGE = 50
STATES = ("active", "archived", "superseded", "all")
SCOPES = ("user", "project", "session")
MODES = ("hybrid", "keyword", "semantic")
# Event kinds whose text is the agent's own output or a tool's result: folded in the timeline, one click away.
FOLDED = ("tool", "tool_result", "tool_call", "post_tool", "assistant", "subagent")
SECRET_WORDS = ("key", "token", "secret", "password")
BLOCK_NAMES = {"start": "Start block", "prompt": "Recall on a prompt", "follow-up": "Recall with a tool result",
               "compact": "After compaction"}


def _int(value: str | None, default: int = 0) -> int:
    try:
        return max(0, int(value or default))
    except ValueError:
        return default


def _tokens(text: str | None) -> int:
    return (len(text or "") + 3) // 4


class Pages:
    """Every page, rendered from the replies of `call(op, args)` (the daemon's socket client)."""

    def __init__(self, call: Any, csrf: str) -> None:
        self.call = call
        self.csrf = csrf
        self._projects: tuple[float, list[str]] = (0.0, [])

    def frame(self, title: str, active: str, body: str, flash: str = "") -> str:
        return page(title, active, body, self.csrf, flash)

    async def projects(self) -> list[str]:
        """Project keys for the filters; read at most every 30 s (the op groups the whole memories table)."""
        at, keys = self._projects
        if time.monotonic() - at > 30:
            keys = [p["project"] for p in (await self.call("projects"))["projects"]]
            self._projects = (time.monotonic(), keys)
        return keys

    async def memories(self, q: Mapping[str, str], flash: str = "") -> str:
        f = {k: q.get(k) or None for k in ("project", "kind", "scope", "state", "q", "mode")}
        offset = _int(q.get("offset"))
        form = (
            '<form class="filters" method="get" action="/">'
            f'<input type="search" name="q" value="{esc(f["q"] or "")}" placeholder="search memories…" autofocus>'
            + select("mode", MODES[1:], f["mode"], "hybrid")
            + select("project", await self.projects(), f["project"], "all projects")
            + select("kind", KINDS, f["kind"], "all kinds but evidence")
            + select("scope", SCOPES, f["scope"], "any scope")
            + select("state", STATES[1:], f["state"], "active")
            + '<button type="submit">Go</button></form>'
        )
        back = "/?" + "&".join(f"{k}={esc(v)}" for k, v in q.items())
        if f["q"]:
            limit = min(200, offset + PAGE)
            reply = await self.call("search", {
                "query": f["q"], "limit": limit, "mode": f["mode"] or "hybrid", "project": f["project"],
                "scope": f["scope"], "kind": f["kind"], "include_archived": f["state"] in ("archived", "all"),
                "explain": True})
            hits = reply["results"][offset:]
            rows = [[kind_badge(h["kind"]), memory_link(h, 300), project_cell(h["project"]), day(h.get("created")),
                     share_bars(h.get("explain") or {}), esc(state_of(h))] for h in hits]
            body = table(["kind", "memory", "project", "created", "signals", "state"], rows, "memories")
            timing = reply.get("timings_ms") or reply.get("timings") or {}
            body = (f'<p class="meta">{len(reply["results"])} hits for “{esc(f["q"])}”'
                    f"{' · ' + esc(json.dumps(timing)) if timing else ''}</p>" + body)
        else:
            reply = await self.call("memories", {
                "project": f["project"], "kind": f["kind"], "scope": f["scope"], "state": f["state"] or "active",
                "limit": PAGE, "offset": offset})
            rows = [[kind_badge(m["kind"]), memory_link(m, 300), project_cell(m["project"]), day(m["created"]),
                     str(m["hits"]), esc(state_of(m)), memory_actions(m, back)] for m in reply["memories"]]
            body = table(["kind", "memory", "project", "created", "hits", "state", ""], rows, "memories")
            body += pager("/", {k: v for k, v in f.items() if v}, offset, PAGE, reply["total"], reply["more"])
        return self.frame("Memories", "memories", form + body, flash)

    async def memory(self, memory_id: int, flash: str = "") -> str:
        (m,) = (await self.call("detail", {"id": memory_id}))["memories"]
        links = await self.call("links", {"id": memory_id})
        sources = (await self.call("evidence", {"id": memory_id, "max_chars": 1500, "limit": 20}))["memories"]
        back = f"/memory/{memory_id}"
        facts = table(None, [
            ["kind", kind_badge(m["kind"])], ["state", esc(state_of(m)) + (
                f" ({esc(links['archive_reason'])})" if m["archived_at"] and links["archive_reason"] else "")],
            ["project", esc(m["project"])], ["scope", esc(m["scope"])], ["origin", esc(m["origin"])],
            ["session", f'<a href="/session/{esc(m["session_id"])}">{esc(m["session_id"])}</a>'
             if m["session_id"] else "–"],
            ["created / updated", f"{when(m['created'])} / {when(m['updated'])}"],
            ["importance", f"{m['importance']:.2f}"], ["hits", f"{links['hits']} (last {when(links['last_hit'])})"],
            ["tokens", str(m["tokens"])], ["tags", esc(" ".join(m["tags"]) or "–")],
            ["reviewed", when(links["reviewed_at"])],
        ], "facts")
        kinds = "".join(f'<option{" selected" if k == m["kind"] else ""}>{k}</option>' for k in KINDS)
        forms = (
            f'<section id="edit"><h2>Correct</h2><form method="post" action="/memory/{memory_id}/edit" class="edit">'
            f'<textarea name="text" rows="4">{esc(m["text"])}</textarea>'
            f'<label>kind <select name="kind">{kinds}</select></label>'
            '<input type="hidden" name="back" value="' + back + '">'
            '<button type="submit">Save (old text kept)</button></form>'
            f'<div class="row">{memory_actions(m, back)}'
            f'<form method="post" action="/memory/{memory_id}/merge" class="inline"><input type="hidden" name="back"'
            f' value="{back}"><input name="other" placeholder="ids to merge in" size="14">'
            '<button type="submit">merge into this</button></form>'
            f'<form method="post" action="/memory/{memory_id}/supersede" class="inline"><input type="hidden"'
            f' name="back" value="{back}"><input name="old" placeholder="ids it replaces" size="14">'
            '<button type="submit">supersedes</button></form></div></section>'
        )
        prov = "".join(
            f'<div class="event"><div class="meta"><a href="/session/{esc(e.get("session_id"))}#e{e["id"]}">'
            f'event {e["id"]}</a> · {esc(e.get("kind"))} {esc(e.get("tool_name") or "")} · {when(e.get("ts"))}'
            f'</div><pre>{esc(e.get("text"))}</pre></div>'
            for s in sources for e in s.get("events", [])) or '<p class="empty">no source events recorded</p>'
        edges = table(["", "type", "node", "weight"], [
            ["→" if e["direction"] == "out" else "←", esc(e["type"]),
             (memory_link({"id": e["node_id"], "text": e["label"] or ""}, 160) if e["node"] == "memory"
              else f'{esc(e["node_kind"])} <code>{esc(e["label"])}</code>'), f"{e['weight']:g}"]
            for e in links["edges"]], "edges") if links["edges"] else '<p class="empty">no edges</p>'
        chain = "".join(f'<li{" class=me" if c["id"] == memory_id else ""}>{memory_link(c, 200)} '
                        f'<small>{esc(state_of(c))}</small></li>' for c in links["chain"])
        injected = "".join(f'<li><a href="/session/{esc(s["id"])}">{esc(s["id"])}</a> {esc(s["agent"])} · '
                           f'{when(s["started"])}</li>' for s in links["injected_into"])
        edits = "".join(f'<li>{when(e["at"])} · {esc(e.get("reason"))} · was {esc(e.get("kind"))}: '
                        f'<q>{esc(e["text"])}</q></li>' for e in reversed(links["edits"]))
        merged = ", ".join(f'<a href="/memory/{i}">#{i}</a>' for i in links["merged_from"])
        body = (
            f'<blockquote class="text">{esc(m["text"])}</blockquote>{facts}{forms}'
            f"<h2>Provenance: source events</h2>{prov}"
            f"<h2>Edges</h2>{edges}"
            f'<h2>Supersession chain</h2>{"<ol>" + chain + "</ol>" if chain else "<p class=empty>none</p>"}'
            f"<h2>Injected into sessions</h2>"
            f'{"<ul>" + injected + "</ul>" if injected else "<p class=empty>never injected</p>"}'
            '<p class="meta">Each session records every memory id it was shown (start, compact and per-prompt '
            "blocks alike); the per-prompt block texts themselves are not stored.</p>"
            f'<h2>Edit trail</h2>{"<ul>" + edits + "</ul>" if edits else "<p class=empty>never edited</p>"}'
            + (f"<p>Merged from {merged}</p>" if merged else "")
        )
        return self.frame(f"Memory #{memory_id}", "memories", body, flash)

    async def sessions(self, q: Mapping[str, str]) -> str:
        project, offset = q.get("project") or None, _int(q.get("offset"))
        reply = await self.call("sessions", {"project": project, "limit": PAGE, "offset": offset})
        form = ('<form class="filters" method="get" action="/sessions">'
                + select("project", await self.projects(), project, "all projects")
                + '<button type="submit">Go</button></form>')
        rows = [[f'<a href="/session/{esc(s["id"])}">{esc(s["id"])}</a>', esc(s["agent"]), project_cell(s["project"]),
                 when(s["started"]), when(s["last_seen"]), str(s["events"]), str(s["memories"]),
                 str(s["injected"]), str(s["block_tokens"])] for s in reply["sessions"]]
        body = form + table(["session", "agent", "project", "started", "last seen", "events", "memories",
                             "injected", "block tokens"], rows, "sessions")
        return self.frame("Sessions", "sessions", body + pager("/sessions", {"project": project}, offset, PAGE,
                                                                 reply["total"]))

    async def session(self, session_id: str, q: Mapping[str, str]) -> str:
        offset = _int(q.get("offset"))
        v = await self.call("session", {"session_id": session_id, "limit": 200, "offset": offset})
        s = v["session"]
        events = []
        for e in v["events"]:
            head = (f'<span class="t">{when(e["ts"], True)}</span> <b>{esc(e["kind"])}</b> '
                    f'{esc(e.get("tool_name") or "")} <small>{esc(e["source"])} · {e["chars"]} chars</small>')
            text = f'<pre>{esc(e["text"])}{"…" if e["truncated"] else ""}</pre>'
            folded = e["kind"] in FOLDED or bool(e.get("tool_name"))
            events.append(f'<div class="event k-{esc(e["kind"])}" id="e{e["id"]}">'
                          + (f"<details><summary>{head}</summary>{text}</details>" if folded else head + text)
                          + "</div>")
        blocks = "".join(f'<h3>{esc(BLOCK_NAMES.get(b["kind"], b["kind"]))} · {when(b["ts"], True)} · '
                         f'{b["tokens"]} tokens</h3><pre class="block">{esc(b["text"])}</pre>' for b in v["blocks"])
        start = s.get("start_block")
        if not blocks:  # a session from before blocks were recorded: its frozen start block at least
            blocks = (f'<h3>Start block · {_tokens(start)} tokens</h3><pre class="block">{esc(start)}</pre>'
                      if start else '<p class="empty">no block was injected</p>')
        injected = "".join(f"<li>{kind_badge(m['kind'])} {memory_link(m, 200)} <small>{m['tokens']} tok</small></li>"
                           for m in v["injected"])
        body = (
            table(None, [["agent", esc(s["agent"])], ["project", esc(s["project"])], ["folder", esc(s["cwd"])],
                             ["started / last seen", f"{when(s['started'])} / {when(s['last_seen'])}"],
                             ["events", str(s["events"])], ["memories", str(s["memories"])]], "facts")
            + f"<h2>Injected</h2>{blocks}"
            + f'<h3>Memories shown ({len(v["injected"])}, {v["injected_tokens"]} tokens of memory text)</h3>'
            + (f"<ul>{injected}</ul>" if injected else '<p class="empty">none</p>')
            + f'<h2>Observations ({len(v["observations"])})</h2>'
            + "<ul>" + "".join(f"<li>{memory_link(o, 220)}</li>" for o in v["observations"]) + "</ul>"
            + f'<h2>Memories written ({len(v["memories"])})</h2>'
            + "<ul>" + "".join(f"<li>{kind_badge(o['kind'])} {memory_link(o, 220)}</li>" for o in v["memories"])
            + "</ul>"
            + f'<h2>Timeline</h2><div class="timeline">{"".join(events)}</div>'
            + pager(f"/session/{session_id}", {}, offset, 200, s["events"])
        )
        return self.frame(f"Session {session_id}", "sessions", body)

    async def review(self, q: Mapping[str, str], flash: str = "") -> str:
        project, offset = q.get("project") or None, _int(q.get("offset"))
        v = await self.call("review", {"project": project, "limit": PAGE, "offset": offset})
        items = "".join(
            f'<li class="card" data-id="{m["id"]}" tabindex="-1">{kind_badge(m["kind"])} '
            f'<span class="text">{memory_link(m, 400)}</span><small>{esc(m["project"])} · {esc(m["origin"])} · '
            f'{when(m["created"])}</small>{memory_actions(m, "/review")}</li>' for m in v["memories"])
        help_ = ('<p class="keys"><kbd>j</kbd>/<kbd>k</kbd> move · <kbd>a</kbd> approve · <kbd>e</kbd> edit · '
                 "<kbd>x</kbd> archive · <kbd>m</kbd> merge into… · <kbd>s</kbd> supersedes… · <kbd>o</kbd> open</p>")
        head = (f'<p class="meta">{v["total"]}{"+" * v["more"]} to review · {v["new"]}{"+" * v["new_more"]}'
                f' written since the last review '
                f'({when(v["last_review"])})</p>')
        body = head + help_ + (f'<ol class="queue">{items}</ol>' if items else '<p class="empty">all reviewed</p>')
        return self.frame("Review", "review", body + pager("/review", {"project": project}, offset, PAGE,
                                                            v["total"], v["more"]), flash)

    async def tasks(self) -> str:
        found = (await self.call("task_list", {"all_projects": True}))["tasks"]
        columns = []
        for state in ("draft", "active", "stable"):
            cards = "".join(
                f'<div class="task"><a href="/memory/{t["id"]}">#{t["id"]}</a> {esc(t["title"])}'
                f'<small>{esc(t["project"])} · {when(t["created"])}</small>'
                + (f'<div class="gaps">needs: {esc(", ".join(t["gaps"]))}</div>' if t["gaps"] else "")
                + "</div>" for t in found if t["state"] == state)
            columns.append(f'<div class="column"><h2>{state}</h2>{cards or "<p class=empty>none</p>"}</div>')
        return self.frame("Tasks", "tasks", f'<div class="board">{"".join(columns)}</div>')

    async def workers(self) -> str:
        w = await self.call("workers")
        jobs = (await self.call("jobs", {"limit": 30}))["jobs"]
        failures = (await self.call("jobs", {"outcome": "error", "limit": 10}))["jobs"]
        status = await self.call("status")
        rows = [[esc(x["name"]), "running" if x["running"] else "idle",
                 esc((x["last_run"] or {}).get("outcome", "–")), when((x["last_run"] or {}).get("started")),
                 when(x["next_run"]), esc(len(x["pending"])), esc((x["last_error"] or {}).get("error") or "")]
                for x in w["workers"]]
        model = w.get("model") or {}
        usage = model.get("usage") or {}
        used = usage.get("tokens", 0) if isinstance(usage, dict) else 0
        budget = model.get("daily_tokens") or 0
        spend = (f'<p>Model distiller {esc(model.get("api"))} {esc(model.get("model"))}: {used} of {budget} tokens '
                 f'today <meter min="0" max="{budget or 1}" value="{used}"></meter></p>' if model.get("api") else
                 "<p>No model distiller configured (the rules distill; no tokens spent).</p>")
        backlog = (f'<p>Backlog: {status["embedder"].get("pending", 0)} memories to embed, '
                   f'{status["spool_backlog"]} spooled events, {status["queue_depth"]} queued writes.</p>')
        job_rows = [[str(j["id"]), esc(j["worker"]), esc(j["trigger"]), when(j["started"], True),
                     f"{(j['ended'] or j['started']) - j['started']:.2f} s", esc(j["outcome"]),
                     f"{j['items_in']} → {j['items_out']}", esc(j["error"] or "")] for j in jobs]
        fail = "".join(f'<li>{when(j["started"])} {esc(j["worker"])}: <code>{esc(j["error"])}</code></li>'
                       for j in failures)
        body = (table(["worker", "now", "last outcome", "last run", "next run", "pending", "last error"], rows)
                + spend + backlog + "<h2>Recent runs</h2>"
                + table(["job", "worker", "trigger", "started", "took", "outcome", "items", "error"], job_rows)
                + f'<h2>Failures</h2>{"<ul>" + fail + "</ul>" if fail else "<p class=empty>none</p>"}')
        return self.frame("Workers", "workers", body)

    async def stats(self) -> str:
        st = await self.call("stats")
        series = await self.call("series", {"days": 30})
        status = await self.call("status")
        days = sorted({p["day"] for p in series["by_kind"]})
        kinds = sorted({p["kind"] for p in series["by_kind"]})
        grid = {k: [0.0] * len(days) for k in kinds}
        for p in series["by_kind"]:
            grid[p["kind"]][days.index(p["day"])] += p["count"]
        label = [dt.datetime.fromtimestamp(d).strftime("%m-%d") for d in days]
        inj = series["injected"]
        inj_chart = stacked_bars(
            [s["session_id"][:6] for s in inj],
            {"block tokens": [s["block_tokens"] for s in inj], "memory tokens": [s["memory_tokens"] for s in inj]},
            "tokens injected per session")
        growth = series["growth"]
        growth_chart = line([dt.datetime.fromtimestamp(g["day"]).strftime("%m-%d") for g in growth],
                            [g["memories"] for g in growth], "memories over time")
        top = "".join(f"<li>{m['hits']} hits · {memory_link(m, 160)}</li>" for m in series["top_hits"])
        counts = st["counts"]
        body = (
            f'<p class="meta">{counts["memories"]} memories ({counts["archived"]} archived) · {counts["events"]} '
            f'events · {counts["sessions"]} sessions · database {status["db_bytes"] / 1e6:.1f} MB</p>'
            f'<div class="charts"><section><h2>Memories written per day, by kind</h2>'
            f'{stacked_bars(label, grid, "memories per day by kind")}</section>'
            f"<section><h2>Tokens injected per session</h2>{inj_chart}</section>"
            f"<section><h2>Store size (memories)</h2>{growth_chart}</section>"
            f'<section><h2>Most recalled</h2>{"<ol>" + top + "</ol>" if top else "<p class=empty>no hits yet</p>"}'
            "</section></div>"
            + "<h2>By kind</h2>" + table(["kind", "active", "archived"], [
                [kind_badge(k), str(v["active"]), str(v["archived"])] for k, v in st["memories"].items()])
        )
        return self.frame("Stats", "stats", body)

    async def config(self) -> str:
        cfg = await self.call("config")
        rows = []
        for name, entry in sorted(cfg.items()):
            value = entry["value"]
            if any(w in name.lower() for w in SECRET_WORDS) and value and not name.startswith("path."):
                value = "***"  # whatever the daemon masked or not, a secret never reaches a page
            rows.append([f"<code>{esc(name)}</code>", f"<code>{esc(json.dumps(value))}</code>",
                         esc(entry["source"])])
        return self.frame("Config", "config", table(["setting", "value", "from"], rows, "config"))
