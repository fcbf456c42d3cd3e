"""Tests of seqshard.data.packing: the split read as a ring, cut into rows from a seeded shift,
the rows of each epoch emitted in a seeded order computed per index."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import SEQ_LEN, reshard

from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import open_split


def _ring(split) -> tuple[np.ndarray, np.ndarray]:
    """All the split's tokens in order and a flag at each document start."""
    tokens = np.concatenate([np.asarray(s.tokens, np.int32) for s in split.shards])
    starts = np.zeros(len(tokens), bool)
    starts[np.concatenate([s.start + np.asarray(s.offsets[:-1]) for s in split.shards])] = True
    return tokens, starts


@pytest.mark.parametrize("epoch", [0, 1])
def test_packing_one_epoch_round_trip(data_dir, epoch):
    """An epoch's rows, put back in packed order, are the ring of tokens read from the epoch's
    shift; the ``n_tokens % seq_len`` before the shift are left out; starts mark exactly the
    document starts."""
    split = open_split(data_dir, "train")
    stream = PackedStream(split, SEQ_LEN, seed=3)
    R = stream.rows_per_epoch
    order = [stream.packed_row(epoch, j) for j in range(R)]
    assert sorted(order) == list(range(R)) and order != list(range(R))
    tokens, starts, mask = stream.rows(np.arange(epoch * R, (epoch + 1) * R))
    tokens, starts = tokens[np.argsort(order)].reshape(-1), starts[np.argsort(order)].reshape(-1)
    ring, ring_starts = _ring(split)
    kept = np.roll(np.arange(split.n_tokens), -stream.shift(epoch))[: R * SEQ_LEN]
    assert np.array_equal(tokens, ring[kept]) and np.array_equal(starts, ring_starts[kept])
    assert mask.all()  # no mask file: every token counts
    assert split.n_tokens - len(kept) == stream.dropped_per_epoch < SEQ_LEN
    first = starts.reshape(R, SEQ_LEN)[:, 0]
    assert not first.all() and first.any()  # some rows begin mid-document


def test_epochs_differ_and_rows_are_a_pure_function(data_dir):
    split = open_split(data_dir, "train")
    a, b = PackedStream(split, SEQ_LEN, seed=3), PackedStream(split, SEQ_LEN, seed=3)
    R = a.rows_per_epoch
    assert a.shift(0) != a.shift(1) or a.packed_row(0, 0) != a.packed_row(1, 0)
    rows = np.array([5, R + 5, 7 * R + 2, 10**9])
    for x, y in zip(a.rows(rows), b.rows(rows[::-1]), strict=True):
        assert np.array_equal(x, y[::-1])
    other = PackedStream(split, SEQ_LEN, seed=4).rows(rows)[0]
    assert not np.array_equal(a.rows(rows)[0], other)


def test_shards_read_as_one_split(tmp_path, data_dir):
    """The same documents cut into 3 shards give the same stream, row for row; a loss mask
    read from the shards' mask files lands on the same tokens."""
    one = open_split(data_dir, "train")
    rng = np.random.default_rng(0)
    masks = {s: rng.integers(0, 2, open_split(data_dir, s).n_tokens) for s in ("train", "val")}
    three = open_split(reshard(data_dir, tmp_path / "sharded", 3, masks), "train")
    assert len(three.shards) == 3 and three.n_tokens == one.n_tokens and three.has_mask
    rows = np.arange(0, 4 * PackedStream(one, SEQ_LEN, 0).rows_per_epoch, 3)
    want = PackedStream(one, SEQ_LEN, seed=0).rows(rows)
    got = PackedStream(three, SEQ_LEN, seed=0).rows(rows)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    # Each row's mask is the mask file at the row's tokens: find them through read().
    tokens, _, mask = three.read(0, three.n_tokens)
    assert np.array_equal(mask, masks["train"].astype(bool))
    assert np.array_equal(
        three.doc(len(three.shards[0].offsets) - 1), one.doc(len(three.shards[0].offsets) - 1)
    )
