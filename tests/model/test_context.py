"""Tests of the sequence split over the context axis c (seqshard/model/context.py and the model
in the 'B/d/e L@zigzag/c' layout).

    values       loss, logits and gradients equal the single-device reference on meshes
                 (d, c, t) = (1, 8, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), for model.context_impl
                 allgather and ring, model.residual M/t and L/t, document and causal masks,
                 both backward passes; packed documents whose boundaries fall on and across
                 the shards' chunk boundaries (f32; the default run takes 4 of the 32 mesh x
                 impl x residual x mask cases, covering each value of each, -m slow the rest)
    causality    perturbing token j changes no logit before j nor in another document, on
                 every shard (zigzag chunks) and for both impls
    HLO audit    allgather: two all-gathers over c per layer forward (k, v) and their
                 reduce-scatters backward; ring: collective-permutes only (c - 1 per layer
                 forward for each of k, v; backward c - 1 for k, v and c for dk, dv), no
                 all-gather over c of an activation; the compiled counts equal those predicted
                 from the notation and do not grow with the layer count
    memory       compiled temporary bytes per device at sequence 8192 fall about as 1/c
    resume       a run checkpointed on c=2 continues on c=1 and on c=4 with the losses of an
                 uninterrupted run
"""

from __future__ import annotations

import dataclasses
import functools
import shutil

import jax
import numpy as np
import pytest
from model_weights import random_weights, tiny_model
from run_helpers import FLAT, by_step, run

from seqshard.batch import batch_structs
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.mesh import mesh_of_sizes
from seqshard.model import (
    ModelConfig,
    logits_fn,
    loss_fn,
    reference_logits_fn,
    reference_loss_fn,
    weight_structs,
)
from seqshard.plan.step_comms import collectives_per_step
from seqshard.shardlib.comms import collectives
from seqshard.testing import compiled_hlo
from seqshard.train.step import grads_and_loss

CFG = tiny_model(n_kv=4)
BATCH, LENGTH = 4, 32

# Documents: row 0 begins mid-document; starts on chunk boundaries of every c (16, and 8 and 24
# for c >= 2) and across them (5, 13, 27), so documents span shards in the zigzag layout.
STARTS = np.zeros((BATCH, LENGTH), bool)
for row, starts in enumerate([(5, 16, 27), (0, 8, 13, 24), (0, 3, 19), (0,)]):
    STARTS[row, list(starts)] = True
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab, (BATCH, LENGTH)).astype(np.int32)
WEIGHTS = random_weights(CFG, seed=0)

# As tests/model/test_transformer.py's f32 tolerances: the sharded model sums in another order.
F32_LOSS = dict(rtol=1e-6, atol=0)
F32_LOGITS = dict(rtol=1e-5, atol=1e-5)
F32_GRADS = dict(rtol=1e-5, atol=1e-6)

MESHES = [(1, 8, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2)]


def mesh_of(shape: tuple[int, int, int]):
    return mesh_of_sizes(dict(zip("dct", shape, strict=True)))


@functools.cache
def sharded_outputs(cfg: ModelConfig, shape: tuple[int, int, int]):
    mesh = mesh_of(shape)
    shardings = jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh))
    w = jax.device_put(WEIGHTS, shardings)

    @jax.jit
    def f(w, tokens, starts):
        loss_and_grads = jax.value_and_grad(loss_fn)(w, tokens, starts, cfg, mesh)
        return loss_and_grads, logits_fn(w, tokens, starts, cfg, mesh)

    return jax.tree.map(np.asarray, f(w, TOKENS, STARTS))


@functools.cache
def reference_outputs(mask: str):
    cfg = dataclasses.replace(CFG, attention_mask=mask)

    def f(w, tokens, starts):
        loss_and_grads = jax.value_and_grad(reference_loss_fn)(w, tokens, starts, cfg)
        return loss_and_grads, reference_logits_fn(w, tokens, starts, cfg)

    return jax.tree.map(np.asarray, jax.jit(f)(WEIGHTS, TOKENS, STARTS))


def assert_matches_reference(got, want) -> None:
    (loss, grads), logits = got
    (ref_loss, ref_grads), ref_logits = want
    np.testing.assert_allclose(loss, ref_loss, **F32_LOSS)
    np.testing.assert_allclose(logits, ref_logits, **F32_LOGITS)
    paths = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, r), g in zip(paths, jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g, r, err_msg=jax.tree_util.keystr(path), **F32_GRADS)


