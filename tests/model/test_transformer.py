"""Tests of seqshard/model/transformer.py: the sharded decoder against its single-device
reference. (The weights' layouts and init: test_weights.py.)

    values       loss, logits and gradients equal reference_loss_fn / reference_logits_fn and
                 the reference's gradient on d x t meshes 1x1, 8x1, 4x2, 2x4, 1x8 (f32 tight,
                 bf16 loose), for inputs given as numpy or already sharded
    attention    attention_impl='xla' equals 'einsum' for both masks; 'causal' equals the
                 reference's causal mask
    causality    no logit depends on a later token or on another packed document
    HLO audit    the compiled loss-and-gradient holds exactly the collectives transformer.py
                 writes, derived below from a table of its shardops calls (see COMM TABLE)
    errors       configs a mesh cannot split fail before compiling, naming field, value, axis

Everything is jitted once per (config, mesh) and shared between tests through cached helpers.
The model config has n_kv > 1, n_q_per_kv > 1, and n_kv, d_ff, vocab divisible by t = 8 and
d_model by d * t = 8, so every mesh of 8 devices splits it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from model_weights import assert_trees_close, random_weights, tiny_model, to_numpy
from model_weights import packed_batch as shared_packed_batch

from seqshard.config import ConfigError, load_config
from seqshard.model import (
    ModelConfig,
    Weights,
    init_weights,
    logits_fn,
    loss_fn,
    reference_logits_fn,
    reference_loss_fn,
    weight_structs,
)
from seqshard.model.attention import resolve_impl
from seqshard.model.config import RESIDUAL_SPECS
from seqshard.shardlib import collective_log
from seqshard.testing import count_collectives, fake_cpu_mesh, list_collectives

CFG = tiny_model()

MESHES = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]
BATCH, LENGTH = 8, 16

# f32: the sharded model sums in a different order than the reference (psum_scatter over t,
# the loss split over vocab blocks); measured differences: 1e-6 on the loss (4.87), 4.4e-6 on
# logits (|logit| < 5.7), 2.4e-7 on gradients (entries up to 0.19).
F32_LOSS = dict(rtol=1e-6, atol=0)
F32_LOGITS = dict(rtol=1e-5, atol=1e-5)
F32_GRADS = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Shared, jitted once


@functools.cache
def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return fake_cpu_mesh(shape, ("d", "t"))


def packed_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return shared_packed_batch(CFG.vocab, BATCH, LENGTH, seed)


TOKENS, IS_SEQ_START = packed_batch(0)


WEIGHTS = random_weights(CFG, seed=0)  # for CFG and its variants (same shapes)


def on_mesh(weights: Weights, cfg: ModelConfig, mesh) -> Weights:
    """``weights`` placed in the layouts their types declare on ``mesh``."""
    shardings = jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh))
    return jax.device_put(weights, shardings)


@functools.cache
def sharded_fn(cfg: ModelConfig, shape: tuple[int, int]):
    """jit of (w, tokens, is_seq_start) -> ((loss, grads), logits) of the sharded model."""
    mesh = mesh_of(shape)

    def f(w, tokens, is_seq_start):
        loss_and_grads = jax.value_and_grad(loss_fn)(w, tokens, is_seq_start, cfg, mesh)
        return loss_and_grads, logits_fn(w, tokens, is_seq_start, cfg, mesh)

    return jax.jit(f)


def _reference(w, tokens, is_seq_start, cfg):
    loss_and_grads = jax.value_and_grad(reference_loss_fn)(w, tokens, is_seq_start, cfg)
    return loss_and_grads, reference_logits_fn(w, tokens, is_seq_start, cfg)


reference_fn = jax.jit(_reference, static_argnums=3)


@functools.cache
def sharded_outputs(cfg: ModelConfig, shape: tuple[int, int]):
    """((loss, grads), logits) as numpy for the module's batch, on a d x t mesh."""
    w = on_mesh(WEIGHTS, cfg, mesh_of(shape))
    return to_numpy(sharded_fn(cfg, shape)(w, TOKENS, IS_SEQ_START))


@functools.cache
def reference_outputs(cfg: ModelConfig):
    return to_numpy(reference_fn(WEIGHTS, TOKENS, IS_SEQ_START, cfg))


