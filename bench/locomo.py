"""BENCH.md §3, retrieval quality on LoCoMo, through the daemon's own API.

For each conversation a real daemon (`python -m loomd serve` on a private LOOMD_HOME) stores one memory per dialog
turn with the `store` op: text `(<session date>) <speaker>: <text>` (+ ` [image: <caption>]`), the session's date
as its time, the LoCoMo session as its session. Once the daemon's back-fill has embedded every turn, each question
is one `search` op (limit 50, the conversation's project). Recall@k = share of the question's evidence turns in
the top k; nDCG@10 with binary gains. Nothing is padded: a method returning fewer than k results is scored on
what it returned.

Methods (one run, same data): the default hybrid; every signal alone (`weights`); one ablation per signal (its
weight 0); the two neighbour devices off (`tuning`: ctx_weight 0, mixed false); and the same-run baselines, on a
second daemon holding the same turns without sessions ("plain items": no neighbour column, raw vectors): FTS5
BM25 alone (keyword mode; OR of non-stopword terms) and MiniLM vectors alone (semantic mode). Each conversation gets
its own database, as in the paper: BM25's idf is the conversation's own.

Prints one JSON object on stdout; markdown tables go to stderr.

    python bench/locomo.py [--data PATH] [--conversations 0-4] [--quick] [--categories 1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loomd.client import Client  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data" / "locomo-dev.json"
KS = (5, 10, 25, 50)
GROUPS = ("c1", "c2", "c3", "c4", "c5", "c1-4", "all")
ANCHORS = {
    "DRAGON (LoCoMo paper, Table 3, dialog turns, all five categories)": {"R@5": .588, "R@10": .675, "R@25": .799,
                                                                          "R@50": .848},
    "BM25 measured before (BENCH.md, categories 1-4)": {"R@5": .555, "R@10": .640, "nDCG@10": .500},
}
OFF = {"fts": 0, "vec": 0, "graph": 0, "recency": 0, "recurrence": 0}
# (name, which daemon, search arguments). "main" stores turns with their sessions, "plain" without.
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("hybrid (default)", "main", {}),
    ("BM25 alone (plain items)", "plain", {"mode": "keyword"}),
    ("vectors alone (plain items, raw MiniLM)", "plain", {"mode": "semantic"}),
    ("fts alone (text + neighbour column)", "main", {"mode": "keyword"}),
    ("vec alone (neighbour-mixed vectors)", "main", {"mode": "semantic"}),
    ("graph alone", "main", {"weights": {**OFF, "graph": 1}}),
    ("ablate fts", "main", {"weights": {"fts": 0}}),
    ("ablate vec", "main", {"weights": {"vec": 0}}),
    ("ablate graph", "main", {"weights": {"graph": 0}}),
    ("ablate recency", "main", {"weights": {"recency": 0}}),
    ("ablate recurrence", "main", {"weights": {"recurrence": 0}}),
    ("ablate neighbour column (ctx weight 0)", "main", {"tuning": {"ctx_weight": 0.0}}),
    ("ablate vector mixing (raw vectors)", "main", {"tuning": {"mixed": False}}),
    ("hybrid on plain items", "plain", {}),
]
QUICK = ("hybrid (default)", "BM25 alone (plain items)", "vectors alone (plain items, raw MiniLM)",
         "ablate neighbour column (ctx weight 0)")
EVIDENCE = re.compile(r"^D:?(\d+):0*(\d+)$")


@dataclass
class Turn:
    dia_id: str
    session: int
    date: str
    speaker: str
    text: str
    caption: str

    def item(self) -> str:
        out = f"({self.date}) {self.speaker}: {self.text}"
        return out + (f" [image: {self.caption}]" if self.caption else "")


@dataclass
class Conversation:
    sample_id: str
    turns: list[Turn]
    questions: list[tuple[str, int, list[str]]]  # question, category, evidence dia_ids
    dropped_evidence: int = 0
    ids: dict[str, dict[str, int]] = field(default_factory=dict)  # daemon -> dia_id -> memory id


def parse_date(text: str) -> float:
    """'1:56 pm on 8 May, 2023' -> epoch seconds (UTC)."""
    moment = dt.datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y")
    return moment.replace(tzinfo=dt.UTC).timestamp()


def load(path: Path, selected: list[int]) -> list[Conversation]:
    raw = json.loads(path.read_text())
    out = []
    for index in selected:
        sample = raw[index]
        conv = sample["conversation"]
        turns: list[Turn] = []
        numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
        for n in numbers:
            for t in conv[f"session_{n}"]:
                turns.append(Turn(t["dia_id"], n, conv[f"session_{n}_date_time"], t["speaker"], t["text"],
                                  t.get("blip_caption") or ""))
        known = {t.dia_id for t in turns}
        questions, dropped = [], 0
        for qa in sample["qa"]:
            evidence: list[str] = []
            for item in qa.get("evidence", []):
                for part in filter(None, re.split(r"[;,\s]+", item)):
                    m = EVIDENCE.match(part)
                    norm = f"D{m.group(1)}:{m.group(2)}" if m else None
                    if norm in known and norm not in evidence:
                        evidence.append(norm)
                    elif norm not in known:
                        dropped += 1
            if evidence:
                questions.append((qa["question"], int(qa["category"]), evidence))
        out.append(Conversation(sample["sample_id"], turns, questions, dropped))
    return out


class Daemon:
    """`python -m loomd serve` on a private LOOMD_HOME, stopped with SIGTERM, its folder removed."""

    def __init__(self, extra_env: dict[str, str] | None = None, home: Path | None = None) -> None:
        self.home = home or Path(tempfile.mkdtemp(prefix="lmb", dir="/tmp"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMD_")}
        env.update({"LOOMD_HOME": str(self.home), "LOOMD_EMBEDDER": "local", "LOOMD_TAIL_TRANSCRIPTS": "0",
                    "LOOMD_PASSIVE": "1", "LOOMD_LOG_LEVEL": "WARNING", **(extra_env or {})})
        self.log = open(self.home / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "loomd", "serve"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=REPO)
        self.client = Client(self.home / "loomd.sock", timeout=120)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {(self.home / 'daemon.log').read_text()[-2000:]}")
            try:
                self.client.call("ping")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_caught_up(self, timeout: float = 900) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = self.client.call("status")["embedder"]
            if status["caught_up"] and status["state"] != "loading":
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"back-fill did not finish: {status}")
            time.sleep(0.1)

    def stop(self, keep: bool = False) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()
        if not keep:
            shutil.rmtree(self.home, ignore_errors=True)


def store_turns(daemon: Daemon, conv: Conversation, project: str, sessions: bool) -> dict[str, int]:
    ids: dict[str, int] = {}
    for turn in conv.turns:
        args: dict[str, Any] = {"text": turn.item(), "kind": "observation", "project": project,
                                "created": parse_date(turn.date)}
        if sessions:
            args["session_id"] = f"{conv.sample_id}:s{turn.session}"
        ids[turn.dia_id] = daemon.client.call("store", args)["id"]
    return ids


def ndcg10(ranked: list[int], gold: set[int]) -> float:
    dcg = sum(1 / math.log2(i + 2) for i, x in enumerate(ranked[:10]) if x in gold)
    ideal = sum(1 / math.log2(i + 2) for i in range(min(10, len(gold))))
    return dcg / ideal


def run_method(daemon: Daemon, conv: Conversation, which: str, project: str, args: dict[str, Any],
               categories: set[int]) -> list[dict[str, Any]]:
    rows = []
    for question, category, evidence in conv.questions:
        if category not in categories:
            continue
        started = time.perf_counter()
        reply = daemon.client.call("search", {"query": question, "project": project, "limit": 50, **args})
        elapsed = (time.perf_counter() - started) * 1000
        ranked = [r["id"] for r in reply["results"]]
        gold = {conv.ids[which][e] for e in evidence}
        rows.append({
            "category": category, "ms": elapsed,
            **{f"R@{k}": len(gold.intersection(ranked[:k])) / len(gold) for k in KS},
            "nDCG@10": ndcg10(ranked, gold),
            "tokens10": sum(len(r["text"]) for r in reply["results"][:10]) / 4,
        })
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {g: [] for g in GROUPS}
    for row in rows:
        groups[f"c{row['category']}"].append(row)
        if row["category"] != 5:
            groups["c1-4"].append(row)
        groups["all"].append(row)
    table = {
        g: {"n": len(items), **{m: round(statistics.fmean(r[m] for r in items), 4)
                                for m in [*(f"R@{k}" for k in KS), "nDCG@10"]}}
        for g, items in groups.items() if items
    }
    ms = sorted(r["ms"] for r in rows)
    return {"groups": table, "tokens_top10_median": statistics.median(r["tokens10"] for r in rows),
            "search_ms_p50": round(statistics.median(ms), 2), "search_ms_p99": round(ms[int(0.99 * (len(ms) - 1))], 2)}


def markdown(results: dict[str, Any]) -> str:
    cols = [*(f"R@{k}" for k in KS), "nDCG@10"]
    out = ["| method | c1-4 " + " | ".join(cols) + " | all " + " | ".join(cols) + " | tok@10 |",
           "|---" * (2 + 2 * len(cols)) + "|---|"]
    for name, res in results.items():
        cells = [f"{res['groups'][g][c]:.3f}" if g in res["groups"] else "-" for g in ("c1-4", "all") for c in cols]
        out.append(f"| {name} | " + " | ".join(cells) + f" | {res['tokens_top10_median']:.0f} |")
    default = results.get("hybrid (default)")
    if default:
        out += ["", "hybrid (default) per category:", "", "| group | n | " + " | ".join(cols) + " |",
                "|---|---|" + "---|" * len(cols)]
        for g, row in default["groups"].items():
            out.append(f"| {g} | {row['n']} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(out)


def span(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a LoCoMo-format JSON file")
    parser.add_argument("--conversations", default="0-4", help="indices, e.g. 0-4 or 0,2")
    parser.add_argument("--categories", default="1,2,3,4,5", help="question categories to ask (default: all)")
    parser.add_argument("--quick", action="store_true", help="conversation 0, four methods: under a minute")
    parser.add_argument("--methods", default="", help="comma-separated method names (default: all)")
    args = parser.parse_args()
    selected = [0] if args.quick else span(args.conversations)
    categories = set(span(args.categories))
    methods = [m for m in METHODS if (not args.quick or m[0] in QUICK)
               and (not args.methods or m[0] in args.methods.split(","))]
    started = time.time()
    convs = load(args.data, selected)
    rows: dict[str, list[dict[str, Any]]] = {m[0]: [] for m in methods}
    backfill: list[dict[str, Any]] = []
    conversation_tokens = {c.sample_id: round(sum(len(t.item()) for t in c.turns) / 4) for c in convs}
    for conv in convs:
        for which in ("main", "plain"):
            todo = [m for m in methods if m[1] == which]
            if not todo:
                continue
            daemon = Daemon()
            try:
                project = f"locomo:{conv.sample_id}:{which}"
                t0 = time.perf_counter()
                conv.ids[which] = store_turns(daemon, conv, project, sessions=which == "main")
                t1 = time.perf_counter()
                status = daemon.wait_caught_up()
                t2 = time.perf_counter()
                backfill.append({"conversation": conv.sample_id, "daemon": which, "turns": len(conv.turns),
                                 "store_s": round(t1 - t0, 2), "backfill_wait_s": round(t2 - t1, 2),
                                 "vectors": status["vectors"]})
                for name, _, search_args in todo:
                    rows[name] += run_method(daemon, conv, which, project, search_args, categories)
                    print(f"{conv.sample_id} {name}: done", file=sys.stderr, flush=True)
            finally:
                daemon.stop()
    results = {name: summarise(r) for name, r in rows.items() if r}
    hybrid, bm25 = results.get("hybrid (default)"), results.get("BM25 alone (plain items)")
    checks: dict[str, Any] = {}
    if hybrid and bm25 and "c1-4" in hybrid["groups"]:
        checks["hybrid beats BM25 at every k (c1-4)"] = all(
            hybrid["groups"]["c1-4"][f"R@{k}"] > bm25["groups"]["c1-4"][f"R@{k}"] for k in KS)
    if hybrid and "c5" in hybrid["groups"]:
        dragon = next(iter(ANCHORS.values()))
        checks["hybrid beats DRAGON at every k (all five)"] = all(
            hybrid["groups"]["all"][k] > v for k, v in dragon.items())
        checks["hybrid R@10 >= 0.75 (c1-4)"] = hybrid["groups"]["c1-4"]["R@10"] >= 0.75
    out = {
        "bench": "locomo", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "python": platform.python_version()},
        "versions": _versions(), "parameters": {
            "data": str(args.data), "conversations": [c.sample_id for c in convs], "categories": sorted(categories),
            "limit": 50, "quick": args.quick, "item": "(<session date>) <speaker>: <text> [image: <caption>]",
        },
        "data": {"questions": sum(len(r) for r in list(rows.values())[:1]),
                 "dropped_evidence_ids": sum(c.dropped_evidence for c in convs),
                 "conversation_tokens": conversation_tokens,
                 "conversation_tokens_median": statistics.median(conversation_tokens.values())},
        "backfill": backfill, "methods": results, "anchors": ANCHORS, "checks": checks,
        "seconds": round(time.time() - started, 1),
    }
    print(markdown(results), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


def _versions() -> dict[str, str]:
    from loomd import __version__
    from loomd.store.db import connect_sync
    from loomd.vectors.embed import LOCAL_NAME, MODEL_PACKAGE, MODEL_PACKAGE_VERSION

    conn = connect_sync(":memory:")
    sqlite, vec = conn.execute("SELECT sqlite_version(), vec_version()").fetchone()
    conn.close()
    return {"loomd": __version__, "sqlite": sqlite, "sqlite_vec": vec, "model": LOCAL_NAME,
            "model_package": f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"}


if __name__ == "__main__":
    sys.exit(main())
