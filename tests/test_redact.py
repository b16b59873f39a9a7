import base64
import copy
import dataclasses
import json
import random
import re
import string

import pytest
from conftest import need_test_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from secret_corpus import (
    AGE_KEY,
    ANTHROPIC,
    AWS_ID,
    CORPUS,
    DB_PASS,
    DICEWARE,
    DOCKERCONFIGJSON,
    ETH_KEY,
    GENERIC,
    GITHUB_FINE,
    GITHUB_PAT,
    GITLAB,
    GOOGLE,
    HEROKU_TOKEN,
    HF,
    JWT,
    KNOWN_MISSES,
    MAILCHIMP,
    MNEMONIC_12,
    NPM,
    OPENAI_LEGACY,
    OPENAI_PROJ,
    PGPASS_PASS,
    PROSE_PASS,
    REDIS_PASS,
    SECRET_SAMPLES,
    SLACK_BOT,
    SOLANA_KEYPAIR,
    STRIPE_LIVE,
    TWILIO_SID,
    TWILIO_TOKEN,
    URL_PASS,
    WIF,
)

from loomd import redact
from loomd.redact import redact_text, redact_value

ALL_SAMPLES = [sample for samples in CORPUS.values() for sample in samples]


def test_corpus_is_large_and_well_formed() -> None:
    assert len(ALL_SAMPLES) >= 80 and len(CORPUS["outside_tester"]) == 15
    assert len({text for text, _ in ALL_SAMPLES}) == len(ALL_SAMPLES)  # KNOWN_MISSES names samples by their text
    for text, secret in ALL_SAMPLES:
        assert secret and secret in text
    assert set(KNOWN_MISSES) <= {text for text, _ in ALL_SAMPLES}
    assert len(SECRET_SAMPLES) == len(ALL_SAMPLES) - len(KNOWN_MISSES)