def assert_matches_reference(got, want, loss_tol, logits_tol, grads_tol) -> None:
    (loss, grads), logits = got
    (ref_loss, ref_grads), ref_logits = want
    np.testing.assert_allclose(loss, ref_loss, **loss_tol)
    np.testing.assert_allclose(logits, ref_logits, **logits_tol)
    assert_trees_close(grads, ref_grads, **grads_tol)


# ---------------------------------------------------------------------------------------------
# Values: sharded == reference


def test_batch_has_packed_documents():
    starts_per_row = IS_SEQ_START.sum(axis=1)
    assert starts_per_row.min() >= 2, "every row should pack several documents"
    assert not IS_SEQ_START[0, 0], "row 0 should begin mid-document"


@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{t}" for d, t in MESHES])
def test_sharded_equals_reference_f32(shape):
    assert_matches_reference(
        sharded_outputs(CFG, shape), reference_outputs(CFG), F32_LOSS, F32_LOGITS, F32_GRADS
    )


SEQUENCE_PARALLEL = [(8, 1), (4, 2), (2, 4), (1, 8)]


@pytest.mark.parametrize(
    "shape,backward",
    [
        pytest.param(
            shape,
            backward,
            id=f"{backward}-{shape[0]}x{shape[1]}",
            # autodiff's transposes on one mesh by default; every mesh with -m slow
            marks=[pytest.mark.slow] if backward == "autodiff" and shape != (4, 2) else [],
        )
        for backward in ("explicit", "autodiff")
        for shape in SEQUENCE_PARALLEL
    ],
)
def test_sequence_parallel_residual_equals_reference(shape, backward):
    """model.residual=L/t: the residual 'B/dp L/t M' between blocks (Megatron's sequence
    parallelism), gathered over t along L before each norm. The same model: the same loss,
    logits and gradients as the reference, to the same f32 tolerances."""
    cfg = dataclasses.replace(CFG, residual="L/t", backward=backward)
    assert_matches_reference(
        sharded_outputs(cfg, shape), reference_outputs(CFG), F32_LOSS, F32_LOGITS, F32_GRADS
    )


