"""Tests of seqshard/shardlib/matmul.py: what a matmul accumulates in, and its derivative.

f32          einsum of f32 operands is jnp.einsum, bit for bit, gradients included (f32 runs
             unchanged); ragged_dot is lax.ragged_dot's (bit for bit where the backend keeps
             it, to f32 rounding where it walks row tiles)
row tiles    groups spanning several tiles, empty groups, rows past the last group, no rows at
             all, varying operands in a shard_map; the compiled step multiplies tiles, not
             the whole buffer per group
CPU class    each CPU class's flags (AMX Xeon, Zen 4, avx2 only, none readable) give its class;
             SEQSHARD_CPU_MATMUL overrides them and refuses a name that is no class
bf16         on each CPU class, the value is the f32-accumulated product rounded once to bf16;
             the custom VJP equals the f32 matmul's VJP of the same bf16 cotangent, to bf16
             rounding
compiled     every dot of a bf16 matmul's gradient takes its CPU class's path: bf16 x bf16 ->
             f32, or on an avx2-only CPU f32 x f32 -> f32; a plain einsum's transpose does not
             keep the first (what the custom VJP is for)
shard_map    operands varying over different mesh axes: the gradients of the replicated one
             sum over the axis, as jnp.einsum's do
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from seqshard.shardlib import matmul
from seqshard.testing import compiled_hlo, count_dots, fake_cpu_mesh

BF16, F32 = jnp.bfloat16, jnp.float32
EQ = "blm,mqd->blqd"

# /proc/cpuinfo flags of the CPU classes this project's machines have had (the bf16 and vector
# ones, as the first processor's `flags` line lists them).
XEON_AMX = "fma avx avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
ZEN4 = "fma avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni"  # AMD EPYC 9004
AVX2_ONLY = "fma avx avx2 f16c"  # AMD EPYC 7002/7003


@pytest.fixture(params=["bf16", "f32"])
def cpu_class(request, monkeypatch):
    """Each CPU class's matmul path, forced on this machine."""
    monkeypatch.setenv(matmul.CPU_MATMUL_ENV, request.param)
    return request.param


def operands(dtype, seed=0):
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (4, 8, 16), F32).astype(dtype)
    b = jax.random.normal(kb, (16, 3, 5), F32).astype(dtype)
    ct = jax.random.normal(kc, (4, 8, 3, 5), F32).astype(dtype)
    return a, b, ct


def ragged_operands(dtype):
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (10, 6), F32).astype(dtype)
    w = jax.random.normal(kw, (3, 6, 4), F32).astype(dtype)
    ct = jax.random.normal(kc, (10, 4), F32).astype(dtype)
    return x, w, ct, jnp.array([3, 0, 6], jnp.int32)  # one empty group, one unused row


def test_f32_is_plain_jax_bit_for_bit():
    a, b, ct = operands(F32)
    ours, vjp = jax.vjp(lambda a, b: matmul.einsum(EQ, a, b), a, b)
    plain, plain_vjp = jax.vjp(lambda a, b: jnp.einsum(EQ, a, b), a, b)
    np.testing.assert_array_equal(ours, plain)
    for g, h in zip(vjp(ct), plain_vjp(ct), strict=True):
        np.testing.assert_array_equal(g, h)


def assert_ragged_dot_is_laxs(x, w, ct, sizes):
    """Value and VJP equal lax.ragged_dot's: bit for bit where the backend keeps it; in row
    tiles, to f32 rounding (the tile's matmul sums M in another order: measured within 1.2e-5
    of entries up to 30)."""

    def value_and_vjp(ragged):
        out, vjp = jax.vjp(lambda x, w: ragged(x, w, sizes), x, w)
        return (out, *vjp(ct))

    ours = jax.jit(value_and_vjp, static_argnums=0)(matmul.ragged_dot)
    plain = jax.jit(value_and_vjp, static_argnums=0)(jax.lax.ragged_dot)
    tiled = jax.default_backend() in matmul.ROW_TILES
    for got, want in zip(ours, plain, strict=True):
        if tiled:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        else:
            np.testing.assert_array_equal(got, want)


def test_f32_ragged_dot_is_laxs():
    assert_ragged_dot_is_laxs(*ragged_operands(F32))


@pytest.mark.parametrize(
    "sizes",
    [[100, 0, 7, 150], [0, 0, 0, 0], [0, 0, 0, 300], [1, 1, 1, 1], [64, 64, 64, 64]],
    ids=["spanning-tiles", "no-rows", "last-only", "one-row-each", "whole-tiles"],
)
def test_row_tiles_cover_every_group_and_no_other_row(monkeypatch, sizes):
    """Tiles of 64 rows: a group over several tiles and ending inside one, empty groups,
    300 rows of which some belong to no group (their output and gradient: 0)."""
    monkeypatch.setitem(matmul.ROW_TILES, jax.default_backend(), 64)
    kx, kw, kc = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (300, 24), F32)
    w = jax.random.normal(kw, (4, 24, 8), F32)
    ct = jax.random.normal(kc, (300, 8), F32)
    assert_ragged_dot_is_laxs(x, w, ct, jnp.array(sizes, jnp.int32))


