"""sqlite-vec on the stored vectors: a real daemon back-fills real local-model embeddings, then sqlite-vec's SQL
(what the vector signal's exact re-rank runs, and what a script can run on the database) is checked against the
numpy cosine over the same blobs, and against the daemon's own semantic search."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
from conftest import caught_up

from loomd.client import AsyncClient
from loomd.daemon import Daemon
from loomd.store.db import connect_sync
from loomd.vectors.index import BitIndex, Filters, IndexRow, as_matrix, sign_bits

TEXTS = [
    "pytest fails on tests/test_embed.py with ImportError: no module named onnxruntime",
    "My kid really enjoys painting the sunset on weekends.",
    "The deploy uses rsync to the staging host.",
    "Bananas are rich in potassium.",
    "We chose postgres over mysql for the billing service.",
    "The websocket reconnect test is flaky on CI again.",
    "Use ruff instead of flake8 and black in this repository.",
    "The cache lives in redis with a one hour TTL.",
    "Grandma's apple pie recipe needs cinnamon and nutmeg.",
    "Refactor the tailer so it never blocks the event loop.",
    "Our team hikes in the Alps every August.",
    "The daemon's socket lives under $XDG_RUNTIME_DIR/loomd.",
    "mypy complains about an untyped decorator in cli.py.",
    "I prefer tabs for Makefiles and spaces everywhere else.",
    "The staging database was restored from last night's backup.",
    "Learning Portuguese before the trip to Lisbon.",
]
QUERIES = ["my daughter loves art", "which database did we pick", "lint and format tools", "flaky tests",
           "holiday plans", "where is the socket"]


def sql_distances(conn: Any, column: str, query: bytes) -> list[tuple[int, float]]:
    return [(r[0], r[1]) for r in conn.execute(
        f"SELECT memory_id, vec_distance_cosine({column}, ?) AS d FROM memory_vectors ORDER BY d, memory_id",
        (query,))]


def assert_same_ranking(sql: list[tuple[int, float]], cosines: dict[int, float]) -> None:
    """The SQL order is the numpy order: cosine = 1 - distance, and any pair SQL puts in another order than numpy
    does is a tie within float32 rounding."""
    for memory_id, distance in sql:
        assert abs((1.0 - distance) - cosines[memory_id]) < 1e-5, memory_id
    numpy_order = sorted(cosines, key=lambda i: (-cosines[i], i))
    for got, want in zip((i for i, _ in sql), numpy_order, strict=True):
        assert got == want or abs(cosines[got] - cosines[want]) < 1e-5


async def test_sqlite_vec_cosine_ranks_the_stored_vectors_as_numpy_does(
    client: AsyncClient, daemon: Daemon, home: Path,
) -> None:
    for i, text in enumerate(TEXTS):
        await client.call("store", text=text, project="p", session_id=f"s{i // 4}")  # neighbours: mixed != raw
    status = await caught_up(client)
    assert status["state"] == "ready" and status["vectors"] == len(TEXTS)
    embedder = daemon.vectors.embedder
    assert embedder is not None
    conn = connect_sync(home / "loomd.db")  # what a script does: loomd's driver, sqlite-vec loaded
    try:
        rows = conn.execute("SELECT memory_id, vec, mixed, bits, raw_bits, vec_length(vec), vec_length(mixed)"
                            " FROM memory_vectors ORDER BY memory_id").fetchall()
        assert {(r[5], r[6]) for r in rows} == {(embedder.dim, embedder.dim)}
        assert any(r[1] != r[2] for r in rows)
        ids = [r[0] for r in rows]
        for column, at in (("vec", 1), ("mixed", 2)):
            blobs = as_matrix([r[at] for r in rows], embedder.dim)
            # The stored bits are sqlite-vec's own binary quantisation of the stored vectors.
            quantised = conn.execute(f"SELECT vec_quantize_binary({column}) FROM memory_vectors ORDER BY memory_id")
            assert [q[0] for q in quantised] == sign_bits(blobs) == [r[3 if column == "mixed" else 4] for r in rows]
            for query in QUERIES:
                vector = np.frombuffer(embedder.embed([query])[0], dtype="<f4")
                cosines = dict(zip(ids, (blobs @ vector).tolist(), strict=True))
                assert_same_ranking(sql_distances(conn, column, vector.tobytes()), cosines)
                # vec_f32 reads the same blob from JSON text (what a script without numpy would pass).
                as_json = conn.execute("SELECT vec_distance_cosine(vec_f32(?), ?)",
                                       (str(vector.tolist()), rows[0][at])).fetchone()[0]
                assert abs((1.0 - as_json) - cosines[ids[0]]) < 1e-5
        # The daemon's semantic search (index prefilter, then the SQL re-rank) finds the exact nearest, in order,
        # with sqlite-vec's cosines.
        for query in QUERIES:
            vector = np.frombuffer(embedder.embed([query])[0], dtype="<f4")
            exact = sql_distances(conn, "mixed", vector.tobytes())[:5]
            found = (await client.call("search", query=query, project="p", mode="semantic", limit=5,
                                       explain=True))["results"]
            assert [r["id"] for r in found] == [i for i, _ in exact], query
            for hit, (_, distance) in zip(found, exact, strict=True):
                assert abs(hit["explain"]["vec"]["score"] - (1.0 - distance)) < 1e-4
    finally:
        conn.close()


async def test_semantic_search_timings_name_the_vector_stages(client: AsyncClient) -> None:
    for text in TEXTS[:4]:
        await client.call("store", text=text, project="p")
    await caught_up(client)
    reply = await client.call("search", query="my daughter loves art", project="p", mode="semantic", explain=True)
    timings = reply["timings"]
    assert {"embed_ms", "vec_rank_ms", "vec_rerank_ms", "vec_ms"} <= set(timings)
    assert timings["vec_ms"] >= timings["vec_rerank_ms"] >= 0


def test_removed_rows_leave_the_index_and_the_rest_still_rank() -> None:
    """A deleted memory's row goes (the last row fills its hole): never a candidate again, the others still found
    with the cosines they had, and a new row reuses the room."""
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((6, 8)).astype("<f4")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)

    def row(i: int) -> IndexRow:
        bits = sign_bits(vectors[i - 1])[0]
        return IndexRow(i, vectors[i - 1].tobytes(), bits, bits, "p", "project", f"s{i}", "fact", float(i))

    index = BitIndex("m", 8)
    index.upsert(row(i) for i in range(1, 6))
    before = {i: c for i, c in zip(*index.search(vectors[0], Filters())[:2], strict=True)}
    index.remove([2, 5, 99])  # a middle row, the last one, one never indexed
    ids, cosines, eligible = index.search(vectors[0], Filters())
    assert len(index) == eligible == 3 and sorted(ids) == [1, 3, 4] and 2 not in index and 5 not in index
    assert all(abs(c - before[i]) < 1e-6 for i, c in zip(ids, cosines, strict=True))
    index.upsert([row(6)])
    assert sorted(index.search(vectors[5], Filters())[0]) == [1, 3, 4, 6] and 6 in index


def test_the_index_keeps_nothing_per_session_for_sessions_gone() -> None:
    """Sessions come and go for good: the index numbers a session by a hash of its id, so once their memories are
    removed nothing of them is left; the session filter and recurrence (neighbours in other sessions) still work."""
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((2001, 8)).astype("<f4")

    def row(i: int, session: str | None) -> IndexRow:
        bits = sign_bits(vectors[i])[0]
        return IndexRow(i, vectors[i].tobytes(), bits, bits, "p", "project", session, "fact", float(i))

    index = BitIndex("m", 8)
    index.upsert(row(i, f"gone-{i}") for i in range(1, 2001))
    index.remove(range(1, 2001))
    index.upsert([row(1, "a"), row(2, "a"), row(3, "b"), row(4, None)])
    assert len(index._codes) <= 8  # project, scope and kind names only
    assert sorted(index.search(vectors[1], Filters(session="a"))[0]) == [1, 2]
    assert index.search(vectors[1], Filters(session="gone-7"))[0] == []
    raw = index.words_of(sign_bits(vectors[1])[0])
    assert sorted(index.near_candidates([(raw, 1, "a")], 10, "p")[0]) == [3, 4]


async def test_the_back_fill_waits_while_hooks_arrive_and_catches_up_when_they_pause(client: AsyncClient) -> None:
    """Live hooks come first: while they arrive the back-fill is held (status says so) and what is stored meanwhile
    waits; once they pause, it is embedded."""
    await client.call("store", text=TEXTS[0], project="p")
    await caught_up(client)
    held = []
    for i in range(20):
        raw = json.dumps({"session_id": "burst", "cwd": "/tmp/burst", "hook_event_name": "PostToolUse",
                          "tool_name": "Bash", "tool_use_id": f"burst-{i}", "tool_input": {"command": f"make {i}"},
                          "tool_response": {"stdout": "ok", "stderr": ""}}).encode()
        await client.call("hook", raw=raw, event="PostToolUse", eid=f"burst-{i}")
        if i == 5:
            await client.call("store", text=TEXTS[1], project="p")
        held.append((await client.call("status"))["embedder"]["held"])
    assert any(held), held
    status = await caught_up(client)
    assert not status["held"] and status["vectors"] >= 2, status


async def test_a_memory_deleted_while_the_back_fill_is_held_is_not_kept_waiting_to_be_checked(
        client: AsyncClient) -> None:
    """What is deleted before the back-fill gets to it leaves its queue too: a retention that deletes while hooks
    stream must not pile ids up in the daemon for good."""
    await client.call("store", text=TEXTS[0], project="p")
    await caught_up(client)
    stored: list[int] = []
    checks: list[tuple[bool, int]] = []
    for i in range(12):
        raw = json.dumps({"session_id": "burst", "cwd": "/tmp/burst", "hook_event_name": "PostToolUse",
                          "tool_name": "Bash", "tool_use_id": f"held-{i}", "tool_input": {"command": f"make {i}"},
                          "tool_response": {"stdout": "ok", "stderr": ""}}).encode()
        await client.call("hook", raw=raw, event="PostToolUse", eid=f"held-{i}")
        if i in (2, 3, 4):
            stored.append((await client.call("store", text=TEXTS[i + 2], project="p"))["id"])
        if i == 6:
            await client.call("purge", id=stored, confirm=True)
        if i >= 7:
            embedder = (await client.call("status"))["embedder"]
            checks.append((embedder["held"], embedder["to_check"]))
    held_checks = [to_check for held, to_check in checks if held]
    assert held_checks, checks  # the back-fill really was held after the purge
    assert all(to_check == 0 for to_check in held_checks), checks


def burst_hook(i: int) -> bytes:
    return json.dumps({"session_id": "burst", "cwd": "/tmp/burst", "hook_event_name": "PostToolUse",
                       "tool_name": "Bash", "tool_use_id": f"mid-{i}", "tool_input": {"command": f"make {i}"},
                       "tool_response": {"stdout": "ok", "stderr": ""}}).encode()


async def test_a_back_fill_batch_begun_in_a_pause_waits_between_its_texts_while_hooks_arrive(
        client: AsyncClient) -> None:
    """A batch the back-fill began while no hook arrived yields to the hooks that come while it is embedded: its
    texts go to the model one at a time, each after the hooks have paused, so none of its vectors is written while
    they stream (the batch went to the model whole, and ran on through them); once they pause it is finished."""
    await client.call("store", text=TEXTS[0], project="p")
    start = await caught_up(client)
    await client.call("hook", raw=burst_hook(0), event="PostToolUse", eid="mid-0")  # held: the 8 make one batch
    for text in TEXTS[1:9]:
        await client.call("store", text=text, project="p")
    for _ in range(5000):  # until the batch is with the model
        status = await client.call("status")
        if status["offload"]["in_flight"] and not status["embedder"]["held"]:
            break
        await asyncio.sleep(0.001)
    else:
        raise AssertionError(f"the back-fill never began its batch: {status}")
    during = []
    for i in range(1, 40):  # hooks every 50 ms for about 2 s: the back-fill stays held
        await client.call("hook", raw=burst_hook(i), event="PostToolUse", eid=f"mid-{i}")
        during.append((await client.call("status"))["embedder"])
        await asyncio.sleep(0.05)
    assert all(e["embedded"] == start["embedded"] for e in during), [e["embedded"] for e in during]
    assert during[-1]["yielded"] >= 1 and during[-1]["held"], during[-1]
    done = await caught_up(client)
    assert done["embedded"] == start["embedded"] + 8 and done["vectors"] == start["vectors"] + 8, done