def test_corpus_detection_rate() -> None:
    """Issue 15: at least 95% of the whole corpus loses its secret, and what is missed is exactly what
    KNOWN_MISSES says (so a new miss, or a known one now caught, shows here by name)."""
    missed = [text for text, secret in ALL_SAMPLES if secret in redact_text(text)]
    rate = 1 - len(missed) / len(ALL_SAMPLES)
    assert rate >= 0.95, f"{rate:.1%} of {len(ALL_SAMPLES)} redacted; missed: {missed}"
    assert set(missed) == set(KNOWN_MISSES), f"missed: {missed}"


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
        (f"redis-cli -a {REDIS_PASS} ping", "cli_password"),
        (f"the staging db password is {PROSE_PASS}", "prose_secret"),
        (f'MNEMONIC="{MNEMONIC_12}"', "mnemonic"),
        (f"importprivkey {WIF}", "crypto_private_key"),
        (SOLANA_KEYPAIR, "crypto_private_key"),
        (AGE_KEY, "age_key"),
        (f"key {MAILCHIMP}", "mailchimp_key"),
        (f"{TWILIO_SID} {TWILIO_TOKEN}", "twilio_token"),
        (f"  .dockerconfigjson: {DOCKERCONFIGJSON}", "base64_secret"),
        (f"$ heroku auth:token\n{HEROKU_TOKEN}", "command_output"),
        (f"db.internal:5432:app:app:{PGPASS_PASS}", "conn_string"),
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
    # Issue 15: commands whose flags only look like the password flags of others, or carry no password.
    "docker run -d -p 8080:80 -p 5432:5432 --name db postgres:16",
    "mysql -u root -p app_prod < dump.sql",
    "redis-cli -h cache.internal -p 6379 ping",
    "ssh-keygen -t ed25519 -N '' -f ~/.ssh/id_ed25519",
    'ssh-keygen -t rsa -b 4096 -N "$PASSPHRASE" -f deploy_key',
    "zip -r release.zip dist/ && unzip -l release.zip",
    "htpasswd -c /etc/nginx/.htpasswd admin",
    "openssl rand -hex 32",
    "openssl rsa -in key.pem -passin env:KEY_PASS -out plain.pem",
    "keytool -list -v -keystore release.jks -storepass:env STORE_PASS",
    "git config --global user.email dev@example.com",
    "npm config set registry https://registry.npmjs.org/",
    "aws configure set region eu-west-1 --profile ci",
    "kubectl get secret db-creds -o yaml",
    "gh secret list --repo acme/api",
    "docker login ghcr.io -u octocat --password-stdin < token.txt",
    "echo $GHCR_TOKEN | docker login ghcr.io -u octocat --password-stdin",
    "mc alias set local http://localhost:9000 minioadmin minioadmin",
    "sqlplus / as sysdba",
    "vault login -method=oidc",
    "cargo login",
    "ldapsearch -x -H ldap://localhost -b dc=example,dc=org",
    # prose about passwords, tokens and keys, with no secret in it
    "The password reset flow is broken on staging.",
    "the token limit is 4096 tokens per request",
    "The password hash is sha256 of the salt and the input.",
    "Password must be at least 12 characters.",
    "Use the API key from the dashboard as the bearer token.",
    "Use OAuth2 as the token flow for the CLI.",
    "the secret is stored in Vault under kv/app/prod",
    "The API key is read from the OPENAI_API_KEY environment variable.",
    "Your password was changed on 2024-05-01.",
    "Set the random seed to 42 so the phrase generator is deterministic.",
    'mnemonic = "mov"',
    '{"password": "The password used to connect to the database"}',
    "Passphrase for the key: (none)",
    # hashes, ids and addresses
    "Address:     0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed",
    "tx 0x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 confirmed in block 19283746",
    "session 550e8400-e29b-41d4-a716-446655440000 started at 12:34:56",
    "ID:          2b3c4d5e-6f70-4812-9a3b-4c5d6e7f8091",
    "12:34:56:78:90:ab",
    "src/redact.py:120:5: E501 Line too long (121 > 120)",
    "src/app.py:12:main:run:exit",
    "Merge commit 3f2a9c1e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39 into main; the token refresh fix is 8b7d6a5f4e3d2c1b",
    "[1, 2, 3, 4, 5, 6, 7, 8]",
    "weights = np.array([0.1, 0.2, 0.3])",
    # base64 of ordinary things
    '{"config": "eyJuYW1lIjoibG9vbWQiLCJ2ZXJzaW9uIjoiMS4wIiwiZGVidWciOmZhbHNlfQ=="}',
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "AC_LOCAL_PORT=8080 SK_LOG_LEVEL=debug",
    "<PasswordField>Enter your password</PasswordField>",
    'variable "db_password_length" {\n  default = 24\n}',
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


# What the rules decide where a secret and an ordinary string can look alike: each line is (text, the part in
# question, whether it is redacted). The context decides, never the string alone.
SHA = "3f2a9c1e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39"
TWELVE_WORDS = "quick brown foxes jumped over lazy dogs near river banks today again"
TRADE_OFFS = [
    # a bare UUID is an id; printed by `heroku auth:token` it is the token
    (f"request {HEROKU_TOKEN} took 20 ms", HEROKU_TOKEN, False),
    (f"$ heroku auth:token\n{HEROKU_TOKEN}\n", HEROKU_TOKEN, True),
    # a commit SHA survives; the same hex stated as a token is redacted
    (f"commit {SHA} (HEAD -> main)", SHA, False),
    (f"my old github token was {SHA} but I revoked it", SHA, True),
    # 0x + 64 hex is a transaction hash, or a private key when labelled so
    (f"tx 0x{ETH_KEY} confirmed", ETH_KEY, False),
    (f"Private key: 0x{ETH_KEY}", ETH_KEY, True),
    # a few lower-case words under a password name are a diceware passphrase; a sentence is a description
    (f'{{"password": "{DICEWARE}"}}', DICEWARE, True),
    ('{"password": "The password used to connect"}', "The password used to connect", False),
    # 12 lower-case words after a label read as a wallet's words, whatever they say
    (f"the test phrase: {TWELVE_WORDS}", TWELVE_WORDS, True),
    (f"the test is: {TWELVE_WORDS}", TWELVE_WORDS, False),
    # after a known password flag a bare lower-case word reads as prose about the flag; quoted it is a value
    ("redis-cli -a foobared ping", "foobared", False),
    ("redis-cli -a 'foobared' ping", "foobared", True),
    ("mysql -pfoobared app", "foobared", True),  # glued to mysql's -p it can only be the password
    # a .pgpass line needs a host and a port; a grep hit in a file under a directory is not one
    (f"db.internal:5432:app:app:{PGPASS_PASS}", PGPASS_PASS, True),
    ("src/app.py:5432:app:app:value", "value", False),
]


