"""Pure pieces of sync: global ids, the shape of a shared memory, and who wins a conflict."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

Version = tuple[float, str]


def uuid7(now: float | None = None) -> str:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then random bits; ids sort by creation time."""
    ms = int((time.time() if now is None else now) * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))


@dataclass
class Shared:
    """One version of a memory as the server holds it (`loomd.memories`)."""

    gid: str
    team: str
    project: str
    kind: str
    scope: str
    text: str
    tags: str
    importance: float
    created_at: float
    changed_at: float
    changed_by: str
    archived_at: float | None
    superseded_by: str | None
    device: str
    person: str
    provenance: dict[str, Any] = field(default_factory=dict)
    embed_model: str | None = None
    embedding: Any = None  # a pgvector Vector (or a numpy float32 vector), or None

    @property
    def version(self) -> Version:
        return (self.changed_at, self.changed_by)


def wins(incoming: Version, current: Version) -> bool:
    """Whether an incoming version replaces the current one: the later change wins, equal times go to the greater
    device name. Deterministic: every machine and the server pick the same winner from the same two versions."""
    return incoming > current


@dataclass
class Verdict:
    """What the server did with one pushed version."""

    gid: str
    outcome: str  # 'inserted' | 'updated' | 'same' (a replay) | 'lost' (an existing newer version won)
    winner: Shared | None = None  # for 'lost': the version that stands
