"""The assistant's sentences and text similarity: what the observer and the reflector read text with.

Pure and deterministic. `classify_assistant_sentence` says whether an agent's sentence states a decision, a finding
or a blocker (a user's sentences are read by `loomd.ingest.sentences`); `content_words`, `jaccard` and `polarity`
decide whether two memories say the same thing (or the opposite).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from loomd.ingest.sentences import sentences

MAX_OBSERVATION = 200



FILLER = re.compile(
    r"^(?:perfect|great|excellent|good|nice|done|ok(?:ay)?|alright|all set|got it|great news|sure|absolutely|"
    r"excellent work|success|you're welcome|of course|now|finally)\b[!.,:]*\s*", re.IGNORECASE)


_STOPWORDS = frozenset(
    "a an the and or but if then so to of in on at by for with from as is are was were be been being it its this "
    "that these those we i you he she they them our your my me us do does did done have has had will would can "
    "could should shall may might must not no yes all any some each every into onto over under about than too very "
    "just also only more most such own same other there here when where which who whom what why how let let's "
    "please now use using used user".split()
)
_NEGATION = re.compile(r"\b(never|not|no|don'?t|do not|doesn'?t|dislike|avoid|stop|without|mustn'?t|shouldn'?t|"
                       r"can'?t|cannot|won'?t|hate)\b", re.IGNORECASE)


def _stem(word: str) -> str:
    for suffix in ("ing", "ies", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def content_words(text: str) -> frozenset[str]:
    """Lower-cased, lightly stemmed words that carry meaning (stop words and negations dropped)."""
    words = re.findall(r"[a-z0-9][a-z0-9_./@+-]*", text.lower().replace("’", "'"))
    return frozenset(_stem(w.strip("./-")) for w in words
                     if w not in _STOPWORDS and not _NEGATION.fullmatch(w) and len(w.strip("./-")) > 1)


def text_key(text: str) -> str:
    """A stable key for 'says the same thing': sorted content words."""
    return " ".join(sorted(content_words(text)))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


def polarity(text: str) -> int:
    """-1 when the sentence forbids or rejects, +1 otherwise (for contradiction checks)."""
    return -1 if _NEGATION.search(text) else 1


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=False))
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


# --- user and assistant sentences -------------------------------------------------------------------------------

_WE = r"\b(?:I|we)(?:'ll| will|'ve| have|'m going to| are going to| am going to|'re going to)?\s+"
DECISION = re.compile(
    rf"{_WE}(?:decided|chose|chosen|opted|(?:am |are )?going with|go with|use|switch(?:ed)? to|migrat(?:e|ed) to|"
    r"keep|kept|stick with|replaced?|drop(?:ped)?|settled on)\b"
    r"|\blet'?s (?:use|go with|switch to|keep|stick with)\b"
    r"|\b(?:decided to|decision:|opted for|going with)\b"
    r"|\bthe (?:best|simplest|cleanest|safest|right) (?:approach|option|way|fix|solution|place) (?:is|would be)\b",
    re.IGNORECASE)
RATIONALE = re.compile(r"\b(because|since|so that|to avoid|as it|as this|given that|which means|due to|otherwise|"
                       r"in order to|to keep|to prevent|to make sure)\b", re.IGNORECASE)
_FIRST_PERSON_ACT = re.compile(r"\b(I'll|I will|I'm going to|we'll|we will|I've|I have)\s+"
                               r"(?!check|look|read|see|examine|explore|verify|find|search|run|start|begin|try|"
                               r"review|investigate|inspect|analy[sz]e|gather|fetch|get|need|also|now|first)\w+",
                               re.IGNORECASE)
FINDING = re.compile(
    r"(^(?:key finding|finding|found it|confirmed|root cause|interesting|important|turns out|it turns out|"
    r"headline)\b|\b(?:the (?:root cause|problem|issue|bug|culprit|cause) (?:is|was)|is caused by|was caused by|"
    r"turns out|found the (?:issue|problem|bug|cause)|the fix (?:is|was)|doesn't support|does not support|"
    r"is deprecated|is dead code|already (?:released|implemented|fixed|done))\b)", re.IGNORECASE)
BLOCKER = re.compile(
    r"\b(blocked (?:by|on)|can(?:no|')t proceed|unable to|not able to|permission denied|usage limit reached|"
    r"rate limit(?:ed| exceeded| reached)|hit (?:the|a) rate limit|requires? (?:your|manual)|need (?:you|your) to|"
    r"waiting (?:for|on) (?:you|your|the user)|still (?:failing|broken)|"
    r"pre-existing (?:issue|error|failure|problem|test failure)s?|unrelated to (?:our|my|the|these) changes?|"
    r"could not (?:be )?(?:resolve|fix)|couldn't (?:resolve|fix))\b", re.IGNORECASE)
_META_TALK = re.compile(r"^(?:let me|let's|i need to|i'll (?:now |first |also |then )?(?:check|look|read|start|"
                        r"examine|explore|run|search|create|update|add|fix|help|analy[sz]e|implement|execute|verify|"
                        r"continue|perform|review|proceed|do|make|write|set up|take|go|get)|now (?:let me|i'll|let's)|"
                        r"first,? let me|next,? |here(?:'s| is| are)|i'd suggest|i can|would you)", re.IGNORECASE)
_FILLER_SENTENCE = re.compile(r"^(?:you'?re (?:absolutely |completely )?right|thank you|thanks|no problem|"
                              r"happy to help|you're welcome)\b", re.IGNORECASE)


def classify_assistant_sentence(sentence: str) -> str | None:
    if len(sentence) < 25 or sentence.endswith(("?", ":")) or _META_TALK.match(sentence):
        return None
    if BLOCKER.search(sentence):
        return "blocker"
    if FINDING.search(sentence) and not re.search(r"\b(I need|need to|to know|to verify|to check)\b", sentence):
        return "finding"
    if DECISION.search(sentence):
        return "decision"
    if RATIONALE.search(sentence) and _FIRST_PERSON_ACT.search(sentence):
        return "decision"
    return None


def summary_sentence(text: str) -> str:
    """The sentence that says what a final assistant message reports (fillers like 'Perfect!' skipped)."""
    for s in [*sentences(text, prose_only=True), *sentences(text)]:
        s = FILLER.sub("", FILLER.sub("", s).strip()).strip()
        if (len(s) >= 20 and not s.endswith(("?", ":")) and not _META_TALK.match(s)
                and not _FILLER_SENTENCE.match(s)):
            return s
    return ""
