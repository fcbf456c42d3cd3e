"""Shared set-up of the data-pipeline tests (test_corpus, test_tokenizer, test_tokenfile,
test_prepare, test_packing, test_loader): a small text corpus of documents of very different
lengths, prepared with a 400-token BPE; a 2x4 mesh; loader shortcuts.

Their fixtures are in tests/data/conftest.py."""

from __future__ import annotations

import numpy as np

from seqshard.batch import TokenBatch
from seqshard.data.loader import Loader

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


def _loader(data_dir, mesh, **kw) -> Loader:
    kw = {"batch_size": 4, "seq_len": SEQ_LEN, "mesh": mesh, **kw}
    return Loader(data_dir, kw.pop("split", "train"), **kw)


def _host(batch: TokenBatch) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(batch.tokens), np.asarray(batch.is_seq_start)


def reshard(data_dir, out, n_shards: int, masks: dict | None = None):
    """A format-2 copy of the prepared directory ``data_dir`` at ``out``: each split's documents
    cut into ``n_shards`` shards at document boundaries, with loss masks ``masks[split]``
    (uint8 per token) when given. The same documents in the same order: a reader must see the
    same split."""
    import json
    import shutil
    from pathlib import Path

    from seqshard.data.tokenfile import open_split

    out = Path(out)
    out.mkdir(parents=True)
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    shutil.copy(Path(data_dir) / meta["tokenizer"], out / meta["tokenizer"])
    for split, entry in meta["splits"].items():
        data = open_split(data_dir, split)
        tokens, offsets = np.asarray(data.shards[0].tokens), np.asarray(data.shards[0].offsets)
        cuts = np.linspace(0, len(offsets) - 1, n_shards + 1).astype(int)
        shards = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            name = f"{split}-{k:05d}"
            lo, hi = int(offsets[a]), int(offsets[b])
            tokens[lo:hi].tofile(out / f"{name}.bin")
            np.save(out / f"{name}.offsets.npy", offsets[a : b + 1] - lo)
            if masks is not None:
                np.asarray(masks[split][lo:hi], np.uint8).tofile(out / f"{name}.mask.bin")
            shards.append(
                {
                    "name": name,
                    "n_tokens": hi - lo,
                    "n_docs": int(b - a),
                    "sha256": "x",
                    "max_id": int(tokens[lo:hi].max()),
                }
            )
        entry.update(shards=shards, has_mask=masks is not None)
    meta["format_version"] = 2
    (out / "meta.json").write_text(json.dumps(meta))
    return out
