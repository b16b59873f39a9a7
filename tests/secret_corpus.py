"""Realistic lines holding a secret, shared by the redaction tests, the "no secret on disk" tests and
bench/redaction.py.

Each sample is `(text, secret)`: `secret` is the exact substring of `text` that must not survive redaction.
`CORPUS` groups them by where such a secret turns up; `KNOWN_MISSES` names the samples redaction is known to miss
(each with the reason), and `SECRET_SAMPLES` is every other sample: those must always be redacted.
Secrets are assembled from pieces so the repository itself does not trip secret scanners.
"""

import base64
import hashlib
import json

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


_HEX = (
    "3b9e7c1a5f08d2e64a7c9b1d3e5f7a2c" + "4e6b8d0f1a3c5e7b9d2f4a6c8e0b1d3f"
    + "5a7c9e2b4d6f8a0c1e3b5d7f9a2c4e6b" + "8d0f2a4c6e8b0d1f3a5c7e9b2d4f6a8c"
)
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_BECH32 = "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L"


def _hex(n: int, offset: int = 0) -> str:
    """A fixed lower-case hex string, like a hash or a hex-encoded key."""
    return (_HEX * 3)[offset : offset + n]


def _base58check(payload: bytes) -> str:
    """Bitcoin's Base58Check encoding (WIF private keys, BIP32 extended keys)."""
    data = payload + hashlib.sha256(hashlib.sha256(payload).digest()).digest()[:4]
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _BASE58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------
# Issue 15: the 15 secrets an outside tester found the original rules missed.

MYSQL_QUOTED = "K9#mq" + "!vL2^wz"
REGISTRY_PASS = "Zq8mR3" + "vLp2Wn"
REDIS_PASS = "r3d1s-" + "Pa55-w0rd"
STORE_PASS = "S3cure" + "Store!"
SSH_NEW_PASS = "blue-Otter-" + "42-canyon"
ZIP_PASS = "Zip" + "Me2024#"
HTPASSWD_PASS = "nGinx-" + "Adm1n-77"
PGPASS_PASS = "Ord3rs" + "RW-2024"
ETH_KEY = _hex(64, 7)
AGE_KEY = "AGE-SECRET-" + "KEY-1" + (_BECH32 * 2)[3:61]
MAILCHIMP = _hex(32, 40) + "-us21"
TWILIO_SID = "AC" + _hex(32, 11)
TWILIO_TOKEN = _hex(32, 77)
PROSE_PASS = "Sunset" + "-Harbor-42"
DICEWARE = "tundra mosaic " + "ladle crimson vouch"
HEROKU_TOKEN = "4f8c2d1e-7b3a-" + "4e9f-a6d5-0c1b2e3f4a5d"

OUTSIDE_TESTER: list[tuple[str, str]] = [
    (f"mysql -h 127.0.0.1 -u root -p'{MYSQL_QUOTED}' shop", MYSQL_QUOTED),
    (f"docker login registry.example.com -u deploy -p {REGISTRY_PASS}", REGISTRY_PASS),
    (f"redis-cli -h cache.internal -p 6379 -a {REDIS_PASS} INFO keyspace", REDIS_PASS),
    (f"keytool -genkeypair -v -keystore release.jks -alias release -keyalg RSA -storepass {STORE_PASS} "
     f"-keypass {STORE_PASS} -dname CN=Acme", STORE_PASS),
    (f"ssh-keygen -t ed25519 -C deploy@ci -N '{SSH_NEW_PASS}' -f ~/.ssh/deploy_key", SSH_NEW_PASS),
    (f"zip -r -P {ZIP_PASS} backup.zip ./exports", ZIP_PASS),
    (f"htpasswd -bc /etc/nginx/.htpasswd admin {HTPASSWD_PASS}", HTPASSWD_PASS),
    (f"$ cat ~/.pgpass\ndb.prod.internal:5432:orders:orders_rw:{PGPASS_PASS}\n", PGPASS_PASS),
    (f"Successfully created new keypair.\nAddress:     0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed\n"
     f"Private key: 0x{ETH_KEY}", ETH_KEY),
    (f"# created: 2024-05-01T12:00:00Z\n# public key: age1{(_BECH32.lower() * 2)[5:63]}\n{AGE_KEY}", AGE_KEY),
    (f"MAILCHIMP_KEY: {MAILCHIMP}", MAILCHIMP),
    (f'client = Client("{TWILIO_SID}", "{TWILIO_TOKEN}")', TWILIO_TOKEN),
    (f"fyi the staging db password is {PROSE_PASS}, same as last week", PROSE_PASS),
    (f'{{"username": "ops", "password": "{DICEWARE}"}}', DICEWARE),
    (f"$ heroku auth:token\n{HEROKU_TOKEN}\n", HEROKU_TOKEN),
]

