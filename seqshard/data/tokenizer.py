"""Byte-level BPE tokenizers (GPT-2 style) trained and loaded with the `tokenizers` library.

Byte-level means every string, in any script, encodes without unknown tokens and decodes back
to itself exactly: the 256 byte symbols are always in the vocabulary, merges are learned on
top, and one special token ``<|endoftext|>`` ends each document in the token files.

    tok = train_tokenizer(corpus, vocab_size=4096, path="data/tokenizer.json")
    tok = load_tokenizer("data/tokenizer.json")
    ids = encode(tok, "def f(x):")          # list[int]
    decode(tok, ids) == "def f(x):"
    tokenizer_hash("data/tokenizer.json")    # sha256 hex of the file
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOT",
    "MIN_VOCAB",
    "Tokenizer",
    "decode",
    "encode",
    "encode_batch",
    "eot_id",
    "load_tokenizer",
    "tokenizer_hash",
    "train_tokenizer",
]

EOT = "<|endoftext|>"
# The 256 byte symbols plus EOT: a vocabulary that cannot hold them cannot encode every text.
MIN_VOCAB = 257


def train_tokenizer(
    documents: Iterable[str],
    vocab_size: int,
    path: str | os.PathLike | None = None,
    *,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (fewer if the text runs out of
    pairs seen ``min_frequency`` times) and save it to ``path`` as tokenizer.json if given."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB} (256 byte symbols + {EOT}), got "
            f"{vocab_size!r}; use e.g. --vocab-size 4096."
        )
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer.json (one written by :func:`train_tokenizer` or any `tokenizers` one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} does not exist; pass the path of a tokenizer.json, or leave "
            f"--tokenizer out to train a new one."
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ValueError(
            f"{path} is not a valid tokenizers tokenizer.json ({e}); pass a file saved by "
            f"`tokenizers` (Tokenizer.save) or train a new one."
        ) from None


def tokenizer_hash(path: str | os.PathLike) -> str:
    """The sha256 (hex) of the tokenizer file's bytes: two files hash equal iff identical."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist; cannot hash it.")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def eot_id(tok: Tokenizer) -> int | None:
    """The id of ``<|endoftext|>``, or None if this tokenizer has no such token."""
    return tok.token_to_id(EOT)


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return tok.encode(text, add_special_tokens=False).ids


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text; runs in parallel over the batch in Rust."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The text of ``ids``; ``decode(tok, encode(tok, s)) == s`` for every string ``s``."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
