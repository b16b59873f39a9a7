import base64
import copy
import dataclasses
import json
import random
import string

import pytest
from conftest import need_test_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from secret_corpus import (
    ANTHROPIC,
    AWS_ID,
    DB_PASS,
    GENERIC,
    GITHUB_FINE,
    GITHUB_PAT,
    GITLAB,
    GOOGLE,
    HF,
    JWT,
    NPM,
    OPENAI_LEGACY,
    OPENAI_PROJ,
    SECRET_SAMPLES,
    SLACK_BOT,
    STRIPE_LIVE,
    URL_PASS,
)

from loomd import redact
from loomd.redact import redact_text, redact_value


def test_corpus_is_large_and_well_formed() -> None:
    assert len(SECRET_SAMPLES) >= 40
    for text, secret in SECRET_SAMPLES:
        assert secret and secret in text


@pytest.mark.parametrize(("text", "secret"), SECRET_SAMPLES, ids=[t[:40] for t, _ in SECRET_SAMPLES])
def test_corpus_secret_is_removed(text: str, secret: str) -> None:
    out = redact_text(text)
    assert secret not in out
    assert "[REDACTED:" in out
    assert redact_text(out) == out


@pytest.mark.parametrize(("text", "secret"), SECRET_SAMPLES, ids=[t[:40] for t, _ in SECRET_SAMPLES])
def test_corpus_secret_is_removed_from_json_escaped_text(text: str, secret: str) -> None:
    # Transcripts arrive as JSON lines, sometimes with a tool's JSON output nested inside a string.
    for depth in (1, 2):
        wrapped, escaped = text, secret
        for _ in range(depth):
            wrapped = json.dumps({"tool_response": {"stdout": wrapped}})
            escaped = json.dumps(escaped)[1:-1]
        out = redact_text(wrapped)
        assert escaped not in out
        assert secret not in out


@pytest.mark.parametrize("sep", ["\n", " ", " | "])
def test_corpus_joined_into_one_text(sep: str) -> None:
    out = redact_text(sep.join(text for text, _ in SECRET_SAMPLES))
    assert [secret for _, secret in SECRET_SAMPLES if secret in out] == []


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (f"key={AWS_ID}", "aws_key"),
        (f"token {GITHUB_PAT}", "github_token"),
        (GITHUB_FINE, "github_token"),
        (GITLAB, "gitlab_token"),
        (SLACK_BOT, "slack_token"),
        (STRIPE_LIVE, "stripe_key"),
        (OPENAI_LEGACY, "openai_key"),
        (OPENAI_PROJ, "openai_key"),
        (ANTHROPIC, "anthropic_key"),
        (GOOGLE, "google_api_key"),
        (NPM, "npm_token"),
        (HF, "huggingface_token"),
        (JWT, "jwt"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY-----", "private_key"),
        (f"https://bob:{URL_PASS}@example.com", "url_password"),
        (f"postgres://bob:{URL_PASS}@db/app", "conn_string"),
        (f"DB_PASSWORD={DB_PASS}", "env_secret"),
        (f"Authorization: Token {URL_PASS}", "auth_header"),
        (f"Cookie: sid={URL_PASS}", "cookie"),
        (f"sshpass -p {URL_PASS} ssh deploy@host", "cli_password"),
        (f"value {GENERIC} end", "generic_high_entropy"),
    ],
)
def test_kind_names_the_secret(text: str, kind: str) -> None:
    assert f"[REDACTED:{kind}]" in redact_text(text)


def test_url_password_keeps_scheme_user_and_host() -> None:
    out = redact_text(f"git clone https://deploy:{URL_PASS}@git.example.com/acme/app.git")
    assert out == "git clone https://deploy:[REDACTED:url_password]@git.example.com/acme/app.git"


def test_unclosed_pem_block_stops_at_the_body() -> None:
    out = redact_text("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n... (truncated)")
    assert out == "[REDACTED:private_key]\n... (truncated)"


def test_unclosed_pem_block_on_one_line() -> None:
    out = redact_text("key: -----BEGIN RSA PRIVATE KEY----- MIIEowIBAAKCAQEAx1234567 q8Lm3Nd4Tkw7Zx2Lm9Np4")
    assert out == "key: [REDACTED:private_key]"


def test_base64_encoded_private_key_is_removed() -> None:
    pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx\n-----END RSA PRIVATE KEY-----\n"
    blob = base64.b64encode(pem.encode()).decode()
    out = redact_text(f"    client-key-data: {blob}")
    assert blob not in out
    assert "[REDACTED:private_key]" in out