# ---------------------------------------------------------------------------------------------
# Issue 15: more of each kind, by where the secret turns up.

MONGO_PASS = "m0ngo" + "Adm1n!x"
REDIS_ACL_PASS = "app-" + "R3dis-acl"
SQLSERVER_PASS = "Sa-P@ss" + "w0rd-2022"
MYSQLDUMP_PASS = "Dump" + "er#2024x"
SPRING_PASS = "spr1ng-" + "DS-pass"
ORACLE_PASS = "Or4cle" + "Sys77"
CASSANDRA_PASS = "Cass4" + "ndra!pw"
LDAP_PASS = "ldap-B1nd-" + "Secret"
UPSTASH_PASS = "AX" + _rand(30, 21)
CLICKHOUSE_PASS = "cl1ck" + "H0use-ro"
PSQL_OUTPUT_PASS = "pg-" + "Sh0wn-pw"

DATABASE_MORE: list[tuple[str, str]] = [
    (f'mongosh "mongodb://db1.internal:27017/admin" -u admin -p {MONGO_PASS} --authenticationDatabase admin',
     MONGO_PASS),
    (f"redis-cli --user app --pass {REDIS_ACL_PASS} -h redis.internal -p 6380 GET session:42", REDIS_ACL_PASS),
    (f"sqlcmd -S tcp:sql01.corp.local,1433 -U sa -P '{SQLSERVER_PASS}' -Q \"SELECT @@VERSION\"", SQLSERVER_PASS),
    (f"mysqldump -u backup --password={MYSQLDUMP_PASS} --single-transaction shop > shop.sql", MYSQLDUMP_PASS),
    (f"# application.properties\nspring.datasource.url=jdbc:postgresql://db:5432/app\n"
     f"spring.datasource.username=app\nspring.datasource.password={SPRING_PASS}\n", SPRING_PASS),
    (f"sqlplus system/{ORACLE_PASS}@//oracle.internal:1521/ORCLPDB1", ORACLE_PASS),
    (f"cqlsh 10.0.0.7 9042 -u cassandra -p {CASSANDRA_PASS}", CASSANDRA_PASS),
    (f'ldapsearch -x -H ldaps://ldap.corp.local -D "cn=admin,dc=corp,dc=local" -w {LDAP_PASS} "(uid=jdoe)"',
     LDAP_PASS),
    (f"REDIS_URL=rediss://default:{UPSTASH_PASS}@us1-fancy-gull-38211.upstash.io:38211", UPSTASH_PASS),
    (f"clickhouse-client --host ch.internal --user default --password '{CLICKHOUSE_PASS}' --query 'SELECT 1'",
     CLICKHOUSE_PASS),
    (f"$ pass show db/prod\n{PSQL_OUTPUT_PASS}\nuser: app\nurl: db.internal\n", PSQL_OUTPUT_PASS),
]

QUAY_PASS = "Qu4y-" + "robot-Pw9"
PODMAN_PASS = "Rh-" + "regi5try-pw"
HELM_PASS = "h3lm-" + "Charts-pw"
SKOPEO_PASS = "Sk0peo" + "-Push-1"
NPM_AUTH = _b64(b"ci-bot:" + b"Nx9pL2mQ4w")
PIP_PASS = "p1p-" + "Mirror-pw"
CRATES = "cio" + _rand(32, 23)
RUBYGEMS = "rubygems_" + _hex(48, 5)
NUGET = "oy2" + "kq7x3mzp9t2v5w8y1b4d" + "6f0h3j5l7n9r2s4u6a8c1e3"
NEXUS_TOKEN = "9b1f6c2e-3d4a-" + "4b5c-8d7e-6f5a4b3c2d1e"
POETRY_PASS = "p0etry-" + "Basic-pw"
TWINE_PASS = "tw1ne-" + "Upload-pw"
COMPOSER_OAUTH = _hex(40, 13)
DOCKER_AUTH = _b64(b"ci:" + b"Dock3r-cfg-pw")