def test_row_tiles_in_shard_map_with_operands_varying_differently(monkeypatch):
    """Rows and group sizes vary over d, the matrices are replicated: the matrices' gradient
    sums the d shards' (as lax.ragged_dot's does), per shard its own groups."""
    monkeypatch.setitem(matmul.ROW_TILES, jax.default_backend(), 16)
    mesh = fake_cpu_mesh((2,), ("d",))
    x = jax.random.normal(jax.random.key(5), (2 * 40, 12), F32)
    w = jax.random.normal(jax.random.key(6), (3, 12, 5), F32)
    sizes = jnp.array([[20, 0, 17], [0, 40, 0]], jnp.int32)

    def loss(ragged):
        def body(x, w, sizes):
            y = ragged(x, w, sizes[0])
            return jax.lax.psum(jnp.sum(y * y), "d")

        run = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P())
        return jax.jit(jax.value_and_grad(run, (0, 1)))

    (got, got_g), (want, want_g) = (
        loss(f)(x, w, sizes) for f in (matmul.ragged_dot, jax.lax.ragged_dot)
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, h in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5 * np.abs(h).max())


@pytest.mark.skipif(
    jax.default_backend() not in matmul.ROW_TILES, reason="backend keeps ragged_dot"
)
def test_the_compiled_product_multiplies_tiles_not_the_buffer():
    """Every dot of the compiled value and gradient is one tile's (128 rows) or a tile's
    contraction into one group's matrix: none spans the 4096-row buffer, which is what XLA:CPU's
    own ragged_dot does for each group."""
    x = jnp.ones((4096, 32), F32)
    w = jnp.ones((4, 32, 16), F32)
    sizes = jnp.array([10, 300, 0, 50], jnp.int32)
    grad = jax.grad(lambda x, w: jnp.sum(matmul.ragged_dot(x, w, sizes) ** 2), (0, 1))
    hlo = compiled_hlo(grad, x, w)
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert len(dots) == 3, dots
    assert not any("4096" in line.split("=")[1].split("dot(")[0] for line in dots), dots


def assert_bf16_close(got, want):
    """Equal to f32 ``want`` rounded once to bf16: within half a bf16 ulp (2^-9 relative) plus
    the summation order's f32 rounding."""
    assert got.dtype == BF16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-6 * np.abs(want).max()
    )


def test_bf16_value_and_vjp_are_the_f32_matmuls_rounded_once(cpu_class):
    a, b, ct = operands(BF16)
    out, vjp = jax.vjp(lambda a, b: matmul.einsum(EQ, a, b), a, b)
    up = [t.astype(F32) for t in (a, b, ct)]
    want, want_vjp = jax.vjp(lambda a, b: jnp.einsum(EQ, a, b), *up[:2])
    assert_bf16_close(out, want)
    for g, h in zip(vjp(ct), want_vjp(up[2]), strict=True):
        assert_bf16_close(g, h)
    scores = matmul.einsum(EQ, a, b, out_dtype=F32)
    assert scores.dtype == F32
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-6)


def test_bf16_ragged_dot_value_and_vjp(cpu_class):
    x, w, ct, sizes = ragged_operands(BF16)
    out, vjp = jax.vjp(lambda x, w: matmul.ragged_dot(x, w, sizes), x, w)
    up = [t.astype(F32) for t in (x, w, ct)]
    want, want_vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), *up[:2])
    assert_bf16_close(out, want)
    for g, h in zip(vjp(ct), want_vjp(up[2]), strict=True):
        assert_bf16_close(g, h)


CLASS_DOT = {"bf16": ("bf16", "bf16", "f32"), "f32": ("f32", "f32", "f32")}
"""The dot each CPU class runs a bf16 matmul as: (lhs, rhs, result) element types."""


def grad_of_square(matmul_fn):
    return jax.grad(lambda a, b: jnp.sum(matmul_fn(a, b).astype(F32) ** 2), (0, 1))


def test_bf16_gradient_dots_take_the_cpu_class_path(cpu_class):
    """The value's and the custom VJP's three dots are bf16 x bf16 -> f32 on a CPU with bf16
    instructions, f32 x f32 -> f32 (the operands upcast) on one without: one path, no other."""
    a, b, _ = operands(BF16)
    grad = grad_of_square(lambda a, b: matmul.einsum(EQ, a, b))
    dots = count_dots(compiled_hlo(grad, a, b))
    assert dots == {CLASS_DOT[cpu_class]: 3}, dots


