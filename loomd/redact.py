"""Secret and <private> scrubbing: pure functions over text and JSON-like values.

Every rule is a precompiled pattern whose variable-length parts are possessive or bounded and
anchored by a look-behind, so no input can make a match backtrack over more than a bounded window.
A rule only runs when one of its trigger substrings occurs in the text (the fast path).
"""

import binascii
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

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
_SECRET_EXACT = frozenset({"pass", "pwd", "auth", "creds", "cred", "sig", "signature"})
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


@dataclass(frozen=True, slots=True)
class _SecretName:
    kind: str
    weak: bool
    counted: bool  # `token`/`tokens`: a number after it is an id or a count, not a secret


@lru_cache(maxsize=4096)
def _secret_name(name: str) -> _SecretName | None:
    """Classify an identifier such as `DB_PASSWORD`, `apiKey` or `X-Auth-Token`; None if not secret."""
    # Only the last dotted part names the value: `self.password` is secret, `Token.Keyword` is not.
    segs = [s.lower() for s in _SEGMENT_RE.findall(name.rsplit(".", 1)[-1])]
    hit = -1
    for i, seg in enumerate(segs):
        if seg in _SECRET_EXACT or seg.endswith(_SECRET_SUFFIXES):
            hit = i
        elif seg in ("key", "keys") and i and segs[i - 1] in _KEY_PREFIXES:
            hit = i
    if hit < 0 or any(s in _DENY_AFTER for s in segs[hit + 1 :]):
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
    (?=[A-Za-z0-9_.\-]{0,64}?(?i:pass|pwd|secret|token|key|auth|cred|sig))
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
_ASSIGN_WORD_RE = re.compile(r"(?i:pass|pwd|secret|token|key|auth|cred|sig)")
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def _assignment_starts(text: str) -> Iterator[int]:
    """Where _ASSIGN_RE can match: the start of a name run (its first look-behind) that holds one of the words of
    its look-ahead within 64 characters. Found from the words, so a long text without them is not scanned
    position by position with a 64-character look-ahead (that scan was most of a large payload's redaction)."""
    previous = -1
    for word in _ASSIGN_WORD_RE.finditer(text):
        start = word.start()
        floor = max(0, start - 65)
        while start > floor and text[start - 1] in _NAME_CHARS:
            start -= 1
        if start > 0 and text[start - 1] in _NAME_CHARS:
            continue  # the run starts more than 64 characters before the word: the look-ahead cannot reach it
        if start != previous:
            previous = start
            yield start


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


def _keep_value(m: re.Match[str], info: _SecretName, value: str, quoted: bool) -> bool:
    """True when the value after a secret-named key is not a literal secret (a reference, a call, a type)."""
    if len(value.strip()) < 4 or _has_marker(value):
        return True  # nothing a secret could be
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
        if len(value.split()) >= 4 and not info.weak and "passphrase" not in name.lower():
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


def _replace_cli_flag(m: re.Match[str]) -> str:
    value = m.group("value")
    stripped = value.strip("'\"")
    info = _secret_name(m.group("name"))
    if info is None or not stripped or value.startswith("-") or _has_marker(stripped):
        return m.group(0)
    if _PLACEHOLDER_RE.fullmatch(stripped) or stripped[0] in "$%{<[" or not _plausible_secret(stripped):
        return m.group(0)  # `--password "$PW"`, or prose: `the --password option`
    if _ENV_NAME_RE.fullmatch(stripped):
        return m.group(0)  # `--secrets HF_TOKEN` names a variable
    start = m.start("value")
    quote = value[0] if value[0] in "'\"" else ""
    return m.group(0)[: start - m.start()] + quote + _marker("cli_password") + quote


