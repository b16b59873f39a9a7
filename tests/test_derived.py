"""What is derived from a memory's text (loomd/store/derived.py) is one state whatever the batching.

Real sessions (shared transcripts and LoCoMo turns) are written three ways into three stores: one memory per
transaction (a worker, the `store` op), in small batches, and in batches of 500 (an import, bench/search.py). Each
store must end with the same entities, mention counts, edges and weights, the same `ctx` text and the same
full-text index, token for token.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loomd.ingest.transcript import parse_file
from loomd.store.db import Store
from loomd.store.derived import mentioned
from loomd.store.memories import MemoryWriter, insert_memory
from tests.conftest import need_test_data

TRANSCRIPTS = ("kvsankar-agent-history", "pookNast-loopkit", "daniifrim-10-box-os")


@dataclass(frozen=True)
class Write:
    kind: str
    text: str
    project: str
    session_id: str | None
    created: float
    context: str = ""


def transcript_writes(per_session: int = 120) -> list[Write]:
    """The first text items of a few real sessions, one session each, in transcript order."""
    out: list[Write] = []
    for name in TRANSCRIPTS:
        root = need_test_data("transcripts", name)
        path = next(p for p in sorted(root.rglob("*")) if p.suffix == ".jsonl" or p.name == "chat.json")
        items = [i for i in parse_file(path) if len(i.text.strip()) >= 20][:per_session]
        out += [Write("observation", " ".join(i.text.split())[:400], "code", name, 1_700_000_000.0 + n * 60)
                for n, i in enumerate(items)]
    return out


def locomo_writes(turns: int = 200) -> list[Write]:
    """LoCoMo conversation 0's first turns, its sessions as sessions (names that co-occur, short replies)."""
    conv = json.loads(need_test_data("locomo-dev.json").read_text())[0]["conversation"]
    out: list[Write] = []
    numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
    for n in numbers:
        for t in conv[f"session_{n}"]:
            out.append(Write("observation", f"{t['speaker']}: {t['text']}", "chat", f"locomo:s{n}",
                             1_600_000_000.0 + len(out) * 60))
    return out[:turns]


def mixed_writes() -> list[Write]:
    """Both sources interleaved across sessions, plus what the write path must also keep straight: memories that
    arrive late (older than their session's newest), the same text again (a duplicate bumps the first), evidence
    passages (their own ctx, and no distilled memory's neighbour), memories without a session."""
    code, chat = transcript_writes(), locomo_writes()
    out: list[Write] = []
    for i in range(max(len(code), len(chat))):
        out += [w for w in (code[i] if i < len(code) else None, chat[i] if i < len(chat) else None) if w]
    for i in range(0, len(out), 9):  # late: placed between two memories already written in its session
        w = out[i]
        out.append(Write("decision", f"late note on: {w.text[:80]}", w.project, w.session_id, w.created + 30))
    for i in range(3, len(out), 17):
        out.append(out[i])  # seen again
    for i in range(0, len(code), 11):
        w = code[i]
        out.append(Write("evidence", f"Bash `pytest -q`: {w.text[:200]}", w.project, w.session_id, w.created + 10,
                         context=f"User: {w.text[:60]}"))
    for i in range(5, len(chat), 23):
        out.append(Write("fact", chat[i].text, "chat", None, chat[i].created))
    return out


async def write_all(store: Store, writes: list[Write], batch: int, given: bool = False) -> None:
    """`given`: each batch's entities worked out before its transaction, as the observer's offload process does."""
    memories = MemoryWriter(store)
    for start in range(0, len(writes), batch):
        chunk = writes[start : start + batch]
        names = {w.text: mentioned(w.text) for w in chunk} if given else None
        async with memories.atomic() as db:
            ids = []
            for w in chunk:
                memory_id, _ = await insert_memory(db, kind=w.kind, text=w.text, project=w.project,
                                                   session_id=w.session_id, created=w.created, context=w.context)
                ids.append(memory_id)
            await memories.derive(db, ids, names)


