"""Retrieval end to end: a real daemon, the real local model, hand-made memories; each signal moves ranking the
expected way, fusion is deterministic, user text is never FTS syntax, filters hold, and a broken model is reported."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import caught_up, wait_for_socket

from loomd.client import AsyncClient, RemoteError
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.search import retrieval
from loomd.search.retrieval import memory_filters
from loomd.store.memories import insert_memory
from loomd.vectors.embed import MODEL_SHA256, default_model_path

DAY = 86400.0
NOW = 1_750_000_000.0


async def store_all(client: AsyncClient, texts: list[str], **common: Any) -> list[int]:
    ids = []
    for text in texts:
        ids.append((await client.call("store", text=text, project=common.get("project", "p"),
                                      **{k: v for k, v in common.items() if k != "project"}))["id"])
    return ids


async def search(client: AsyncClient, query: str, **args: Any) -> list[dict[str, Any]]:
    args.setdefault("project", "p")
    return (await client.call("search", query=query, explain=True, **args))["results"]


def ids_of(results: list[dict[str, Any]]) -> list[int]:
    return [r["id"] for r in results]


async def test_keyword_and_semantic_signals(client: AsyncClient) -> None:
    ids = await store_all(client, [
        "pytest fails on tests/test_embed.py with ImportError: no module named onnxruntime",
        "My kid really enjoys painting the sunset on weekends.",
        "The deploy uses rsync to the staging host.",
        "Bananas are rich in potassium.",
    ])
    status = await caught_up(client)
    assert status["state"] == "ready" and status["vectors"] == 4 and status["model"] == "all-minilm-l6-v2-int8"
    keyword = await search(client, "ImportError onnxruntime", mode="keyword")
    assert ids_of(keyword) == [ids[0]] and keyword[0]["explain"]["fts"]["rank"] == 1
    # A paraphrase with no shared word: keywords find nothing, vectors find it first.
    assert await search(client, "my daughter loves art", mode="keyword") == []
    semantic = await search(client, "my daughter loves art", mode="semantic")
    assert ids_of(semantic)[0] == ids[1] and 0.3 < semantic[0]["explain"]["vec"]["score"] <= 1.0
    hybrid = await search(client, "my daughter loves art")
    assert ids_of(hybrid)[0] == ids[1]
    first = hybrid[0]
    assert {"id", "kind", "created", "text", "tokens", "score"} <= set(first) and first["tokens"] > 0


async def test_an_identifier_in_the_question_finds_its_words_said_in_prose(client: AsyncClient) -> None:
    """"max_tokens" asked about finds "make it 5000 tokens max" (the user's words); a file name stays whole."""
    ids = await store_all(client, ["make it 5000 tokens max for both", "The vision prompt asks for JSON only.",
                                   "Edited the test of the new button props."])
    found = await search(client, "What max_tokens should the vision requests use?", mode="keyword")
    assert ids[0] in ids_of(found)
    # A name of a file is looked up as that name, not as its words ("button", "test" are everywhere in a repo).
    assert await search(client, "What was done about components/button_test.go?", mode="keyword") == []


async def test_a_lone_letter_of_the_question_is_no_term(client: AsyncClient) -> None:
    """"D-Bus" in a question is "d" and "bus" to the index; "d" alone matches every `-d` flag of a shell log."""
    ids = await store_all(client, [
        "The bridge is on port 9123.",
        "docker network create -d bridge net1 -d overlay -d macvlan; docker compose up -d; rm -d tmp",
        "The battery monitor polls every 5 seconds.", "Charge limits are set in the inverter settings.",
        "The README lists the read tools.",
    ])
    keyword = await search(client, "Which port is the D-Bus bridge on?", mode="keyword")
    assert ids_of(keyword)[0] == ids[0], keyword


async def test_turns_that_share_only_their_dates_numbers_are_not_repeats(client: AsyncClient) -> None:
    """A short turn said in the same minute as a longer one shares its date and time ("(4:05 pm on 13 March, 2024)")
    and a name; what it says of its own is two words. Numbers in common do not make two texts say the same: the
    short turn keeps its slot instead of collapsing into the longer one shown above it."""
    head = "(4:05 pm on 13 March, 2024)"
    ids = await store_all(client, [
        f"{head} Priya: Thanks, Tomas! These boots are for hiking. Been hiking longer since spring - a great way"
        " to clear my head and see the hills.",
        f"{head} Tomas: Wow! What got you into hiking?",
        "The staging deploy uses rsync over ssh.",
    ])
    await caught_up(client)
    found = ids_of(await search(client, "What is Priya's reason for getting into hiking?"))
    assert ids[0] in found and ids[1] in found, found


async def test_neighbour_column_finds_the_answer_to_a_question(client: AsyncClient) -> None:
    """'Yes, last week!' is found through the question before it (the FTS context column), not without it."""
    texts = ["Melanie: Did you finally go to the pottery class?", "Caroline: Yes, last week! I loved it.",
             "Melanie: Great, what else is new?", "Caroline: Not much, work is busy."]
    ids = []
    for i, text in enumerate(texts):
        ids.append((await client.call("store", text=text, project="p", session_id="s1", created=NOW + i))["id"])
    await store_all(client, ["Caroline: I bought new shoes."], session_id="s2", created=NOW + DAY)
    await caught_up(client)
    found = await search(client, "pottery class", mode="keyword")
    assert ids_of(found)[:2] == [ids[0], ids[1]]
    plain = await search(client, "pottery class", mode="keyword", tuning={"ctx_weight": 0.0})
    assert ids_of(plain) == [ids[0]]
    # Mixed vectors carry the neighbours too: the answer turn is closer to the query than with raw vectors.
    mixed = {r["id"]: r["explain"]["vec"]["score"] for r in await search(client, "pottery class", mode="semantic")}
    raw = {r["id"]: r["explain"]["vec"]["score"]
           for r in await search(client, "pottery class", mode="semantic", tuning={"mixed": False})}
    assert mixed[ids[1]] > raw[ids[1]]


async def test_graph_signal_follows_entities(client: AsyncClient) -> None:
    ids = await store_all(client, [
        "Changed the cache in loomd/embed.py so models load once",
        "Refactored the cache layer of the web frontend",
        "Wrote notes about caching strategies",
        "loomd/embed.py: the sha256 check reads the file once",
    ])
    await caught_up(client)
    graph = await search(client, "what happened to loomd/embed.py?", weights={"fts": 0, "vec": 0})
    assert set(ids_of(graph)) == {ids[0], ids[3]}
    assert all("graph" in r["explain"] for r in graph)
    # In the hybrid the entity lifts the memories that name it above the ones that only share words.
    with_graph = ids_of(await search(client, "cache loomd/embed.py", weights={"graph": 5}))
    assert set(with_graph[:2]) == {ids[0], ids[3]}
    timeline = await client.call("timeline", entity="loomd/embed.py", project="p")
    assert [m["id"] for m in timeline["memories"]] == [ids[0], ids[3]]


async def test_recency_prefers_newer_among_equals(client: AsyncClient) -> None:
    old = await store_all(client, ["The staging deploy uses rsync over ssh."], created=NOW - 300 * DAY)
    new = await store_all(client, ["Deploying to staging: rsync over ssh."], created=NOW - DAY)
    await caught_up(client)
    alone = await search(client, "staging deploy rsync", weights={"fts": 0, "vec": 0, "graph": 0, "recurrence": 0})
    assert ids_of(alone) == [new[0], old[0]]
    assert alone[0]["explain"]["recency"]["score"] > alone[1]["explain"]["recency"]["score"]
    heavy = ids_of(await search(client, "staging deploy rsync", weights={"recency": 10}))
    assert heavy[0] == new[0]


async def test_recurrence_prefers_what_comes_back_across_sessions(client: AsyncClient) -> None:
    once = await store_all(client, ["The integration tests need the redis container running."], session_id="a")
    again = []
    for session in ("b", "c", "d"):
        again += await store_all(client, [f"Flaky test: the websocket reconnect test times out on CI ({session})"],
                                 session_id=session)
    await caught_up(client)
    alone = await search(client, "tests", weights={"fts": 0, "vec": 0, "graph": 0, "recency": 0})
    assert set(ids_of(alone)) == set(again) and once[0] not in ids_of(alone)
    assert all(r["explain"]["recurrence"]["score"] == 2 for r in alone)  # two other sessions each
    boosted = ids_of(await search(client, "which tests are problematic", weights={"recurrence": 10}))
    assert boosted[0] in again


async def test_fusion_is_deterministic(client: AsyncClient) -> None:
    await store_all(client, [f"note {i}: the build step {i % 3} runs ruff and pytest" for i in range(30)],
                    session_id="s")
    await caught_up(client)
    first = await client.call("search", query="build step ruff", project="p", limit=30, explain=True)
    for _ in range(3):
        again = await client.call("search", query="build step ruff", project="p", limit=30, explain=True)
        assert [(r["id"], r["score"]) for r in again["results"]] == [(r["id"], r["score"]) for r in first["results"]]
    scores = [r["score"] for r in first["results"]]
    assert scores == sorted(scores, reverse=True)
    assert {"fts_ms", "embed_ms", "total_ms"} <= set(first["timings"])


@pytest.mark.parametrize("query", [
    'NOT pytest', '"unbalanced quote', 'py*', 'NEAR(pytest ruff, 2)', 'text:pytest', 'ctx:ruff OR', '{text}: x',
    "AND OR NOT", "^pytest", "pytest -ruff +x", "'); DROP TABLE memories; --", "*", '"', "(", "",
])
async def test_fts_syntax_in_user_text_is_harmless(client: AsyncClient, query: str) -> None:
    await store_all(client, ["pytest and ruff run in CI", "NOT a keyword here, near the text column"])
    for mode in ("keyword", "hybrid"):
        results = await search(client, query, mode=mode)
        assert isinstance(results, list)
    if "pytest" in query:
        assert (await search(client, query, mode="keyword"))[0]["text"] == "pytest and ruff run in CI"


async def test_filters_and_archive(client: AsyncClient, daemon: Daemon) -> None:
    a = (await client.call("store", text="alpha uses postgres", project="p", kind="decision", session_id="s1",
                           created=NOW - 10 * DAY))["id"]
    b = (await client.call("store", text="beta uses postgres", project="p", kind="fact", session_id="s2",
                           created=NOW))["id"]
    c = (await client.call("store", text="gamma uses postgres", project="q", kind="fact", created=NOW))["id"]
    u = (await client.call("store", text="I prefer postgres everywhere", scope="user", kind="preference"))["id"]
    await caught_up(client)
    for mode in ("keyword", "semantic", "hybrid"):
        found = set(ids_of(await search(client, "postgres", mode=mode)))
        assert found == {a, b, u}, mode  # user-scope memories follow the user into every project
        assert set(ids_of(await search(client, "postgres", mode=mode, kind="decision"))) == {a}
        assert set(ids_of(await search(client, "postgres", mode=mode, kind=["fact", "preference"]))) == {b, u}
        assert set(ids_of(await search(client, "postgres", mode=mode, session_id="s2"))) == {b}
        assert set(ids_of(await search(client, "postgres", mode=mode, since=NOW - DAY, scope="project"))) == {b}
        assert set(ids_of(await search(client, "postgres", mode=mode, until=NOW - DAY))) == {a}
        assert set(ids_of(await search(client, "postgres", mode=mode, project="q"))) == {c, u}
    await client.call("forget", id=b)
    for mode in ("keyword", "semantic", "hybrid"):
        assert b not in ids_of(await search(client, "postgres", mode=mode))
        archived = await search(client, "postgres", mode=mode, include_archived=True)
        assert b in ids_of(archived) and archived[ids_of(archived).index(b)]["archived_at"] is not None
    # timeline around a memory stays in its project; evidence shows source events
    around = await client.call("timeline", id=a, after=5)
    assert [m["id"] for m in around["memories"]] == [a, u] and around["memories"][0]["anchor"] is True
    around = await client.call("timeline", id=b, before=5, include_archived=True)
    assert [m["id"] for m in around["memories"]] == [a, b, u] and around["memories"][1]["anchor"] is True
    event = await client.call("ingest", item={"session_id": "s9", "kind": "UserPromptSubmit",
                                              "payload": {"prompt": "always use postgres 16 " + "x" * 900}})
    async with daemon.store.atomic() as db:
        sourced, _ = await insert_memory(db, kind="decision", text="use postgres 16", project="p",
                                         sources=event["ids"])
        await daemon.memories.derive(db, [sourced])
    shown = (await client.call("evidence", id=sourced, max_chars=100))["memories"][0]
    assert shown["events_total"] == 1 and shown["events"][0]["text"].startswith("always use postgres 16")
    assert shown["events"][0]["truncated"] is True and len(shown["events"][0]["text"]) == 100
    with pytest.raises(RemoteError) as err:
        await client.call("evidence", id=999)
    assert err.value.code == "not_found"


@pytest.mark.parametrize("args", [
    {"weights": {"bm25": 1}}, {"weights": {"fts": -1}}, {"weights": {"vec": "high"}}, {"tuning": {"rrf_k": 1.5}},
    {"tuning": {"mixed": 1}}, {"tuning": {"nope": 1}}, {"mode": "fuzzy"},
])
async def test_bad_weights_and_tuning_are_refused(client: AsyncClient, args: dict[str, Any]) -> None:
    with pytest.raises(RemoteError) as err:
        await client.call("search", query="x", **args)
    assert err.value.code == "bad_request"


async def test_stale_vectors_are_back_filled(client: AsyncClient, daemon: Daemon) -> None:
    """A changed text gets a new vector (content hash), a vector of another model is replaced."""
    (memory_id,) = await store_all(client, ["the cache lives in redis"])
    await caught_up(client)
    async with daemon.store.atomic() as db:
        await db.execute("UPDATE memories SET text = 'the cache lives in memcached', content_hash = 'changed'"
                         " WHERE id = ?", (memory_id,))
        await daemon.memories.derive(db, [memory_id])
    daemon.memories.changed()
    await caught_up(client)
    row = await daemon.store.fetchone("SELECT content_hash FROM memory_vectors WHERE memory_id = ?", (memory_id,))
    assert row is not None and row[0] == "changed"
    assert ids_of(await search(client, "memcached", mode="semantic"))[0] == memory_id


async def test_wrong_model_file_leaves_full_text_search_and_says_so(
    home: Path, sock_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "model.onnx"
    shutil.copyfile(default_model_path(), bad)
    with bad.open("r+b") as f:
        f.seek(4096)
        f.write(b"\0\0\0\0")
    monkeypatch.setenv("LOOMD_EMBED_MODEL_PATH", str(bad))
    d = Daemon(load_config())
    task = asyncio.create_task(d.serve())
    await wait_for_socket(sock_path)
    try:
        async with AsyncClient(sock_path) as client:
            await client.call("store", text="we deploy with rsync", project="p")
            status = await caught_up(client)
            assert status["state"] == "failed" and "full-text" in status["note"]
            assert f"expected {MODEL_SHA256}" in status["error"] and str(bad) in status["error"]
            assert ids_of(await search(client, "rsync"))  # keywords still work in hybrid mode
            semantic = await client.call("search", query="rsync", project="p", mode="semantic")
            assert semantic["results"] == [] and "embedder failed" in semantic["notes"][0]
            from loomd.installer.doctor import run_checks

            findings = {f.name: f for f in await asyncio.to_thread(run_checks)}
            assert findings["embedder"].status == "FAIL" and "sha256" in findings["embedder"].detail
    finally:
        d.should_exit.set()
        await asyncio.wait_for(task, 30)
    assert os.environ["LOOMD_EMBED_MODEL_PATH"] == str(bad)


async def test_restart_reads_the_index_and_replaces_vectors_of_another_model(home: Path, sock_path: Path) -> None:
    async def run(body: Any) -> Any:
        d = Daemon(load_config())
        task = asyncio.create_task(d.serve())
        await wait_for_socket(sock_path)
        try:
            async with AsyncClient(sock_path) as client:
                return await body(client)
        finally:
            d.should_exit.set()
            await asyncio.wait_for(task, 30)

    async def first(client: AsyncClient) -> list[int]:
        ids = await store_all(client, ["the cache lives in redis", "deploys go through rsync"])
        await caught_up(client)
        return ids

    ids = await run(first)
    from loomd.store.db import connect_sync

    db = connect_sync(home / "loomd.db")
    db.execute("UPDATE memory_vectors SET model = 'some-older-model' WHERE memory_id = ?", (ids[0],))
    db.close()

    async def second(client: AsyncClient) -> dict[str, Any]:
        status = await caught_up(client)
        assert ids_of(await search(client, "where is the cache kept", mode="semantic"))[0] == ids[0]
        return status

    status = await run(second)
    assert status["vectors"] == 2 and status["embedded"] == 1  # one read back from disk, one embedded afresh


async def test_filters_hold_when_other_projects_crowd_the_fast_paths(client: AsyncClient) -> None:
    """Each signal first ranks without the filters and checks the best few: when other projects (or archived
    memories) take all of those, it must still return the right ones, not fewer."""
    await store_all(client, [f"postgres postgres replication lag on loomd/db.py shard {i}" for i in range(30)],
                    project="other")
    mine = await store_all(client, ["postgres vacuum settings in loomd/db.py", "postgres upgrade plan",
                                    "postgres backups run nightly"])
    await caught_up(client)
    tight = {"candidates": 2, "prefilter": 4}
    for mode in ("keyword", "semantic"):
        found = await search(client, "postgres loomd/db.py", mode=mode, tuning=tight, limit=2)
        assert len(found) == 2 and set(ids_of(found)) <= set(mine), mode
    graph = await search(client, "postgres loomd/db.py", weights={"fts": 0, "vec": 0}, tuning=tight, limit=2)
    assert ids_of(graph) == [mine[0]]  # the only memory of this project naming loomd/db.py
    await client.call("forget", id=mine[:2])
    for mode in ("keyword", "semantic"):
        found = await search(client, "postgres", mode=mode, tuning=tight, limit=2)
        assert ids_of(found) == [mine[2]], mode


async def test_full_text_finds_the_same_hits_whichever_way_it_checks_the_filters(
    client: AsyncClient, daemon: Daemon, home: Path,
) -> None:
    """Full text checks a project's filters one of three ways: on the best 2n of the whole index (the share passing
    unknown, or most), with the ranking (few pass: a hybrid search's graph signal counted them), or, when the few that
    pass were read (`within`), on each match as the index yields it, scoring only them; and it ranks nothing in a
    project with no memories. The same hits with the same scores, every way, through the search op and called
    directly."""
    await store_all(client, [f"postgres replication note {i}" for i in range(40)], project="other")
    mine = await store_all(client, ["postgres vacuum settings in loomd/db.py", "vacuum postgres nightly (loomd/db.py)",
                                    "postgres vacuum full on loomd/db.py, then vacuum analyze",
                                    "loomd/db.py: postgres autovacuum off, vacuum by hand"])
    await caught_up(client)
    where, params = memory_filters("p", None, None, None, None, None, False)
    ctx = daemon.retrieval_context()
    tight, query = {"candidates": 3}, "postgres vacuum loomd/db.py"
    retrieval._TOTALS.clear()
    assert retrieval._counted(ctx, where, params) is None
    first = await search(client, query, mode="keyword", tuning=tight, limit=3)  # the project's 4, read first
    await search(client, query, tuning=tight, limit=3)  # hybrid: the graph signal counts the project's memories
    counted, indexed = retrieval._counted(ctx, where, params), retrieval._counted(ctx, "1", [])
    assert counted == 4 and indexed == 44
    then = await search(client, query, mode="keyword", tuning=tight, limit=3)
    assert len(first) == 3 and set(ids_of(first)) <= set(mine)
    assert [(r["id"], r["explain"]["fts"]) for r in then] == [(r["id"], r["explain"]["fts"]) for r in first]

    from loomd.store.db import connect_sync

    db = connect_sync(home / "loomd.db")
    try:
        knobs = retrieval.resolve_tuning(None)

        terms = retrieval.fts_terms(db, query, knobs["fts_budget"], 44)

        def ranked(**how: Any) -> list[tuple[int, float]]:
            return retrieval.fts_signal(db, terms, where, params, 3, knobs["ctx_weight"], 44, **how)

        statements: list[str] = []
        db.set_trace_callback(statements.append)
        among = ranked(within=mine)
        db.set_trace_callback(None)
        # Ids no memory has in the list change nothing: only matches are checked against it.
        ways = {"best 2n, then with the filters": ranked(), "with the filters": ranked(passing=4),
                "among the few": among, "among the few and others": ranked(within=[*mine, *range(10**6, 10**6 + 50)])}
        assert len(among) == 3 and {i for i, _ in among} <= set(mine)
        assert all(found == among for found in ways.values()), ways
        # The few are a filter on the matches, not a lookup of each in the index (FTS5's plan says "=" for that).
        scored = next(sql for sql in statements if "MATCH" in sql)
        plan = [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + scored)]
        assert any(step.startswith("SCAN memories_fts VIRTUAL TABLE INDEX 0:M") for step in plan), plan
        assert ranked(within=[]) == []
    finally:
        db.close()


async def test_a_project_with_no_memories_yet_finds_its_first_at_once(client: AsyncClient, daemon: Daemon) -> None:
    """A search first reads its project's memories when it holds few, by index (the project's, and m013's for the
    user-scope ones), never remembered: none yet means no hits, not a stale answer once the first arrives, and
    user-scope memories still follow the user into it. The project filter itself stays out of the indexes: a list of
    ids checked against it is looked up id by id, not by reading the project."""
    await store_all(client, [f"the flaky websocket test, try {i}" for i in range(10)], project="other")
    await caught_up(client)
    seen: list[str] = []
    await daemon.store.reader._execute(daemon.store.reader._conn.set_trace_callback, seen.append)
    try:
        assert await search(client, "flaky websocket test", mode="keyword", project="new") == []
    finally:
        await daemon.store.reader._execute(daemon.store.reader._conn.set_trace_callback, None)
    reads = [sql for sql in seen if sql.startswith("SELECT m.id") and ("WHERE m.project = " in sql
                                                                      or "WHERE m.scope = 'user'" in sql)]
    assert len(reads) == 2, seen
    plans = [[r[3] for r in await daemon.store.fetchall("EXPLAIN QUERY PLAN " + sql)] for sql in reads]
    assert not any(step.startswith("SCAN") for plan in plans for step in plan), plans
    assert any("memories_user_scope" in step for step in plans[1]), plans
    where, params = memory_filters("new", None, None, None, None, None, False)
    listed = [r[3] for r in await daemon.store.fetchall(
        f"EXPLAIN QUERY PLAN SELECT m.id FROM memories m WHERE m.id IN (SELECT value FROM json_each(?)) AND {where}",
        ["[1, 2]", *params])]
    assert any("INTEGER PRIMARY KEY" in step for step in listed) and not any("OR" in step for step in listed), listed
    ids = await store_all(client, ["the websocket test is flaky under load"], project="new")
    assert ids_of(await search(client, "flaky websocket test", mode="keyword", project="new")) == ids
    # The other filters hold on what is read (a time range is in no index with the project).
    assert await search(client, "flaky websocket test", mode="keyword", project="new", since=4e9) == []
    user = (await client.call("store", text="flaky tests get a retry, never a skip", scope="user"))["id"]
    assert set(ids_of(await search(client, "flaky websocket test", mode="keyword", project="new"))) == {*ids, user}


async def test_a_project_holding_more_than_the_query_matches_is_counted_by_index_and_ranked_with_its_filters(
    client: AsyncClient, daemon: Daemon, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A project found holding more than FEW_PASSING memories has its rows counted by index, up to half the index.
    While it holds no more than the query matches in the whole index, it is read all the same (scoring its matches
    among them costs less than ranking every match with the filters). Holding more, it is not read: full text then
    knows few of the index pass, and ranks with the filters at once. The same hits every way."""
    mine = await store_all(client, [f"the nightly vacuum of postgres took {i} minutes" for i in range(5)])
    await store_all(client, [f"postgres vacuum note {i}" for i in range(20)], project="other")
    await caught_up(client)
    query, ctx = "postgres vacuum minutes", daemon.retrieval_context()

    async def statements(few: int) -> tuple[list[Any], list[str], list[str]]:
        """The hits, the statements of a first search (which finds how many memories the project holds), and those
        of a second."""
        monkeypatch.setattr(retrieval, "FEW_PASSING", few)
        retrieval._MANY.clear()
        retrieval._TOTALS.clear()
        seen: list[list[str]] = [[], []]
        for statements in seen:
            await daemon.store.reader._execute(daemon.store.reader._conn.set_trace_callback, statements.append)
            try:
                found = await search(client, query, mode="keyword", tuning={"candidates": 3}, limit=3)
            finally:
                await daemon.store.reader._execute(daemon.store.reader._conn.set_trace_callback, None)
        return [(r["id"], r["explain"]["fts"]) for r in found], *seen

    # 5 memories, more than FEW_PASSING, fewer than the 25 the query matches: read, and only their matches scored.
    # (The first search found it holding more than FEW_PASSING: ranked with the filters, and the project counted.)
    read_first, _, _ = await statements(10**6)
    found, counting, few = await statements(3)
    assert found == read_first and {i for i, _ in found} <= set(mine)
    assert any("LIMIT" in sql and "count(*)" in sql for sql in counting), counting
    assert any("MATCH" in sql and "+rowid IN" in sql for sql in few), few
    assert not any("LIMIT" in sql and "count(*)" in sql for sql in few), few
    # 65, more than the query matches (at most 55, its terms' counts summed), under half of the 165 indexed.
    await store_all(client, [f"the build cache of run {i} lives under .cache" for i in range(60)])
    await store_all(client, [f"deploy step {i} pushes the image" for i in range(80)], project="other")
    await caught_up(client)
    read_first, _, _ = await statements(10**6)
    found, counting, counts = await statements(3)
    assert found == read_first and {i for i, _ in found} <= set(mine)
    where, params = memory_filters("p", None, None, None, None, None, False)
    assert retrieval._many_passing(ctx, where, params) == 65
    count = next(sql for sql in counting if "LIMIT" in sql and "count(*)" in sql)
    plan = [r[3] for r in await daemon.store.fetchall("EXPLAIN QUERY PLAN " + count)]
    assert not any(step.startswith("SCAN m") for step in plan), plan  # the memories themselves are not read
    assert sum("USING COVERING INDEX" in step for step in plan) == 2, plan
    # Ranked with the filters (under half the index passes), not the best 2n of the whole index first.
    assert not any("EXISTS (SELECT 1 FROM memories m WHERE m.id = r.id" in sql for sql in counts), counts
    assert not any("+rowid IN" in sql for sql in counts), counts


async def test_a_search_stops_at_the_last_hit_its_caller_may_show(client: AsyncClient, daemon: Daemon) -> None:
    """`shows` (a prompt's keyword recall: only its best few keyword hits may be shown) cuts the hits after the last
    one the caller may show: none past it is windowed or returned, and those before it are shown as without it."""
    await store_all(client, [f"the flaky websocket test failed on CI again, run {i}: {word}" for i, word in
                             enumerate(["timeout", "reconnect", "ECONNRESET", "port in use", "slow runner",
                                        "retry", "flaky", "deadline"])])
    await caught_up(client)
    args: dict[str, Any] = {"query": "websocket test failed on CI timeout reconnect", "limit": 12, "project": "p",
                            "weights": {"vec": 0, "graph": 0}}
    ctx = daemon.retrieval_context()
    whole = await retrieval.search_hits(ctx, **args)

    def best_two(hit: retrieval.Hit) -> bool:
        return hit.signals["fts"].rank <= 2

    cut = await retrieval.search_hits(ctx, **args, shows=best_two)
    last = max(i for i, hit in enumerate(whole) if best_two(hit))
    assert last + 1 < len(whole) == 8, [(h.memory["id"], h.signals["fts"].rank) for h in whole]
    assert [(h.memory["id"], h.memory["text"]) for h in cut] == [(h.memory["id"], h.memory["text"])
                                                                  for h in whole[: last + 1]]
    assert await retrieval.search_hits(ctx, **args, shows=lambda hit: False) == []


async def test_recurrence_follows_a_changed_text(client: AsyncClient, daemon: Daemon) -> None:
    ids = []
    for session in ("a", "b", "c"):
        ids += await store_all(client, [f"The websocket reconnect test is flaky on CI again ({session})"],
                               session_id=session)
    await caught_up(client)

    async def recurrence() -> list[int]:
        rows = await daemon.store.fetchall(
            "SELECT memory_id, recurrence FROM memory_vectors ORDER BY memory_id")
        return [r[1] for r in rows]

    assert await recurrence() == [2, 2, 2]
    async with daemon.store.atomic() as db:
        await db.execute("UPDATE memories SET text = 'Bananas are rich in potassium.', content_hash = 'x'"
                         " WHERE id = ?", (ids[0],))
        await daemon.memories.derive(db, [ids[0]])
    daemon.memories.changed()
    await caught_up(client)
    assert await recurrence() == [0, 1, 1]
    assert not await daemon.store.fetchall("SELECT 1 FROM memory_near WHERE ? IN (a, b)", (ids[0],))
