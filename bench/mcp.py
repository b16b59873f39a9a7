"""How fast `python -m loomd.mcp` answers an MCP client's `initialize`, against a bare interpreter's start.

Clients drop MCP servers that are slow to start (~1 s): the server must answer its handshake within 0.8 s of a bare
interpreter answering one line, measured in the same run (load slows both alike). Prints one JSON object: the floor,
the handshake times (best of `--runs`), the margin and whether it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BOUND_S = 0.8  # what loomd.mcp may add to a bare interpreter's start
HELLO = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}}) + "\n"


def floor_s() -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.readline())"], input=HELLO,
                   capture_output=True, text=True, check=True)
    return time.monotonic() - start


def handshake_s(home: str) -> float:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "loomd.mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO, env={**os.environ, "LOOMD_HOME": home})
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(HELLO)
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    took = time.monotonic() - start
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()
    if reply.get("result", {}).get("serverInfo", {}).get("name") != "loom":
        raise SystemExit(f"unexpected reply: {reply}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="the best of this many of each (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loomd-mcp-") as home:
        floors = [floor_s() for _ in range(args.runs)]
        shakes = [handshake_s(home) for _ in range(args.runs)]
    margin = min(shakes) - min(floors)
    print(json.dumps({"bench": "mcp", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                  "loadavg": list(os.getloadavg())},
                      "floor_s": [round(t, 4) for t in floors], "handshake_s": [round(t, 4) for t in shakes],
                      "added_s": round(margin, 4), "bound_s": BOUND_S, "holds": margin < BOUND_S}, indent=1))


if __name__ == "__main__":
    main()
