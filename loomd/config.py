"""Effective configuration: defaults, then the TOML file, then `LOOMD_*` variables. No side effects."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomd.errors import BadRequest

ENV_PREFIX = "LOOMD_"


@dataclass(frozen=True)
class Paths:
    """Where loomd keeps its files. `LOOMD_HOME` puts every one of them under one folder."""

    data_dir: Path
    state_dir: Path
    runtime_dir: Path
    config_file: Path

    @property
    def db(self) -> Path:
        return self.data_dir / "loomd.db"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "loomd.sock"

    @property
    def journal(self) -> Path:
        return self.data_dir / "hooks.journal"

    @property
    def spool(self) -> Path:
        return self.state_dir / "spool"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"


def resolve_paths(env: Mapping[str, str] | None = None) -> Paths:
    """Compute the paths; the shim repeats this logic (it may not import loomd), keep both in step."""
    env = os.environ if env is None else env
    if env.get("LOOMD_HOME"):
        home = Path(env["LOOMD_HOME"]).expanduser()
        return Paths(home, home, home, home / "config.toml")
    user_home = Path(env.get("HOME") or Path.home())
    data = Path(env.get("XDG_DATA_HOME") or user_home / ".local" / "share") / "loomd"
    state = Path(env.get("XDG_STATE_HOME") or user_home / ".local" / "state") / "loomd"
    runtime = Path(env["XDG_RUNTIME_DIR"]) / "loomd" if env.get("XDG_RUNTIME_DIR") else state
    config_file = Path(env.get("XDG_CONFIG_HOME") or user_home / ".config") / "loomd" / "config.toml"
    if env.get("LOOMD_CONFIG"):
        config_file = Path(env["LOOMD_CONFIG"]).expanduser()
    return Paths(data, state, runtime, config_file)


@dataclass(frozen=True)
class Config:
    """Every tunable of the daemon. Field names are the TOML keys and, upper-cased, the env suffix."""

    log_level: str = "INFO"
    max_frame_bytes: int = 8 * 1024 * 1024
    max_tool_output_chars: int = 16_000
    drain_timeout_s: float = 5.0
    max_inflight: int = 256
    busy_timeout_ms: int = 5000
    # hook path
    context_deadline_ms: int = 150
    ack_deadline_ms: int = 1000
    # The hook journal (ingest/journal.py): a hook is answered once its bytes are synced to this file, and committed
    # to the store after its reply. Its size, allocated once; 0: off (every hook is answered after its commit).
    hook_journal_bytes: int = 8 << 20
    capture_rate_per_session: int = 60
    auto_capture: bool = True  # the capture rules at ingest (ingest/capture.py); off: only the workers distill
    # Kinds of memory never written by the capture rules or the reflector (comma-separated, e.g. "insight,error");
    # banned kinds are not written either, and GC archives those already stored.
    extract_off: str = ""
    extract_banned: str = ""
    # context planner
    start_block_chars: int = 1500
    start_block_chars_claude: int = 0
    start_block_chars_codex: int = 0
    prompt_block_chars: int = 1600  # 400 tokens
    # At most; an evidence hit is windowed to its share of the block, a third at least (render.recall_room): past
    # three, the lines are short memories and windows that fit in what the long ones leave.
    prompt_block_lines: int = 6
    prompt_min_score: float = 0.5
    # Wait for the prompt's hybrid search inside the UserPromptSubmit hook (an embedding: ~3-40 ms) instead of
    # answering with the keyword signals and delivering the rest with the next tool result.
    prompt_semantic_inline: bool = False
    # How long the UserPromptSubmit hook waits for the prompt's keyword recall; past it the hook answers without a
    # block and the prompt's hybrid search comes with the next tool result, as its semantic rest does (inside the
    # shim's 150 ms `context_deadline_ms`, so that a slow recall follows instead of being lost). 0: never wait.
    prompt_recall_budget_ms: int = 100
    # retrieval
    embedder: str = "local"
    embed_url: str = ""
    embed_model: str = "text-embedding-3-small"
    embed_key: str = ""
    embed_dim: int = 384
    embed_threads: int = 1  # onnxruntime threads of the local model (the back-fill and each query use one each)
    embed_model_path: str = ""  # the local model file; "" = the one the model package ships
    recency_half_life_days: float = 30.0
    # The relevance floor of `loom search` (search/floor.py; `--all` shows everything): a hit needs this cosine, an
    # entity the query names, or (keywords only) this share of the query's words.
    search_min_cosine: float = 0.3
    search_min_terms: float = 0.5
    # workers
    passive: bool = False
    observe_after_tokens: int = 10_000
    reflect_after_tokens: int = 20_000
    reflection_context_max_tokens: int = 10_000
    observations_pool_max_tokens: int = 20_000
    observations_pool_target_tokens: int = 10_000
    gc: bool = True  # off: the GC worker runs only when asked (`loom workers run gc`)
    event_ttl_days: float = 0.0  # 0: raw events are evidence, kept for good; a limit is the user's choice
    memory_ttl_days: float = 0.0
    # 0: an archived memory stays for good (fetchable by id, restorable); a limit is the user's choice: this long
    # after it was archived, GC deletes it with its vectors, sources and edges (what holds a store's size constant)
    archived_ttl_days: float = 0.0
    project_memory_cap: int = 5000
    worker_interval_s: float = 60.0
    # While the agent works, background work rests this many times as long as each of its transactions held the
    # writer (`ingest.writer.LiveTraffic.ran`), leaving a CPU to the hooks' processes; 0: never rests.
    background_rest_ratio: float = 2.0
    job_history_days: float = 7.0  # GC keeps the runs' log this long (each worker's latest run and error always)
    observe_idle_s: float = 600.0  # a session quiet this long is observed (and its open todos noted)
    # `loom import`'s parser processes stop when no file came for this long: the CLI sends the next file at once, and
    # idle parsers (~30 MB each) would stay into the catch-up, when the embedder peaks (it starts ACTIVE_GRACE_S = 2 s
    # after the last file)
    import_idle_s: float = 1.0
    working_set_days: float = 7.0  # injected into a session active, or hit, this recently: never archived
    stale_task_days: float = 30.0  # an open task untouched this long is archived by GC
    # optional model endpoint
    model_api: str = ""  # "" | "openai" | "anthropic"
    model_url: str = ""
    model_name: str = ""
    model_key: str = ""
    model_daily_tokens: int = 200_000
    model_timeout_s: float = 30.0
    # the web viewer (`loom ui`): loopback and a free port unless set; another interface only when set here
    ui_host: str = "127.0.0.1"
    ui_port: int = 0
    # transcripts
    tail_transcripts: bool = True
    codex_home: str = ""
    # shared memory on PostgreSQL (loomd/team/): the file's `[shared]` table (`dsn = …`) or `LOOMD_SHARED_DSN`.
    # The DSN is never logged whole (`public()` and every message show it redacted); the password may sit in
    # `shared_password_file` (or the usual PGPASSFILE / ~/.pgpass) instead of the DSN.
    shared_dsn: str = ""
    shared_password_file: str = ""
    shared_team: str = ""
    shared_device: str = ""  # "" = this machine's host name
    shared_interval_s: float = 15.0
    # Memories per push or pull transaction: small, so a sync never holds the store's write lock for long.
    shared_batch: int = 100
    # Projects (keys, as `loom projects` shows them; comma-separated, or a TOML list) whose evidence passages are
    # shared too: the opt-in past "durable memories only". A private project never sends anything, listed or not.
    shared_evidence_projects: str = ""

    paths: Paths = field(default_factory=resolve_paths, compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # Per-project settings from the file's `[project."<key>"]` tables (PER_PROJECT names only): `for_project`.
    projects: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    def public(self) -> dict[str, Any]:
        """The config as plain values with secrets masked, plus where each value came from."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in NOT_SETTINGS:
                continue
            value = getattr(self, f.name)
            if f.name.endswith("_key") and value:
                value = "***"
            elif f.name.endswith("_dsn") and value:
                # Imported here: the redactor's ~40 ms import would weigh on every client that reads the paths.
                from loomd.redact import redact_text

                value = redact_text(value)
            out[f.name] = {"value": value, "source": self.sources.get(f.name, "default")}
        for project, settings in sorted(self.projects.items()):
            for name, value in sorted(settings.items()):
                out[f'project."{project}".{name}'] = {"value": value, "source": str(self.paths.config_file)}
        for name in ("db", "socket", "spool", "logs", "config_file", "data_dir", "state_dir"):
            out[f"path.{name}"] = {"value": str(getattr(self.paths, name)), "source": "derived"}
        return out

    def kinds_off(self) -> frozenset[str]:
        """The kinds never written: `extract_off` and `extract_banned`."""
        return _kinds(self.extract_off) | self.kinds_banned()

    def kinds_banned(self) -> frozenset[str]:
        return _kinds(self.extract_banned)

    def for_project(self, project: str | None) -> Config:
        """This config with the project's own settings (`[project."<key>"]`) over it."""
        own = self.projects.get(project or "")
        return dataclasses.replace(self, **own) if own else self

    def evidence_projects(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.shared_evidence_projects.split(",") if p.strip())

    def start_block_budget(self, agent: str) -> int:
        per_agent = {"claude": self.start_block_chars_claude, "codex": self.start_block_chars_codex}.get(agent, 0)
        return per_agent or self.start_block_chars


