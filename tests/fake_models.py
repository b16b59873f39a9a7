"""Fake model servers on 127.0.0.1 for driving the real Claude Code and Codex clients offline.

Stdlib only. Each fake is a context manager that serves on an ephemeral port and records every
request it receives::

    with AnthropicFake(tool_name="Bash", tool_input={"command": "echo tool-ran"}) as fake:
        run_claude(..., base_url=fake.url)
        assert "MARKER" in fake.request_text()

The conversation is scripted per request: while the request carries no tool result the fake asks
for one tool call; once a tool result is present it answers with the final text. A request whose
tool list does not name the requested tool (a side request such as a title or summary) gets the
final text straight away.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, Self

__all__ = ["AnthropicFake", "FakeModelServer", "OpenAIResponsesFake", "RecordedRequest"]


@dataclass
class RecordedRequest:
    """One HTTP request as the fake saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


@dataclass
class _Reply:
    status: int = 200
    content_type: str = "application/json"
    body: bytes = b"{}"
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean; requests are recorded instead

    def _handle(self) -> None:
        body = self._read_body()
        parsed: Any = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        req = RecordedRequest(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body, parsed)
        owner = self.server.owner
        with owner.lock:
            owner.requests.append(req)
        reply = owner.respond(req)
        self.send_response(reply.status)
        if reply.events:
            # SSE: no length; the stream ends when the connection closes.
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for name, data in reply.events:
                self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True
            return
        payload = b"" if self.command == "HEAD" else reply.body
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if payload:
            self.wfile.write(payload)

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: FakeModelServer


class FakeModelServer:
    """Base class: a threaded HTTP server on 127.0.0.1 that records requests and scripts replies."""

    default_final_text: ClassVar[str] = "FAKE-MODEL-REPLY done."

    def __init__(self, *, tool_name: str | None, tool_input: dict[str, Any], final_text: str | None = None) -> None:
        self.tool_name = tool_name
        self.tool_input = dict(tool_input)
        self.final_text = self.default_final_text if final_text is None else final_text
        self.requests: list[RecordedRequest] = []
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> Self:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("fake server is not running")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.port}"

    # assertions helpers ----------------------------------------------------------------------
    def snapshot(self) -> list[RecordedRequest]:
        with self.lock:
            return list(self.requests)

    def model_requests(self) -> list[RecordedRequest]:
        """The requests that asked the model for a reply (the scripted endpoint only)."""
        return [r for r in self.snapshot() if self.is_model_request(r)]

    def request_text(self) -> str:
        """All model request bodies decoded and joined, for substring assertions."""
        return "\n".join(r.text for r in self.model_requests())

    def next_id(self) -> int:
        return next(self._ids)

    # to override -----------------------------------------------------------------------------
    def is_model_request(self, req: RecordedRequest) -> bool:
        raise NotImplementedError

    def respond(self, req: RecordedRequest) -> _Reply:
        raise NotImplementedError


class AnthropicFake(FakeModelServer):
    """Anthropic Messages API (``POST /v1/messages``, streaming SSE or plain JSON)."""

    def __init__(
        self,
        *,
        tool_name: str | None = "Bash",
        tool_input: dict[str, Any] | None = None,
        final_text: str | None = None,
    ) -> None:
        super().__init__(
            tool_name=tool_name,
            tool_input={"command": "echo tool-ran"} if tool_input is None else tool_input,
            final_text=final_text,
        )

    def is_model_request(self, req: RecordedRequest) -> bool:
        return req.method == "POST" and req.path.split("?", 1)[0] == "/v1/messages"

    @staticmethod
    def has_tool_result(body: Any) -> bool:
        for msg in (body or {}).get("messages") or []:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content
            ):
                return True
        return False

    def wants_tool(self, body: Any) -> bool:
        if not self.tool_name or not isinstance(body, dict) or self.has_tool_result(body):
            return False
        return any(isinstance(t, dict) and t.get("name") == self.tool_name for t in body.get("tools") or [])

    def tool_results(self) -> list[dict[str, Any]]:
        """Every ``tool_result`` block the client sent back, in order."""
        out: list[dict[str, Any]] = []
        for req in self.model_requests():
            for msg in (req.json or {}).get("messages") or []:
                content = msg.get("content") if isinstance(msg, dict) else None
                if isinstance(content, list):
                    out.extend(b for b in content if isinstance(b, dict) and b.get("type") == "tool_result")
        return out

    def respond(self, req: RecordedRequest) -> _Reply:
        path = req.path.split("?", 1)[0]
        if req.method != "POST":
            return _Reply()
        if path == "/v1/messages/count_tokens":
            return _Reply(body=json.dumps({"input_tokens": max(1, len(req.body) // 4)}).encode())
        if path != "/v1/messages":
            return _Reply()
        body = req.json if isinstance(req.json, dict) else {}
        n = self.next_id()
        model = str(body.get("model") or "claude-fake")
        if self.wants_tool(body):
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": f"toolu_fake{n:02d}",
                "name": self.tool_name,
                "input": self.tool_input,
            }
            stop_reason = "tool_use"
        else:
            block = {"type": "text", "text": self.final_text}
            stop_reason = "end_turn"
        usage = {"input_tokens": 10, "output_tokens": 5}
        message = {
            "id": f"msg_fake{n:02d}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [block],
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return _Reply(body=json.dumps(message).encode())
        if block["type"] == "tool_use":
            start_block = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            start_block = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        events: list[tuple[str, dict[str, Any]]] = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}},
                },
            ),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start_block}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": usage["output_tokens"]},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        return _Reply(events=events)


