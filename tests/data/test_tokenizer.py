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


def test_token_bytes_join_to_the_decoded_text():
    """The stop strings of generation are matched on these bytes (seqshard.sample): joined and
    read as UTF-8 they must be what decode gives, for added tokens too (in the byte alphabet
    or not), on ids that split characters."""
    import random

    from tokenizers import AddedToken, decoders

    tok = tk.train_tokenizer(_documents(30) + ["東京 🙂 naïve <|end|>\n"] * 5, 300)
    tok.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", special=True)])
    tok.add_tokens(["<|end|>", "ñandú"])
    pieces = tk.token_bytes(tok)
    assert len(pieces) == tok.get_vocab_size()
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 10))]
        assert b"".join(pieces[i] for i in ids).decode("utf-8", "replace") == tk.decode(tok, ids)
    tok.decoder = decoders.Metaspace()  # decodes "▁" as a space, and drops a leading one
    assert tk.token_bytes(tok) is None


def test_a_hub_name_that_cannot_be_fetched_is_one_line_with_the_fix(tmp_path, monkeypatch):
    """A tokenizer named ORG/NAME, where no such path exists, is fetched from the Hugging Face
    Hub (tokenizers' from_pretrained). Without network (this machine, CI) or for a name the
    Hub lacks, the error names the tokenizer, the failure and the fix."""
    import huggingface_hub.constants

    # Offline at once: without network the library fails the same way after ~20 s of retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    name = "seqshard-tests/no-such-tokenizer"
    with pytest.raises(ValueError) as e:
        tk.load_tokenizer(name)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"tokenizer {name}: no such file here, so it names a Hugging Face Hub")
    assert f"`hf download {name} tokenizer.json --local-dir DIR`" in msg
    assert "point data.tokenizer (or --tokenizer) at DIR/tokenizer.json" in msg
    with pytest.raises(ValueError, match=f"tokenizer {name}: "):
        tk.tokenizer_hash(name)  # what prepare records of it
    # A path that exists wins over the name; a missing .json is a missing file, not a name.
    tk.train_tokenizer(_documents(5), 300, tmp_path / "seqshard-tests" / "my-tokenizer")
    assert tk.load_tokenizer("seqshard-tests/my-tokenizer").get_vocab_size() <= 300
    with pytest.raises(FileNotFoundError, match="no-such.json does not exist"):
        tk.load_tokenizer("seqshard-tests/no-such.json")