NEGATIVES = [
    "commit 3f2a9c1e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39 (HEAD -> main, origin/main)",
    "request_id=550e8400-e29b-41d4-a716-446655440000 status=200",
    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "Image digest: sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "/Users/JohnSmith/Library/Application Support/Code/User/globalStorage/state.vscdb",
    "src/components/UserProfileCard/UserProfileCardHeaderContainer.tsx:42:7",
    "token = tokenize(x)",
    'password_field = form.get("password")',
    "The secretary filed the report before the meeting.",
    'tokenizer = AutoTokenizer.from_pretrained("gpt2")',
    "response = client.messages.create(model=model, max_tokens=4096, messages=msgs)",
    '{"max_tokens": 1024, "temperature": 0.2, "prompt_tokens": 10, "tokens": 5}',
    "usage = response.usage.total_tokens",
    "def login(username: str, password: str) -> bool:",
    "    password: Optional[str] = None",
    'api_key = os.environ["OPENAI_API_KEY"]',
    "client = OpenAI(api_key=api_key, base_url=base_url)",
    'token = request.headers.get("Authorization")',
    'const [token, setToken] = useState<string>("")',
    "git clone git@github.com:acme/api.git",
    "https://github.com/acme/api/pull/42#discussion_r1234567",
    "http://localhost:3000/@scope/pkg",
    "export PATH=/usr/local/bin:$PATH",
    "PWD=/home/dev/project",
    "      secretName: app-tls",
    'token_type: "bearer"',
    "PASSWORD_FILE=/run/secrets/db_password",
    "docker run --rm -u 1000:1000 -p 8080:80 nginx:1.25",
    "pip install scikit-learn==1.4.2",
    "bypass = True",
    "The auth module handles login and logout.",
    "nonce = secrets.token_hex(16)",
    "      GITHUB_TOKEN: ${{ secrets.GITHUB_TOKEN }}",
    'password = getpass.getpass("Password: ")',
    'value = input("API key: ")',
    'curl -H "Authorization: Bearer $TOKEN" https://api.example.com',
    'logger.info("password reset requested for %s", user)',
    '"integrity": "sha512-7x3K8Bq2nP9Wm4Lz5Rt1Yv6Cu0Xs3Ga8Hd2Jf5Ke9Mb1Nc4Qp7Ow0Iy6Ur3Ts8Ve2Zh5Ai9Bj1Dk4Fl7Gm0Hn3"',
    "github.com/stretchr/testify v1.8.4 h1:CcVxjf3Q8PM0mHUKJCdn+eZZtm5yQwehR5yeSVQQcUk=",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHq8Bz3Kp7Lm2Nw5Rt9Yv4Cx1Gs6Hd0Jf3Ke8Mb dev@laptop",
    "test_redact_value_handles_nested_dicts_without_mutation_in_2024",
    "class AbstractSingletonProxyFactoryBean2Impl(BaseHandlerConfigurationV3):",
    "npm_config_cache=/tmp/npm-cache",
    'hf_hub_download(repo_id="gpt2", filename="config.json")',
    '<input type="password" name="password" autocomplete="current-password">',
    "if not auth:\n    raise PermissionError('missing credentials')",
    "auth = HTTPBasicAuth(user, getpass.getpass())",
    "      - name: API_KEY\n        valueFrom:\n          secretKeyRef:\n            name: api\n",
    "Bearer authentication is described in RFC 6750.",
    "self.password = password",
    "let apiKey = process.env.API_KEY;",
    'token := os.Getenv("GITHUB_TOKEN")',
    'let token = env::var("TOKEN")?;',
    "cookie = request.cookies.get('session')",
    'Token.Keyword: "bold",',
    "FillMaskOutputElement(score=0.07, token=11098, token_str=' happiness')",
    '"--token": "Use a User Access Token. Prefer setting the HF_TOKEN variable.",',
    "hf jobs run --secrets HF_TOKEN python:3.12 python script.py",
    "if token_response.status_code != 200:",
    'EXPIRED_TOKEN = "expired_token"',
    "    private_key: PrivateKeyTypes | None,",
    "def set_callable_name(sig: FuncSignature, fdef: FuncDef) -> ProperType:",
    "username, password = un, pw",
    ":param token: an event loop token to use to get back to the event loop thread",
    "tokens += more_tokens",
    "N_SAMPLES_PER_TOKEN = HOP_LENGTH * 2",
    'api_key="your-api-key-here",  # placeholder from the docs',
    "Compare hunter2 with the password hash only after rate limiting.",
]


