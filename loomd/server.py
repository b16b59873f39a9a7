"""Unix-socket server: frames in, dispatch to `handle_<op>`, replies out. One request never kills the loop."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from loomd import protocol
from loomd.errors import FrameTooLarge, LoomdError, UnknownOp

if TYPE_CHECKING:
    from loomd.offload import SchedulingGroup

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
# Told of each request answered: the request, when its frame was cut (wall clock, seconds) and how long it took to
# answer (ms, frame cut to reply written): the daemon's own service time, apart from a client's start and connect.
Served = Callable[[protocol.Request, float, float], None]
# Health probes answer even under overload, so `loom status` can say why the daemon is busy.
PROBES = frozenset({"ping", "status"})
# Requests that do not lift the daemon's scheduling group (`Server.group`): `loom import`'s files, background work the
# daemon is asked for (held to what the machine has to spare, as the catch-up it leaves).
UNLIFTED = frozenset({"import_file"})
# How long a refused peer has to finish sending before the connection closes (see `Connection.connection_made`).
REFUSED_LINGER_S = 0.2


def peer_uid(sock: socket.socket) -> int | None:
    """The connecting process's uid (SO_PEERCRED on Linux); None where the platform cannot tell."""
    if hasattr(socket, "SO_PEERCRED"):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
        if libc.getpeereid(sock.fileno(), ctypes.byref(uid), ctypes.byref(gid)) == 0:
            return uid.value
    except (OSError, AttributeError):
        pass
    return None


