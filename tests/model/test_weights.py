"""Tests of seqshard/model/weights.py: the weights' layouts from their types (a golden
snapshot), init in place with the documented stds, the same weights on every mesh, and the
parameter count."""

from __future__ import annotations

import functools
import math
import os
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from model_weights import assert_trees_close, tiny_model, to_numpy

from seqshard.model import ModelConfig, init_weights, param_count, weight_structs
from seqshard.model.weights import weights_type
from seqshard.shardlib.shardtypes import partition_specs
from seqshard.testing import fake_cpu_mesh

CFG = tiny_model()


@functools.cache
def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return fake_cpu_mesh(shape, ("d", "t"))


# ---------------------------------------------------------------------------------------------
# Golden snapshot of the weight layouts

GOLDEN = pathlib.Path(__file__).parent / "golden" / "weights_default_d2_t2.txt"


def weight_layout_table(cfg: ModelConfig, mesh) -> str:
    structs = weight_structs(cfg, mesh)
    specs = jax.tree.leaves(partition_specs(weights_type(cfg)), is_leaf=lambda x: isinstance(x, P))
    rows = [("weight", "dtype", "global shape", "per-device block", "PartitionSpec")]
    for (path, s), spec in zip(jax.tree_util.tree_leaves_with_path(structs), specs, strict=True):
        assert s.sharding.spec == spec, "weight_structs and partition_specs disagree"
        rows.append(
            (
                jax.tree_util.keystr(path, simple=True, separator="."),
                str(s.dtype),
                str(s.shape),
                str(s.sharding.shard_shape(s.shape)),
                str(spec),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    header = (
        "# Weight layouts of ModelConfig() on a d=2 x t=2 mesh, from the types in weights.py.\n"
        "# Rewrite: SEQSHARD_UPDATE_GOLDEN=1 pytest tests/model/test_weights.py -k golden\n"
    )
    return header + "\n".join(lines) + "\n"


def test_weight_layouts_match_golden():
    """Every weight's global shape, dtype and PartitionSpec, for ModelConfig() on d=2 x t=2.

    A layout change shows up as a diff of tests/model/golden/weights_default_d2_t2.txt in review.
    After an intended change, rewrite the file and commit it with the change:

        SEQSHARD_UPDATE_GOLDEN=1 pytest tests/model/test_weights.py -k golden
    """
    table = weight_layout_table(ModelConfig(), mesh_of((2, 2)))
    if os.environ.get("SEQSHARD_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(table)
    assert GOLDEN.exists(), f"{GOLDEN} is missing; create it with SEQSHARD_UPDATE_GOLDEN=1"
    assert table == GOLDEN.read_text()


# ---------------------------------------------------------------------------------------------
# init_weights and param_count

BIG = ModelConfig(vocab=512, d_model=256, n_layers=4, n_q_per_kv=2, n_kv=4, d_head=32, d_ff=1024)


def documented_stds(cfg: ModelConfig) -> dict[str, float | str]:
    """The table in weights.py's docstring, written out again (q_norm and k_norm exist with
    model.qk_norm only)."""
    depth = math.sqrt(2 * cfg.n_layers)
    stds = {
        "embed": 1.0,
        "layers.ln1": "ones",
        "layers.w_q": 1 / math.sqrt(cfg.d_model),
        "layers.w_kv": 1 / math.sqrt(cfg.d_model),
        "layers.w_o": 1 / math.sqrt(cfg.n_q_per_kv * cfg.n_kv * cfg.d_head) / depth,
        "layers.q_norm": "ones",
        "layers.k_norm": "ones",
        "layers.ln2": "ones",
        "layers.w_gate": 1 / math.sqrt(cfg.d_model),
        "layers.w_up": 1 / math.sqrt(cfg.d_model),
        "layers.w_down": 1 / math.sqrt(cfg.d_ff) / depth,
        "final_norm": "ones",
        "unembed": 1 / math.sqrt(cfg.d_model),
    }
    if not cfg.qk_norm:
        del stds["layers.q_norm"], stds["layers.k_norm"]
    return stds


@pytest.fixture(scope="module")
def big_weights():
    mesh = mesh_of((2, 4))
    return init_weights(BIG, mesh, jax.random.key(1)), mesh


def _leaves_by_name(tree) -> dict[str, jax.Array]:
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_init_weights_have_the_shardings_their_types_declare(big_weights):
    weights, mesh = big_weights
    specs = jax.tree.leaves(partition_specs(weights_type(BIG)), is_leaf=lambda x: isinstance(x, P))
    structs = jax.tree.leaves(weight_structs(BIG))
    for (name, w), spec, s in zip(_leaves_by_name(weights).items(), specs, structs, strict=True):
        assert w.sharding == NamedSharding(mesh, spec), name
        assert (w.shape, w.dtype) == (s.shape, s.dtype), name


def test_init_stds_are_the_documented_ones(big_weights):
    weights, _ = big_weights
    leaves = _leaves_by_name(weights)
    assert set(leaves) == set(documented_stds(BIG))
    for name, std in documented_stds(BIG).items():
        w = np.asarray(leaves[name], np.float64)
        if std == "ones":
            np.testing.assert_array_equal(w, 1.0, err_msg=name)
            continue
        # >= 131072 samples each: the sample std is within 0.3% of the true one (1 sigma)
        assert abs(w.std() / std - 1) < 0.02, (name, w.std(), std)
        assert abs(w.mean()) < 5 * std / math.sqrt(w.size), name
    # every weight, and every layer, draws its own numbers
    assert not np.allclose(leaves["layers.w_gate"], leaves["layers.w_up"])
    assert not np.allclose(leaves["layers.w_q"][0], leaves["layers.w_q"][1])


@pytest.mark.slow  # two more init compiles, ~10 s of CPU
def test_init_gives_the_same_weights_on_every_mesh():
    """Partitioned RNG: each device makes its block, and the blocks form the same array."""
    on_one = to_numpy(init_weights(CFG, mesh_of((1, 1)), jax.random.key(0)))
    on_eight = to_numpy(init_weights(CFG, mesh_of((2, 4)), jax.random.key(0)))
    assert_trees_close(on_eight, on_one, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [CFG, BIG, ModelConfig()], ids=["small", "big", "default"])
def test_param_count(cfg):
    count_of_structs = sum(math.prod(s.shape) for s in jax.tree.leaves(weight_structs(cfg)))
    assert param_count(cfg) == count_of_structs
    m, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_layers
    attention = 2 * m * cfg.n_q_per_kv * cfg.n_kv * cfg.d_head + 2 * m * cfg.n_kv * cfg.d_head
    per_layer = 2 * m + attention + 3 * m * f  # two norms, q/kv/o, gate/up/down
    assert param_count(cfg) == 2 * v * m + n * per_layer + m  # untied embed/unembed, final norm


def test_param_count_equals_the_elements_of_init_weights(big_weights):
    weights, _ = big_weights
    assert param_count(BIG) == sum(w.size for w in jax.tree.leaves(weights))