REGISTRIES_MORE: list[tuple[str, str]] = [
    (f"echo '{QUAY_PASS}' | podman login quay.io -u 'acme+ci' --password-stdin", QUAY_PASS),
    (f"podman login -u ci -p {PODMAN_PASS} registry.redhat.io", PODMAN_PASS),
    (f"helm registry login registry.example.com --username ci --password {HELM_PASS}", HELM_PASS),
    (f"skopeo copy --dest-creds ci:{SKOPEO_PASS} docker-archive:img.tar docker://registry.example.com/app:1.2",
     SKOPEO_PASS),
    (f"; ~/.npmrc\n//nexus.corp.local/repository/npm-private/:_auth={NPM_AUTH}\nalways-auth=true\n", NPM_AUTH),
    (f"[global]\nindex-url = https://ci:{PIP_PASS}@pypi.corp.local/simple/\ntrusted-host = pypi.corp.local\n",
     PIP_PASS),
    (f"cargo login {CRATES}", CRATES),
    (f"GEM_HOST_API_KEY={RUBYGEMS} gem push acme-core-1.2.0.gem", RUBYGEMS),
    (f"dotnet nuget push bin/Release/Acme.Core.1.2.0.nupkg -k {NUGET} -s https://api.nuget.org/v3/index.json", NUGET),
    (f'npmRegistries:\n  "https://nexus.corp.local/repository/npm/":\n    npmAuthToken: "NpmToken.{NEXUS_TOKEN}"\n',
     NEXUS_TOKEN),
    (f"poetry config http-basic.corp ci {POETRY_PASS}", POETRY_PASS),
    (f"twine upload --repository-url https://pypi.corp.local/ -u ci -p {TWINE_PASS} dist/*", TWINE_PASS),
    (f"composer config --global github-oauth.github.com {COMPOSER_OAUTH}", COMPOSER_OAUTH),
    (f'{{"auths": {{"registry.corp.local": {{"auth": "{DOCKER_AUTH}"}}}}}}', DOCKER_AUTH),
]

AWS_SECRET_2 = "Xk9/aP2vLm" + "8QwRt5Ny3Zb7" + "Hc1Jd4Fg6Ks0Ue2Wi8Op"
AZ_SECRET = "aB3" + "8Q~" + _rand(20, 5) + "~" + _rand(13, 9)
AZ_SECRET_2 = "Zy7" + "8Q~" + _rand(22, 15) + "." + _rand(11, 3)
AZ_STORAGE_KEY = _b64(hashlib.sha512(b"azure storage account key").digest())
HEROKU_LONG = "HRKU-AA" + _rand(58, 17)
MINIO_SECRET = "minio-" + "S3cret-Key-2024"
GH_SECRET_PASS = "Deploy" + "-Pw-5150"
VERCEL_TOKEN = _rand(24, 31)
NETLIFY = "nfp_" + _rand(36, 33)
FLY = "fm2_" + _rand(60, 35)
GCLOUD_SQL_PASS = "Cl0ud-" + "SQL-pg-pw"
K8S_DECODED = "kub3-" + "Decoded-pw"
REGCRED_PASS = "Reg-" + "Cred-pw88"

CLOUD_MORE: list[tuple[str, str]] = [
    (f"aws configure set aws_secret_access_key {AWS_SECRET_2} --profile ci", AWS_SECRET_2),
    (f"az login --service-principal -u 0f4e2a6c-1b3d-4e5f-8a9b-7c6d5e4f3a2b -p {AZ_SECRET} "
     f"--tenant 9a8b7c6d-5e4f-4a3b-2c1d-0e9f8a7b6c5d", AZ_SECRET),
    (f'{{\n  "appId": "0f4e2a6c-1b3d-4e5f-8a9b-7c6d5e4f3a2b",\n  "displayName": "gh-actions",\n'
     f'  "password": "{AZ_SECRET_2}",\n  "tenant": "9a8b7c6d-5e4f-4a3b-2c1d-0e9f8a7b6c5d"\n}}', AZ_SECRET_2),
    (f'[\n  {{\n    "creationTime": "2024-05-01T12:00:00+00:00",\n    "keyName": "key1",\n'
     f'    "permissions": "FULL",\n    "value": "{AZ_STORAGE_KEY}"\n  }}\n]', AZ_STORAGE_KEY),
    (f"Creating OAuth Authorization... done\nClient:      <none>\nID:          2b3c4d5e-6f70-4812-9a3b-4c5d6e7f8091\n"
     f"Description: ci deploy\nScope:       global\nToken:       {HEROKU_LONG}\n", HEROKU_LONG),
    (f"mc alias set prod https://minio.corp.local:9000 minioadmin {MINIO_SECRET}", MINIO_SECRET),
    (f"gh secret set DEPLOY_PASSWORD --repo acme/api --body '{GH_SECRET_PASS}'", GH_SECRET_PASS),
    (f"vercel deploy --prod --token {VERCEL_TOKEN}", VERCEL_TOKEN),
    (f"netlify deploy --prod --dir dist --auth {NETLIFY}", NETLIFY),
    (f'FLY_API_TOKEN="FlyV1 {FLY}"', FLY),
    (f"gcloud sql users set-password postgres --instance=main --password={GCLOUD_SQL_PASS}", GCLOUD_SQL_PASS),
    (f"$ kubectl get secret db-creds -o jsonpath='{{.data.password}}' | base64 -d\n{K8S_DECODED}", K8S_DECODED),
    (f"kubectl create secret docker-registry regcred --docker-server=ghcr.io --docker-username=ci "
     f"--docker-password={REGCRED_PASS}", REGCRED_PASS),
]

