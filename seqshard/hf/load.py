"""Import a Hugging Face model directory's weights straight into seqshard's sharded layout
(Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3: :mod:`seqshard.hf.hf_config`).

One tensor at a time: each Hugging Face tensor is read from its safetensors file, rearranged to
seqshard's layout (:mod:`seqshard.hf.table`, a view), and each local device's block of it is
copied to that device (``jax.make_array_from_callback``). A layer's (an expert's) tensor is
written into its slot of the stacked weight in place (a jitted update that donates the stack),
so the host holds the weights placed so far plus about one tensor, never the whole model at
once. Weights with no Hugging Face tensor start at zero: ``router_bias`` (Mixtral's and
Qwen3-MoE's routers have none; DeepSeek-V3's is ``e_score_correction_bias``) and the weights of
size 0.

A DeepSeek-V3's multi-token prediction modules (``num_nextn_predict_layers`` layers after the
model's, as DeepSeek's checkpoints hold them) are ``model.mtp``'s (read_hf_config makes its
depth theirs); their copies of the embedding and the head must equal the model's own (seqshard
shares them). Where the files hold no module (transformers declares one and saves none), one
line says so, and a ``model.mtp.depth`` the config asks for anyway starts as
:func:`~seqshard.model.weights.init_weights` makes it (gains ones, matrices random), not zeros.

    weights = load_hf_weights("Llama-3.2-1B", cfg.model, mesh)   # Weights, sharded on mesh
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from seqshard.hf.hf_config import HFFormatError, HFModel, hf_keys, read_hf_config
from seqshard.hf.safetensors_io import HFTensors
from seqshard.hf.table import TensorRow, hf_tensor_names
from seqshard.model.config import DIM_KEYS, ModelConfig
from seqshard.model.layers import MTP_STACK
from seqshard.model.weights import Weights, init_weights, weight_structs
from seqshard.shardlib.shardtypes import shape_dtype_structs

__all__ = ["check_model_agrees", "load_hf_weights"]

# Buffers some checkpoints carry that are not weights (recomputed from config.json).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A module's copy of the embedding or head is compared with the model's this much at a time.
_COMPARE_BYTES = 64 * 2**20


def check_model_agrees(hf: HFModel, cfg: ModelConfig) -> None:
    """Raise HFFormatError if ``cfg``'s model fields differ from what ``config.json`` says."""
    diff = [
        f"model.{k}={ours!r} but it says {theirs!r}"
        + (f" ({_hf_key_of(hf, k)})" if _hf_key_of(hf, k) else "")
        for k, (ours, theirs) in hf.disagreements(cfg).items()
    ]
    if diff:
        raise HFFormatError(
            f"{hf.path} disagrees with the config: {'; '.join(diff)}. Leave these model fields "
            f"out of the config (init.from_hf fills them) or make them equal."
        )


def _hf_key_of(hf: HFModel, field: str) -> str | None:
    """The config.json key behind a model field, where a dimension names it: ``moe.n_experts``
    -> ``num_local_experts`` in a Mixtral."""
    keys = hf_keys(hf.architecture)
    dim = next((d for d, k in DIM_KEYS.items() if k == field and d in keys), None)
    return keys[dim] if dim else None


