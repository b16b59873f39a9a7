"""Small sync and async clients for the socket (CLI, MCP server, tests, scripts)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomd import protocol
from loomd.config import resolve_paths
from loomd.errors import DaemonNotRunning, LoomdError


class RemoteError(LoomdError):
    """An error reply from the daemon; `code` is the daemon's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def default_socket() -> Path:
    return resolve_paths().socket


def _result(reply: Any) -> Any:
    if not isinstance(reply, dict):
        raise LoomdError(f"malformed reply from the daemon: {reply!r:.200}")
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    raise RemoteError(str(error.get("code", "error")), str(error.get("message", "unknown error")))


def _not_running(path: Path, exc: OSError) -> DaemonNotRunning:
    return DaemonNotRunning(
        f"loomd is not running (no daemon on {path}: {exc.strerror or exc}). Start it with `loomd`.")


class Client:
    """Blocking client: one connection, one request at a time."""

    def __init__(self, path: Path | str | None = None, *, timeout: float = 30.0) -> None:
        self.path = Path(path) if path else default_socket()
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError as exc:
                sock.close()
                raise _not_running(self.path, exc) from exc
            self._sock = sock
        return self._sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            # Shut down first: a thread blocked in recv on this socket (`loom import`'s workers, when another
            # file's call failed) wakes with EOF; close alone leaves it waiting and the process cannot exit.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _recv_exactly(self, n: int) -> bytes:
        sock = self.connect()
        chunks: list[bytes] = []
        while n:
            chunk = sock.recv(min(n, 1 << 20))
            if not chunk:
                self.close()
                raise LoomdError("the daemon closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def call(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        rid = next(self._ids)
        frame = protocol.encode_frame({"v": protocol.VERSION, "id": rid, "op": op, "args": {**(args or {}), **kwargs}})
        self.connect().sendall(frame)
        (length,) = protocol.HEADER.unpack(self._recv_exactly(protocol.HEADER.size))
        return _result(protocol.decode_body(self._recv_exactly(length)))


def wait_until_serving(path: Path | str, within_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Ping the daemon at `path` until it answers (True), `within_s` passes or `alive()` turns false (False): a
    script that started a daemon waits for it here."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and alive():
        try:
            with Client(path, timeout=2) as client:
                client.call("ping")
            return True
        except (OSError, LoomdError):  # not listening yet, or still starting
            time.sleep(0.05)
    return False


class AsyncClient:
    """Asyncio client with pipelining: many calls in flight on one connection, matched by id."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path else default_socket()
        self._ids = itertools.count(1)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._writer is not None:
            return
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        except OSError as exc:
            raise _not_running(self.path, exc) from exc
        self._reader_task = asyncio.create_task(self._read_replies())

    async def close(self) -> None:
        if self._reader_task:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        if self._writer:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
        self._writer = None

    async def _read_replies(self) -> None:
        assert self._reader is not None
        try:
            while True:
                (length,) = protocol.HEADER.unpack(await self._reader.readexactly(protocol.HEADER.size))
                reply = protocol.decode_body(await self._reader.readexactly(length))
                rid = reply.get("id") if isinstance(reply, dict) else None
                future = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if future is not None and not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, LoomdError) as exc:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(LoomdError(f"connection to the daemon lost: {exc}"))
            self._pending.clear()

    async def call(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        await self.connect()
        assert self._writer is not None
        rid = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        self._writer.write(protocol.encode_frame(
            {"v": protocol.VERSION, "id": rid, "op": op, "args": {**(args or {}), **kwargs}}))
        await self._writer.drain()
        return _result(await future)
