"""Fixtures: a private LOOMD_HOME with a short socket path, a real daemon, a real store."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlean

from loomd.client import AsyncClient, Client
from loomd.config import load_config
from loomd.daemon import Daemon
from loomd.store.db import Store, connect_sync

REPO = Path(__file__).resolve().parent.parent
REQUIRE_ALL = os.environ.get("LOOMD_REQUIRE_ALL", "") not in ("", "0")
# What a prompt's recall shows is tested apart from this machine's speed: a loaded runner must not turn a hook's
# block into a follow-up, in any daemon a test starts (`DaemonProcess` passes this environment on). The budget itself
# is tested with 0 (`test_context`) and measured by bench/hooks.py.
RECALL_BUDGET = {"LOOMD_PROMPT_RECALL_BUDGET_MS": "10000"}
os.environ.update(RECALL_BUDGET)


AGENT_CLIS = ("claude", "codex")


def path_without_agents(folder: Path) -> str:
    """A PATH of the system's tools minus the agents' CLIs (symlinks in `folder`): a test that needs them absent
    passes whether or not this machine has them installed globally."""
    folder.mkdir(parents=True, exist_ok=True)
    for system in ("/usr/local/bin", "/usr/bin", "/bin"):
        if not os.path.isdir(system):
            continue
        for name in os.listdir(system):
            if name not in AGENT_CLIS and not os.path.lexists(folder / name):
                (folder / name).symlink_to(Path(system) / name)
    return str(folder)


def test_data_dir() -> Path:
    return Path(os.environ.get("LOOMD_TEST_DATA") or REPO.parent / "shared" / "data")


def query(home: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """A read of the daemon's database file, as a test checks what was stored.

    Through the daemon's own SQLite build (sqlean): a second SQLite library in the process does not see the first
    one's POSIX locks on the WAL index, and closing its connection can pull the shared memory from under the
    in-process daemon's connections (SIGBUS)."""
    conn = sqlean.connect(f"file:{home / 'loomd.db'}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def need_test_data(*parts: str) -> Path:
    """The shared data path, or a skip with the reason (CI turns that skip into a failure)."""
    path = test_data_dir().joinpath(*parts)
    if not path.exists():
        pytest.skip(f"test data {path} is absent (set LOOMD_TEST_DATA)")
    return path


def pytest_report_header(config: pytest.Config) -> str:
    conn = connect_sync(":memory:")
    sqlite, vec = conn.execute("SELECT sqlite_version(), vec_version()").fetchone()
    conn.close()
    return f"loomd: SQLite {sqlite}, sqlite-vec {vec}, test data {test_data_dir()}, require all: {REQUIRE_ALL}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI (LOOMD_REQUIRE_ALL=1) a skipped test is a failed test: nothing may silently not run."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which requires every test to run: {report.longrepr}"


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private LOOMD_HOME under /tmp, short enough for AF_UNIX paths (~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lm", dir="/tmp"))
    monkeypatch.setenv("LOOMD_HOME", str(path))
    for name in list(os.environ):
        if name.startswith("LOOMD_") and name not in ("LOOMD_HOME", "LOOMD_TEST_DATA", "LOOMD_REQUIRE_ALL",
                                                      "LOOMD_AGENTS_PREFIX", *RECALL_BUDGET):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LOOMD_EMBEDDER", os.environ.get("LOOMD_TEST_EMBEDDER", "local"))
    # Never let a test daemon scan the developer's real ~/.codex sessions.
    monkeypatch.setenv("LOOMD_CODEX_HOME", str(path / "codex-home"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sock_path(home: Path) -> Path:
    return home / "loomd.sock"


async def wait_for_socket(path: Path, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if os.path.exists(path):  # noqa: ASYNC240 - a stat in a test poll loop
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"daemon socket {path} did not appear")


@asynccontextmanager
async def serving(sock_path: Path) -> AsyncIterator[Daemon]:
    """A real Daemon.serve() task in this loop, configured from the environment (LOOMD_HOME, LOOMD_*), until the
    block ends; a daemon that dies while starting raises its error here."""
    d = Daemon(load_config())
    task = asyncio.create_task(d.serve())
    waiter = asyncio.create_task(wait_for_socket(sock_path))
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()
    try:
        yield d
    finally:
        d.should_exit.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def daemon(home: Path, sock_path: Path) -> AsyncIterator[Daemon]:
    """A real daemon on a temporary socket and database file."""
    async with serving(sock_path) as d:
        yield d


async def caught_up(client: AsyncClient, within_s: float = 30.0) -> dict[str, Any]:
    """Wait until the back-fill has embedded everything stored so far."""
    for _ in range(int(within_s / 0.02)):
        status = (await client.call("status"))["embedder"]
        if status["caught_up"] and status["state"] != "loading":
            return status
        await asyncio.sleep(0.02)
    raise TimeoutError(f"embedder never caught up: {status}")


@pytest.fixture
async def client(daemon: Daemon, sock_path: Path) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(sock_path) as c:
        yield c


@pytest.fixture
async def quiet(
    home: Path, sock_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Daemon, AsyncClient]]:
    """A passive daemon without an embedder and its client: the observer runs when asked, nothing runs behind the
    test's back."""
    monkeypatch.setenv("LOOMD_PASSIVE", "1")
    monkeypatch.setenv("LOOMD_EMBEDDER", "none")
    async with serving(sock_path) as d, AsyncClient(sock_path) as c:
        yield d, c


@pytest.fixture
async def store(home: Path) -> AsyncIterator[Store]:
    s = await Store.open(home / "loomd.db")
    yield s
    await s.close()


PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def drop_dac_capabilities() -> None:
    """In the child before exec: as root, give up the override of file modes, so a 0500 folder is unwritable."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


class DaemonProcess:
    """`python -m loomd serve` as a real child process, for signal, crash and fault tests."""

    def __init__(self, home: Path, env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.home = home
        self.env = {**os.environ, "LOOMD_HOME": str(home), **(env or {})}
        self.preexec_fn = preexec_fn  # e.g. drop root's override of file modes, or lower the fd limit
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "daemon.log"

    @property
    def sock(self) -> Path:
        return self.home / "loomd.sock"

    def start(self, wait: bool = True) -> DaemonProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=REPO,
                                         preexec_fn=self.preexec_fn)  # noqa: PLW1509
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with Client(self.sock, timeout=2) as c:
                    c.call("ping")
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        raise TimeoutError(f"daemon did not come up: {self.log.read_text()[-2000:]}")

    def stop(self, sig: int = 15, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture
def daemon_process(home: Path) -> Iterator[DaemonProcess]:
    procs: list[DaemonProcess] = []

    def make(env: dict[str, str] | None = None, preexec_fn: Callable[[], None] | None = None) -> DaemonProcess:
        p = DaemonProcess(home, env, preexec_fn)
        procs.append(p)
        return p

    yield make  # type: ignore[misc]
    for p in procs:
        if p.proc and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
