"""The README as a newcomer follows it: its runnable shell blocks work as written against a temporary home, and
every file it names is in the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import REPO, path_without_agents

README = REPO / "README.md"
MARK = "<!-- runnable -->"


def runnable_blocks(text: str) -> list[str]:
    """The fenced shell blocks right after a `<!-- runnable -->` line, in order."""
    return re.findall(re.escape(MARK) + r"\s*\n```(?:sh|bash)\n(.*?)\n```", text, flags=re.DOTALL)


def test_the_runnable_blocks_run_as_written(tmp_path: Path) -> None:
    blocks = runnable_blocks(README.read_text())
    assert len(blocks) >= 4, "the newcomer's path lost its runnable blocks"
    user_home = tmp_path / "home"
    user_home.mkdir()
    loomd_home = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))  # short: the socket path has a length limit
    # This interpreter's bin (loomd, loom) first; whatever agent CLIs the machine has, the run must not depend on them.
    env = {"HOME": str(user_home), "LOOMD_HOME": str(loomd_home), "LANG": "C.UTF-8",
           "PATH": f"{Path(sys.executable).parent}:{path_without_agents(tmp_path / 'bin')}"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # a worktree's code, when the venv is another checkout's
    script = "set -eo pipefail\n" + "\n".join(blocks) + "\n"
    try:
        run = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    finally:  # a block that failed before `loom stop` must not leave a daemon behind
        subprocess.run([str(Path(sys.executable).parent / "loom"), "stop"], env=env, capture_output=True, timeout=60)
    out = run.stdout
    assert run.returncode == 0, f"stdout:\n{out}\nstderr:\n{run.stderr}\nlog:\n{_log(user_home)}"
    assert out.startswith("loomd ") and "loomd" in out.splitlines()[1]  # --version, then status
    assert "# loom install systemd" in out
    assert "the hooks went into settings.json" in out and (user_home / ".claude" / "settings.json").is_file()
    assert "stored #1 (dir:" in out and "[LOOM] shop · 1 memories · shown: 1 rules" in out
    assert re.search(r"^#1 +[0-9.]+ +\w+", out, re.MULTILINE), out  # the hit with its score and signal
    assert "no results in project dir:" in out  # the nonsense query
    assert "OK   daemon socket" in out and "OK   hooks (claude)" in out
    assert "stopped loomd (pid" in out


def _log(user_home: Path) -> str:
    log = user_home / "loomd.log"
    return log.read_text()[-3000:] if log.exists() else "(no log)"


def test_every_file_the_readme_names_exists() -> None:
    text = README.read_text()
    top = {p.name for p in REPO.iterdir()}
    # Paths from the repository root (`loomd/trust.py`, `.ci/run`, `systemd/`) and documents next to the README;
    # not what lives outside it (`../shared/data/…`, `~/.claude/…`, `$LOOMD_HOME/…`).
    named = set(re.findall(r"(?<![\w/$~.<{-])((?:\.?[\w-]+/)+[\w.-]*)", text))
    named |= set(re.findall(r"(?<![\w/.-])[\w-]+\.md\b", text))
    missing = []
    for path in sorted(named):
        first = path.split("/", 1)[0]
        if path.endswith(".md") and "/" not in path or first in top:
            if not (REPO / path.rstrip("/")).exists():
                missing.append(path)
    assert not missing, f"the README names files that are not in the repository: {missing}"
