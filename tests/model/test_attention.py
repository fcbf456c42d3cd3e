"""Tests of seqshard/model/attention.py's pieces, against plain loops: document positions,
RoPE tables, masks (dense, and splash's and pallas' segment ids), which implementation ``auto``
means per backend and mask, what runs a dense mask, and that cudnn fails cleanly off GPU.
(Attention inside the sharded model, against the reference: test_transformer.py; splash and
pallas against einsum: test_splash.py, test_pallas_gpu.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqshard.model.attention import (
    apply_rope,
    attention,
    attention_mask,
    dense_mask_impl,
    document_positions,
    resolve_impl,
    rope_frequencies,
    rope_tables,
)
from seqshard.model.config import ModelConfig

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


def llama3_frequencies_loop(d_head, theta, factor, low, high, original):
    """Llama 3.1's frequency rescaling, one frequency at a time as Meta's reference code reads."""
    out = []
    for i in range(0, d_head, 2):
        freq = 1.0 / theta ** (i / d_head)
        wavelength = 2 * np.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("original", [16, 64, 8192])
def test_llama3_rope_frequencies_match_the_loop_in_all_three_bands(original):
    cfg = ModelConfig(
        d_head=64,
        rope_theta=500000.0,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=original,
    )
    want = llama3_frequencies_loop(64, 500000.0, 8.0, 1.0, 4.0, original)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), want, rtol=2e-6)
    default = np.asarray(rope_frequencies(ModelConfig(d_head=64, rope_theta=500000.0)))
    wavelength = 2 * np.pi / default
    if original == 64:  # all three bands are present: kept, slowed 8x, between
        assert (wavelength < 16).any() and (wavelength > 64).any()
        assert ((wavelength >= 16) & (wavelength <= 64)).any()


def test_llama3_rope_needs_ordered_factors():
    with pytest.raises(ValueError, match="rope_low_freq_factor < rope_high_freq_factor"):
        ModelConfig(rope_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0)


def test_rope_rotates_pairs_i_and_i_plus_half_by_position_times_frequency():
    positions = jnp.asarray([[0, 1, 5]])
    cos, sin = rope_tables(positions, rope_frequencies(ModelConfig(d_head=4, rope_theta=100.0)))
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


@pytest.mark.parametrize("impl", ["splash", "pallas"])
def test_segment_id_mask_numbers_documents_along_the_row(impl):
    for mode in ("document", "causal"):  # causal: the kernel is told causal_only and drops them
        ids = np.asarray(attention_mask(jnp.asarray(STARTS), mode, impl))
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, [[1, 1, 1, 2, 2, 2, 2, 3], [0, 0, 0, 0, 0, 1, 1, 1]])
    # which equal the dense mask's documents: same id <=> same document
    dense = np.asarray(attention_mask(jnp.asarray(STARTS), "document"))
    causal = np.tril(np.ones((8, 8), bool))
    np.testing.assert_array_equal(dense, causal & (ids[:, :, None] == ids[:, None, :]))


def test_auto_means_einsum_on_cpu_and_names_pass_through():
    assert resolve_impl("auto") == "einsum"  # these tests run on CPU
    for impl in ("einsum", "xla", "cudnn", "splash", "pallas"):
        assert resolve_impl(impl) == impl
        assert resolve_impl(impl, "causal") == impl


@pytest.mark.parametrize(
    "backend, mode, impl",
    [
        ("tpu", "document", "splash"),
        ("tpu", "causal", "splash"),
        ("gpu", "document", "pallas"),  # segment ids, no dense [B, L, L] mask
        ("gpu", "causal", "cudnn"),  # is_causal reads no mask
        ("cpu", "document", "einsum"),
        ("cpu", "causal", "einsum"),
    ],
)
def test_auto_means_splash_on_tpu_and_pallas_or_cudnn_on_gpu(monkeypatch, backend, mode, impl):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_impl("auto", mode) == impl
    ids = attention_mask(jnp.asarray(STARTS), mode, "auto").ndim == 2
    assert ids == (impl in ("splash", "pallas")), "auto's mask is what its kernel takes"


@pytest.mark.parametrize(
    "backend, impl, dense",
    [
        ("gpu", "pallas", "cudnn"),  # what auto ran on GPU before pallas
        ("cpu", "pallas", "einsum"),
        ("tpu", "splash", "einsum"),
        ("gpu", "cudnn", "cudnn"),
        ("cpu", "xla", "xla"),
    ],
)
def test_a_dense_mask_goes_to_a_kernel_that_reads_one(monkeypatch, backend, impl, dense):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert dense_mask_impl(impl) == dense


@pytest.mark.parametrize("causal_only", [False, True])
def test_cudnn_off_gpu_fails_cleanly(causal_only):
    """JAX's own error, raised while tracing: nothing silently falls back to another kernel."""
    q = jnp.zeros((2, 8, 2, 2, 4))
    k = v = jnp.zeros((2, 8, 2, 4))
    mask = attention_mask(jnp.asarray(STARTS), "document")
    with pytest.raises(RuntimeError, match="cuDNN"):
        attention(q, k, v, mask, "cudnn", causal_only)