MNEMONIC_12 = "oyster vital glimpse hurdle fabric tennis " + "orphan cushion lava wisdom bracket gauge"
MNEMONIC_24 = (
    "canvas jungle salmon rifle pilot wealth kitten donor useless ramp cereal vacant "
    + "north exhibit orchard mirror spider rocket fever tenant luggage amateur silver velvet"
)
MNEMONIC_HARDHAT = "cabin matrix olive fringe dizzy sugar " + "ladder mango pupil window arctic sponsor"
MNEMONIC_PROSE = "robust effort humble tragic lemon atom " + "glove crater pause ivory siren dentist"
WIF = _base58check(b"\x80" + hashlib.sha256(b"loomd corpus wif").digest() + b"\x01")
XPRV = _base58check(
    bytes.fromhex("0488ade4") + bytes(9) + hashlib.sha256(b"loomd chain").digest() + b"\0"
    + hashlib.sha256(b"loomd xprv").digest()
)
SOLANA_KEYPAIR = "[" + ",".join(str(b) for b in hashlib.sha512(b"loomd solana keypair").digest()) + "]"
DEPLOYER_KEY = _hex(64, 21)
FORGE_KEY = _hex(64, 49)

CRYPTO_MORE: list[tuple[str, str]] = [
    (f'MNEMONIC="{MNEMONIC_12}"', MNEMONIC_12),
    (f"Wrote new keypair to /home/dev/.config/solana/id.json\n====================\n"
     f"Save this seed phrase and your BIP39 passphrase to recover your new keypair:\n{MNEMONIC_24}\n"
     f"====================", MNEMONIC_24),
    (f'    sepolia: {{ url: process.env.RPC_URL, accounts: {{ mnemonic: "{MNEMONIC_HARDHAT}" }} }},',
     MNEMONIC_HARDHAT),
    (f"my metamask recovery phrase is {MNEMONIC_PROSE}, keep it safe", MNEMONIC_PROSE),
    (f'bitcoin-cli importprivkey "{WIF}" "cold-storage" false', WIF),
    (f"Account 0 extended private key: {XPRV}", XPRV),
    (f"$ cat ~/.config/solana/id.json\n{SOLANA_KEYPAIR}", SOLANA_KEYPAIR),
    (f"DEPLOYER_PRIVATE_KEY={DEPLOYER_KEY}", DEPLOYER_KEY),
    (f"forge script script/Deploy.s.sol --rpc-url $SEPOLIA_RPC --private-key 0x{FORGE_KEY} --broadcast", FORGE_KEY),
]

P12_PASS = "P12-" + "Export-pw9"
PASSIN_PASS = "Rsa-" + "Unl0ck-pw"
ENC_PASS = "Enc-" + "Backup-2024x"
GPG_PASS = "gpg-" + "Sign1ng-Phrase"
OLD_PASSPHRASE = "old-Phrase-" + "17-river"
SEVENZ_PASS = "7z-" + "Arch1ve-pw"
UNZIP_PASS = "Inv0ice" + "s-2024"
JAR_PASS = "J4r-" + "Sign-pw"
SSHPASS_PASS = "Scp-" + "Deploy-99"
WG_KEY = _b64(hashlib.sha256(b"loomd wireguard").digest())
TLS_KEY_BODY = "MIIEvgIBADANBgkqhkiG9w0BAQEFAASC" + _rand(32, 2) + "\n    " + _rand(64, 7)

