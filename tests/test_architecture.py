"""The house plan (ARCHITECTURE.md) holds: every import inside `loomd/` follows the wing rules, and there is no
import cycle. An AST walk, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "loomd"

SHARED = {"loomd", "config", "errors", "protocol", "client", "redact", "trust", "supervisor", "ignore", "offload",
          "memory"}
# Which parts each part may import (besides itself). Wings are subpackages; the rest are top-level modules.
ALLOWED: dict[str, set[str]] = {
    "shared": set(),
    "store": set(),
    "ingest": {"store"},
    "vectors": {"store"},
    "search": {"store", "ingest", "vectors"},
    "team": {"store", "search"},
    "workers": {"store", "ingest", "vectors", "team"},
    "context": {"store", "ingest", "search"},
    "installer": {"store", "vectors"},
    "server": set(),
    "ops": {"store", "ingest", "vectors", "search", "context", "workers", "team"},
    "daemon": {"store", "ingest", "vectors", "search", "context", "workers", "team", "server", "ops"},
    "mcp": set(),
    "ui": set(),
    "cli": {"installer", "mcp", "ui", "team"},
    "__main__": {"daemon"},
}


def part(module: str) -> str:
    """`loomd.store.db` -> store; `loomd.ops` -> ops; `loomd.config` -> shared."""
    name = module.split(".")[1] if "." in module else "loomd"
    return "shared" if name in SHARED else name


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the loomd modules it imports (a `from pkg import mod` names the module)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_of(path)
        targets = found.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}: relative import; the house style is absolute `loomd.` imports"
                if node.module and node.module.split(".")[0] == "loomd":
                    for alias in node.names:
                        name = f"{node.module}.{alias.name}"
                        is_module = (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists()
                        targets.add(name if is_module else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "loomd")
    return found


def test_every_part_has_a_rule() -> None:
    assert {part(m) for m in imports()} <= set(ALLOWED)


def test_imports_follow_the_wing_rules() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in imports().items() for target in targets
        if part(target) not in {part(module), "shared"} | ALLOWED[part(module)]
        or (part(module) == "shared" and part(target) != "shared")
    )
    assert not wrong, "imports against ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    found = imports()
    graph = {m: {t for t in ts if t in found and t != m} for m, ts in found.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_rules_catch_a_violation() -> None:
    """The checker itself: a store module importing search, or a worker importing the daemon, is flagged."""
    assert part("loomd.search.fusion") not in ALLOWED["store"] | {"store", "shared"}
    assert part("loomd.daemon") not in ALLOWED["workers"] | {"workers", "shared"}
    assert part("loomd.ingest.events") not in ALLOWED["vectors"]
