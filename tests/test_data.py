"""Tests of seqshard.data: corpus, tokenizer, token files, prepare, packing and the loader."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from seqshard.data import corpus as corpus_lib
from seqshard.data.loader import Batch, Loader, unigram_entropy
from seqshard.data.packing import PackedStream
from seqshard.data.prepare import prepare, prepare_main
from seqshard.data.tokenfile import (
    SplitWriter,
    check_tokenizer,
    dtype_for_vocab,
    open_split,
    read_meta,
)
from seqshard.data.tokenizer import (
    EOT,
    decode,
    encode,
    load_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)
from seqshard.testing import fake_cpu_mesh

VOCAB = 400
SEQ_LEN = 64
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "def",
    "class",
    "return",
    "import",
    "self",
    "lambda",
    "yield",
    "über",
    "naïve",
    "東京",
    "données",
    "λ",
    "→",
    "✓",
    "🙂",
    "x0",
    "y1",
    "(a,",
    "b)",
    "[i]",
    "{k:",
    "v}",
    "==",
    "!=",
    "<=",
    "#",
    "\t",
]


def _documents(n: int = 80, seed: int = 0) -> list[str]:
    """Documents of very different lengths (a few words to a few hundred), so rows hold several
    documents and documents span several rows."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        n_words = int(rng.choice([3, 12, 40, 150, 400]))
        words = rng.choice(WORDS, size=n_words)
        lines = [" ".join(words[j : j + 9]) for j in range(0, n_words, 9)]
        docs.append(f"doc {i}\n" + "\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(_documents()):
        (root / f"sub{i % 3}").mkdir(exist_ok=True)
        (root / f"sub{i % 3}" / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, text_dir) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    return prepare(out, inputs=[text_dir], vocab_size=VOCAB, val_fraction=0.2, log=None)


@pytest.fixture
def data_copy(tmp_path, data_dir) -> Path:
    """A private copy of the prepared directory, for tests that damage it."""
    return Path(shutil.copytree(data_dir, tmp_path / "tokens"))


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


def _loader(data_dir, mesh, **kw) -> Loader:
    kw = {"batch_size": 4, "seq_len": SEQ_LEN, "mesh": mesh, **kw}
    return Loader(data_dir, kw.pop("split", "train"), **kw)


def _host(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(batch.tokens), np.asarray(batch.is_seq_start)


# -- corpus ------------------------------------------------------------------------------------


def test_stdlib_corpus_is_the_base_stdlib_without_tests():
    root = corpus_lib.stdlib_dir()
    assert (root / "os.py").is_file()  # in a venv: the base interpreter's library
    files = corpus_lib.stdlib_files(root)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert not any(set(r.split("/")[:-1]) & corpus_lib.STDLIB_EXCLUDED_DIRS for r in rel)
    assert 5e6 < sum(f.stat().st_size for f in files) < 40e6
    first = next(iter(corpus_lib.stdlib_corpus().take(2)))
    assert first == files[0].read_text(encoding="utf-8") or not files[0].read_text()


def test_path_corpus_files_dirs_jsonl_and_bad_input(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "b.md").write_text("bee")
    (tmp_path / "d" / "e" / "a.py").write_text("x = 1\n")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "d" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (tmp_path / "d" / "empty.txt").write_text("")
    (tmp_path / "r.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    docs = list(corpus_lib.path_corpus([tmp_path / "d", tmp_path / "r.jsonl"]))
    assert docs == ["bee", "x = 1\n", "one", "two"]

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object.*text"):
        list(corpus_lib.iter_path_documents([tmp_path / "bad.jsonl"]))
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        corpus_lib.path_corpus([tmp_path / "nope.txt"])


def test_hf_corpus_without_datasets_says_how_to_install():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'seqshard\[hf\]'"):
            corpus_lib.hf_corpus("some/dataset")
    else:
        pytest.skip("datasets is installed")


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_hash(tmp_path):
    path = tmp_path / "tok.json"
    tok = train_tokenizer(_documents(30), 300, path)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(EOT) is not None
    for text in ["", "def f(x):\n\treturn x  # ok\n", "  leading", "東京 🙂 naïve\r\n", "\x00\x7f"]:
        ids = encode(tok, text)
        assert decode(tok, ids) == text
        assert all(0 <= i < tok.get_vocab_size() for i in ids)
    loaded = load_tokenizer(path)
    assert encode(loaded, "the of and") == encode(tok, "the of and")
    h = tokenizer_hash(path)
    assert len(h) == 64 and h == tokenizer_hash(path)
    path.write_text(path.read_text() + " ")
    assert tokenizer_hash(path) != h
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257"):
        train_tokenizer(["abc"], 100)
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")


# -- token files and prepare -------------------------------------------------------------------


def test_dtype_for_vocab():
    assert [dtype_for_vocab(v).name for v in (256, 257, 65536, 65537)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint32",
    ]


def test_prepare_writes_files_and_meta(data_dir, text_dir):
    names = sorted(p.name for p in data_dir.iterdir())
    assert names == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "train.offsets.npy",
        "val.bin",
        "val.offsets.npy",
    ]
    assert not Path(f"{data_dir}.tmp").exists()
    meta = read_meta(data_dir)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= VOCAB
    assert meta["tokenizer"] == "tokenizer.json"
    assert meta["tokenizer_sha256"] == tokenizer_hash(data_dir / "tokenizer.json")
    assert str(text_dir) in meta["source"] and meta["format_version"] == 1
    n_docs = {s: meta["splits"][s]["n_docs"] for s in ("train", "val")}
    assert n_docs["train"] + n_docs["val"] == 80 and 5 <= n_docs["val"] <= 30

    # Every document comes back, in corpus order within its split, ending with EOT.
    tok = load_tokenizer(data_dir / "tokenizer.json")
    decoded = []
    for split in ("train", "val"):
        s = open_split(data_dir, split)
        assert s.tokens.dtype == np.uint16 and s.n_tokens == meta["splits"][split]["n_tokens"]
        assert (data_dir / f"{split}.bin").stat().st_size == 2 * s.n_tokens
        for i in range(s.n_docs):
            ids = s.doc(i)
            assert ids[-1] == meta["eot_id"]
            decoded.append(decode(tok, ids[:-1]))
    assert sorted(decoded) == sorted(_documents())


def test_prepare_is_deterministic_and_reuses_a_tokenizer(tmp_path, data_dir, text_dir):
    again = prepare(
        tmp_path / "again",
        inputs=[text_dir],
        tokenizer_path=data_dir / "tokenizer.json",
        val_fraction=0.2,
        log=None,
    )
    for name in ("train.bin", "val.bin", "train.offsets.npy", "tokenizer.json"):
        assert (again / name).read_bytes() == (data_dir / name).read_bytes()
    assert read_meta(again)["tokenizer_sha256"] == read_meta(data_dir)["tokenizer_sha256"]
    with pytest.raises(FileExistsError, match="--force"):
        prepare(again, inputs=[text_dir], log=None)


def test_prepare_tiny_corpus_still_gets_a_val_doc(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * 20)
    out = prepare(tmp_path / "out", inputs=[tmp_path], vocab_size=300, log=None)
    assert read_meta(out)["splits"]["val"]["n_docs"] == 1


def test_prepare_default_corpus_and_cli(tmp_path, capsys):
    assert (
        prepare_main(["--out", str(tmp_path / "std"), "--vocab-size", "300", "--max-docs", "8"])
        == 0
    )
    meta = read_meta(tmp_path / "std")
    assert "stdlib" in meta["source"] and meta["splits"]["train"]["n_docs"] >= 6
    assert "prepare: wrote" in capsys.readouterr().out
    assert prepare_main(["--out", str(tmp_path / "x"), str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        prepare_main(["--help"])
    assert e.value.code == 0 and "--vocab-size" in capsys.readouterr().out


def test_interrupted_prepare_leaves_nothing_that_looks_prepared(tmp_path, text_dir, monkeypatch):
    def crash(self, docs):
        raise KeyboardInterrupt

    monkeypatch.setattr(SplitWriter, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "out", inputs=[text_dir], vocab_size=300, log=None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# -- bad input: every error names the file, the expected and actual values, and the fix ---------


def test_missing_directory_meta_and_bin(tmp_path, data_copy):
    with pytest.raises(FileNotFoundError, match=r"nothere does not exist.*seqshard prepare"):
        open_split(tmp_path / "nothere", "train")
    (data_copy / "train.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"train\.bin is missing.*seqshard prepare"):
        open_split(data_copy, "train")
    (data_copy / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"meta\.json is missing.*seqshard prepare"):
        open_split(data_copy, "val")


def test_empty_split(tmp_path, text_dir):
    out = prepare(tmp_path / "noval", inputs=[text_dir], vocab_size=300, val_fraction=0, log=None)
    with pytest.raises(ValueError, match=r"val\.bin is empty \(0 tokens.*val-fraction"):
        open_split(out, "val")


def test_bin_size_not_a_multiple_of_dtype(data_copy):
    with (data_copy / "train.bin").open("ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match=r"train\.bin is \d+ bytes, not a multiple of 2.*uint16"):
        open_split(data_copy, "train")


def test_bin_token_count_differs_from_meta(data_copy):
    path = data_copy / "train.bin"
    n = path.stat().st_size // 2
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(
        ValueError, match=rf"train\.bin holds {n - 2} tokens but meta\.json says {n}"
    ):
        open_split(data_copy, "train")


def test_offsets_inconsistent_with_tokens(data_copy):
    path = data_copy / "train.offsets.npy"
    offsets = np.load(path)
    offsets[-1] += 5
    np.save(path, offsets)
    with pytest.raises(ValueError, match=rf"offsets\.npy is inconsistent.*to {offsets[-1] - 5}"):
        open_split(data_copy, "train")
    np.save(path, offsets[:-1])
    with pytest.raises(ValueError, match=r"expected int64 offsets of shape \(\d+,\)"):
        open_split(data_copy, "train")


def test_ids_outside_vocab(data_copy):
    vocab = read_meta(data_copy)["vocab_size"]
    tokens = np.fromfile(data_copy / "train.bin", dtype=np.uint16)
    tokens[17] = 65000
    tokens.tofile(data_copy / "train.bin")
    with pytest.raises(
        ValueError, match=rf"train\.bin holds token id 65000.*expected ids < {vocab}"
    ):
        open_split(data_copy, "train")


def test_tokenizer_hash_mismatch(data_copy, mesh):
    path = data_copy / "tokenizer.json"
    path.write_text(path.read_text() + "\n")
    with pytest.raises(ValueError, match=r"tokenizer\.json has sha256 .* tokenized with sha256"):
        check_tokenizer(data_copy)
    with pytest.raises(ValueError, match="sha256"):
        _loader(data_copy, mesh)


def test_loader_argument_errors(data_dir, mesh):
    max_id = open_split(data_dir, "train").max_id
    with pytest.raises(
        ValueError, match=rf"train\.bin holds token id {max_id}.*model's vocab is 10"
    ):
        _loader(data_dir, mesh, vocab=10)
    with pytest.raises(ValueError, match=r"multiple of the mesh's d axis \(2\).*got 5"):
        _loader(data_dir, mesh, batch_size=5)
    with pytest.raises(ValueError, match="fewer than one row of seq_len"):
        _loader(data_dir, mesh, seq_len=10**7)
    with pytest.raises(ValueError, match="'d' axis"):
        _loader(data_dir, fake_cpu_mesh((2, 4), ("x", "t")))


# -- packing and the loader --------------------------------------------------------------------


def test_packing_one_epoch_round_trip(data_dir):
    """One epoch's rows, put back in packing order, are the permuted documents concatenated,
    minus the tail; starts mark exactly the document starts."""
    split = open_split(data_dir, "train")
    stream = PackedStream(split, SEQ_LEN, seed=3)
    R = stream.rows_per_epoch
    order = stream.row_order(0)
    assert sorted(order) == list(range(R)) and not np.array_equal(order, np.arange(R))
    tokens, starts = stream.rows(np.arange(R))
    tokens, starts = tokens[np.argsort(order)], starts[np.argsort(order)]
    perm, cum = stream.epoch_order(0)
    concat = np.concatenate([split.doc(i) for i in perm]).astype(np.int32)
    emitted = tokens.reshape(-1)
    assert np.array_equal(emitted, concat[: R * SEQ_LEN])
    dropped = concat[R * SEQ_LEN :]
    assert len(dropped) == stream.dropped_per_epoch < SEQ_LEN
    # Nothing lost or duplicated: emitted + dropped tail is the split's multiset of tokens.
    everything = np.sort(np.asarray(split.tokens, np.int32))
    assert np.array_equal(np.sort(np.concatenate([emitted, dropped])), everything)
    doc_starts = cum[:-1][cum[:-1] < R * SEQ_LEN]
    assert np.array_equal(np.flatnonzero(starts.reshape(-1)), doc_starts)
    assert not starts[:, 0].all() and starts[:, 0].any()  # some rows begin mid-document

    # The next epoch is another permutation of the same documents.
    perm1, _ = stream.epoch_order(1)
    assert sorted(perm1) == sorted(perm) and not np.array_equal(perm1, perm)
    tokens1, _ = stream.rows(np.arange(R, 2 * R))
    tokens1 = tokens1[np.argsort(stream.row_order(1))]
    concat1 = np.concatenate([split.doc(i) for i in perm1]).astype(np.int32)
    assert np.array_equal(tokens1.reshape(-1), concat1[: R * SEQ_LEN])


def test_loader_batches_are_stream_rows_and_sharded(data_dir, mesh):
    with _loader(data_dir, mesh, batch_size=4, seed=3) as loader:
        stream = PackedStream(open_split(data_dir, "train"), SEQ_LEN, seed=3)
        R = stream.rows_per_epoch
        for batch in loader:  # cross an epoch boundary
            tokens, starts = _host(batch)
            want_t, want_s = stream.rows(np.arange(batch.step * 4, batch.step * 4 + 4))
            assert np.array_equal(tokens, want_t) and np.array_equal(starts, want_s)
            if batch.step * 4 > R + 8:
                break
    for arr, dtype in ((batch.tokens, np.int32), (batch.is_seq_start, np.bool_)):
        assert isinstance(arr, jax.Array) and arr.shape == (4, SEQ_LEN) and arr.dtype == dtype
        assert arr.sharding.spec == P("d", None) and arr.sharding.mesh.shape == mesh.shape
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            assert shard.data.shape == (2, SEQ_LEN)
            assert np.array_equal(np.asarray(shard.data), np.asarray(arr)[shard.index])


def test_loader_is_deterministic_and_random_access(data_dir, mesh):
    a = _loader(data_dir, mesh, seed=7, prefetch=0)
    b = _loader(data_dir, mesh, seed=7, prefetch=3)
    c = _loader(data_dir, mesh, seed=8, prefetch=0)
    with a, b, c:
        for step in (0, 1, 5, 123, 10**6):
            ta, sa = _host(a.batch_at(step))
            tb, sb = _host(b.batch_at(step))
            assert np.array_equal(ta, tb) and np.array_equal(sa, sb)
        assert not np.array_equal(_host(a.batch_at(1))[0], _host(c.batch_at(1))[0])
        first = [_host(x) for _, x in zip(range(3), b, strict=False)]
        assert all(np.array_equal(f[0], _host(a.batch_at(i))[0]) for i, f in enumerate(first))


def test_loader_exact_resume(data_dir, mesh):
    with _loader(data_dir, mesh, seed=1) as full:
        reference = [_host(x) for _, x in zip(range(12), full, strict=False)]
        assert full.state()["step"] == 12
    with _loader(data_dir, mesh, seed=1) as first:
        for _, _batch in zip(range(5), first, strict=False):
            pass
        state = first.state()
    assert state == {**state, "step": 5, "seed": 1, "split": "train", "batch_size": 4}
    with _loader(data_dir, mesh, seed=state["seed"], start_step=state["step"]) as resumed:
        resumed.check_state(state)
        for (step, batch), want in zip(enumerate(resumed, start=5), reference[5:], strict=False):
            assert batch.step == step
            assert all(np.array_equal(x, y) for x, y in zip(_host(batch), want, strict=True))
    with (
        _loader(data_dir, mesh, seed=2) as other,
        pytest.raises(ValueError, match="seed: saved 1, now 2"),
    ):
        other.check_state(state)


def test_eval_batches_are_fixed(data_dir, mesh):
    with _loader(data_dir, mesh, seed=1, prefetch=0) as a, _loader(data_dir, mesh, seed=2) as b:
        first = [_host(x) for x in a.eval_batches(2)]
        again = [_host(x) for x in a.eval_batches(2)]
        other = [_host(x) for x in b.eval_batches(2)]
    for x, y, z in zip(first, again, other, strict=True):
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[0], z[0])
    val_tokens = set(np.unique(np.asarray(open_split(data_dir, "val").tokens)))
    assert set(np.unique(first[0][0])) <= val_tokens


def test_prefetch_thread_reraises_errors_and_stops(data_dir, mesh):
    loader = _loader(data_dir, mesh, prefetch=2)
    real_rows = loader.stream.rows

    def rows(row_ids):
        if row_ids.min() >= 3 * 4:
            raise ValueError("disk on fire")
        return real_rows(row_ids)

    loader.stream.rows = rows
    steps = []
    with pytest.raises(ValueError, match="disk on fire"):
        for batch in loader:
            steps.append(batch.step)
    assert steps == [0, 1, 2]
    assert loader._thread is None  # closed and joined
    with pytest.raises(ValueError, match="disk on fire"):
        next(loader)


def test_close_stops_a_blocked_prefetch_thread(data_dir, mesh):
    before = threading.active_count()
    loader = _loader(data_dir, mesh, prefetch=2)
    next(loader)
    thread = loader._thread
    time.sleep(0.3)  # the thread fills the queue and blocks in put()
    assert thread.is_alive()
    t0 = time.perf_counter()
    loader.close()
    assert not thread.is_alive() and time.perf_counter() - t0 < 2
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()  # idempotent


def test_unigram_entropy(data_dir):
    tokens = np.asarray(open_split(data_dir, "train").tokens)
    p = np.bincount(tokens) / len(tokens)
    p = p[p > 0]
    h = unigram_entropy(data_dir, "train")
    assert h == pytest.approx(-(p * np.log(p)).sum()) and 0 < h < np.log(VOCAB)


@pytest.mark.slow
def test_prepare_full_stdlib(tmp_path):
    t0 = time.perf_counter()
    out = prepare(tmp_path / "stdlib", vocab_size=4096, log=None)
    meta = read_meta(out)
    assert meta["vocab_size"] == 4096 and meta["splits"]["train"]["n_tokens"] > 1_000_000
    assert meta["splits"]["val"]["n_docs"] >= 1 and time.perf_counter() - t0 < 120
    assert json.loads((out / "meta.json").read_text()) == meta


_TWO_PROCESS_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import AxisType
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, data_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
from seqshard.data.loader import Loader
from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import open_split
mesh = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
loader = Loader(data_dir, "train", batch_size=8, seq_len=16, mesh=mesh, prefetch=0, seed=5)
batch = loader.batch_at(3)
want, _ = PackedStream(open_split(data_dir, "train"), 16, 5).rows(np.arange(24, 32))
rows = sorted({s.index[0].start for s in batch.tokens.addressable_shards})
assert all(np.array_equal(np.asarray(s.data), want[s.index]) for s in batch.tokens.addressable_shards)
total = int(jax.jit(lambda x: x.sum())(batch.tokens))
assert total == int(want.sum()), (total, int(want.sum()))
print("OK", pid, rows)
"""


@pytest.mark.slow
def test_two_processes_each_read_their_own_rows(tmp_path, data_dir):
    """Two JAX processes of 4 CPU devices each: each builds only its half of the batch, and the
    global array they make together is the whole batch."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "two_process.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(pid), port, str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "OK 0 [0, 2]" in outs[0] and "OK 1 [4, 6]" in outs[1]
