"""Redaction measured: detection on the secret corpus, and what it takes out of real transcripts.

Prints one JSON object:
- `corpus`: per category of tests/secret_corpus.py, how many samples lose their secret (the exact secret string no
  longer appears in the redacted text), for loomd/redact.py now and, with `--before REV`, for that revision's
  redact.py; plus the samples each misses.
- `transcripts`: every string (keys and values) of every Claude/Codex JSON line and hook payload under the
  transcripts folder, read with plain `json`: how many strings and characters are redacted, by marker kind, and
  the first `--samples` redacted spans with a little context either side, so a human can judge the false
  positives (the shared transcripts were vetted to hold no live secret, so nearly everything redacted there is one).
  `only_after` / `only_before` are the spans one version redacts and the other does not: what a change adds or
  drops (counted in `spans_only_*`; a span both redact under another kind is counted in `spans_relabelled`). A
  string under a secret-named key is judged as `redact_value` judges it (the whole value is replaced).
- `timing`: per payload (one JSON line, one hook call) `redact_value` time, p50/p99/max in microseconds, before
  and after, each payload timed `--repeat` times (the fastest kept) after one warm-up pass, so both have a warm
  clean-string cache (the long strings' results are forgotten before each run: the time is a redaction's).

    python bench/redaction.py [--transcripts DIR] [--before REV] [--samples N] [--repeat N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from secret_corpus import CORPUS  # noqa: E402

from loomd import redact as after_module  # noqa: E402

MARKER_RE = re.compile(r"\[REDACTED:[a-z0-9_]+\]|\[private\]")
CONTEXT = 40


def load_before(rev: str) -> ModuleType | None:
    """loomd/redact.py as it was at `rev`, imported under another name."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:loomd/redact.py"], capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    name = "redact_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:loomd/redact.py", "exec"), module.__dict__)
    return module


def corpus_report(module: ModuleType) -> dict[str, Any]:
    per: dict[str, Any] = {}
    caught = total = 0
    for category, samples in CORPUS.items():
        missed = [text for text, secret in samples if secret in module.redact_text(text)]
        per[category] = {"samples": len(samples), "caught": len(samples) - len(missed), "missed": missed}
        caught += len(samples) - len(missed)
        total += len(samples)
    return {"samples": total, "caught": caught, "rate": round(caught / total, 4), "per_category": per}


# ---------------------------------------------------------------------------------------------
# Transcripts


def payloads(root: Path) -> Iterator[tuple[str, object]]:
    """Every JSON line of a .jsonl file, every element of a .json array (hook calls, chat.json lines)."""
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".json", ".jsonl") or path.name == "INVENTORY.json":
            continue
        rel = str(path.relative_to(root))
        if path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8", errors="surrogatepass").splitlines():
                if line.strip():
                    yield rel, json.loads(line)
        else:
            data = json.loads(path.read_text(encoding="utf-8", errors="surrogatepass"))
            for item in data if isinstance(data, list) else [data]:
                yield rel, item


