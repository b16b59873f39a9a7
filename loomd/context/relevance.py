"""Whether a prompt gets a recall at all, and which hits its block shows: pure rules over the prompt's words and each
hit's signals.

Nothing rather than noise. A prompt is asked about only in the user's own words (a slash command's echo, the IDE's
note of an open file, a pasted command output are not what the user asked), and only a prompt that asks something
memory can answer gets a block: a question about the project with words of its own to match ("how do I run the
lint suite?", "why did the CI jobs fail?"). A go-ahead, a short steer ("merge PR", "is this tested?") or a task to
carry out ("add a gitignore file", "fix the remaining warnings") gets nothing: the agent works on the repository as
it is now and reads what it needs; and a session that replayed its earlier work for every such prompt would spend
more on the recall than on its own turns (bench/tokens.py --again). A hit that only says back what the prompt says (the
same request, typed in an earlier session) adds nothing and is never shown.
"""

from __future__ import annotations

import functools
import math
import re

from loomd.ingest.sentences import ACK
from loomd.search.fusion import query_terms, text_terms
from loomd.search.retrieval import Hit, covered_terms, held_terms
from loomd.store.entities import extract_entities

KEYWORD_TOP = 3  # without a cosine, only the best few keyword hits are candidates at all
QUESTION_TERMS = 2  # a question needs this many words of its own to match ("is this tested?" has one)
# A hit whose words are all the prompt's but for this share of its own says the prompt back ("User: <the prompt>");
# a short answer names at least one thing the question does not ("Bumped the version in manifest.json").
ECHO_NEW_SHARE = 0.2

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# Words that open a sentence without changing what it asks: "ok, dumb question, how do I …", "Wait, does it …".
_LEAD = re.compile(r"^(?:(?:ok(?:ay)?|so|also|and|but|wait|well|hey|hmm+|now|then|alright|right|sorry|btw|quick"
                   r"|dumb|stupid|one|another|last|question|q)\b[\s,:;.!-]*)+", re.IGNORECASE)
# A request phrased as a question is a task: "can you add …?", "would you mind fixing …?", "can we have a section?".
_REQUEST = re.compile(r"\b(?:can|could|would|will|won't|wouldn't|shall)\s+(?:you|u|we)\b(?!\s+(?:see|tell|know|find|"
                      r"remember|recall)\b)|\b(?:would|do) you mind\b|\bplease\b", re.IGNORECASE)
# A tag that only seeks agreement does not make a statement a question: "…, right?", "…, ok?".
_TAG_WORDS = ("right", "ok", "okay", "yeah", "yes", "no", "correct", "is that clear", "got it", "understood", "clear",
              "makes sense")
_TAG = re.compile(rf"[,;]?\s*(?:{'|'.join(map(re.escape, _TAG_WORDS))})\s*\?+\s*$", re.IGNORECASE)
_TAG_LONGEST = max(map(len, _TAG_WORDS))
# A sentence that asks, with or without its question mark: "how do I run the tests", "where is the config".
_ASKS = re.compile(r"^(?:how|what|why|where|which|when|who|whose)\b(?:\s+\w+)?\s+(?:do|does|did|is|are|was|were|can|"
                   r"could|should|would|will|has|have|had|to|'?s|much|many|long|often)\b", re.IGNORECASE)


def asks_memory(text: str) -> bool:
    """Does the prompt ask something memory can answer: a question (not a request phrased as one) with at least
    `QUESTION_TERMS` words to match? `text`: the user's own words (`clean_user_text`)."""
    if ACK.match(text) or len(query_terms(text, limit=QUESTION_TERMS)) < QUESTION_TERMS:
        return False
    for sentence in _SENTENCE.split(text):
        sentence = _LEAD.sub("", without_tag(sentence.strip()))
        if not sentence or sentence.endswith("!") or _REQUEST.search(sentence):
            continue
        if sentence.endswith("?") or _ASKS.match(sentence):
            return True
    return False