ALL_CASES = [
    (shape, impl, residual, mask)
    for shape in MESHES
    for impl in ("allgather", "ring")
    for residual in ("L/t", "M/t")
    for mask in ("document", "causal")
]
DEFAULT_CASES = [  # every impl, residual and mask at least once; the rest under -m slow
    ((2, 2, 2), "allgather", "M/t", "causal"),
    ((4, 2, 1), "ring", "M/t", "causal"),
    ((1, 4, 2), "allgather", "L/t", "document"),
]
CASES = [
    pytest.param(*case, marks=() if case in DEFAULT_CASES else pytest.mark.slow)
    for case in ALL_CASES
]


def _id(case) -> str:
    shape, impl, residual, mask = case
    return f"{'x'.join(map(str, shape))}-{impl}-{residual}-{mask}"


@pytest.mark.parametrize(("shape", "impl", "residual", "mask"), CASES, ids=map(_id, ALL_CASES))
def test_split_sequence_equals_reference(shape, impl, residual, mask):
    """Loss, logits and gradients on a (d, c, t) mesh == the reference, f32 (measured: loss
    within 5e-7 of 4.2, logits within 2e-6, gradients within 1e-6 of entries up to 0.2)."""
    cfg = dataclasses.replace(CFG, context_impl=impl, residual=residual, attention_mask=mask)
    assert_matches_reference(sharded_outputs(cfg, shape), reference_outputs(mask))


@pytest.mark.parametrize("impl", ["allgather", pytest.param("ring", marks=pytest.mark.slow)])
def test_autodiff_backward_equals_reference(impl):
    """model.backward=autodiff: JAX differentiates the forward (the ring through its custom
    VJP, the all-gathers by transposing them)."""
    cfg = dataclasses.replace(CFG, context_impl=impl, backward="autodiff")
    assert_matches_reference(sharded_outputs(cfg, (2, 2, 2)), reference_outputs("document"))


@pytest.mark.parametrize("impl", ["allgather", "ring"])
def test_no_logit_sees_a_later_token_or_another_document(impl):
    """Perturb one token in the middle of a document that spans shards: logits before it and
    in other documents stay exactly as they were; later ones in its document change."""
    cfg = dataclasses.replace(CFG, context_impl=impl)
    j = 10  # row 1's document [8, 13): on shard 1 of c = 4 in natural order
    changed = TOKENS.copy()
    changed[1, j] = (changed[1, j] + 1) % CFG.vocab
    shape = (1, 4, 2)
    before, after = _logits(cfg, shape, TOKENS), _logits(cfg, shape, changed)
    np.testing.assert_array_equal(after[1, :j], before[1, :j])
    np.testing.assert_array_equal(after[1, 13:], before[1, 13:])  # the next documents
    np.testing.assert_array_equal(after[[0, 2, 3]], before[[0, 2, 3]])  # other rows
    assert np.abs(after[1, j:13] - before[1, j:13]).max() > 1e-3


def _logits(cfg, shape, tokens):
    mesh = mesh_of(shape)
    shardings = jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh))
    w = jax.device_put(WEIGHTS, shardings)
    return np.asarray(jax.jit(lambda w, t, s: logits_fn(w, t, s, cfg, mesh))(w, tokens, STARTS))


# ---------------------------------------------------------------------------------------------
# HLO audit


