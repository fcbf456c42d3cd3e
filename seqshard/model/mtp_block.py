"""The entry of a multi-token prediction module (``model.mtp``; DeepSeek-V3): its weights and the
combination of the previous depth's hidden state with the embedding of the token ahead.

Module k (1 .. depth) at position i reads h^{k-1}_i (the main model's last residual for k = 1)
and the embedding of token i + k, and predicts token i + k + 1::

    x      = [norm(emb(t_{i+k}), enorm) | norm(h^{k-1}_i, hnorm)] . w_eh      (a residual)
    h^k    = one transformer layer (the model's attention kind, its FFN or MoE) on x
    logits = unembed(norm(h^k, head_norm))                       (the shared output head)

Per device: both norms as the pre-norms (gains gathered over t,d,c; the residual gathered over
t around them), the concatenation 'B/dp L@zigzag/c N' (N = 2 M) split over t locally, ``w_eh``
'M/fsdp N/t' gathered over d,e,c, its product owing a sum over t: one psum_scatter into the
residual's layout (row-parallel, as the attention output). Everything is per position: token
i + k is looked up where position i lives (its id comes from the row the batch's ids were
gathered into, :func:`seqshard.model.context.sequence_rows`), so zigzag order over c moves no
activation. :mod:`seqshard.model.mtp` runs the modules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from seqshard.model.block import (
    Activation,
    Activations,
    Aux,
    Block,
    LayerInputs,
    elementwise,
    gain,
    matmul,
    weight,
)
from seqshard.model.config import ModelConfig
from seqshard.model.norm import norm_input, normed
from seqshard.shardlib import shardops
from seqshard.shardlib.shardtypes import f32, pytree_dataclass

__all__ = ["MTP_ENTRY", "MTPWeights", "mtp_entry_forward", "mtp_metrics"]

# DeepSeek-V3's checkpoints hold module k as the layer after the last: model.layers.{n_layers + k - 1}.
_LAYER = "model.layers.{i}."


def _eh_std(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(2 * cfg.d_model)


@pytree_dataclass
class MTPWeights:
    """A multi-token prediction module's own weights (besides its transformer layer's)."""

    enorm: f32["d_model/t/fsdp"] = gain(_LAYER + "enorm.weight")
    hnorm: f32["d_model/t/fsdp"] = gain(_LAYER + "hnorm.weight")
    # [embedding | hidden] (2 d_model) -> d_model.
    w_eh: f32["d_model/fsdp mtp_in/t"] = weight(
        _eh_std, hf=_LAYER + "eh_proj.weight", layout="d_model mtp_in", matrix=("mtp_in", "d_model")
    )
    head_norm: f32["d_model/t/fsdp"] = gain(_LAYER + "shared_head.norm.weight")


_R = "B/dp L/c M/t"


def mtp_entry_forward(
    cfg: ModelConfig, inputs: LayerInputs, w, a: Activations
) -> tuple[jax.Array, dict]:
    """The module's input residual ``x`` from ``a['h_prev']`` and ``a['emb']`` (both
    residuals); its auxiliary output, the module's mean loss, is filled in by
    :func:`seqshard.model.mtp.mtp_loss` once the module's head has run."""
    dt = jnp.dtype(cfg.compute_dtype)
    enorm = a("enorm", lambda: shardops.all_gather("M/t/fsdp -> M", w.enorm))
    hnorm = a("hnorm", lambda: shardops.all_gather("M/t/fsdp -> M", w.hnorm))
    ne = a("ne", lambda: normed(cfg, norm_input(cfg, a["emb"]), enorm))
    nh = a("nh_prev", lambda: normed(cfg, norm_input(cfg, a["h_prev"]), hnorm))
    w_eh = a("w_eh", lambda: shardops.all_gather("M/fsdp N/t -> M N/t", w.w_eh.astype(dt)))

    def combined() -> jax.Array:
        both = shardops.split(
            "B/dp L@zigzag/c N -> B/dp L@zigzag/c N/t", jnp.concatenate([ne, nh], axis=-1)
        )
        out = shardops.einsum_unreduced(
            "B/dp L@zigzag/c N/t, M N/t -> B/dp L@zigzag/c M", both, w_eh
        )
        # Each t shard contracted its slice of N: sum the shards into the residual's layout.
        return shardops.psum_scatter(f"B/dp L@zigzag/c M -> {cfg.residual_spec}", out)

    return a("x", combined), {}


def mtp_metrics(cfg: ModelConfig, aux: dict, names, w) -> dict[str, jax.Array]:
    """The log's figures: each module's mean cross-entropy (``mtp_loss/<k>``, k = 1 .. depth:
    predicting the token k + 1 ahead) and their mean (``mtp_loss``, before loss_weight)."""
    losses = aux["loss"]
    out = {"mtp_loss": jnp.mean(losses)}
    for k in range(losses.shape[0]):
        out[f"mtp_loss/{k + 1}"] = losses[k]
    return out


MTP_ENTRY = Block(
    name="mtp_entry",
    activations=(
        Activation("h_prev", _R, "compute", "mtp_norms", saved=True),
        Activation("emb", _R, "compute", "mtp_norms", saved=True),
        Activation("enorm", "M", "f32", "mtp_norms"),
        Activation("hnorm", "M", "f32", "mtp_norms"),
        Activation("ne", "B/dp L/c M", "compute", "mtp_norms"),
        Activation("nh_prev", "B/dp L/c M", "compute", "mtp_norms"),
        Activation("w_eh", "M N/t", "compute", "eh_proj"),
        Activation("x", _R, "compute", "eh_proj", saved=True),
    ),
    ops=(
        # Two RMSNorms (norm_op's counts, twice).
        elementwise("mtp_norms", "token", "B/dp L M", lambda m: 2 * (4 * m.d_model + 3),
                    lambda m: 2 * 8 * m.d_model, ("saved", "full")),
        matmul("eh_proj", "token", "B/dp L N/t, M N/t -> B/dp L M",
               lambda m: 2 * 2 * m.d_model * m.d_model, ("full",)),
    ),
    weights=MTPWeights,
    forward=mtp_entry_forward,
    input="h_prev",
    output="x",
    aux=Aux(fields={"loss": ""}, mean=("loss",), metrics=mtp_metrics),
)  # fmt: skip
"""The entry block of a multi-token prediction module (its head norm's weight rides along in
:class:`MTPWeights`; its head's operations are :mod:`seqshard.model.mtp`'s)."""
