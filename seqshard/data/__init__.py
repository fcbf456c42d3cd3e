"""Text -> tokens -> sharded batches.

    seqshard prepare --out data/tokens           # corpus.py, tokenizer.py, tokenfile.py, prepare.py
    Loader("data/tokens", "train", batch_size=32, seq_len=256, mesh=mesh)   # packing.py, loader.py

Modules: ``corpus`` (where documents come from; default: the Python stdlib), ``tokenizer``
(byte-level BPE), ``tokenfile`` (the on-disk format and its checks), ``prepare`` (text -> token
files), ``packing`` (the packed, shuffled row stream, random access), ``loader`` (sharded global
batches with prefetch).
"""

from seqshard.data.corpus import Corpus, hf_corpus, path_corpus, stdlib_corpus
from seqshard.data.loader import EVAL_SEED, Loader, unigram_entropy
from seqshard.data.packing import PackedStream
from seqshard.data.prepare import prepare
from seqshard.data.tokenfile import TokenSplit, check_tokenizer, open_split, read_meta
from seqshard.data.tokenizer import (
    EOT,
    decode,
    encode,
    load_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

__all__ = [
    "EOT",
    "EVAL_SEED",
    "Corpus",
    "Loader",
    "PackedStream",
    "TokenSplit",
    "check_tokenizer",
    "decode",
    "encode",
    "hf_corpus",
    "load_tokenizer",
    "open_split",
    "path_corpus",
    "prepare",
    "read_meta",
    "stdlib_corpus",
    "tokenizer_hash",
    "train_tokenizer",
    "unigram_entropy",
]