@pytest.mark.parametrize("text", NEGATIVES)
def test_ordinary_text_is_unchanged(text: str) -> None:
    assert redact_text(text) == text


def test_source_code_block_is_unchanged() -> None:
    code = """
import hashlib
from dataclasses import dataclass


@dataclass
class Session:
    token: str
    expires_at: float

    def fingerprint(self) -> str:
        return hashlib.sha256(self.token.encode()).hexdigest()


def refresh(session: Session, *, max_tokens: int = 512) -> Session:
    token = session.token
    if not token:
        raise ValueError("token required")
    return Session(token=token, expires_at=session.expires_at + 3600)
"""
    assert redact_text(code) == code


def test_random_tokens_are_caught_by_the_generic_rule() -> None:
    rng = random.Random(1234)
    alphabet = string.ascii_letters + string.digits
    caught = 0
    for _ in range(200):
        token = "".join(rng.choice(alphabet) for _ in range(40))
        caught += token not in redact_text(f"X-Custom-Header: {token}\nvalue {token} end")
    assert caught >= 190


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("before <private>my home address</private> after", "before [private] after"),
        ("a <PRIVATE>x</Private> b", "a [private] b"),
        ("a <private>line one\nline two\n</private>\nb", "a [private]\nb"),
        ("keep <private>hide this\nand this", "keep [private]"),
        ("<private>x</private> middle <private>y</private> end", "[private] middle [private] end"),
        ("a <private>outer <private>inner</private> still</private> b", "a [private] b"),
        ("stray </private> closer", "stray </private> closer"),
        ('x <private reason="pii">hidden</private> y', "x [private] y"),
        ("< private >z</ private > w", "[private] w"),
    ],
)
def test_private_spans(text: str, expected: str) -> None:
    assert redact_text(text) == expected
    assert redact_text(expected) == expected


def test_private_span_hides_secrets_and_text_around_survives() -> None:
    out = redact_text(f"note <private>{GITHUB_PAT}</private> and DB_PASSWORD={DB_PASS}")
    assert out == "note [private] and DB_PASSWORD=[REDACTED:env_secret]"


def test_idempotent_on_everything() -> None:
    texts = [t for t, _ in SECRET_SAMPLES] + NEGATIVES
    texts.append("\n".join(texts))
    for text in texts:
        once = redact_text(text)
        assert redact_text(once) == once


def test_idempotent_on_spliced_fragments() -> None:
    # Splicing samples puts secrets next to each other and cuts them mid-token, where one rule's marker
    # can change what another rule sees on a second pass.
    rng = random.Random(20240501)
    pieces = [t for t, _ in SECRET_SAMPLES] + NEGATIVES + ["<private>", "</private>", "=", ":", '"', "\\n", "]"]
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 5)):
            piece = rng.choice(pieces)
            if rng.random() < 0.3 and len(piece) > 4:
                start = rng.randrange(len(piece))
                piece = piece[start : start + rng.randint(1, 40)]
            parts.append(piece)
        text = rng.choice(["", " ", "\n", "=", ":"]).join(parts)
        once = redact_text(text)
        assert redact_text(once) == once, text


def test_accepts_any_str() -> None:
    assert redact_text("") == ""
    assert redact_text("\ud800 lone \udfff") == "\ud800 lone \udfff"
    out = redact_text(f"\ud800DB_PASSWORD={DB_PASS}\udfff")
    assert DB_PASS not in out
    assert out.startswith("\ud800")


def test_redact_value_nested() -> None:
    data = {
        "tool": "Bash",
        "input": {"command": f"export OPENAI_API_KEY={OPENAI_LEGACY}", "timeout": 120},
        "env": {"DB_PASSWORD": "plain-words", "API_TOKEN": "", "max_tokens": "4096"},
        "headers": [{"Authorization": f"Bearer {JWT}"}, ("x", f"https://u:{URL_PASS}@h")],
        "client_secret": "abc",
        "password": None,
        "count": 3,
        "ok": True,
        "ratio": 0.5,
        7: "seven",
    }
    before = copy.deepcopy(data)
    out = redact_value(data)
    assert data == before
    assert isinstance(out, dict)
    assert out["tool"] == "Bash"
    assert out["input"]["command"] == "export OPENAI_API_KEY=[REDACTED:openai_key]"
    assert out["input"]["timeout"] == 120
    assert out["env"] == {"DB_PASSWORD": "[REDACTED:env_secret]", "API_TOKEN": "", "max_tokens": "4096"}
    assert JWT not in str(out["headers"])
    assert isinstance(out["headers"][1], tuple)
    assert URL_PASS not in out["headers"][1][1]
    assert out["client_secret"] == "[REDACTED:env_secret]"
    assert out["password"] is None
    assert (out["count"], out["ok"], out["ratio"], out[7]) == (3, True, 0.5, "seven")
    assert out["input"] is not data["input"]
    assert redact_value(out) == out


