"""`loom ui`: a Starlette app on loopback that shows and corrects what loomd remembers, over the daemon's socket.

Security: a per-run secret token, given once in the printed URL and then kept in an HttpOnly, SameSite=Strict
cookie; every request without it gets 401. A request whose Host is not this server's gets 403 (DNS rebinding).
A state-changing request also needs an Origin of this server and the page's CSRF token (derived from the secret),
else 403. It binds 127.0.0.1 unless `ui_host` or `--host` says otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import sys
import threading
import webbrowser
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from loomd.client import AsyncClient, RemoteError
from loomd.errors import DaemonNotRunning, LoomdError
from loomd.ui.html import esc, page
from loomd.ui.pages import Pages

COOKIE = "loomd_ui"
STATIC = Path(__file__).parent / "static"
SAFE_METHODS = ("GET", "HEAD")
ERROR_STATUS = {"not_found": 404, "bad_request": 400, "busy": 503}


def csrf_of(token: str) -> str:
    """The CSRF token pages carry: derived from the secret, so the cookie's value never appears in a page."""
    return hmac.new(token.encode(), b"loomd-ui-csrf", hashlib.sha256).hexdigest()


class Guard:
    """ASGI middleware: the token (query once, then cookie), the Host, and the Origin of state-changing requests."""

    def __init__(self, app: ASGIApp, token: str, hosts: set[str] | None) -> None:
        self.app, self.token, self.hosts = app, token, hosts  # hosts None: bound to a chosen interface, any name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.hosts is not None and host not in self.hosts:
            await PlainTextResponse("unknown host", 403)(scope, receive, send)
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        given = query.pop("token", None)
        if given is not None and hmac.compare_digest(given, self.token) and scope["method"] in SAFE_METHODS:
            # Trade the token in the URL for the cookie, and drop it from the address bar and history.
            target = scope["path"] + ("?" + urlencode(query) if query else "")
            response = RedirectResponse(target, 303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict", path="/")
            await response(scope, receive, send)
            return
        cookie = SimpleCookie(headers.get("cookie", ""))
        held = cookie[COOKIE].value if COOKIE in cookie else ""
        if not hmac.compare_digest(held, self.token):
            await PlainTextResponse("401: open the URL `loom ui` printed (it carries this run's token)",
                                    401)(scope, receive, send)
            return
        if scope["method"] not in SAFE_METHODS:
            if headers.get("origin", "") != f"http://{host}":
                await PlainTextResponse("403: cross-site request refused", 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Viewer:
    """The daemon's async socket client, reconnecting once when the daemon restarted."""

    def __init__(self, socket_path: Path | None = None) -> None:
        self.socket_path = socket_path
        self.client: AsyncClient | None = None

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        for attempt in (1, 2):
            if self.client is None:
                self.client = AsyncClient(self.socket_path)
            try:
                return await self.client.call(op, args or {})
            except RemoteError:
                raise
            except LoomdError:
                await self.client.close()
                self.client = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _back(form: dict[str, str], default: str) -> str:
    """Where to go after an action: a local path only (never another site)."""
    back = form.get("back", "")
    return back if back.startswith("/") and not back.startswith("//") else default


def _ids(text: str) -> list[int]:
    ids = [int(p) for p in text.replace(",", " ").replace("#", " ").split() if p.isdigit()]
    if not ids:
        raise RemoteError("bad_request", "give one or more memory ids")
    return ids


def build_app(viewer: Viewer, token: str, hosts: set[str] | None) -> ASGIApp:
    """The viewer's ASGI app behind its guard."""
    csrf = csrf_of(token)
    pages = Pages(viewer.call, csrf)

    def html(render: Callable[[Request], Awaitable[str]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return HTMLResponse(await render(request))
            except DaemonNotRunning as exc:
                return HTMLResponse(page("loomd is not running", "", f"<p>{esc(exc)}</p>", csrf), 503)
            except RemoteError as exc:
                return HTMLResponse(page("Error", "", f'<p class="flash">{esc(exc)}</p>', csrf),
                                    ERROR_STATUS.get(exc.code, 500))
        return endpoint

    async def act(request: Request) -> Response:
        """A state-changing action: the op it names, then back to the page (or JSON for the page's script)."""
        form = {k: str(v) for k, v in (await request.form()).items()}
        if not hmac.compare_digest(form.get("csrf", request.headers.get("x-csrf-token", "")), csrf):
            return PlainTextResponse("403: missing or wrong CSRF token", 403)
        memory_id, verb = int(request.path_params["id"]), request.path_params["verb"]
        try:
            if verb == "approve":
                result = await viewer.call("approve", {"id": memory_id})
            elif verb == "archive":
                result = await viewer.call("forget", {"id": memory_id, "reason": form.get("reason") or "viewer"})
            elif verb == "restore":
                result = await viewer.call("restore", {"id": memory_id})
            elif verb == "edit":
                result = await viewer.call("edit", {"id": memory_id, "text": form.get("text"),
                                                    "kind": form.get("kind") or None, "reason": "viewer"})
            elif verb == "merge":
                result = await viewer.call("merge", {"id": memory_id, "other": _ids(form.get("other", ""))})
            elif verb == "supersede":
                result = await viewer.call("supersede", {"id": memory_id, "old": _ids(form.get("old", ""))})
            else:
                return PlainTextResponse("unknown action", 404)
        except RemoteError as exc:
            if "json" in request.headers.get("accept", ""):
                return JSONResponse({"ok": False, "error": str(exc)}, ERROR_STATUS.get(exc.code, 500))
            return HTMLResponse(page("Error", "", f'<p class="flash">{esc(exc)}</p>', csrf),
                                ERROR_STATUS.get(exc.code, 500))
        if "json" in request.headers.get("accept", ""):
            return JSONResponse({"ok": True, "result": result})
        return RedirectResponse(_back(form, f"/memory/{memory_id}"), 303)

    routes = [
        Route("/", html(lambda r: pages.memories(r.query_params))),
        Route("/memory/{id:int}", html(lambda r: pages.memory(r.path_params["id"]))),
        Route("/memory/{id:int}/{verb}", act, methods=["POST"]),
        Route("/sessions", html(lambda r: pages.sessions(r.query_params))),
        Route("/session/{sid:path}", html(lambda r: pages.session(r.path_params["sid"], r.query_params))),
        Route("/review", html(lambda r: pages.review(r.query_params))),
        Route("/tasks", html(lambda r: pages.tasks())),
        Route("/workers", html(lambda r: pages.workers())),
        Route("/stats", html(lambda r: pages.stats())),
        Route("/config", html(lambda r: pages.config())),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await viewer.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return Guard(app, token, hosts)


def listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so the URL printed names the port really taken (0 = a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


def hosts_for(host: str, port: int) -> set[str] | None:
    """The Host names a loopback viewer answers to (another name there is DNS rebinding: a page of another site
    resolving its own name to 127.0.0.1); on an interface chosen by the user, any name."""
    if host not in ("127.0.0.1", "::1", "localhost"):
        return None
    return {f"{n}:{port}" for n in ("127.0.0.1", "localhost", "[::1]")}


def run(host: str = "127.0.0.1", port: int = 0, open_browser: bool = True, socket_path: Path | None = None) -> None:
    """Serve until Ctrl-C; print the URL (with this run's token) and open it in a browser when asked."""
    import uvicorn  # only `loom ui` pays for importing the server

    sock = listen(host, port)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(24)
    app = build_app(Viewer(socket_path), token, hosts_for(host, port))
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/?token={token}"
    sys.stdout.write(f"loom ui: {address}\n")
    sys.stdout.flush()
    if open_browser:
        threading.Timer(0.3, webbrowser.open, [address]).start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
    server.run(sockets=[sock])
