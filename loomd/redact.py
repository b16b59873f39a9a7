"""Secret and <private> scrubbing: pure functions over text and JSON-like values.

Every rule is a precompiled pattern whose variable-length parts are possessive or bounded and
anchored by a look-behind, so no input can make a match backtrack over more than a bounded window.
A rule only runs when one of its trigger substrings occurs in the text (the fast path; in a long text one
Aho-Corasick pass finds them all); a rule whose pattern cannot begin with a literal is tried only where a plain
search says it can start (`starts`).
How much of a corpus of realistic secrets it catches, and what it takes out of real transcripts, is
measured by bench/redaction.py (tests/secret_corpus.py is the corpus).
"""

import binascii
import hashlib
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import ahocorasick

PRIVATE_MARKER = "[private]"
_MARKER_PREFIX = "[REDACTED:"


def _marker(kind: str) -> str:
    return f"{_MARKER_PREFIX}{kind}]"


def _has_marker(value: str) -> bool:
    # A value holding a marker was already handled, by this rule or an earlier one; touching it again
    # would make a second pass differ from the first.
    return _MARKER_PREFIX in value or PRIVATE_MARKER in value


@dataclass(frozen=True, slots=True)
class _Rule:
    pattern: re.Pattern[str]
    # Lower-case substrings; the rule is skipped unless one occurs in the lower-cased text.
    triggers: tuple[str, ...]
    replace: Callable[[re.Match[str]], str]
    # When `replace` keeps a match, scanning resumes at the end of this group instead of the match, so a
    # kept `name = value` cannot swallow a real assignment inside its value.
    resume: str | None = None
    # Where a match can start, in ascending order, when that is cheaper to find than the pattern's own scan:
    # the pattern is then tried (`match`) at those places only, with the same result as `search`.
    starts: Callable[[str], Iterator[int]] | None = None

    def _search(self, text: str, pos: int, starts: Iterator[int] | None) -> re.Match[str] | None:
        """The first match at or after `pos`: the pattern's own scan, or its tries at the next `starts` (ascending,
        and `pos` only grows, so a start passed over is never wanted again)."""
        if starts is None:
            return self.pattern.search(text, pos)
        for start in starts:
            if start >= pos and (m := self.pattern.match(text, start)) is not None:
                return m
        return None

    def apply(self, text: str) -> str:
        out: list[str] = []
        last = pos = 0
        starts = self.starts(text) if self.starts is not None else None
        while (m := self._search(text, pos, starts)) is not None:
            new = self.replace(m)
            if new == m.group(0):
                pos = m.end(self.resume) if self.resume else m.end()
                pos = max(pos, m.start() + 1)
                continue
            out.append(text[last : m.start()])
            out.append(new)
            last = m.end()
            pos = max(last, m.start() + 1)
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)


# ---------------------------------------------------------------------------------------------
# <private> spans

_PRIVATE_TAG_RE = re.compile(r"<\s*(/?)\s*private(?:\s[^<>]{0,200})?\s*>", re.IGNORECASE)


