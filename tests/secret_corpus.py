"""Realistic lines holding a secret, shared by the redaction tests and the "no secret on disk" tests.

Secrets are assembled from pieces so the repository itself does not trip secret scanners.
"""

_B62 = "aB3dE5fG7hJ9kL2mN4pQ6rS8tU0vW1xY3zA5cD7eF9gH2iJ4kM6nP8qR0sT2uV4wX6yZ8"


def _rand(n: int, offset: int = 0) -> str:
    """A fixed, random-looking base62 string (mixed case and digits, no dictionary words)."""
    return (_B62 * 4)[offset : offset + n]


AWS_ID = "AKIA" + "Q3EXZ7" + "LM2N4P6R8T"
AWS_SECRET = "wJalr" + "XUtnFEMI/K7MDENG/" + "bPxRfiCYzq8Lm3Nd4Tk"
GITHUB_PAT = "ghp_" + _rand(36)
GITHUB_OAUTH = "gho_" + _rand(36, 5)
GITHUB_APP = "ghs_" + _rand(36, 9)
GITHUB_FINE = "github_pat_" + "11ABCDE2F0" + _rand(12, 3) + "_" + _rand(59, 7)
GITLAB = "glpat-" + _rand(20, 11)
SLACK_BOT = "xoxb-" + "123456789012-1234567890123-" + _rand(24, 2)
SLACK_USER = "xoxp-" + "123456789012-123456789012-1234567890123-" + _rand(32, 4)
STRIPE_LIVE = "sk_" + "live_" + _rand(24, 6)
STRIPE_RESTRICTED = "rk_" + "live_" + _rand(24, 8)
OPENAI_LEGACY = "sk-" + _rand(20, 1) + "T3Blbk" + "FJ" + _rand(20, 13)
OPENAI_PROJ = "sk-proj-" + _rand(64, 10) + "_" + _rand(40, 2) + "-" + _rand(48, 14)
ANTHROPIC = "sk-ant-" + "api03-" + _rand(80, 3) + "-" + _rand(12, 5) + "AA"
GOOGLE = "AIza" + "Sy" + _rand(33, 12)
NPM = "npm_" + _rand(36, 15)
HF = "hf_" + "QxYzAbCdEf" + "GhIjKlMnOpQrStUvWxYzAb"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
    + "."
    + "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ"
    + "."
    + "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PEM_BODY = "MIIEpAIBAAKCAQEA" + _rand(48, 6) + "\n" + _rand(64, 1) + "\n" + _rand(40, 16) + "=="
SSH_BODY = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW" + "\n" + _rand(64, 8)
PGP_BODY = "lQOYBGXabcdBCAC" + _rand(49, 2) + "\n" + _rand(64, 17) + "\n=" + "Ab1c"
DB_PASS = "Pg" + "s3cr3t" + "Pass9"
URL_PASS = "hunter2" + "Xyz"
ENV_VALUE = "v3ry" + "S3cret" + "Value"
BASIC = "dXNlcjpw" + "YXNzd29yZA=="
GENERIC = _rand(40, 19)
DJANGO = "django-insecure-" + "q8#x!2m%" + "w7z@k1pv$9s"

