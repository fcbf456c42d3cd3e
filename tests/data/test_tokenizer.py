"""Tests of seqshard.data.tokenizer: byte-level BPE training, round trips, hashes."""

from __future__ import annotations

import pytest
from data_helpers import _documents

from seqshard.data import tokenizer as tk


def test_tokenizer_round_trip_and_hash(tmp_path):
    path = tmp_path / "tok.json"
    tok = tk.train_tokenizer(_documents(30), 300, path)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(tk.EOT) is not None
    for text in ["", "def f(x):\n\treturn x  # ok\n", "  leading", "東京 🙂 naïve\r\n", "\x00\x7f"]:
        ids = tk.encode(tok, text)
        assert tk.decode(tok, ids) == text
        assert all(0 <= i < tok.get_vocab_size() for i in ids)
    loaded = tk.load_tokenizer(path)
    assert tk.encode(loaded, "the of and") == tk.encode(tok, "the of and")
    h = tk.tokenizer_hash(path)
    assert len(h) == 64 and h == tk.tokenizer_hash(path)
    path.write_text(path.read_text() + " ")
    assert tk.tokenizer_hash(path) != h
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257"):
        tk.train_tokenizer(["abc"], 100)
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        tk.load_tokenizer(tmp_path / "missing.json")
