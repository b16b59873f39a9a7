"""Parse, clean and redact incoming events off the event loop, so no payload stalls the other clients.

A small hook payload is parsed on the loop (a thread hop would cost more than the work): one of at most INLINE_BYTES
holding at most INLINE_NODES values (`value_bound`). A larger one goes to a thread: cleaning and redaction are
Python, and the interpreter hands the GIL back to the loop every switch interval (`daemon.GIL_SWITCH_INTERVAL_S`).
But `json.loads` is one C call that keeps the GIL until the whole document is built (about 70 ms for 200k keys), so
a payload that may hold more than THREAD_NODES values is parsed in a child process (the daemon's offload process,
`loomd.offload`, on a lane of its own), which sends back only the event as cut to `events.MAX_NODES` values: the loop
never waits on the big parse.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from loomd.errors import BadRequest, ChildDied
from loomd.ingest.events import INGEST_ARGS, MAX_BATCH, Event, parse_hook, parse_normalised, sent_at
from loomd.offload import Offload
from loomd.protocol import take_args

log = logging.getLogger(__name__)

# Parsed where it arrives: the parse's cost is about 1 us a value (the payload's walk) plus the text's redaction, and
# under these bounds it stays under the interpreter's switch interval (0.5 ms), the finest a thread could interleave
# it with the loop anyway. The shared real hook payloads: 133 of 135 within them, each parsed in 0.3 ms at most (up
# to 56 KB: the output is cut to `max_tool_output_chars`). A payload of 1,000 small values takes 1.1 ms. At 4 KB
# alone, half of the PostToolUse payloads took a thread hop, which under a catch-up cost more than their parse.
INLINE_BYTES = 64 << 10
INLINE_NODES = 400
# Values a hook payload may hold before its JSON parse leaves the process: json.loads of this many takes ~1 ms.
THREAD_NODES = 20_000


def value_bound(raw: bytes | str) -> int:
    """An upper bound on the JSON values in `raw`: every value but the first follows a ',' a ':' or a '['.

    C-speed (about 1 ms per 3 MB); separators inside strings count too, which only errs towards the safe side.
    """
    if isinstance(raw, str):
        return raw.count(",") + raw.count(":") + raw.count("[") + 1
    return raw.count(b",") + raw.count(b":") + raw.count(b"[") + 1


class EventParser:
    """Turns hook bytes and `ingest` arguments into Events off the loop; big payloads go to the offload process."""

    def __init__(self, offload: Offload | None = None) -> None:
        self.offload = offload  # None: every payload is parsed in this process (a thread at most)
        self.in_process = 0  # payloads parsed in the child, for status

    async def hook(self, agent: str, event_name: str, raw: bytes | str, eid: str | None, *, max_chars: int,
                   now: float | None = None) -> Event:
        """`events.parse_hook`, on the loop, a thread or the child process depending on the payload's size."""
        if len(raw) <= INLINE_BYTES and value_bound(raw) <= INLINE_NODES:
            return parse_hook(agent, event_name, raw, eid, max_chars=max_chars, now=now)
        parsed = await asyncio.to_thread(_parse_unless_big, agent, event_name, raw, eid, max_chars, now,
                                         self.offload is not None)
        if parsed is not None:
            return parsed
        assert self.offload is not None
        self.in_process += 1
        try:
            return await self.offload.call("parse", parse_child, agent, event_name, raw, eid, max_chars, now)
        except ChildDied:
            log.error("the offload process died on a %d-byte hook payload", len(raw))
            raise BadRequest(f"the {len(raw)}-byte hook payload could not be parsed: the parser process died") from None

    async def events_from_args(self, args: dict[str, Any], *, max_chars: int) -> list[Event]:
        """The `ingest` op's arguments (also what the spool holds): raw hook bytes plus agent and event name, one
        normalised `item`, or a list of `events`."""
        a = take_args(args, INGEST_ARGS)
        if a["events"] is not None and len(a["events"]) > MAX_BATCH:
            raise BadRequest(f"a batch holds at most {MAX_BATCH} events, got {len(a['events'])}")
        events: list[Event] = []
        if a["raw"] is not None:
            events.append(await self.hook(a["agent"], a["event"], a["raw"], a["eid"], max_chars=max_chars,
                                          now=sent_at(a["sent_at"])))
        items = ([a["item"]] if a["item"] is not None else []) + list(a["events"] or [])
        if items:
            # Already decoded (msgpack); cleaning and redaction are Python, which a thread interleaves with the loop.
            events.extend(await asyncio.to_thread(lambda: [parse_normalised(i, max_chars=max_chars) for i in items]))
        if not events:
            raise BadRequest("ingest needs 'raw' (hook bytes), 'item' (one event) or 'events' (a list)")
        return events


def parse_child(agent: str, event_name: str, raw: bytes | str, eid: str | None, max_chars: int,
                now: float | None) -> Event:
    """In the offload process: `parse_hook` with its keyword arguments (a call there passes positional ones)."""
    return parse_hook(agent, event_name, raw, eid, max_chars=max_chars, now=now)


def _parse_unless_big(agent: str, event_name: str, raw: bytes | str, eid: str | None, max_chars: int,
                      now: float | None, child: bool) -> Event | None:
    """In a thread: the event, or None when the payload may hold too many values to parse in this process (and a
    child process can)."""
    if child and value_bound(raw) > THREAD_NODES:
        return None
    return parse_hook(agent, event_name, raw, eid, max_chars=max_chars, now=now)