@pytest.mark.parametrize(("text", "part", "redacted"), TRADE_OFFS, ids=[t[:40] for t, _, _ in TRADE_OFFS])
def test_trade_offs(text: str, part: str, redacted: bool) -> None:
    assert (part not in redact_text(text)) is redacted


def test_redact_value_judges_names_that_need_a_shaped_value() -> None:
    """`FOO_KEY` and `MNEMONIC` are secrets only when the value has their shape, as values and as assignments."""
    data = {
        "MAILCHIMP_KEY": MAILCHIMP,
        "PUSHER_KEY": "app-name",
        "SORT_KEY": "created_at",
        "CACHE_KEY": "user:42:profile",
        "MNEMONIC": MNEMONIC_12,
        "mnemonic": "mov",
        "seed_phrase": "hello world",
    }
    out = redact_value(data)
    assert isinstance(out, dict)
    assert out["MAILCHIMP_KEY"] == "[REDACTED:env_secret]" and out["MNEMONIC"] == "[REDACTED:env_secret]"
    for key in ("PUSHER_KEY", "SORT_KEY", "CACHE_KEY", "mnemonic", "seed_phrase"):
        assert out[key] == data[key]
    assert MAILCHIMP not in redact_text(f"MAILCHIMP_KEY={MAILCHIMP}")
    assert redact_text("SORT_KEY=created_at_2024") == "SORT_KEY=created_at_2024"


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
    # issue 15
    "redis-cli -a ", "zip x=zip ", "sqlplus a/", "mc alias set ", " login ", " config ", "htpasswd -b ", "-p'",
    "echo x | sudo -S ", "heroku auth:token\n", "pass show x\n", "a:5432:b:c:d ", "[1,", "AC" + "0" * 32 + " ", "-us",
    "0" * 32 + "-us1 ", 'variable "a_password" {', "<password>x", "seed phrase ", "abandon ", "password is ",
    "password ", "api key ", "use x as the password ", "creds are a / ", "\\u043f", "Пароль ", "\\nPrivate key ",
    "ewo", "Q~", "oy2", "cio", "abc …", "[1,…", "seed abc…",
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