NOT_SETTINGS = ("paths", "sources", "projects")
# Tables of the file read as prefixed settings: `[shared] dsn = …` is `shared_dsn`.
SECTIONS = ("shared",)
# What a project may set for itself in `[project."<key>"]`.
PER_PROJECT = ("auto_capture", "gc", "extract_off", "extract_banned")


def _kinds(text: str) -> frozenset[str]:
    return frozenset(k.strip().lower() for k in text.split(",") if k.strip())


def _project_tables(raw: Any, where: Path) -> dict[str, dict[str, Any]]:
    """`[project."<key>"]` tables: only PER_PROJECT names, each read as the global setting of that name is."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise BadRequest(f'config file {where}: [project] must hold tables, e.g. [project."git:github.com/o/r"]')
    kinds = {f.name: f.type for f in dataclasses.fields(Config)}
    out: dict[str, dict[str, Any]] = {}
    for project, settings in raw.items():
        for name, value in settings.items():
            if name not in PER_PROJECT:
                raise BadRequest(f'config file {where}: [project."{project}"] cannot set {name!r}; '
                                 f"a project sets: {', '.join(PER_PROJECT)}")
            kind = kinds[name]
            out.setdefault(project, {})[name] = _coerce(name, _KINDS[kind] if isinstance(kind, str) else kind, value)
    return out


def _coerce(name: str, kind: type, raw: Any) -> Any:
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is str and isinstance(raw, list):  # a TOML list for a comma-separated setting
            return ",".join(str(item) for item in raw)
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"config {name}: cannot read {raw!r} as {kind.__name__}") from exc


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
# Settings whose value must lie within bounds (inclusive): outside them the daemon would misbehave, not just differ
# (a rest ratio of inf held background work back for good).
BOUNDS: dict[str, tuple[float, float]] = {"background_rest_ratio": (0.0, 10.0)}


def _bounded(name: str, value: Any) -> Any:
    low, high = BOUNDS.get(name, (-math.inf, math.inf))
    if isinstance(value, int | float) and not (low <= value <= high):  # NaN fails both comparisons
        raise BadRequest(f"config {name}: {value!r} is outside {low:g} to {high:g}")
    return value


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Defaults, overridden by the TOML file, overridden by `LOOMD_<NAME>` variables."""
    env = os.environ if env is None else env
    paths = resolve_paths(env)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values: dict[str, Any] = {}
    if paths.config_file.is_file():
        try:
            file_values = tomllib.loads(paths.config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise BadRequest(f"config file {paths.config_file}: {exc}") from exc
    for section in SECTIONS:
        table = file_values.get(section, {})
        if not isinstance(table, dict):
            raise BadRequest(f"config file {paths.config_file}: [{section}] must be a table")
        file_values.update({f"{section}_{name}": value for name, value in table.items()})
    for f in dataclasses.fields(Config):
        if f.name in NOT_SETTINGS:
            continue
        kind = _KINDS[f.type] if isinstance(f.type, str) else f.type
        if f.name in file_values:
            values[f.name] = _bounded(f.name, _coerce(f.name, kind, file_values[f.name]))
            sources[f.name] = str(paths.config_file)
        env_name = ENV_PREFIX + f.name.upper()
        if env_name in env:
            values[f.name] = _bounded(f.name, _coerce(f.name, kind, env[env_name]))
            sources[f.name] = f"env {env_name}"
    projects = _project_tables(file_values.get("project"), paths.config_file)
    return Config(**values, paths=paths, sources=sources, projects=projects)