def derived_state(path: Path) -> dict[str, Any]:
    """Everything derived, with wall-clock columns (`updated`, edges' `created`) left out."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("INSERT INTO memories_fts(memories_fts) VALUES ('integrity-check')").rowcount is not None
        conn.execute("CREATE VIRTUAL TABLE temp.tokens USING fts5vocab(main, memories_fts, 'instance')")
        return {
            "memories": conn.execute("SELECT id, kind, text, session_id, hits, ctx FROM memories ORDER BY id")
            .fetchall(),
            "entities": conn.execute("SELECT id, project, name, kind, mentions FROM entities ORDER BY id").fetchall(),
            "edges": conn.execute("SELECT src_type, src_id, dst_type, dst_id, type, weight FROM edges"
                                  " ORDER BY src_type, src_id, dst_type, dst_id, type").fetchall(),
            "fts": conn.execute("SELECT term, doc, col, offset FROM temp.tokens ORDER BY doc, col, offset").fetchall(),
        }
    finally:
        conn.close()


async def test_same_derived_state_one_at_a_time_and_in_batches(tmp_path: Path) -> None:
    """...and with the entities worked out before the transaction (the observer's, in the offload process)."""
    writes = mixed_writes()
    states = []
    for batch, given in ((1, False), (7, False), (500, False), (500, True)):
        store = await Store.open(tmp_path / f"b{batch}{given}.db")
        try:
            await write_all(store, writes, batch, given)
        finally:
            await store.close()
        states.append(derived_state(tmp_path / f"b{batch}{given}.db"))
    one, small, large, given_state = states
    # The data exercised what it is meant to: sessions with neighbours, a graph with weights above one.
    assert sum(1 for m in one["memories"] if m[5]) > 400
    assert any(e[4] == "co_occurs" and e[5] > 1 for e in one["edges"])
    assert any(m[4] > 0 for m in one["memories"])  # duplicates were bumped
    for name in one:
        assert small[name] == one[name], name
        assert large[name] == one[name], name
        assert given_state[name] == one[name], name


async def test_ctx_is_the_neighbours_text_in_time_order(store: Store) -> None:
    """Written out of order, a session's memories still get their time-order neighbours; evidence and other
    sessions are no one's neighbours."""
    writes = [Write("observation", f"turn {c} says {word}", "p", "s", float(t))
              for c, t, word in (("c", 3, "gamma"), ("a", 1, "alpha"), ("e", 5, "epsilon"), ("b", 2, "beta"),
                                 ("d", 4, "delta"))]
    writes += [Write("evidence", "User: a passage in between", "p", "s", 2.5, context="its own"),
               Write("observation", "turn x in another session", "p", "t", 2.6)]
    await write_all(store, writes, 3)
    rows = dict(await store.fetchall("SELECT text, ctx FROM memories"))
    assert rows["turn a says alpha"] == "turn b says beta turn c says gamma"
    assert rows["turn c says gamma"] == "turn a says alpha turn b says beta turn d says delta turn e says epsilon"
    assert rows["turn e says epsilon"] == "turn c says gamma turn d says delta"
    assert rows["User: a passage in between"] == "its own"
    assert rows["turn x in another session"] == ""


@pytest.mark.parametrize("batch", [1, 40])
async def test_ctx_is_rewritten_once_per_batch(store: Store, batch: int) -> None:
    """A `ctx` change rewrites the row's whole FTS5 entry (delete and insert, `memories_au`): a batch in time order
    rewrites each memory's at most once, and one memory at a time rewrites at most its own and two neighbours'."""
    writes = [Write("observation", f"step {i}: ran the test suite for module_{i} in src/m{i}.py", "p", "s",
                    float(i + 1)) for i in range(40)]
    # A temporary trigger on the writer connection counts the rewrites: the store's schema is left as it is.
    await store.writer.execute("CREATE TEMP TABLE ctx_writes (id INTEGER)")
    await store.writer.execute("CREATE TEMP TRIGGER count_ctx_writes AFTER UPDATE OF ctx ON main.memories"
                               " BEGIN INSERT INTO ctx_writes VALUES (new.id); END")
    await write_all(store, writes, batch)
    per_row = await store.writer.execute_fetchall("SELECT id, count(*) FROM ctx_writes GROUP BY id")
    per_txn = await store.writer.execute_fetchall("SELECT count(*) FROM ctx_writes")
    assert per_row, "no ctx was written"
    if batch == len(writes):
        assert max(n for _, n in per_row) == 1
    else:
        assert per_txn[0][0] <= 3 * len(writes)


async def test_duplicate_lookup_searches_the_content_hash(store: Store) -> None:
    """The duplicate check reads one index entry, not every memory of the project and kind (which made every
    insert slower as the store grew): its query plan searches `memories_hash` by the content hash."""
    seen: list[str] = []
    await store.writer._execute(store.writer._conn.set_trace_callback, seen.append)
    async with store.atomic() as db:
        await insert_memory(db, kind="fact", text="the cache lives in ~/.cache/loomd", project="p")
    await store.writer._execute(store.writer._conn.set_trace_callback, None)
    lookup = next(s for s in seen if "content_hash = " in s)
    plan = " ".join(r[3] for r in await store.writer.execute_fetchall("EXPLAIN QUERY PLAN " + lookup))
    assert "memories_hash" in plan and "content_hash=?" in plan, plan


async def test_a_batch_reads_a_fixed_number_of_times(store: Store) -> None:
    """Deriving a batch reads the store a few times per batch (the rows, the entities of each project, the known
    mentions, one span per session), not a few times per memory: each read is a trip to the writer's thread."""
    writes = [Write("observation", f"Caroline asked about step_{i} of src/app{i % 5}.py", "p", f"s{i % 4}",
                    float(i + 1)) for i in range(200)]
    memories = MemoryWriter(store)
    async with memories.atomic() as db:
        ids = [(await insert_memory(db, kind=w.kind, text=w.text, project=w.project, session_id=w.session_id,
                                    created=w.created))[0] for w in writes]
        seen: list[str] = []
        await db._execute(db._conn.set_trace_callback, seen.append)
        try:
            await memories.derive(db, ids)
        finally:
            await db._execute(db._conn.set_trace_callback, None)
    reads = [s for s in seen if s.lstrip().upper().startswith("SELECT")]
    assert len(reads) <= 3 + 4, reads[:10]