KEYS_MORE: list[tuple[str, str]] = [
    (f"openssl pkcs12 -export -in cert.pem -inkey key.pem -out bundle.p12 -passout pass:{P12_PASS}", P12_PASS),
    (f"openssl rsa -in encrypted.key -out plain.key -passin pass:{PASSIN_PASS}", PASSIN_PASS),
    (f"openssl enc -aes-256-cbc -salt -pbkdf2 -in db.sql -out db.sql.enc -k {ENC_PASS}", ENC_PASS),
    (f"gpg --batch --yes --pinentry-mode loopback --passphrase '{GPG_PASS}' --decrypt secrets.tar.gpg", GPG_PASS),
    (f"ssh-keygen -p -f ~/.ssh/id_ed25519 -P '{OLD_PASSPHRASE}' -N ''", OLD_PASSPHRASE),
    (f"7z a -p{SEVENZ_PASS} -mhe=on backup.7z ~/Documents/finance", SEVENZ_PASS),
    (f"unzip -P {UNZIP_PASS} invoices-2024.zip -d invoices/", UNZIP_PASS),
    (f"jarsigner -keystore release.jks -storepass {JAR_PASS} app-release-unsigned.apk release", JAR_PASS),
    (f"sshpass -p '{SSHPASS_PASS}' scp dump.sql deploy@10.0.0.9:/tmp/", SSHPASS_PASS),
    (f"[Interface]\nAddress = 10.8.0.2/24\nPrivateKey = {WG_KEY}\nDNS = 1.1.1.1\n", WG_KEY),
    (f"  tls.key: |\n    -----BEGIN PRIVATE KEY-----\n    {TLS_KEY_BODY}\n    -----END PRIVATE KEY-----\n",
     TLS_KEY_BODY),
]

SUDO_PASS = "sud0-" + "Laptop-pw"
SMB_PASS = "Smb-" + "F1les-pw"
WIFI_PASS = "Office-" + "Wifi-5150"

SHELL_MORE: list[tuple[str, str]] = [
    (f"echo '{SUDO_PASS}' | sudo -S systemctl restart nginx", SUDO_PASS),
    (f"smbclient //fileserver/finance -U 'CORP\\jdoe%{SMB_PASS}' -c 'ls'", SMB_PASS),
    (f"nmcli device wifi connect \"Office-5G\" password '{WIFI_PASS}'", WIFI_PASS),
]

TOML_PASS = "t0ml-" + "Db-pass"
MYCNF_PASS = "Bkp-" + "My.cnf-9"
MAVEN_PASS = "Mvn-" + "Nexus-d3ploy"
K8S_B64 = _b64(b"k8s-" + b"Db-Pa55word")
DOCKERCONFIGJSON = _b64(json.dumps({"auths": {"ghcr.io": {"auth": _b64(b"ci:" + b"ghcr-Pw-77")}}}).encode())
GCP_SA_B64 = _b64(
    json.dumps(
        {
            "type": "service_account",
            "project_id": "acme-prod",
            "private_key_id": _hex(40, 2),
            "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n" + _rand(64, 5),
            "client_email": "ci@acme-prod.iam.gserviceaccount.com",
        },
        indent=2,
    ).encode()
)
LARAVEL_KEY = _b64(hashlib.sha256(b"loomd laravel").digest())
COMPOSE_PASS = "Compose-" + "Pg-pw42"
TF_PASS = "Terra-" + "f0rm-pw"
WPA_PASS = "Home-" + "Wlan-8812"
JAAS_PASS = "Kafka-" + "Sasl-pw7"
ANSIBLE_PASS = "Bec0me-" + "Root-pw"
XML_PASS = "Xml-" + "DataSrc-pw1"
NEXTAUTH = _b64(hashlib.sha256(b"loomd nextauth").digest())

CONFIG_MORE: list[tuple[str, str]] = [
    (f'[database]\nhost = "db.internal"\nuser = "app"\npassword = "{TOML_PASS}"\n', TOML_PASS),
    (f"[client]\nuser=backup\npassword={MYCNF_PASS}\nhost=127.0.0.1\n", MYCNF_PASS),
    (f"<server>\n  <id>nexus-releases</id>\n  <username>deploy</username>\n  <password>{MAVEN_PASS}</password>\n"
     f"</server>", MAVEN_PASS),
    (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: db\ntype: Opaque\ndata:\n  username: YXBw\n"
     f"  password: {K8S_B64}\n", K8S_B64),
    (f"kind: Secret\ntype: kubernetes.io/dockerconfigjson\ndata:\n  .dockerconfigjson: {DOCKERCONFIGJSON}\n",
     DOCKERCONFIGJSON),
    (f"kind: Secret\ndata:\n  credentials.json: {GCP_SA_B64}\n", GCP_SA_B64),
    (f"APP_KEY=base64:{LARAVEL_KEY}", LARAVEL_KEY),
    (f"    environment:\n      - POSTGRES_USER=app\n      - POSTGRES_PASSWORD={COMPOSE_PASS}\n", COMPOSE_PASS),
    (f'variable "db_password" {{\n  type      = string\n  default   = "{TF_PASS}"\n  sensitive = true\n}}', TF_PASS),
    (f'network={{\n    ssid="HomeNet"\n    psk="{WPA_PASS}"\n}}', WPA_PASS),
    (f"sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username=\"svc\" "
     f"password=\"{JAAS_PASS}\";", JAAS_PASS),
    (f"ansible_user: deploy\nansible_become_pass: {ANSIBLE_PASS}\n", ANSIBLE_PASS),
    (f'<DataSource name="main" user="sa" password="{XML_PASS}" url="jdbc:sqlserver://db:1433"/>', XML_PASS),
    (f"NEXTAUTH_SECRET={NEXTAUTH}", NEXTAUTH),
]

