"""Tests of seqshard.data.packing: documents packed into rows, one shuffled epoch at a time."""

from __future__ import annotations

import numpy as np
from data_helpers import SEQ_LEN

from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import (
    open_split,
)


def test_packing_one_epoch_round_trip(data_dir):
    """One epoch's rows, put back in packing order, are the permuted documents concatenated,
    minus the tail; starts mark exactly the document starts."""
    split = open_split(data_dir, "train")
    stream = PackedStream(split, SEQ_LEN, seed=3)
    R = stream.rows_per_epoch
    order = stream.row_order(0)
    assert sorted(order) == list(range(R)) and not np.array_equal(order, np.arange(R))
    tokens, starts = stream.rows(np.arange(R))
    tokens, starts = tokens[np.argsort(order)], starts[np.argsort(order)]
    perm, cum = stream.epoch_order(0)
    concat = np.concatenate([split.doc(i) for i in perm]).astype(np.int32)
    emitted = tokens.reshape(-1)
    assert np.array_equal(emitted, concat[: R * SEQ_LEN])
    dropped = concat[R * SEQ_LEN :]
    assert len(dropped) == stream.dropped_per_epoch < SEQ_LEN
    # Nothing lost or duplicated: emitted + dropped tail is the split's multiset of tokens.
    everything = np.sort(np.asarray(split.tokens, np.int32))
    assert np.array_equal(np.sort(np.concatenate([emitted, dropped])), everything)
    doc_starts = cum[:-1][cum[:-1] < R * SEQ_LEN]
    assert np.array_equal(np.flatnonzero(starts.reshape(-1)), doc_starts)
    assert not starts[:, 0].all() and starts[:, 0].any()  # some rows begin mid-document

    # The next epoch is another permutation of the same documents.
    perm1, _ = stream.epoch_order(1)
    assert sorted(perm1) == sorted(perm) and not np.array_equal(perm1, perm)
    tokens1, _ = stream.rows(np.arange(R, 2 * R))
    tokens1 = tokens1[np.argsort(stream.row_order(1))]
    concat1 = np.concatenate([split.doc(i) for i in perm1]).astype(np.int32)
    assert np.array_equal(tokens1.reshape(-1), concat1[: R * SEQ_LEN])
