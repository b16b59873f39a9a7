"""Pure pieces of hybrid search: query terms, the FTS5 match expression, weighted reciprocal rank fusion.

The defaults here are the recipe measured on LoCoMo (bench/ and the closing note of the retrieval issue):
BM25 over a memory's own text plus a down-weighted column holding its session neighbours' text, fused with
vector KNN over neighbour-mixed vectors, by weighted RRF with a small k.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Collection, Mapping, Sequence

from loomd.errors import BadRequest

# Weighted RRF: score(d) = sum over signals s of weights[s] / (k + rank_s(d)), rank from 1.
# A small k lets the first few ranks of each list dominate; 60 (the paper's default) flattened LoCoMo's top 10.
RRF_K = 15
# fts and vec carry LoCoMo; graph, recency and recurrence were neutral there (within 0.005 of R@k either way)
# and stay light so that identifiers, paths and fresh work can tip close calls on coding sessions.
# recency and recurrence only reorder the candidates the other signals found: alone they would push the same
# items into every answer.
DEFAULT_WEIGHTS: dict[str, float] = {"fts": 1.5, "vec": 1.0, "graph": 0.25, "recency": 0.1, "recurrence": 0.1}
# How many candidates each signal should hand to the fusion (more costs time, fewer costs recall@50).
CANDIDATES = 100
# FTS5 `bm25(memories_fts, 1.0, CONTEXT_WEIGHT)`: the neighbours' text (store/derived.py) counts, at less than
# the memory's own.
CONTEXT_WEIGHT = 0.3
MAX_QUERY_TERMS = 32

STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are aren't as at be because been before being below between
    both but by can can't cannot could couldn't did didn't do does doesn't doing don't down during each few for from
    further had hadn't has hasn't have haven't having he he'd he'll he's her here here's hers herself him himself his
    how how's i i'd i'll i'm i've if in into is isn't it it's its itself let's me more most mustn't my myself no nor
    not of off on once only or other ought our ours ourselves out over own same shan't she she'd she'll she's should
    shouldn't so some such than that that's the their theirs them themselves then there there's these they they'd
    they'll they're they've this those through to too under until up very was wasn't we we'd we'll we're we've were
    weren't what what's when when's where where's which while who who's whom why why's with won't would wouldn't you
    you'd you'll you're you've your yours yourself yourselves
    """.split()
)
_TERM_RE = re.compile(r"[\w']+")

Explain = dict[str, tuple[int, float]]


def query_terms(text: str, stopwords: frozenset[str] = STOPWORDS, limit: int | None = MAX_QUERY_TERMS) -> list[str]:
    """Lower-cased non-stopword terms of `text`, first occurrence order, possessive 's dropped, at most `limit`.

    A lone letter is no term: it is a piece of a word ("e.g.", "D-Bus", "x.com"), and code is full of them (`e`, `x`,
    `-d`), so it matches noise (coding QA dev set: venus-06 7 -> 5; a digit stays, "port 8 of 10").

    Each distinct word is looked at once (`_term`, remembered): a passage says the same words many times, and this
    ran for every hit of a prompt's recall, up to half of its time on the hook path."""
    lowered = text.lower()
    if limit is None or limit <= 0:
        words = dict.fromkeys(_TERM_RE.findall(lowered))  # first occurrence order, as the terms they make
        return list(dict.fromkeys(filter(None, map(_term, words, itertools.repeat(stopwords)))))
    terms: dict[str, None] = {}
    for match in _TERM_RE.finditer(lowered):  # up to the limit: a long text is not split to its end
        term = _term(match.group(), stopwords)
        if term and term not in terms:
            terms[term] = None
            if len(terms) == limit:
                break
    return list(terms)


@functools.lru_cache(maxsize=4096)  # the words of a recall's hits; more would only hold memory (RSS is bounded)
def _term(word: str, stopwords: frozenset[str]) -> str:
    """The term a word of `_TERM_RE` makes, or "" (a stopword, a lone letter)."""
    term = word.strip("'")
    if term.endswith("'s"):
        term = term[:-2]
    return "" if term in stopwords or (len(term) == 1 and term.isalpha()) else term