TELEGRAM = "7312845960:" + "AA" + _rand(33, 8)
DISCORD = "MTE" + _rand(23, 4) + "." + "Gx7Kp2" + "." + _rand(38, 6)
NOTION = "ntn_" + _rand(46, 12)

TOKENS_MORE: list[tuple[str, str]] = [
    (f"curl -s https://api.telegram.org/bot{TELEGRAM}/getUpdates", TELEGRAM),
    (f'client.run("{DISCORD}")', DISCORD),
    (f'notion = Client(auth="{NOTION}")', NOTION),
]

PROSE_RESET = "Wint3r" + "-Is-Here!"
PROSE_KEYSTORE = "k3ystore-" + "Unlock-77"
PROSE_HEX = _hex(32, 91)
PROSE_WIFI = "Gr33n-" + "Tea-Office"
PROSE_GH = _hex(40, 3)
PROSE_AS = "Tmp-" + "Acc0unt-pw"
PROSE_SLASH = "St4ging-" + "Deploy!"
PROSE_RU = "Baza-" + "Pr0d-2024"
PROSE_ES = "Serv1dor-" + "Clave-9"
PROSE_SSH = "Jump-" + "H0st-pw"
PROSE_BARE = "Dr4gon-" + "Fly-88"
PROSE_BARE_HEX = _hex(32, 55)

PROSE: list[tuple[str, str]] = [
    (f"I reset the admin password to {PROSE_RESET} — please change it after you log in.", PROSE_RESET),
    (f"Passphrase for the release keystore is `{PROSE_KEYSTORE}`", PROSE_KEYSTORE),
    (f"ok, use this api key for now: {PROSE_HEX}", PROSE_HEX),
    (f"The wifi password for the office is {PROSE_WIFI}.", PROSE_WIFI),
    (f"my old github token was {PROSE_GH} but I revoked it", PROSE_GH),
    (f"Use {PROSE_AS} as the password for the test account", PROSE_AS),
    (f"creds for staging are deploy / {PROSE_SLASH}", PROSE_SLASH),
    (f"Пароль от базы: {PROSE_RU}", PROSE_RU),
    (f"la contraseña del servidor es {PROSE_ES}", PROSE_ES),
    (f"ssh in as deploy, password {PROSE_SSH}, then sudo su", PROSE_SSH),
    # No label at all: nothing says these are secrets, and a hex string looks like any hash.
    (f"server 10.0.0.9, user deploy, {PROSE_BARE}", PROSE_BARE),
    (f"paste this into the dashboard: {PROSE_BARE_HEX}", PROSE_BARE_HEX),
]

# ---------------------------------------------------------------------------------------------
# The samples from before issue 15, by category.

_CONFIG_FILES_BEFORE: list[tuple[str, str]] = [
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
    (f'{{"api_key": "{ENV_VALUE}", "model": "gpt-4o"}}', ENV_VALUE),
    (f'{{"mcpServers": {{"gh": {{"env": {{"GITHUB_PERSONAL_ACCESS_TOKEN": "{GITHUB_FINE}"}}}}}}}}', GITHUB_FINE),
    (f'  "password": "{URL_PASS}",', URL_PASS),
    (f"slack_webhook: https://hooks.slack.com/services/T0ABC1234/B0DEF5678/{_rand(24, 7)}", _rand(24, 7)),
    (f"stripe:\n  restricted_key: {STRIPE_RESTRICTED}\n", STRIPE_RESTRICTED),
    (f'const firebaseConfig = {{ apiKey: "{GOOGLE}", projectId: "demo-app" }};', GOOGLE),
    (f'{{"tool_result": "{{\\"token\\": \\"{ENV_VALUE}\\"}}"}}', ENV_VALUE),
    (f"export SLACK_USER_TOKEN={SLACK_USER}", SLACK_USER),
    (f"machine api.heroku.com login me@example.com password {URL_PASS}", URL_PASS),
    (f"AZURE_STORAGE=DefaultEndpointsProtocol=https;AccountName=acme;AccountKey={GENERIC}==;", GENERIC),
    (f'<add key="ApiKey" value="{ENV_VALUE}" />', ENV_VALUE),
]