def strings(value: object, key: str | None = None) -> Iterator[tuple[str | None, str]]:
    """(the dict key it sits under or None, the string) for every key and string value."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield None, k
            yield from strings(v, k if isinstance(k, str) else None)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def redact_one(module: ModuleType, key: str | None, text: str) -> str:
    if key is None:
        return str(module.redact_text(text))
    out = module.redact_value({key: text})
    assert isinstance(out, dict)
    return str(next(iter(out.values())))


def spans(original: str, redacted: str) -> list[tuple[int, int, str]]:
    """(start, end, marker) of each replaced span of `original`: the text between markers is kept in order, so
    each kept piece is found after the previous one (the last one is the suffix)."""
    out: list[tuple[int, int, str]] = []
    pieces = MARKER_RE.split(redacted)
    markers = MARKER_RE.findall(redacted)
    pos = len(pieces[0])
    for i, marker in enumerate(markers):
        piece = pieces[i + 1]
        if i == len(markers) - 1:
            end = len(original) - len(piece)
        elif not piece:
            end = pos  # two markers side by side: the next one takes the span
        else:
            found = original.find(piece, pos + 1)
            end = found if found >= 0 else len(original)
        out.append((pos, max(pos, end), marker))
        pos = max(pos, end) + len(piece)
    return out


def sample(rel: str, key: str | None, text: str, start: int, end: int, marker: str) -> dict[str, str]:
    return {
        "file": rel,
        "key": key or "",
        "marker": marker,
        "context": f"{text[max(0, start - CONTEXT) : start]}⟦{text[start:end][:200]}⟧{text[end : end + CONTEXT]}",
    }


@dataclass
class Stats:
    strings: int = 0
    chars: int = 0
    by_marker: Counter[str] = field(default_factory=Counter)


def transcript_report(root: Path, modules: dict[str, ModuleType], n_samples: int) -> dict[str, Any]:
    """Per module: strings and characters redacted, by marker, and the first redacted spans; with two modules,
    also the first spans only the new one redacts (what this change adds, for a human to judge)."""
    stats = {name: Stats() for name in modules}
    samples: dict[str, list[dict[str, str]]] = {name: [] for name in modules}
    added: list[dict[str, str]] = []
    removed: list[dict[str, str]] = []
    relabelled: Counter[str] = Counter()
    n_added = n_removed = 0
    n_payloads = n_strings = n_chars = 0
    for rel, payload in payloads(root):
        n_payloads += 1
        for key, text in strings(payload):
            n_strings += 1
            n_chars += len(text)
            outs = {name: redact_one(module, key, text) for name, module in modules.items()}
            found: dict[str, set[tuple[int, int, str]]] = {}
            for name, redacted in outs.items():
                if redacted == text:
                    found[name] = set()
                    continue
                st = stats[name]
                st.strings += 1
                found[name] = set(spans(text, redacted))
                for start, end, marker in sorted(found[name]):
                    st.by_marker[marker] += 1
                    st.chars += end - start
                    if len(samples[name]) < n_samples:
                        samples[name].append(sample(rel, key, text, start, end, marker))
            if len(found) == 2 and outs["after"] != outs["before"]:
                old = {(s, e): marker for s, e, marker in found["before"]}
                new = {(s, e): marker for s, e, marker in found["after"]}
                for (s, e), marker in sorted(new.items()):
                    if (s, e) not in old:
                        n_added += 1
                        if len(added) < n_samples:
                            added.append(sample(rel, key, text, s, e, marker))
                    elif old[(s, e)] != marker:
                        relabelled[f"{old[(s, e)]} -> {marker}"] += 1
                for (s, e), marker in sorted(old.items()):
                    if (s, e) not in new:
                        n_removed += 1
                        if len(removed) < n_samples:
                            removed.append(sample(rel, key, text, s, e, marker))
    out: dict[str, Any] = {"payloads": n_payloads, "strings": n_strings, "chars": n_chars}
    for name in modules:
        st = stats[name]
        out[name] = {
            "strings_redacted": st.strings,
            "chars_redacted": st.chars,
            "by_marker": dict(st.by_marker.most_common()),
            "samples": samples[name],
        }
    if len(modules) == 2:
        out["spans_only_after"] = n_added
        out["spans_only_before"] = n_removed
        out["spans_relabelled"] = dict(relabelled)
        out["only_after"] = added
        out["only_before"] = removed
    return out


def timing(root: Path, modules: dict[str, ModuleType], repeat: int) -> dict[str, Any]:
    items = [payload for _, payload in payloads(root)]
    for module in modules.values():
        for payload in items:
            module.redact_value(payload)  # warm the clean-string caches and the lru caches
    best: dict[str, list[float]] = {name: [] for name in modules}
    for payload in items:
        for name, module in modules.items():
            fn: Callable[[object], object] = module.redact_value
            # Long results are remembered (by digest) since 66af406: forgotten before each run, so every run redacts.
            forget: Callable[[], None] = getattr(module, "forget_long", lambda: None)
            fastest = float("inf")
            for _ in range(repeat):
                forget()
                t0 = time.perf_counter()
                fn(payload)
                fastest = min(fastest, time.perf_counter() - t0)
            best[name].append(fastest)
    out: dict[str, Any] = {"payloads": len(items), "repeat": repeat}
    for name, times in best.items():
        times.sort()
        out[name] = {
            "p50_us": round(times[len(times) // 2] * 1e6, 1),
            "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
            "max_us": round(times[-1] * 1e6, 1),
            "total_ms": round(sum(times) * 1e3, 1),
        }
    return out


def main() -> None:
    default_data = Path(os.environ.get("LOOMD_TEST_DATA", REPO.parent / "shared" / "data")) / "transcripts"
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--transcripts", type=Path, default=default_data)
    parser.add_argument("--before", default="5c14a17", help="git revision of the redact.py to compare with")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()

    before = load_before(args.before) if args.before else None
    modules = {"after": after_module} | ({"before": before} if before is not None else {})
    result: dict[str, Any] = {"before_rev": args.before if before is not None else None}
    result["corpus"] = {name: corpus_report(module) for name, module in modules.items()}
    if args.transcripts.is_dir():
        result["transcripts"] = transcript_report(args.transcripts, modules, args.samples)
        if not args.no_timing:
            result["timing"] = timing(args.transcripts, modules, args.repeat)
    else:
        result["transcripts"] = f"not found: {args.transcripts}"
    print(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
