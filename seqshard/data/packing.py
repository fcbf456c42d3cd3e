"""Sequence packing with random access: the rows of a packed, shuffled token stream.

The stream of a split is epoch after epoch. Epoch ``e`` is every document once, in the order of
a permutation seeded by ``(seed, e)``, concatenated and cut into rows of ``seq_len`` tokens:

    epoch e:  | doc 7 ......| doc 2 ...| doc 9 .............| doc 4 ..|  ...  | tail |
    rows:     | row 0         | row 1         | row 2         |  ...          |

The last ``n_tokens % seq_len`` tokens of each epoch's order (the *tail*, the end of that
epoch's last document or documents) are dropped, so every epoch has the same
``rows_per_epoch = n_tokens // seq_len`` rows and a row never spans two epochs. Every other
token appears exactly once per epoch. ``is_seq_start`` is True where a document begins; a row
that begins inside a document has False at position 0.

The rows of an epoch are then emitted in a second seeded permutation, so consecutive rows of
the stream (one batch) come from all over the corpus rather than from one or two long
documents: a batch of neighbouring rows would make the loss swing with whichever file it
landed in. Row ``r`` of the stream is packed row ``row_order(e)[r % rows_per_epoch]`` of epoch
``e = r // rows_per_epoch``, found by a binary search over the cumulative document lengths of
that epoch's order, so reading row ``r`` never needs rows ``0 .. r - 1``.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from seqshard.data.tokenfile import TokenSplit

__all__ = ["PackedStream"]


class PackedStream:
    """Rows ``[n, seq_len]`` of a split's packed stream (host numpy, int32 tokens, bool starts).

    stream = PackedStream(open_split("data/tokens", "train"), seq_len=256, seed=0)
    tokens, is_seq_start = stream.rows(np.arange(8, 16))
    """

    _CACHED_EPOCHS = 2  # consecutive steps use one epoch, or two at a boundary

    def __init__(self, split: TokenSplit, seq_len: int, seed: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}.")
        self.split, self.seq_len, self.seed = split, seq_len, int(seed)
        self.rows_per_epoch = split.n_tokens // seq_len
        if self.rows_per_epoch == 0:
            raise ValueError(
                f"{split.path} holds {split.n_tokens} tokens, fewer than one row of seq_len "
                f"{seq_len}; use a smaller seq_len or prepare more text."
            )
        self._lengths = split.doc_lengths()
        self._epochs: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # the prefetch thread and batch_at may both read

    @property
    def dropped_per_epoch(self) -> int:
        """Tokens of each epoch's tail that no row holds."""
        return self.split.n_tokens - self.rows_per_epoch * self.seq_len

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            if epoch in self._epochs:
                self._epochs.move_to_end(epoch)
                return self._epochs[epoch]
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.split.n_docs)
        cum = np.zeros(len(perm) + 1, np.int64)
        np.cumsum(self._lengths[perm], out=cum[1:])
        row_order = rng.permutation(self.rows_per_epoch)
        with self._lock:
            self._epochs[epoch] = (perm, cum, row_order)
            while len(self._epochs) > self._CACHED_EPOCHS:
                self._epochs.popitem(last=False)
        return perm, cum, row_order

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The document permutation of ``epoch`` and its cumulative lengths (n_docs + 1)."""
        perm, cum, _ = self._epoch(epoch)
        return perm, cum

    def row_order(self, epoch: int) -> np.ndarray:
        """Which packed row of ``epoch`` the stream emits j-th: a permutation of its rows."""
        return self._epoch(epoch)[2]

    def rows(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (int32) and is_seq_start (bool), both ``[len(row_ids), seq_len]``."""
        row_ids = np.asarray(row_ids, np.int64)
        if row_ids.size and row_ids.min() < 0:
            raise ValueError(f"row ids must be >= 0, got min {row_ids.min()}.")
        L = self.seq_len
        tokens = np.empty((len(row_ids), L), np.int32)
        starts = np.zeros((len(row_ids), L), np.bool_)
        data, offsets = self.split.tokens, self.split.offsets
        for out, row in enumerate(row_ids):
            epoch, j = divmod(int(row), self.rows_per_epoch)
            perm, cum, row_order = self._epoch(epoch)
            pos = int(row_order[j]) * L  # position in this epoch's concatenation
            k = int(np.searchsorted(cum, pos, side="right")) - 1  # the document holding pos
            filled = 0
            while filled < L:
                into_doc = pos - int(cum[k])
                take = min(L - filled, int(cum[k + 1]) - pos)
                src = int(offsets[perm[k]]) + into_doc
                tokens[out, filled : filled + take] = data[src : src + take]
                starts[out, filled] = into_doc == 0
                filled, pos, k = filled + take, pos + take, k + 1
        return tokens, starts