def test_redact_value_scalars_and_lists() -> None:
    assert redact_value(5) == 5
    assert redact_value(None) is None
    assert redact_value(f"token {GITHUB_PAT}") == "token [REDACTED:github_token]"
    src = [f"{AWS_ID}", ["fine", {"apiKey": "zzz"}]]
    assert redact_value(src) == ["[REDACTED:aws_key]", ["fine", {"apiKey": "[REDACTED:env_secret]"}]]


MB = 1024 * 1024
# The three inputs the design names, at full size; every pattern gets its own worst case at 1 MB, where
# anything quadratic would still take minutes.
PATHOLOGICAL_SEEDS = [
    "a", "=", "-", ":", "\\", '"', " ", "\n", "\ud800", "aA1", "<private>", "</private>", "password: ", "password=",
    '"password": "', "API_KEY", "token_", "eyJ", "eyJa.eyJb.", "sk-", "ghp_", "AKIA", "a://b:", "x://u:p@", "@",
    "mysql -p", "machine h password ", "Authorization: ", "Bearer ", "Cookie: a=", "--token ", "-u a:",
    "-----BEGIN RSA PRIVATE KEY-----\n", "Private-Lines: 1\n", "LS0tLS1CRUdJTi", "hooks.slack.com/",
]  # fmt: skip


@pytest.mark.parametrize(
    "text",
    ["a" * 5 * MB, "=" * 5 * MB, "-----BEGIN" * (MB // 2)]
    + [seed * (MB // len(seed)) for seed in PATHOLOGICAL_SEEDS]
    + ["https://u:" + "@" * MB],
    ids=lambda t: f"{t[:12]!r}x{len(t)}",
)
def test_pathological_inputs_finish(text: str) -> None:
    # No timing assertion: a catastrophic pattern would hang and trip the suite's timeout.
    assert isinstance(redact_text(text), str)


# --- the assignment rule's fast path ----------------------------------------------------------------------------
# It tries its pattern only where a name run holding a secret word starts; this must find exactly what the
# pattern's own scan finds (the same rule without `starts` is the reference).

_ASSIGN_PIECES = st.sampled_from([
    "password", "PASSWD", "pwd", "api_key", "Secret", "tokenizer", "auth", "creds", "signature", "KEY", "\u212aey",
    "x" * 70, "a.b-c", "::", "[REDACTED:", " ", "\t", "\n", "=", " = ", ": ", ":=", "=>", "==", '"', "'", "\\\"",
    "hunter2", "s3cr3t-Val_ue", "b'", "f\"", "]", ",", "(", "os.environ", "-", "_", ".", "é", "0123456789abcdef",
])


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_ASSIGN_PIECES | st.text(max_size=6), max_size=30))
def test_assignment_fast_path_finds_what_the_full_scan_finds(pieces: list[str]) -> None:
    rule = next(r for r in redact._RULES if r.pattern is redact._ASSIGN_RE)
    assert rule.starts is not None
    reference = dataclasses.replace(rule, starts=None)
    text = "".join(pieces)
    assert rule.apply(text) == reference.apply(text)


def test_assignment_fast_path_on_real_payloads() -> None:
    """Every string of every real hook payload: the same result either way."""
    rule = next(r for r in redact._RULES if r.pattern is redact._ASSIGN_RE)
    reference = dataclasses.replace(rule, starts=None)
    root = need_test_data("transcripts")
    seen = 0

    def strings(value: object) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return []

    for path in sorted(root.rglob("*.json")):
        data = json.loads(path.read_text())
        for text in strings(data):
            seen += 1
            assert rule.apply(text) == reference.apply(text), text[:200]
    assert seen > 1000


def test_short_clean_strings_are_remembered_and_secrets_never() -> None:
    """The cache of short strings found clean: the same answers as without it, and no secret kept in it."""
    for text, secret in SECRET_SAMPLES:
        if len(text) <= redact.SHORT_TEXT:
            first, second = redact_text(text), redact_text(text)
            assert first == second and secret not in first
            assert text not in redact._clean_short
    assert redact_text("hook_event_name") == "hook_event_name" and "hook_event_name" in redact._clean_short
