"""Tests of seqshard.data.tokenfile: the on-disk token format, and every way a damaged data directory is
reported (the file, the expected and actual values, the fix)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import _loader

from seqshard.data.corpus import path_corpus
from seqshard.data.prepare import PrepareConfig, prepare
from seqshard.data.tokenfile import (
    check_tokenizer,
    dtype_for_vocab,
    open_split,
    read_meta,
)


def test_dtype_for_vocab():
    assert [dtype_for_vocab(v).name for v in (256, 257, 65536, 65537)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint32",
    ]


def test_missing_directory_meta_and_bin(tmp_path, data_copy):
    with pytest.raises(FileNotFoundError, match=r"nothere does not exist.*seqshard prepare"):
        open_split(tmp_path / "nothere", "train")
    (data_copy / "train-00000.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"train-00000\.bin is missing.*seqshard prepare"):
        open_split(data_copy, "train")
    (data_copy / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"meta\.json is missing.*seqshard prepare"):
        open_split(data_copy, "val")


def test_empty_split(tmp_path, text_dir):
    no_val = PrepareConfig(vocab_size=300, val_fraction=0)
    out = prepare(tmp_path / "noval", path_corpus([text_dir]), no_val, log=None)
    with pytest.raises(ValueError, match=r"val split is empty \(0 tokens.*val-fraction"):
        open_split(out, "val")


def test_bin_size_not_a_multiple_of_dtype(data_copy):
    with (data_copy / "train-00000.bin").open("ab") as f:
        f.write(b"\x01")
    with pytest.raises(
        ValueError, match=r"train-00000\.bin is \d+ bytes, not a multiple of 2.*uint16"
    ):
        open_split(data_copy, "train")


def test_bin_token_count_differs_from_meta(data_copy):
    path = data_copy / "train-00000.bin"
    n = path.stat().st_size // 2
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(
        ValueError, match=rf"train-00000\.bin holds {n - 2} tokens but meta\.json says {n}"
    ):
        open_split(data_copy, "train")


def test_offsets_inconsistent_with_tokens(data_copy):
    path = data_copy / "train-00000.offsets.npy"
    offsets = np.load(path)
    offsets[-1] += 5
    np.save(path, offsets)
    with pytest.raises(ValueError, match=rf"offsets\.npy is inconsistent.*to {offsets[-1] - 5}"):
        open_split(data_copy, "train")
    np.save(path, offsets[:-1])
    with pytest.raises(ValueError, match=r"expected int64 offsets of shape \(\d+,\)"):
        open_split(data_copy, "train")


@pytest.mark.parametrize("value", [10**9, -7, "swap"])
def test_a_corrupt_inner_offset_is_caught_when_its_span_is_read(data_copy, value):
    """Fault 3 of the second campaign: an inner offset corrupted (first, last and length
    intact, so opening passes) raised a bare IndexError from read(); now the error names the
    file, the entry and what offsets must be."""
    path = data_copy / "train-00000.offsets.npy"
    offsets = np.load(path)
    k = len(offsets) // 2
    lo, hi = int(offsets[k - 1]), int(offsets[k + 1])
    if value == "swap":  # out of order, each value in range
        offsets[k], offsets[k + 1] = offsets[k + 1], offsets[k]
    else:
        offsets[k] = value
    np.save(path, offsets)
    split = open_split(data_copy, "train")
    with pytest.raises(ValueError, match=rf"train-00000\.offsets\.npy is corrupt: entry {k}") as e:
        split.read(lo, hi - lo)
    assert "expected document offsets rising from 0 to the shard's" in str(e.value)
    assert f"run `seqshard prepare --out {data_copy}`" in str(e.value)
    with pytest.raises(ValueError, match=r"offsets\.npy is corrupt"):
        split.doc(k)


def test_ids_outside_vocab(data_copy):
    """Opening trusts prepare's recorded largest id (it reads no tokens), and refuses one
    outside the vocabulary; a corrupt id in the file is caught when its span is read."""
    vocab = read_meta(data_copy)["vocab_size"]
    tokens = np.fromfile(data_copy / "train-00000.bin", dtype=np.uint16)
    tokens[17] = 65000
    tokens.tofile(data_copy / "train-00000.bin")
    split = open_split(data_copy, "train")
    assert split.read(18, 100)[0].max() < vocab
    with pytest.raises(
        ValueError,
        match=rf"train-00000\.bin holds token id 65000 at position 17.*expected ids < {vocab}",
    ):
        split.read(10, 20)
    meta = json.loads((data_copy / "meta.json").read_text())
    meta["splits"]["train"]["max_id"] = vocab
    (data_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"train split's largest id is {vocab}, outside"):
        open_split(data_copy, "train")


def test_tokenizer_hash_mismatch(data_copy, mesh):
    path = data_copy / "tokenizer.json"
    path.write_text(path.read_text() + "\n")
    with pytest.raises(ValueError, match=r"tokenizer\.json has sha256 .* tokenized with sha256"):
        check_tokenizer(data_copy)
    with pytest.raises(ValueError, match="sha256"):
        _loader(data_copy, mesh)
