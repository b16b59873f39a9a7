"""`loom`: the operator CLI, thin commands over client.py. Human output by default, `--json` everywhere."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import click

from loomd.client import Client, RemoteError
from loomd.config import load_config
from loomd.errors import LoomdError


def _emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2, default=str, ensure_ascii=False) if as_json else human(data))


def _call(op: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
    try:
        with Client(timeout=timeout) as client:
            return client.call(op, args or {})
    except LoomdError as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot talk to loomd: {exc}") from exc


def _day(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d") if ts else "-"


def _memory_line(m: dict[str, Any]) -> str:
    flag = " (archived)" if m.get("archived_at") else ""
    return f"#{m['id']:<6} {m['kind']:<11} {_day(m.get('created'))}  {_one_line(m['text'])}{flag}"


def _one_line(text: str, limit: int = 160) -> str:
    """A memory's text on one line (an evidence passage holds a file or a command's output), cut at `limit`."""
    return " ".join(text.split())[:limit]


json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


@click.group()
@click.version_option(package_name="loomd")
def main() -> None:
    """loom: talk to the loomd memory daemon."""


@main.command()
@click.option("--wait", default=0.0, metavar="SECONDS", help="wait this long for a daemon that is starting")
@json_option
def status(wait: float, as_json: bool) -> None:
    """Is the daemon up, and what does it hold."""
    import time

    deadline = time.monotonic() + wait
    while True:
        try:
            data = _call("status")
            break
        except click.ClickException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)

    def human(s: dict[str, Any]) -> str:
        c = s["counts"]
        return (f"loomd {s['version']} pid {s['pid']} up {s['uptime_s']:.0f}s on {s['socket']}\n"
                f"db {s['db']} ({s['db_bytes'] / 1e6:.1f} MB): {c['events']} events, {c['sessions']} sessions, "
                f"{c['memories']} memories ({c['archived']} archived)\n"
                f"spool backlog {s['spool_backlog']}, queue depth {s['queue_depth']}, "
                f"embedder {s['embedder'].get('provider')}" + _health(s) + _storage_line(s.get("storage")))
    _emit(data, as_json, human)


def _health(s: dict[str, Any]) -> str:
    """The background tasks, and what the spool set aside, when there is something to say."""
    tasks = s.get("tasks") or {}
    lines = [f"\ntask {name} {t['state']}: {t['failures']} failure(s), last: {t['last_error']}"
             for name, t in sorted(tasks.items()) if t.get("failures")]
    spool = s.get("spool") or {}
    aside = {k: spool.get(k) for k in ("quarantined", "rejected", "temp_reaped") if spool.get(k)}
    if aside or spool.get("last_error"):
        lines.append(f"\nspool: {', '.join(f'{v} {k}' for k, v in aside.items()) or 'nothing set aside'}"
                     + (f"; {spool['last_error']}" if spool.get("last_error") else ""))
    journal = s.get("journal") or {}
    if journal.get("broken"):
        lines.append(f"\nhook journal broken ({journal['broken']}): hooks are answered after their commit")
    elif journal.get("retries"):
        lines.append(f"\nhook journal: {journal['retries']} failed commit(s) of answered hooks tried again,"
                     f" {journal['unsettled']} not committed yet")
    return "".join(lines)


def _storage_line(storage: dict[str, Any] | None) -> str:
    """Events the daemon could not store, the last storage error, and the free space: losses are never silent."""
    if not storage:
        return ""
    free = storage.get("free_bytes")
    line = (f"\nstorage: {storage['commit_failed']} event(s) failed to commit, {storage['busy_refused']} refused as "
            f"busy since start; {'?' if free is None else f'{free / 1e6:.0f} MB'} free")
    recent = storage.get("recent_errors") or []
    if recent:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(recent[-1]["time"]))
        line += f"\nlast storage error {when}: {recent[-1]['message']}"
    return line


@main.command()
@click.argument("op")
@click.option("--args", "args_json", default=None, help="the op's arguments as a JSON object")
@click.option("--json", "old_args_json", default=None, hidden=True, help="deprecated spelling of --args")
def call(op: str, args_json: str | None, old_args_json: str | None) -> None:
    """Send any op with JSON arguments (--args '{...}'); print the JSON result (the generic client for scripts)."""
    if old_args_json is not None:
        # Everywhere else --json means JSON *output*; here it once meant input.
        click.echo("loom call: --json for the arguments is deprecated, use --args", err=True)
        args_json = args_json if args_json is not None else old_args_json
    try:
        args = json.loads(args_json or "{}")
    except ValueError as exc:
        raise click.ClickException(f"--args is not valid JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise click.ClickException("--args must be a JSON object")
    click.echo(json.dumps(_call(op, args), indent=2, default=str, ensure_ascii=False))


@main.command()
@click.option("--project", default=None, help="only this project key (see `loom projects`)")
@json_option
def stats(project: str | None, as_json: bool) -> None:
    """What the store holds: memories by kind (active and archived), events by agent and kind."""
    if project:
        _check_project(project)
    data = _call("stats", {"project": project})

    def human(d: dict[str, Any]) -> str:
        c = d["counts"]
        lines = [f"{c['events']} events, {c['sessions']} sessions, {c['memories']} memories ({c['archived']} "
                 f"archived)" + (f" in all projects; {project}:" if project else ""), "memories by kind:"]
        lines += [f"  {kind:<12} {n['active']:>7} active {n['archived']:>7} archived"
                  for kind, n in d["memories"].items()] or ["  none"]
        lines.append("events by agent and kind:")
        lines += [f"  {e['agent']:<7} {e['kind']:<22} {e['count']:>7}" for e in d["events"]] or ["  none"]
        return "\n".join(lines)
    _emit(data, as_json, human)


def _alive(pid: int) -> bool:
    """Whether the process runs (an exited one its parent has not reaped yet, a zombie, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): the signal check is all there is