def _config(impl: str, n_layers: int = 2, c: int = 4, backward: str = "explicit") -> Config:
    model = dataclasses.replace(CFG, context_impl=impl, n_layers=n_layers, backward=backward)
    return Config(
        model=model,
        mesh=MeshConfig(d=8 // c, c=c),
        train=TrainConfig(batch_size=8, seq_len=LENGTH, warmup_steps=1),
    )


@functools.cache
def compiled(cfg: Config) -> tuple[str, list]:
    """The compiled loss-and-gradient's HLO text and its collectives."""
    mesh = mesh_of_sizes(cfg.mesh.sizes())
    step = jax.jit(lambda w, b: grads_and_loss(w, b, cfg, mesh))
    hlo = compiled_hlo(step, weight_structs(cfg.model, mesh), batch_structs(8, LENGTH, mesh))
    return hlo, collectives(hlo, mesh)


def _activation_calls(found, kind: str, phase: str | None = None) -> int:
    """Calls per step of ``kind`` over c alone of float activations (k, v: a sequence
    dimension and heads; the gathered ids 'B/d/e L' are int32 and bool)."""
    return sum(
        c.calls_per_step
        for c in found
        if c.kind == kind
        and c.axes == ("c",)
        and (phase is None or c.phase == phase)
        and any(dt.startswith("f") and len(s) == 4 for dt, s in c.result_arrays)
    )


def test_allgather_gathers_k_and_v_over_c_per_layer():
    _, found = compiled(_config("allgather"))
    # Forward: k and v gathered over c in each of the 2 layers (again in the backward, as
    # remat=saved recomputes them); backward: their transposes, reduce-scatters over c.
    assert _activation_calls(found, "all-gather", "forward") == 2 * 2
    assert _activation_calls(found, "reduce-scatter", "backward") == 2 * 2
    assert _activation_calls(found, "collective-permute") == 0


def test_ring_passes_k_and_v_around_c_and_never_gathers_them():
    c = 4
    _, found = compiled(_config("ring", c=c))
    permutes = [x for x in found if x.kind == "collective-permute"]
    assert permutes and all(x.axes == ("c",) for x in permutes)
    per_layer = sum(x.calls_per_step for x in permutes) / 2
    # Forward: k and v, c - 1 times each; backward: k and v c - 1 times, dk and dv c times.
    assert per_layer == 2 * (c - 1) + 2 * (c - 1) + 2 * c
    assert _activation_calls(found, "all-gather") == 0  # only the ids 'B/d/e L/c' are gathered


@pytest.mark.parametrize("impl", ["allgather", pytest.param("ring", marks=pytest.mark.slow)])
def test_counts_do_not_grow_with_the_layer_count(impl):
    two, three = compiled(_config(impl, n_layers=2))[1], compiled(_config(impl, n_layers=3))[1]
    assert len(two) == len(three)


@pytest.mark.parametrize(
    "impl, backward",
    [
        ("allgather", "explicit"),
        ("allgather", "autodiff"),
        ("ring", "explicit"),
        pytest.param("ring", "autodiff", marks=pytest.mark.slow),  # ring's autodiff: below
    ],
)
def test_compiled_collectives_are_the_predicted_ones(impl, backward):
    """The step's collectives predicted from the notation (seqshard.plan.step_comms, nothing
    compiled) == the compiled ones, per kind, axes and phase, in calls per step."""
    cfg = _config(impl, backward=backward)
    _, found = compiled(cfg)

    def key(kind, axes, phase):
        return kind, tuple(axes), phase

    predicted, got = {}, {}
    for x in collectives_per_step(cfg):
        k = key(x.kind, x.axes, x.phase)
        predicted[k] = predicted.get(k, 0) + x.calls
    for x in found:
        if x.phase == "update":
            continue
        k = key(x.kind, x.axes, x.phase)
        got[k] = got.get(k, 0) + x.calls_per_step
    assert got == predicted


# ---------------------------------------------------------------------------------------------
# Memory


@pytest.mark.slow
def test_ring_memory_falls_as_one_over_c():
    """Compiled temporary bytes per device of the loss-and-gradient at sequence 8192 (one row,
    the tiny model, the ring). Measured: see the note in the assertion."""
    temps = {}
    for c in (1, 2, 4, 8):
        cfg = Config(
            model=dataclasses.replace(CFG, context_impl="ring", n_layers=1),
            mesh=MeshConfig(c=c),
            train=TrainConfig(batch_size=1, seq_len=8192, warmup_steps=1),
        )
        mesh = mesh_of_sizes(cfg.mesh.sizes())
        lowered = jax.jit(lambda w, b, cfg=cfg, mesh=mesh: grads_and_loss(w, b, cfg, mesh)).lower(
            weight_structs(cfg.model, mesh), batch_structs(1, 8192, mesh)
        )
        temps[c] = lowered.compile().memory_analysis().temp_size_in_bytes
    for c in (2, 4, 8):
        assert temps[c] <= 1.5 * temps[1] / c, temps


# ---------------------------------------------------------------------------------------------
# Resume across c


@pytest.fixture(scope="module")
def c2_runs(tmp_path_factory, tiny_overrides):
    root = tmp_path_factory.mktemp("context_runs")
    on_c2 = ["mesh.d=4", "mesh.c=2", "mesh.t=1"]
    straight = [*tiny_overrides(root, "straight", steps=12, **FLAT), *on_c2]
    run(straight)
    run([*tiny_overrides(root, "half", steps=6, **FLAT), *on_c2])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.d=8", "mesh.c=1"], ["mesh.d=2", "mesh.c=4"]],
                         ids=["c=1", "c=4"])  # fmt: skip
def test_a_c2_checkpoint_continues_on_other_c(c2_runs, tmp_path, tiny_overrides, mesh):
    shutil.copytree(c2_runs / "half", tmp_path / "half")
    run([*tiny_overrides(tmp_path, "half", steps=12, **FLAT), "mesh.t=1", *mesh])
    resumed, straight = by_step(tmp_path / "half"), by_step(c2_runs / "straight")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(7, 13):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in straight[step]:
                np.testing.assert_allclose(
                    resumed[step][key], straight[step][key], rtol=2e-5, err_msg=f"{step} {key}"
                )
