"""Search over memories: filters, the five signals, their fusion.

Signals, each usable alone (`weights`), fused by weighted reciprocal rank fusion (fusion.py):
- fts: FTS5 BM25 over the text, the tags and (down-weighted) the session neighbours' text; user text is quoted
  term by term, never FTS syntax;
- vec: KNN over neighbour-mixed vectors (loomd.vectors);
- graph: memories that mention the query's entities, by summed idf (one hop over `mentions`);
- recency: newest first, and recurrence: what keeps coming back across sessions first. Both only reorder what
  fts and vec found (alone they would push the same memories into every answer); used without those, they rank
  every memory that passes the filters.

A question of a form whose answer shares few of its words adds a ranking of its own: where work stopped (`ending`),
what the user wanted (`voice`), how to run something (`worked`), what fixed something (`fix`).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loomd.errors import BadRequest, EmbedderError
from loomd.ingest.reading import EDIT_TOOLS
from loomd.ingest.sentences import clean_user_text
from loomd.search.fusion import (
    CANDIDATES,
    CONTEXT_WEIGHT,
    DEFAULT_WEIGHTS,
    MAX_QUERY_TERMS,
    RRF_K,
    STOPWORDS,
    fts_match,
    query_terms,
    score_by_entities,
    text_terms,
    text_words,
    weighted_rrf,
)
from loomd.search.windows import GAP, LEAD_CHARS, WINDOW_CHARS, best_windows, merge_passages, passage_head
from loomd.store.db import Store, connect_sync
from loomd.store.entities import extract_entities
from loomd.store.memories import memory_dict
from loomd.vectors.index import PREFILTER, Filters

if TYPE_CHECKING:
    from loomd.vectors.service import VectorService

MODES = ("keyword", "semantic", "hybrid")
SIGNALS = ("fts", "vec", "graph", "recency", "recurrence")
MODE_WEIGHTS: dict[str, dict[str, float]] = {
    "keyword": {"fts": 1.0}, "semantic": {"vec": 1.0}, "hybrid": dict(DEFAULT_WEIGHTS),
}
# An entity named in more memories than this is read only this far (newest first); its idf stays exact.
GRAPH_POSTINGS = 1000
COLLAPSE_POOL = 4  # candidates per slot read for the provenance collapse
NEAR_DUPLICATE = 0.75  # a hit sharing this share of its terms with a better one takes no slot
MIN_SOURCE_ROOM = 120  # an observation shows its source step's lines when this much room is left (`_with_source_lines`)
MAX_SOURCE_STEPS = 8  # of an observation's source steps, this many are read for its lines
SPARE_HITS = 10  # hits kept past the limit, to move up when a hit shown collapses into another
REPEATED = 0.8  # a hit whose terms are this share of a shown one's shows nothing new ...
REPEAT_MIN_TERMS = 8  # ... when it has this many (a few words are held by many texts)
ASIDE_PRIOR = 0.5  # see `workers/evidence.is_aside`: 0.4–0.8 all lift coding QA (all@5 .57 → .60–.62)
# A view of files (an aside) is the answer when the question asks what the files say: where something is or how the
# code is wired (`CODE_ASKED`: "how are colors wired in the app?", "where does the script keep the transcripts?";
# coding QA dev set: all@5 .82 -> .84, tenbox-06 7 -> 3, eob-03 not in 10 -> 1, chess-04 5 -> 2), or, asked how to run
# something (`RUN_ASKED`), a view of a project manifest, whose scripts are the commands (`MANIFEST`: `package.json`'s
# "dev": "next dev --turbopack"; all@5 .81 -> .82, eob-05 not in 10 -> 5). Of the aside's penalty, this share is lifted.
CODE_VIEWS = 1.0
MANIFEST_VIEWS = 1.0
DENSE_WINS = 0.9  # a distilled memory scoring this share of its evidence passage's score takes the passage's slot
# Asked where work stopped (`ENDING_ASKED`), the last steps of the session the best hits come from rank as a signal
# of this weight (fts's is 1.5): the answer is how the session ended, which shares few words with the question
# (coding QA dev set: all@5 .72 -> .74, all@10 .80 -> .82; weight 1.0 .73, 2.5 .74).
ENDING_WEIGHT = 1.5
ENDING_STEPS = 5  # memories (passages, notes) from the session's end
ENDING_HITS = 10  # the best fused hits whose session is the one asked about
# Asked what the user wanted (`USER_ASKED`), the user's own words around the work the best hits are about rank as a
# signal of fts's weight (`_user_words`; coding QA dev set: all@5 .78 -> .79, preferences .83 -> .92, recall .58 -> .59;
# 1.75 .80, 2.0 .79 with a loss).
VOICE_WEIGHT = 1.5
VOICE_HITS = 20  # the best fused hits whose framing words are looked for (10: .78)
# ... and a hit that is not the user's own words loses this share of its fused score: what the agent did about the work
# holds the question's words, what the user said about it is the answer (all@5 .84 -> .85, preferences .92 -> 1.0,
# templar-02 8 -> 3, big3-01 5 -> 2; 0.2 to 0.7 alike).
UNVOICED = 0.4
# Asked how to run, build or test something (`RUN_ASKED`), the runs that worked among the best hits rank as a signal:
# the answer is the command that worked (coding QA dev set: all@5 .79 -> .80, recall .60 -> .61; weight 0.5 and 1.5
# alike).
WORKED_WEIGHT = 1.0
WORKED_HITS = 60
# Asked anything else, the observer's note that a run passed ("Tests pass: `go test ./internal/monitoring`", "Works:
# `go build ./...`") loses this share of its fused score: it names the command and what it touched, so its few words
# are the question's subject, but all it says is that a command ran fine (coding QA dev set:
# all@5 .85 -> .86, templar-ci-09 8 -> 5, venus-04 4 -> 3; 0.5 to 0.9 alike, 0.3 8 -> 6).
PASSED_RUNS = 0.5
# Asked what fixed something (`FIX_ASKED`), the edits made first after the best hits rank as a signal (coding QA dev
# set: all@1 .39 -> .43, all@5 .80 -> .81, recall .61 -> .62; weight 1.5 alike).
FIX_WEIGHT = 1.0
FIX_HITS = 20
ASKED_SIGNALS = ("ending", "voice", "worked", "fix")  # the rankings a question's form adds (`search_hits`)
OUTCOME_HOPS = 3  # an announcement's outcome: the next message, or the one after it while each announces again
# BM25 scores every memory a query matches: past this many (summed per term) the commonest terms are dropped.
FTS_BUDGET = 10_000
# Knobs a benchmark (or a curious user) may turn per search: name -> (type, default, lowest, highest).
TUNING: dict[str, tuple[type, Any, float, float]] = {
    "ctx_weight": (float, CONTEXT_WEIGHT, 0.0, 10.0),  # BM25 weight of the neighbours' column; 0 = plain text
    "rrf_k": (int, RRF_K, 0, 1000),
    "candidates": (int, CANDIDATES, 1, 1000),  # per signal
    "mixed": (bool, True, 0, 1),  # KNN over neighbour-mixed vectors (else the raw ones)
    "prefilter": (int, PREFILTER, 1, 100_000),  # 1-bit candidates re-ranked with float vectors
    "fts_budget": (int, FTS_BUDGET, 1, 10_000_000),  # see prune_terms
    "aside_prior": (float, ASIDE_PRIOR, 0.0, 1.0),  # share of its fused score an aside's passage keeps
    "code_views": (float, CODE_VIEWS, 0.0, 1.0),  # share of that penalty lifted from a view when asked about the code
    "manifests": (float, MANIFEST_VIEWS, 0.0, 1.0),  # ... from a view of a manifest when asked how to run something
    "repeated": (float, REPEATED, 0.0, 2.0),  # see `_repeats`; over 1 never
    "ending": (float, ENDING_WEIGHT, 0.0, 10.0),  # weight of a session's last steps when asked where it stopped
    "voice": (float, VOICE_WEIGHT, 0.0, 10.0),  # weight of the user's words around the hits when asked what they wanted
    "unvoiced": (float, UNVOICED, 0.0, 1.0),  # ... and the share of its score a hit not in those words loses then
    "worked": (float, WORKED_WEIGHT, 0.0, 10.0),  # weight of the runs that worked when asked how to run something
    "passed_runs": (float, PASSED_RUNS, 0.0, 1.0),  # ... and the share of its score such a note loses when not
    "fix": (float, FIX_WEIGHT, 0.0, 10.0),  # weight of the edits made after the hits when asked what fixed something
}


@dataclass
class SearchContext:
    store: Store
    vectors: VectorService | None = None
    half_life_days: float = 30.0


def memory_filters(
    project: str | None, scope: str | None, kind: str | list[str] | None, since: float | None, until: float | None,
    session_id: str | None, include_archived: bool,
) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    if project:
        # User-scope memories follow the user into every project. `+` keeps the OR out of the indexes: with both of
        # its sides indexed (m013), SQLite would read a whole project to check a list of ids against it.
        clauses.append("(m.project = ? OR +m.scope = 'user')")
        params.append(project)
    if scope:
        clauses.append("m.scope = ?")
        params.append(scope)
    if kind:
        kinds = [kind] if isinstance(kind, str) else kind
        if not all(isinstance(k, str) for k in kinds):
            raise BadRequest("'kind' must be a string or a list of strings")
        clauses.append(f"m.kind IN ({','.join('?' * len(kinds))})")
        params.extend(kinds)
    if since is not None:
        clauses.append("m.created >= ?")
        params.append(since)
    if until is not None:
        clauses.append("m.created <= ?")
        params.append(until)
    if session_id:
        clauses.append("m.session_id = ?")
        params.append(session_id)
    if not include_archived:
        clauses.append("m.archived_at IS NULL")
    return (" AND ".join(clauses) or "1"), params


def resolve_weights(mode: str, weights: Mapping[str, Any] | None) -> dict[str, float]:
    """The mode's signal weights with the caller's overrides; 0 turns a signal off."""
    if mode not in MODES:
        raise BadRequest(f"unknown mode '{mode}'; one of: {', '.join(MODES)}")
    out = dict(MODE_WEIGHTS[mode])
    for name, value in (weights or {}).items():
        if name not in SIGNALS:
            raise BadRequest(f"unknown signal '{name}' in 'weights'; one of: {', '.join(SIGNALS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
            raise BadRequest(f"weight of '{name}' must be a number from 0 to 100")
        out[name] = float(value)
    return {name: w for name, w in out.items() if w > 0}


def resolve_tuning(tuning: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {name: spec[1] for name, spec in TUNING.items()}
    for name, value in (tuning or {}).items():
        if name not in TUNING:
            raise BadRequest(f"unknown tuning '{name}'; one of: {', '.join(TUNING)}")
        kind, _, low, high = TUNING[name]
        if kind is bool:
            if not isinstance(value, bool):
                raise BadRequest(f"tuning '{name}' must be true or false")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high \
                or (kind is int and value != int(value)):
            what = "an integer" if kind is int else "a number"
            raise BadRequest(f"tuning '{name}' must be {what} from {low} to {high}")
        out[name] = kind(value)
    return out


# --- the signals ---------------------------------------------------------------------------------------------------


class Stemmer:
    """The FTS index's own tokenizer (porter unicode61) on a private in-memory table: query term -> index terms."""

    # Between two words of one text: a token of its own, which no word is expected to hold (checked: `_as_one_text`).
    SEPARATOR = "qx0sep0xq"

    def __init__(self) -> None:
        self._db = connect_sync(":memory:")
        self._db.execute("CREATE VIRTUAL TABLE t USING fts5(x, tokenize='porter unicode61')")
        self._db.execute("CREATE VIRTUAL TABLE v USING fts5vocab(t, 'instance')")
        self._cache: dict[str, tuple[str, ...]] = {}
        # A search runs on the reader's thread (`search_hits`), a prompt's relevance check on the event loop: the
        # table's insert, read and delete of one call must not interleave with another's.
        self._lock = threading.Lock()

    def __call__(self, term: str) -> tuple[str, ...]:
        found = self._cache.get(term)
        return found if found is not None else self.many((term,))[term]

    def many(self, terms: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """Each term's index terms, in the order given. The ones not cached go through the tokenizer together, as one
        text (`_as_one_text`): one by one, a hit's new words cost ~75 µs each, a row each ~15 µs (a prompt's recall
        on the hook path spent 11 ms on 150 words not seen yet), in one text ~2.5 µs."""
        found = {term: self._cache.get(term) for term in terms}
        missing = [term for term, stems in found.items() if stems is None]
        if missing:
            with self._lock:
                tokens = self._as_one_text(missing)
                if tokens is None:
                    tokens = self._a_row_each(missing)
            if len(self._cache) + len(missing) > 50_000:
                self._cache.clear()
            for term, own in zip(missing, tokens, strict=True):
                found[term] = self._cache[term] = own
        return {term: stems or () for term, stems in found.items()}

    def _as_one_text(self, words: list[str]) -> list[tuple[str, ...]] | None:
        """Each word's index terms, the words tokenized as one text with SEPARATOR between them (a word's tokens are
        its own: the tokenizer splits at spaces); None when a word holds the separator's token too."""
        self._db.execute("INSERT INTO t (rowid, x) VALUES (1, ?)", (f" {self.SEPARATOR} ".join(words),))
        try:
            out: list[list[str]] = [[]]
            for (token,) in self._db.execute("SELECT term FROM v ORDER BY offset"):
                if token == self.SEPARATOR:
                    out.append([])
                else:
                    out[-1].append(token)
        finally:
            self._db.execute("DELETE FROM t")
        return [tuple(own) for own in out] if len(out) == len(words) else None

    def _a_row_each(self, words: list[str]) -> list[tuple[str, ...]]:
        self._db.executemany("INSERT INTO t (rowid, x) VALUES (?, ?)", enumerate(words, 1))
        try:
            tokens: dict[int, list[str]] = {}
            for doc, token in self._db.execute("SELECT doc, term FROM v ORDER BY doc, offset"):
                tokens.setdefault(doc, []).append(token)
        finally:
            self._db.execute("DELETE FROM t")
        return [tuple(tokens.get(n, ())) for n in range(1, len(words) + 1)]


_stem: Stemmer | None = None


def stemmer() -> Stemmer:
    global _stem
    _stem = _stem or Stemmer()
    return _stem


def held_terms(query: str | Sequence[str], text: str) -> frozenset[str]:
    """The query's terms (`query_terms`, or already split) that the text holds, as the index reads both (stemmed).

    The shorter side is stemmed, and of the other only the words that can stem to one of its index terms
    (`_may_stem_to`): the others cannot match one. A long tool output after a catch-up is hundreds of words not
    stemmed yet, ~15 µs each: a prompt's recall on the hook path spent up to 25 ms choosing its windows, and up to 8
    ms more asking whether its hits only said the prompt back."""
    terms = query_terms(query) if isinstance(query, str) else query
    if not terms:
        return frozenset()
    words = text_words(text)
    if len(terms) > MAX_QUERY_TERMS and len(words) < len(terms):
        # The text is the short side (a prompt, asked which of a memory's many words it holds: `echoes`): its words
        # are stemmed, and only the terms that can stem to one of theirs. A term with no index term at all ("_")
        # is held by any text, as the index reads it. (A query's terms, at most MAX_QUERY_TERMS, are stemmed once
        # for all the lines of its windows: `_query_stems`.)
        held = {t for ts in stemmer().many(words).values() for t in ts}
        keys = _stem_keys(held)
        maybe = [t for t in terms if _may_stem_to(t, keys) or not any(c.isalnum() for c in t)]
        return frozenset(term for term, own in stemmer().many(maybe).items() if set(own) <= held)
    stems, keys, bare = _query_stems(tuple(terms))
    held = _held_stems(words, keys)
    return frozenset(term for term, own in stems if own <= held) if held else bare


def _held_stems(words: Iterable[str], keys: tuple[frozenset[str], ...]) -> set[str]:
    """The index terms of the words that may stem to one starting with `keys` (`_may_stem_to`); the others hold none.
    Each word is looked at once per query (`_word_stems`): a recall's windows ask of every line, and the same words
    come back line after line (the filter and the stem cache's lookups were a fifth of a prompt's recall)."""
    known = _word_stems(keys)  # shared by the reader's thread (a search) and the loop (a prompt's relevance check)
    held: set[str] = set()
    new: list[str] = []
    for word in words:  # one lookup a word: most hold none of the query's terms (an empty tuple)
        stems = known.get(word)
        if stems is None:
            new.append(word)
        elif stems:
            held.update(stems)
    if new:
        stemmed = stemmer().many(word for word in new if _may_stem_to(word, keys))
        if len(known) + len(new) > WORDS_KNOWN:
            known.clear()
        for word in new:
            known[word] = stems = stemmed.get(word, ())
            held.update(stems)
    return held


WORDS_KNOWN = 20_000  # per query: each word's index terms, as far as they can be the query's (`_held_stems`)


@functools.lru_cache(maxsize=8)
def _word_stems(keys: tuple[frozenset[str], ...]) -> dict[str, tuple[str, ...]]:
    """The words looked at for a query's keys so far, with their index terms (`_held_stems`): of the last few queries,
    at most WORDS_KNOWN words each."""
    return {}


def _prestem(terms: Sequence[str], texts: Iterable[str]) -> None:
    """Stem at once the words of `texts` that `held_terms(terms, text)` will stem: its calls find them cached."""
    if not terms:
        return
    _, keys, _ = _query_stems(tuple(terms))
    words: set[str] = set()
    for text in texts:
        words.update(text_words(text))
    _held_stems(words, keys)


@functools.lru_cache(maxsize=64)
def _query_stems(
    terms: tuple[str, ...],
) -> tuple[tuple[tuple[str, frozenset[str]], ...], tuple[frozenset[str], ...], frozenset[str]]:
    """Each term with its index terms, their keys (`_stem_keys`), and the terms with none (held by any text): a
    search asks `held_terms` of every line of its hits' windows with the same terms."""
    stems = stemmer().many(terms)
    return (tuple((t, frozenset(stems[t])) for t in terms), _stem_keys(t for own in stems.values() for t in own),
            frozenset(t for t in terms if not stems[t]))


# What the porter stemmer keeps of a word: each of its parts (unicode61 splits at every character that is not a letter
# or digit: `get_sort_key` is three) keeps its first three characters but that a `y` may turn into an `i` ("any" ->
# "ani", "eyed" -> "ei"), or is cut to one or two of them ("is", "ei"). Checked on every word of the shared
# transcripts, of the embedding model's vocabulary and every ASCII word of up to three letters (tests/test_evidence.py).
_PARTS_RE = re.compile(r"[^0-9a-z]+")


def _stem_key(text: str) -> str:
    return text[:3].replace("y", "i")


def _stem_keys(stems: Iterable[str]) -> tuple[frozenset[str], ...]:
    """The keys an index term's word starts with (`_stem_key`), by length: (3 characters, 2, 1)."""
    keys = {_stem_key(t) for t in stems}
    return tuple(frozenset(k for k in keys if len(k) == n) for n in (3, 2, 1))


def _may_stem_to(word: str, keys: tuple[frozenset[str], ...]) -> bool:
    """Whether one of `word`'s index terms may start with one of `keys` (`_stem_keys`); True for a word whose folding
    this does not model (one not in ASCII)."""
    if not word.isascii():
        return True
    three, two, one = keys
    for part in (word,) if word.isalnum() else _PARTS_RE.split(word):
        key = _stem_key(part)
        if key in three or key[:2] in two or key[:1] in one:
            return True
    return False


def covered_terms(query: str, text: str) -> tuple[int, int]:
    """(how many of the query's terms the text holds, as the index reads both; how many terms the query has)."""
    terms = query_terms(query)
    return len(held_terms(terms, text)), len(terms)


# Memories per index term, for pruning only (an estimate may be minutes old): (store, term) -> (when, count).
_DF: dict[tuple[int, str], tuple[float, int]] = {}
DF_TTL_S = 300.0


def prune_terms(conn: sqlite3.Connection, terms: list[str], budget: int, indexed: int) -> list[str]:
    """Drop the commonest terms while the memories the query would score exceed `budget` (BM25 scores every
    match: 50k matches take 45 ms at 100k memories), keeping the rarest term. Within budget: every term.

    `indexed`, the memories in the index, bounds the matches: at or under the budget there is nothing to prune."""
    if indexed <= budget:
        return terms
    df = term_docs(conn, terms)
    kept = list(terms)
    while len(kept) > 1 and sum(df[t] for t in kept) > budget:
        kept.remove(max(kept, key=lambda t: (df[t], t)))
    return kept


def term_docs(conn: sqlite3.Connection, terms: Sequence[str]) -> dict[str, int]:
    """The memories each term is in (the fewest of its index tokens'), from the index's vocabulary; an estimate that
    may be minutes old (`_DF`)."""
    tokens = stemmer().many(list(terms))
    now = time.monotonic()
    docs: dict[str, int] = {}
    wanted = []
    for token in sorted({t for ts in tokens.values() for t in ts}):
        cached = _DF.get((id(conn), token))
        if cached is not None and now - cached[0] < DF_TTL_S:
            docs[token] = cached[1]
        else:
            wanted.append(token)
    if wanted:  # fts5vocab counts by walking the term's postings (0.2 ms for a common term at 100k): cache it
        if len(_DF) > 100_000:
            _DF.clear()
        found = {r[0]: r[1] for r in conn.execute(
            "SELECT term, doc FROM memories_fts_vocab WHERE term IN (SELECT value FROM json_each(?))",
            [json.dumps(wanted)]).fetchall()}
        for token in wanted:
            docs[token] = found.get(token, 0)
            if docs[token]:  # a word no memory has yet may arrive any moment: never cache its absence
                _DF[(id(conn), token)] = (now, docs[token])
    return {term: min((docs.get(t, 0) for t in ts), default=0) for term, ts in tokens.items()}


def _verify(conn: sqlite3.Connection, ranked: Sequence[int], where: str, params: Sequence[Any], n: int) -> list[int]:
    """The first n of `ranked` that pass the filters (checked in SQL, in chunks of 2n, best first)."""
    kept: list[int] = []
    step = max(2 * n, 1)
    for start in range(0, len(ranked), step):
        chunk = list(ranked[start : start + step])
        ok = {r[0] for r in conn.execute(
            f"SELECT m.id FROM memories m WHERE m.id IN (SELECT value FROM json_each(?)) AND {where}",
            [json.dumps(chunk), *params]).fetchall()}
        kept += [i for i in chunk if i in ok]
        if len(kept) >= n:
            break
    return kept[:n]


# A question about where work stopped: "where did the table work stop?", "still open when the session ended",
# "how far had it got when this was saved", "the user's last request".
ENDING_ASKED = re.compile(
    r"\bwhere\b.*\bstop(?:ped)?\b|\b(?:left off|leave off|ended|end of\b[^.?]{0,30}\bsession|last request|how far"
    r"|(?:still|left) (?:open|left|pending|unfinished))\b|\bwhen\b.*\b(?:saved|ended|declared|finished)\b", re.I)
# A question about what the user asked for, wanted or ruled: "what did the user insist on while …", "which way of
# working did the user ask for …", "may the agent patch those files directly?".
USER_ASKED = re.compile(
    r"\b(?:user|they|he|she)\b.{0,40}\b(?:ask(?:ed)?|want(?:ed)?|insist(?:ed)?|prefer(?:red)?|request(?:ed)?|told|sa(?:y|id)"
    r"|demand(?:ed)?|forb[ia]d|require[ds]?)\b|\b(?:may|should|can|must) the (?:agent|assistant)\b", re.I)
# A question about how to run, build or test something: "how do I run the loopkit test suite?", "how is dmux built?".
RUN_ASKED = re.compile(
    r"\bhow (?:do|can|should|did|would) (?:i|we|you|one)\b.*\b(?:run|build|test|start|lint|install|launch|serve|deploy"
    r"|check|type-?check)\b|\bhow (?:is|are|was|were)\b.*\b(?:built|run|started|tested|linted|installed|launched|served"
    r"|deployed|checked)\b", re.I)
# A question about what fixed something: "… What was the fix?", "how was it resolved?", "one of the failures and its
# fix", "how do you fix `cannot use href …`?".
FIX_ASKED = re.compile(r"\bwhat was the (?:final )?fix\b|\bits fix\b|\bhow (?:was|were|did|do you)\b.*\b(?:fix|fixed"
                       r"|resolved|solved)\b|\bwhat (?:fixed|resolved|solved)\b", re.I)
# A question about what the code or the files say: where something is ("where is the vision call implemented?",
# "where does the script keep the transcripts?"), how it is wired ("how are colors wired in the app?").
CODE_ASKED = re.compile(
    r"\bwhere (?:is|are|does|do)\b|\bhow (?:is|are|was|were)\b.*\b(?:wired|implemented|structured|organi[sz]ed"
    r"|configured|set up|defined|laid out|hooked up|connected|named|stored)\b"
    r"|\bhow (?:does|do)\b.*\b(?:work|store|name|wire|implement|configure|define)\b", re.I)
# A project's manifest, named in a view's header: the file whose scripts or targets are how the project is run.
MANIFEST = re.compile(
    r"(?<![\w.-])(?:package\.json|deno\.jsonc?|composer\.json|[Mm]akefile|GNUmakefile|[Jj]ustfile|Taskfile\.ya?ml"
    r"|pyproject\.toml|setup\.cfg|tox\.ini|noxfile\.py|Cargo\.toml|(?:docker-)?compose\.ya?ml|Procfile|flake\.nix)(?![\w.-])")
# A snake_case identifier standing alone, not a piece of a path or a file name ("button_test.go" is found whole).
_IDENTIFIER_RE = re.compile(r"(?<![\w./\\-])[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+(?![\w/\\-]|\.\w)")


def with_identifier_parts(query: str, terms: Sequence[str]) -> list[str]:
    """The terms, then the words of each snake_case identifier standing alone in the query: "max_tokens" in a
    question is a phrase to the index, which misses "make it 5000 tokens max" said in prose."""
    out = dict.fromkeys(terms)
    for identifier in _IDENTIFIER_RE.findall(query):
        out.update((part, None) for part in identifier.lower().split("_") if len(part) > 1 and part not in STOPWORDS)
    return list(out)


def fts_terms(conn: sqlite3.Connection, query: str, budget: int, indexed: int) -> list[str]:
    """The query's full-text terms (`query_terms`, with its identifiers' words), the commonest pruned to `budget`."""
    terms = with_identifier_parts(query, query_terms(query))
    return prune_terms(conn, terms, budget, indexed) if terms else []


def fts_signal(
    conn: sqlite3.Connection, terms: list[str], where: str, params: Sequence[Any], n: int, ctx_weight: float,
    indexed: int, passing: int | None = None, within: Sequence[int] | None = None,
) -> list[tuple[int, float]]:
    """BM25 of the `terms` (`fts_terms`) over text, tags and the neighbours' column (weighted ctx_weight; 0 leaves
    the column out). `passing`: about how many of the `indexed` memories pass the filters (`_counted`,
    `_many_passing`), or None; `within`: every memory that passes them, when they are few (`_passing_ids`), or None.
    The hits are the same every way."""
    if not terms or (within is not None and not within):  # nothing to look up, or a project with no memories yet
        return []
    match = fts_match(terms)
    if ctx_weight == 0:
        match = "{text tags} : (" + match + ")"
    bm25 = f"bm25(memories_fts, 1.0, 1.0, {float(ctx_weight)!r})"
    if within is not None:
        # Few pass: each match is checked against them as the index yields it (`+rowid`: a filter, where a bare
        # `rowid IN` has the index look each one up, ~55 us apiece), and only they are scored, where ranking with the
        # filters scores every match (up to `budget`) and reads its memory to keep a few: at 8k memories, a project
        # holding 71, 1.0 -> 0.4 ms a question (coding QA's, in-process), 4-9 ms under a catch-up.
        rows = conn.execute(
            f"SELECT rowid, {bm25} AS score FROM memories_fts WHERE memories_fts MATCH ?"
            " AND +rowid IN (SELECT value FROM json_each(?)) ORDER BY score, rowid LIMIT ?",
            [match, json.dumps(list(within)), n]).fetchall()
        return [(r[0], -r[1]) for r in rows]
    # The index alone ranks fastest; the filters are checked on the best 2n, in the same statement (one trip to
    # the reader thread). Too few pass: rank with them. Under half the memories passing (a project among others),
    # n of the best 2n seldom do: ranked with the filters at once, the same hits without the first statement (half
    # of a prompt's full-text recall, 4 ms, in a project holding a tenth of the memories).
    if passing is None or 2 * passing >= indexed:
        rows = conn.execute(
            f"SELECT r.id, r.score, EXISTS (SELECT 1 FROM memories m WHERE m.id = r.id AND {where}) FROM"
            f" (SELECT rowid AS id, {bm25} AS score FROM memories_fts WHERE memories_fts MATCH ?"
            " ORDER BY score, rowid LIMIT ?) r ORDER BY r.score, r.id", [*params, match, 2 * n]).fetchall()
        kept = {r[0] for r in rows if r[2]}
        if len(kept) >= n or len(rows) < 2 * n:
            return [(r[0], -r[1]) for r in rows if r[0] in kept][:n]
    rows = conn.execute(
        f"SELECT m.id, {bm25} AS score FROM memories_fts JOIN memories m ON m.id = memories_fts.rowid"
        f" WHERE memories_fts MATCH ? AND {where} ORDER BY score, m.id LIMIT ?", [match, *params, n]).fetchall()
    return [(r[0], -r[1]) for r in rows]


_TOTALS: dict[tuple[int, str, str], tuple[int, float, int]] = {}
# Counts a hook's search used past their time (`_total`'s `cached`), left for `recount_stale` to count again.
_STALE: set[tuple[int, str, str]] = set()
TOTAL_FRESH_S = 2.0


def _total(ctx: SearchContext, conn: sqlite3.Connection, where: str, params: Sequence[Any], *,
           cached: bool = False) -> int:
    """How many memories pass the filters (the graph's idf, the keyword budget), recounted after writes at most
    every 2 s (every 2 s at all without the vector service, whose generation counts the writes).

    `cached` (a hook's search: `search_hits`'s `cached_counts`): a count made before serves whatever its age, and
    one past its time is counted again apart (`recount_stale`, on the workers' connection). The count reads a whole
    index, which every commit of a catch-up takes out of the reader's cache: in the hooks bench with a catch-up
    running, 14 ms of the reader's CPU for each prompt's keyword recall (10 recalls: 139 ms in the count, 59 in full
    text), where what the count steers (which terms are too common to rank, which way to rank) needs it only roughly."""
    generation = _generation(ctx)
    key = _total_key(ctx, where, params)
    known = _TOTALS.get(key)
    if known is not None:
        fresh = (generation >= 0 and known[0] == generation) or time.monotonic() - known[1] < TOTAL_FRESH_S
        if fresh or cached:
            if not fresh:
                _STALE.add(key)
            return known[2]
    total = int(conn.execute(_count_sql(where), params).fetchone()[0] or 0)
    _keep_total(key, generation, total)
    return total


async def recount_stale(ctx: SearchContext) -> int:
    """Count again, on the workers' connection (never the hooks' reader), what hooks' searches used past its time
    (`_total`'s `cached`); how many counts that was."""
    keys = [key for key in list(_STALE) if key[0] == id(ctx.store)]  # list(): the reader's thread adds to it
    for key in keys:
        _STALE.discard(key)
        generation = _generation(ctx)  # before the count: a write meanwhile leaves it stale
        row = await ctx.store.fetchone(_count_sql(key[1]), json.loads(key[2]), background=True)
        _keep_total(key, generation, int(row[0] or 0) if row is not None else 0)
    return len(keys)


def _count_sql(where: str) -> str:
    """The one count `_total` keeps, of the memories passing `where`, whichever connection runs it."""
    return f"SELECT count(*) FROM memories m WHERE {where}"


def _generation(ctx: SearchContext) -> int:
    return ctx.vectors.generation if ctx.vectors is not None else -1


def _keep_total(key: tuple[int, str, str], generation: int, total: int) -> None:
    if len(_TOTALS) > 1000:
        _TOTALS.clear()
        _STALE.clear()  # what it names is gone: counted afresh when next searched
    _TOTALS[key] = (generation, time.monotonic(), total)


def _counted(ctx: SearchContext, where: str, params: Sequence[Any]) -> int | None:
    """How many memories passed the filters when `_total` last counted them (a graph signal's count, maybe minutes
    old), or None: an estimate that costs nothing, where a fresh count scans the memories (`fts_signal`)."""
    cached = _TOTALS.get(_total_key(ctx, where, params))
    return cached[2] if cached is not None else None


# A project holding at most FEW_PASSING memories (live or archived), or no more than the query matches in the whole
# index (`term_docs`; and under half the index): those passing the filters are read whenever searched (by index), and
# full text scores only its matches among them. Each match it checks costs about 1 us, each one it does not score
# 2 us less, against reading a row of the project to list it, 1 us: a prompt's recall in a project of 429 memories
# among 28k, matching 1,147-1,733 of them, scored them in 3.1-5.5 ms ranked with the filters, in 1.3-2.1 read first.
# Found holding more than FEW_PASSING, its rows are counted by index (`_rows_at_most`), and that count decides for
# MANY_TTL_S. It only chooses between ways that find the same hits, so it may be old: 10 minutes, not 1, so that a
# prompt's recall every few minutes has it.
FEW_PASSING = 200
MANY_TTL_S = 600.0
_MANY: dict[tuple[int, str, str], tuple[float, int]] = {}


def _passing_ids(
    ctx: SearchContext, conn: sqlite3.Connection, project: str, where: str, params: Sequence[Any],
    counted: int | None, indexed: int, matches: Callable[[], int],
) -> list[int] | None:
    """The memories that pass a project's filters, read now, or None: the project holds more than FEW_PASSING (the
    read itself says so, and counts it), and more than `matches()`, how many memories the query matches at most (its
    rows' count within MANY_TTL_S, or `counted`, the last count of those passing the filters, says so). Read now, not
    cached, so that a project with no memories, or a handful, never ranks the full-text matches of the whole index (a
    prompt's: 3-20 ms at 8k).

    At most that many + 1 of the project's rows are read (its archived ones count: a project GC has mostly
    archived is read no further), and the user-scope memories by their index (m013). Holding more, its rows are
    counted (`_rows_at_most`) for `_many_passing`."""
    key = _total_key(ctx, where, params)
    many = _MANY.get(key)
    # What it holds, as last counted: its rows (the read's cost: archived ones too), else those passing the filters.
    held = many[1] if many and time.monotonic() - many[0] < MANY_TTL_S else counted
    most = FEW_PASSING
    if held is not None and held > most:  # known to hold more than a few: read while the query matches as many
        most = max(FEW_PASSING, min(matches(), indexed // 2))
        if held > most:
            return None
    rows = conn.execute(f"SELECT m.id, {where} FROM memories m WHERE m.project = ? LIMIT ?",
                        [*params, project, most + 1]).fetchall()
    ids = [r[0] for r in rows if r[1]]
    if len(rows) <= most:
        ids += [r[0] for r in conn.execute(
            f"SELECT m.id FROM memories m WHERE m.scope = 'user' AND m.project != ? AND {where} LIMIT ?",
            [project, *params, most + 1 - len(ids)]).fetchall()]
        if len(ids) <= most:
            return sorted(ids)
    if len(_MANY) > 1000:
        _MANY.clear()
    _MANY[key] = (time.monotonic(), _rows_at_most(conn, project, indexed // 2 + 1))
    return None


def _rows_at_most(conn: sqlite3.Connection, project: str, bound: int) -> int:
    """The project's memories and the user-scope ones (archived or not), counted by index up to `bound` each."""
    row = conn.execute("SELECT (SELECT count(*) FROM (SELECT 1 FROM memories m WHERE m.project = ?1 LIMIT ?2)) +"
                       " (SELECT count(*) FROM (SELECT 1 FROM memories m WHERE m.scope = 'user' LIMIT ?2))",
                       [project, bound]).fetchone()
    return int(row[0])


def _many_passing(ctx: SearchContext, where: str, params: Sequence[Any]) -> int | None:
    """At most about how many memories pass a project's filters when it holds many (`_passing_ids`), or None: full
    text ranks with the filters at once when that is under half the index, where the best 2n of the whole index
    seldom hold n of them (an unknown share: both, one after the other, 3.7 ms for a long prompt at 8k, not 1.8)."""
    many = _MANY.get(_total_key(ctx, where, params))
    return many[1] if many is not None else None


def _total_key(ctx: SearchContext, where: str, params: Sequence[Any]) -> tuple[int, str, str]:
    return id(ctx.store), where, json.dumps(list(params))


def graph_signal(
    ctx: SearchContext, conn: sqlite3.Connection, query: str, where: str, params: Sequence[Any], project: str | None,
    n: int, *, cached: bool = False,
) -> list[tuple[int, float]]:
    """Memories that mention the query's entities, by summed idf over the memories searched."""
    names = list(dict.fromkeys(name for name, _ in extract_entities(query)))
    if not names:
        return []
    marks = ",".join("?" * len(names))
    sql = f"SELECT id, name, mentions FROM entities WHERE name IN ({marks})"
    args: list[Any] = list(names)
    if project:
        sql += " AND project IN (?, 'user')"
        args.append(project)
    entities = conn.execute(sql, args).fetchall()
    if not entities:
        return []
    # The entities' newest postings, a subquery each (each walks the edge index), in as few statements as SQLite's
    # compound-select limit (500) allows.
    found: dict[int, list[int]] = {}
    for start in range(0, len(entities), 200):
        chunk = entities[start : start + 200]
        for entity_id, src_id in conn.execute(" UNION ALL ".join(
                "SELECT * FROM (SELECT dst_id, src_id FROM edges WHERE dst_type = 'entity' AND dst_id = ?"
                " AND type = 'mentions' AND src_type = 'memory' ORDER BY src_id DESC LIMIT ?)" for _ in chunk),
                [p for entity in chunk for p in (entity[0], GRAPH_POSTINGS)]).fetchall():
            found.setdefault(entity_id, []).append(src_id)
    postings: dict[str, set[int]] = {}
    df: dict[str, int] = {}
    for entity_id, name, mentions in entities:
        ids = found.get(entity_id, [])
        postings.setdefault(name, set()).update(ids)
        df[name] = df.get(name, 0) + (max(mentions, len(ids)) if len(ids) == GRAPH_POSTINGS else len(ids))
    ranked = score_by_entities(names, postings, _total(ctx, conn, where, params, cached=cached), df)
    kept = set(_verify(conn, [i for i, _ in ranked], where, params, n))
    return [(i, score) for i, score in ranked if i in kept]


# --- search --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalHit:
    """One signal's say on a hit: its rank in that signal's list (from 1), its raw score (a cosine for `vec`, the
    negated BM25 for `fts`) and what it added to the fused score."""

    rank: int
    score: float
    contribution: float


@dataclass
class Hit:
    memory: dict[str, Any]  # memory_dict(row) with the fused `score`
    signals: dict[str, SignalHit]

    def as_dict(self, explain: bool) -> dict[str, Any]:
        """The search op's item; `explain` adds each signal's rank, score and share."""
        if not explain:
            return self.memory
        return {**self.memory, "explain": {
            s: {"rank": h.rank, "score": round(h.score, 6), "contribution": round(h.contribution, 6)}
            for s, h in sorted(self.signals.items())}}


async def search_memories(ctx: SearchContext, *, explain: bool = False, **kwargs: Any) -> list[dict[str, Any]]:
    """The search op: `search_hits` as plain items (with each signal's part when `explain`)."""
    return [hit.as_dict(explain) for hit in await search_hits(ctx, **kwargs)]


@dataclass(frozen=True)
class _Search:
    """What `search_hits` was asked, resolved: what the reader's thread needs for its reads and the fusion."""

    query: str
    limit: int
    project: str | None
    where: str
    params: list[Any]
    active: dict[str, float]
    knobs: dict[str, Any]
    window_chars: int
    lead_chars: int
    half_life_days: float
    timings: dict[str, float]
    shows: Callable[[Hit], bool] | None = None
    cached_counts: bool = False


async def search_hits(
    ctx: SearchContext, *, query: str, limit: int = 10, mode: str = "hybrid", project: str | None = None,
    scope: str | None = None, kind: str | list[str] | None = None, since: float | None = None,
    until: float | None = None, session_id: str | None = None, include_archived: bool = False,
    weights: Mapping[str, Any] | None = None, tuning: Mapping[str, Any] | None = None,
    report: dict[str, Any] | None = None, window_chars: int = WINDOW_CHARS, lead_chars: int = LEAD_CHARS,
    shows: Callable[[Hit], bool] | None = None, cached_counts: bool = False,
) -> list[Hit]:
    """Fused search. `report`, when given, receives per-stage timings (ms) and notes on signals that could not run;
    an evidence hit shows at most `window_chars` of its step (`search/windows.py`), the first hit `lead_chars`;
    `shows`, the hits the caller may show at all (`_show_windows`); `cached_counts` (a hook's search), counts made
    before, whatever their age (`_total`).

    Its reads run on the reader's thread in two trips (`Store.read`): the keyword and graph signals while the query
    is embedded, then the fusion and what the hits show; in one trip when there is no vector search to wait for (a
    prompt's keyword recall). A trip per read, 10-15 of them one after another, waited each time for the event loop's
    turn: during a catch-up a prompt's recall took up to 71 ms (closing note, stop 41)."""
    started = time.perf_counter()
    active = resolve_weights(mode, weights)
    knobs = resolve_tuning(tuning)
    where, params = memory_filters(project, scope, kind, since, until, session_id, include_archived)
    plan = _Search(query, limit, project, where, params, active, knobs, window_chars, lead_chars, ctx.half_life_days,
                   {}, shows, cached_counts)
    notes: list[str] = []
    found: list[tuple[int, float]] | None = None  # the vector signal's hits; None: no vectors to search
    if "vec" not in active or ctx.vectors is None:
        def whole(conn: sqlite3.Connection) -> list[Hit]:
            scored = _signals(ctx, plan, conn)
            if "vec" in active:
                scored["vec"] = []
            return _ranked(plan, scored, conn)

        results = await ctx.store.read(whole)
    else:
        # Started first: the query is embedded on its own thread while the keyword and graph signals query SQLite.
        kinds = None if not kind else (kind,) if isinstance(kind, str) else tuple(kind)
        filters = Filters(project or None, scope or None, kinds, since, until, session_id or None, include_archived)
        knn = asyncio.create_task(ctx.vectors.knn(
            query, k=knobs["candidates"], filters=filters, where=where, params=params, mixed=knobs["mixed"],
            prefilter=knobs["prefilter"], timings=plan.timings))
        try:
            scored = await ctx.store.read(functools.partial(_signals, ctx, plan))
            try:
                found = await knn
            except EmbedderError as exc:  # a remote endpoint down: the other signals still answer
                notes.append(f"vec: the query could not be embedded: {exc}")
                found = []
        finally:
            if not knn.done():
                knn.cancel()
        scored["vec"] = found or []
        results = await ctx.store.read(functools.partial(_ranked, plan, scored))
    if "vec" in active and found is None:
        state = ctx.vectors.status() if ctx.vectors is not None else {"state": "off"}
        why = f"{state['state']}: {state['error']}" if state.get("error") else state["state"]
        notes.append(f"vec: no vectors to search (embedder {why})")
    plan.timings["total_ms"] = _ms(started)
    if report is not None:
        report["timings"] = plan.timings
        report["weights"] = active
        if notes:
            report["notes"] = notes
    return results


def _signals(ctx: SearchContext, plan: _Search, conn: sqlite3.Connection) -> dict[str, list[tuple[int, float]]]:
    """The keyword and graph signals (those `plan.active` weighs), on the reader's thread."""
    scored: dict[str, list[tuple[int, float]]] = {}
    n, knobs = plan.knobs["candidates"], plan.knobs
    if "fts" in plan.active:
        t = time.perf_counter()
        indexed = _total(ctx, conn, "1", (), cached=plan.cached_counts)
        passing = _counted(ctx, plan.where, plan.params)
        terms = fts_terms(conn, plan.query, knobs["fts_budget"], indexed)
        within = None
        if plan.project and terms:
            within = _passing_ids(ctx, conn, plan.project, plan.where, plan.params, passing, indexed,
                                  lambda: sum(term_docs(conn, terms).values()))
        if passing is None and within is None and plan.project:
            passing = _many_passing(ctx, plan.where, plan.params)
        scored["fts"] = fts_signal(conn, terms, plan.where, plan.params, n, knobs["ctx_weight"], indexed, passing,
                                   within)
        plan.timings["fts_ms"] = _ms(t)
    if "graph" in plan.active:
        t = time.perf_counter()
        scored["graph"] = graph_signal(ctx, conn, plan.query, plan.where, plan.params, plan.project, n,
                                       cached=plan.cached_counts)
        plan.timings["graph_ms"] = _ms(t)
    return scored


def _ranked(plan: _Search, scored: dict[str, list[tuple[int, float]]], conn: sqlite3.Connection) -> list[Hit]:
    """The signals fused and reordered, collapsed by provenance, and the first `plan.limit` hits as shown, on the
    reader's thread."""
    # The pool recency and recurrence reorder: what the relevance signals found.
    pool = {i for name in ("fts", "vec") for i, _ in scored.get(name, [])}
    if not pool and "fts" not in plan.active and "vec" not in plan.active:
        pool = {i for i, _ in scored.get("graph", [])}
    t = time.perf_counter()
    if "recency" in plan.active or "recurrence" in plan.active:
        if not ({"fts", "vec", "graph"} & set(plan.active)):
            pool = _prior_pool(conn, plan.where, plan.params, plan.knobs["candidates"], plan.active)
        facts = _facts(conn, pool)
        pool &= facts.keys()  # deleted since the signals read it (a retention's GC): nothing to rank
        now = time.time()
        half_life = max(plan.half_life_days, 1e-6) * 86400
        if "recency" in plan.active:
            newest = sorted(pool, key=lambda i: (-facts[i][0], -i))
            scored["recency"] = [(i, round(0.5 ** (max(0.0, now - facts[i][0]) / half_life), 6)) for i in newest]
        if "recurrence" in plan.active:
            recurring = sorted((i for i in pool if facts[i][1] > 0), key=lambda i: (-facts[i][1], i))
            scored["recurrence"] = [(i, float(facts[i][1])) for i in recurring]
    fused = weighted_rrf({s: [i for i, _ in scored[s]] for s in scored}, plan.active, plan.knobs["rrf_k"])
    # A question of a form whose answer shares few of its words gets a ranking of its own, each seeing the fusion so
    # far: "where did it stop?" (the last steps of the session the best hits come from), "what did the user ask
    # for?" (what the user said around the work the best hits are about), "how do I run the tests?" (the runs that
    # worked among the hits), "what was the fix?" (the edits made right after them).
    for name, asked, best, ranking in (("ending", ENDING_ASKED, ENDING_HITS, _session_end),
                                       ("voice", USER_ASKED, VOICE_HITS, _user_words),
                                       ("worked", RUN_ASKED, WORKED_HITS, _worked),
                                       ("fix", FIX_ASKED, FIX_HITS, _edits_after)):
        if plan.knobs[name] > 0 and fused and asked.search(plan.query):
            scored[name] = ranking(conn, fused[:best], plan.where, plan.params)
            weights = {**plan.active, **{n: plan.knobs[n] for n in ASKED_SIGNALS if n in scored}}
            fused = weighted_rrf({s: [i for i, _ in scored[s]] for s in scored}, weights, plan.knobs["rrf_k"])
    if plan.knobs["unvoiced"] > 0 and scored.get("voice"):
        # Asked what the user wanted, what the user said outranks what was done: the rest keeps a share of its score.
        said, keep = {i for i, _ in scored["voice"]}, 1 - plan.knobs["unvoiced"]
        fused = sorted(((i, score if i in said else score * keep, parts) for i, score, parts in fused),
                       key=lambda f: (-f[1], f[0]))
    # Collapse by provenance: a candidate whose source events a better one already cites takes no slot of its own
    # (the passages of one tool result, a memory and the evidence it came from); enough candidates for the slots.
    # A passage of an aside (a step that only showed files: a Read, `cat`, `rg`; a message that only announces the
    # next step) keeps a share of its score: the answer is what the session found, said or did. Twice the pool is
    # looked at, so what the others drop to makes room for what rises.
    slots = plan.limit * COLLAPSE_POOL
    looked = fused[: 2 * slots]
    by_id = _rows(conn, [f[0] for f in looked[:slots]])
    if plan.knobs["aside_prior"] < 1:
        asides = {i for i, row in by_id.items() if marked_aside(row["kind"], row["meta"])}
        # With no aside in the first `slots` nothing there drops, so nothing past them rises (`fused` is in score
        # order, equal scores by id): the rows past them are read only when an aside makes room.
        if asides and len(looked) > slots:
            more = _rows(conn, [f[0] for f in looked[slots:]])
            by_id.update(more)
            asides.update(i for i, row in more.items() if marked_aside(row["kind"], row["meta"]))
        if asides:
            prior = plan.knobs["aside_prior"]
            lifted = {i: views_lifted(plan.query, by_id[i]["meta"], plan.knobs) for i in asides}
            share = {i: prior + (1 - prior) * lift for i, lift in lifted.items()}
            looked = sorted(((i, score * share[i] if i in asides else score, parts) for i, score, parts in looked),
                            key=lambda f: (-f[1], f[0]))
    if plan.knobs["passed_runs"] > 0 and not RUN_ASKED.search(plan.query):
        # Not asked how to run something: a note that a run passed says little more than the question's words.
        # As with the asides: a note in the first `slots` drops, so the rows past them are read to rise or drop too.
        if any(_a_passed_note(row) for row in by_id.values()):
            by_id.update(_rows(conn, [f[0] for f in looked if f[0] not in by_id]))
            noted, keep = {i for i, row in by_id.items() if _a_passed_note(row)}, 1 - plan.knobs["passed_runs"]
            looked = sorted(((i, score * keep if i in noted else score, parts) for i, score, parts in looked),
                            key=lambda f: (-f[1], f[0]))
    candidates = looked[:slots]
    sources = _sources(conn, [f[0] for f in candidates])
    # Out of date (superseded by a later memory) ranks below everything current, its successor included.
    candidates.sort(key=lambda f: f[0] in by_id and by_id[f[0]]["superseded_by"] is not None)
    raw = {s: dict(items) for s, items in scored.items()}
    results: list[Hit] = []
    cited: dict[int, Hit] = {}  # source event -> the hit that holds it
    terms = query_terms(plan.query)
    kept_words: list[tuple[Hit, frozenset[str]]] = []

    def take_slot(old: Hit, new: Hit, words: frozenset[str], mine: Sequence[int]) -> None:
        """`new` takes `old`'s slot; `old` (and what it held) is collapsed into it."""
        results[results.index(old)] = new
        kept_words[:] = [(new, words) if h is old else (h, w) for h, w in kept_words]
        new.memory["collapsed"] = [old.memory["id"], *old.memory.get("collapsed", [])]
        cited.update((e, new) for e in (*mine, *(e for e, h in cited.items() if h is old)))

    for memory_id, score, parts in candidates:
        if memory_id not in by_id:
            continue
        item = memory_dict(by_id[memory_id])
        item["score"] = round(score, 6)
        hit = Hit(item, {s: SignalHit(rank, raw[s][memory_id], part) for s, (rank, part) in parts.items()})
        evidence = item["kind"] == "evidence"
        words = text_terms(item["text"]) if evidence else frozenset()
        twin = next((h for h, w in kept_words if _near(words, w)), None) if evidence else None
        mine = sources.get(memory_id, ())
        if twin is not None:  # the same passage again (a todo list rewritten, a file read twice): one slot
            if max(mine, default=0) > max(sources.get(twin.memory["id"], ()), default=0):
                # ... and the later one is what the session went on with (a file's second version: the one whose
                # comment says the write is "not yet implemented"), so it takes the slot (coding QA: venus-09).
                take_slot(twin, hit, words, mine)
            else:
                twin.memory.setdefault("collapsed", []).append(memory_id)
            continue
        # Passages of one step collapse into the best of them (it shows the step's windows that match); passages of
        # different steps that share an event (a call and its result) stay apart.
        holder = next((cited[e] for e in mine if e in cited
                       and not (evidence and cited[e].memory["kind"] == "evidence"
                                and set(sources.get(cited[e].memory["id"], ())) != set(mine))), None)
        if holder is None:
            if len(results) < plan.limit + SPARE_HITS:
                results.append(hit)
                if evidence:
                    kept_words.append((hit, words))
                cited.update((e, hit) for e in mine if e not in cited or cited[e].memory["kind"] == "evidence")
            continue
        if holder.memory["kind"] == "evidence" and not evidence and dense_wins(terms, hit.memory, holder.memory):
            take_slot(holder, hit, words, mine)  # the dense memory: the passage it came from is collapsed into it
        else:
            holder.memory.setdefault("collapsed", []).append(memory_id)
    results = _show_windows(conn, results, {i: by_id[i]["meta"] for i in by_id}, sources, plan.query, plan.window_chars,
                            max(plan.lead_chars, plan.window_chars), plan.limit, plan.knobs["repeated"], plan.shows)
    plan.timings["fuse_ms"] = _ms(t)
    return results


def dense_wins(terms: Sequence[str], dense: Mapping[str, Any], passage: Mapping[str, Any]) -> bool:
    """A distilled memory takes the slot of the passage it came from when it says about as much of what is asked:
    more of the query's terms, or all but one of the passage's count at nearly the passage's score. A one-line
    summary of a long report ("Reported: I've investigated how sessions are launched") holds fewer of them than the
    report, and must not hide it; a procedure that names the finding asked about holds more than the bare output of
    the command that later passed, and wins."""
    mine, theirs = len(held_terms(terms, dense["text"])), len(held_terms(terms, passage["text"]))
    return mine > theirs or (mine >= theirs - 1 and dense["score"] >= DENSE_WINS * passage["score"])


def views_lifted(query: str, meta: str | None, knobs: Mapping[str, Any]) -> float:
    """How much of an aside's penalty a query lifts from it (0 to 1): a view of files (not an announcement) when the
    question asks what the code says (`CODE_ASKED`), a view of a project manifest when it asks how to run something
    (`RUN_ASKED`, `MANIFEST`). Elsewhere a view is a copy of the repository, rich in every word of the question."""
    head = passage_head(meta) or ""
    if not head or head == "Assistant:":
        return 0.0
    lift = knobs["code_views"] if knobs["code_views"] > 0 and CODE_ASKED.search(query) else 0.0
    if knobs["manifests"] > 0 and RUN_ASKED.search(query) and MANIFEST.search(head):
        lift = max(lift, knobs["manifests"])
    return lift


def _a_passed_note(row: Mapping[str, Any]) -> bool:
    """Is this the observer's note that a run passed ("Tests pass: …", "Works: …"), not a procedure?"""
    return bool(row["kind"] == "observation" and _a_run_that_worked(row["kind"], row["meta"]))


def marked_aside(kind: str, meta: str | None) -> bool:
    """Is this memory a passage of a step that says nothing of its own (`workers/evidence.is_aside`)?"""
    if kind != "evidence" or not meta or '"aside"' not in meta:
        return False
    try:
        return json.loads(meta).get("aside") is True
    except ValueError:
        return False


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def _show_windows(conn: sqlite3.Connection, hits: Sequence[Hit], metas: Mapping[int, Any],
                  sources: Mapping[int, tuple[int, ...]], query: str, budget: int, lead: int,
                  limit: int, repeated: float = REPEATED, shows: Callable[[Hit], bool] | None = None) -> list[Hit]:
    """The first `limit` hits as shown: each evidence hit shows the windows of its whole step that match the query
    (`search/windows.py`), the first hit `lead` characters of them, the others `budget`. A hit that shows nearly the
    words of one shown before it (two steps that repeat one commit message, one summary: `_repeats`) takes no
    slot: it is collapsed into that one, and the next hit moves up.

    `shows`: which hits the caller may show at all, by their signals (a prompt's keyword recall: its best few keyword
    hits); the hits past the last of those are neither windowed nor returned. Each hit is shown as it would be
    without it: what a hit shows depends only on the hits before it."""
    if shows is not None:
        hits = hits[: max((i + 1 for i, hit in enumerate(hits) if shows(hit)), default=0)]
    terms = query_terms(query)  # once, not per line

    def holds(line: str) -> frozenset[str]:
        return held_terms(terms, line)

    answers: dict[int, int] = {}
    leads: dict[int, int] = {}
    outcomes: dict[int, tuple[int, ...]] = {}
    steps: dict[tuple[int, str], tuple[int, list[str]]] = {}

    def read_for(batch: Sequence[Hit]) -> None:
        """What the hits of `batch` may show, in a few reads for them all."""
        # What a user's ask led to: the turn's answer, shown with the ask (`_answers`).
        asked = _answers(conn, [(hit.memory["session_id"], sources[hit.memory["id"]][-1]) for hit in batch
                                if "goal" in hit.memory["tags"] and sources.get(hit.memory["id"])])
        answers.update(asked)
        # The steps every hit may show, in one read: an evidence hit's own step, an observation's source steps.
        wanted = {e for hit in batch if hit.memory["kind"] in ("evidence", "observation") for e in
                  sources.get(hit.memory["id"], ())[:1 if hit.memory["kind"] == "evidence" else MAX_SOURCE_STEPS]}
        # What an announcement ("…but let me check the specific test to understand:") led to: the agent's next
        # message, what the check found (coding QA dev set: templar-ci-08 8 -> 3, all@5 .74 -> .75, recall .53 -> .54).
        led = {hit.memory["id"]: start for hit in batch if (start := _leads_on(hit, metas, sources)) is not None}
        leads.update(led)
        sessions = {hit.memory["id"]: hit.memory["session_id"] for hit in batch}
        found = _outcomes(conn, [(sessions[i], start) for i, start in led.items()]) if led else {}
        needed = wanted | set(asked.values()) | {e for o in found.values() for e in o}
        read = _steps(conn, sorted(needed)) if needed else {}
        steps.update(read)
        # Every word the windows may ask `holds` about, stemmed in one call: line by line, a call each cost ~40 µs
        # however few its new words (a prompt's windows 8-10 ms after a catch-up).
        _prestem(terms, (line for _, lines in read.values() for line in lines))
        # A message that announces again ("Let me check if there's a specific test…:") leads on to the next one.
        for said_first, chain in found.items():
            ends = [i for i, said in enumerate(chain) if not _announces(steps, said)]
            outcomes[said_first] = chain[: ends[0] + 1] if ends else chain

    shown: list[tuple[Hit, frozenset[str]]] = []
    cited: set[int] = set()  # the source events of the hits shown so far and of those collapsed into them
    for index, hit in enumerate(hits):
        if len(shown) == limit:
            break
        if index in (0, limit):  # the hits past the first `limit` are read for only when some collapse
            read_for(hits[index : limit if not index else None])
        memory_id = hit.memory["id"]
        head = passage_head(metas.get(memory_id)) if hit.memory["kind"] == "evidence" else None
        events = sources.get(memory_id, ())
        room = lead if not shown else budget
        if head is not None and events:
            passages, lines = steps.get((events[0], head), (0, []))
            if passages > 1 or len(hit.memory["text"]) > room:
                hit.memory["text"] = best_windows(head, lines, holds, room)
        own = hit.memory["text"]
        led = leads.get(memory_id)
        outcome = tuple(e for e in outcomes.get(led, ()) if e not in cited) if led is not None else ()
        if outcome and hit.memory["kind"] == "evidence":
            hit.memory["text"] = _with_source_lines(own, outcome, steps, holds, room)
        if hit.memory["kind"] == "observation" and events:
            answer = answers.get(events[-1])
            # An answer a hit above stands for already (its report, shown or collapsed into one) is not shown twice.
            # A failed run's note: what the agent said next, whatever it went on to announce.
            after = (answer,) if answer is not None and answer not in cited else outcome[:1]
            shown_steps = (*events[:MAX_SOURCE_STEPS], *after)
            hit.memory["text"] = _with_source_lines(own, shown_steps, steps, holds, room)
        words = text_terms(hit.memory["text"])
        # An observation repeats a hit shown above it by what it says itself, not by the lines of its step it shows.
        says = _wordy(text_terms(own) if own is not hit.memory["text"] else words)
        twin = next((h for h, w in shown if _repeats(says, w, repeated)), None)
        folded = [memory_id, *hit.memory.get("collapsed", [])] if twin is not None else hit.memory.get("collapsed", [])
        cited.update(e for i in (memory_id, *folded) for e in sources.get(i, ()))
        if twin is not None:
            twin.memory.setdefault("collapsed", []).extend(folded)
            continue
        shown.append((hit, words))
    return [hit for hit, _ in shown]


def _answers(conn: sqlite3.Connection, asks: Sequence[tuple[str | None, int]]) -> dict[int, int]:
    """For each (session, the event of a user's ask): the event of the agent's last message before the user spoke
    again — the turn's answer. "User asked: can you write a balanced opinion?" is found by the question's words;
    what the agent wrote back is what a later agent wants (coding QA: all@5 .70 → .71)."""
    found = _rest_of_turn(conn, asks, ("assistant_message", "Stop", "TurnComplete"), last=True, limit=1)
    return {asked: said[0] for asked, said in found.items()}


def _rest_of_turn(conn: sqlite3.Connection, starts: Sequence[tuple[str | None, int]], kinds: Sequence[str], *,
                  last: bool, limit: int) -> dict[int, tuple[int, ...]]:
    """For each (session, an event): the events of the agent's messages (`kinds`) after it and before the user spoke
    again, the first `limit` of them in order, or (`last`) the last ones, latest first."""
    found: dict[int, tuple[int, ...]] = {}
    marks = ",".join("?" * len(kinds))
    for session_id, start in starts:
        if session_id is None or start in found:
            continue
        rows = conn.execute(
            f"SELECT id FROM events WHERE session_id = ?1 AND id > ?2 AND kind IN ({marks}) AND id < coalesce((SELECT"
            " min(id) FROM events WHERE session_id = ?1 AND id > ?2 AND kind IN ('user_message', 'UserPromptSubmit')),"
            f" 9223372036854775807) ORDER BY id {'DESC' if last else 'ASC'} LIMIT ?",
            [session_id, start, *kinds, limit]).fetchall()
        if rows:
            found[start] = tuple(int(r[0]) for r in rows)
    return found


def _announces(steps: Mapping[tuple[int, str], tuple[int, list[str]]], event: int) -> bool:
    lines = steps.get((event, "Assistant:"), (0, []))[1]
    return bool(lines) and lines[-1].rstrip().endswith(":")


def _leads_on(hit: Hit, metas: Mapping[int, Any], sources: Mapping[int, tuple[int, ...]]) -> int | None:
    """The event whose outcome, the agent's next message, a hit should show: an announcement's ("…let me check the
    specific test:"), or a failed run's observation ("`pnpm typecheck` failed: …": what the agent made of the failure,
    "the cli.ts errors are in the existing codebase"; coding QA: big3-08 not in 10 -> 1). The passage of a failed
    run showing it too was measured and left out (templar-ci-08 3 -> 7: the run's own lines lose their room)."""
    events = sources.get(hit.memory["id"])
    if not events:
        return None
    text = hit.memory["text"]
    if hit.memory["kind"] == "observation":
        return events[-1] if _FAILED_RUN.match(text) else None
    announces = passage_head(metas.get(hit.memory["id"])) == "Assistant:" and text.rstrip().endswith(":")
    return events[0] if hit.memory["kind"] == "evidence" and announces else None


_FAILED_RUN = re.compile(r"`[^\n`]*` failed:")  # the observer's note of a failed run (`workers/rules.py`)


def _outcomes(conn: sqlite3.Connection, announced: Sequence[tuple[str | None, int]]) -> dict[int, tuple[int, ...]]:
    """For each (session, the event of an announcing message): the events of the agent's next `OUTCOME_HOPS`
    messages before the user spoke again — what the tool calls it announced found (`_show_windows` keeps them up to
    the first that does not announce again)."""
    return _rest_of_turn(conn, announced, ("assistant_message",), last=False, limit=OUTCOME_HOPS)


def _steps(conn: sqlite3.Connection, events: Sequence[int]) -> dict[tuple[int, str], tuple[int, list[str]]]:
    """The steps stored as evidence passages of `events`, by (event, the step's header): how many passages, and
    the step's lines."""
    parts: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for event_id, text, meta in conn.execute(
            "SELECT s.event_id, m.text, m.meta FROM memory_sources s JOIN memories m ON m.id = s.memory_id WHERE"
            " s.event_id IN (SELECT value FROM json_each(?)) AND m.kind = 'evidence' AND m.archived_at IS NULL",
            [json.dumps(list(events))]).fetchall():
        head = passage_head(meta)
        if head is not None:
            parts.setdefault((event_id, head), []).append((json.loads(meta).get("part", 0), text))
    return {key: (len(texts), merge_passages(key[1], [text for _, text in sorted(texts)]))
            for key, texts in parts.items()}


def _with_source_lines(text: str, events: Sequence[int], steps: Mapping[tuple[int, str], tuple[int, list[str]]],
                       holds: Callable[[str], frozenset[str]], room: int) -> str:
    """An observation followed by the lines of its source step that match the query, in the room a passage hit
    would have: an observation is a clip ("Reported: <first sentence>", "User asked (before compaction): …",
    "Edited a, b") that takes the slot of the step it came from (the provenance collapse), and the answer is often
    further down that step (coding QA dev set: all@5 .62 → .66, tokens in the top 5 645 → 724). Of
    several source steps (an observation of many edits), the one whose lines hold the most query terms, then the
    others holding one while room is left (all@5 .68 → .69); a line that says nearly only what the clip says (a
    report's first line is its "Reported: …") is not shown again."""
    own, left = text, room - len(text) - 1
    said = text_terms(text)

    def new(line: str) -> bool:  # not what the clip says already ("Perfect! <the reported sentence> …")
        words = text_terms(line)
        return line.strip() not in text and (not words or len(words - said) > (1 - REPEATED) * len(words))

    mine = {key: [line for line in value[1] if new(line)] for key, value in steps.items() if key[0] in events}
    held = {key: frozenset().union(*(holds(line) for line in lines)) for key, lines in mine.items()}
    # The steps holding the most query terms first, the next one while room is left and it holds one (an observation
    # of two edits: the second file's change is the answer as often as the first's).
    for key in sorted(mine, key=lambda k: (-len(held[k]), events.index(k[0]))):
        if left < MIN_SOURCE_ROOM:
            break
        if text != own and not held[key]:
            continue
        head = key[1]
        body = best_windows(head, mine[key], holds, left + len(head) + 1)[len(head) + 1:]
        shown = body.strip(f" {GAP}\n")
        if shown and shown not in text:
            text = f"{text}\n{body}"
            left -= len(body) + 1
    return text


def _repeats(mine: frozenset[str], shown: frozenset[str], share: float = REPEATED) -> bool:
    """A hit whose words (`_wordy`) are nearly all in one shown before it (the same block, a shorter window of it)
    shows nothing new."""
    return len(mine) >= REPEAT_MIN_TERMS and len(mine & shown) >= share * len(mine)


def _wordy(terms: frozenset[str]) -> frozenset[str]:
    """The terms a repeat is judged by: numbers do not count. Texts of one moment share its date and time ("4:33 pm
    on 12 July, 2023"), and a short turn of a dialog said then was its neighbour's repeat by them (LoCoMo
    conversations 0-4: c1-4 R@10 .785 -> .786, coding QA unchanged)."""
    return frozenset(term for term in terms if not term.isdigit())


def _near(a: frozenset[str], b: frozenset[str]) -> bool:
    """Two texts that say nearly the same words (Jaccard over their terms). Each evidence candidate of a search is
    asked of every one kept before it: sizes too far apart to be near (Jaccard is at most the smaller over the
    larger) are not intersected, and the union is counted, not built (a long prompt's recall: 1.2 ms of ~12)."""
    small, large = sorted((len(a), len(b)))
    if not small or small < NEAR_DUPLICATE * large:
        return False
    shared = len(a & b)
    return shared >= NEAR_DUPLICATE * (small + large - shared)


def _rows(conn: sqlite3.Connection, ids: Sequence[int]) -> dict[int, Any]:
    """The memories' rows by id."""
    rows = conn.execute("SELECT m.* FROM memories m WHERE m.id IN (SELECT value FROM json_each(?))",
                        [json.dumps(list(ids))]).fetchall()
    return {row["id"]: row for row in rows}


def _sources(conn: sqlite3.Connection, ids: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Each memory's source events (what it was made from)."""
    found: dict[int, list[int]] = {}
    for memory_id, event_id in conn.execute(
            "SELECT memory_id, event_id FROM memory_sources WHERE memory_id IN (SELECT value FROM json_each(?))",
            [json.dumps(list(ids))]).fetchall():
        found.setdefault(memory_id, []).append(event_id)
    return {k: tuple(v) for k, v in found.items()}


def _session_end(conn: sqlite3.Connection, best: Sequence[tuple[int, float, Any]], where: str,
                 params: Sequence[Any]) -> list[tuple[int, float]]:
    """The `ENDING_STEPS` latest memories (evidence and observations, by their latest source event) of the session
    the `best` hits weigh most in (summed fused score), latest first."""
    score = {i: s for i, s, _ in best}
    weight: dict[str, float] = {}
    for memory_id, session_id in conn.execute(
            "SELECT id, session_id FROM memories WHERE id IN (SELECT value FROM json_each(?)) AND session_id IS NOT"
            " NULL", [json.dumps(list(score))]).fetchall():
        weight[session_id] = weight.get(session_id, 0.0) + score[memory_id]
    if not weight:
        return []
    session = max(weight, key=lambda k: (weight[k], k))
    rows = conn.execute(
        f"SELECT m.id, max(s.event_id) AS last FROM memories m JOIN memory_sources s ON s.memory_id = m.id"
        f" WHERE m.session_id = ? AND m.kind IN ('evidence', 'observation') AND {where} GROUP BY m.id"
        f" ORDER BY last DESC, m.id DESC LIMIT ?", [session, *params, ENDING_STEPS]).fetchall()
    return [(r[0], float(place)) for place, r in enumerate(rows, 1)]  # its raw score: its place from the end


def _user_words(conn: sqlite3.Connection, best: Sequence[tuple[int, float, Any]], where: str,
                params: Sequence[Any]) -> list[tuple[int, float]]:
    """The user's own words (`_in_user_voice`) said last before and first after each of the `best` hits, by the summed
    fused score of the hits they frame, best first (of one event's, the prompt's own passage first). Asked what the
    user wanted, the answer is what the user said around the work the question is about, in words the question
    rarely shares ("also use tdd and serena and the mcp tools", said as the SDK work started; "why tf are you editing
    generated code!")."""
    found = _around(conn, best, where, params, "(m.kind IN ('constraint', 'preference') OR (m.kind = 'evidence'"
                    " AND m.text LIKE 'User:%') OR (m.kind = 'observation' AND m.meta LIKE '%\"by\"%'))",
                    _in_user_voice, before=True)
    return [(i, w) for i, (w, kind) in sorted(found.items(), key=lambda f: (-f[1][0], f[1][1] != "evidence", f[0]))]


def _edits_after(conn: sqlite3.Connection, best: Sequence[tuple[int, float, Any]], where: str,
                 params: Sequence[Any]) -> list[tuple[int, float]]:
    """The edits (`_an_edit`) made first after each of the `best` hits, by the summed fused score of the hits they
    follow, best first. Asked what fixed something, the answer is the change made after the failure, the report or
    the finding the question's words find ("A subagent reported that the langgraph dependency could not be installed.
    What was the fix?": the edit of package.json that followed)."""
    found = _around(conn, best, where, params, _EDITS_SQL, _an_edit, before=False)
    return [(i, w) for i, (w, _) in sorted(found.items(), key=lambda f: (-f[1][0], f[0]))]


def _around(conn: sqlite3.Connection, best: Sequence[tuple[int, float, Any]], where: str, params: Sequence[Any],
            which: str, pick: Callable[[str, str | None, str], bool], before: bool) -> dict[int, tuple[float, str]]:
    """For each of the `best` hits: in its session, the memories (`which`, an SQL condition over alias m, and
    `pick(kind, meta, text)`) of the first event after the hit and (`before`) of the last one at or before it. Each
    such memory: the summed fused score of the hits it frames, and its kind."""
    ids = [i for i, _, _ in best]
    sources = _sources(conn, ids)
    sessions = {r[0]: r[1] for r in conn.execute(
        "SELECT id, session_id FROM memories WHERE id IN (SELECT value FROM json_each(?)) AND session_id IS NOT NULL",
        [json.dumps(ids)]).fetchall()}
    picked: dict[str, list[tuple[int, int, str]]] = {}  # session -> (the memory's latest event, memory, kind)
    for session_id in set(sessions.values()):
        rows = conn.execute(
            f"SELECT m.id, max(s.event_id), m.kind, m.meta, m.text FROM memories m JOIN memory_sources s"
            f" ON s.memory_id = m.id WHERE m.session_id = ? AND {where} AND {which} GROUP BY m.id",
            [session_id, *params]).fetchall()
        picked[session_id] = sorted((int(r[1]), int(r[0]), r[2]) for r in rows if pick(r[2], r[3], r[4]))
    weight: dict[tuple[str, int], float] = {}
    for memory_id, score, _ in best:
        session_id = sessions.get(memory_id)
        events = sources.get(memory_id)
        if session_id is None or not events or not picked.get(session_id):
            continue
        when = [event for event, _, _ in picked[session_id]]
        framing = [bisect.bisect_right(when, max(events))]
        if before:
            framing.append(bisect.bisect_right(when, min(events)) - 1)
        for at in framing:
            if 0 <= at < len(when):
                weight[(session_id, when[at])] = weight.get((session_id, when[at]), 0.0) + score
    return {memory_id: (weight[(session_id, event)], kind) for session_id, found in picked.items()
            for event, memory_id, kind in found if (session_id, event) in weight}


def _worked(conn: sqlite3.Connection, best: Sequence[tuple[int, float, Any]], where: str,
            params: Sequence[Any]) -> list[tuple[int, float]]:
    """Of the `best` hits, in their order, the runs that worked: a procedure, the observer's note of a command that
    passed ("Tests pass: `PYTHONPATH=src python3 -m pytest tests/ -v`", "Works: `pnpm build`"). Asked how to run
    something, the answer is the command that worked, which a passage that only names the project and its tests
    ("mkdir -p /tmp/loopkit/tests") outranks by its words."""
    rows = _rows(conn, [i for i, _, _ in best])
    return [(i, score) for i, score, _ in best if i in rows and _a_run_that_worked(rows[i]["kind"], rows[i]["meta"])]


def _a_run_that_worked(kind: str, meta: str | None) -> bool:
    if kind == "procedure":
        return True
    try:
        return kind == "observation" and json.loads(meta or "{}").get("type") == "procedure"
    except ValueError:
        return False


# What `_an_edit` reads, in SQL: an evidence passage opens with its step's header, the tool's name first.
_EDITS_SQL = ("((m.kind = 'evidence' AND (substr(m.text, 1, instr(m.text, ' ') - 1) IN ("
              + ", ".join(f"'{tool}'" for tool in sorted(EDIT_TOOLS)) + ") OR instr(m.text, '*** Begin Patch') > 0))"
              " OR (m.kind = 'observation' AND m.meta LIKE '%\"files\"%'))")


def _an_edit(kind: str, meta: str | None, text: str) -> bool:
    """Is this memory a change to files: a passage of an edit tool's step (a Codex patch too), the observer's note of
    the files a turn edited or created?"""
    if kind == "evidence":
        return (passage_head(meta) or "").split(" ", 1)[0] in EDIT_TOOLS or "*** Begin Patch" in text
    try:
        return kind == "observation" and bool(json.loads(meta or "{}").get("files"))
    except ValueError:
        return False


def _in_user_voice(kind: str, meta: str | None, text: str) -> bool:
    """Is this memory the human user's own words: a prompt's passage (not only a slash command's echo), a note the
    observer took of what the user said, chose or rejected (`by: user`), a constraint or preference (captured from the
    user's prompts only)?"""
    if kind in ("constraint", "preference"):
        return True
    if kind == "evidence":
        return passage_head(meta) == "User:" and bool(clean_user_text(text.removeprefix("User:")))
    try:
        return kind == "observation" and json.loads(meta or "{}").get("by") == "user"
    except ValueError:
        return False


def _facts(conn: sqlite3.Connection, ids: set[int]) -> dict[int, tuple[float, int]]:
    if not ids:
        return {}
    rows = conn.execute(
        "SELECT m.id, m.created, coalesce(v.recurrence, 0) FROM memories m LEFT JOIN memory_vectors v"
        " ON v.memory_id = m.id WHERE m.id IN (SELECT value FROM json_each(?))", [json.dumps(sorted(ids))]).fetchall()
    return {r[0]: (float(r[1]), int(r[2])) for r in rows}


def _prior_pool(conn: sqlite3.Connection, where: str, params: Sequence[Any], n: int,
                active: Mapping[str, float]) -> set[int]:
    """Recency or recurrence alone: the newest and the most recurring memories that pass the filters."""
    pool: set[int] = set()
    if "recency" in active:
        rows = conn.execute(
            f"SELECT m.id FROM memories m WHERE {where} ORDER BY m.created DESC, m.id DESC LIMIT ?",
            [*params, n]).fetchall()
        pool.update(r[0] for r in rows)
    if "recurrence" in active:
        rows = conn.execute(
            f"SELECT m.id FROM memories m JOIN memory_vectors v ON v.memory_id = m.id WHERE v.recurrence > 0"
            f" AND {where} ORDER BY v.recurrence DESC, m.id LIMIT ?", [*params, n]).fetchall()
        pool.update(r[0] for r in rows)
    return pool
