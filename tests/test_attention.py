"""Tests of seqshard/model/attention.py's pieces, against plain loops: document positions,
RoPE tables, masks, and which implementation ``auto`` means. (Attention inside the sharded
model, against the reference: test_transformer.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from seqshard.model.attention import (
    apply_rope,
    attention_mask,
    document_positions,
    resolve_impl,
    rope_tables,
)

STARTS = np.array(
    [
        [1, 0, 0, 1, 0, 0, 0, 1],
        [0, 0, 0, 0, 0, 1, 0, 0],  # a row may begin mid-document
    ],
    bool,
)


def loop_positions(starts: np.ndarray) -> np.ndarray:
    out = np.zeros(starts.shape, np.int32)
    for b, row in enumerate(starts):
        p = 0
        for i, start in enumerate(row):
            p = 0 if (start or i == 0) else p + 1
            out[b, i] = p
    return out


def test_document_positions_restart_at_each_document():
    np.testing.assert_array_equal(document_positions(jnp.asarray(STARTS)), loop_positions(STARTS))


def test_rope_rotates_pairs_i_and_i_plus_half_by_position_times_frequency():
    positions = jnp.asarray([[0, 1, 5]])
    cos, sin = rope_tables(positions, d_head=4, theta=100.0)
    assert cos.shape == sin.shape == (1, 3, 2)
    freqs = 100.0 ** (-np.arange(2) * 2 / 4)
    np.testing.assert_allclose(cos[0, 2], np.cos(5 * freqs), rtol=1e-6)
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    rotated = np.asarray(apply_rope(x, cos, sin))
    for i, p in enumerate([0, 1, 5]):
        for j in range(2):
            a, b = float(x[0, i, j]), float(x[0, i, j + 2])
            angle = p * freqs[j]
            np.testing.assert_allclose(
                rotated[0, i, [j, j + 2]],
                [a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)],
                rtol=1e-5,
                atol=1e-5,
            )
    # Rotations keep norms: attention scores depend on relative position only.
    np.testing.assert_allclose(
        np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("mode", ["document", "causal"])
def test_masks_by_loop(mode):
    mask = np.asarray(attention_mask(jnp.asarray(STARTS), mode))
    doc = np.cumsum(STARTS, axis=1)
    for b in range(2):
        for q in range(8):
            for k in range(8):
                want = k <= q and (mode == "causal" or doc[b, q] == doc[b, k])
                assert mask[b, q, k] == want, (b, q, k)


def test_auto_means_einsum_off_gpu_and_names_pass_through():
    assert resolve_impl("auto") == "einsum"  # these tests run on CPU
    for impl in ("einsum", "xla", "cudnn"):
        assert resolve_impl(impl) == impl