def load_hf_weights(
    directory: str | Path,
    cfg: ModelConfig,
    mesh: Mesh,
    log: Callable[[str], None] = print,
    key: jax.Array | None = None,
) -> Weights:
    """The weights of the Hugging Face model in ``directory``, each placed in its sharded
    layout on ``mesh`` (f32, as seqshard's master weights; bf16 files are widened exactly).

    Everything is checked before any tensor is placed: config.json against ``cfg``, every
    tensor present (``lm_head.weight`` may be absent when embeddings are tied: a copy of the
    embedding), no tensor seqshard would ignore (biases), every shape as config.json implies,
    the multi-token prediction modules' copies of the embedding and head equal to the model's.
    ``key``: what :func:`~seqshard.model.weights.init_weights` draws ``model.mtp``'s weights
    from when the files hold none (default ``jax.random.key(0)``; pass ``train.seed``'s)."""
    hf = read_hf_config(directory)
    check_model_agrees(hf, cfg)
    tensors = HFTensors(directory)
    # read_hf_config gives the model the modules' depth only if the files hold them.
    held = "mtp.depth" in hf.fields
    names = [
        (row, where, name)
        for row, where, name in hf_tensor_names(cfg, hf.architecture)
        if held or not (row.stack == MTP_STACK or row.copy)
    ]
    _check_tensors(tensors, hf, cfg, names)
    _check_copies(tensors, hf, names)
    if not held and (hf.mtp_depth or cfg.mtp.depth):
        log(_no_modules_said(hf, cfg))
    structs = weight_structs(cfg, mesh)
    embed = next(r for r, _, _ in names if r.field == "embed" and not r.copy)
    # Every weight starts at zero in its layout (those without a tensor stay so), or, for
    # multi-token prediction modules the files lack, as init_weights makes them; each tensor
    # is written into its slot.
    placed = {
        jax.tree_util.keystr(path, simple=True, separator="."): _zeros(s.shape, s.sharding)
        for path, s in jax.tree_util.tree_leaves_with_path(structs)
        if held or not cfg.mtp.depth or path[0].name != MTP_STACK
    }
    if not held and cfg.mtp.depth:
        fresh = _mtp_initializer(cfg, mesh)(jax.random.key(0) if key is None else key)
        for path, x in jax.tree_util.tree_leaves_with_path(fresh):
            placed[f"{MTP_STACK}.{jax.tree_util.keystr(path, simple=True, separator='.')}"] = x
    for row, where, name in names:
        if row.copy:  # checked equal to the model's own weight, which holds it
            continue
        target = row.of(structs)
        # Tied: the embedding's copy, as transformers does, even if lm_head is there.
        source = embed if row.field == "unembed" and hf.tied else row
        if not where:
            placed[row.field] = _place(
                tensors, source.hf_name, source, cfg, target.sharding, target.shape, log
            )
            continue
        block = shape_dtype_structs(row.block_type, cfg.dim_sizes(), mesh)
        x = _place(tensors, name, source, cfg, block.sharding, block.shape, log)
        placed[row.field] = _updater(target.sharding, len(where))(placed[row.field], x, *where)
        del x
    n = sum(int(np.prod(s)) for s in tensors.shapes.values())
    log(f"imported {len(tensors.shapes)} tensors ({n / 1e6:.1f}M values) from {hf.path.parent}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(structs)
    return treedef.unflatten(
        [placed[jax.tree_util.keystr(path, simple=True, separator=".")] for path, _ in leaves]
    )


def _no_modules_said(hf: HFModel, cfg: ModelConfig) -> str:
    """The line that says the files hold no multi-token prediction module, and what
    ``model.mtp`` becomes."""
    declared = (
        f"{hf.path.name} says num_nextn_predict_layers={hf.mtp_depth}, but " if hf.mtp_depth else ""
    )
    said = (
        f"{declared}{hf.path.parent.name}'s files hold no multi-token prediction module "
        f"(no model.layers.{cfg.n_layers}.*)"
    )
    if not cfg.mtp.depth:
        return f"{said}: imported without one (model.mtp.depth 0)"
    return (
        f"{said}: model.mtp.depth={cfg.mtp.depth}'s modules start as init_weights makes them "
        f"(norm gains ones, matrices random), not from the files"
    )


@functools.lru_cache(maxsize=8)
def _mtp_initializer(cfg: ModelConfig, mesh: Mesh):
    """``key -> init_weights(cfg, mesh, key).mtp`` (the same values), jitted: the rest of the
    model's draws are dead code XLA drops, so only the modules' weights are made."""
    shardings = jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh).mtp)
    return jax.jit(lambda key: init_weights(cfg, mesh, key).mtp, out_shardings=shardings)


