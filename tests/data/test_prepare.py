"""Tests of seqshard.data.prepare: text -> tokenizer + token files, deterministic and atomic."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import VOCAB, _documents

from seqshard.cli import main
from seqshard.data.corpus import path_corpus, stdlib_corpus
from seqshard.data.prepare import PrepareConfig, prepare
from seqshard.data.tokenfile import (
    SplitWriter,
    open_split,
    read_meta,
)
from seqshard.data.tokenizer import (
    decode,
    load_tokenizer,
    tokenizer_hash,
)


def test_prepare_writes_files_and_meta(data_dir, text_dir):
    names = sorted(p.name for p in data_dir.iterdir())
    assert names == [
        "meta.json",
        "tokenizer.json",
        "train-00000.bin",
        "train-00000.offsets.npy",
        "val-00000.bin",
        "val-00000.offsets.npy",
    ]
    assert not Path(f"{data_dir}.tmp").exists()
    meta = read_meta(data_dir)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= VOCAB
    assert meta["tokenizer"] == "tokenizer.json"
    assert meta["tokenizer_sha256"] == tokenizer_hash(data_dir / "tokenizer.json")
    assert str(text_dir) in meta["source"] and meta["format_version"] == 2
    n_docs = {s: meta["splits"][s]["n_docs"] for s in ("train", "val")}
    assert n_docs["train"] + n_docs["val"] == 80 and 5 <= n_docs["val"] <= 30

    # Every document comes back, in corpus order within its split, ending with EOT.
    tok = load_tokenizer(data_dir / "tokenizer.json")
    decoded = []
    for split in ("train", "val"):
        s = open_split(data_dir, split)
        assert (
            s.shards[0].tokens.dtype == np.uint16
            and s.n_tokens == meta["splits"][split]["n_tokens"]
        )
        assert (data_dir / f"{split}-00000.bin").stat().st_size == 2 * s.n_tokens
        for i in range(s.n_docs):
            ids = s.doc(i)
            assert ids[-1] == meta["eot_id"]
            decoded.append(decode(tok, ids[:-1]))
    assert sorted(decoded) == sorted(_documents())


def test_prepare_is_deterministic_and_reuses_a_tokenizer(tmp_path, data_dir, text_dir):
    given = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", val_fraction=0.2)
    again = prepare(tmp_path / "again", path_corpus([text_dir]), given, log=None)
    for name in ("train-00000.bin", "val-00000.bin", "train-00000.offsets.npy", "tokenizer.json"):
        assert (again / name).read_bytes() == (data_dir / name).read_bytes()
    assert read_meta(again)["tokenizer_sha256"] == read_meta(data_dir)["tokenizer_sha256"]
    with pytest.raises(FileExistsError, match="--force"):
        prepare(again, path_corpus([text_dir]), log=None)


def test_prepare_tiny_corpus_still_gets_a_val_doc(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * 20)
    out = prepare(
        tmp_path / "out", path_corpus([tmp_path]), PrepareConfig(vocab_size=300), log=None
    )
    assert read_meta(out)["splits"]["val"]["n_docs"] == 1


def test_prepare_default_corpus_and_cli(tmp_path, capsys):
    out = str(tmp_path / "std")
    assert main(["prepare", "--out", out, "--vocab-size", "300", "--max-docs", "8"]) == 0
    meta = read_meta(tmp_path / "std")
    assert "stdlib" in meta["source"] and meta["splits"]["train"]["n_docs"] >= 6
    assert "prepare: wrote" in capsys.readouterr().out
    assert main(["prepare", "--out", str(tmp_path / "x"), str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert main(["prepare", "--help"]) == 0 and "--vocab-size" in capsys.readouterr().out


def test_interrupted_prepare_leaves_nothing_that_looks_prepared(tmp_path, text_dir, monkeypatch):
    def crash(self, docs, masks=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(SplitWriter, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "out", path_corpus([text_dir]), PrepareConfig(vocab_size=300), log=None)
    # out.tmp stays, to resume; nothing at out looks prepared.
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp" / "meta.json").exists()


@pytest.mark.slow
def test_prepare_full_stdlib(tmp_path):
    t0 = time.perf_counter()
    out = prepare(tmp_path / "stdlib", stdlib_corpus(), PrepareConfig(vocab_size=4096), log=None)
    meta = read_meta(out)
    assert meta["vocab_size"] == 4096 and meta["splits"]["train"]["n_tokens"] > 1_000_000
    assert meta["splits"]["val"]["n_docs"] >= 1 and time.perf_counter() - t0 < 120
    assert json.loads((out / "meta.json").read_text()) == meta


def test_prepare_refuses_paths_in_place_of_a_corpus(tmp_path, text_dir):
    with pytest.raises(TypeError, match=r"corpus must be a seqshard.data.Corpus, got list"):
        prepare(tmp_path / "out", [text_dir], log=None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_shards_are_the_same_for_any_number_of_workers_and_resume(tmp_path, data_dir, text_dir):
    """Small shards (a few documents each): 1 and 2 worker processes write the same files,
    byte for byte. A prepare killed after some shards resumes from them: the tokenizer and
    counts are reused, the finished shards kept (not rewritten), the output the same."""
    config = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", shard_tokens=3000)
    one = prepare(tmp_path / "one", path_corpus([text_dir]), config, log=None)
    two = prepare(
        tmp_path / "two",
        path_corpus([text_dir]),
        dataclasses.replace(config, workers=2),
        log=None,
    )
    files = _files(one)
    assert files == _files(two)
    meta = read_meta(one)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["n_tokens"] <= 3000 for s in shards)
    total = sum(meta["splits"][s]["n_tokens"] for s in ("train", "val"))
    assert total == sum(open_split(data_dir, s).n_tokens for s in ("train", "val"))

    # A kill after the third unit: its tmp holds three units' shards and records.
    from seqshard.data import shards as shards_module

    real = shards_module._encode_unit
    calls = []

    def dies_at_the_fourth(job):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(job[1])
        return real(job)

    shards_module._encode_unit = dies_at_the_fourth
    try:
        with pytest.raises(KeyboardInterrupt):
            prepare(tmp_path / "again", path_corpus([text_dir]), config, log=None)
    finally:
        shards_module._encode_unit = real
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "again.tmp").glob("train-*.bin")}
    assert len(kept) == 3
    messages = []
    resumed = prepare(tmp_path / "again", path_corpus([text_dir]), config, log=messages.append)
    assert _files(resumed) == files
    assert any("resuming the unfinished" in m for m in messages)
    assert any(f"reused 3 of {len(shards)} units" in m for m in messages), messages
    for name, mtime in kept.items():
        assert (resumed / name).stat().st_mtime_ns == mtime  # not written again

    # Other settings start over.
    (tmp_path / "again.tmp").mkdir()
    (tmp_path / "again.tmp" / "prepare-plan.json").write_text("{}")
    messages.clear()
    prepare(
        tmp_path / "again", path_corpus([text_dir]), config, overwrite=True, log=messages.append
    )
    assert any("other inputs or settings; starting over" in m for m in messages)