class OpenAIResponsesFake(FakeModelServer):
    """OpenAI Responses API (``POST /v1/responses``, SSE) as Codex's ``wire_api = "responses"`` uses it."""

    default_final_text = "FAKE-CODEX-REPLY done."

    def __init__(
        self,
        *,
        tool_name: str | None = "exec_command",
        tool_input: dict[str, Any] | None = None,
        final_text: str | None = None,
    ) -> None:
        super().__init__(
            tool_name=tool_name,
            tool_input={"cmd": "echo tool-ran"} if tool_input is None else tool_input,
            final_text=final_text,
        )

    def is_model_request(self, req: RecordedRequest) -> bool:
        return req.method == "POST" and req.path.split("?", 1)[0] == "/v1/responses"

    @staticmethod
    def has_tool_output(body: Any) -> bool:
        items = (body or {}).get("input") or []
        return isinstance(items, list) and any(
            isinstance(i, dict) and i.get("type") in ("function_call_output", "custom_tool_call_output") for i in items
        )

    def resolve_tool(self, body: Any) -> tuple[str | None, str] | None:
        """``(namespace, name)`` to call, or None when no tool call is due.

        Codex offers MCP tools inside a namespace (``{"type": "namespace", "name": "mcp__loom", "tools": [...]}``)
        and expects the call as ``namespace="mcp__loom", name="loom_search"``; ``tool_name`` may be given either
        flat (``mcp__loom__loom_search``) or bare.
        """
        if not self.tool_name or not isinstance(body, dict) or self.has_tool_output(body):
            return None
        for tool in body.get("tools") or []:
            if not isinstance(tool, dict):
                continue
            if tool.get("type") == "namespace":
                ns = str(tool.get("name") or "")
                for sub in tool.get("tools") or []:
                    sub_name = sub.get("name") if isinstance(sub, dict) else None
                    if sub_name and self.tool_name in (sub_name, f"{ns}__{sub_name}"):
                        return ns, sub_name
            elif tool.get("name") == self.tool_name:
                return None, self.tool_name
        return None

    def tool_outputs(self) -> list[dict[str, Any]]:
        """Every ``function_call_output`` item the client sent back, in order (repeats included).

        ``output`` is a string for shell tools and a list of ``input_text`` parts for MCP tools.
        """
        out: list[dict[str, Any]] = []
        for req in self.model_requests():
            items = (req.json or {}).get("input") or []
            out.extend(i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
        return out

    def respond(self, req: RecordedRequest) -> _Reply:
        path = req.path.split("?", 1)[0]
        if req.method == "GET" and path.rstrip("/") == "/v1/models":
            return _Reply(body=b'{"object":"list","data":[],"models":[]}')
        if req.method != "POST" or path != "/v1/responses":
            return _Reply()
        body = req.json if isinstance(req.json, dict) else {}
        n = self.next_id()
        resp_id = f"resp_fake{n:02d}"
        item: dict[str, Any]
        target = self.resolve_tool(body)
        if target is not None:
            namespace, name = target
            item = {
                "type": "function_call",
                "id": f"fc_fake{n:02d}",
                "call_id": f"call_fake{n:02d}",
                "name": name,
                "arguments": json.dumps(self.tool_input),
                "status": "completed",
            }
            if namespace:
                item["namespace"] = namespace
        else:
            item = {
                "type": "message",
                "id": f"msg_fake{n:02d}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": self.final_text, "annotations": []}],
            }
        usage = {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        }
        model = str(body.get("model") or "gpt-fake")
        base = {"id": resp_id, "object": "response", "model": model}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"type": "response.created", "response": {**base, "status": "in_progress"}}),
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
            (
                "response.completed",
                {
                    "type": "response.completed",
                    "response": {**base, "status": "completed", "output": [item], "usage": usage},
                },
            ),
        ]
        return _Reply(events=events)