@pytest.mark.slow  # bf16 runs by default in tests/train/test_step.py and tests/model/test_moe.py
def test_sharded_equals_reference_bf16():
    """bf16 matmul inputs round differently in the two programs (the sharded one sums
    psum_scatter partials and vocab blocks in its own order, in bf16 where the activations are
    bf16), so they agree only to bf16 rounding. Measured on mesh 2x4 over 5 seeds of weights and
    batch (loss ~4.8, |logit| < 5.7): loss within 1.5e-3, logits within 0.075, gradients within
    3.1% of each leaf's largest entry. The tolerances are about 3x those."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    (loss, grads), logits = sharded_outputs(cfg, (2, 4))
    (ref_loss, ref_grads), ref_logits = reference_outputs(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=5e-3)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=0.2)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        if not r.size:  # q_norm, k_norm without model.qk_norm
            continue
        scale = np.max(np.abs(r))
        assert np.max(np.abs(g - r)) <= 0.1 * scale, jax.tree_util.keystr(path)
    # and bf16 is really in use: the f32 logits differ from these by more than f32 rounding
    # (measured: 0.05 to 0.08)
    assert np.max(np.abs(reference_outputs(CFG)[1] - ref_logits)) > 1e-2


@pytest.fixture(scope="module")
def loss_2x4():
    mesh = mesh_of((2, 4))
    return jax.jit(lambda w, tokens, is_seq_start: loss_fn(w, tokens, is_seq_start, CFG, mesh))


@pytest.mark.parametrize("inputs", ["numpy", "sharded as B/dp", "sharded over t"])
def test_loss_takes_inputs_in_any_sharding(loss_2x4, inputs):
    """Global arrays in any layout: numpy (weights too), or already on the mesh."""
    mesh = mesh_of((2, 4))
    w, tokens, starts = WEIGHTS, TOKENS, IS_SEQ_START
    if inputs != "numpy":
        w = on_mesh(w, CFG, mesh)
        spec = P("d", None) if inputs == "sharded as B/dp" else P(None, "t")
        tokens, starts = jax.device_put((tokens, starts), NamedSharding(mesh, spec))
        assert tokens.sharding.spec == spec
    loss = loss_2x4(w, tokens, starts)
    np.testing.assert_allclose(loss, reference_outputs(CFG)[0][0], **F32_LOSS)


# ---------------------------------------------------------------------------------------------
# Attention implementations and masks


def test_auto_attention_is_einsum_on_cpu():
    assert resolve_impl("auto") == "einsum"
    assert resolve_impl("xla") == "xla"


@pytest.mark.parametrize("mask", ["document", pytest.param("causal", marks=pytest.mark.slow)])
def test_xla_attention_equals_einsum(mask):
    einsum = dataclasses.replace(CFG, attention_mask=mask)
    xla = dataclasses.replace(einsum, attention_impl="xla")
    # measured: loss within 5e-7, logits within 2.5e-6, gradients within 1.2e-7
    assert_matches_reference(
        sharded_outputs(xla, (2, 4)),
        sharded_outputs(einsum, (2, 4)),
        F32_LOSS,
        F32_LOGITS,
        F32_GRADS,
    )


def test_causal_mask_equals_reference_causal_mask():
    cfg = dataclasses.replace(CFG, attention_mask="causal")
    assert_matches_reference(
        sharded_outputs(cfg, (2, 4)), reference_outputs(cfg), F32_LOSS, F32_LOGITS, F32_GRADS
    )
    # The batch packs documents, so ignoring their boundaries must change the logits.
    assert np.max(np.abs(sharded_outputs(cfg, (2, 4))[1] - sharded_outputs(CFG, (2, 4))[1])) > 0.1


# ---------------------------------------------------------------------------------------------
# Causality and document isolation
#
# One base row of three documents, [0, 5), [5, 11), [11, 16); rows 1-6 change one token each;
# row 7 holds the middle document alone at the start of the row, then another document.

DOCS = [(0, 5), (5, 11), (11, 16)]
PERTURBED = [2, 5, 7, 10, 11, 14]  # first, middle and last tokens of documents


def causality_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    base = rng.integers(0, CFG.vocab, LENGTH).astype(np.int32)
    base_starts = np.zeros(LENGTH, bool)
    base_starts[[s for s, _ in DOCS]] = True
    tokens, starts = np.tile(base, (BATCH, 1)), np.tile(base_starts, (BATCH, 1))
    for row, j in enumerate(PERTURBED, start=1):
        tokens[row, j] = (base[j] + 1 + row) % CFG.vocab
    s, e = DOCS[1]
    tokens[7] = np.concatenate([base[s:e], rng.integers(0, CFG.vocab, LENGTH - (e - s))])
    starts[7] = False
    starts[7, [0, e - s]] = True
    return tokens, starts


def _doc_of(j: int) -> tuple[int, int]:
    return next((s, e) for s, e in DOCS if s <= j < e)


@pytest.mark.parametrize("impl", ["einsum", "xla"])
def test_logits_are_causal_and_documents_isolated(impl):
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    w = on_mesh(WEIGHTS, cfg, mesh_of((2, 4)))
    logits = np.asarray(sharded_fn(cfg, (2, 4))(w, *causality_batch())[1])
    base = logits[0]
    for row, j in enumerate(PERTURBED, start=1):
        s, e = _doc_of(j)
        # exactly equal: a masked key's probability is exactly 0, so its value adds exactly 0
        np.testing.assert_array_equal(logits[row, :j], base[:j], err_msg=f"position < {j}")
        np.testing.assert_array_equal(logits[row, e:], base[e:], err_msg=f"after doc {s}:{e}")
        # ...while the perturbed position itself does see the change (the test can fail)
        assert np.max(np.abs(logits[row, j] - base[j])) > 1e-3
    # Positions restart per document: a document packed after another has the logits it has
    # alone at the start of a row (sums over differently placed keys round differently).
    s, e = DOCS[1]
    np.testing.assert_allclose(logits[7, : e - s], base[s:e], rtol=1e-5, atol=1e-5)


def test_causal_mask_leaks_across_documents():
    """attention_mask='causal' trades document isolation for speed: later documents see earlier."""
    cfg = dataclasses.replace(CFG, attention_mask="causal")
    w = on_mesh(WEIGHTS, cfg, mesh_of((2, 4)))
    logits = np.asarray(sharded_fn(cfg, (2, 4))(w, *causality_batch())[1])
    row, j = 1, PERTURBED[0]  # a change in the first document...
    np.testing.assert_array_equal(logits[row, :j], logits[0, :j])  # ...still causal
    assert np.max(np.abs(logits[row, DOCS[1][0] :] - logits[0, DOCS[1][0] :])) > 1e-3


# ---------------------------------------------------------------------------------------------
# COMM TABLE: the collectives of value_and_grad(loss_fn), derived from transformer.py
#
# Each shardops collective that transformer.py writes, where it is written. In the compiled
# program each becomes one collective in its forward pass; autodiff adds its transpose in the
# backward pass (all_gather <-> psum_scatter; psum and pmax add nothing: psum's transpose is a
# broadcast, and pmax is taken of a stop-gradiented value); remat adds a second copy of the
# layer-body collectives it recomputes. The layer body is a rolled lax.scan, so it appears
# once in the HLO whatever n_layers is. For remat='saved' on mesh 2x4 (f32):
#
#     where            pass        all-gather                    reduce-scatter   all-reduce
#     outside scan     forward     4 (embed, final_norm,         1 (embedding)    3 (pmax,
#                                     residual, unembed)                            2 psums)
#     outside scan     backward    1 (embedding transpose)       4 (gathers')     0
#     layer body       forward     10 (ln1, x, w_q, w_kv, w_o,   2 (attention,    0
#                                     ln2, h, w_gate, w_up,          FFN outputs)
#                                     w_down)
#     layer body       backward    2 (psum_scatters')            10 (gathers')    0
#     layer body       recompute   10 (saved, full; none: 0)     1 (full only)    0
#
#     totals           saved: AG 27, RS 17, AR 3   full: AG 27, RS 18, AR 3   none: AG 17, RS 17, AR 3


@dataclasses.dataclass(frozen=True)
class Comm:
    """One shardops collective call in transformer.py."""

    what: str  # the value it moves
    op: str  # the shardops function
    spec: str  # its spec, as written
    axes: tuple[str, ...]  # the mesh axes it runs over, major to minor
    recomputed_under: frozenset[str] = frozenset()  # remat policies that recompute it


GATHERED_AGAIN = frozenset({"saved", "full"})  # save_for_backward marks no gathered value

OUTSIDE_SCAN = (  # in the order the forward pass runs them: embed, final norm, unembed, loss
    Comm("embed", "all_gather", "V/t M/fsdp -> V/t M", ("d",)),
    Comm(
        "embeddings (partial: vocab blocks)",
        "psum_scatter",
        "B/dp L@zigzag/c M -> B/dp L@zigzag/c M/t",
        ("t",),
    ),
    Comm("final_norm", "all_gather", "M/t/fsdp -> M", ("t", "d")),
    Comm(
        "residual, before the final norm",
        "all_gather",
        "B/dp L@zigzag/c M/t -> B/dp L@zigzag/c M",
        ("t",),
    ),
    Comm("unembed", "all_gather", "V/t M/fsdp -> V/t M", ("d",)),
    Comm("logsumexp shift", "pmax", "B/dp L@zigzag/c{U_t} -> B/dp L@zigzag/c", ("t",)),
    Comm("(sum_exp, target_logit)", "psum", "2 B/dp L@zigzag/c{U_t} -> 2 B/dp L@zigzag/c", ("t",)),
    Comm("(loss_sum, count)", "psum", "2{U_dp,c} -> 2", ("d",)),
)
LAYER_BODY = (  # the scanned layer body, in order
    Comm("ln1", "all_gather", "M/t/fsdp -> M", ("t", "d"), GATHERED_AGAIN),
    Comm("x", "all_gather", "B/dp L@zigzag/c M/t -> B/dp L@zigzag/c M", ("t",), GATHERED_AGAIN),
    Comm("w_q", "all_gather", "M/fsdp Q K/t D -> M Q K/t D", ("d",), GATHERED_AGAIN),
    Comm("w_kv", "all_gather", "2 M/fsdp K/t D -> 2 M K/t D", ("d",), GATHERED_AGAIN),
    Comm("w_o", "all_gather", "M/fsdp Q K/t Dv -> M Q K/t Dv", ("d",), GATHERED_AGAIN),
    # 'saved' keeps h = x + out, so only 'full' recomputes this sum to rebuild h.
    Comm(
        "attention output",
        "psum_scatter",
        "B/dp L@zigzag/c M -> B/dp L@zigzag/c M/t",
        ("t",),
        frozenset({"full"}),
    ),
    Comm("ln2", "all_gather", "M/t/fsdp -> M", ("t", "d"), GATHERED_AGAIN),
    Comm("h", "all_gather", "B/dp L@zigzag/c M/t -> B/dp L@zigzag/c M", ("t",), GATHERED_AGAIN),
    Comm("w_gate", "all_gather", "M/fsdp F/t -> M F/t", ("d",), GATHERED_AGAIN),
    Comm("w_up", "all_gather", "M/fsdp F/t -> M F/t", ("d",), GATHERED_AGAIN),
    Comm("w_down", "all_gather", "M/fsdp F/t -> M F/t", ("d",), GATHERED_AGAIN),
    # Its result only leaves the layer; no policy's backward pass needs it again.
    Comm("FFN output", "psum_scatter", "B/dp L@zigzag/c M -> B/dp L@zigzag/c M/t", ("t",)),
)
HLO_KIND = {
    "all_gather": "all-gather",
    "psum_scatter": "reduce-scatter",
    "psum": "all-reduce",
    "pmax": "all-reduce",
}
TRANSPOSE_KIND = {"all_gather": "reduce-scatter", "psum_scatter": "all-gather"}
DOCUMENTED_TOTALS = {  # the docstring table's last line, held to the compiled program below
    "saved": {"all-gather": 27, "reduce-scatter": 17, "all-reduce": 3},
    "full": {"all-gather": 27, "reduce-scatter": 18, "all-reduce": 3},
    "none": {"all-gather": 17, "reduce-scatter": 17, "all-reduce": 3},
}


def expected_collectives(remat: str) -> collections.Counter:
    """(kind, phase, in the layer body, axes) -> count, from the tables above."""
    out = collections.Counter()
    for in_loop, comms in ((False, OUTSIDE_SCAN), (True, LAYER_BODY)):
        for c in comms:
            out[HLO_KIND[c.op], "forward", in_loop, c.axes] += 1
            if c.op in TRANSPOSE_KIND:
                out[TRANSPOSE_KIND[c.op], "backward", in_loop, c.axes] += 1
            if remat in c.recomputed_under:
                out[HLO_KIND[c.op], "recompute", in_loop, c.axes] += 1
    return out


def totals(counter: collections.Counter) -> dict[str, int]:
    by_kind = collections.Counter()
    for (kind, *_), n in counter.items():
        by_kind[kind] += n
    return {k: by_kind[k] for k in ("all-gather", "reduce-scatter", "all-reduce")}


def _for_residual(comms: tuple[Comm, ...], residual: str) -> list[tuple[str, str]]:
    """(op, spec) of each call, the tables' 'B/dp L@zigzag/c M/t' read as ``residual``'s layout."""
    layout = RESIDUAL_SPECS[residual]
    return [(c.op, c.spec.replace("B/dp L@zigzag/c M/t", layout)) for c in comms]


@pytest.mark.parametrize("residual", ["M/t", "L/t"])
def test_comm_table_lists_the_shardops_calls_of_transformer_py(residual):
    """The collectives transformer.py's forward pass writes, as shardops log them while it
    is traced (seqshard.shardlib.collective_log), in order, inside the scanned layer body or not."""
    cfg = dataclasses.replace(
        CFG, n_layers=3, rope_theta=12345.0, backward="autodiff", residual=residual
    )
    mesh = mesh_of((2, 4))
    log = collective_log.traced(
        lambda w, tok, start: loss_fn(w, tok, start, cfg, mesh),
        weight_structs(cfg, mesh),
        jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32),
        jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.bool_),
    )
    in_layer = [(c.op, c.spec) for c in log.calls if c.in_loop("layers")]
    outside = [(c.op, c.spec) for c in log.calls if not c.in_loop("layers")]
    assert in_layer == _for_residual(LAYER_BODY, residual)
    assert outside == _for_residual(OUTSIDE_SCAN, residual)
    assert {c.loops for c in log.calls if c.in_loop("layers")} == {(("layers", 3),)}


@functools.cache
def loss_and_grad_2x4(remat: str, n_layers: int):
    """The jitted value_and_grad of loss_fn on mesh 2x4, and abstract arguments for it."""
    cfg = dataclasses.replace(CFG, remat=remat, n_layers=n_layers)
    mesh = mesh_of((2, 4))
    fn = jax.jit(jax.value_and_grad(lambda w, tok, start: loss_fn(w, tok, start, cfg, mesh)))
    args = (
        weight_structs(cfg, mesh),
        jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32),
        jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.bool_),
    )
    return fn, args, mesh


@pytest.mark.parametrize(
    "remat, n_layers",
    [
        *((r, 2) for r in ("saved", "full", "none")),
        ("saved", 4),
        *(pytest.param(r, 4, marks=pytest.mark.slow) for r in ("full", "none")),
    ],
    ids=lambda v: str(v),
)
def test_compiled_collectives_are_the_ones_the_code_writes(remat, n_layers):
    """A 1-layer scan may be unrolled away, hence 2 and 4 layers; the counts are the same
    (4 layers with each remat policy under -m slow)."""
    fn, args, mesh = loss_and_grad_2x4(remat, n_layers)
    expected = expected_collectives(remat)
    counts = count_collectives(fn, *args)
    compiled = {k: counts[k] for k in ("all-gather", "reduce-scatter", "all-reduce")}
    assert compiled == totals(expected) == DOCUMENTED_TOTALS[remat]
    assert counts["all-to-all"] == counts["collective-permute"] == 0
    found = list_collectives(fn, *args, mesh=mesh)
    got = collections.Counter((c.kind, c.phase, c.in_loop, c.axes) for c in found)
    assert got == expected
    # The layer body runs once per layer; everything else once per step.
    assert {(c.in_loop, c.calls_per_step) for c in found} == {(False, 1), (True, n_layers)}


# ---------------------------------------------------------------------------------------------
# Errors for what a mesh cannot split: before anything compiles, naming field, value, axis

BAD_FOR_4x2 = [  # (field, value, the mesh axes that must divide it, their size) on d=4 x t=2
    ("n_kv", 3, "t", 2),
    ("d_ff", 65, "t", 2),
    ("vocab", 65, "t", 2),
    ("d_model", 36, "t*d*e*c", 8),  # norm gains are d_model/t/fsdp
]


def _only_traced(fn, *args):
    """Run ``fn`` under jax.eval_shape: it traces, so an error comes before any compilation."""
    return jax.eval_shape(fn, *args)


@pytest.mark.parametrize("field, value, axis, size", BAD_FOR_4x2)
def test_model_the_mesh_cannot_split_is_rejected(field, value, axis, size):
    cfg = dataclasses.replace(CFG, **{field: value})
    mesh = mesh_of((4, 2))
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    starts = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.bool_)
    for call in (
        lambda: _only_traced(
            functools.partial(loss_fn, cfg=cfg, mesh=mesh), weight_structs(cfg), tokens, starts
        ),
        lambda: init_weights(cfg, mesh, jax.random.key(0)),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert f"model.{field}={value}" in message
        assert f"mesh axis {axis}" in message and f"= {size}" in message
        assert "d=4 x c=1 x t=2" in message


def test_batch_the_mesh_cannot_split_is_rejected():
    mesh = mesh_of((4, 2))
    with pytest.raises(ValueError) as info:
        _only_traced(
            functools.partial(loss_fn, cfg=CFG, mesh=mesh),
            weight_structs(CFG, mesh),
            jax.ShapeDtypeStruct((6, LENGTH), jnp.int32),
            jax.ShapeDtypeStruct((6, LENGTH), jnp.bool_),
        )
    message = str(info.value)
    assert "'batch'.tokens" in message and "size 6" in message and "d=4" in message


# d=4 x t=2 for every case; data.vocab_size fits every model.vocab so only the named check fails.
BASE_OVERRIDES = ["mesh.d=4", "mesh.t=2", "data.vocab_size=64"]


@pytest.mark.parametrize("field, value, axis, size", BAD_FOR_4x2)
def test_load_config_rejects_a_model_the_mesh_cannot_split(field, value, axis, size):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE_OVERRIDES, f"model.{field}={value}"])
    message = str(info.value)
    assert f"model.{field}={value}" in message
    assert f"mesh axis {axis}" in message and f"= {size}" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "overrides, needed",
    [
        (["train.batch_size=6"], "4"),  # 6 rows over d=4
        (["train.batch_size=8", "train.microbatches=4"], "16"),  # 2-row microbatches over d=4
    ],
)
def test_load_config_rejects_a_batch_the_mesh_cannot_split(overrides, needed):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE_OVERRIDES, *overrides])
    message = str(info.value)
    batch = overrides[0].split("=")[1]
    assert "train.batch_size" in message and batch in message and "d=4" in message
    assert f"= {needed}" in message  # the multiple to choose


def test_load_config_accepts_a_config_the_mesh_splits():
    cfg = load_config(None, [*BASE_OVERRIDES, "train.batch_size=16", "train.microbatches=2"])
    assert (cfg.mesh.d, cfg.mesh.t, cfg.train.batch_size) == (4, 2, 16)
