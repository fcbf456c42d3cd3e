"""The mixture-of-experts FFN block: pre-norm, a router choosing ``top_k`` of ``n_experts``
SwiGLU experts per token, the tokens exchanged over the mesh axis e to the shard holding
their experts, one grouped matmul per projection there, the results exchanged back and
combined with the router's gates; shared experts (a dense SwiGLU every token passes through)
beside them. Its weights, activations and operations are declared here (:data:`MOE`,
:class:`ExpertFfnWeights`), its math is :func:`moe_ffn`.

Letters beyond the model's: E (experts), X (an expert's hidden size, ``moe.d_ff``), Sh (the
shared experts' hidden size), T (this device's tokens, B x L flattened), Src and Dst (the
sending and the receiving shard of e), Slot (a row of the exchange buffer, C of them: the
copies one shard sends another), G (the router's statistics, 2 E + 3 numbers).

Layout. Routed experts rest ``'experts/e d_model/d/c d_expert/t'``: split over e (expert
parallelism), their rows over d and c (FSDP), their hidden dim over t (tensor parallelism
inside each expert). Everything else treats e as data parallelism: the batch is
``'B/dp L/c'`` and the other weights' rows ``d_model/fsdp``, so no device idles in attention
(as MaxText and torchtitan borrow expert parallelism from data parallelism).

Per device, per MoE layer, forward:

    all_gather over t,d,e,c  ln2, the router             (small)
    all_gather over t        the residual, around the norm
    all_gather over d,c      w_gate, w_up, w_down: this shard's E/e experts
    all_to_all over e        the token copies to their experts' shards, and back (2 x e C M)
    psum over d,e,c          the router's statistics (2 E + 3 numbers)
    psum_scatter over t      the experts' and shared experts' output (they contract X/t, Sh/t)

Dispatch with fixed buffers (XLA:CPU runs no ragged all-to-all): each device sorts its
T x k token copies by expert and sends each shard a buffer of C rows, the copies whose expert r
holds. Dropless (``capacity_factor=0``) sizes C for the worst case, every copy to one shard:
C = T x min(k, E/e) (a token's k copies go to k distinct experts), so the exchange moves
e x C x M per device, up to e times the copies' own bytes (``seqshard show`` prints it). A
bound measured per step would make the compiled program's shapes depend on the data. With
``capacity_factor`` f > 0, C = ceil(f x T x k / e) and the copies past a shard's C-th are
dropped (their output is 0), counted in the statistics.

Loss terms, each over one microbatch's global rows (every device's tokens: one psum), added
to the microbatch's summed loss weighted by its counted positions, so that the step's loss,
the mean over positions, adds each term once per microbatch (gradient accumulation weighs
microbatches as it weighs their positions): ``aux_loss_weight * E * sum_i f_i P_i`` (f_i the
fraction of the microbatch's token copies routed to expert i, P_i its mean router
probability; a sigmoid router's scores normalized to sum 1 per token) and ``z_loss_weight *
mean(logsumexp(logits)^2)`` over the microbatch's tokens. The reference computes the same.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.block import (
    Activation,
    Activations,
    Aux,
    Block,
    LayerInputs,
    Op,
    elementwise,
    gain,
    matmul,
    weight,
)
from seqshard.model.config import ModelConfig
from seqshard.model.norm import norm_input, norm_op, normed
from seqshard.shardlib import shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.matmul import einsum, ragged_dot
from seqshard.shardlib.shardtypes import f32, pytree_dataclass

__all__ = [
    "MOE",
    "ExpertFfnWeights",
    "ROUTED_OPS",
    "ROUTER_STATS",
    "balanced_bias",
    "buffer_bytes",
    "capacity",
    "moe_ffn",
    "moe_forward",
    "moe_metrics",
    "route",
    "within_top_groups",
]


_LAYER = "model.layers.{i}."
_EXPERT = _LAYER + "mlp.experts.{x}."


_S_IN = ("d_model", "d_shared")  # the shared experts' gate and up map (down: the reverse)


def _expert(init, proj: str):
    """A routed expert's weight, Hugging Face's ``mlp.experts.{x}.<proj>.weight`` (stored as
    nn.Linear's [out, in])."""
    down = proj == "down_proj"
    layout = "d_model d_expert" if down else "d_expert d_model"
    matrix = ("d_expert", "d_model") if down else ("d_model", "d_expert")  # one per expert
    return weight(init, hf=f"{_EXPERT}{proj}.weight", layout=layout, matrix=matrix)


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


def _w_down_std(cfg: ModelConfig) -> float:
    """Each expert's contribution at unit scale, the residual stream growing like
    sqrt(layers) (as the dense FFN's w_down)."""
    return 1 / math.sqrt(cfg.moe.d_ff) / math.sqrt(2 * cfg.n_layers)


def _has_shared(cfg: ModelConfig) -> bool:
    return cfg.moe.n_shared > 0


@pytree_dataclass
class ExpertFfnWeights:
    """One MoE layer's FFN weights. ``router_bias`` is no trained weight: the forward reads it
    without a gradient (for the top-k choice only) and the train step moves it after each
    optimizer step (``moe.balance=bias``); it rests with the weights, so checkpoints carry it."""

    ln2: f32["d_model/t/fsdp"] = gain(_LAYER + "post_attention_layernorm.weight")
    # Its rows split over t as well as d, e, c (as the norm gains): gathered over t too, it
    # stays varying over t, so its gradient is the gather's transpose (a reduce-scatter the
    # notation predicts), not an all-reduce JAX would add for an invariant weight.
    router: f32["d_model/t/fsdp experts"] = weight(
        _fan_in, gathered_in="f32", hf=_LAYER + "mlp.gate.weight", layout="experts d_model"
    )
    # No Hugging Face tensor: Mixtral and Qwen3-MoE choose their experts without a bias.
    router_bias: f32["experts"] = weight(0.0, decay=False, gathered_in="f32")
    # One Hugging Face tensor per expert ({x}); Mixtral names them w1, w3, w2
    # (seqshard.hf.table).
    w_gate: f32["experts/e d_model/d/c d_expert/t"] = _expert(_fan_in, "gate_proj")
    w_up: f32["experts/e d_model/d/c d_expert/t"] = _expert(_fan_in, "up_proj")
    w_down: f32["experts/e d_model/d/c d_expert/t"] = _expert(_w_down_std, "down_proj")
    # The shared experts (absent without any): one SwiGLU of n_shared x d_ff.
    s_gate: f32["d_model/fsdp d_shared/t"] = weight(_fan_in, present=_has_shared, matrix=_S_IN)
    s_up: f32["d_model/fsdp d_shared/t"] = weight(_fan_in, present=_has_shared, matrix=_S_IN)
    s_down: f32["d_model/fsdp d_shared/t"] = weight(
        _w_down_std, present=_has_shared, matrix=_S_IN[::-1]
    )


# Nothing inside the block is marked saved: under remat saved or full, autodiff re-runs the
# whole block in the backward pass (the exchanges included), and the hand-written backward
# differentiates it with jax.vjp from its input. Its output alone is never re-run.
_RERUN = frozenset({"saved", "full"})


def _active(cfg: ModelConfig) -> int:
    return cfg.moe.top_k


ROUTER_STATS = {"load": "experts", "dropped": "", "aux": "", "z": "", "tokens": ""}
"""The routing of one microbatch by one MoE layer, summed over the microbatch (every device):
``load`` the token copies routed to each expert (before any drop), ``dropped`` the copies
capacity dropped, ``aux`` and ``z`` the balancing terms (weighted, per token of the
microbatch), ``tokens`` the tokens routed. The block's auxiliary outputs (:class:`Aux`):
replicated on every device, stacked over the MoE layers by the layer scan."""


def moe_forward(cfg: ModelConfig, inputs: LayerInputs, w, a: Activations):
    """The block on the residual ``a['h']``: (the residual, its routing statistics)."""
    return moe_ffn(cfg, w, a)


def moe_metrics(
    cfg: ModelConfig, stats: dict[str, jax.Array], names: list[str], w
) -> dict[str, jax.Array]:
    """The MoE layers' figures for the log from the step's statistics (each [layers, ...],
    in the stored stack's order; ``names`` each stored layer's place in the model): the expert
    load's max over its mean (1: balanced), of the worst layer and of each layer
    (``.../<layer>``), each expert's share of the layer's token copies (``seqshard plot``
    draws them as a heatmap), the dropped fraction, the aux and z losses, and the router
    bias's range (max - min over experts and layers)."""
    moe = cfg.moe
    copies = stats["tokens"] * moe.top_k  # [layers]
    share = stats["load"] / copies[:, None]
    out = {
        "moe_aux_loss": jnp.sum(stats["aux"]),
        "moe_z_loss": jnp.sum(stats["z"]),
        "moe_dropped_fraction": jnp.sum(stats["dropped"]) / jnp.sum(copies),
        "moe_bias_range": jnp.max(w.router_bias) - jnp.min(w.router_bias),
        "moe_load_max_over_mean": jnp.max(share) * moe.n_experts,  # the worst layer's
    }
    for i, layer in enumerate(names):
        out[f"moe_load_max_over_mean/{layer}"] = jnp.max(share[i]) * moe.n_experts
        for j in range(moe.n_experts):
            out[f"moe_load/{layer}/{j}"] = share[i, j]
    return out


def balanced_bias(cfg: ModelConfig, w, stats: dict[str, jax.Array]):
    """The MoE stack's weights with each layer's router bias moved by ``moe.bias_rate``
    towards balance (DeepSeek-V3, ``moe.balance=bias``; else unchanged): up for the experts
    loaded below the layer's mean, down above it, from the whole step's load (every
    microbatch, every device)."""
    if cfg.moe.balance != "bias":
        return w
    load = stats["load"]
    step = cfg.moe.bias_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return dataclasses.replace(w, router_bias=w.router_bias + step)


MOE = Block(
    name="moe",
    activations=(
        Activation("ln2", "M", "f32", "ffn_norm", needed=False),
        Activation("gh", "B/dp L/c M", "compute", "ffn_norm", needed=False),
        Activation("nh", "B/dp L/c M", "compute", "ffn_norm", needed=False),
        Activation("out", "B/dp L/c M/t", "compute", "ffn_residual", needed=False),
    ),
    ops=(
        norm_op("ffn_norm", consumers=3, recomputed_by=tuple(_RERUN)),  # router, experts, shared
        matmul("router", "token", "B/dp L M, M E -> B/dp L E",
               lambda m: 2 * m.d_model * m.moe.n_experts, _RERUN),
        # softmax or sigmoid, the top-k choice, the gates' normalization (about 8 per expert)
        elementwise("routing", "token", "B/dp L E", lambda m: 8 * m.moe.n_experts,
                    lambda m: 4 * m.moe.n_experts, _RERUN),
        Op("dispatch", "transfer", "token", "B/dp L M", lambda m: 0, lambda m: 0, _RERUN),
        # The experts' work per token is its k copies': FLOPs on active parameters.
        matmul("expert_gate", "token", "B/dp L/c M, E M X/t -> B/dp L/c X/t",
               lambda m: 2 * m.d_model * m.moe.d_ff * _active(m), _RERUN),
        matmul("expert_up", "token", "B/dp L/c M, E M X/t -> B/dp L/c X/t",
               lambda m: 2 * m.d_model * m.moe.d_ff * _active(m), _RERUN),
        elementwise("expert_swiglu", "token", "B/dp L/c X/t", lambda m: 3 * m.moe.d_ff * _active(m),
                    lambda m: 7 * m.moe.d_ff * _active(m), _RERUN),
        # The combine needs each copy's output (its gate's gradient): the down projection is
        # re-run too, unlike the dense FFN's.
        matmul("expert_down", "token", "B/dp L/c X/t, E M X/t -> B/dp L/c M",
               lambda m: 2 * m.moe.d_ff * m.d_model * _active(m), _RERUN),
        # out = sum over the k copies of gate x copy; backward: the same, and the gates' dot.
        elementwise("combine", "token", "B/dp L M", lambda m: 2 * m.d_model * _active(m),
                    lambda m: 4 * m.d_model * _active(m), _RERUN),
        matmul("shared_gate", "token", "B/dp L M, M Sh/t -> B/dp L Sh/t",
               lambda m: 2 * m.d_model * m.moe.n_shared * m.moe.d_ff, _RERUN),
        matmul("shared_up", "token", "B/dp L M, M Sh/t -> B/dp L Sh/t",
               lambda m: 2 * m.d_model * m.moe.n_shared * m.moe.d_ff, _RERUN),
        elementwise("shared_swiglu", "token", "B/dp L Sh/t",
                    lambda m: 3 * m.moe.n_shared * m.moe.d_ff,
                    lambda m: 7 * m.moe.n_shared * m.moe.d_ff, _RERUN),
        matmul("shared_down", "token", "B/dp L Sh/t, M Sh/t -> B/dp L M",
               lambda m: 2 * m.moe.n_shared * m.moe.d_ff * m.d_model, _RERUN),
        elementwise("ffn_residual", "token", "B/dp L M/t", lambda m: m.d_model,
                    lambda m: m.d_model),
    ),
    weights=ExpertFfnWeights,
    forward=moe_forward,
    input="h",
    output="out",
    aux=Aux(
        fields=ROUTER_STATS,
        loss=("aux", "z"),
        mean=("aux", "z"),
        metrics=moe_metrics,
        update=balanced_bias,
    ),
)  # fmt: skip
"""The MoE block's declarations (FLOPs on active parameters: a token's k experts)."""

ROUTED_OPS = frozenset({"expert_gate", "expert_up", "expert_swiglu", "expert_down"})
"""The operations on the routed token copies: their work lands on the e shard holding each
copy's expert, so the busiest shard does more than the mean when the router is unbalanced
(the planner's ``imbalance``)."""


def capacity(cfg: ModelConfig, tokens: int, e: int) -> int:
    """C, the rows of each exchange buffer for ``tokens`` tokens on one device with e shards
    (see the module docstring: dropless sizes it for the worst case)."""
    moe = cfg.moe
    k = moe.top_k
    worst = tokens * min(k, moe.n_experts // e)  # every copy to one shard
    if moe.capacity_factor == 0:
        return worst
    # A larger buffer would only hold padding: a factor past the worst case is dropless.
    return min(worst, max(1, math.ceil(moe.capacity_factor * tokens * k / e)))


def buffer_bytes(cfg: ModelConfig, tokens: int, e: int) -> int:
    """Bytes of one exchange buffer ``[e, C, M]`` in compute dtype on a device holding
    ``tokens`` tokens (C = :func:`capacity`): the dispatch sends one and receives one, the
    return the same again, whatever the routing (fixed shapes)."""
    return e * capacity(cfg, tokens, e) * cfg.d_model * cfg.compute_bytes


def route(
    cfg: ModelConfig, logits: jax.Array, bias: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert ids i32[..., k], gates f32[..., k], probabilities f32[..., E]) from the router's
    f32 logits [..., E]: softmax (renormalized over the k chosen, as Mixtral and Qwen3-MoE) or
    sigmoid scores (normalized over the k chosen, as DeepSeek-V3); ``bias`` [E] is added to
    the scores for the choice only. With ``moe.n_group`` > 1 the choice is among the experts
    of the token's ``topk_group`` best groups only (:func:`within_top_groups`);
    ``norm_topk_prob`` false leaves the k gates unnormalized; ``routed_scaling_factor``
    multiplies them. The probabilities are what the auxiliary loss averages (a sigmoid
    router's scores normalized to sum 1)."""
    moe = cfg.moe
    if moe.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores + jnp.broadcast_to(lax.stop_gradient(bias), scores.shape)
    if moe.n_group > 1:
        choice = within_top_groups(choice, moe.n_group, moe.topk_group)
    _, ids = lax.top_k(choice, moe.top_k)
    gates = jnp.take_along_axis(scores, ids, axis=-1)
    if moe.norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    if moe.routed_scaling_factor != 1.0:
        gates = gates * moe.routed_scaling_factor
    return ids, gates, probs


def within_top_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """``choice`` [..., E] with every expert outside the ``topk_group`` best of ``n_group``
    equal groups set to -inf (DeepSeek-V3's group-limited routing): a group's score is the sum
    of its two best experts' scores. Per token, on this device: no communication."""
    grouped = choice.reshape(*choice.shape[:-1], n_group, -1)
    group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, best = lax.top_k(group_scores, topk_group)
    kept = jnp.sum(jax.nn.one_hot(best, n_group, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def _router_stats(cfg: ModelConfig, ids, probs, logits, dropped: jax.Array) -> dict[str, jax.Array]:
    """The microbatch's statistics: this device's sums over its tokens, summed over the
    batch's shards (d, e, c) in one psum."""
    moe = cfg.moe
    n_experts = moe.n_experts
    load = jnp.sum(jax.nn.one_hot(ids, n_experts, dtype=jnp.float32), axis=(0, 1))
    prob_sum = jnp.sum(probs, axis=0)
    z_sum = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    n_tokens = jnp.asarray(ids.shape[0], jnp.float32)
    local = jnp.concatenate([load, prob_sum, jnp.stack([z_sum, dropped, n_tokens])])
    # Each (d, e, c) shard summed its own tokens: add them up. The t shards computed the same
    # sums (the router reads the normed rows gathered over t): each adds its 1/t share, so
    # the result is the same on every device, as the loss it joins must be.
    total = shardops.psum("G{U_dp,c,t} -> G", local / shardops.axis_size("t"))
    load, prob_sum = total[:n_experts], total[n_experts : 2 * n_experts]
    z_sum, dropped, tokens = total[2 * n_experts], total[2 * n_experts + 1], total[-1]
    f = load / (tokens * moe.top_k)
    weight = moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0
    aux = weight * n_experts * jnp.sum(f * prob_sum / tokens)
    z = moe.z_loss_weight * z_sum / tokens
    return {"load": load, "dropped": dropped, "aux": aux, "z": z, "tokens": tokens}


def _dispatch_plan(cfg: ModelConfig, ids: jax.Array, e: int, cap: int):
    """Where each token copy goes: (its shard r, its slot in r's buffer, its expert's index on
    r), each i32[T, k]; a slot >= ``cap`` is a dropped copy. Copies are ranked by expert, then
    by token, so a shard's buffer holds its experts' copies in expert order."""
    n_local = cfg.moe.n_experts // e
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    shard_sorted = flat[order] // n_local
    counts = jnp.bincount(shard_sorted, length=e)
    starts = jnp.cumsum(counts) - counts  # where each shard's copies begin in sorted order
    slot_sorted = jnp.arange(flat.shape[0]) - starts[shard_sorted]
    slot = jnp.zeros_like(flat).at[order].set(slot_sorted)
    return (
        (flat // n_local).reshape(ids.shape),
        slot.reshape(ids.shape),
        (flat % n_local).reshape(ids.shape),
    )


def _experts(cfg: ModelConfig, w, rows: jax.Array, local: jax.Array) -> jax.Array:
    """This shard's experts on the rows it received, [R C M] -> [R C M] owing a sum over t:
    the rows sorted by expert, one grouped matmul (``lax.ragged_dot``) per projection, and
    back in place. ``local`` i32[R C]: each row's expert on this shard (E/e: an empty slot,
    sorted last, outside every group: its output is 0)."""
    dt = jnp.dtype(cfg.compute_dtype)
    n_local = w.w_gate.shape[0]
    shape = rows.shape
    rows, local = rows.reshape(-1, shape[-1]), local.reshape(-1)
    order = jnp.argsort(local, stable=True)
    sizes = jnp.bincount(local, length=n_local + 1)[:n_local].astype(jnp.int32)
    x = rows[order]
    # FSDP: this shard's experts gathered over d and c (they are split over e already).
    w_gate, w_up, w_down = _gathered_swiglu(w, "w", "expert", "E/e M/d/c X/t -> E/e M X/t", dt)
    # Grouped matmuls summed as shardlib.matmul decides (bf16 in f32), outputs in dt.
    gate = ragged_dot(x, w_gate, sizes)
    up = ragged_dot(x, w_up, sizes)
    y = ragged_dot(jax.nn.silu(gate) * up, jnp.swapaxes(w_down, 1, 2), sizes)
    return jnp.zeros_like(y).at[order].set(y).reshape(shape)


def _gathered_swiglu(w, weights: str, parts: str, spec: str, dt) -> list[jax.Array]:
    """The SwiGLU weights ``{weights}_gate``, ``_up`` and ``_down`` of ``w`` in compute dtype
    ``dt``, each gathered by ``spec`` (FSDP) in its own part ``{parts}_gate``, ..."""
    out = []
    for kind in ("gate", "up", "down"):
        with part(f"{parts}_{kind}"):
            out.append(shardops.all_gather(spec, getattr(w, f"{weights}_{kind}").astype(dt)))
    return out


def moe_ffn(cfg: ModelConfig, w, a: Activations) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """The pre-norm MoE FFN plus the residual ``h``: (a residual in compute dtype, the
    microbatch's routing statistics (:data:`ROUTER_STATS`), every token counted)."""
    moe = cfg.moe
    dt = jnp.dtype(cfg.compute_dtype)
    h = a["h"]
    ln2 = a("ln2", lambda: shardops.all_gather("M/t/fsdp -> M", w.ln2))
    gh = a("gh", lambda: norm_input(cfg, h))
    nh = a("nh", lambda: normed(cfg, gh, ln2))
    b, length, m = nh.shape
    x = nh.reshape(b * length, m)

    with part("router"):
        # f32 logits: the choice and the gates are sensitive to rounding.
        router = shardops.all_gather("M/t/fsdp E -> M E", w.router)
        logits = shardops.einsum_unreduced(
            "T M, M E -> T E", x.astype(jnp.float32), router, out_dtype=jnp.float32
        )
    with part("routing"):
        ids, gates, probs = route(cfg, logits, w.router_bias)

    e = shardops.axis_size("e")
    n_tok = x.shape[0]
    cap = capacity(cfg, n_tok, e)
    shard, slot, local = _dispatch_plan(cfg, ids, e, cap)
    kept = slot < cap
    dropped = jnp.sum(jnp.where(kept, 0.0, 1.0))
    token = jnp.broadcast_to(jnp.arange(n_tok)[:, None], ids.shape)
    # Send buffers [R C M]: each copy in its shard's slot (a dropped one nowhere: mode=drop).
    send = jnp.zeros((e, cap, m), dt).at[shard, slot].set(x[token], mode="drop")
    send_ids = (
        jnp.full((e, cap), moe.n_experts // e, jnp.int32).at[shard, slot].set(local, mode="drop")
    )
    with part("dispatch"):
        # Every shard hands each other its buffer: rows by sending shard, on the receiver.
        recv = shardops.all_to_all("Src/e Dst Slot M -> Src Dst/e Slot M", send[None])[:, 0]
        recv_ids = shardops.all_to_all("Src/e Dst Slot -> Src Dst/e Slot", send_ids[None])[:, 0]
    out_rows = _experts(cfg, w, recv, recv_ids)
    with part("dispatch"):
        back = shardops.all_to_all("Src Dst/e Slot M -> Src/e Dst Slot M", out_rows[:, None])[0]
    with part("combine"):
        copies = back.at[shard, slot].get(mode="fill", fill_value=0)  # [T k M]
        y = einsum("tkm,tk->tm", copies, (gates * kept).astype(copies.dtype))

    if moe.n_shared:  # shared experts: a dense SwiGLU every token passes through
        s_gate, s_up, s_down = _gathered_swiglu(w, "s", "shared", "M/fsdp Sh/t -> M Sh/t", dt)
        sg = shardops.einsum_unreduced("T M, M Sh/t -> T Sh/t", x, s_gate)
        su = shardops.einsum_unreduced("T M, M Sh/t -> T Sh/t", x, s_up)
        y = y + shardops.einsum_unreduced("T Sh/t, M Sh/t -> T M", jax.nn.silu(sg) * su, s_down)

    with part("routing"):
        stats = _router_stats(cfg, ids, probs, logits, dropped)

    def residual() -> jax.Array:
        out = y.reshape(b, length, m).astype(dt)
        # Each t shard contracted only its own slice of X and Sh (X/t, Sh/t): sum the shards,
        # scattered into the residual's layout.
        out = shardops.psum_scatter(f"B/dp L@zigzag/c M -> {cfg.residual_spec}", out)
        return (h + out).astype(dt)

    return a("out", residual), stats