def _strip_private(text: str) -> str:
    """Replace each outermost <private>…</private> span (nesting counted; unclosed runs to the end)."""
    out: list[str] = []
    depth = 0
    last = 0
    for m in _PRIVATE_TAG_RE.finditer(text):
        if not m.group(1):
            if depth == 0:
                out.append(text[last : m.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                out.append(PRIVATE_MARKER)
                last = m.end()
        # A closer with no opener is left alone: there is nothing to hide before it.
    if depth:
        out.append(PRIVATE_MARKER)
        last = len(text)
    out.append(text[last:])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# PEM private key blocks

_PEM_LABEL = r"[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?"
_PEM_BEGIN_RE = re.compile(rf"-{{3,5}} ?BEGIN{_PEM_LABEL} ?-{{3,5}}")
_PEM_END_RE = re.compile(rf"-{{3,5}} ?END{_PEM_LABEL} ?-{{3,5}}")
# Body of a block whose END line is missing (truncated output): whole lines of armour headers or
# base64, newlines possibly JSON-escaped; then base64 runs cut off mid-line or joined by spaces.
_PEM_NEWLINE = r"(?:\r?\n|\\+r?\\+n)"
_PEM_BODY_RE = re.compile(
    rf"(?:{_PEM_NEWLINE}[ \t]*+(?:(?:Proc-Type|DEK-Info|Comment|Version|Hash|Charset)[ \t]*:[^\r\n\\]*+"
    rf"|[A-Za-z0-9+/=]*+)(?=[ \t]*(?:[\r\n\\]|\Z)))*+(?:(?:{_PEM_NEWLINE}|[ \t])[ \t]*+[A-Za-z0-9+/=]{{16,}}+)*+"
)


def _redact_pem(text: str) -> str:
    out: list[str] = []
    pos = 0
    end_missing = False  # once an END search fails, every later BEGIN is unclosed too
    for m in _PEM_BEGIN_RE.finditer(text):
        if m.start() < pos:
            continue
        end = None if end_missing else _PEM_END_RE.search(text, m.end())
        if end is not None:
            stop = end.end()
        else:
            end_missing = True
            body = _PEM_BODY_RE.match(text, m.end())
            stop = body.end() if body else m.end()
            while stop > m.end() and text[stop - 1].isspace():
                stop -= 1
        out.append(text[pos : m.start()])
        out.append(_marker("private_key"))
        pos = stop
    out.append(text[pos:])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Secret-looking names (shared by assignments, CLI flags and redact_value)

_SEGMENT_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# A segment ending in one of these is a secret: `dbpassword`, `githubtoken`, `apikey`.
_SECRET_SUFFIXES = (
    "password", "passwords", "passwd", "passphrase", "secret", "secrets", "token", "tokens",
    "apikey", "apikeys", "accesskey", "privatekey", "secretkey", "credential", "credentials",
)  # fmt: skip
# Too short to match inside a segment (`bypass`, `oauth`); only a whole segment counts.
_SECRET_EXACT = frozenset(
    {
        "pass", "pwd", "auth", "creds", "cred", "sig", "signature", "psk", "passin", "passout",
        "storepass", "keypass", "srcstorepass", "deststorepass", "srckeypass", "destkeypass",
    }
)  # fmt: skip
# `<word>_key` pairs that are secret; a bare `key` (cache_key, primary_key) is not.
_KEY_PREFIXES = frozenset(
    {
        "api", "access", "private", "secret", "encryption", "decryption", "signing", "master", "app",
        "auth", "account", "session", "license", "shared", "client", "consumer", "storage", "hmac",
        "jwt", "webhook", "sas", "aes", "crypt", "deploy", "ssh", "gpg", "pgp", "admin", "service", "root",
        "openai", "anthropic", "stripe", "google", "maps", "github", "gitlab", "slack", "twilio", "sendgrid",
        "mailgun", "aws", "azure", "gcp", "firebase", "algolia", "mapbox", "datadog", "sentry", "write",
    }
)  # fmt: skip
# A segment after the secret word that makes the name describe the secret, not hold it:
# `password_file`, `token_url`, `secret_name`, `password_field`.
_DENY_AFTER = frozenset(
    {
        "url", "uri", "urls", "endpoint", "file", "files", "path", "paths", "dir", "name", "names",
        "field", "fields", "type", "types", "length", "len", "size", "count", "counts", "limit", "limits",
        "id", "ids", "ttl", "expiry", "expires", "expiration", "expire", "lifetime", "timeout", "prefix",
        "suffix", "header", "env", "var", "method", "mode", "provider", "enabled", "required", "scheme",
        "policy", "rotation", "pattern", "regex", "format", "hint", "label", "placeholder", "min", "max",
        "arn", "version", "location", "source", "kind", "class", "description", "help", "prompt", "text",
        "message", "msg", "error", "errors", "title", "widget", "input", "validator", "validation",
        "strength", "usage", "used", "budget", "cost", "price", "window", "per", "index", "idx", "stream",
        "parser", "helper", "manager", "store", "handler", "callback", "ref", "mask", "visible", "hidden",
        "toggle", "flag", "list", "schema", "template", "example", "stdin", "cmd", "command", "keyring",
        "end", "start", "begin", "response", "resp", "request", "req", "status", "func", "fn", "function",
        "metadata", "server", "config", "settings", "options", "str",
        "vault", "backend", "bucket", "host", "domain", "realm", "flow", "timestamp",
    }
)  # fmt: skip
# Before `token`: tokenizer and pagination vocabulary (`pad_token`, `next_token`); `INPUT_TOKEN` stays secret.
_DENY_BEFORE_TOKEN = frozenset(
    {
        "special", "pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "stop", "next", "page",
        "continuation", "cursor", "sync", "added", "image", "audio", "last", "first", "current", "cur", "prev",
        "per",
    }
)  # fmt: skip
# Before `tokens`: LLM usage and limits (`max_tokens`, `input_tokens`).
_DENY_BEFORE_TOKENS = _DENY_BEFORE_TOKEN | frozenset(
    {
        "max", "min", "num", "n", "total", "input", "output", "prompt", "completion", "cached", "cache",
        "context", "reasoning", "thinking", "per", "count", "estimated", "used", "remaining", "available",
        "limit", "budget", "new", "generated", "response", "request",
    }
)  # fmt: skip
# Secret words common in ordinary code (`sig`, `auth`, `tokens`): their value must look like a token.
_WEAK_WORDS = frozenset({"tokens", "auth", "sig", "signature", "cred", "creds"})
# A wallet's words: `MNEMONIC`, `seed_phrase`, `recoveryPhrase`; the value must be 12 to 24 words.
_PHRASE_PREFIXES = frozenset({"seed", "recovery", "secret", "backup", "wallet", "mnemonic"})
# An upper-case `<WORD>_KEY` outside `_KEY_PREFIXES` (`MAILCHIMP_KEY`, `PUSHER_KEY`) holds a key when its value
# looks like a token; these words make it a key of something else.
_NOT_SECRET_KEY_PREFIXES = frozenset(
    {
        "primary", "foreign", "sort", "partition", "cache", "hash", "idempotency", "dedup", "dedupe", "lookup",
        "map", "dict", "group", "row", "column", "col", "index", "unique", "composite", "public", "pub", "range",
        "shard", "routing", "object", "s3", "file", "message", "event", "react", "list", "item", "node", "entity",
        "record", "table", "field", "attribute", "attr", "prop", "property", "query", "search", "hot", "short",
        "shortcut", "keyboard", "press", "modifier", "translation", "i18n", "locale", "lang", "label", "title",
        "cursor", "page", "pagination", "start", "end", "next", "last", "first", "parent", "child", "join",
        "natural", "surrogate", "candidate", "alternate", "super", "meta", "state", "store", "redis", "registry",
        "host", "dns", "gpg", "pgp", "ssh", "signing",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _SecretName:
    kind: str
    weak: bool
    counted: bool  # `token`/`tokens`: a number after it is an id or a count, not a secret
    loose: bool = False  # `MAILCHIMP_KEY`: secret only when the value looks like a token, even in redact_value
    phrase: bool = False  # `MNEMONIC`: secret only when the value is a 12- to 24-word phrase


@lru_cache(maxsize=4096)
def _secret_name(name: str) -> _SecretName | None:
    """Classify an identifier such as `DB_PASSWORD`, `apiKey` or `X-Auth-Token`; None if not secret."""
    # Only the last dotted part names the value: `self.password` is secret, `Token.Keyword` is not.
    last = name.rsplit(".", 1)[-1]
    segs = [s.lower() for s in _SEGMENT_RE.findall(last)]
    hit = -1
    for i, seg in enumerate(segs):
        if seg in _SECRET_EXACT or seg.endswith(_SECRET_SUFFIXES):
            hit = i
        elif seg in ("key", "keys") and i and segs[i - 1] in _KEY_PREFIXES:
            hit = i
    if hit < 0:
        if segs and segs[-1] in ("mnemonic", "mnemonics", "seedphrase") or (
            len(segs) > 1 and segs[-1] in ("phrase", "words") and segs[-2] in _PHRASE_PREFIXES
        ):
            return _SecretName("mnemonic", False, False, phrase=True)
        if (
            len(segs) > 1
            and segs[-1] in ("key", "keys")
            and segs[-2] not in _NOT_SECRET_KEY_PREFIXES
            and _ENV_NAME_RE.fullmatch(last.lstrip("_"))
        ):
            return _SecretName("env_secret", True, False, loose=True)
        return None
    if any(s in _DENY_AFTER for s in segs[hit + 1 :]):
        return None
    word = segs[hit]
    deny_before = _DENY_BEFORE_TOKENS if word.endswith("tokens") else _DENY_BEFORE_TOKEN
    if word.endswith(("token", "tokens")) and any(s in deny_before for s in segs[:hit]):
        return None
    aws = "aws" in segs or "secretaccesskey" in segs or ("secret" in segs and "access" in segs)
    counted = word.endswith(("token", "tokens"))
    return _SecretName("aws_key" if aws else "env_secret", word in _WEAK_WORDS, counted)


# ---------------------------------------------------------------------------------------------
# Assignments: `.env`, shell, YAML, JSON, code, headers, query strings

_ASSIGN_RE = re.compile(
    r"""
    (?<![A-Za-z0-9_.\-])(?<!::)(?<!\[REDACTED:)
    (?=[A-Za-z0-9_.\-]{0,64}?(?i:pass|pwd|secret|token|key|auth|cred|sig|psk))
    (?P<name>[A-Za-z0-9_.\-]{1,128}+)
    (?P<close>\\{0,8}["'])?\]?
    (?:
        (?P<ann>[ \t]*:[ \t]*[A-Za-z_][\w.]{0,60}+(?:\[[^\]\n=]{0,80}\])?
            (?:[ \t]*\|[ \t]*[A-Za-z_][\w.]{0,60}+(?:\[[^\]\n=]{0,80}\])?){0,3}+)
        [ \t]+=(?!=)[ \t]*
      | (?P<sep>[ \t]*(?:=>|:=|===?|!==?|\+=|=|:(?!:))[ \t]*)
    )
    (?P<pre>[bBrRuUfF]{1,2}(?=["']))?
    (?:
        \\{1,8}"(?P<v1>(?:[^"\\\r\n]++|\\++(?!"))*+)(?:\\*")?
      | "(?P<v2>(?:[^"\\\r\n]|\\.)*+)"?
      | '(?P<v3>(?:[^'\\\r\n]|\\.)*+)'?
      | (?P<v4>[^\s"'`,;&)\]}<>\\]++)
    )
    """,
    re.VERBOSE,
)
_ASSIGN_WORD_RE = re.compile(r"(?i:pass|pwd|secret|token|key|auth|cred|sig|psk)")
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


_ASSIGN_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cred", "sig", "psk")


def _word_positions(text: str, words: tuple[str, ...], pattern: re.Pattern[str]) -> list[int]:
    """Where `words` (lower case) occur in `text`, any case: plain searches of the lower-cased text (a
    case-insensitive alternation's own scan cost as much as the rest of a rule), or `pattern`'s (the same words,
    case-insensitive) where lower-casing cannot stand in for it. Overlapping occurrences may be left out."""
    low = _findable_lower(text)
    if low is None:
        return [m.start() for m in pattern.finditer(text)]
    found: list[int] = []
    for word in words:
        at = low.find(word)
        while at >= 0:
            found.append(at)
            at = low.find(word, at + 1)
    return found


def _assignment_starts(text: str) -> Iterator[int]:
    """Where _ASSIGN_RE can match: the start of a name run (its first look-behind) that holds one of the words of
    its look-ahead within 64 characters. Found from the words, so a long text without them is not scanned
    position by position with a 64-character look-ahead (that scan was most of a large payload's redaction)."""
    if ":" not in text and "=" not in text:
        return iter(())  # every separator the pattern allows holds one or the other
    starts: set[int] = set()
    for at in _word_positions(text, _ASSIGN_WORDS, _ASSIGN_WORD_RE):
        start, floor = at, max(0, at - 65)
        while start > floor and text[start - 1] in _NAME_CHARS:
            start -= 1
        if start > 0 and text[start - 1] in _NAME_CHARS:
            continue  # the run starts more than 64 characters before the word: the look-ahead cannot reach it
        starts.add(start)
    return iter(sorted(starts))


_PLACEHOLDER_RE = re.compile(
    r"\s*|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\$\{\{.*\}\}|\{\{.*\}\}|\$\(.*\)|<[^<>]*>|%\([A-Za-z_]\w*\)s|\*+"
    r"|\{[A-Za-z_]\w*\}|(?i:your[\s_-].*)|.*(?:\.\.\.|…|(?i:xxxx)).*"
)
# `Token: "bold #A3AAB2"`: a colour in a syntax-highlighting style.
_COLOUR_RE = re.compile(r"(?:[a-z]+ )*#[0-9a-fA-F]{3,8}")
_REGEX_CHARS = frozenset("\\[]()^$*+?|")
_CALL_RE = re.compile(r"[A-Za-z_$@][\w.:$@]*!?[(\[]")
_DOTTED_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_IDENT_RE = re.compile(r"[A-Za-z_]\w*")
_URL_VALUE_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{1,30}://[^\s:@/]+(?:[:/?#]|$)")
_NUMBER_RE = re.compile(r"[+-]?\d+(?:\.\d+)?")
_CAMEL_RE = re.compile(r"[a-z][A-Z]")
_CODE_WORDS = frozenset(
    {
        "none", "null", "nil", "true", "false", "undefined", "yes", "no", "on", "off", "~", "str", "string",
        "bytes", "int", "integer", "float", "bool", "boolean", "number", "dict", "list", "object", "any",
        "optional", "union", "secretstr", "secretbytes", "nan", "void", "char", "await", "new", "yield",
        "lambda", "function", "async", "not", "typeof", "this", "self", "cls", "super", "require", "import",
        "mapped", "field",
    }
)  # fmt: skip


_LINE_PREFIX_RE = re.compile(r"[ \t]*(?:[-+][ \t]*)?(?:(?:export|set|declare|env)[ \t]+(?:-\w+[ \t]+)?)?")


def _at_line_start(m: re.Match[str]) -> bool:
    """True for `NAME=value` that starts a line, as in `.env` files and shell scripts."""
    start = m.start()
    # Look back a bounded distance so a huge single-line input stays linear.
    newline = m.string.rfind("\n", max(0, start - 40), start)
    if newline < 0 and start > 40:
        return False
    return _LINE_PREFIX_RE.fullmatch(m.string, newline + 1, start) is not None


def _plausible_secret(value: str) -> bool:
    """A lower-case word (`options`, `root`) is not worth hiding after a comparison or a CLI flag."""
    return len(value) >= 16 or _mixed_case(value) or any(not c.isalpha() for c in value)


_TOKEN_CHARS_RE = re.compile(r"[A-Za-z0-9+/=_%\-]{12,}")
_USER_PASS_RE = re.compile(r"[^\s:]+:[^\s:]+")


def _token_like(value: str) -> bool:
    """What an ambiguous name (`sig`, `auth`) must hold: `user:pw`, or a long non-wordy run with a digit."""
    if _USER_PASS_RE.fullmatch(value):
        return True  # `BASIC_AUTH=user:pw`
    if not _TOKEN_CHARS_RE.fullmatch(value) or not any(c.isdigit() for c in value):
        return False
    letters = sum(c.isalpha() for c in value)
    return 2 * sum(len(w) for w in _WORDY_RE.findall(value)) <= letters


_PHRASE_WORD_RE = re.compile(r"[a-z]{3,8}")
# Words of descriptions and help texts, never of a diceware passphrase or a wallet's words.
_STOPWORDS = frozenset(
    {
        "the", "a", "an", "to", "of", "for", "in", "on", "at", "by", "with", "from", "and", "or", "not", "no", "is",
        "are", "be", "was", "were", "been", "your", "you", "my", "our", "their", "this", "that", "these", "it", "its",
        "as", "if", "use", "used", "uses", "using", "enter", "here", "please", "must", "should", "will", "can",
        "may", "required", "optional", "new", "current", "old", "user", "users", "password", "passwords",
        "passphrase", "token", "key", "secret", "value", "set", "get", "when", "than", "then", "there", "which",
        "who", "what", "how", "all", "any", "each", "only", "also", "into", "via", "per", "default", "leave",
        "empty", "blank", "none", "null", "true", "false", "example", "sample", "test", "change", "changeme",
        "characters", "chars", "least", "more", "less", "minimum", "maximum",
    }
)  # fmt: skip


def _diceware(value: str) -> bool:
    """`tundra mosaic ladle crimson`: a few lower-case words joined by spaces or dashes, none of them a word
    that a description would use."""
    words = value.replace("-", " ").split()
    return (
        3 <= len(words) <= 12
        and all(w.isalpha() and w.islower() and w.isascii() and 2 <= len(w) <= 12 for w in words)
        and _STOPWORDS.isdisjoint(words)
        and len(set(words)) == len(words)
    )


def _mnemonic_like(value: str) -> bool:
    """A BIP39 wallet's words: 12, 15, 18, 21 or 24 lower-case words of 3 to 8 letters."""
    words = value.split()
    if len(words) not in (12, 15, 18, 21, 24) or not all(_PHRASE_WORD_RE.fullmatch(w) for w in words):
        return False
    return not _sentence(words)


def _keep_value(m: re.Match[str], info: _SecretName, value: str, quoted: bool) -> bool:
    """True when the value after a secret-named key is not a literal secret (a reference, a call, a type)."""
    if len(value.strip()) < 4 or _has_marker(value):
        return True  # nothing a secret could be
    if info.phrase:
        return not _mnemonic_like(value)
    if info.weak and not _token_like(value):
        return True  # `sig == "tuple"`, `auth: basic`, `tokens: OAuthToken`
    sep = (m.group("sep") or "=").strip()
    if sep in ("+=", "==", "===", "!=", "!==") and not _plausible_secret(value):
        return True  # `if token == 'root'`
    if m.group("name").lower() in ("pwd", "oldpwd") and value.startswith(("/", "~", ".")):
        return True  # the shell's working directory
    if _URL_VALUE_RE.match(value):
        return True  # a URL; one with a password in it is handled by the URL rule
    name = m.group("name")
    if quoted:
        start = m.start()
        opener = m.string[start - 1] if start else ""
        after_name = m.group(0)[m.end("name") - start :].lstrip(" \t:=>")
        if opener in "\"'" and not m.group("close") and after_name[:1] == opener:
            # `input("Password: ")`: the name sits inside a string and the "value" quote closes that string.
            return True
        pre = (m.group("pre") or "").lower()
        if ("f" in pre and "{" in value) or ("r" in pre and not _REGEX_CHARS.isdisjoint(value)):
            return True  # an f-string is interpolated; a raw string with metacharacters is a regex
        if value.lower() in (name.rsplit(".", 1)[-1].lower(), "true", "false", "null", "none", "yes", "no"):
            return True  # `EXPIRED_TOKEN = "expired_token"`, `"...-Credentials": "true"`
        if len(value.split()) >= 4 and not info.weak and "passphrase" not in name.lower() and not _diceware(value):
            return True  # prose: a help text or a description under a secret-named key
        return _PLACEHOLDER_RE.fullmatch(value) is not None or _COLOUR_RE.fullmatch(value) is not None
    bare = value.rstrip(".,:;")
    if value[0] in "[{($%" or bare.lower() in _CODE_WORDS or _PLACEHOLDER_RE.fullmatch(value):
        return True
    if _CALL_RE.match(value) or _DOTTED_RE.fullmatch(bare):
        return True  # a call, a subscript or an attribute: `tokenize(x)`, `os.environ[`, `self.token`
    if _NUMBER_RE.fullmatch(bare) and (info.weak or info.counted or len(bare) <= 3):
        return True  # `tokens: 4096`, `token=11098`, `secret = 0`
    if not _IDENT_RE.fullmatch(bare):
        return False
    # From here the value is a bare word: a variable in code, a literal in .env, YAML or INI files.
    if sep in ("+=", "==", "===", "!=", "!=="):
        return True  # `tokens += more`, `if token == other`
    if bare.lower() in name.lower() or name.lower().rsplit(".", 1)[-1] in bare.lower():
        return True  # `api_key=api_key`, `previous_token = token`, `password = password_input`
    if m.group("close") and sep == ":":
        return True  # `{"password": password}`: JSON never has bare words, so this is code
    if any(c.isdigit() for c in value):
        return False  # digits suggest a password, not a variable
    following = m.string[m.end() : m.end() + 16]
    after = following.lstrip(" \t")[:1]
    if after in (",", ")", "`") or (after == "|" and sep == ":"):
        # arguments, a tuple, a dict, a type union or rST: `f(password=pw, ...)`, `key: Key | None`, `pass :meth:`
        return True
    spaced = sep == "=" and m.group("sep") != "="
    if spaced and _ENV_NAME_RE.fullmatch(bare):
        return True  # `N_PER_TOKEN = HOP_LENGTH`: a constant assigned from another
    if not any(c.islower() for c in name):
        return False  # an upper-case name is an environment variable: `DB_PASSWORD: example`
    # `[` may be a marker a later rule put where a word was, so it counts as a word for a second pass.
    if sep == ":" and value == bare and following[:1] == " " and (following[1:2].isalpha() or following[1:2] == "["):
        return True  # prose or a docstring: `token: The access token to verify.`
    if spaced:
        return True  # PEP 8 spacing: `token = Comment` is code (an INI `password = word` is missed)
    # `password=pw_input` as a keyword argument, but `db_password=my_pw` starting a line is .env
    code_like = "_" in bare or (bare[0].islower() and _CAMEL_RE.search(bare) is not None)
    return code_like and sep != ":" and not _at_line_start(m)


def _replace_assignment(m: re.Match[str]) -> str:
    info = _secret_name(m.group("name"))
    if info is None:
        return m.group(0)
    for group in ("v1", "v2", "v3", "v4"):
        value = m.group(group)
        if value is not None:
            break
    else:  # pragma: no cover - the pattern always captures one value group
        return m.group(0)
    if _keep_value(m, info, value, quoted=group != "v4"):
        return m.group(0)
    start, end = m.span(group)
    whole = m.group(0)
    return whole[: start - m.start()] + _marker(info.kind) + whole[end - m.start() :]


# `--password hunter2` (the `=` form is an assignment). The look-ahead keeps the callback rare.
_CLI_FLAG_RE = re.compile(
    r"(?<![\w-])--?(?=[\w-]{0,64}?(?i:pass|pwd|secret|token|key|auth|cred))(?P<name>[A-Za-z][\w-]{0,64}+)"
    r"[ \t]++(?P<value>\"[^\"\r\n]*+\"?|'[^'\r\n]*+'?|[^\s\"'`;|&<>]++)"
)


_FLAG_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cred")
_FLAG_WORD_RE = re.compile(r"(?i:pass|pwd|secret|token|key|auth|cred)")


def _flag_char(c: str) -> bool:
    return c.isalnum() or c in "_-"  # `[\w-]`


def _flag_starts(text: str) -> Iterator[int]:
    """Where _CLI_FLAG_RE can match: a dash that starts a run of word characters and dashes (its look-behind)
    holding one of its look-ahead's words at most 66 characters in (two dashes and 64); found from the words, as
    `_assignment_starts` finds its own."""
    starts: set[int] = set()
    for at in _word_positions(text, _FLAG_WORDS, _FLAG_WORD_RE):
        start, floor = at, max(0, at - 66)
        while start > floor and _flag_char(text[start - 1]):
            start -= 1
        if text[start] == "-" and not (start > 0 and _flag_char(text[start - 1])):
            starts.add(start)
    return iter(sorted(starts))


def _replace_cli_flag(m: re.Match[str]) -> str:
    value = m.group("value")
    stripped = value.strip("'\"")
    info = _secret_name(m.group("name"))
    if info is None or not stripped or value.startswith("-") or _has_marker(stripped):
        return m.group(0)
    if _PLACEHOLDER_RE.fullmatch(stripped) or stripped[0] in "$%{<[" or not _plausible_secret(stripped):
        return m.group(0)  # `--password "$PW"`, or prose: `the --password option`
    if _OTHER_SOURCE_RE.match(stripped):
        return m.group(0)  # `-passin env:VAR`, `-passin file:path`
    if _ENV_NAME_RE.fullmatch(stripped):
        return m.group(0)  # `--secrets HF_TOKEN` names a variable
    start = m.start("value")
    quote = value[0] if value[0] in "'\"" else ""
    return m.group(0)[: start - m.start()] + quote + _marker("cli_password") + quote


_ENV_NAME_RE = re.compile(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+")

# `curl -u user:pass`
_CLI_USERPASS_RE = re.compile(r"(?<!\S)(?:-u|--user)[ \t]++[\"']?[^\s:\"'\[]++:(?P<pw>[^\s\"']++)")


def _replace_cli_userpass(m: re.Match[str]) -> str:
    pw = m.group("pw")
    if _has_marker(pw) or pw.startswith("$") or pw.isdigit():
        return m.group(0)  # `docker run -u 1000:1000` is a uid and a gid
    start = m.start("pw") - m.start()
    return m.group(0)[:start] + _marker("cli_password")


# ---------------------------------------------------------------------------------------------
# Commands that take a password as an argument: `redis-cli -a PW`, `keytool -storepass PW`, `mysql -pPW`,
# `zip -P PW`, `htpasswd -b FILE USER PW`, `sqlplus USER/PW@DB`, `mc alias set NAME URL KEY SECRET`,
# `aws configure set aws_secret_access_key SECRET`. Each command's own flags, so `-p` is a password only where
# that command means one (`docker login -p`, not `docker run -p 8080:80`).

# One argument: quoted (single, or double with any depth of JSON escaping), a `<placeholder>`, or a bare word;
# adjacent pieces join (`-p'pw'`). It stops at a separator (`;`, `|`, `&`, a backtick, a bracket) or a newline,
# escaped (`\n` in JSON) or not.
_ARG = (
    r"""(?:'[^'\r\n]*+'?|\\*+"(?:[^"\\\r\n]++|\\++(?!"))*+(?:\\*+")?|<[^<>\s]{1,64}+>"""
    r"""|[^\s'"\\;|&`<>()]++|\\++(?![nrt"\\]))++"""
)
_ARG_RE = re.compile(_ARG)
_QUOTE_OPEN_RE = re.compile(r"""\\*+["']""")
_OTHER_SOURCE_RE = re.compile(r"(?:env|file|fd):|stdin$")  # `openssl -passin env:VAR`, `file:path`


def _arg_inner(text: str, start: int, end: int) -> tuple[int, int, bool]:
    """The argument's leading quoted part without its quotes (`"name":` gives `name`): (start, end, quoted)."""
    q = _QUOTE_OPEN_RE.match(text, start, end)
    if q is None:
        return start, end, False
    close = text.find(q.group(), q.end(), end)  # the same quote, escaped the same way
    return q.end(), end if close < 0 else close, True


def _cli_secret(text: str, start: int, end: int, forced: bool = False, split: str = "") -> tuple[int, int] | None:
    """The span of the secret in an argument, or None for a reference (`$PW`, `env:PW`), a flag or a placeholder.
    Unless `forced` (the secret is glued to its flag, or the argument is known to be one) a bare word must look
    like a password, so prose about a flag (`the -a option`) stays."""
    start, end, quoted = _arg_inner(text, start, end)
    value = text[start:end]
    if split:
        cut = value.find(split)
        if cut < 0:
            return None  # `-U user` with no `%password`
        start += cut + 1
        value = value[cut + 1 :]
    if value.startswith("pass:"):
        start, value, forced = start + 5, value[5:], True
    elif _OTHER_SOURCE_RE.match(value):
        return None
    if not value or value[0] in "$%-" or _has_marker(value) or _PLACEHOLDER_RE.fullmatch(value):
        return None
    if not (quoted or forced or _plausible_secret(value)):
        return None
    return start, start + len(value)


@dataclass(frozen=True, slots=True)
class _Cli:
    # The next argument is the secret: `-a PW`, `-storepass PW`, nmcli's `password PW`.
    flags: frozenset[str] = frozenset()
    # The secret is glued to this flag: mysql's `-pPW` (a spaced `-p name` prompts, and `name` is the database).
    glued: str = ""
    # Only once these words lead the command (in order, among its first words): `login`, `configure set`.
    after: tuple[str, ...] = ()
    # The secret is the n-th word after `after` (flags and the values of `takes` skipped): `cargo login TOKEN`.
    nth: int = 0
    takes: frozenset[str] = frozenset()
    # The secret follows this character in the flag's value: `smbclient -U user%PW`.
    split: str = ""
    # `NAME VALUE` after `after`: the value is the secret when NAME names one (`http-basic.REPO USER PW`: the second).
    setting: bool = False


# Setting names that hold credentials though their last part does not say so (composer, poetry).
_CREDENTIAL_SETTINGS = ("http-basic.", "github-oauth.", "gitlab-oauth.", "gitlab-token.", "bitbucket-oauth.",
                        "bearer.", "pypi-token.")  # fmt: skip


def _cli_secrets(spec: _Cli, text: str, origin: int, args: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The secrets among the arguments of a command that starts at `origin`."""
    out: list[tuple[int, int]] = []
    words: list[tuple[int, int]] = []
    led = not spec.after
    pending = lead = 0
    i = 0
    while i < len(args):
        start, end = args[i]
        token = text[start:end]
        if token in spec.flags:
            if led and i + 1 < len(args) and (span := _cli_secret(text, *args[i + 1], split=spec.split)):
                out.append(span)
            i += 2
            continue
        if token.startswith("-") and len(token) > 1:
            if led and spec.glued and token.startswith(spec.glued) and len(token) > len(spec.glued):
                if span := _cli_secret(text, start + len(spec.glued), end, forced=True):
                    out.append(span)
            i += 2 if token in spec.takes else 1
            continue
        if not led:
            lead += 1
            # The first subcommand word is where _cli_starts finds the command: after a space, near it.
            near = pending or (text[start - 1] == " " and start - origin <= _SUB_REACH)
            if token == spec.after[pending] and near:
                pending += 1
                led = pending == len(spec.after)
            elif lead > 3:
                break
        else:
            words.append((start, end))
        i += 1
    plain = [(start, end) for start, end in words if "=" not in text[start:end]]  # `key=value` is an assignment
    if spec.nth and len(plain) >= spec.nth:
        if span := _cli_secret(text, *plain[spec.nth - 1]):
            out.append(span)
    if spec.setting and len(words) >= 2:
        name_start, name_end, _ = _arg_inner(text, *words[0])
        name = text[name_start:name_end]
        at = 2 if name.startswith("http-basic.") else 1  # `http-basic.REPO USER PW`
        known = "=" not in name and not _has_marker(name) and len(words) > at
        if known and (_secret_name(name) is not None or name.startswith(_CREDENTIAL_SETTINGS)):
            if span := _cli_secret(text, *words[at]):
                out.append(span)
    return out


def _htpasswd_secrets(text: str, args: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`htpasswd -b[c] FILE USER PW`, `htpasswd -nb USER PW`: the password is an argument only with `-b`."""
    letters = ""
    words: list[tuple[int, int]] = []
    skip = False
    for start, end in args:
        token = text[start:end]
        if skip:
            skip = False
        elif token.startswith("-") and len(token) > 1 and not token.startswith("--"):
            letters += token[1:]
            skip = token[-1] in "Cr"  # `-C cost`, `-r rounds`
        else:
            words.append((start, end))
    at = 1 if "n" in letters else 2
    if "b" not in letters or len(words) <= at:
        return []
    span = _cli_secret(text, *words[at], forced=True)
    return [span] if span else []


_SLASH_LOGIN_RE = re.compile(r"[^/\s@'\"\\]++/(?P<pw>[^@\s/'\"\\]++)")


def _slash_login_secrets(text: str, args: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Oracle tools: `sqlplus USER/PW@DB`, the first word after the flags."""
    for start, end in args:
        if text.startswith("-", start):
            continue
        start, end, _ = _arg_inner(text, start, end)
        m = _SLASH_LOGIN_RE.match(text, start, end)
        if m is not None and (span := _cli_secret(text, *m.span("pw"), forced=True)):
            return [span]
        return []
    return []


def _flags(*names: str) -> frozenset[str]:
    return frozenset(names)


_CliSpec = _Cli | Callable[[str, list[tuple[int, int]]], list[tuple[int, int]]]
_MYSQL_CLI = _Cli(glued="-p")
_LOGIN_CLI = _Cli(flags=_flags("-p", "--password"), after=("login",))
_PASSWORD_P = _Cli(flags=_flags("-p", "--password"))
_PASSWORD_CAPITAL_P = _Cli(flags=_flags("-P"))
_KEYTOOL = _Cli(flags=_flags("-storepass", "-keypass", "-srcstorepass", "-deststorepass", "-srckeypass",
                             "-destkeypass", "-new"))  # fmt: skip
_LDAP = _Cli(flags=_flags("-w"))
_SMB = _Cli(flags=_flags("-U", "--user"), split="%")
_SETTING_TAKES = _flags("--file", "-f", "--location", "--profile", "--region", "--registry", "--scope", "--type")
_CLIS: dict[str, _CliSpec] = {
    **dict.fromkeys(("mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlshow", "mysqlcheck", "mysqlsh",
                     "mariadb", "mariadb-dump", "mariadb-admin"), _MYSQL_CLI),
    **dict.fromkeys(("7z", "7za", "7zr"), _MYSQL_CLI),
    "sshpass": _Cli(flags=_flags("-p")),
    **dict.fromkeys(("redis-cli", "valkey-cli", "keydb-cli"), _Cli(flags=_flags("-a", "--pass", "--password"))),
    "keytool": _KEYTOOL,
    "jarsigner": _KEYTOOL,
    "ssh-keygen": _Cli(flags=_flags("-N", "-P")),
    "zip": _Cli(flags=_flags("-P", "--password")),
    "unzip": _PASSWORD_CAPITAL_P,
    "openssl": _Cli(flags=_flags("-k", "-pass", "-passin", "-passout")),
    **dict.fromkeys(("docker", "podman", "nerdctl", "buildah", "finch", "skopeo", "oras", "regctl", "crane", "helm",
                     "az"), _LOGIN_CLI),
    **dict.fromkeys(("mongo", "mongosh", "mongodump", "mongorestore", "mongoexport", "mongoimport", "mongostat",
                     "mongotop", "mongofiles", "cqlsh", "twine", "smbmap"), _PASSWORD_P),
    "sqlcmd": _PASSWORD_CAPITAL_P,
    **dict.fromkeys(("ldapsearch", "ldapadd", "ldapmodify", "ldapdelete", "ldapwhoami", "ldapcompare",
                     "ldapmodrdn", "ldapexop"), _LDAP),
    "ldappasswd": _Cli(flags=_flags("-w", "-s", "-a")),
    **dict.fromkeys(("smbclient", "smbcacls", "smbget"), _SMB),
    "nmcli": _Cli(flags=_flags("password", "wifi-sec.psk", "802-11-wireless-security.psk")),
    "gh": _Cli(flags=_flags("-b", "--body"), after=("secret",)),
    "vercel": _Cli(flags=_flags("-t", "--token")),
    "mc": _Cli(after=("alias", "set"), nth=4, takes=_flags("--api", "--path")),
    "cargo": _Cli(after=("login",), nth=1, takes=_flags("--registry", "--config", "-Z")),
    "vault": _Cli(after=("login",), nth=1),
    "aws": _Cli(after=("configure", "set"), setting=True, takes=_SETTING_TAKES),
    **dict.fromkeys(("npm", "pnpm", "yarn"), _Cli(after=("config", "set"), setting=True, takes=_SETTING_TAKES)),
    **dict.fromkeys(("poetry", "composer", "git"), _Cli(after=("config",), setting=True, takes=_SETTING_TAKES)),
    "doppler": _Cli(after=("configure", "set"), setting=True, takes=_SETTING_TAKES),
    "sqlplus": _slash_login_secrets,
    "htpasswd": _htpasswd_secrets,
}  # fmt: skip
_CLI_NAMES = "|".join(re.escape(c) for c in sorted(_CLIS, key=len, reverse=True))
# The arguments (64 at most, so overlapping commands cost a bounded rescan) end at another command of the table
# too: `docker exec db mysql -pPW`, or commands run together.
_CLI_RE = re.compile(
    rf"(?<![\w.\-~])(?P<cmd>{_CLI_NAMES})(?![\w.\-])"
    rf"(?P<rest>(?:[ \t]++(?!(?:[\w.\-~]*+/)*+(?:{_CLI_NAMES})(?![\w.\-])){_ARG}){{0,64}}+)"
)
# Substrings that find the commands (`ldap` finds every ldap tool); those with a leading space are subcommands,
# so the command is one of the words before them on the line.
_CLI_TRIGGERS = (
    "sql", "ssh", "mariadb", "mongo", "ldap", "smb", "-cli", "zip", "7z", "openssl", "keytool", "jarsigner", "cqlsh",
    "twine", "nmcli", "vercel", "htpasswd", " login", " secret", " alias", " config",
)  # fmt: skip
_RUN_START_RE = re.compile(r"(?<![\w.\-~])[\w.\-~]")
_CMD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-~")
_SUB_REACH = 80  # how far before its subcommand (` login`) a command can start


def _cli_starts(text: str, present: set[str] | None = None) -> Iterator[int]:
    """Where _CLI_RE can match: the start of the word run holding a command's name (a name is at most 16
    characters), or for a subcommand (` login`, ` config`) each word start up to _SUB_REACH before it on its line,
    as _cli_secrets requires. Commands are lower case, so a plain search finds them; the rule has no separate
    trigger check, as this search is one. `present`: the triggers a long text holds (`_present`), searched for only
    them."""
    found: set[int] = set()
    for trigger in _CLI_TRIGGERS:
        if present is not None and trigger not in present:
            continue
        at = text.find(trigger)
        sub = trigger.startswith(" ")
        while at >= 0:
            if sub:
                line = max(text.rfind("\n", max(0, at - _SUB_REACH), at) + 1, at - _SUB_REACH, 0)
                found.update(m.start() for m in _RUN_START_RE.finditer(text, line, at))
            else:
                start, floor = at, max(0, at - 16)
                while start > floor and text[start - 1] in _CMD_CHARS:
                    start -= 1
                found.add(start)
            at = text.find(trigger, at + 1)
    return iter(sorted(found))


def _cli_match_secrets(m: re.Match[str]) -> list[tuple[int, int]]:
    spec = _CLIS[m.group("cmd")]
    text = m.string
    args = [a.span() for a in _ARG_RE.finditer(text, m.start("rest"), m.end("rest"))]
    return _cli_secrets(spec, text, m.start(), args) if isinstance(spec, _Cli) else spec(text, args)


def _keep_cli(m: re.Match[str]) -> str:
    return m.group(0)  # unused: _CliRule.apply replaces what _cli_match_secrets finds


class _CliRule(_Rule):
    """The command rule: every command found is judged, also one inside another's arguments
    (`mc ... KEY=sqlplus u/pw`, or commands run together), so a second pass finds nothing the first did not;
    the secrets of all of them are then replaced at once."""

    __slots__ = ()

    def apply(self, text: str, present: set[str] | None = None) -> str:
        spans: list[tuple[int, int]] = []
        if self.starts is not None:  # `_cli_starts`, with the triggers a long text holds when they are known
            for start in _cli_starts(text, present):
                if (m := self.pattern.match(text, start)) is not None:
                    spans += _cli_match_secrets(m)
        else:
            pos = 0
            while (m := self.pattern.search(text, pos)) is not None:
                spans += _cli_match_secrets(m)
                pos = m.start() + 1
        if not spans:
            return text
        out: list[str] = []
        last = 0
        for start, end in sorted(spans):
            if start >= last:
                out += [text[last:start], _marker("cli_password")]
                last = end
        out.append(text[last:])
        return "".join(out)


_CLI_RULE = _CliRule(_CLI_RE, ("",), _keep_cli, starts=_cli_starts)

# `echo PW | docker login --password-stdin`, `echo PW | sudo -S ...`, `echo user:PW | chpasswd`
_STDIN_SECRET_RE = re.compile(
    rf"(?<![\w-])(?:echo|printf)(?:[ \t]++-[neE]++)*+[ \t]++(?P<value>{_ARG})[ \t]*+\|(?=(?P<rest>[^\r\n|;&]{{0,300}}))"
)
_STDIN_READER_RE = re.compile(
    r"--password-stdin|--passphrase-fd[ \t=]+0\b|\bsudo\b[^|]*?[ \t]-[A-Za-z]*S\b|\bchpasswd\b|\bpasswd\b[^|]*--stdin"
)


def _replace_stdin_secret(m: re.Match[str]) -> str:
    rest = m.group("rest")
    if _STDIN_READER_RE.search(rest) is None:
        return m.group(0)
    split = ":" if "chpasswd" in rest else ""
    span = _cli_secret(m.string, *m.span("value"), split=split)
    if span is None:
        return m.group(0)
    whole, base = m.group(0), m.start()
    return whole[: span[0] - base] + _marker("cli_password") + whole[span[1] - base :]


# The output of a command that prints a secret, on the line after it (warnings before it skipped):
# `heroku auth:token`, `pass show NAME`, `kubectl get secret ... | base64 -d`.
_EOL = r"(?:\r?\n|\\++[nr])"
_REST_OF_LINE = r"[^\r\n\\]*+(?:\\++(?![nr])[^\r\n\\]*+)*+"
_PRINTED_SECRET_RE = re.compile(
    r"(?<![\w-])(?:(?P<token>heroku[ \t]++auth:token|gh[ \t]++auth[ \t]++token|(?:doctl|fly|flyctl)[ \t]++auth"
    r"[ \t]++token|aws[ \t]++ecr[ \t]++get-login-password|az[ \t]++account[ \t]++get-access-token)"
    r"|(?P<password>(?:go)?pass[ \t]++show|op[ \t]++read|(?:bw|rbw)[ \t]++get[ \t]++password"
    r"|security[ \t]++find-(?:generic|internet)-password(?=[^\r\n]*?[ \t]-w\b)"
    r"|get[ \t]++secrets?(?=[^\r\n|]*+\|[ \t]*+base64[ \t]++(?:-d|--decode|-D)\b)))"
    rf"{_REST_OF_LINE}(?:{_EOL}[ \t]*+(?:›|»|!|[Ww]arning|WARNING){_REST_OF_LINE}){{0,3}}+"
    # a token is token characters (it ends at `:`); a password any word
    rf"{_EOL}[ \t]*+(?P<value>(?(token)[A-Za-z0-9._~+/=\-]++|[^\s\"'`\\\[:]++))(?P<label>:(?:\s|\Z))?"
)


def _replace_printed_secret(m: re.Match[str]) -> str:
    value = m.group("value")
    if m.group("label") or value.lower() in _CODE_WORDS:
        return m.group(0)  # `Error: ...`
    if m.group("token") is not None:
        if len(value) < 16 or not any(c.isdigit() for c in value):
            return m.group(0)
    elif len(value) < 4:
        return m.group(0)
    return _value_replacer("command_output")(m)


# `.netrc`: `machine HOST login USER password SECRET`, on one line or one keyword per line.
_NETRC_RE = re.compile(
    r"(?im)(?:^(?P<pre>[ \t]*+(?:machine[ \t]++\S++[ \t]++)?(?:login[ \t]++\S++[ \t]++)?)"
    r"|(?<![\w-])machine[ \t]++\S++[ \t]++login[ \t]++\S++[ \t]++)"
    r"(?:password|passwd)[ \t]++(?P<value>[^\s\"'\\]++)(?P<rest>[^\r\n]*+)"
)


def _replace_netrc(m: re.Match[str]) -> str:
    # A bare `password <word> ...` line is prose unless the word ends the line.
    if m.group("pre") is not None and not m.group("pre").strip() and m.group("rest").strip():
        return m.group(0)
    return _value_replacer("env_secret")(m)


# `auth=("user", "pw")`, `HTTPBasicAuth("user", "pw")`, `<add key="ApiKey" value="pw" />`
_AUTH_TUPLE_RE = re.compile(
    r"(?:(?<![\w.])auth[ \t]*=[ \t]*[(\[]|\b(?:HTTPBasicAuth|HTTPDigestAuth|BasicAuth|DigestAuth)\()"
    r"[ \t]*(?P<q1>\\*[\"'])[^\"'\\\r\n]*+(?P=q1)[ \t]*,[ \t]*(?P<q2>\\*[\"'])(?P<value>[^\"'\\\r\n]++)(?P=q2)"
)
_XML_KEY_VALUE_RE = re.compile(
    r"\bkey[ \t]*=[ \t]*(?P<q1>\\*[\"'])(?P<name>[\w.:\-]{1,128}+)(?P=q1)[ \t]+value[ \t]*=[ \t]*"
    r"(?P<q2>\\*[\"'])(?P<value>[^\"'\\\r\n]++)(?P=q2)"
)


def _replace_xml_key_value(m: re.Match[str]) -> str:
    if _secret_name(m.group("name")) is None:
        return m.group(0)
    return _value_replacer("env_secret")(m)


# ---------------------------------------------------------------------------------------------
# URLs with credentials

_URL_CRED_RE = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{1,30}+)://"
    r"(?P<user>[^\s:/?#\"'<>\[\]{}]{0,256}+):"
    # An `@` belongs to the password when another `@` follows before the host ends.
    r"(?P<pw>(?:[^\s@\"'<>]|@(?=[^\s@/\"'<>]*+@))++)@"
)
_DB_SCHEMES = frozenset(
    {
        "postgres", "postgresql", "pg", "mysql", "mariadb", "mongodb", "redis", "rediss", "amqp", "amqps",
        "mssql", "sqlserver", "oracle", "cockroachdb", "clickhouse", "couchdb", "cassandra", "neo4j", "bolt",
        "memcached", "kafka", "nats", "ldap", "ldaps", "db2", "snowflake", "elasticsearch", "influxdb",
    }
)  # fmt: skip
_PORT_PATH_RE = re.compile(r"\d{1,5}/")


def _replace_url_cred(m: re.Match[str]) -> str:
    pw = m.group("pw")
    if _has_marker(pw) or _PORT_PATH_RE.match(pw) or pw.startswith("$"):
        return m.group(0)  # `host:8080/path@x` is a port and a path, not a password
    scheme = m.group("scheme").lower().split("+", 1)[0]
    kind = "conn_string" if scheme in _DB_SCHEMES else "url_password"
    return m.group(0)[: m.start("pw") - m.start()] + _marker(kind) + "@"


# ---------------------------------------------------------------------------------------------
# Headers

_AUTH_HEADER_RE = re.compile(
    r"(?i)(?<![\w-])(?:proxy-)?authorization\\*[\"']?[ \t]*[:=][ \t]*\\*[\"']?"
    r"(?:(?:bearer|basic|token|bot|apikey|api-key|key|sso-key|ssws|negotiate|ntlm|jwt|splunk)[ \t]+)?"
    r"(?P<value>[^\s\"'\\,;<>]++)"
)
_BEARER_RE = re.compile(r"(?<![A-Za-z0-9_])[Bb]earer[ \t]+(?P<value>[A-Za-z0-9\-._~+/]{16,}+=*)")
# The value is `name=value` pairs and attributes, so it stops where the header does.
_COOKIE_RE = re.compile(
    r"(?i)(?<![\w-])(?:set-)?cookie\\*[\"']?[ \t]*:[ \t]*\\*[\"']?"
    r"(?P<value>[\w.\-]++=[^\s;\"'\\]*+(?:;[ \t]*[\w.\-]++(?:=[^\s;\"'\\]*+)?)*+)"
)


def _value_replacer(kind: str, check: Callable[[str], bool] | None = None) -> Callable[[re.Match[str]], str]:
    def replace(m: re.Match[str]) -> str:
        value = m.group("value")
        if _has_marker(value) or value.startswith("$") or (check is not None and not check(value)):
            return m.group(0)
        start, end = m.span("value")
        whole = m.group(0)
        return whole[: start - m.start()] + _marker(kind) + whole[end - m.start() :]

    return replace


def _tokenish(value: str) -> bool:
    return any(c.isdigit() or c in "-._~+/" for c in value)


def _header_credential(value: str) -> bool:
    """Skip `'Authorization': auth,` and `authorization: basic ...`: a variable name or an ellipsis."""
    if not any(c.isalnum() for c in value):
        return False
    return any(c.isdigit() for c in value) or len(value) >= 20 or _IDENT_RE.fullmatch(value.rstrip(".,")) is None


# ---------------------------------------------------------------------------------------------
# Provider tokens with a recognisable shape


def _mixed_case(value: str) -> bool:
    return any(c.isupper() for c in value) and any(c.islower() for c in value)


def _mixed_case_digit(value: str) -> bool:
    return _mixed_case(value) and any(c.isdigit() for c in value)


def _token_replacer(kind: str, check: Callable[[str], bool] | None = None) -> Callable[[re.Match[str]], str]:
    marker = _marker(kind)

    def replace(m: re.Match[str]) -> str:
        if check is not None and not check(m.group(0)):
            return m.group(0)
        return marker

    return replace


def _base64_private_key(value: str) -> bool:
    """True for base64 of a PEM private key (kubeconfig `client-key-data`, k8s `tls.key`)."""
    head = value[:64]
    try:
        decoded = binascii.a2b_base64(head[: len(head) - len(head) % 4])
    except binascii.Error:
        return False
    return b"PRIVATE KEY" in decoded


_TOKEN_SPECS: tuple[tuple[str, str, tuple[str, ...], Callable[[str], bool] | None], ...] = (
    ("private_key", r"(?<![A-Za-z0-9+/])LS0tLS1CRUdJTi[A-Za-z0-9+/]{16,}+={0,2}", ("ls0tls1crudjti",),
     _base64_private_key),
    ("private_key", r"(?m)^Private-Lines:[ \t]*\d+[ \t]*(?:\r?\n[A-Za-z0-9+/=]++(?=\r?$))++", ("private-lines",), None),
    ("anthropic_key", r"(?<![A-Za-z0-9_\-])sk-ant-[A-Za-z0-9_\-]{20,}+", ("sk-ant-",), None),
    ("openai_key", r"(?<![A-Za-z0-9_\-])sk-(?:proj-|svcacct-|admin-|None-)?[A-Za-z0-9_\-]{20,}+", ("sk-",),
     _mixed_case_digit),
    ("github_token", r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}+|github_pat_[A-Za-z0-9_]{22,}+)",
     ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), None),
    # The literal first (its look-behind after it), so the scan is a fast search for it: `gl` is in most texts.
    ("gitlab_token", r"gl(?<![A-Za-z0-9_\-]gl)(?:pat|dt|rt|ptt|cbt|ft|imt|oas|soat|agent|wt)-[A-Za-z0-9_\-]{20,}+",
     ("gl",), None),
    ("slack_token", r"(?<![A-Za-z0-9_\-])(?:xox[abprseo]|xapp)-[A-Za-z0-9\-]{10,}+", ("xox", "xapp-"), None),
    ("slack_token", r"(?<=hooks\.slack\.com/)(?:services|workflows|triggers)/[A-Za-z0-9/_\-]++",
     ("hooks.slack.com",), None),
    ("stripe_key", r"(?<![A-Za-z0-9_])(?:(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}+|whsec_[A-Za-z0-9]{24,}+)",
     ("sk_", "rk_", "whsec_"), None),
    ("google_api_key", r"(?<![A-Za-z0-9_\-])(?:AIza[0-9A-Za-z_\-]{30,}+|GOCSPX-[A-Za-z0-9_\-]{20,}+"
     r"|ya29\.[0-9A-Za-z_\-]{20,}+)", ("aiza", "gocspx-", "ya29."), None),
    ("npm_token", r"(?<![A-Za-z0-9_])npm_[A-Za-z0-9]{36,}+(?![A-Za-z0-9_])", ("npm_",), None),
    ("huggingface_token", r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}+(?![A-Za-z0-9_])", ("hf_",), _mixed_case),
    ("pypi_token", r"(?<![A-Za-z0-9_\-])pypi-AgE[A-Za-z0-9_\-]{50,}+", ("pypi-",), None),
    # Prefixed vendor tokens whose body is plain hex (so the mixed-case checks above and below never see them).
    ("openrouter_key", r"(?<![A-Za-z0-9_\-])sk-or-v1-[0-9a-f]{64}(?![0-9a-f])", ("sk-or-v1-",), None),
    ("vendor_token", r"(?<![A-Za-z0-9_\-])(?:shp(?:at|ss|ca|pa)_[0-9a-fA-F]{32}|do[opr]_v1_[0-9a-f]{64}"
     r"|dapi[0-9a-f]{32}|key-[0-9a-f]{32}|NRAK-[A-Z0-9]{27}|PMAK-[0-9a-f]{24}-[0-9a-f]{34})(?![0-9A-Za-z])",
     ("shpat_", "shpss_", "shpca_", "shppa_", "_v1_", "dapi", "key-", "nrak-", "pmak-"), None),
    ("aws_key", r"(?<![A-Z0-9])(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])",
     ("akia", "asia", "abia", "acca", "a3t"), None),
    ("jwt", r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{5,}+\.[A-Za-z0-9_\-]{5,}+\.[A-Za-z0-9_\-]*+", ("eyj",), None),
    # Issue 15: more formats with a fixed shape. The literal comes first where it can, so the scan is a fast
    # search for it; the look-behind then follows it.
    ("age_key", r"AGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}", ("age-secret-key-1",), None),
    ("telegram_token", r"(?<![0-9])[0-9]{8,10}:AA[0-9A-Za-z_\-]{33}(?![0-9A-Za-z_\-])", (":aa",), None),
    ("nuget_key", r"oy2(?<![0-9A-Za-z]oy2)[a-z0-9]{43}(?![0-9A-Za-z])", ("oy2",), None),
    ("rubygems_key", r"rubygems_[0-9a-f]{48}(?![0-9a-f])", ("rubygems_",), None),
    ("crates_token", r"cio(?<![0-9A-Za-z]cio)[A-Za-z0-9]{32}(?![0-9A-Za-z])", ("cio",), _mixed_case_digit),
    ("azure_secret", r"(?<![A-Za-z0-9_~.\-])[A-Za-z0-9_~.]{3}[0-9]Q~[A-Za-z0-9_~.\-]{31,34}(?![A-Za-z0-9_~.\-])",
     ("q~",), None),
    ("heroku_token", r"HRKU-(?<![A-Za-z0-9_\-]HRKU-)[A-Za-z0-9_\-]{60,}+", ("hrku-",), None),
)  # fmt: skip

# ---------------------------------------------------------------------------------------------
# Rules whose pattern cannot start with a literal find their starts with plain searches


def _found_starts(pattern: re.Pattern[str], words: tuple[str, ...], back: int | tuple[int, ...] = 0,
                  lower: bool = False) -> Callable[[str], Iterator[int]]:  # fmt: skip
    """Starts for a pattern that begins `back` characters (or any of several such distances) before one of `words`,
    found by a plain search (in the lower-cased text if `lower`): much cheaper than the pattern's own scan when it
    cannot start with a literal."""
    backs = back if isinstance(back, tuple) else (back,)

    def starts(text: str) -> Iterator[int]:
        hay = _findable_lower(text) if lower else text
        if hay is None:
            return (m.start() for m in pattern.finditer(text))
        found: set[int] = set()
        for word in words:
            at = hay.find(word)
            while at >= 0:
                found.update(at - b for b in backs if at >= b)
                at = hay.find(word, at + 1)
        return iter(sorted(found))

    return starts


# ---------------------------------------------------------------------------------------------
# Secrets stated in prose: `the staging db password is hunter2X`, `Private key: 0x...`, `use X as the password`,
# `creds are deploy / X`, `Пароль: X`. The value must look like a password, so prose about passwords stays.

def _json_escapable(word: str) -> str:
    """A pattern for `word` that also matches it as JSON encoders write non-ASCII text (`\\u043f`), at any depth."""
    out = []
    for c in word:
        if c.isascii():
            out.append(re.escape(c))
        else:
            codes = sorted({f"{ord(x):04x}" for x in (c, c.upper(), c.lower()) if len(x) == 1})
            out.append(f"(?:{re.escape(c)}|\\\\+u(?:{'|'.join(codes)}))")
    return "".join(out)


_PROSE_VALUE = r"`[^`\r\n]{1,200}+`|\"[^\"\r\n]{1,200}+\"|'[^'\r\n]{1,200}+'|[^\s\"'`]{1,200}+"
_PROSE_RE = re.compile(
    r"(?:(?<![\w\]-])|(?<=\\[nrt]))(?i:(?P<label>pass(?:word|wd|phrase|code)|pass[ \t]phrase|secret|token"
    r"|(?:api|access|auth|bearer|refresh|bot|deploy|private|secret|signing|encryption|master|client|app|license)"
    r"[ \t_-]?(?:key|token|secret)"
    r"|passwort|contrasena|mot[ \t]de[ \t]passe|"
    + "|".join(_json_escapable(w) for w in ("пароль", "contraseña", "hasło", "密码", "パスワード", "비밀번호"))
    + r")"
    r"(?![\w-])\*{0,2}"
    # up to four words between the label and its verb: `password for the staging db is ...`
    r"(?P<mid>(?:[ \t]++(?!(?:is|was|are|to|es|ist|est|é)[ \t])[^\s:=`'\"<>()\[\]{}|*]{1,30}+){0,4}?)"
    r"(?:\*{0,2}[ \t]*+(?P<sym>[:=])\*{0,2}[ \t]*+"
    r"|[ \t]++(?P<verb>is|was|are|to|es|ist|est|é|это)(?:[ \t]++(?:now|still|just|also|set[ \t]++to))?[ \t]++"
    # no verb (`password Jump-H0st-pw`): only a value with letters and digits, 8 characters or more
    r"|[ \t]++(?![\\$%{<\[(])(?=[^\s\"'`]{8})(?=[^\s\"'`]*?[0-9])(?=[^\s\"'`]*?[A-Za-z])))"
    rf"(?P<value>{_PROSE_VALUE})"
)
# Words between the label and the verb that make the sentence about something else: `password hash is bcrypt2`.
_PROSE_DENY_MID = _DENY_AFTER | frozenset(
    {
        "hash", "hashes", "hashing", "hashed", "reset", "requirements", "rules", "change", "changes", "changed",
        "storage", "stored", "check", "checks", "verification", "encoding", "encoded", "algorithm", "complexity",
        "sent", "generation", "generator", "rotation", "refresh", "exchange", "expired", "invalid", "missing",
        "mint", "address", "contract", "account", "program", "public", "pubkey",
    }
)  # fmt: skip
# Single words of technical prose that have letters and digits but are no password.
_PROSE_DENY_VALUES = frozenset(
    {
        "sha1", "sha256", "sha384", "sha512", "md5", "bcrypt", "argon2", "argon2id", "pbkdf2", "scrypt", "utf8",
        "utf-8", "base64", "base32", "hs256", "hs512", "rs256", "es256", "aes128", "aes256", "aes-256", "x509",
        "http2", "oauth2", "oauth1", "ipv4", "ipv6", "hmac-sha256", "ed25519", "rsa2048", "rsa4096", "p256",
    }
)  # fmt: skip
_VERSION_RE = re.compile(r"v?[0-9]+(?:\.[0-9]+)+[\w.+-]*")
_ESCAPED_BREAK_RE = re.compile(r"\\+[nrt]")
_ENGLISH_LABELS = frozenset({"password", "passwd", "passphrase", "passcode", "secret", "token"})


def _prose_secret(value: str, quoted: bool) -> bool:
    """A stated value that looks like a password or a key: not a word, a number, a reference or code."""
    if not 4 <= len(value) <= 200 or (len(value) < 6 and not quoted):
        return False
    low = value.lower()
    if _has_marker(value) or value[0] in "$%{<[(#\\" or _PLACEHOLDER_RE.fullmatch(value):
        return False
    if low in _CODE_WORDS or low in _STOPWORDS or low in _PROSE_DENY_VALUES or "://" in value:
        return False
    if value.startswith(("/", "~", "./", "../")) or _NUMBER_RE.fullmatch(value) or _VERSION_RE.fullmatch(value):
        return False
    if _DOTTED_RE.fullmatch(value) or _CALL_RE.match(value) or _ENV_NAME_RE.fullmatch(value):
        return False  # `session.token`, `getToken()`, `DB_PASSWORD`
    if " " in value:
        return quoted and _diceware(value)
    if _IDENT_RE.fullmatch(value) and ("_" in value or not any(c.isdigit() for c in value)):
        return False  # an identifier: `api_key_2`, `accessToken`
    digits = any(c.isdigit() for c in value)
    letters = any(c.isalpha() for c in value)
    symbols = any(not c.isalnum() and c not in "_-.'" for c in value)  # `Per-message` is a word
    return (digits and letters) or (letters and (symbols or _CAMEL_RE.search(value) is not None))


def _prose_value_span(m: re.Match[str]) -> tuple[int, int] | None:
    start, end = m.span("value")
    value = m.group("value")
    quoted = value[0] in "`'\""
    if quoted:
        start, end = start + 1, end - 1
    else:
        if (cut := _ESCAPED_BREAK_RE.search(value)) is not None:
            value = value[: cut.start()]  # `String,\n+` in JSON: the word ends at the escaped newline
        end = start + len(value.rstrip(".,;:!?)]}"))
    return (start, end) if _prose_secret(m.string[start:end], quoted) else None


def _replace_prose(m: re.Match[str]) -> str:
    label = m.group("label").lower()
    mid = m.group("mid").lower().split()
    bold = "*" in m.string[m.end("label") : m.start("value")]  # `**Password:** ...` is no assignment
    if m.group("sym") and not mid and not bold and (label in _ENGLISH_LABELS or not any(c in label for c in " \t")):
        return m.group(0)  # `password: ...`, `api_token = ...` are assignments, the assignment rule's to judge
    if not _PROSE_DENY_MID.isdisjoint(mid):
        return m.group(0)
    span = _prose_value_span(m)
    if span is None:
        return m.group(0)
    whole, base = m.group(0), m.start()
    return whole[: span[0] - base] + _marker("prose_secret") + whole[span[1] - base :]


_PROSE_WORDS = ("pass", "secret", "token", "key", "contrase", "пароль", "hasło", "密码", "パスワード", "비밀번호")
_PROSE_ASCII_WORDS = tuple(w for w in _PROSE_WORDS if w.isascii())
# The non-ASCII labels JSON-escaped (`\u043f\u0430\u0440...`): found by the pattern's own scan.
_PROSE_ESCAPED = ("u043f", "u041f", "u0142o", "u5bc6", "u30d1", "ube44")
# The first words of two-word labels (`api key`, `client secret`, `mot de passe`).
_PROSE_PREFIXES = frozenset({"api", "access", "auth", "bearer", "refresh", "bot", "deploy", "private", "secret",
                             "signing", "encryption", "master", "client", "app", "license", "de"})  # fmt: skip
_PREVIOUS_WORD_RE = re.compile(r"([a-z]{2,16})[ \t_-]?\Z")
_PROSE_PREFIX_ENDS = tuple(_PROSE_PREFIXES)
# The labels of _PROSE_RE that begin with `pass` (`passed` and `compass` begin none).
_PASS_LABELS = ("password", "passwd", "passphrase", "passcode", "pass phrase", "pass\tphrase", "passwort")


def _prose_starts(text: str) -> Iterator[int]:
    """Where _PROSE_RE can match: each label word, and the word before it when that starts a two-word label."""
    low = _findable_lower(text)
    if low is None or ("\\u" in low and any(e in low for e in _PROSE_ESCAPED)):
        yield from (m.start() for m in _PROSE_RE.finditer(text))
        return
    found: set[int] = set()
    for word in _PROSE_WORDS if not low.isascii() else _PROSE_ASCII_WORDS:
        at = low.find(word)
        while at >= 0:
            # `key` alone is no label; `pass` only begins one as `password`, `passwd`, `pass phrase`...
            if word != "key" and (word != "pass" or low.startswith(_PASS_LABELS, at)):
                found.add(at)
            # The word before can be a label's first word only if one of them ends where it does: one C call
            # instead of the regex's search of the 17 characters before every label word. Before `pass`, only `de`
            # (`mot de passe`): no two-word label ends in `pass`, and `secret` is a label word of its own.
            end = at - 1 if at and low[at - 1] in " \t_-" else at
            ends = _PROSE_PREFIX_ENDS if word != "pass" else ("de",)
            before = _PREVIOUS_WORD_RE.search(low, max(0, at - 17), at) if low.endswith(ends, 0, end) else None
            if before is not None:
                start = before.start(1)
                if low[start] in "nrt" and low.endswith("\\", 0, start):
                    start += 1  # `\nPrivate key` in JSON: the word after an escaped newline
                prefix = low[start : before.end(1)]
                if prefix in _PROSE_PREFIXES:
                    found.add(start)
                if prefix == "de" and low.endswith("mot", 0, start - 1):
                    found.add(start - 4)  # `mot de passe`
            at = low.find(word, at + 1)
    yield from sorted(found)


# `use X as the password`
_USE_AS_RE = re.compile(
    rf"(?i)(?<![\w\]-])use[ \t]++(?P<value>{_PROSE_VALUE})[ \t]++as[ \t]++(?:(?:the|a|your|my|our)[ \t]++)?"
    r"(?:[\w-]{1,30}+[ \t]++)?(?:pass(?:word|wd|phrase)|token|api[ \t]?key|secret)\b"
)
# `creds for staging are deploy / X`, `login: admin:X`. (A `]` before a label counts as a word: a marker put
# where a word was must not let a second pass find what the first did not.)
_CREDS_PAIR_RE = re.compile(
    r"(?i)(?<![\w\]-])(?:creds|credentials|login)(?:[ \t]++[^\s:=/]{1,30}+){0,3}?(?:[ \t]*+[:=]|[ \t]++(?:are|is))"
    r"[ \t]++(?P<user>[\w.@+\-\\]{1,64}+)[ \t]*+[/:][ \t]*+(?P<value>[^\s\"'`,;]{1,200}+)"
)


def _replace_prose_value(m: re.Match[str]) -> str:
    span = _prose_value_span(m)
    if span is None:
        return m.group(0)
    whole, base = m.group(0), m.start()
    return whole[: span[0] - base] + _marker("prose_secret") + whole[span[1] - base :]


# ---------------------------------------------------------------------------------------------
# Secrets known by what stands next to them

# Twilio: an Account SID (`AC` + 32 hex) then its auth token, or an API key SID (`SK`) then its secret, as two
# arguments or `sid:token`.
_TWILIO_PAIR_RE = re.compile(
    r"(?P<sid>AC[0-9a-f]{32}|SK[0-9a-f]{32})(?P<sep>\\*[\"']?[ \t]*+[,:][ \t]*+\\*[\"']?|[ \t]++)"
    r"(?P<value>[0-9A-Za-z]{32})(?![0-9A-Za-z])"
)


def _replace_twilio_pair(m: re.Match[str]) -> str:
    start = m.start()
    if start and m.string[start - 1].isalnum():
        return m.group(0)
    value = m.group("value")
    if m.group("sid").startswith("AC") and _HEX_RE.fullmatch(value) is None:
        return m.group(0)
    return _value_replacer("twilio_token")(m)


# Mailchimp: 32 hex and the data centre, `-us21`; found from the `-us`.
_MAILCHIMP_RE = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{32}-us[0-9]{1,2}(?![0-9A-Za-z])")

# A `.pgpass` line: `host:port:database:user:password`, found from its `:port:` (the host is checked by hand).
_PGPASS_RE = re.compile(
    r":(?:[0-9]{1,5}|\*):(?P<db>[\w.\-*]{1,63}+):(?P<user>[\w.\-*@]{1,63}+):(?P<value>[^\s:\"'\\]{1,128}+)"
    r"(?=[\s\"'\\]|\Z)"
)
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-*")


def _replace_pgpass(m: re.Match[str]) -> str:
    text, start = m.string, m.start()
    host = start
    while host > max(0, start - 253) and text[host - 1] in _HOST_CHARS:
        host -= 1
    if host == start or (host and text[host - 1] not in " \t\r\n\"'`\\"):
        return m.group(0)  # no host, or part of a longer run: `a/b.py:12:...`, `[::1]:5432:...`
    if any(m.group(g).isdigit() for g in ("db", "user", "value")) or _has_marker(m.group("value")):
        return m.group(0)  # `12:34:56:78:90`: a time or a list of numbers
    return _value_replacer("conn_string")(m)


# `<password>PW</password>` (Maven settings.xml, NuGet.Config, Tomcat), by the element's name.
_XML_ELEMENT_RE = re.compile(
    r"<(?=[\w.:\-]{0,64}?(?i:pass|pwd|secret|token|key|auth|cred|psk))(?P<name>[\w.:\-]{1,64}+)>"
    r"(?P<value>[^<>\r\n]{1,512}+)</(?P=name)>"
)


def _replace_xml_element(m: re.Match[str]) -> str:
    info = _secret_name(m.group("name").rsplit(":", 1)[-1])
    value = m.group("value").strip()
    if info is None or len(value) < 4 or value[0] in "$%{" or _PLACEHOLDER_RE.fullmatch(value):
        return m.group(0)
    if (info.weak or info.loose) and not _token_like(value):
        return m.group(0)
    return _value_replacer(info.kind)(m)


# Terraform: `variable "db_password" { ... default = "PW" }`.
_TF_DEFAULT_RE = re.compile(
    r"(?<![\w-])variable[ \t]++\\*\"(?P<name>[\w-]{1,128}+)\\*\"[ \t]*+\{(?P<body>[^{}]{0,600}?)\bdefault"
    r"[ \t]*+=[ \t]*+\\*\"(?P<value>[^\"\\\r\n]++)\\*\""
)


def _replace_tf_default(m: re.Match[str]) -> str:
    info = _secret_name(m.group("name"))
    value = m.group("value")
    if info is None or len(value) < 4 or _PLACEHOLDER_RE.fullmatch(value):
        return m.group(0)
    return _value_replacer(info.kind)(m)


# A Solana keypair file (`~/.config/solana/id.json`): a JSON array of its 64 bytes.
_BYTE_ARRAY_RE = re.compile(r"\[\s*+(?:[0-9]{1,3}\s*+,\s*+){63}[0-9]{1,3}\s*+\](?![\w\[])")


def _replace_byte_array(m: re.Match[str]) -> str:
    text, start = m.string, m.start()
    before = text[start - 1] if start else " "
    if (before.isalnum() or before in "_]") and not (before in "nrt" and text.endswith("\\", 0, start - 1)):
        return m.group(0)  # an index or a slice (`a[1, 2, ...]`); `\n[` is a line break in JSON
    if any(int(n) > 255 for n in re.findall(r"[0-9]+", m.group(0))):
        return m.group(0)
    return _marker("crypto_private_key")


# A wallet's recovery words: 12 to 24 lower-case words of 3 to 8 letters, single-spaced as wallets write them,
# with a label up to 200 characters before them (`seed phrase: w1 ... w12`, `MNEMONIC="w1 ... w24"`, `Save this
# seed phrase ... to recover your new keypair:\nw1 ...`). Found as runs of lower-case words, each from its first
# word only (the look-behind), so a long run is scanned once.
_WORD_RUN_RE = re.compile(r"(?<![a-z][ \t])(?<![a-zA-Z])[a-z]++(?:[ \t][a-z]++){11,}+(?![a-zA-Z])")
_PHRASE_RUN_RE = re.compile(r"(?<![a-z])[a-z]{3,8}(?:[ \t][a-z]{3,8}){11,}+(?![a-z])")
# The label starts a word or a camel-case part (`walletMnemonic`); not `passphrase`.
_MNEMONIC_LABEL_RE = re.compile(r"(?:(?<![a-zA-Z])|(?<=[a-z])(?=[A-Z]))(?i:mnemonic|phrase|seed)[^\[]{0,200}\Z")
# English words no wallet's word list has: two of them make a run of words a sentence.
_FUNCTION_WORDS = frozenset(
    {
        "the", "and", "that", "this", "with", "from", "are", "was", "were", "has", "had", "but", "not", "you",
        "your", "they", "them", "their", "these", "those", "than", "which", "would", "could", "should", "does",
        "been", "its", "his", "her", "him", "she", "our", "for",
    }
)  # fmt: skip


def _sentence(words: list[str]) -> bool:
    return sum(w in _FUNCTION_WORDS for w in words) >= 2


def _replace_mnemonic(m: re.Match[str]) -> str:
    text = m.string
    out: list[str] = []
    last = m.start()
    for run in _PHRASE_RUN_RE.finditer(text, m.start(), m.end()):
        words = list(_PHRASE_WORD_RE.finditer(text, run.start(), run.end()))
        # Words of the sentence may lead (`phrase was w1 ... w12`): the last 12 to 24 words are the phrase.
        keep = next((n for n in (24, 21, 18, 15, 12) if n <= len(words) <= n + 2), 0)
        if not keep:
            continue
        begin = words[len(words) - keep].start()
        if _sentence([w.group() for w in words[len(words) - keep :]]):
            continue
        # The label, with no `[` between it and the words: a marker put there must not bring a label into reach.
        if _MNEMONIC_LABEL_RE.search(text, max(0, begin - 208), begin) is None:
            continue
        out += [text[last:begin], _marker("mnemonic")]
        last = run.end()
    if not out:
        return m.group(0)
    out.append(text[last : m.end()])
    return "".join(out)


# A secret of several words or numbers cut short by truncation (loomd cuts oversized output between words, before
# redaction, and marks the cut with `…`): the part left still counts, when the label is there.
_CUT_PHRASE_RE = re.compile(r"(?<![a-z][ \t])(?<![a-zA-Z])[a-z]++(?:[ \t][a-z]++)*+[ \t]?(?=…)")
_CUT_TAIL_RE = re.compile(r"(?<![a-z])[a-z]{3,8}(?:[ \t][a-z]{3,8}){2,23}+[ \t]?\Z")
_CUT_BYTE_ARRAY_RE = re.compile(r"\[\s*+(?:[0-9]{1,3}\s*+,\s*+){1,63}+[0-9]{0,3}(?=…)")


def _replace_cut_phrase(m: re.Match[str]) -> str:
    # the last 3 to 24 words of 3 to 8 letters (at most 216 characters)
    tail = _CUT_TAIL_RE.search(m.string, max(m.start(), m.end() - 220), m.end())
    if tail is None or _sentence(tail.group().split()):
        return m.group(0)
    if _MNEMONIC_LABEL_RE.search(m.string, max(0, tail.start() - 208), tail.start()) is None:
        return m.group(0)
    return m.string[m.start() : tail.start()] + _marker("mnemonic")


# ---------------------------------------------------------------------------------------------
# Generic high-entropy tokens: a last resort for keys with no known prefix

_GENERIC_RE = re.compile(r"(?<![A-Za-z0-9+/_\-=])[A-Za-z0-9+/_\-]{32,}+={0,2}(?![A-Za-z0-9+/_\-=])")
_GENERIC_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-")
# Each byte of a token's alphabet becomes `a`, every other byte a space: its runs are found by plain searches.
_GENERIC_MARKS = bytes(0x61 if b in _GENERIC_CHARS else 0x20 for b in range(256))
_GENERIC_RUN = b"a" * 32


def _generic_starts(text: str) -> Iterator[int]:
    """Where _GENERIC_RE can match: the start of each run of 32 or more of its characters (its look-behind makes a
    match start a run), found by byte searches over the text's marks, a character a byte (anything not ASCII is none
    of them). The pattern's own scan, a look-behind tried at every position, was a long text's costliest rule."""
    marks = text.encode("ascii", "replace").translate(_GENERIC_MARKS)
    at = marks.find(_GENERIC_RUN)
    while at >= 0:
        yield at
        end = marks.find(b" ", at + len(_GENERIC_RUN))
        if end < 0:
            return
        at = marks.find(_GENERIC_RUN, end)
_HEX_RE = re.compile(r"[0-9a-fA-F\-]+")
_WORDY_RE = re.compile(r"[a-z]{4,}|[A-Z][a-z]{3,}|[A-Z]{5,}")
_PIECE_SPLIT_RE = re.compile(r"[/_\-]+")
_NOT_SECRET_PREFIXES = ("sha1-", "sha256-", "sha384-", "sha512-", "AAAA", "/")


def _random_piece(piece: str) -> bool:
    if len(piece) < 6 or _HEX_RE.fullmatch(piece):
        return False
    if any(c.isupper() for c in piece) + any(c.islower() for c in piece) + any(c.isdigit() for c in piece) < 2:
        return False
    letters = sum(c.isalpha() for c in piece)
    return 2 * sum(len(w) for w in _WORDY_RE.findall(piece)) <= letters


def _looks_random(token: str) -> bool:
    """Mixed case, digits, few dictionary-like runs and high entropy; never hex, paths or identifiers."""
    core = token.rstrip("=")
    if not 32 <= len(core) <= 256 or core.startswith(_NOT_SECRET_PREFIXES) or _HEX_RE.fullmatch(core):
        return False
    if core.startswith("0x") and _HEX_RE.fullmatch(core, 2):
        return False  # an Ethereum address in its mixed-case checksum form
    if not _mixed_case_digit(core):
        return False
    # Most of it must be random-looking pieces, not words, hashes and numbers joined by `/`, `_`, `-`
    # (URL paths, slugs, `NODE_SEA_FUSE_<hex>`, `uncased_L-12_H-768_A-12`).
    if 2 * sum(len(p) for p in _PIECE_SPLIT_RE.split(core) if _random_piece(p)) < len(core):
        return False
    counts = Counter(core)
    entropy = -sum(n / len(core) * math.log2(n / len(core)) for n in counts.values())
    return entropy >= 4.0


_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_BASE58_INDEX = {c: i for i, c in enumerate(_BASE58)}
# Base58Check version bytes of private keys: WIF (mainnet, testnet) and BIP32 extended keys (xprv, tprv, yprv,
# zprv, Yprv, Zprv, uprv, vprv).
_WIF_VERSIONS = (b"\x80", b"\xef")
_XPRV_VERSIONS = tuple(bytes.fromhex(v) for v in ("0488ade4", "04358394", "049d7878", "04b2430c", "0295b005",
                                                  "02aa7a99", "044a4e28", "045f18bc"))  # fmt: skip


def _base58check_private_key(token: str) -> bool:
    """A Bitcoin WIF private key or a BIP32 extended private key: exact, by its checksum."""
    if not 51 <= len(token) <= 112 or not all(c in _BASE58_INDEX for c in token):
        return False
    n = 0
    for c in token:
        n = n * 58 + _BASE58_INDEX[c]
    data = n.to_bytes((n.bit_length() + 7) // 8, "big")
    payload, check = data[:-4], data[-4:]
    if hashlib.sha256(hashlib.sha256(payload).digest()).digest()[:4] != check:
        return False
    if len(payload) in (33, 34):
        return payload[:1] in _WIF_VERSIONS
    return len(payload) == 78 and payload[:4] in _XPRV_VERSIONS


# In base64 of a JSON object or a PEM file: a key naming a credential, or a private key.
_DECODED_SECRET_RE = re.compile(
    rb'(?i)"[\w.-]{0,40}(?:pass(?:word|wd)?|secret|token|auth|private_?key|api_?key|credentials?)[\w-]{0,20}"[ \t]*:'
    rb'[ \t]*"|PRIVATE KEY-----'
)


def _base64_document(token: str) -> bool | None:
    """For base64 of a JSON document or a PEM file: whether it holds a credential (a service-account key, a docker
    config); None when the token is not that."""
    if not token.startswith(("eyJ", "ewo", "ew0K", "eyA", "LS0t")):
        return None
    head = token[:1024]
    try:
        decoded = binascii.a2b_base64(head[: len(head) - len(head) % 4])
    except binascii.Error:
        return None
    if _DECODED_SECRET_RE.search(decoded) is not None:
        return True
    # Readable text is a document without a credential, however random its base64 looks; binary is not text.
    return False if decoded.isascii() and all(c >= 32 or c in b"\t\r\n" for c in decoded) else None


def _replace_generic(m: re.Match[str]) -> str:
    token = m.group(0)
    document = _base64_document(token)
    if document is not None:
        return _marker("base64_secret") if document else token
    if not _looks_random(token) or m.string.endswith("h1:", 0, m.start()):
        return token  # `h1:` is a Go module checksum
    if _base58check_private_key(token):
        return _marker("crypto_private_key")
    return _marker("generic_high_entropy")


# ---------------------------------------------------------------------------------------------
# Rule table, in order: specific shapes first so they name the kind, generic last.


def _build_rules() -> tuple[_Rule, ...]:
    rules = [
        _Rule(re.compile(pattern), triggers, _token_replacer(kind, check))
        for kind, pattern, triggers, check in _TOKEN_SPECS
    ]
    rules += [
        _Rule(_AUTH_HEADER_RE, ("authorization",), _value_replacer("auth_header", _header_credential)),
        _Rule(_BEARER_RE, ("bearer",), _value_replacer("auth_header", _tokenish)),
        _Rule(_COOKIE_RE, ("cookie",), _value_replacer("cookie")),
        _Rule(_URL_CRED_RE, ("://",), _replace_url_cred),
        _Rule(_CLI_USERPASS_RE, ("-u", "--user"), _replace_cli_userpass,
              starts=_found_starts(_CLI_USERPASS_RE, ("-u", "--user"))),
        _CLI_RULE,
        _Rule(_STDIN_SECRET_RE, ("-stdin", "passphrase-fd", "sudo -s", "chpasswd"),
              _replace_stdin_secret),
        _Rule(_PRINTED_SECRET_RE, ("auth:token", "auth token", "get-login-password", "get-access-token", "pass show",
                                   "op read", "get password", "find-generic-password", "find-internet-password",
                                   "get secret"), _replace_printed_secret),
        _Rule(_CLI_FLAG_RE, ("-",), _replace_cli_flag, starts=_flag_starts),
        _Rule(_NETRC_RE, ("password", "passwd"), _replace_netrc),
        # `auth=` starts at its word; `HTTPBasicAuth(` and the others 0 or 4 characters before `BasicAuth(` or
        # `DigestAuth(` (the alternation has no literal to start from: its own scan was the costliest rule's).
        _Rule(_AUTH_TUPLE_RE, ("auth",), _value_replacer("env_secret"),
              starts=_found_starts(_AUTH_TUPLE_RE, ("auth", "BasicAuth(", "DigestAuth("), back=(0, 4))),
        _Rule(_XML_KEY_VALUE_RE, ("value",), _replace_xml_key_value),
        _Rule(
            _ASSIGN_RE, ("pass", "pwd", "secret", "token", "key", "auth", "cred", "sig", "psk"), _replace_assignment,
            "name",
            _assignment_starts,
        ),
        _Rule(_PROSE_RE, _PROSE_WORDS + _PROSE_ESCAPED, _replace_prose, starts=_prose_starts),
        _Rule(_USE_AS_RE, ("as the ", "as your ", "as my ", "as pass", "as token"), _replace_prose_value,
              starts=_found_starts(_USE_AS_RE, ("use",), lower=True)),
        _Rule(_CREDS_PAIR_RE, ("cred", "login"), _replace_prose_value,
              starts=_found_starts(_CREDS_PAIR_RE, ("cred", "login"), lower=True)),
        _Rule(_TWILIO_PAIR_RE, ("ac", "sk"), _replace_twilio_pair, starts=_found_starts(_TWILIO_PAIR_RE, ("AC", "SK"))),
        _Rule(_MAILCHIMP_RE, ("-us",), _token_replacer("mailchimp_key"),
              starts=_found_starts(_MAILCHIMP_RE, ("-us",), back=32)),
        _Rule(_PGPASS_RE, (":",), _replace_pgpass),
        _Rule(_XML_ELEMENT_RE, ("</",), _replace_xml_element),
        _Rule(_TF_DEFAULT_RE, ("variable",), _replace_tf_default,
              starts=_found_starts(_TF_DEFAULT_RE, ("variable",))),
        _Rule(_BYTE_ARRAY_RE, ("[",), _replace_byte_array),
        _Rule(_CUT_BYTE_ARRAY_RE, ("…",), _token_replacer("crypto_private_key")),
        _Rule(_GENERIC_RE, ("",), _replace_generic, starts=_generic_starts),
        # Last: a run of words starts where the text before it stops being one, which a marker put there by any
        # rule above can change.
        _Rule(_WORD_RUN_RE, ("mnemonic", "phrase", "seed"), _replace_mnemonic),
        _Rule(_CUT_PHRASE_RE, ("…",), _replace_cut_phrase),
    ]
    return tuple(rules)


_RULES = _build_rules()

# Each rule with its triggers: whether it always runs (the empty trigger), its one-character triggers (a search for
# a character is cheap), the longer ones (found by the automaton).
_PLAN = tuple((rule, "" in rule.triggers, frozenset(t for t in rule.triggers if len(t) == 1),
               frozenset(t for t in rule.triggers if len(t) > 1)) for rule in _RULES)
_SINGLES = tuple(sorted({c for _, _, singles, _ in _PLAN for c in singles}))


def _automaton() -> "ahocorasick.Automaton":
    words = {t for _, _, _, multi in _PLAN for t in multi} | {t for t in _CLI_TRIGGERS if len(t) > 1}
    automaton = ahocorasick.Automaton(ahocorasick.STORE_ANY)
    for word in sorted(words):
        automaton.add_word(word, word)
    automaton.make_automaton()
    return automaton


_TRIGGERS = _automaton()


def _present(low: str) -> set[str]:
    """The multi-character triggers (the rules' and the command rule's) that occur in `low`, in one pass instead of
    a search for each of 125 (bench/redaction.py's timing total: 1,899 -> 1,363 ms)."""
    return {word for _, word in _TRIGGERS.iter(low)}


@lru_cache(maxsize=4096)
def _rules_for(present: frozenset[str]) -> tuple[_Rule, ...]:
    """The rules a text with these triggers runs, in table order: a text's few triggers pick them at once instead of
    a check of each of the 117 for each text (most strings are short, and were mostly that loop). Keyed by trigger
    words only, so the cache never holds a text."""
    return tuple(rule for rule, always, singles, multi in _PLAN
                 if always or not multi.isdisjoint(present) or not singles.isdisjoint(present))


def redact_text(text: str) -> str:
    """Replace every secret with `[REDACTED:<kind>]` and every <private> span with `[private]`."""
    if not text:
        return text
    # Short strings repeat from event to event (payload keys, paths, event names, tool names); the 29 trigger
    # checks on each cost more than the one long string of a payload. Those found clean are remembered: only
    # text without a secret is kept, so the cache never holds one.
    if len(text) > SHORT_TEXT:
        return _redact_long(text)
    if text in _clean_short:
        return text
    out = _redact(text)
    if out == text:
        if len(_clean_short) >= MAX_CLEAN_SHORT:
            _clean_short.clear()  # atomic under the GIL (the tailer redacts on a worker thread too)
        _clean_short[text] = None
    return out


SHORT_TEXT = 256
MAX_CLEAN_SHORT = 8192
_clean_short: dict[str, None] = {}

# Long strings repeat too: a file read again, a test run's output, a tool result copied into a later session (an
# import of a history re-reads them all). Each result is kept under a digest of its input, never the input itself,
# so the cache holds no secret; the oldest go first once the results pass MAX_LONG_CHARS characters in all.
MAX_LONG_CHARS = 500_000
_long_done: dict[bytes, str] = {}
_long_chars = 0
_long_lock = threading.Lock()  # the tailer redacts on a worker thread too


def _redact_long(text: str) -> str:
    global _long_chars
    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if (out := _long_done.get(key)) is not None:
        return out
    out = _redact(text)
    if len(out) <= MAX_LONG_CHARS // 4:
        with _long_lock:
            if key not in _long_done:
                _long_done[key] = out
                _long_chars += len(out)
                while _long_chars > MAX_LONG_CHARS:
                    _long_chars -= len(_long_done.pop(next(iter(_long_done))))
    return out


def forget_long() -> None:
    """Drop the remembered long results (bench/redaction.py times redaction itself, not a lookup)."""
    global _long_chars
    with _long_lock:
        _long_done.clear()
        _long_chars = 0


_last_lower: tuple[str, str] = ("", "")


def _lower(text: str) -> str:
    """`text.lower()`, remembered for the last text: rules that find their starts in lower case run one after
    another on the same text (a rule that changes nothing returns the same object)."""
    global _last_lower
    last = _last_lower  # one read: another thread may replace it, never half of it
    if last[0] is text:
        return last[1]
    low = text.lower()
    _last_lower = (text, low)
    return low


def _findable_lower(text: str) -> str | None:
    """`text` lower-cased for a plain search that stands in for a case-insensitive pattern, or None when that
    cannot: a character whose lower case is longer (positions would shift), or one the pattern matches but
    lower() does not map (`ſ` matches `s`, `ı` matches `i`)."""
    low = _lower(text)
    if len(low) != len(text) or (not low.isascii() and ("ſ" in low or "ı" in low)):
        return None
    return low


def _redact(text: str) -> str:
    low = _lower(text)
    if "private" in low:
        if "<" in text:
            text = _strip_private(text)
        if "---" in text:
            text = _redact_pem(text)
        low = _lower(text)
    # Which rules can fire is judged on the text as it came (a marker a rule puts in never triggers another).
    present = _present(low)
    triggers = frozenset(present.union([c for c in _SINGLES if c in low]))
    scanned = text
    for rule in _rules_for(triggers):
        if rule is _CLI_RULE:
            # Its starts are its triggers' places: searched for in the text as it is now (a rule before it may
            # have changed it), and only those present.
            text = _CLI_RULE.apply(text, present if text is scanned else _present(_lower(text)))
        else:
            text = rule.apply(text)
    global _last_lower
    _last_lower = ("", "")  # it may hold a secret: kept only while this text is redacted
    return text


def _whole_value_secret(info: _SecretName, value: str) -> bool:
    """Whether a string under a secret-named key is the secret itself (`redact_value`)."""
    if info.phrase:
        return _mnemonic_like(value)
    if info.loose:
        return _token_like(value)
    return True


def redact_value(value: object) -> object:
    """Redact JSON-like data recursively; string values under secret-named keys are replaced whole."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        out: dict[object, object] = {}
        for key, item in value.items():
            if isinstance(key, str):
                info = _secret_name(key)
                if info is not None and isinstance(item, str) and item and _whole_value_secret(info, item):
                    out[redact_text(key)] = _marker("env_secret")
                    continue
                key = redact_text(key)
            out[key] = redact_value(item)
        return out
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    if isinstance(value, tuple):
        return tuple(redact_value(item) for item in value)
    return value