_ENV_NAME_RE = re.compile(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+")

# `curl -u user:pass`, `mysql -pSECRET`, `sshpass -p SECRET`
_CLI_USERPASS_RE = re.compile(r"(?<!\S)(?:-u|--user)[ \t]++[\"']?[^\s:\"'\[]++:(?P<pw>[^\s\"']++)")
_MYSQL_LINE_RE = re.compile(r"(?im)^[^\n]*\b(?:mysql|mysqldump|mysqladmin|mariadb|sshpass)\b[^\n]*")
_MYSQL_P_RE = re.compile(r"(?<!\S)-p(?P<sp>[ \t]*)(?P<pw>[^\s\"'-][^\s\"']*+)")


def _replace_cli_userpass(m: re.Match[str]) -> str:
    pw = m.group("pw")
    if _has_marker(pw) or pw.startswith("$") or pw.isdigit():
        return m.group(0)  # `docker run -u 1000:1000` is a uid and a gid
    start = m.start("pw") - m.start()
    return m.group(0)[:start] + _marker("cli_password")


def _replace_mysql_line(m: re.Match[str]) -> str:
    line = m.group(0)
    spaced_ok = "sshpass" in line.lower()  # for mysql, `-p name` prompts and `name` is the database

    def one(p: re.Match[str]) -> str:
        if (p.group("sp") and not spaced_ok) or _has_marker(p.group("pw")) or p.group("pw").startswith("$"):
            return p.group(0)
        return "-p" + p.group("sp") + _marker("cli_password")

    return _MYSQL_P_RE.sub(one, line)


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
    ("gitlab_token", r"(?<![A-Za-z0-9_\-])gl(?:pat|dt|rt|ptt|cbt|ft|imt|oas|soat|agent|wt)-[A-Za-z0-9_\-]{20,}+",
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
)  # fmt: skip

# ---------------------------------------------------------------------------------------------
# Generic high-entropy tokens: a last resort for keys with no known prefix

_GENERIC_RE = re.compile(r"(?<![A-Za-z0-9+/_\-=])[A-Za-z0-9+/_\-]{32,}+={0,2}(?![A-Za-z0-9+/_\-=])")
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
    if not _mixed_case_digit(core):
        return False
    # Most of it must be random-looking pieces, not words, hashes and numbers joined by `/`, `_`, `-`
    # (URL paths, slugs, `NODE_SEA_FUSE_<hex>`, `uncased_L-12_H-768_A-12`).
    if 2 * sum(len(p) for p in _PIECE_SPLIT_RE.split(core) if _random_piece(p)) < len(core):
        return False
    counts = Counter(core)
    entropy = -sum(n / len(core) * math.log2(n / len(core)) for n in counts.values())
    return entropy >= 4.0


def _replace_generic(m: re.Match[str]) -> str:
    token = m.group(0)
    if not _looks_random(token) or m.string.endswith("h1:", 0, m.start()):
        return token  # `h1:` is a Go module checksum
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
        _Rule(_CLI_USERPASS_RE, ("-u", "--user"), _replace_cli_userpass),
        _Rule(_MYSQL_LINE_RE, ("mysql", "mariadb", "sshpass"), _replace_mysql_line),
        _Rule(_CLI_FLAG_RE, ("-",), _replace_cli_flag),
        _Rule(_NETRC_RE, ("password", "passwd"), _replace_netrc),
        _Rule(_AUTH_TUPLE_RE, ("auth",), _value_replacer("env_secret")),
        _Rule(_XML_KEY_VALUE_RE, ("value",), _replace_xml_key_value),
        _Rule(
            _ASSIGN_RE, ("pass", "pwd", "secret", "token", "key", "auth", "cred", "sig"), _replace_assignment, "name",
            _assignment_starts,
        ),
        _Rule(_GENERIC_RE, ("",), _replace_generic),
    ]
    return tuple(rules)


_RULES = _build_rules()


def redact_text(text: str) -> str:
    """Replace every secret with `[REDACTED:<kind>]` and every <private> span with `[private]`."""
    if not text:
        return text
    # Short strings repeat from event to event (payload keys, paths, event names, tool names); the 29 trigger
    # checks on each cost more than the one long string of a payload. Those found clean are remembered: only
    # text without a secret is kept, so the cache never holds one.
    if len(text) > SHORT_TEXT:
        return _redact(text)
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


def _redact(text: str) -> str:
    low = text.lower()
    if "private" in low:
        if "<" in text:
            text = _strip_private(text)
        if "---" in text:
            text = _redact_pem(text)
        low = text.lower()
    for rule in _RULES:
        if any(t in low for t in rule.triggers):
            text = rule.apply(text)
    return text


def redact_value(value: object) -> object:
    """Redact JSON-like data recursively; string values under secret-named keys are replaced whole."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        out: dict[object, object] = {}
        for key, item in value.items():
            if isinstance(key, str):
                info = _secret_name(key)
                if info is not None and isinstance(item, str) and item:
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
