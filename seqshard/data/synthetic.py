"""Token sets of any size made on the fly, for measuring the loader against corpus size.

    write_synthetic("/tmp/tok1e9", n_tokens=10**9, vocab_size=4096)   # seconds, ~2 GB sparse

The tokens are a sparse file (zeros: the filesystem stores no blocks for them) and documents
of random lengths (mean ``mean_doc``); the meta.json is format 1 (one file a split), which the
reader still accepts and earlier seqshard versions read too, so the same set measures both.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from seqshard.data.tokenfile import dtype_for_vocab, write_meta

__all__ = ["write_synthetic"]

_TOKENIZER = "tokenizer.json"


def write_synthetic(
    out: str | os.PathLike,
    n_tokens: int,
    *,
    vocab_size: int = 4096,
    mean_doc: int = 1000,
    tokenizer: str | os.PathLike,
    seed: int = 0,
) -> Path:
    """A prepared-looking directory of ``n_tokens`` train tokens (and 1% as many val tokens)
    using ``tokenizer`` (a tokenizer.json, copied; meta records its hash)."""
    from seqshard.data.tokenizer import tokenizer_hash

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 100, mean_doc))):
        with (out / f"{split}.bin").open("wb") as f:
            f.truncate(n * dtype.itemsize)
        cuts = np.unique(rng.integers(1, n, size=max(0, n // mean_doc - 1)))
        offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        np.save(out / f"{split}.offsets.npy", offsets)
        n_docs = len(offsets) - 1
        splits[split] = {"n_tokens": n, "n_docs": n_docs, "max_id": 0, "sha256": f"synthetic-{n}"}
    (out / _TOKENIZER).write_bytes(Path(tokenizer).read_bytes())
    meta = {
        "format": "seqshard-tokens",
        "format_version": 1,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eot_id": None,
        "tokenizer": _TOKENIZER,
        "tokenizer_sha256": tokenizer_hash(out / _TOKENIZER),
        "source": f"synthetic {n_tokens} tokens",
        "splits": splits,
    }
    write_meta(out, meta)
    return out