class Server:
    """Accepts connections, checks the peer's uid, and serves pipelined requests on each."""

    def __init__(self, handlers: dict[str, Handler], *, max_frame: int, max_inflight: int,
                 served: Served | None = None, group: SchedulingGroup | None = None) -> None:
        self.handlers = handlers
        self.served = served
        self.group = group  # at full weight while a request runs (`SchedulingGroup.enter`), but UNLIFTED's
        self.max_frame = max_frame
        self.max_inflight = max_inflight
        self.inflight: set[asyncio.Task[None]] = set()
        self.connections: set[Connection] = set()
        self.server: asyncio.AbstractServer | None = None
        self.requests = 0
        self.refused = 0

    async def start(self, *, path: str | None = None, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self.server = await loop.create_unix_server(lambda: Connection(self), sock=sock)
        else:
            assert path is not None
            # Bind under a private umask so the socket is never briefly world-connectable, then pin 0600.
            old = os.umask(0o177)
            try:
                self.server = await loop.create_unix_server(lambda: Connection(self), path=path)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def drain(self, grace_s: float) -> int:
        """Wait for in-flight requests up to `grace_s`; cancel and count what is left (each answers
        `shutting_down`), then close every connection."""
        pending = set(self.inflight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self.connections):
            conn.close()
        return len(pending)

    async def answer(self, body: bytes, conn: Connection, began: float | None = None) -> None:
        """One request (its frame cut at perf_counter `began`): decode, dispatch to its handler, reply. Every error
        becomes an error reply."""
        now = time.perf_counter()
        began = now if began is None else began
        received = time.time() - (now - began)
        rid: Any = None
        request: protocol.Request | None = None
        lifted: SchedulingGroup | None = None  # the group this request lifted, to lower as it ends
        try:
            message = protocol.decode_body(body)
            rid = protocol.request_id(message)
            request = protocol.parse_request(message)
            self.requests += 1
            if self.group is not None and request.op not in UNLIFTED:
                lifted = self.group
                lifted.enter()
            if len(self.inflight) > self.max_inflight and request.op not in PROBES:
                reply = protocol.error_reply(rid, "busy", "too many requests in flight; retry or spool")
            else:
                handler = self.handlers.get(request.op)
                if handler is None:
                    raise UnknownOp(f"unknown op '{request.op}'; known: {', '.join(sorted(self.handlers))}")
                reply = protocol.ok_reply(rid, await handler(request.args))
        except LoomdError as exc:
            reply = protocol.error_reply(rid if rid is not None else protocol.salvage_id(body), exc.code, str(exc))
        except asyncio.CancelledError:
            conn.send(protocol.error_reply(rid, "shutting_down", "the daemon is stopping; retry shortly"))
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: one request never kills the daemon
            log.exception("internal error in a request")
            reply = protocol.error_reply(rid, "internal", f"internal error: {type(exc).__name__}")
        finally:
            if lifted is not None:
                lifted.leave()
        conn.send(reply)
        if self.served is not None and request is not None:
            self.served(request, received, (time.perf_counter() - began) * 1000)


class Connection(asyncio.Protocol):
    """One client connection: frames are cut from the bytes as they arrive (no stream reader, no await per read)
    and each request runs as a task; its reply goes straight to the transport, in whatever order they finish.

    The peer may half-close after its last request: the replies still in flight are written, then the connection
    closes. While the transport's write buffer is full (a peer that sends and never reads), reading pauses, so
    what a connection can make the daemon hold stays bounded."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()  # the start of a frame whose end has not arrived yet
        self.need = protocol.HEADER.size  # bytes `buffer` must hold before a frame can be cut from it
        self.tasks: set[asyncio.Task[None]] = set()
        self.reading = True  # False after EOF, an oversized frame or a refusal: nothing more is parsed
        self.write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the subclass
        self.server.connections.add(self)
        sock = transport.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid is not None and uid != os.getuid():
            self.server.refused += 1
            self.reading = False
            log.warning("refused a connection from uid %d: only uid %d may use this daemon", uid, os.getuid())
            self.send(protocol.error_reply(None, "forbidden", "this daemon serves only its own user"))
            # Read (and drop) what the peer sends before closing, for a moment: closing with unread data resets the
            # connection, and the peer would see a broken pipe instead of the refusal. Nothing is parsed.
            asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        if not self.reading:
            return
        buffer = self.buffer
        if buffer:
            buffer += data
            if len(buffer) < self.need:
                return
            data = bytes(buffer)
            buffer.clear()
        at, size, header = 0, len(data), protocol.HEADER.size
        while size - at >= header:
            (length,) = protocol.HEADER.unpack_from(data, at)
            try:
                protocol.check_length(length, self.server.max_frame)
            except FrameTooLarge as exc:
                # The rest of the stream cannot be trusted to re-synchronise: answer, then close.
                self.send(protocol.error_reply(None, exc.code, str(exc)))
                self._stop_reading()
                return
            end = at + header + length
            if end > size:
                self.need = header + length
                break
            self._dispatch(data[at + header:end])
            at = end
        else:
            self.need = header
        if at < size:
            buffer += memoryview(data)[at:]

    def eof_received(self) -> bool:
        if self.reading and self.buffer:
            if len(self.buffer) < protocol.HEADER.size:
                message = "truncated frame header"
            else:
                message = f"truncated frame: expected {self.need - protocol.HEADER.size} bytes"
            self.send(protocol.error_reply(None, "bad_frame", message))
        self._stop_reading()
        return True  # keep the transport open: the replies still in flight go out before it closes

    def connection_lost(self, exc: Exception | None) -> None:
        # Requests in flight run on (an event the peer sent is stored all the same); their replies go nowhere.
        self.reading = False
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.reading and self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.reading and self.transport is not None:
            self.transport.resume_reading()

    def send(self, reply: dict[str, Any]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            frame = protocol.encode_frame(reply)
        except (TypeError, ValueError) as exc:
            frame = protocol.encode_frame(
                protocol.error_reply(reply.get("id"), "internal", f"unencodable reply: {exc}"))
        transport.write(frame)

    def close(self) -> None:
        """Close once what was written has gone out (the transport flushes its buffer first)."""
        self.reading = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _dispatch(self, body: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self.server.answer(body, self, time.perf_counter()))
        self.tasks.add(task)
        self.server.inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.server.inflight.discard(task)
        if not self.reading and not self.tasks:
            self.close()

    def _stop_reading(self) -> None:
        """Parse nothing more; close as soon as the requests in flight have answered."""
        self.reading = False
        self.buffer.clear()
        if not self.tasks:
            self.close()
