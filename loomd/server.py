"""Unix-socket server: frames in, dispatch to `handle_<op>`, replies out. One request never kills the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from loomd import protocol
from loomd.errors import FrameTooLarge, LoomdError, UnknownOp

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
# Health probes answer even under overload, so `loom status` can say why the daemon is busy.
PROBES = frozenset({"ping", "status"})


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

    def __init__(self, handlers: dict[str, Handler], *, max_frame: int, max_inflight: int) -> None:
        self.handlers = handlers
        self.max_frame = max_frame
        self.max_inflight = max_inflight
        self.inflight: set[asyncio.Task[None]] = set()
        self.connections: set[asyncio.Task[None]] = set()
        self.server: asyncio.AbstractServer | None = None
        self.requests = 0
        self.refused = 0

    async def start(self, *, path: str | None = None, sock: socket.socket | None = None) -> None:
        if sock is not None:
            self.server = await asyncio.start_unix_server(self._on_connect, sock=sock)
        else:
            assert path is not None
            # Bind under a private umask so the socket is never briefly world-connectable, then pin 0600.
            old = os.umask(0o177)
            try:
                self.server = await asyncio.start_unix_server(self._on_connect, path=path)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def drain(self, grace_s: float) -> int:
        """Wait for in-flight requests up to `grace_s`; cancel and count what is left."""
        pending = set(self.inflight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        for conn in list(self.connections):
            conn.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        return len(pending)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            sock = writer.get_extra_info("socket")
            uid = peer_uid(sock) if sock is not None else None
            if uid is not None and uid != os.getuid():
                self.refused += 1
                log.warning("refused a connection from uid %d: only uid %d may use this daemon", uid, os.getuid())
                writer.write(protocol.encode_frame(protocol.error_reply(
                    None, "forbidden", "this daemon serves only its own user")))
                await writer.drain()
                # Read (and drop) what the peer already sent before closing: closing with unread data resets the
                # connection, and the peer would see a broken pipe instead of the refusal. Nothing is parsed.
                with contextlib.suppress(TimeoutError, ConnectionError):
                    await asyncio.wait_for(reader.read(1 << 16), 0.2)
                return
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self.connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        mine: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    header = await reader.readexactly(protocol.HEADER.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        await self._send(writer, lock, protocol.error_reply(
                            None, "bad_frame", "truncated frame header"))
                    return
                (length,) = protocol.HEADER.unpack(header)
                try:
                    protocol.check_length(length, self.max_frame)
                except FrameTooLarge as exc:
                    # The rest of the stream cannot be trusted to re-synchronise: answer, then close.
                    await self._send(writer, lock, protocol.error_reply(None, exc.code, str(exc)))
                    return
                try:
                    body = await reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    await self._send(writer, lock, protocol.error_reply(
                        None, "bad_frame", f"truncated frame: expected {length} bytes"))
                    return
                task = asyncio.create_task(self._answer(body, writer, lock))
                mine.add(task)
                self.inflight.add(task)
                task.add_done_callback(mine.discard)
                task.add_done_callback(self.inflight.discard)
        finally:
            if mine:
                await asyncio.wait(mine)

    async def _answer(self, body: bytes, writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        rid: Any = None
        try:
            message = protocol.decode_body(body)
            rid = protocol.request_id(message)
            request = protocol.parse_request(message)
            self.requests += 1
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
            reply = protocol.error_reply(rid, "shutting_down", "the daemon is stopping; retry shortly")
            await self._send(writer, lock, reply)
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: one request never kills the daemon
            log.exception("internal error in a request")
            reply = protocol.error_reply(rid, "internal", f"internal error: {type(exc).__name__}")
        await self._send(writer, lock, reply)

    async def _send(self, writer: asyncio.StreamWriter, lock: asyncio.Lock, reply: dict[str, Any]) -> None:
        try:
            frame = protocol.encode_frame(reply)
        except (TypeError, ValueError) as exc:
            frame = protocol.encode_frame(
                protocol.error_reply(reply.get("id"), "internal", f"unencodable reply: {exc}"))
        async with lock:
            if writer.is_closing():
                return
            writer.write(frame)
            try:
                await writer.drain()
            except ConnectionError:
                pass