def _strings(value: object) -> list[str]:
    """Every key and string value of a JSON value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_assignment_fast_path_on_real_payloads() -> None:
    """Every string of every real hook payload: the same result either way."""
    rule = next(r for r in redact._RULES if r.pattern is redact._ASSIGN_RE)
    reference = dataclasses.replace(rule, starts=None)
    root = need_test_data("transcripts")
    seen = 0

    for path in sorted(root.rglob("*.json")):
        data = json.loads(path.read_text())
        for text in _strings(data):
            seen += 1
            assert rule.apply(text) == reference.apply(text), text[:200]
    assert seen > 1000


# --- the other rules that find their starts by plain search (issue 15) --------------------------------------------

_STARTS_RULES = [r for r in redact._RULES if r.starts is not None and r.pattern is not redact._ASSIGN_RE]
_STARTS_PIECES = st.sampled_from([
    "mysql", "-p", "'pw'", "redis-cli", "-a", "/usr/bin/", "docker", " login", "login", "\tlogin", " config", "set",
    "aws", "configure", "mc", " alias", "gh", " secret", "sqlplus", "u/pw@db", "htpasswd", "-bc", "ssh-keygen",
    "zip", "x" * 20, "password", "Passphrase", "PASSWORD", "pa\u017fsword", "pass\u0131", "api", "key", "api_key",
    "token", "secret", "mot de passe", "mot\tde passe", "contraseña", "пароль", "Пароль", "\\u043f", "is", "was",
    "to", "for the db", ":", "=", " ", "\t", "\n", "\\n", "hunter2Xyz", "0x" + "ab" * 32, "use", "Use", "as the",
    "creds", "credentials", "Login", "/", "AC" + "0" * 32, "SK" + "f" * 32, "a" * 32, "-us21", "variable",
    '"db_password"', "{", "default = ", '"', "'", "[", "]", "[REDACTED:x]", "é", "\u212aey", "İ",
    "auth", "auth=(", "auth = [", "Auth(", "BasicAuth(", "DigestAuth(", "HTTPBasicAuth(", "HTTPDigestAuth(", "HTTP",
    '"u", "pw")', "'u', 'pw'", ".", ",",
])


@pytest.mark.parametrize("index", range(len(_STARTS_RULES)), ids=lambda i: _STARTS_RULES[i].pattern.pattern[:24])
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_STARTS_PIECES | st.text(max_size=6), max_size=24))
def test_other_fast_paths_find_what_the_full_scan_finds(index: int, pieces: list[str]) -> None:
    rule = _STARTS_RULES[index]
    reference = dataclasses.replace(rule, starts=None)
    text = "".join(pieces)
    assert rule.apply(text) == reference.apply(text)


def test_other_fast_paths_on_corpus_and_real_payloads() -> None:
    root = need_test_data("transcripts")
    texts = [text for text, _ in ALL_SAMPLES]
    for path in sorted(root.rglob("*.json")):
        texts += [t for t in _strings(json.loads(path.read_text())) if len(t) < 50_000]
    for rule in _STARTS_RULES:
        reference = dataclasses.replace(rule, starts=None)
        for text in texts:
            assert rule.apply(text) == reference.apply(text), (rule.pattern.pattern[:40], text[:200])


def test_every_command_is_found() -> None:
    """_cli_starts finds a command by a trigger inside its name, or by its first subcommand word."""
    names = [t for t in redact._CLI_TRIGGERS if not t.startswith(" ")]
    subs = [t[1:] for t in redact._CLI_TRIGGERS if t.startswith(" ")]
    for command, spec in redact._CLIS.items():
        after = spec.after if isinstance(spec, redact._Cli) else ()
        assert any(n in command[:16] for n in names) or (after and any(after[0].startswith(s) for s in subs)), command


def test_short_clean_strings_are_remembered_and_secrets_never() -> None:
    """The cache of short strings found clean: the same answers as without it, and no secret kept in it."""
    for text, secret in SECRET_SAMPLES:
        if len(text) <= redact.SHORT_TEXT:
            first, second = redact_text(text), redact_text(text)
            assert first == second and secret not in first
            assert text not in redact._clean_short
    assert redact_text("hook_event_name") == "hook_event_name" and "hook_event_name" in redact._clean_short


def test_gitlab_literal_first_finds_what_the_look_behind_first_form_finds() -> None:
    """The GitLab pattern starts with its literal (a fast scan); the look-behind after it keeps the old meaning."""
    before = re.compile(r"(?<![A-Za-z0-9_\-])gl(?:pat|dt|rt|ptt|cbt|ft|imt|oas|soat|agent|wt)-[A-Za-z0-9_\-]{20,}+")
    after = next(r.pattern for r in redact._RULES if r.pattern.pattern.startswith("gl(?<!"))
    tail = GITLAB.removeprefix("glpat-")
    texts = [GITLAB, f"x{GITLAB}", f"-{GITLAB}", f"_{GITLAB}", f" {GITLAB}", f"a=gldt-{tail} glrt-{tail}",
             f"glglpat-{tail}", f"\n{GITLAB}\n", "gl" * 50, f"{GITLAB[:-15]}"]
    for text in texts:
        assert [m.span() for m in after.finditer(text)] == [m.span() for m in before.finditer(text)], text


def test_long_results_are_remembered_under_a_digest_and_never_the_input() -> None:
    """A long string seen again (a file read twice, a tool result an import meets in every copy of a session) is not
    redacted again: the same result comes back; the cache keeps only results, keyed by a digest of the input."""
    redact.forget_long()  # what other tests left there (a bare token, found clean, may be among it) is not this one's
    secret = f"AWS_SECRET_ACCESS_KEY={GENERIC}"
    text = "output line of a build\n" * 40 + secret + "\n" + "more output\n" * 20
    assert len(text) > redact.SHORT_TEXT
    first = redact_text(text)
    second = redact_text(text)
    assert second is first and GENERIC not in first
    assert redact_text(text + " ") is not first  # another input: redacted on its own
    # Keyed by digests, holding redacted results: the secret is nowhere in the cache. (The short strings' cache keeps
    # strings found clean, and a bare token another test redacted without its name is one: not looked at here.)
    assert all(isinstance(key, bytes) and len(key) == 16 for key in redact._long_done)
    assert not any(GENERIC in result for result in redact._long_done.values())


# --- a long text's triggers, found in one pass (issue 17) ---------------------------------------------------------

def _each_trigger_searched(text: str) -> str:
    """The rule table as it reads: each rule whose trigger occurs in the (lower-cased) text, in order."""
    low = text.lower()
    for rule in redact._RULES:
        if any(trigger in low for trigger in rule.triggers):
            text = rule.apply(text)
    return text


_TRIGGER_PIECES = st.sampled_from(sorted({t for r in redact._RULES for t in r.triggers if t}
                                         | set(redact._CLI_TRIGGERS) | set(redact._CLIS)
                                         | {text for text, _ in ALL_SAMPLES if "private" not in text.lower()}))
_FILLER = "lorem ipsum dolor sit amet, consectetur adipiscing elit; " * 10


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_TRIGGER_PIECES | st.text(max_size=8), max_size=16), at=st.integers(0, 16),
       filler=st.booleans())
def test_texts_run_the_rules_their_triggers_name(pieces: list[str], at: int, filler: bool) -> None:
    """One automaton pass says which triggers a text holds, short or long, and the rules those triggers name run
    (`_rules_for`): the same rules as when each trigger is searched for, and the command rule finds the same
    commands (also after a rule before it changed the text)."""
    if filler:
        pieces.insert(min(at, len(pieces)), _FILLER)
    text = "".join(pieces)
    if "private" in text.lower():
        return  # <private> spans and PEM blocks are handled before the rule table either way
    assert redact._present(text.lower()) == {t for t in redact._TRIGGERS.keys() if t in text.lower()}
    assert redact._redact(text) == _each_trigger_searched(text)


def test_long_corpus_samples_redact_as_each_trigger_searched() -> None:
    for text, _ in ALL_SAMPLES:
        long = f"{_FILLER}\n{text}\n{_FILLER}"
        if "private" not in long.lower():
            assert redact._redact(long) == _each_trigger_searched(long), text[:200]
        if "private" not in text.lower():
            assert redact._redact(text) == _each_trigger_searched(text), text[:200]


_TOKEN_CHARS = string.ascii_letters + string.digits + "+/_-"


_SEPARATORS = " =.:\"\n\t\u00e9\u20ac\U0001f600\u0130"


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.text(_TOKEN_CHARS, max_size=60), st.sampled_from(_SEPARATORS)), max_size=12))
def test_the_generic_rule_tried_at_its_runs_finds_what_its_own_scan_finds(parts: list[tuple[str, str]]) -> None:
    """The generic token rule is tried only where a run of 32 or more token characters starts (`_generic_starts`,
    byte searches): the same matches, so the same output, as the pattern's own scan; non-ASCII text and `=` too."""
    text = "".join(run + sep for run, sep in parts)
    own = redact._Rule(redact._GENERIC_RE, ("",), redact._replace_generic)
    tried = next(rule for rule in redact._RULES if rule.pattern is redact._GENERIC_RE)
    assert tried.starts is not None
    assert tried.apply(text) == own.apply(text)
    assert [m.start() for m in redact._GENERIC_RE.finditer(text)] == [
        at for at in tried.starts(text) if redact._GENERIC_RE.match(text, at)]