SECRET_PAIRS: list[tuple[str, str]] = [
    # .env files
    (f"AWS_ACCESS_KEY_ID={AWS_ID}", AWS_ID),
    (f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET),
    (f'OPENAI_API_KEY="{OPENAI_PROJ}"', OPENAI_PROJ),
    (f"ANTHROPIC_API_KEY={ANTHROPIC}", ANTHROPIC),
    (f"export GITHUB_TOKEN={GITHUB_PAT}", GITHUB_PAT),
    (f"export FOO_TOKEN={ENV_VALUE}", ENV_VALUE),
    (f"DB_PASSWORD={DB_PASS}", DB_PASS),
    (f"SECRET_KEY='{DJANGO}'", DJANGO),
    (f"STRIPE_SECRET_KEY={STRIPE_LIVE}", STRIPE_LIVE),
    (f"client_secret={ENV_VALUE}", ENV_VALUE),
    (f"  MYSQL_ROOT_PASSWORD: {DB_PASS}", DB_PASS),
    (f'DB_PASSWORD: "{DB_PASS}"', DB_PASS),
    # shell and CLI
    (f"$ curl -H 'Authorization: Bearer {GITHUB_PAT}' https://api.github.com/user", GITHUB_PAT),
    (f'curl -s -H "Authorization: Bearer {ENV_VALUE}" https://api.example.com/v1/items', ENV_VALUE),
    (f'curl -H "Authorization: Basic {BASIC}" https://ci.example.com/api/json', BASIC),
    (f"curl -u admin:{URL_PASS} https://jenkins.internal:8443/api/json", URL_PASS),
    (f'curl https://api.openai.com/v1/models -H "Authorization: Bearer {OPENAI_LEGACY}"', OPENAI_LEGACY),
    (f"git remote add origin https://x-access-token:{GITHUB_APP}@github.com/acme/api.git", GITHUB_APP),
    (f"git clone https://oauth2:{GITLAB}@gitlab.com/acme/infra.git", GITLAB),
    (f"docker run -e DB_PASSWORD={DB_PASS} -e PORT=8080 postgres:16", DB_PASS),
    (f"docker login ghcr.io -u octocat --password {GITHUB_OAUTH}", GITHUB_OAUTH),
    (f"mysql -h db.internal -u root -p{DB_PASS} app_prod", DB_PASS),
    (f"PGPASSWORD={DB_PASS} psql -h localhost -U app app_dev", DB_PASS),
    (f"npm config set //registry.npmjs.org/:_authToken={NPM}", NPM),
    (f"huggingface-cli login --token {HF}", HF),
    (f"+ export SLACK_BOT_TOKEN={SLACK_BOT}", SLACK_BOT),
    # connection strings and URLs
    (f"DATABASE_URL=postgres://app:{DB_PASS}@db.internal:5432/app_prod", DB_PASS),
    (f'engine = create_engine("postgresql+psycopg2://svc:{DB_PASS}@10.0.0.5/analytics")', DB_PASS),
    (f"MONGO_URI=mongodb+srv://admin:{URL_PASS}@cluster0.ab1cd.mongodb.net/test", URL_PASS),
    (f"redis://:{URL_PASS}@cache.internal:6379/0", URL_PASS),
    (f"amqp://guest:{URL_PASS}@rabbitmq:5672/vhost", URL_PASS),
    (f"Fetching https://deploy:{URL_PASS}@registry.example.com/v2/", URL_PASS),
    (f"Server=tcp:sql.example.net,1433;Database=app;User Id=sa;Password={DB_PASS};Encrypt=true", DB_PASS),
    # JSON and YAML configs
    (f'{{"api_key": "{ENV_VALUE}", "model": "gpt-4o"}}', ENV_VALUE),
    (f'{{"mcpServers": {{"gh": {{"env": {{"GITHUB_PERSONAL_ACCESS_TOKEN": "{GITHUB_FINE}"}}}}}}}}', GITHUB_FINE),
    (f'  "password": "{URL_PASS}",', URL_PASS),
    (f"slack_webhook: https://hooks.slack.com/services/T0ABC1234/B0DEF5678/{_rand(24, 7)}", _rand(24, 7)),
    (f"stripe:\n  restricted_key: {STRIPE_RESTRICTED}\n", STRIPE_RESTRICTED),
    (f'const firebaseConfig = {{ apiKey: "{GOOGLE}", projectId: "demo-app" }};', GOOGLE),
    (f'{{"tool_result": "{{\\"token\\": \\"{ENV_VALUE}\\"}}"}}', ENV_VALUE),
    # logs and tool output
    (f"2024-05-01T12:00:00Z INFO auth ok user=42 jwt={JWT}", JWT),
    (f"DEBUG request headers: {{'Authorization': 'Bearer {JWT}'}}", JWT),
    (f"Set-Cookie: session={ENV_VALUE}; Path=/; HttpOnly", ENV_VALUE),
    (f"X-API-Key: {GENERIC}", GENERIC),
    (f"export SLACK_USER_TOKEN={SLACK_USER}", SLACK_USER),
    (f"Found key {AWS_ID} in ~/.aws/credentials", AWS_ID),
    (f"The request used token {GENERIC} and failed with 401", GENERIC),
    (f"$ cat ~/.ssh/id_rsa\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----\n", PEM_BODY),
    (f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SSH_BODY}\n-----END OPENSSH PRIVATE KEY-----", SSH_BODY),
    (f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n{PGP_BODY}\n-----END PGP PRIVATE KEY BLOCK-----", PGP_BODY),
    (f'"private_key": "-----BEGIN PRIVATE KEY-----\\n{_rand(64, 3)}\\n-----END PRIVATE KEY-----\\n"', _rand(64, 3)),
    (f"$ head -3 server.key\n-----BEGIN EC PRIVATE KEY-----\n{_rand(64, 5)}\n", _rand(64, 5)),
    (f"machine api.heroku.com login me@example.com password {URL_PASS}", URL_PASS),
    (f'headers = {{"x-api-key": "{ANTHROPIC}", "anthropic-version": "2023-06-01"}}', ANTHROPIC),
    (f"client = OpenAI(api_key='{OPENAI_LEGACY}')", OPENAI_LEGACY),
    (f"resp = requests.get(url, auth=('admin', '{URL_PASS}'), timeout=10)", URL_PASS),
    (f'{{"Credentials": {{"AccessKeyId": "ASIA{AWS_ID[4:]}", "SecretAccessKey": "{AWS_SECRET}"}}}}', AWS_SECRET),
    (f"kubectl create secret generic db --from-literal=password={DB_PASS}", DB_PASS),
    (f"AZURE_STORAGE=DefaultEndpointsProtocol=https;AccountName=acme;AccountKey={GENERIC}==;", GENERIC),
    (f"https://acme.blob.core.windows.net/logs/a.txt?sv=2022-11-02&sr=b&sig=Xy{_rand(30, 4)}%3D", _rand(30, 4)),
    (f"PuTTY-User-Key-File-3: ssh-rsa\nPrivate-Lines: 2\n{_rand(64, 2)}\n{_rand(24, 9)}\nPrivate-MAC: 1", _rand(64, 2)),
    (f'<add key="ApiKey" value="{ENV_VALUE}" />', ENV_VALUE),
]

HEX32 = "9f86d081884c7d65" + "9a2feaa0c55ad015"
HEX64 = HEX32 + "a3bf4f1b2b0b822c" + "d15d6c15b0f00a08"
OPENROUTER = "sk-or-" + "v1-" + HEX64
GROQ = "gsk_" + _rand(52, 1)
XAI = "xai-" + _rand(80, 2)
REPLICATE = "r8_" + _rand(37, 4)
PERPLEXITY = "pplx-" + _rand(48, 3)
ANTHROPIC_ADMIN = "sk-ant-" + "admin01-" + _rand(80, 6) + "-" + _rand(10, 2) + "AA"
OPENAI_SVC = "sk-" + "svcacct-" + _rand(64, 8) + "T3Blbk" + "FJ" + _rand(20, 2)
GCP_OAUTH = "ya29." + "a0AfB_by" + _rand(60, 3)
GITHUB_REFRESH = "ghr_" + _rand(36, 2)
GITHUB_USER = "ghu_" + _rand(36, 3)
GITLAB_RUNNER = "glrt-" + _rand(20, 4)
BITBUCKET = "ATBB" + _rand(32, 5)
SENDGRID = "SG." + _rand(22, 1) + "." + _rand(43, 2)
SHOPIFY = "shpat_" + HEX32
DIGITALOCEAN = "dop_" + "v1_" + HEX64
DATABRICKS = "dapi" + HEX32
MAILGUN = "key-" + HEX32
VAULT = "hvs." + _rand(90, 1)
DOCKERHUB = "dckr_" + "pat_" + _rand(27, 5)
LINEAR = "lin_" + "api_" + _rand(40, 3)
DOPPLER = "dp.pt." + _rand(43, 2)
NEWRELIC = "NRAK-" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0"
POSTMAN = "PMAK-" + HEX32[:24] + "-" + HEX32 + "12"
AWS_SESSION = "IQoJb3JpZ2luX2VjE" + _rand(100, 3)
GRAFANA = "glsa_" + _rand(32, 2) + "_" + "0123abcd"
K8S_JWT = "eyJhbGciOiJSUzI1NiIsImtpZCI6IiJ9" + "." + "eyJpc3MiOiJrdWJlcm5ldGVzIn0" + "." + _rand(50, 7)

# Issue 8: more clouds, VCS hosts and model providers, and the header and connection-string shapes they travel in.
MORE_PAIRS: list[tuple[str, str]] = [
    # model providers
    (f"OPENROUTER_API_KEY={OPENROUTER}", OPENROUTER),
    (f'client = OpenAI(base_url="https://openrouter.ai/api/v1", api_key="{OPENROUTER}")', OPENROUTER),
    (f"export GROQ_API_KEY={GROQ}", GROQ),
    (f"curl https://api.x.ai/v1/chat -H 'Authorization: Bearer {XAI}'", XAI),
    (f"REPLICATE_API_TOKEN={REPLICATE}", REPLICATE),
    (f"using pplx key {PERPLEXITY} for search", PERPLEXITY),
    (f"ANTHROPIC_ADMIN_KEY={ANTHROPIC_ADMIN}", ANTHROPIC_ADMIN),
    (f"openai.api_key = '{OPENAI_SVC}'", OPENAI_SVC),
    (f'curl -H "api-key: {HEX32}" https://acme.openai.azure.com/openai/deployments', HEX32),
    (f'genai.configure(api_key="AIzaSy{_rand(33, 4)}")', "AIzaSy" + _rand(33, 4)),
    (f"MISTRAL_API_KEY={_rand(32, 9)}", _rand(32, 9)),
    # clouds
    (f"gcloud auth print-access-token\n{GCP_OAUTH}", GCP_OAUTH),
    (f"AWS_SESSION_TOKEN={AWS_SESSION}", AWS_SESSION),
    (f"[default]\naws_access_key_id = {AWS_ID}\naws_secret_access_key = {AWS_SECRET}\n", AWS_SECRET),
    (f"doctl auth init --access-token {DIGITALOCEAN}", DIGITALOCEAN),
    (f"DATABRICKS_TOKEN={DATABRICKS}", DATABRICKS),
    (f"databricks configure --host https://x.cloud.databricks.com --token {DATABRICKS}", DATABRICKS),
    (f"export VAULT_TOKEN={VAULT}", VAULT),
    (f"Using token {VAULT} for vault login", VAULT),
    (f"CLOUDFLARE_API_TOKEN={_rand(40, 14)}", _rand(40, 14)),
    (f"HEROKU_API_KEY=01234567-89ab-cdef-0123-{HEX32[:12]}", f"01234567-89ab-cdef-0123-{HEX32[:12]}"),
    (f"kubectl --token={K8S_JWT} get pods", K8S_JWT),
    # VCS hosts and package registries
    (f"git clone https://x-token-auth:{BITBUCKET}@bitbucket.org/acme/app.git", BITBUCKET),
    (f"GITLAB_RUNNER_TOKEN={GITLAB_RUNNER}", GITLAB_RUNNER),
    (f"refresh_token: {GITHUB_REFRESH}", GITHUB_REFRESH),
    (f"gh auth status: logged in with {GITHUB_USER}", GITHUB_USER),
    (f"//npm.pkg.github.com/:_authToken={GITHUB_PAT[:-6]}Zz9Yx8", GITHUB_PAT[:-6] + "Zz9Yx8"),
    (f"docker login -u acme -p {DOCKERHUB}", DOCKERHUB),
    # SaaS
    (f"SENDGRID_API_KEY={SENDGRID}", SENDGRID),
    (f"shopify app deploy --token {SHOPIFY}", SHOPIFY),
    (f"mailgun: {MAILGUN}", MAILGUN),
    (f"LINEAR_API_KEY={LINEAR}", LINEAR),
    (f"doppler configure set token {DOPPLER}", DOPPLER),
    (f"new relic ingest with {NEWRELIC}", NEWRELIC),
    (f"postman api key {POSTMAN}", POSTMAN),
    (f"TWILIO_AUTH_TOKEN={HEX32}", HEX32),
    (f"grafana service account {GRAFANA}", GRAFANA),
    (f"STRIPE_WEBHOOK_SECRET=whsec_{_rand(32, 3)}", "whsec_" + _rand(32, 3)),
    # headers and connection strings
    (f"Proxy-Authorization: Basic {BASIC}", BASIC),
    (f"Authorization: token {_rand(40, 12)}", _rand(40, 12)),
    (f'{{"headers": {{"Authorization": "Bearer {_rand(48, 13)}"}}}}', _rand(48, 13)),
    (f"jdbc:mysql://db:3306/app?user=root&password={DB_PASS}", DB_PASS),
    (f"psql 'host=db port=5432 user=app password={DB_PASS} dbname=app'", DB_PASS),
    (f"-----BEGIN ENCRYPTED PRIVATE KEY-----\n{_rand(64, 6)}\n-----END ENCRYPTED PRIVATE KEY-----", _rand(64, 6)),
    (f"-----BEGIN DSA PRIVATE KEY-----\n{_rand(64, 4)}\n-----END DSA PRIVATE KEY-----", _rand(64, 4)),
]

# The full corpus: the secret is a substring of the text and must not survive redaction.
SECRET_SAMPLES: list[tuple[str, str]] = SECRET_PAIRS + MORE_PAIRS