def _check_copies(tensors: HFTensors, hf: HFModel, names) -> None:
    """Raise HFFormatError naming the tensor if a multi-token prediction module's copy of the
    embedding or head differs from the model's own (``lm_head.weight``, the embedding's when
    tied): seqshard's modules share them, so it would hold only the model's. Compared a few
    rows at a time, as f32 (a copy may be stored in another dtype)."""
    own = {r.field: r.hf_name for r, _, _ in names if not r.stacked and not r.copy}
    if hf.tied:
        own["unembed"] = own["embed"]
    for row, _, name in names:
        if not row.copy:
            continue
        model = own[row.field]
        shape = tensors.shapes[name]
        step = max(1, _COMPARE_BYTES // (4 * int(np.prod(shape[1:]))))
        for start in range(0, shape[0], step):
            rows = slice(start, min(start + step, shape[0]))  # safetensors does not clip
            copy = tensors.read(name, rows).astype(np.float32)
            theirs = tensors.read(model, rows).astype(np.float32)
            if np.array_equal(copy, theirs):
                continue
            at = tuple(int(i) for i in np.argwhere(~(copy == theirs))[0])
            where = (start + at[0], *at[1:])
            n_layers = hf.fields["n_layers"]
            raise HFFormatError(
                f"{tensors.file_of[name]}: tensor {name}, a multi-token prediction module's "
                f"copy of {model}, differs from it (at {list(where)}: {copy[at]!r} but "
                f"{theirs[at]!r}). seqshard's modules share the model's embedding and output "
                f"head, as DeepSeek-V3's do, so it would hold only {model}: use files whose "
                f"copies equal it (DeepSeek's released checkpoints' do), or remove the modules' "
                f"tensors (model.layers.{n_layers}.* on) and set num_nextn_predict_layers to 0 "
                f"in {hf.path} to import the model without them."
            )


def _check_tensors(tensors: HFTensors, hf: HFModel, cfg: ModelConfig, names) -> None:
    expected = {name: row for row, _, name in names}
    # A tensor of no element holds no weight (DeepSeek-V3's shared experts with
    # n_shared_experts 0): nothing to place, nothing dropped.
    have = {
        n
        for n, shape in tensors.shapes.items()
        if np.prod(shape) and not n.endswith(_IGNORED_SUFFIXES)
    }
    tied_ok = {"lm_head.weight"} if hf.tied else set()
    missing = sorted(set(expected) - have - tied_ok)
    if "lm_head.weight" in missing:
        raise HFFormatError(
            f"{tensors.directory} has no lm_head.weight and {hf.path.name} says "
            f"tie_word_embeddings=false: the unembedding is missing. Set tie_word_embeddings: "
            f"true in {hf.path} if the model shares its embedding, or fetch the missing file."
        )
    if missing:
        raise HFFormatError(
            f"{tensors.directory}: {len(missing)} tensors a {cfg.n_layers}-layer "
            f"{hf.architecture} of {hf.path.name} needs are missing, e.g. "
            f"{', '.join(missing[:3])}. Download or copy the whole model directory."
            + _expert_count_said(missing, False, hf, cfg)
        )
    extra = sorted(have - set(expected))
    if extra:
        raise HFFormatError(
            f"{tensors.directory} has tensors seqshard's {hf.architecture} does not compute: "
            f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''} ({len(extra)} in all; "
            f"biases and extra layers or experts are not supported)."
            + _expert_count_said(extra, True, hf, cfg)
            + " seqshard will not drop weights silently."
        )
    for name, row in expected.items():
        if name not in tensors.shapes:
            continue
        want, got = row.hf_shape(cfg), tensors.shapes[name]
        if want != got:
            raise HFFormatError(
                f"{tensors.file_of[name]}: tensor {name} has shape {list(got)}, but "
                f"{hf.path.name} implies {list(want)} ({row.hf_layout} with "
                f"{_sizes_said(row, cfg, hf.architecture)}). The file and config.json are of "
                f"different models: fix {hf.path.name} to match the tensors, or use the "
                f"config.json that came with them."
            )
        if tensors.dtypes[name] not in ("F32", "BF16", "F16"):
            raise HFFormatError(
                f"{tensors.file_of[name]}: tensor {name} is {tensors.dtypes[name]}; seqshard "
                f"imports F32, BF16 and F16 weights (dequantize first)."
            )


def _sizes_said(row: TensorRow, cfg: ModelConfig, architecture: str) -> str:
    names = [n for n in row.hf_layout.replace("(", " ").replace(")", " ").split()]
    sizes, keys = cfg.dim_sizes(), hf_keys(architecture)
    return ", ".join(f"{n}={sizes[n]} ({keys[n]})" for n in dict.fromkeys(names))


def _expert_counts(names: list[str]) -> dict[int, set[int]]:
    """Hugging Face layer -> the expert numbers among ``names`` (``...layers.3.mlp.experts.7.``)."""
    out: dict[int, set[int]] = {}
    for name in names:
        words = name.split(".")
        if "experts" in words and words[1] == "layers":
            at = words.index("experts")
            if words[at + 1].isdigit():
                out.setdefault(int(words[2]), set()).add(int(words[at + 1]))
    return out


def _expert_count_said(names: list[str], more: bool, hf: HFModel, cfg: ModelConfig) -> str:
    """What to say when ``names`` (tensors the files have beyond config.json's count of experts
    if ``more``, else those it counts that the files lack) name experts; "" when none do."""
    found = _expert_counts(names)
    if not found:
        return ""
    key = hf_keys(hf.architecture)["experts"]
    layer, numbers = min(found.items())
    said = f"{hf.path.name} says {key}={cfg.moe.n_experts}"
    if more:
        return (
            f" Layer {layer} has experts up to {max(numbers)}, but {said}: set {key} to the "
            f"number of experts the files hold ({max(numbers) + 1}?)."
        )
    return (
        f" Layer {layer} lacks experts {min(numbers)}..{max(numbers)}: {said}; if the files "
        f"hold only {min(numbers)}, set {key} to {min(numbers)}."
    )


LARGEST_TRAINED_WEIGHT = 1e4
"""A weight above this in magnitude is reported on import. Trained transformer weights are of
order 1 (AdamW with weight decay keeps them there; the largest, norm gains and a few outlier
entries, stay in the tens to hundreds), and a single 1e4 entry already makes the activations
it feeds 1e4 times larger than the rest of the residual. Past about 1e19 the next RMSNorm's
sum of squares overflows f32 and every gradient through it is zero: a corrupt value (1e30 in
one down_proj) trained 40 steps at loss ln(vocab) with gradient norm 0."""


def _place(
    tensors: HFTensors,
    name: str,
    row: TensorRow,
    cfg,
    sharding,
    shape,
    log: Callable[[str], None] = print,
) -> jax.Array:
    """Read one Hugging Face tensor and put each local device's block of it on that device;
    one warning line (to ``log``) if it holds values far outside a trained model's."""
    stored = tensors.read(name)
    if not np.isfinite(stored).all():
        bad = int(np.size(stored) - np.count_nonzero(np.isfinite(stored)))
        raise HFFormatError(
            f"{tensors.file_of[name]}: tensor {name} holds {bad} non-finite values (NaN or "
            f"inf): a run started from it would stop at its first step. The file is damaged "
            f"or the model diverged; use another checkpoint."
        )
    largest = float(np.max(np.abs(stored))) if stored.size else 0.0
    if largest > LARGEST_TRAINED_WEIGHT:
        over = int(np.count_nonzero(np.abs(stored) > LARGEST_TRAINED_WEIGHT))
        log(
            f"warning: {tensors.file_of[name]}: tensor {name} holds {over} values above "
            f"{LARGEST_TRAINED_WEIGHT:g} in magnitude (largest {largest:.3g}), far outside what "
            f"a trained model holds: the file may be damaged. A run from it may stand still "
            f"(its gradient vanishes) or diverge; seqshard stops at such a step."
        )
    values = row.from_hf(stored, cfg)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.ascontiguousarray(values[index], dtype=np.float32)
    )


@functools.lru_cache(maxsize=32)
def _updater(sharding, n_index: int):
    """``(stack, x, *index) -> stack`` with x written at ``stack[index]``, in place (donated)."""

    def update(stack, x, *index):
        start = (*index, *(0,) * (stack.ndim - n_index))
        return lax.dynamic_update_slice(stack, x.reshape((1,) * n_index + x.shape), start)

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


def _zeros(shape, sharding) -> jax.Array:
    if not np.prod(shape):  # XLA would not split a zero-size output (jax then cannot read it)
        return jax.device_put(np.zeros(shape, np.float32), sharding)
    return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
