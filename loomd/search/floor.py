"""The relevance floor of a search a person reads: which fused hits are about the query at all, and why each one is.

Fused scores are rank-based (weighted RRF): the tenth hit of a nonsense query scores like the tenth hit of a good
one, so the floor reads the raw signals instead. A hit is above it when the meaning is close (a cosine at least
`min_cosine`), when it mentions an entity the query names (the graph signal), or when its text holds enough of the
query's words (the share `min_terms` of them, at least one, and two always suffice: the answer to a long question
rarely repeats more of it), or when the question asked where work stopped and the hit is from where it did (the
`ending` ranking), or when it asked what the user wanted and the hit is what the user said around the work it is
about (the `voice` ranking), or what fixed something and the hit is the change made right after it (the `fix`
ranking). Recency and recurrence only reorder what the others found: alone they never lift a hit
over the floor.

Measured on the coding-session QA set (bench/codingqa.py, 100 questions, top 10, and 9 nonsense queries against
its 13 projects): every nonsense hit's cosine was <= 0.285, the answering hits' 5th percentile 0.315; at 0.3 and a
share of 0.5 the floor cut 3 of 171 answering hits and every nonsense hit that held none of the query's words.

The search op applies it on request (`floor`): `loom search` asks for it, the hooks and benchmarks do not (the
prompt recall has its own, stricter test in context/relevance.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loomd.search.retrieval import Hit, covered_terms

WORDS_ENOUGH = 2


@dataclass(frozen=True)
class Floor:
    min_cosine: float
    min_terms: float  # the share of the query's terms a keyword-only hit must hold


def top_signal(hit: Hit) -> tuple[str, float] | None:
    """The signal that put the hit where it is (its largest share of the fused score) and that signal's raw score:
    a cosine for `vec`, the negated BM25 for `fts`, summed idf for `graph`."""
    if not hit.signals:
        return None
    name, part = max(hit.signals.items(), key=lambda item: (item[1].contribution, item[0]))
    return name, part.score


def above(hit: Hit, query: str, floor: Floor) -> bool:
    """Whether a hit is about the query (see the module's docstring)."""
    vec = hit.signals.get("vec")
    if vec is not None and vec.score >= floor.min_cosine:
        return True
    # ending: asked where work stopped, this is where; voice: asked what the user wanted, this is what they said;
    # fix: asked what fixed something, this is the change that followed
    if {"graph", "ending", "voice", "fix"} & set(hit.signals):
        return True
    if "fts" not in hit.signals:
        return False
    held, terms = covered_terms(query, hit.memory["text"])
    return terms > 0 and held >= min(WORDS_ENOUGH, max(1, math.ceil(floor.min_terms * terms)))


def apply_floor(hits: Sequence[Hit], query: str, floor: Floor) -> tuple[list[Hit], int]:
    """The hits above the floor, in their order, and how many were cut."""
    kept = [hit for hit in hits if above(hit, query, floor)]
    return kept, len(hits) - len(kept)
