"""Zero-LLM entity extraction: the nodes of the entity graph (`mentions` edges) and the query's entry points.

Rules, not a model: URLs, file paths, shell commands, packages, code identifiers and capitalised names, each
normalised to lower case so "Caroline's", "caroline" and "CAROLINE" meet in one node. Deterministic: the same text
always gives the same list, in order of first appearance, without duplicates.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Entity types, as stored in `entities.type`.
URL = "url"
PATH = "path"
COMMAND = "command"
PACKAGE = "package"
IDENTIFIER = "identifier"
NAME = "name"

MAX_ENTITY_CHARS = 200

_URL_RE = re.compile(r"\bhttps?://[^\s<>\"'`]+", re.IGNORECASE)
_EXTENSIONS = (
    "py|pyi|ipynb|js|mjs|cjs|ts|tsx|jsx|json|jsonl|toml|yaml|yml|ini|cfg|conf|env|md|rst|txt|csv|tsv|html|css|scss|"
    "sql|db|sqlite|sh|bash|zsh|fish|ps1|rs|go|c|h|cc|cpp|hpp|java|kt|swift|rb|php|lua|r|jl|scala|cs|vue|svelte|"
    "lock|log|xml|proto|graphql|tf|dockerfile|mk|gradle|plist|service|socket|msgpack|onnx|whl|gz|zip|tar"
)
# A path: rooted (/, ~/, ./, ../), or two or more slashes, or a slash and a known extension; or a bare file name
# with a known extension. "and/or" and "input/output" stay words.
_PATH_RE = re.compile(
    r"(?<![\w/.~-])(?:"
    r"(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+/?"  # rooted
    r"|[\w.@+-]+(?:/[\w.@+-]+){2,}/?"  # a/b/c
    rf"|[\w.@+-]+/[\w@+-]+\.(?:{_EXTENSIONS})"  # a/b.py
    rf"|[\w@+-]+(?:\.[\w@+-]+)*\.(?:{_EXTENSIONS})"  # b.py
    r")(?![\w/])",
    re.IGNORECASE,
)
_TOOLS = (
    "git|gh|pip|pip3|pipx|uv|uvx|poetry|pdm|conda|python|python3|pytest|tox|nox|ruff|mypy|black|npm|npx|pnpm|yarn|"
    "bun|deno|node|tsc|cargo|rustup|rustc|go|make|cmake|ninja|gcc|clang|docker|podman|kubectl|helm|terraform|"
    "systemctl|journalctl|launchctl|brew|apt|apt-get|dnf|yum|pacman|curl|wget|ssh|scp|rsync|tar|sqlite3|psql|"
    "claude|codex|loom|loomd"
)
# A tool followed by a subcommand: "git rebase", "uv pip", "cargo test". Flags and arguments are not part of it.
_COMMAND_RE = re.compile(rf"(?<![\w/.-])({_TOOLS})(?:\s+([a-z][\w-]*))?(?![\w/-])")
_INSTALL_RE = re.compile(
    r"\b(?:pip3?|uv pip|uv|poetry|pdm|pipx|npm|pnpm|yarn|bun|cargo|gem|brew|apt|apt-get|go)\s+"
    r"(?:install|add|get)((?:\s+[^\s;|&`]+)+)"
)
_ENGLISH_TOOLS = frozenset({"go", "make", "node", "tar", "apt", "loom", "helm", "bun", "black"})
_IMPORT_RE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+(?:\s*,\s*[\w.]+)*))", re.MULTILINE)
_REQ_RE = re.compile(r"^([A-Za-z0-9][\w.-]*)(?:\[[\w,.-]+\])?(?:[<>=!~@].*)?$")
_IDENT_RES = (
    re.compile(r"\b[A-Za-z_][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b"),  # snake_case, SCREAMING_CASE
    re.compile(r"\b[a-z][a-z0-9]*(?:[A-Z][a-z0-9]+)+\b"),  # camelCase
    re.compile(r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b"),  # PascalCase with two or more humps: EmbedderError
    re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?"),  # dotted: os.path.join, loomd.vectors.embed
    re.compile(r"\b[A-Za-z_]\w*\(\)"),  # call: main()
)
_DOTTED_NOT_CODE = re.compile(r"^(?:e\.g|i\.e|etc|vs|mr|mrs|ms|dr|st|a\.m|p\.m|u\.s|u\.k)$", re.IGNORECASE)
_WORD = r"[A-Z][\w'’&-]*[A-Za-z0-9]|[A-Z]"
# Capitalised words, possibly joined by a few lower-case connectors: "Game of Thrones", "New York", "LGBTQ".
_CONNECTORS = ("of", "the", "de", "da", "del", "van", "von", "&")
_NAME_RE = re.compile(rf"(?:{_WORD})(?:\s+(?:(?:{'|'.join(_CONNECTORS)})\s+)?(?:{_WORD}))*")

# Capitalised for grammar, not because they name anything: sentence starters, pronouns, interjections,
# question words, calendar words (dates are not entities here; a memory's time is its own column).
STOP_NAMES = frozenset(
    """
    a about above after again against all also although am an and another any anyway are as at away back be because
    been before being below besides between both but by can cannot could did do does doing done down during each
    either else even ever every few for from further had has have having he her here hers herself him himself his
    how however i i'd i'll i'm i've if in indeed instead into is it it's its itself just let let's like many may me
    might mine more most much must my myself neither never no nor not now of off often on once one only or other
    otherwise our ours ourselves out over own perhaps please quite rather same she should since so some still such
    than that that's the their theirs them themselves then there there's therefore these they this those though
    through thus to too under until up upon us very was we well were what what's whatever when where whether which
    while who whom whose why will with within without would yes yet you you'd you'll you're you've your yours
    yourself yourselves hey hi hello bye goodbye thanks thank cheers welcome sorry please wow whoa yay yeah yep yup
    nope nah ok okay oh ooh ah aw aww hmm huh haha hahaha lol omg btw fyi cool great awesome amazing nice sure
    totally absolutely definitely exactly right true really good glad congrats congratulations love happy
    first second third next last finally note today tomorrow yesterday tonight
    monday tuesday wednesday thursday friday saturday sunday january february march april june july august
    september october november december
    mon tue wed thu fri sat sun jan feb mar apr jun jul aug sep sept oct nov dec
    todo done fixed added removed updated changed use using used see run running make made get got set
    error errors warning warnings info debug note notes question answer user assistant system
    none true false null nil
    """.split()
)
# Names only together with another word: "New York" is a name, "New" alone starts a sentence.
WEAK_NAMES = frozenset("new old big little great best north south east west central national united saint".split())
_TRAILING = ".,;:!?)]}>'\"`’"


def _norm(text: str) -> str:
    text = text.strip().rstrip(_TRAILING).lower().replace("’", "'")
    if text.endswith("'s"):
        text = text[:-2]
    return text


def _split_possessive(span: str) -> list[str]:
    # "Caroline's LGBTQ group": a possessive ends a name, the next capital starts another.
    parts = re.split(r"(?<=['’]s)\s+", span)
    return [p for p in parts if p]


def _add_name(span: str, start: int, add: Callable[[int, int, str, str], None]) -> None:
    words = span.split()
    # Drop grammatical capitals at either end ("Thanks Caroline" -> "Caroline", "The" -> nothing).
    while words and _norm(words[0]) in STOP_NAMES:
        words.pop(0)
    while words and (_norm(words[-1]) in STOP_NAMES or words[-1].lower() in _CONNECTORS):
        words.pop()
    if not words or (len(words) == 1 and _norm(words[0]) in WEAK_NAMES):
        return
    name = " ".join(words)
    if len(words) == 1 and (len(_norm(name)) < 2 or _norm(name).isdigit()):
        return
    first = start + span.find(words[0])
    add(first, first + len(name), name, NAME)


def extract_entities(text: str) -> list[tuple[str, str]]:
    """(normalised name, type) for every entity in `text`, in order of first appearance, without duplicates."""
    found: list[tuple[int, str, str]] = []
    # One byte per character of `text`, set where an earlier (stronger) rule claimed it: a path is not also
    # read as identifiers, a URL not as a path.
    taken = bytearray(len(text))

    def free(start: int, end: int) -> bool:
        return not any(taken[start:end])

    def add(start: int, end: int, name: str, kind: str, claim: bool = True) -> None:
        name = _norm(name)
        if 1 < len(name) <= MAX_ENTITY_CHARS:
            found.append((start, name, kind))
        if claim and end > start:
            taken[start:end] = b"\x01" * (end - start)

    for m in _URL_RE.finditer(text):
        url = m.group(0).rstrip(_TRAILING)
        add(m.start(), m.start() + len(url), url, URL)
    for m in _INSTALL_RE.finditer(text):
        for word in m.group(1).split():
            if word.startswith("-"):
                continue
            ends_sentence = word[-1] in ".,;:!?"
            bare = word.rstrip(".,;:!?")
            if _norm(bare) in STOP_NAMES:
                break  # the command ended and the sentence went on: "pip install x and then ..."
            req = _REQ_RE.match(bare.strip("'\""))
            if req:
                add(m.start(1), m.start(1), req.group(1), PACKAGE, claim=False)
            if ends_sentence:
                break
    for m in _IMPORT_RE.finditer(text):
        for mod in (m.group(1) or m.group(2) or "").split(","):
            if mod.strip():
                add(m.start(), m.start(), mod.strip().split(".")[0], PACKAGE, claim=False)
    for m in _PATH_RE.finditer(text):
        if free(m.start(), m.end()) and not re.fullmatch(r"[\d./-]+", m.group(0)):
            add(m.start(), m.end(), m.group(0), PATH)
    for m in _COMMAND_RE.finditer(text):
        if not free(m.start(), m.end()):
            continue
        tool, sub = m.group(1), m.group(2)
        # "go", "make", "node" are English as often as commands: take them only where a command stands
        # (start of a line, after `$ `, inside backticks) and with a subcommand.
        before = text[max(0, m.start() - 2) : m.start()]
        at_command = m.start() == 0 or before.endswith(("`", "\n")) or before in ("$ ", "> ")
        if tool in _ENGLISH_TOOLS:
            if sub and at_command:
                add(m.start(), m.end(), f"{tool} {sub}", COMMAND)
        elif sub and _norm(sub) not in STOP_NAMES:
            add(m.start(), m.end(), f"{tool} {sub}", COMMAND)
        else:
            add(m.start(), m.start() + len(tool), tool, COMMAND)
    for pattern in _IDENT_RES:
        for m in pattern.finditer(text):
            ident = m.group(0)
            if not free(m.start(), m.end()) or _DOTTED_NOT_CODE.match(ident.rstrip("()")):
                continue
            if "." in ident and not re.search(r"[a-z]", ident, re.IGNORECASE):
                continue
            if "." in ident and ident.split(".")[-1].isdigit():
                continue  # a version or a number, not a name
            add(m.start(), m.end(), ident.rstrip("()"), IDENTIFIER)
    for m in _NAME_RE.finditer(text):
        if not free(m.start(), m.end()):
            continue
        span, pos = m.group(0), 0
        for group in _split_possessive(span):
            at = span.index(group, pos)
            pos = at + len(group)
            _add_name(group, m.start() + at, add)

    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, str]] = []
    for _, name, kind in sorted(found, key=lambda row: row[0]):
        if (name, kind) not in seen:
            seen.add((name, kind))
            out.append((name, kind))
    return out
