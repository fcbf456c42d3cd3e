"""Sequence packing with random access: the rows of a packed, shuffled token stream, in
constant memory.

The stream of a split is epoch after epoch. Epoch ``e`` reads the split's documents (all its
shards, in order) as one ring of ``n_tokens`` tokens, starting at a seeded offset ``shift(e)``
and cutting it into ``rows_per_epoch = n_tokens // seq_len`` rows of ``seq_len`` tokens:

    ring:     | doc 0 ....| doc 1 ...| doc 2 ..............| doc 3 ..|  ...  | doc n-1 |
    epoch e:              ^ shift(e)
    rows:                 | row 0         | row 1         |  ...      | row R-1 | left |

The ``n_tokens % seq_len`` tokens just before ``shift(e)`` (``left``) are not in epoch ``e``;
the shift moves every epoch, so no token is left out twice in a row, and every other token is
in exactly one row of the epoch. ``is_seq_start`` is True where a document begins (position 0
of the ring included); a row that begins inside a document has False at position 0.

The rows of an epoch are emitted in a seeded pseudo-random order, so one batch's rows come from
all over the corpus: row ``r`` of the stream is packed row ``order_e(r % R)`` of epoch
``e = r // R``, where ``order_e`` is Grain's ``index_shuffle`` (a bijection on ``0 .. R-1``
computed per index, a Feistel-like network: no array of R entries). Finding a row's documents
is a binary search in the shards' memory-mapped offsets. So reading row ``r`` needs neither the
rows before it nor memory that grows with the corpus: the same start-up time and resident
memory for 10^6 tokens as for 10^12.
"""

from __future__ import annotations

import numpy as np
from grain.experimental import index_shuffle

from seqshard.data.tokenfile import TokenSplit

__all__ = ["PackedStream"]

_ROUNDS = 8  # index_shuffle rounds: 4 leaves neighbouring rows close together at 10^12 rows
_SEED_LIMIT = 2**31  # index_shuffle seeds are 32-bit


class PackedStream:
    """Rows ``[n, seq_len]`` of a split's packed stream (host numpy: int32 tokens, bool
    document starts, bool loss mask).

    stream = PackedStream(open_split("data/tokens", "train"), seq_len=256, seed=0)
    tokens, is_seq_start, loss_mask = stream.rows(np.arange(8, 16))
    """

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

    @property
    def dropped_per_epoch(self) -> int:
        """Tokens of each epoch that no row holds."""
        return self.split.n_tokens - self.rows_per_epoch * self.seq_len

    def _epoch_keys(self, epoch: int) -> tuple[int, int]:
        """``(shift, shuffle seed)`` of ``epoch``: a pure function of ``(seed, epoch)``."""
        rng = np.random.default_rng([self.seed, epoch])
        return int(rng.integers(self.split.n_tokens)), int(rng.integers(_SEED_LIMIT))

    def shift(self, epoch: int) -> int:
        """Where ``epoch``'s first row starts in the ring of the split's tokens."""
        return self._epoch_keys(epoch)[0]

    def packed_row(self, epoch: int, j: int) -> int:
        """Which packed row of ``epoch`` the stream emits ``j``-th (a bijection on its rows)."""
        return self._shuffled(j, self._epoch_keys(epoch)[1])

    def _shuffled(self, j: int, seed: int) -> int:
        if self.rows_per_epoch == 1:  # index_shuffle needs max_index >= 1
            return 0
        return int(index_shuffle(j, max_index=self.rows_per_epoch - 1, seed=seed, rounds=_ROUNDS))

    def rows(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens (int32), is_seq_start and loss_mask (bool), each ``[len(row_ids), seq_len]``."""
        row_ids = np.asarray(row_ids, np.int64)
        if row_ids.size and row_ids.min() < 0:
            raise ValueError(f"row ids must be >= 0, got min {row_ids.min()}.")
        L, n = self.seq_len, self.split.n_tokens
        tokens = np.empty((len(row_ids), L), np.int32)
        starts = np.empty((len(row_ids), L), np.bool_)
        mask = np.empty((len(row_ids), L), np.bool_)
        keys: dict[int, tuple[int, int]] = {}
        for out, row in enumerate(row_ids):
            epoch, j = divmod(int(row), self.rows_per_epoch)
            if epoch not in keys:
                keys[epoch] = self._epoch_keys(epoch)
            shift, seed = keys[epoch]
            pos = (shift + self._shuffled(j, seed) * L) % n
            first = min(L, n - pos)  # the part before the ring wraps to token 0
            for lo, start, length in ((0, pos, first), (first, 0, L - first)):
                if length:
                    span = self.split.read(start, length)
                    tokens[out, lo : lo + length], starts[out, lo : lo + length] = span[:2]
                    mask[out, lo : lo + length] = span[2]
        return tokens, starts, mask