_DATABASE_BEFORE: list[tuple[str, str]] = [
    (f"mysql -h db.internal -u root -p{DB_PASS} app_prod", DB_PASS),
    (f"PGPASSWORD={DB_PASS} psql -h localhost -U app app_dev", DB_PASS),
    (f"DATABASE_URL=postgres://app:{DB_PASS}@db.internal:5432/app_prod", DB_PASS),
    (f'engine = create_engine("postgresql+psycopg2://svc:{DB_PASS}@10.0.0.5/analytics")', DB_PASS),
    (f"MONGO_URI=mongodb+srv://admin:{URL_PASS}@cluster0.ab1cd.mongodb.net/test", URL_PASS),
    (f"redis://:{URL_PASS}@cache.internal:6379/0", URL_PASS),
    (f"amqp://guest:{URL_PASS}@rabbitmq:5672/vhost", URL_PASS),
    (f"Server=tcp:sql.example.net,1433;Database=app;User Id=sa;Password={DB_PASS};Encrypt=true", DB_PASS),
    (f"jdbc:mysql://db:3306/app?user=root&password={DB_PASS}", DB_PASS),
    (f"psql 'host=db port=5432 user=app password={DB_PASS} dbname=app'", DB_PASS),
]

_REGISTRIES_AND_PACKAGES_BEFORE: list[tuple[str, str]] = [
    (f"docker login ghcr.io -u octocat --password {GITHUB_OAUTH}", GITHUB_OAUTH),
    (f"npm config set //registry.npmjs.org/:_authToken={NPM}", NPM),
    (f"huggingface-cli login --token {HF}", HF),
    (f"//npm.pkg.github.com/:_authToken={GITHUB_PAT[:-6]}Zz9Yx8", GITHUB_PAT[:-6] + "Zz9Yx8"),
    (f"docker login -u acme -p {DOCKERHUB}", DOCKERHUB),
]

_CLOUD_CLI_BEFORE: list[tuple[str, str]] = [
    (f'{{"Credentials": {{"AccessKeyId": "ASIA{AWS_ID[4:]}", "SecretAccessKey": "{AWS_SECRET}"}}}}', AWS_SECRET),
    (f"kubectl create secret generic db --from-literal=password={DB_PASS}", DB_PASS),
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
]

