"""Wire format: pure framing and message shapes, no sockets.

A frame is a 4-byte big-endian length followed by one msgpack map.
Request: ``{"v": 1, "id": N, "op": "name", "args": {...}}``.
Reply:   ``{"v": 1, "id": N, "ok": true, "result": ...}`` or
         ``{"v": 1, "id": N, "ok": false, "error": {"code": "...", "message": "..."}}``.
Several requests may be in flight on one connection; replies carry the request id.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from loomd.errors import BadRequest, BadVersion, FrameTooLarge

VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 * 1024 * 1024
# Entries of one msgpack map or list. Decoding is one C call on the event loop (about 7 ms per 20k entries): a
# bigger container is refused before it is built. Hook payloads travel as bytes and are cut, never refused.
MAX_CONTAINER = 20_000

REQUIRED = object()


@dataclass(frozen=True)
class Request:
    id: int | str | None
    op: str
    args: dict[str, Any]


# msgpack's own starting buffer is 256 KiB: in the daemon, whose malloc hands out blocks of that size as fresh
# mappings (`vectors.embed` pins the threshold), every frame mapped and unmapped one (a munmap in a threaded process
# interrupts its other CPUs). Most frames are small; a big one grows the buffer as it needs.
FRAME_BUFFER = 4096


def encode_frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True, buf_size=FRAME_BUFFER)
    return HEADER.pack(len(body)) + body


def check_length(length: int, limit: int) -> None:
    if length > limit:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {limit} bytes")


def decode_body(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, max_map_len=MAX_CONTAINER,
                               max_array_len=MAX_CONTAINER)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # TypeError: a map key msgpack cannot hash (a list or a map used as a key)
        if "exceeds max_" in str(exc):
            raise BadRequest(f"a map or list in the frame holds more than {MAX_CONTAINER} entries ({exc}); "
                             "send less per request") from exc
        raise BadRequest(f"frame body is not valid msgpack: {exc}") from exc


def salvage_id(body: bytes) -> int | str | None:
    """The request id of a frame that could not be decoded whole (an oversized map in its args, say), when the id
    comes before the damage, as every client writes it: without it the client could not match the error reply."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_map_len=MAX_CONTAINER,
                                max_array_len=MAX_CONTAINER)
    unpacker.feed(body)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                rid = unpacker.unpack()
                return rid if isinstance(rid, int | str) and not isinstance(rid, bool) else None
            unpacker.skip()
    except (ValueError, TypeError, msgpack.UnpackException):
        pass  # an unreadable header: the refusal goes out without an id, as for any undecodable frame
    return None


def request_id(message: Any) -> int | str | None:
    """The id to echo in an error reply, when one can be read at all."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int | str):
            return rid
    return None


def parse_request(message: Any) -> Request:
    if not isinstance(message, dict):
        raise BadRequest(f"a request must be a msgpack map, got {type(message).__name__}")
    version = message.get("v", VERSION)
    if version != VERSION:
        raise BadVersion(f"protocol version {version!r} is not supported; this daemon speaks v{VERSION}")
    rid = message.get("id")
    if rid is not None and not isinstance(rid, int | str):
        raise BadRequest("field 'id' must be an integer or a string")
    op = message.get("op")
    if not isinstance(op, str) or not op:
        raise BadRequest("field 'op' is missing or not a string")
    args = message.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise BadRequest(f"field 'args' must be a map, got {type(args).__name__}")
    return Request(rid, op, args)


def ok_reply(rid: int | str | None, result: Any) -> dict[str, Any]:
    return {"v": VERSION, "id": rid, "ok": True, "result": result}


def error_reply(rid: int | str | None, code: str, message: str) -> dict[str, Any]:
    return {"v": VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
               dict: "a map", bytes: "bytes"}


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


_INT64 = (-(2**63), 2**63 - 1)


def _items(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, list) else ()


ArgSpec = dict[str, tuple[type | tuple[type, ...], Any]]  # name -> (type(s), default or REQUIRED)
Handler = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def takes(spec: ArgSpec) -> Callable[[Handler], Handler]:
    """Declare an op handler's arguments: the handler gets them validated (`take_args`), and the spec stays on it
    (`handler.spec`) so the ops can be listed with their arguments."""
    def declare(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def validated(self: Any, args: dict[str, Any]) -> Any:
            return await handler(self, take_args(args, spec))

        validated.spec = spec  # type: ignore[attr-defined]
        return validated
    return declare


def take_args(args: dict[str, Any], spec: ArgSpec) -> dict[str, Any]:
    """Validate `args` against `spec` (name -> (type, default or REQUIRED)); unknown names are errors."""
    if not args.keys() <= spec.keys():
        unknown = sorted(map(repr, set(args) - set(spec)))  # keys may be of any msgpack type: never compare them
        raise BadRequest(f"unknown argument(s): {', '.join(unknown)[:300]}; expected: {', '.join(sorted(spec))}")
    out: dict[str, Any] = {}
    for name, (kind, default) in spec.items():
        value = args.get(name)
        if value is None:
            if default is REQUIRED:
                raise BadRequest(f"argument '{name}' is required ({_type_name(kind)})")
            out[name] = default
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass; never let True pass as a count, but let ints pass as floats.
        if isinstance(value, bool) and bool not in kinds:
            raise BadRequest(f"argument '{name}' must be {_type_name(kind)}, got a boolean")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise BadRequest(f"argument '{name}' must be {_type_name(kind)}, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"argument '{name}' must be a finite number, got {value}")
        # msgpack carries unsigned 64-bit integers; SQLite stores signed ones.
        if isinstance(value, int | list) and any(
                isinstance(v, int) and not _INT64[0] <= v <= _INT64[1] for v in (value, *_items(value))):
            raise BadRequest(f"argument '{name}' holds an integer outside the signed 64-bit range")
        out[name] = value
    return out
