"""Fusion helpers: RRF arithmetic and determinism, FTS5 query safety against a real FTS5 table, neighbour mixing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomd.errors import BadRequest
from loomd.search import fusion
from loomd.search.fusion import fts_match, query_terms, score_by_entities, weighted_rrf
from loomd.vectors.backfill import mix_vector


def fts_query(text: str) -> str:
    return fts_match(query_terms(text))

sqlite3 = pytest.importorskip("sqlean")


def blob(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unblob(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


def test_rrf_scores_and_explain() -> None:
    fused = weighted_rrf({"fts": [3, 1, 2], "vec": [1, 4]}, {"fts": 1.5, "vec": 1.0}, k=10)
    scores = {item: score for item, score, _ in fused}
    assert scores[1] == pytest.approx(1.5 / 12 + 1.0 / 11)
    assert scores[3] == pytest.approx(1.5 / 11)
    assert scores[4] == pytest.approx(1.0 / 12)
    assert [item for item, _, _ in fused] == [1, 3, 2, 4]
    explain = {item: ex for item, _, ex in fused}
    assert explain[1] == {"fts": (2, pytest.approx(1.5 / 12)), "vec": (1, pytest.approx(1.0 / 11))}
    assert explain[2] == {"fts": (3, pytest.approx(1.5 / 13))}


def test_rrf_ties_break_by_id_and_order_of_signals_does_not_matter() -> None:
    a = weighted_rrf({"x": [7, 5], "y": [5, 7]}, {"x": 1.0, "y": 1.0})
    b = weighted_rrf({"y": [5, 7], "x": [7, 5]}, {"y": 1.0, "x": 1.0})
    assert a == b
    assert [item for item, _, _ in a] == [5, 7]
    assert a[0][1] == a[1][1]


def test_rrf_edge_cases() -> None:
    assert weighted_rrf({}, {}) == []
    assert weighted_rrf({"fts": []}, {"fts": 1.0}) == []
    # weight 0 leaves a signal out entirely, also from the explanation
    fused = weighted_rrf({"fts": [1], "recency": [2, 1]}, {"fts": 1.0, "recency": 0.0})
    assert [(item, ex) for item, _, ex in fused] == [(1, {"fts": (1, pytest.approx(1 / (fusion.RRF_K + 1)))})]
    # a repeated id keeps its first rank and does not push later items down
    fused = weighted_rrf({"fts": [4, 4, 9]}, {"fts": 1.0}, k=0)
    assert [(item, score) for item, score, _ in fused] == [(4, 1.0), (9, 0.5)]
    with pytest.raises(BadRequest, match="vec"):
        weighted_rrf({"fts": [1], "vec": [1]}, {"fts": 1.0})
    with pytest.raises(BadRequest):
        weighted_rrf({"fts": [1]}, {"fts": 1.0}, k=-1)


def test_query_terms() -> None:
    assert query_terms("What did Caroline's sister say about the LGBTQ group?") == [
        "caroline",
        "sister",
        "say",
        "lgbtq",
        "group",
    ]
    assert query_terms("the and of") == []
    assert query_terms("run run RUN") == ["run"]
    assert len(query_terms(" ".join(f"w{i}" for i in range(100)))) == fusion.MAX_QUERY_TERMS


def _terms_one_by_one(text: str, stopwords: frozenset[str], limit: int | None) -> list[str]:
    """`query_terms` as its docstring defines it, word by word: what the fast one must equal."""
    terms: dict[str, None] = {}
    for word in fusion._TERM_RE.findall(text.lower()):
        term = word.strip("'")
        if term.endswith("'s"):
            term = term[:-2]
        if term and term not in stopwords and term not in terms and not (len(term) == 1 and term.isalpha()):
            terms[term] = None
            if len(terms) == limit:
                break
    return list(terms)


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(["the", "a", "x", "it's", "'s", "''", "don't", "Foo", "foo's", "run", "Running",
                                 "ÉCOLE", "ß", "İstanbul", "ΣΑΣ", "x.com", "e.g.", "8", "of", "snake_case", "'q'",
                                 " ", "\n", "'", ",", "-"]), max_size=40),
       st.sampled_from([None, 0, 1, 2, 3, 32]), st.booleans())
def test_query_terms_looks_at_each_word_once_with_the_same_terms(words: list[str], limit: int | None,
                                                                    stop: bool) -> None:
    """Each distinct word is made a term once (remembered) and a limited query stops at its limit: the same terms,
    in the same order, as splitting the text word by word."""
    text = "".join(words)
    stopwords = fusion.STOPWORDS if stop else frozenset()
    assert query_terms(text, stopwords, limit) == _terms_one_by_one(text, stopwords, limit)


def test_fts_query_quotes_every_term() -> None:
    assert fts_query("Where is loomd's socket?") == '"loomd" OR "socket"'
    assert fts_query("") == ""
    assert fts_query("is it?") == ""


@pytest.fixture
def fts_db() -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(":memory:")
    db.execute("create virtual table m_fts using fts5(text, ctx, tokenize='porter unicode61')")
    rows = [
        (1, "NOT a keyword here, just text", ""),
        (2, "the column text: value and NEAR friends", ""),
        (3, "painting sunsets with my kids", ""),
        (4, "Yes, last Tuesday! It was lovely.", "Did you go to the pottery class? Yes, last Tuesday!"),
        (5, "I bought a new pottery wheel", ""),
    ]
    db.executemany("insert into m_fts(rowid, text, ctx) values (?, ?, ?)", rows)
    yield db
    db.close()


def search(db: sqlite3.Connection, text: str) -> list[int]:
    query = fts_query(text)
    if not query:
        return []
    sql = "select rowid from m_fts where m_fts match ? order by bm25(m_fts, 1.0, ?), rowid"
    return [r for (r,) in db.execute(sql, (query, fusion.CONTEXT_WEIGHT))]


def test_user_text_is_never_fts_syntax(fts_db: sqlite3.Connection) -> None:
    for text in [
        "NOT keyword",
        "text: value",
        "NEAR(friends value)",
        'a"b" OR',
        "paint*",
        "^kids",
        "(",
        "-x +y",
        "{text}",
    ]:
        search(fts_db, text)  # must not raise a syntax error
    assert search(fts_db, "NEAR") == [2]  # NEAR is a word here, not an operator
    assert search(fts_db, "keyword NOT text") == [1, 2]
    assert search(fts_db, "painted sunset") == [3]  # porter stemming on both sides


def test_context_column_finds_the_answer_turn(fts_db: sqlite3.Connection) -> None:
    # The answer "Yes, last Tuesday!" never says "pottery": its context column (the question before it) does,
    # and at a lower weight than a memory's own words.
    assert search(fts_db, "When did she go to the pottery class?") == [4, 5]
    assert search(fts_db, "pottery wheel") == [5, 4]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_gives_a_valid_match_expression(text: str) -> None:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("create virtual table t using fts5(x)")
        db.execute("insert into t(x) values ('hello world')")
        query = fts_query(text)
        if query:
            db.execute("select rowid from t where t match ?", (query,)).fetchall()
    finally:
        db.close()


def test_mix_pulls_toward_neighbours() -> None:
    a, b = blob([1.0, 0.0]), blob([0.0, 1.0])
    mixed = unblob(mix_vector(a, [b], alpha=0.25))
    assert mixed[0] > mixed[1] > 0
    assert mix_vector(blob([0.0, 0.0]), []) == blob([0.0, 0.0])
    with pytest.raises(ValueError):
        mix_vector(a, [blob([1.0, 2.0, 3.0])])


def rank_by_entities(entities: list[str], postings: dict[str, set[int]], total: int) -> list[int]:
    return [item for item, _ in score_by_entities(entities, postings, total)]


def test_score_by_entities() -> None:
    postings = {"caroline": {1, 2, 3, 4}, "pottery": {2, 5}, "lgbtq": {3}}
    assert rank_by_entities(["pottery", "lgbtq", "pottery"], postings, total=4) == [3, 2, 5]
    assert rank_by_entities(["caroline"], postings, total=4) == []  # in every memory: no information
    assert rank_by_entities(["unknown"], postings, total=4) == []
    assert rank_by_entities(["caroline", "pottery"], postings, total=10) == [2, 5, 1, 3, 4]