def test_autodiffs_own_transpose_leaves_the_bf16_path(monkeypatch):
    """JAX's own transpose of the forward (``preferred_element_type=f32``, then a cast) hands
    its dots an f32 cotangent: on CPU they run f32 x f32 (measured: the two transposes,
    f32 x f32 -> f32), which is what the custom VJP is for."""
    monkeypatch.setenv(matmul.CPU_MATMUL_ENV, "bf16")
    a, b, _ = operands(BF16)

    def plain(a, b):
        return jnp.einsum(EQ, a, b, preferred_element_type=F32).astype(BF16)

    dots = count_dots(compiled_hlo(grad_of_square(plain), a, b))
    assert dots.get(CLASS_DOT["bf16"], 0) < 3, dots


def test_einsum_refuses_a_dimension_summed_alone():
    a, b, _ = operands(BF16)
    with pytest.raises(ValueError, match=r"sums \['l'\] alone"):
        matmul.einsum("blm,mqd->bqd", a, b)


def test_operands_of_different_vma_in_shard_map():
    """x varies over d, w is replicated: w's gradient sums the d shards' (JAX's transpose of
    the implicit pvary), the gradient of the whole batch's matmul, to bf16 rounding (measured: within 0.094 of
    entries up to 25, a bf16 ulp there is 0.125)."""
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    x = jax.random.normal(jax.random.key(2), (8, 16), F32).astype(BF16)
    w = jax.random.normal(jax.random.key(3), (16, 4), F32).astype(BF16)

    def square(x, w):
        y = matmul.einsum("tm,mf->tf", x, w).astype(F32)
        return jnp.sum(y * y)

    def sharded(x, w):
        body = lambda x, w: jax.lax.psum(square(x, w), "d")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())(x, w)

    got = jax.grad(sharded, 1)(x, w)
    want = jax.grad(square, 1)(x, w)
    # Each shard's bf16 partial gradient is rounded before the sum: errors of a bf16 ulp of
    # the partials' size, not of the (smaller, after cancellation) entry's.
    want = np.asarray(want, F32)
    np.testing.assert_allclose(np.asarray(got, F32), want, atol=2**-7 * np.abs(want).max())


def test_f32_sums_are_asked_for_on_cpu_for_one_low_precision_dtype(cpu_class):
    """CPU, either class: bf16 summed in f32 (2.4x its bf16-output rate here); GPU: JAX's
    default, the bf16 output measured as fast (docs/benchmarks.md); mixed operands: JAX's
    promotion."""
    a = jnp.ones(2, BF16)
    assert matmul.accumulation(a, a, platform="cpu") == F32
    assert matmul.accumulation(a, a, platform="gpu") is None
    assert matmul.accumulation(a, a.astype(F32), platform="cpu") is None
    assert matmul.accumulation(a.astype(F32), a.astype(F32), platform="cpu") is None


@pytest.mark.parametrize(
    ("flags", "cpu_class", "operands"),
    [
        (XEON_AMX, "bf16", BF16),
        (ZEN4, "bf16", BF16),
        (AVX2_ONLY, "f32", F32),
        (None, "bf16", BF16),  # no /proc/cpuinfo flags line (macOS, ARM): as before
    ],
    ids=["xeon-amx", "zen4-avx512_bf16", "avx2-only", "unreadable"],
)
def test_each_cpu_class_by_its_flags(monkeypatch, flags, cpu_class, operands):
    """AMX or avx512_bf16: bf16 products summed in f32 (1,176 / 376 GFLOP/s against f32's
    264 / 209); neither: the operands upcast to f32 (f32 99.1 against 68.5 summed in f32)."""
    flags = None if flags is None else frozenset(flags.split())
    assert matmul.cpu_matmul(flags) == cpu_class
    monkeypatch.delenv(matmul.CPU_MATMUL_ENV, raising=False)
    monkeypatch.setattr(matmul, "cpu_flags", lambda: flags)
    assert matmul.matmul_target("cpu") == f"cpu/{cpu_class}"
    a = jnp.ones(2, BF16)
    assert matmul.matmul_path(a, a, platform="cpu") == (jnp.dtype(operands), jnp.dtype(F32))


def test_the_cpu_class_override_wins_over_the_flags_and_refuses_other_names(monkeypatch):
    monkeypatch.setattr(matmul, "cpu_flags", lambda: frozenset(XEON_AMX.split()))
    monkeypatch.setenv(matmul.CPU_MATMUL_ENV, "f32")
    assert matmul.matmul_target("cpu") == "cpu/f32"
    assert matmul.matmul_target("gpu") == "gpu"  # CPUs only
    monkeypatch.setenv(matmul.CPU_MATMUL_ENV, "avx2")
    with pytest.raises(ValueError, match=r"SEQSHARD_CPU_MATMUL='avx2'.*\['bf16', 'f32'\]"):
        matmul.einsum(EQ, *operands(BF16)[:2])


def test_this_machines_flags_are_read():
    """Linux x86 (this project's hosts): a flags line with the vector extensions in it."""
    flags = matmul.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags line here (macOS, ARM)")
    assert "sse2" in flags
