"""Pure HTML pieces of the viewer: the page frame, tables, pagers, memory rows and signal bars. Every value that
came from the store goes through `esc` (memory text is whatever an agent session held)."""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

NAV = (("memories", "/", "Memories"), ("review", "/review", "Review"), ("sessions", "/sessions", "Sessions"),
       ("tasks", "/tasks", "Tasks"), ("workers", "/workers", "Workers"), ("stats", "/stats", "Stats"),
       ("config", "/config", "Config"))
KINDS = ("constraint", "preference", "procedure", "task", "handoff", "decision", "error", "insight", "fact",
         "digest", "reflection", "observation", "evidence")
SIGNAL_COLOURS = {"fts": "#3b6fd4", "vec": "#2a9d6f", "graph": "#c0812b", "recency": "#8a63c9",
                  "recurrence": "#c94f6d"}


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def when(ts: float | None, seconds: bool = False) -> str:
    if not ts:
        return "–"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def project_cell(key: str | None) -> str:
    """A project key in a narrow column: its last path part, the whole key on hover."""
    short = (key or "").rstrip("/").rsplit("/", 1)[-1] or (key or "")
    return f'<span class="p" title="{esc(key)}">{esc(short)}</span>'


def day(ts: float | None) -> str:
    return f'<span class="d" title="{when(ts)}">{when(ts)[:10]}</span>'


def url(path: str, params: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in params.items() if v not in (None, "", 0) or k == "offset" and v}
    return path + ("?" + urlencode(kept) if kept else "")


def page(title: str, active: str, body: str, csrf: str, flash: str = "") -> str:
    """The frame of every page: nav, flash line, body; the CSRF token for the script's POSTs."""
    nav = "".join(f'<a href="{href}"{" class=on" if key == active else ""}>{label}</a>' for key, href, label in NAV)
    note = f'<p class="flash">{esc(flash)}</p>' if flash else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta name="csrf" content="{esc(csrf)}"><title>{esc(title)} · loomd</title>'
        '<link rel="stylesheet" href="/static/app.css"><script defer src="/static/app.js"></script></head>'
        f'<body><header><span class="brand">loomd</span><nav>{nav}</nav></header>'
        f"<main><h1>{esc(title)}</h1>{note}{body}</main></body></html>"
    )


def table(head: Iterable[str] | None, rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """Cells are HTML already (escaped by whoever built them); no `head`: a two-column fact sheet."""
    th = "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>" if head is not None else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{th}<tbody>{body}</tbody></table>'


def pager(path: str, params: Mapping[str, Any], offset: int, limit: int, total: int, more: bool = False) -> str:
    """Newer/older links around a page; `more`: the count stopped at `total` (the op caps it)."""
    if total <= limit and not offset and not more:
        return f'<p class="pager">{total} shown</p>'
    links = []
    if offset > 0:
        links.append(f'<a href="{esc(url(path, {**params, "offset": max(0, offset - limit)}))}">← newer</a>')
    links.append(f"<span>{offset + 1}–{min(offset + limit, total)} of {total}{'+' if more else ''}</span>")
    if offset + limit < total or more:
        links.append(f'<a href="{esc(url(path, {**params, "offset": offset + limit}))}" rel="next">older →</a>')
    return '<p class="pager">' + " ".join(links) + "</p>"


def select(name: str, options: Iterable[str], chosen: str | None, blank: str) -> str:
    opts = [f'<option value="">{esc(blank)}</option>']
    opts += [f'<option{" selected" if o == chosen else ""}>{esc(o)}</option>' for o in options]
    return f'<select name="{name}">{"".join(opts)}</select>'


def kind_badge(kind: str) -> str:
    return f'<span class="kind k-{esc(kind)}">{esc(kind)}</span>'


def state_of(m: Mapping[str, Any]) -> str:
    if m.get("archived_at"):
        return "archived"
    if m.get("superseded_by"):
        return f"superseded by #{m['superseded_by']}"
    return "active"


def memory_link(m: Mapping[str, Any], chars: int = 240) -> str:
    text = " ".join(str(m.get("text", "")).split())
    cut = text if len(text) <= chars else text[:chars] + "…"
    return f'<a href="/memory/{int(m["id"])}">#{int(m["id"])}</a> {esc(cut)}'


def share_bars(explain: Mapping[str, Mapping[str, float]]) -> str:
    """Each signal's share of the fused score as a small stacked bar, with the numbers in its title."""
    total = sum(s.get("contribution", 0.0) for s in explain.values()) or 1.0
    parts, legend = [], []
    for name, signal in explain.items():
        share = signal.get("contribution", 0.0) / total
        if share <= 0:
            continue
        colour = SIGNAL_COLOURS.get(name, "#888")
        parts.append(f'<span style="width:{share * 100:.1f}%;background:{colour}" '
                     f'title="{esc(name)}: rank {esc(signal.get("rank"))}, score {esc(signal.get("score"))}, '
                     f'{share:.0%}"></span>')
        legend.append(f'<i style="color:{colour}">{esc(name)} {share:.0%}</i>')
    return f'<div class="bars">{"".join(parts)}</div><div class="legend">{" ".join(legend)}</div>'


def action(path: str, label: str, hidden: Mapping[str, Any] | None = None, cls: str = "") -> str:
    """A one-button form posting to `path` (the script adds the CSRF token; without script the form carries it)."""
    fields = "".join(f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">' for k, v in (hidden or {}).items())
    return (f'<form method="post" action="{esc(path)}" class="inline">{fields}'
            f'<button class="{cls}" type="submit">{esc(label)}</button></form>')


def memory_actions(m: Mapping[str, Any], back: str) -> str:
    """Approve, archive or restore from a list; edit, merge and supersede live on the memory's page."""
    mid = int(m["id"])
    buttons = [action(f"/memory/{mid}/approve", "approve", {"back": back}, "approve")]
    if m.get("archived_at"):
        buttons.append(action(f"/memory/{mid}/restore", "restore", {"back": back}, "restore"))
    else:
        buttons.append(action(f"/memory/{mid}/archive", "archive", {"back": back}, "archive"))
    buttons.append(f'<a class="button edit" href="/memory/{mid}#edit">edit</a>')
    return '<span class="actions">' + "".join(buttons) + "</span>"