@main.command()
@click.option("--timeout", default=30.0, show_default=True, help="seconds to wait for it to finish draining")
def stop(timeout: float) -> None:
    """Stop the running daemon (SIGTERM: it drains in-flight requests first). A service started again by its socket
    or at login is stopped with `systemctl --user stop loomd.socket loomd.service` (launchd: `loom uninstall
    launchd`)."""
    import signal
    import time

    pid = int(_call("status")["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError as exc:
        raise click.ClickException(f"cannot signal loomd (pid {pid}): {exc}") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            click.echo(f"stopped loomd (pid {pid})")
            return
        time.sleep(0.05)
    raise click.ClickException(f"loomd (pid {pid}) is still running after {timeout:g}s")


@main.command()
@click.argument("text")
@click.option("--kind", default="fact", show_default=True)
@click.option("--scope", default="project", show_default=True, type=click.Choice(["user", "project", "session"]))
@click.option("--tag", "tags", multiple=True)
@click.option("--importance", default=0.7, show_default=True, type=float)
@click.option("--ttl-days", type=float, default=None)
@json_option
def store(text: str, kind: str, scope: str, tags: tuple[str, ...], importance: float, ttl_days: float | None,
          as_json: bool) -> None:
    """Remember TEXT for this project (from the current directory)."""
    data = _call("store", {"text": text, "kind": kind, "scope": scope, "tags": list(tags), "importance": importance,
                           "ttl_days": ttl_days, "cwd": os.getcwd()})
    _emit(data, as_json, lambda d: f"{'stored' if d['created'] else 'already known'} #{d['id']} ({d['project']})")


def _why(m: dict[str, Any]) -> str:
    """A hit's fused score and the signal that placed it (cosine for vec, BM25 for fts, idf for graph)."""
    why = m.get("why") or {}
    top = f" {why['signal']} {why['score']:.3g}" if why else ""
    return f"{m.get('score', 0):.3f}{top:<11}"


def _check_project(project: str) -> None:
    """An unknown project key is an error naming the close ones (a typo would otherwise silently match nothing)."""
    import difflib

    known = [p["project"] for p in _call("projects")["projects"]]
    if project in known or project == "user":
        return
    # Keys share long prefixes (`dir:/Users/`, `git:github.com/`): only a close call is a suggestion.
    close = difflib.get_close_matches(project, known, n=3, cutoff=0.8)
    close += [k for k in known if project.lower() in k.lower() and k not in close][:3]
    hint = f"; did you mean: {', '.join(close)}" if close else "; `loom projects` lists them"
    raise click.ClickException(f"no project '{project}'{hint}")


@main.command()
@click.argument("query")
@click.option("--limit", default=10, show_default=True)
@click.option("--mode", default="hybrid", type=click.Choice(["keyword", "semantic", "hybrid"]), show_default=True)
@click.option("--kind", "kinds", multiple=True)
@click.option("--project", default=None, help="search this project key (see `loom projects`), not the current one")
@click.option("--all-projects", is_flag=True, help="do not limit to the current directory's project")
@click.option("--all", "show_all", is_flag=True, help="also the hits below the relevance floor")
@click.option("--archived", is_flag=True, help="include archived memories")
@click.option("--explain", is_flag=True, help="show each signal's rank and score")
@click.option("--shared", is_flag=True, help="search the team's shared server instead of this machine's store")
@json_option
def search(query: str, limit: int, mode: str, kinds: tuple[str, ...], project: str | None, all_projects: bool,
           show_all: bool, archived: bool, explain: bool, shared: bool, as_json: bool) -> None:
    """Search memories: each hit with its score and the signal behind it, none that is not about QUERY."""
    args: dict[str, Any] = {"query": query, "limit": limit, "mode": mode, "include_archived": archived,
                            "explain": explain, "floor": not show_all}
    if shared:
        args["scope"] = "shared"
    if kinds:
        args["kind"] = list(kinds)
    if project:
        _check_project(project)
        args["project"] = project
    elif not all_projects:
        args["cwd"] = os.getcwd()
    data = _call("search", args)
    if shared:
        _emit(data, as_json, lambda d: "\n".join(
            f"{m['gid'][:13]} {m['kind']:<11} {_day(m.get('created'))}  {_one_line(m['text'])}  "
            f"[{m['person']}@{m['device']}]" for m in d["results"]) or "no results on the shared server")
        return

    def human(d: dict[str, Any]) -> str:
        lines = []
        for m in d["results"]:
            where = f"  [{m['project']}]" if all_projects else ""
            lines.append(f"#{m['id']:<6} {_why(m)} {m['kind']:<11} {_day(m.get('created'))}  "
                         f"{_one_line(m['text'])}{' (archived)' if m.get('archived_at') else ''}{where}")
            if explain and m.get("explain"):
                lines.append("        " + json.dumps(m["explain"], default=str))
        below = d.get("below_floor") or 0
        scope = "every project" if all_projects else f"project {d.get('project')}"
        if not lines or below:
            hints = [f"{below} weaker hit(s) below the relevance floor: --all shows them"] if below else []
            if not all_projects:
                hints.append("--all-projects searches every project (`loom projects` lists them)")
            lines.append(f"{'no results' if not lines else len(lines)} in {scope}; " + "; ".join(hints))
        return "\n".join(lines)
    _emit(data, as_json, human)


@main.command()
@json_option
def projects(as_json: bool) -> None:
    """The projects loomd knows: key, sessions, memories, last activity (newest first)."""
    data = _call("projects")

    def human(d: dict[str, Any]) -> str:
        if not d["projects"]:
            return "no projects yet: loomd has seen no session and stored nothing"
        lines = [f"{'project':<48} {'sessions':>8} {'memories':>8} {'evidence':>8}  last active"]
        for p in d["projects"]:
            lines.append(f"{p['project']:<48} {p['sessions']:>8} {p['memories']:>8} {p['evidence']:>8}  "
                         f"{_when(p['last_active'])}" + (f"  ({p['path']})" if p["path"] else ""))
        return "\n".join(lines)
    _emit(data, as_json, human)


@main.command()
@click.argument("ids", nargs=-1, type=int, required=True)
@json_option
def detail(ids: tuple[int, ...], as_json: bool) -> None:
    """Show memories in full, with their sources."""
    data = _call("detail", {"id": list(ids)})

    def human(d: dict[str, Any]) -> str:
        out = []
        for m in d["memories"]:
            out.append(_memory_line(m))
            out.append(f"        project {m['project']} scope {m['scope']} importance {m['importance']} "
                       f"hits {m['hits']} tags {' '.join(m['tags']) or '-'}")
            out.append("        " + m["text"])
            for s in m.get("sources", []):
                out.append(f"        source event {s['event_id']} {s['kind']} session {s['session_id']}")
        return "\n".join(out)
    _emit(data, as_json, human)


@main.command()
@click.argument("memory_id", type=int, required=False)
@click.option("--entity", default=None, help="memories naming this entity (a path, identifier, name...)")
@click.option("--before", default=5, show_default=True, help="memories before MEMORY_ID")
@click.option("--after", default=5, show_default=True, help="memories after MEMORY_ID")
@click.option("--limit", default=20, show_default=True, help="without MEMORY_ID: the newest this many")
@click.option("--session", default=None)
@click.option("--all-projects", is_flag=True, help="do not limit to the current directory's project")
@json_option
def timeline(memory_id: int | None, entity: str | None, before: int, after: int, limit: int, session: str | None,
             all_projects: bool, as_json: bool) -> None:
    """Memories in time order: around MEMORY_ID, naming --entity, or the newest."""
    args: dict[str, Any] = {"id": memory_id, "entity": entity, "before": before, "after": after, "limit": limit,
                            "session_id": session}
    if not all_projects and memory_id is None:
        args["cwd"] = os.getcwd()
    data = _call("timeline", args)
    _emit(data, as_json, lambda d: "\n".join(
        ("> " if m.get("anchor") else "  ") + _memory_line(m) for m in d["memories"]) or "no memories")


@main.command()
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--chars", default=600, show_default=True, help="cut each event's text here")
@json_option
def evidence(ids: tuple[int, ...], chars: int, as_json: bool) -> None:
    """The source events each memory was made from."""
    data = _call("evidence", {"id": list(ids), "max_chars": chars})

    def human(d: dict[str, Any]) -> str:
        out = []
        for m in d["memories"]:
            out.append(_memory_line(m))
            if not m["events"]:
                out.append("        no source events (stored directly)")
            for e in m["events"]:
                text = " ".join(e["text"].split()) + (" …" if e["truncated"] else "")
                out.append(f"        event {e['id']} {e['kind']} {e['agent']} {_day(e['ts'])}: {text}")
        return "\n".join(out)
    _emit(data, as_json, human)


@main.command()
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--reason", default="forget")
@json_option
def forget(ids: tuple[int, ...], reason: str, as_json: bool) -> None:
    """Archive memories (never deleted; `loom restore` brings them back)."""
    _emit(_call("forget", {"id": list(ids), "reason": reason}), as_json, lambda d: f"archived {d['archived']}")


@main.command()
@click.argument("ids", nargs=-1, type=int)
@click.option("--session", default=None, help="everything of this session: its events, memories and blocks")
@click.option("--project", default=None, help="everything of this project key (see `loom projects`)")
@click.option("--match", default=None, help="every memory and event holding this text, and its copies elsewhere")
@click.option("--yes", is_flag=True, help="do not ask first")
@json_option
def purge(ids: tuple[int, ...], session: str | None, project: str | None, match: str | None, yes: bool,
          as_json: bool) -> None:
    """Delete for good (unlike `forget`): memories IDS, a --session, a --project or what holds --match TEXT, with
    their vectors, index entries and copies; the database file is then rewritten so the text is gone from it."""
    if project:
        _check_project(project)
    criteria = {"id": list(ids) or None, "session_id": session, "project": project, "match": match}
    plan = _call("purge", criteria)["plan"]
    if not plan["memories"] and not plan["events"] and not plan["sessions"]:
        _emit({"purged": False, "plan": plan}, as_json, lambda d: "nothing to purge")
        return
    if not yes:
        lines = [f"this deletes {plan['memories']} memories, {plan['events']} events and "
                 f"{len(plan['sessions'])} sessions for good (no undo), e.g.:"]
        lines += [f"  memory #{m['id']} {m['kind']} {m['project']}: {' '.join(m['text'].split())[:100]}"
                  for m in plan["sample"]["memories"]]
        lines += [f"  event {e['id']} {e['kind']} session {e['session_id']}" for e in plan["sample"]["events"]]
        click.echo("\n".join(lines), err=True)
        if not click.confirm("purge?", default=False, err=True):
            raise click.ClickException("nothing purged")
    data = _call("purge", {**criteria, "confirm": True}, timeout=600.0)
    _emit(data, as_json, lambda d: (
        f"purged {d['plan']['memories']} memories, {d['plan']['events']} events, {len(d['plan']['sessions'])} "
        f"sessions; database rewritten" + ("" if d["wal_truncated"] else " (the WAL is still in use: run "
                                           "`loom purge` again to truncate it)")))


@main.command()
@click.argument("memory_id", type=int)
@click.argument("text", required=False)
@click.option("--kind", default=None, help="also change its kind")
@click.option("--reason", default="edit", show_default=True, help="kept with the old text in its edit trail")
@json_option
def edit(memory_id: int, text: str | None, kind: str | None, reason: str, as_json: bool) -> None:
    """Correct a memory: new TEXT (without it, your $EDITOR opens on the current text); the old text is kept."""
    if text is None and kind is None:
        (current,) = _call("detail", {"id": memory_id, "sources": False})["memories"]
        text = click.edit(current["text"])
        if text is None:
            raise click.ClickException("nothing changed (the editor was closed without saving)")
    data = _call("edit", {"id": memory_id, "text": text, "kind": kind, "reason": reason})
    _emit(data, as_json, lambda d: ("edited " if d["changed"] else "unchanged ") + _memory_line(d["memory"]))


@main.command()
@click.argument("keep", type=int)
@click.argument("others", nargs=-1, type=int, required=True)
@click.option("--text", default=None, help="the merged memory's new text")
@json_option
def merge(keep: int, others: tuple[int, ...], text: str | None, as_json: bool) -> None:
    """Merge OTHERS into KEEP: their sources and hits join it; they are superseded by it and archived."""
    data = _call("merge", {"id": keep, "other": list(others), "text": text})
    _emit(data, as_json, lambda d: f"merged {', '.join(f'#{i}' for i in d['merged'])} into #{d['id']}")


@main.command()
@click.argument("new", type=int)
@click.argument("old", nargs=-1, type=int, required=True)
@json_option
def supersede(new: int, old: tuple[int, ...], as_json: bool) -> None:
    """Mark NEW as superseding OLD (kept, out of date, in its chain; no longer injected)."""
    data = _call("supersede", {"id": new, "old": list(old)})
    _emit(data, as_json, lambda d: f"#{new} supersedes {', '.join(f'#{i}' for i in d['superseded']) or 'nothing new'}")


@main.command()
@click.option("--project", default=None, help="only this project key (see `loom projects`)")
@click.option("--limit", default=20, show_default=True)
@click.option("--approve", "approve_ids", multiple=True, type=int, help="mark this memory reviewed (repeatable)")
@json_option
def review(project: str | None, limit: int, approve_ids: tuple[int, ...], as_json: bool) -> None:
    """The review queue: what the workers and capture rules wrote that no one has reviewed yet."""
    if approve_ids:
        _emit(_call("approve", {"id": list(approve_ids)}), as_json, lambda d: f"approved {d['approved']}")
        return
    data = _call("review", {"project": project, "limit": limit})

    def human(d: dict[str, Any]) -> str:
        head = f"{d['total']} to review ({d['new']} new since the last review, {_day(d['last_review'])})"
        tail = "approve: loom review --approve ID · correct: loom edit ID · archive: loom forget ID"
        return "\n".join([head, *(_memory_line(m) for m in d["memories"]), tail])
    _emit(data, as_json, human)


@main.command()
@click.option("--host", default=None, help="the interface to listen on (default: ui_host, 127.0.0.1)")
@click.option("--port", default=None, type=int, help="the port (default: ui_port; 0 = a free one)")
@click.option("--no-browser", is_flag=True, help="only print the URL")
def ui(host: str | None, port: int | None, no_browser: bool) -> None:
    """The local web viewer: see, search, review and correct memories (over the daemon's socket)."""
    from loomd.ui.app import run  # starlette and uvicorn load only for this command

    cfg = load_config()
    try:
        run(host=host or cfg.ui_host, port=cfg.ui_port if port is None else port, open_browser=not no_browser)
    except OSError as exc:
        raise click.ClickException(f"cannot listen: {exc}") from exc


@main.command()
@click.argument("ids", nargs=-1, type=int, required=True)
@json_option
def restore(ids: tuple[int, ...], as_json: bool) -> None:
    """Un-archive memories."""
    _emit(_call("restore", {"id": list(ids)}), as_json, lambda d: f"restored {d['restored']}")


@main.command()
@click.option("--limit", default=20, show_default=True)
@click.option("--session", default=None)
@json_option
def events(limit: int, session: str | None, as_json: bool) -> None:
    """Show the most recent raw events."""
    data = _call("events", {"limit": limit, "session_id": session})

    def human(d: dict[str, Any]) -> str:
        return "\n".join(
            f"{e['id']:<7} {dt.datetime.fromtimestamp(e['ts']):%m-%d %H:%M:%S} {e['agent']:<6} {e['kind']:<17} "
            f"{e['session_id'][:12]} {e['tool_name'] or ''}{'  ' if e['tool_name'] else ''}"
            f"{' '.join((e.get('text') or '').split())[:160]}" for e in d["events"]) or "no events"
    _emit(data, as_json, human)


@main.command()
@click.option("--local", is_flag=True, help="read the config here instead of asking the daemon")
@json_option
def config(local: bool, as_json: bool) -> None:
    """The effective configuration and where each value came from."""
    if local:
        try:
            data = load_config().public()
        except LoomdError as exc:
            raise click.ClickException(str(exc)) from exc
    else:
        data = _call("config")
    _emit(data, as_json, lambda d: "\n".join(f"{k:<34} {v['value']!s:<40} ({v['source']})" for k, v in d.items()))


@main.command()
@json_option
@click.option("--repair", is_flag=True, help="first rebuild a damaged full-text index from the tables")
def doctor(as_json: bool, repair: bool) -> None:
    """Check everything a user could get wrong; exit non-zero on any FAIL."""
    from loomd.installer.doctor import run_checks

    findings = run_checks(repair=repair)
    _emit([f.__dict__ for f in findings], as_json,
          lambda fs: "\n".join(f"{f['status']:<4} {f['name']:<22} {f['detail']}" + (f"\n     fix: {f['fix']}"
                               if f["fix"] and f["status"] != "OK" else "") for f in fs))
    if any(f.status == "FAIL" for f in findings):
        sys.exit(1)


@main.command("mcp")
def mcp_server() -> None:
    """Serve the loom tools over MCP on stdin/stdout (agents start this; `python -m loomd.mcp` is the same)."""
    from loomd.mcp import main as serve

    sys.exit(serve([]))


@main.command()
@click.option("--session", default=None, help="a session id: the frozen start block, or recall for --prompt")
@click.option("--prompt", default=None, help="show what a prompt would recall (needs --session)")
@click.option("--compact", is_flag=True, help="the block injected after compaction (needs --session)")
@click.option("--agent", default="claude", show_default=True)
@json_option
def context(session: str | None, prompt: str | None, compact: bool, agent: str, as_json: bool) -> None:
    """Show the [LOOM] block an agent would get here."""
    kind = "compact" if compact else "prompt" if prompt else "start"
    data = _call("context", {"kind": kind, "session_id": session, "prompt": prompt, "agent": agent,
                             "cwd": os.getcwd()})
    _emit(data, as_json, lambda d: d["text"] or "(nothing to inject)")


def _task_line(t: dict[str, Any]) -> str:
    need = f"  needs: {', '.join(t['gaps'])}" if t["gaps"] and t["state"] != "stable" else ""
    return f"#{t['id']:<6} {t['state']:<7} {t['title']}{need}"


@main.group()
def task() -> None:
    """Tasks with honest closure: stable only with an artifact, a passing evaluation and a memory reference."""


@task.command("create")
@click.argument("title")
@click.option("--draft", is_flag=True, help="start as draft instead of active")
@json_option
def task_create(title: str, draft: bool, as_json: bool) -> None:
    """Open a task for this project."""
    data = _call("task_create", {"title": title, "cwd": os.getcwd(), "state": "draft" if draft else "active"})
    _emit(data, as_json, _task_line)


@task.command("update")
@click.argument("task_id", type=int)
@click.option("--state", type=click.Choice(["draft", "active"]), default=None)
@click.option("--artifact", multiple=True, help="a path or commit that the work produced")
@click.option("--eval", "evaluation", nargs=2, default=None, metavar="COMMAND RESULT",
              help="a command that passed, and what it printed")
@click.option("--memory", "memories", multiple=True, type=int, help="a memory id this task relies on")
@click.option("--note", default=None)
@json_option
def task_update(task_id: int, state: str | None, artifact: tuple[str, ...], evaluation: tuple[str, str] | None,
                memories: tuple[int, ...], note: str | None, as_json: bool) -> None:
    """Add evidence or notes to a task."""
    evidence: dict[str, Any] = {}
    if artifact:
        evidence["artifact"] = list(artifact)
    if evaluation:
        evidence["evaluation"] = {"command": evaluation[0], "result": evaluation[1], "passed": True}
    if memories:
        evidence["memory"] = list(memories)
    data = _call("task_update", {"id": task_id, "state": state, "evidence": evidence or None, "note": note})
    _emit(data, as_json, _task_line)


@task.command("close")
@click.argument("task_id", type=int)
@json_option
def task_close(task_id: int, as_json: bool) -> None:
    """Mark a task stable; refused, with the missing evidence named, until all three kinds are there."""
    _emit(_call("task_close", {"id": task_id}), as_json, _task_line)


@task.command("list")
@click.option("--state", type=click.Choice(["draft", "active", "stable"]), default=None)
@click.option("--all-projects", is_flag=True)
@json_option
def task_list(state: str | None, all_projects: bool, as_json: bool) -> None:
    """List tasks of this project."""
    data = _call("task_list", {"cwd": os.getcwd(), "state": state, "all_projects": all_projects})
    _emit(data, as_json, lambda d: "\n".join(map(_task_line, d["tasks"])) or "no tasks")


def _project_root(path: str) -> str:
    """The folder a project is: the repository's top level when PATH is inside one, else PATH itself."""
    import subprocess

    where = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(where):
        raise click.ClickException(f"{where} is not a folder")
    try:
        top = subprocess.run(["git", "-C", where, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return where
    return top.stdout.strip() if top.returncode == 0 and top.stdout.strip() else where


def _ignored_list() -> tuple[Any, list[str]]:
    from loomd.ignore import FILE_NAME, read_roots

    path = _data_dir() / FILE_NAME
    return path, read_roots(path)


def _private_list() -> tuple[Any, list[str]]:
    from loomd.ignore import PRIVATE_FILE, read_keys

    path = _data_dir() / PRIVATE_FILE
    return path, read_keys(path)


def _add_line(file: Any, lines: list[str], line: str) -> None:
    """Add `line` to one of the project lists (ignored folders, private keys) unless it is there."""
    from loomd.ignore import write_roots

    if line not in lines:
        write_roots(file, [*lines, line])


def _data_dir() -> Any:
    try:
        return load_config().paths.data_dir
    except LoomdError as exc:
        raise click.ClickException(str(exc)) from exc


@main.group(invoke_without_command=True)
@click.pass_context
def project(ctx: click.Context) -> None:
    """Keep a project out of memory (`ignore`), on this machine only (`private`), or as before (`include`); alone:
    the list."""
    if ctx.invoked_subcommand is not None:
        return
    path, roots = _ignored_list()
    _, keys = _private_list()
    lines = [f"ignored  {root}" for root in roots] + [f"private  {key}" for key in keys]
    click.echo("\n".join(lines) or f"no ignored or private projects ({path.parent})")


@project.command("private")
@click.argument("path", default=".")
def project_private(path: str) -> None:
    """Keep PATH's project (default: here) on this machine: remembered and used here, but none of its text goes to a
    model, a remote embedding endpoint or the team's shared server (the local model still embeds it)."""

    key = _call("projects", {"cwd": _project_root(path)})["here"]
    _add_line(*_private_list(), key)
    click.echo(f"private {key}: nothing of it leaves this machine (`loom project include` undoes it)")


@project.command("ignore")
@click.argument("path", default=".")
def project_ignore(path: str) -> None:
    """Store nothing from PATH's project (default: here): the hooks stop at once, transcripts are skipped. What
    is already stored stays (`loom purge --project KEY` removes it)."""

    root = _project_root(path)
    _add_line(*_ignored_list(), root)
    click.echo(f"ignored {root}: nothing from it is stored from now on (`loom project include` undoes it)")


@project.command("include")
@click.argument("path", default=".")
def project_include(path: str) -> None:
    """Let PATH's project (default: here) back into memory."""
    from loomd.ignore import covers, write_roots

    root = _project_root(path)
    file, roots = _ignored_list()
    private_file, keys = _private_list()
    key = _call("projects", {"cwd": root})["here"] if keys else None
    if root not in roots and key not in keys:
        outer = [r for r in roots if covers([r], root)]
        raise click.ClickException(f"{root} is neither ignored nor private" + (
            f"; {outer[0]}, which holds it, is ignored" if outer else ""))
    if root in roots:
        write_roots(file, [r for r in roots if r != root])
        click.echo(f"included {root}: its sessions are remembered again")
    if key in keys:
        write_roots(private_file, [k for k in keys if k != key])
        click.echo(f"shared {key} again: the model and embedding endpoints may see it")


def _install_targets() -> list[str]:
    from loomd.installer.agents import TARGETS

    return sorted(TARGETS)


def _run_install(target: str, uninstall: bool, print_only: bool, **options: Any) -> None:
    from loomd.installer.agents import plan

    try:
        actions = plan(target, uninstall=uninstall, **options)
        if print_only:
            click.echo(actions.script(), nl=False)
            return
        for line in actions.apply():
            click.echo(line)
    except LoomdError as exc:
        raise click.ClickException(str(exc)) from exc


print_option = click.option("--print", "print_only", is_flag=True,
                            help="show the steps as a shell script; change nothing")


@main.command()
@click.argument("target", type=click.Choice(_install_targets()))
@click.option("--settings-only", is_flag=True, help="claude/codex: hooks in the settings file instead of the plugin")
@click.option("--python", default=None, help="the interpreter hooks and services run (default: this one)")
@print_option
def install(target: str, settings_only: bool, python: str | None, print_only: bool) -> None:
    """Register loomd with TARGET (idempotent; every file changed is backed up first)."""
    _run_install(target, False, print_only, python=python, settings_only=settings_only)


@main.command()
@click.argument("target", type=click.Choice(_install_targets()))
@print_option
def uninstall(target: str, print_only: bool) -> None:
    """Undo `loom install TARGET`, leaving everything else as it was."""
    _run_install(target, True, print_only)


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _worker_line(w: dict[str, Any]) -> str:
    last = w.get("last_run") or {}
    state = "running" if w["running"] else (last.get("outcome") or "never run")
    line = (f"{w['name']:<10} {state:<12} last {_when(last.get('started'))}  in {last.get('items_in', 0):<5} "
            f"out {last.get('items_out', 0):<5} next {_when(w.get('next_run'))}")
    if last.get("error"):
        line += f"\n           error: {last['error'][:200]}"
    return line


@main.group(invoke_without_command=True)
@json_option
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """The memory workers: last run, outcome and next run of each (`loom workers run NAME` runs one)."""
    if ctx.invoked_subcommand is not None:
        return
    data = _call("workers")

    def human(d: dict[str, Any]) -> str:
        head = "passive: no background work" if d["passive"] else f"every {d['interval_s']:g}s and on events"
        model = d.get("model") or {}
        usage = model.get("usage") or {}
        spent = f", {usage.get('tokens', 0)}/{model['daily_tokens']} tokens on {usage.get('day')}" if usage else ""
        lines = [f"workers ({head}); model: {model.get('api') or 'none (rules)'}{spent}"]
        return "\n".join(lines + [_worker_line(w) for w in d["workers"]])
    _emit(data, as_json, human)


@workers.command("run")
@click.argument("name", type=click.Choice(["observer", "reflector", "dropper", "digest", "gc"]))
@click.option("--session", "session_id", default=None, help="only this session (observer; its project otherwise)")
@click.option("--project", default=None, help="only this project (reflector, dropper, digest, gc)")
@click.option("--dry-run", is_flag=True, help="show what it would write; write nothing")
@click.option("--final/--not-final", default=None,
              help="observer: treat the session as ended (its open todos are noted) or as still running "
                   "(default: as the session's events say)")
@json_option
def workers_run(name: str, session_id: str | None, project: str | None, dry_run: bool, final: bool | None,
                as_json: bool) -> None:
    """Run worker NAME now and wait for it."""
    data = _call("workers_run", {"name": name, "session_id": session_id, "project": project, "dry_run": dry_run,
                                 "final": final}, timeout=600.0)

    def human(d: dict[str, Any]) -> str:
        lines = [f"{d['worker']} job #{d['job_id']}: {d['outcome']} in {d['duration_s']}s, "
                 f"{d['items_in']} in, {d['items_out']} out" + (f"\nerror: {d['error']}" if d["error"] else "")]
        for item in d["output"]:
            label = item.get("type") or item.get("kind") or item.get("reason") or ""
            text = item.get("text") or ""
            lines.append(f"  {item['action']:<22} #{item.get('id', '-'):<6} {label:<10} {text[:150]}")
        return "\n".join(lines)
    _emit(data, as_json, human)


@main.command("import")
@click.argument("sources", nargs=-1)
@click.option("--yes", "-y", is_flag=True, help="import without asking")
@click.option("--since", default=None, help="only sessions active on or after this date (YYYY-MM-DD or ISO time)")
@click.option("--project", default=None, help="only sessions whose folder contains this text")
@click.option("--dry-run", is_flag=True, help="show what would be imported, import nothing")
@click.option("--force", is_flag=True, help="read again files an earlier import finished (stores only what is new)")
@json_option
def import_(sources: tuple[str, ...], yes: bool, since: str | None, project: str | None, dry_run: bool,
            force: bool, as_json: bool) -> None:
    """Import existing Claude Code and Codex history: SOURCES are `claude`, `codex` (both by default) or paths.

    Claude Code's is under $CLAUDE_CONFIG_DIR or ~/.claude (projects/), Codex's under $CODEX_HOME or ~/.codex
    (sessions/). Sessions hooks already captured are not stored twice; a re-run (after a kill too) resumes."""
    named = [s if s in ("claude", "codex") else os.path.abspath(os.path.expanduser(s)) for s in sources]
    plan = _call("import_scan", {
        "sources": named or ["claude", "codex"], "since": _since(since), "project": project,
        "claude_dir": os.environ.get("CLAUDE_CONFIG_DIR") or os.path.expanduser("~/.claude"),
        "codex_dir": os.environ.get("CODEX_HOME") or os.path.expanduser("~/.codex"),
    }, timeout=600.0)
    todo = [f for f in plan["files"] if force or not f["imported"]]
    if not as_json:
        click.echo(_import_plan(plan["summary"]))
    if dry_run:
        if as_json:
            _emit(plan, True, str)
        return
    if todo and not yes:
        if not sys.stdin.isatty():
            raise click.ClickException("not a terminal, so no one can confirm: run `loom import --yes` to import")
        click.confirm(f"Import {len(todo)} file(s)?", abort=True, err=True)
    result = _import_files(todo, force, skipped=len(plan["files"]) - len(todo))
    _emit(result, as_json, lambda r: (
        f"imported {r['files']} file(s): {r['events']} events read, {r['stored']} new"
        f" ({r['skipped']} file(s) unchanged since an earlier import, {len(r['failed'])} failed)"
        + "".join(f"\n  failed: {f['path']}: {f['error']}" for f in r["failed"])
        + "\nembedding and observation catch up in the background: `loom status --json` (embedder.pending), "
          "`loom workers`"))
    if result["failed"]:
        sys.exit(1)


def _since(value: str | None) -> float | None:
    if not value:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a date (YYYY-MM-DD or an ISO time)", param_hint="--since") from None
    return when.timestamp()


def _import_plan(s: dict[str, Any]) -> str:
    agents = ", ".join(f"{n} {a}" for a, n in s["agents"].items() if n)
    lines = [f"found {s['sessions']} session(s) ({agents or 'none'}) in {s['projects']} project(s): {s['files']} "
             f"file(s), {s['bytes'] / 1e6:.1f} MB, ~{s['events_estimate']} events, "
             f"{_day(s['first_ts'])} .. {_day(s['last_ts'])}"]
    for name, p in list(s["by_project"].items())[:10]:
        lines.append(f"  {p['sessions']:>5} session(s) ~{p['events']:>7} events  {name}")
    if len(s["by_project"]) > 10:
        lines.append(f"  ... and {len(s['by_project']) - 10} more project(s)")
    if s["imported_files"]:
        lines.append(f"{s['imported_files']} file(s) unchanged since an earlier import are skipped")
    return "\n".join(lines)


# Files `loom import` has in the daemon at once: enough to keep its parser processes (a core each, up to 4) busy while
# it commits what they parsed; few enough that a stop leaves few files half done (their re-read stores nothing).
IMPORT_IN_FLIGHT = 4


def _import_files(files: list[dict[str, Any]], force: bool, skipped: int) -> dict[str, Any]:
    """One `import_file` call per file, IMPORT_IN_FLIGHT at a time (each on its own connection), so the daemon's
    parser processes read the next files while it commits one; hooks are served throughout. A bar on a terminal."""
    from tqdm import tqdm

    done: dict[str, Any] = {"files": 0, "events": 0, "stored": 0, "skipped": skipped, "failed": []}
    if not files:
        return done
    bar = tqdm(total=sum(f["bytes"] for f in files), unit="B", unit_scale=True, desc="importing",
               disable=not sys.stderr.isatty(), file=sys.stderr)
    local = threading.local()
    clients: list[Client] = []

    def one(f: dict[str, Any]) -> dict[str, Any]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = Client(timeout=600.0)
            clients.append(client)
        return _import_one(client, f["path"], force)

    pool = ThreadPoolExecutor(IMPORT_IN_FLIGHT, thread_name_prefix="import")
    try:
        # In order, IMPORT_IN_FLIGHT ahead: a stop (an error, Ctrl-C) leaves few files half done.
        futures = [(f, pool.submit(one, f)) for f in files]
        for f, future in futures:
            try:
                r = future.result()
            except RemoteError as exc:
                done["failed"].append({"path": f["path"], "error": str(exc)})
            else:
                done["files"] += 1
                done["skipped"] += r["skipped"]
                done["events"] += r["events"]
                done["stored"] += r["stored"]
            bar.update(f["bytes"])
            bar.set_postfix(events=done["events"], new=done["stored"], refresh=False)
    except (LoomdError, OSError) as exc:
        raise click.ClickException(f"the import stopped after {done['files']} file(s): {exc}. Run `loom import` "
                                   "again to resume: finished files are skipped, nothing is stored twice") from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            client.close()
        bar.close()
    return done


def _import_one(client: Client, path: str, force: bool) -> dict[str, Any]:
    for wait in (0.1, 0.5, 2.0, 5.0):
        try:
            return dict(client.call("import_file", {"path": path, "force": force}))
        except RemoteError as exc:
            if exc.code != "busy":
                raise
            time.sleep(wait)  # the daemon's queue is full of live events: they come first
    return dict(client.call("import_file", {"path": path, "force": force}))


@main.group()
def shared() -> None:
    """Shared memory on a team's PostgreSQL server ([shared] dsn / LOOMD_SHARED_DSN)."""


@shared.command("init")
@click.option("--dsn", envvar="LOOMD_SHARED_ADMIN_DSN", required=True,
              help="an admin DSN for the server you own (or LOOMD_SHARED_ADMIN_DSN); never printed")
@click.option("--team", required=True, help="the team to create (or add members to)")
@click.option("--member", "members", multiple=True, help="a database role of the team (created if missing)")
@click.option("--dim", default=None, type=int, help="embedding dimension (default: this config's embed_dim)")
def shared_init(dsn: str, team: str, members: tuple[str, ...], dim: int | None) -> None:
    """Create (or migrate) the schema, the team and its members' roles; print the grants it needs and gave."""
    import asyncio

    from loomd.team import remote, schema

    config = load_config()

    async def run() -> tuple[list[str], list[str]]:
        conn = await remote.connect(config, dsn, vector=False)
        try:
            applied = await schema.migrate(conn, dim or config.embed_dim)
            todo = await schema.add_members(conn, team, list(members))
        finally:
            await conn.close()
        return applied, todo

    try:
        applied, todo = asyncio.run(run())
    except LoomdError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"schema loomd at version {schema.version()} ({', '.join(applied) or 'already up to date'}); "
               f"team {team!r} with {', '.join(members) or 'no new members'}")
    click.echo(schema.GRANTS_NEEDED)
    for line in todo:
        click.echo(line)
    click.echo(f"-- each member's config: [shared] dsn = \"postgresql://<member>@<host>/<db>\", team = \"{team}\"")


@shared.command("status")
@json_option
def shared_status(as_json: bool) -> None:
    """Sync health: what waits to be pushed and since when, the last push and pull, the last error."""
    data = _call("shared_status", {"remote": True})

    def human(d: dict[str, Any]) -> str:
        if not d.get("configured"):
            return "shared memory is off (set [shared] dsn and team)"
        server = d.get("server") or {}
        reach = f"unreachable: {server['error']}" if server.get("error") else f"as {server.get('role')}"
        return (f"server {d['dsn']} team {d['team']} {reach} from {d['device']}\n"
                f"push queue {d['push_queue']} (oldest {d['push_lag_s']:.1f}s); pull backlog "
                f"{server.get('pull_backlog')}; pushed {d['pushed']}, pulled {d['pulled']} since the daemon started\n"
                f"last push {_ago(d['last_push_at'])}, last pull {_ago(d['last_pull_at'])}; "
                f"last error: {d['last_error'] or 'none'}")
    _emit(data, as_json, human)


def _ago(ts: float | None) -> str:
    return f"{time.time() - ts:.0f}s ago" if ts else "never"


@shared.command("push")
@click.option("--now", is_flag=True, help="(the default) push now, whatever the schedule and the backoff")
@json_option
def shared_push(now: bool, as_json: bool) -> None:
    """Push this machine's queued changes to the shared server."""
    _emit(_call("shared_sync", {"push": True, "pull": False}, timeout=600), as_json, json.dumps)


@shared.command("pull")
@click.option("--now", is_flag=True, help="(the default) pull now, whatever the schedule and the backoff")
@json_option
def shared_pull(now: bool, as_json: bool) -> None:
    """Pull the team's changes from the shared server into this machine's store."""
    _emit(_call("shared_sync", {"push": False, "pull": True}, timeout=600), as_json, json.dumps)
