"""Tests of seqshard.batch: the batch declared in the notation, and everything derived from it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from seqshard.batch import TokenBatch, batch_structs, split_microbatches, token_batch
from seqshard.shardlib.shardtypes import Array, partition_specs, shardings
from seqshard.testing import count_collectives, fake_cpu_mesh


def test_the_batch_layout_is_its_types():
    rows = ("d", "e")  # the batch rows over d and e
    assert partition_specs(TokenBatch) == TokenBatch(
        tokens=P(rows, "c"), is_seq_start=P(rows, "c"), loss_mask=P(rows, "c")
    )
    stacked = partition_specs(Array["microbatches", TokenBatch])
    assert stacked.tokens == P(None, rows, "c")


def test_token_batch_casts_and_checks():
    b = token_batch(np.zeros((4, 8), np.int64), np.zeros((4, 8), np.int8))
    assert b.tokens.dtype == jnp.int32 and b.is_seq_start.dtype == jnp.bool_ and b.shape == (4, 8)
    assert b.loss_mask.dtype == jnp.bool_ and bool(b.loss_mask.all())  # None: every token counts
    with pytest.raises(TypeError, match="integer ids, got dtype float32"):
        token_batch(np.zeros((4, 8), np.float32), np.zeros((4, 8), bool))
    with pytest.raises(ValueError, match=r"all be \[batch, seq_len\]; got \(4, 8\), \(4, 7\)"):
        token_batch(np.zeros((4, 8), np.int32), np.zeros((4, 7), bool))
    with pytest.raises(ValueError, match=r"got \(4, 8\), \(4, 8\) and \(4, 9\)"):
        token_batch(np.zeros((4, 8), np.int32), np.zeros((4, 8), bool), np.ones((4, 9), bool))


def test_batch_structs_are_sharded_as_declared():
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    s = batch_structs(8, 16, mesh)
    assert s.tokens.shape == (8, 16) and s.tokens.dtype == jnp.int32
    assert s.is_seq_start.dtype == jnp.bool_
    assert s.tokens.sharding == shardings(TokenBatch, mesh).tokens
    with pytest.raises(ValueError, match="6"):
        batch_structs(6, 16, mesh)  # 6 rows over d=4


@pytest.mark.parametrize("k", [2, 4])
def test_split_microbatches_takes_every_kth_row_and_moves_nothing(k):
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    tokens = np.arange(16 * 4, dtype=np.int32).reshape(16, 4)
    starts = tokens % 3 == 0
    batch = jax.device_put(token_batch(tokens, starts), shardings(TokenBatch, mesh))
    split = jax.jit(lambda b: split_microbatches(b, k, mesh))
    out = split(batch)
    for m in range(k):
        np.testing.assert_array_equal(out.tokens[m], tokens[m::k])
        np.testing.assert_array_equal(out.is_seq_start[m], starts[m::k])
    stacked = shardings(Array["microbatches", TokenBatch], mesh).tokens
    assert out.tokens.sharding.is_equivalent_to(stacked, 3)
    # Each device's rows already hold its share of every microbatch.
    assert sum(count_collectives(split, batch).values()) == 0
    with pytest.raises(ValueError, match="does not split into 3 microbatches"):
        split_microbatches(batch, 3, mesh)