_SSH_GPG_KEYS_BEFORE: list[tuple[str, str]] = [
    (f"$ cat ~/.ssh/id_rsa\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----\n", PEM_BODY),
    (f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SSH_BODY}\n-----END OPENSSH PRIVATE KEY-----", SSH_BODY),
    (f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n{PGP_BODY}\n-----END PGP PRIVATE KEY BLOCK-----", PGP_BODY),
    (f'"private_key": "-----BEGIN PRIVATE KEY-----\\n{_rand(64, 3)}\\n-----END PRIVATE KEY-----\\n"', _rand(64, 3)),
    (f"$ head -3 server.key\n-----BEGIN EC PRIVATE KEY-----\n{_rand(64, 5)}\n", _rand(64, 5)),
    (f"PuTTY-User-Key-File-3: ssh-rsa\nPrivate-Lines: 2\n{_rand(64, 2)}\n{_rand(24, 9)}\nPrivate-MAC: 1", _rand(64, 2)),
    (f"-----BEGIN ENCRYPTED PRIVATE KEY-----\n{_rand(64, 6)}\n-----END ENCRYPTED PRIVATE KEY-----", _rand(64, 6)),
    (f"-----BEGIN DSA PRIVATE KEY-----\n{_rand(64, 4)}\n-----END DSA PRIVATE KEY-----", _rand(64, 4)),
]

_SHELL_AND_CLI_BEFORE: list[tuple[str, str]] = [
    (f"docker run -e DB_PASSWORD={DB_PASS} -e PORT=8080 postgres:16", DB_PASS),
    (f"+ export SLACK_BOT_TOKEN={SLACK_BOT}", SLACK_BOT),
]

_HTTP_AND_LOGS_BEFORE: list[tuple[str, str]] = [
    (f"$ curl -H 'Authorization: Bearer {GITHUB_PAT}' https://api.github.com/user", GITHUB_PAT),
    (f'curl -s -H "Authorization: Bearer {ENV_VALUE}" https://api.example.com/v1/items', ENV_VALUE),
    (f'curl -H "Authorization: Basic {BASIC}" https://ci.example.com/api/json', BASIC),
    (f"curl -u admin:{URL_PASS} https://jenkins.internal:8443/api/json", URL_PASS),
    (f'curl https://api.openai.com/v1/models -H "Authorization: Bearer {OPENAI_LEGACY}"', OPENAI_LEGACY),
    (f"git remote add origin https://x-access-token:{GITHUB_APP}@github.com/acme/api.git", GITHUB_APP),
    (f"git clone https://oauth2:{GITLAB}@gitlab.com/acme/infra.git", GITLAB),
    (f"Fetching https://deploy:{URL_PASS}@registry.example.com/v2/", URL_PASS),
    (f"2024-05-01T12:00:00Z INFO auth ok user=42 jwt={JWT}", JWT),
    (f"DEBUG request headers: {{'Authorization': 'Bearer {JWT}'}}", JWT),
    (f"Set-Cookie: session={ENV_VALUE}; Path=/; HttpOnly", ENV_VALUE),
    (f"X-API-Key: {GENERIC}", GENERIC),
    (f"Found key {AWS_ID} in ~/.aws/credentials", AWS_ID),
    (f"The request used token {GENERIC} and failed with 401", GENERIC),
    (f"resp = requests.get(url, auth=('admin', '{URL_PASS}'), timeout=10)", URL_PASS),
    (f"https://acme.blob.core.windows.net/logs/a.txt?sv=2022-11-02&sr=b&sig=Xy{_rand(30, 4)}%3D", _rand(30, 4)),
    (f"Proxy-Authorization: Basic {BASIC}", BASIC),
    (f"Authorization: token {_rand(40, 12)}", _rand(40, 12)),
    (f'{{"headers": {{"Authorization": "Bearer {_rand(48, 13)}"}}}}', _rand(48, 13)),
]

_PROVIDER_TOKENS_BEFORE: list[tuple[str, str]] = [
    (f'headers = {{"x-api-key": "{ANTHROPIC}", "anthropic-version": "2023-06-01"}}', ANTHROPIC),
    (f"client = OpenAI(api_key='{OPENAI_LEGACY}')", OPENAI_LEGACY),
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
    (f"git clone https://x-token-auth:{BITBUCKET}@bitbucket.org/acme/app.git", BITBUCKET),
    (f"GITLAB_RUNNER_TOKEN={GITLAB_RUNNER}", GITLAB_RUNNER),
    (f"refresh_token: {GITHUB_REFRESH}", GITHUB_REFRESH),
    (f"gh auth status: logged in with {GITHUB_USER}", GITHUB_USER),
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
]

# The first sample's secret (an AWS key id) is recognisable alone, with no context: tests use it as a bare string.
CORPUS: dict[str, list[tuple[str, str]]] = {
    "config_files": _CONFIG_FILES_BEFORE + CONFIG_MORE,
    "outside_tester": OUTSIDE_TESTER,
    "database": _DATABASE_BEFORE + DATABASE_MORE,
    "registries_and_packages": _REGISTRIES_AND_PACKAGES_BEFORE + REGISTRIES_MORE,
    "cloud_cli": _CLOUD_CLI_BEFORE + CLOUD_MORE,
    "crypto_wallets": CRYPTO_MORE,
    "ssh_gpg_keys": _SSH_GPG_KEYS_BEFORE + KEYS_MORE,
    "shell_and_cli": _SHELL_AND_CLI_BEFORE + SHELL_MORE,
    "http_and_logs": _HTTP_AND_LOGS_BEFORE,
    "provider_tokens": _PROVIDER_TOKENS_BEFORE + TOKENS_MORE,
    "prose": PROSE,
}

# Samples redaction is known to miss, each with the reason; the corpus test checks this list is exact.
KNOWN_MISSES: dict[str, str] = {
    f"server 10.0.0.9, user deploy, {PROSE_BARE}": "a password with no label: nothing says it is one",
    f"paste this into the dashboard: {PROSE_BARE_HEX}": "unlabelled hex: as likely a hash or a commit as a key",
}

# Every sample that must be redacted: the redaction tests and the "no secret on disk" tests use these.
SECRET_SAMPLES: list[tuple[str, str]] = [
    sample for samples in CORPUS.values() for sample in samples if sample[0] not in KNOWN_MISSES
]
