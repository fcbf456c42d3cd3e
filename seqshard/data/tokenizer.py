"""Byte-level BPE tokenizers (GPT-2 style) trained and loaded with the `tokenizers` library.

Byte-level means every string, in any script, encodes without unknown tokens and decodes back
to itself exactly: the 256 byte symbols are always in the vocabulary, merges are learned on
top, and one special token ``<|endoftext|>`` ends each document in the token files.

    tok = train_tokenizer(corpus, vocab_size=4096, path="data/tokenizer.json")
    tok = load_tokenizer("data/tokenizer.json")
    tok = load_tokenizer("meta-llama/Llama-3.2-1B")   # a Hub name (seqshard.paths.is_hub_name)
    ids = encode(tok, "def f(x):")          # list[int]
    decode(tok, ids) == "def f(x):"
    tokenizer_hash("data/tokenizer.json")    # sha256 hex of the file
    token_bytes(tok)[i]                      # the bytes id i decodes to (a byte-level tokenizer)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from seqshard.paths import is_hub_name

__all__ = [
    "EOT",
    "MIN_VOCAB",
    "Tokenizer",
    "decode",
    "encode",
    "encode_batch",
    "eot_id",
    "load_tokenizer",
    "token_bytes",
    "tokenizer_hash",
    "tokenizer_json",
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
    """Load a tokenizer.json (one written by :func:`train_tokenizer` or any `tokenizers` one),
    or, for a Hugging Face Hub name (``ORG/NAME`` where no such path exists), the Hub model's,
    fetched by ``Tokenizer.from_pretrained``."""
    if is_hub_name(str(path)):
        return _from_hub(str(path))
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} does not exist; pass the path of a tokenizer.json "
            f"(data.tokenizer in a config, --tokenizer to seqshard prepare), or leave it out to "
            f"train a new one."
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ValueError(
            f"{path} is not a valid tokenizers tokenizer.json ({e}); pass a file saved by "
            f"`tokenizers` (Tokenizer.save) or train a new one."
        ) from None


def _from_hub(name: str) -> Tokenizer:
    """The tokenizer of the Hub model ``name``; ValueError naming it, the failure and the fix."""
    # tokenizers fetches through huggingface_hub (a dependency of tokenizers), whose retries
    # without network log a warning each (~20 s of them); the error below says it once.
    from huggingface_hub.utils import logging as hub_logging  # noqa: PLC0415

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as e:  # no network, no such repository, a gated one: all one fix
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"tokenizer {name}: no such file here, so it names a Hugging Face Hub model, and "
            f"fetching its tokenizer failed ({type(e).__name__}: {why}). Download it where "
            f"there is network (`hf download {name} tokenizer.json --local-dir DIR`) and "
            f"point data.tokenizer (or --tokenizer) at DIR/tokenizer.json."
        ) from None
    finally:
        hub_logging.set_verbosity(verbosity)


def tokenizer_json(path: str | os.PathLike) -> bytes:
    """The tokenizer.json bytes of a file, or of a Hub name's tokenizer (see
    :func:`load_tokenizer`) as ``tokenizers`` writes it."""
    if is_hub_name(str(path)):
        return _from_hub(str(path)).to_str(pretty=True).encode()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist; cannot read it.")
    return path.read_bytes()


def tokenizer_hash(path: str | os.PathLike) -> str:
    """The sha256 (hex) of the tokenizer's bytes (:func:`tokenizer_json`): two files hash
    equal iff identical."""
    return hashlib.sha256(tokenizer_json(path)).hexdigest()


def eot_id(tok: Tokenizer) -> int | None:
    """The id of ``<|endoftext|>``, or None if this tokenizer has no such token."""
    return tok.token_to_id(EOT)


def token_bytes(tok: Tokenizer) -> list[bytes] | None:
    """The bytes each id decodes to, for a byte-level tokenizer (``decoders.ByteLevel``: this
    module's and most Hugging Face ones): ``decode(tok, ids)`` is then the concatenation of
    their bytes, read as UTF-8 (a bad sequence as U+FFFD). None for any other decoder."""
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    # GPT-2's byte symbols: the printable bytes stand for themselves, the others for 256 + k.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    symbol_byte = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}
    out = []
    for i in range(tok.get_vocab_size()):
        token = tok.id_to_token(i) or ""
        if all(c in symbol_byte for c in token):
            out.append(bytes(symbol_byte[c] for c in token))
        else:  # an added token outside the byte alphabet: the decoder writes its text as is
            out.append(token.encode())
    return out


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return tok.encode(text, add_special_tokens=False).ids


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text; runs in parallel over the batch in Rust."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The text of ``ids``; ``decode(tok, encode(tok, s)) == s`` for every string ``s``."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