@functools.lru_cache(maxsize=1024)
def text_terms(text: str) -> frozenset[str]:
    """The set of `query_terms(text, limit=None)`, remembered for the texts seen last: the repeat checks of a search
    compare every hit shown (~20 µs a text to split), and the same memories come back across queries. Its words
    (`text_words`) less the stopwords: a word makes the same term with or without them, or none."""
    return text_words(text) - STOPWORDS


@functools.lru_cache(maxsize=1024)  # a recall's hits and the lines it is choosing among (~600): it keeps them alive
def text_words(text: str) -> frozenset[str]:
    """Every word of `text` (`query_terms` without stopwords), remembered for the texts seen last: a prompt's recall
    asks `held_terms` of the same hit and line texts several times (its windows, `_prestem`, `echoes`, `relevant`),
    and splitting a passage was up to half of that recall's time on the hook path. (At 128 texts, the lines `_prestem`
    split were gone before the windows asked of them: splitting was a quarter of a recall over a caught-up store.)"""
    # `query_terms(text, frozenset(), limit=None)` as a set: no order to keep (a third of the time, on every line of a
    # recall's windows the first time it sees them).
    return frozenset(filter(None, map(_term, set(_TERM_RE.findall(text.lower())), itertools.repeat(_NO_STOPWORDS))))


_NO_STOPWORDS: frozenset[str] = frozenset()


def fts_match(terms: Sequence[str]) -> str:
    """An FTS5 MATCH expression: the OR of the terms, each quoted, so user text is never syntax ("" for none)."""
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def weighted_rrf(
    rankings: Mapping[str, Sequence[int]], weights: Mapping[str, float], k: int = RRF_K
) -> list[tuple[int, float, Explain]]:
    """Fuse ranked id lists: (id, score, {signal: (rank, contribution)}), best first, equal scores by id.

    Every signal in `rankings` needs a weight; a weight of 0 leaves it out. A repeated id keeps its first rank.
    """
    if k < 0:
        raise BadRequest(f"rrf k must be >= 0, got {k}")
    missing = sorted(set(rankings) - set(weights))
    if missing:
        raise BadRequest(f"no weight for signal(s) {', '.join(missing)}")
    scores: dict[int, float] = {}
    explain: dict[int, Explain] = {}
    for signal in sorted(rankings):  # sorted: float sums in a fixed order, so scores are reproducible
        weight = weights[signal]
        if weight == 0:
            continue
        rank = 0
        for item in rankings[signal]:
            if signal in explain.get(item, {}):
                continue
            rank += 1
            contribution = weight / (k + rank)
            scores[item] = scores.get(item, 0.0) + contribution
            explain.setdefault(item, {})[signal] = (rank, contribution)
    fused = sorted(scores.items(), key=lambda row: (-row[1], row[0]))
    return [(item, score, explain[item]) for item, score in fused]


def score_by_entities(
    query_entities: Sequence[str], postings: Mapping[str, Collection[int]], total: int,
    df: Mapping[str, int] | None = None,
) -> list[tuple[int, float]]:
    """The graph signal, one hop: (memory, summed idf of the query's entities it mentions), best first.

    `postings` maps an entity to the ids of the memories that mention it; `total` is the number of memories
    searched; `df` overrides an entity's document frequency when its postings were cut short. An entity in every
    memory (idf 0) adds nothing: a speaker's or the project's own name. Equal sums are ordered by id.
    """
    scores: dict[int, float] = {}
    for entity in dict.fromkeys(query_entities):
        ids = postings.get(entity, ())
        count = (df or {}).get(entity, len(ids))
        if not ids or total <= 0 or count <= 0:
            continue
        idf = math.log(total / count)
        if idf <= 0:
            continue
        for item in ids:
            scores[item] = scores.get(item, 0.0) + idf
    return sorted(scores.items(), key=lambda row: (-row[1], row[0]))