def without_tag(sentence: str) -> str:
    """`sentence` less its closing tag (`_TAG`), searched for only where it can be: a tag word ends with a letter,
    where the sentence's closing run of spaces and question marks begins, so a match starts at most the longest tag
    word, a run of spaces and a comma before that. The same result as the whole sentence searched, which cost a
    prompt with a pasted file 1-3 ms on the hook path (every position tried against every tag word)."""
    end, asked = len(sentence), False
    while end and (sentence[end - 1] == "?" or sentence[end - 1].isspace()):
        asked = asked or sentence[end - 1] == "?"
        end -= 1
    if not asked:
        return sentence  # `\?+` needs a question mark in that closing run
    start = max(0, end - _TAG_LONGEST)
    while start and sentence[start - 1].isspace():
        start -= 1
    if start and sentence[start - 1] in ",;":
        start -= 1
    found = _TAG.search(sentence, start)
    return sentence if found is None else sentence[: found.start()] + sentence[found.end() :]


def echoes(prompt: str, text: str) -> bool:
    """Does a memory only say the prompt back (the same question from an earlier session, its capture): all of its
    words are the prompt's but for a few?"""
    terms = tuple(text_terms(text))
    new = len(terms) - len(held_terms(terms, prompt))
    return new <= ECHO_NEW_SHARE * len(terms)


def relevant(hit: Hit, min_score: float, prompt: str) -> bool:
    """Inject a hit only when the meaning matches: a close vector, or a keyword hit that is not far off, or, for a
    prompt asking what the user wanted, the user's own words the search found around the work it is about (`voice`).

    Without a cosine (the keyword recall, or no embedder) a hit must be a top keyword hit that names one of the
    prompt's entities or holds most of the prompt's words.
    """
    vec, fts = hit.signals.get("vec"), hit.signals.get("fts")
    if "voice" in hit.signals:
        return True
    if vec is not None:
        return vec.score >= min_score or (fts is not None and vec.score >= min_score - 0.15)
    if not keyword_candidate(hit):
        return False
    text = hit.memory["text"]
    if prompt_entities(prompt) & {name for name, _ in extract_entities(text)}:
        return True
    held, terms = covered_terms(prompt, text)
    return terms > 0 and held >= min(terms, max(2, min(5, math.ceil(0.4 * terms))))


def recalled(hits: list[Hit], min_score: float, prompt: str) -> list[Hit]:
    """The hits a prompt's block shows, in the search's order, none that only says the prompt back: each `relevant`
    one and, once one is (the prompt is about something stored: nothing rather than noise), each keyword hit the
    vector signal did not reach, and each of the best `KEYWORD_TOP` keyword hits whatever its cosine.

    With thousands of passages the vector signal's candidates are a small share of the store: a passage outside
    them is not far in meaning, it was ranked by its words, and the fusion put it among the prompt's best hits. A
    passage among the best few by its words holds what the question names (a command's output, an error's line),
    which a sentence embedding reads as far from a question (coding QA dev set: recall block .56 -> .57, no loss).
    A keyword-only recall (or no embedder) has no cosine for any hit: there each hit still needs `relevant`."""
    hits = [h for h in hits if not echoes(prompt, h.memory["text"])]
    shown = [relevant(h, min_score, prompt) for h in hits]
    if not any(shown) or not any("vec" in h.signals for h in hits):
        return [h for h, ok in zip(hits, shown, strict=True) if ok]
    return [h for h, ok in zip(hits, shown, strict=True) if ok or _by_words(h)]


def keyword_candidate(hit: Hit) -> bool:
    """Whether a hit without a cosine may be shown at all (`relevant`), by its signals alone: the user's words around
    the work asked about, or one of the best `KEYWORD_TOP` keyword hits. A keyword recall's search windows no hit
    past the last of these (`search_hits`' `shows`): on the hook path, the windows of the hits it would drop cost
    as much as those it shows."""
    fts = hit.signals.get("fts")
    return "voice" in hit.signals or (fts is not None and fts.rank <= KEYWORD_TOP)


def _by_words(hit: Hit) -> bool:
    """A keyword hit the vector signal did not reach, or one of the best few keyword hits."""
    fts = hit.signals.get("fts")
    return fts is not None and ("vec" not in hit.signals or fts.rank <= KEYWORD_TOP)


@functools.lru_cache(maxsize=64)
def prompt_entities(prompt: str) -> frozenset[str]:
    """The prompt's entity names (asked once per hit, so kept for the few prompts in flight)."""
    return frozenset(name for name, _ in extract_entities(prompt))
