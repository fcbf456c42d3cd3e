"""The hand-written backward pass of transformer.py's model (seed 001, Parts 3-4), in shardops.

    cfg = ModelConfig(..., backward="explicit")                     # model.backward=explicit
    jax.grad(loss_fn)(weights, tokens, is_seq_start, cfg, mesh)     # runs the backward below

Inside the model's shard_map, :func:`explicit_terms_and_stats` is a ``jax.custom_vjp`` over the
whole model. Its value is transformer.py's forward pass, unchanged (so eval and generation
are the same programs whichever backward is chosen); under differentiation its forward keeps
per layer what ``cfg.remat`` says (:func:`kept_activations`), and its backward is written out here, layer
by layer in reverse under ``lax.scan``, in the same notation as the forward. Gradients come
out in the weights' own layouts, as a :class:`~seqshard.model.weights.Weights`.

Dimensions and mesh axes as in transformer.py: B, L (Qlen, Klen), M, F, V, Q, K, D; d, e, c
(batch and weight rows), t (tensor). A block kind's own backward sits in its module
(attention_block.py, swiglu.py; the pieces they share in grads.py); a block without one (moe.py)
is differentiated by ``jax.vjp`` of its forward inside this backward. Every weight's gradient follows one pattern, the
transpose of the forward's all_gather -> einsum:

    w = all_gather('M/fsdp F/t -> M F/t', w)                          # again, as FSDP does
    dw = einsum_unreduced('B/dp L@zigzag/c M, B/dp L@zigzag/c F/t -> M F/t{U_dp,c}', nx, dy)   # sums this B/dp only
    dw = psum_scatter('M F/t{U_fsdp} -> M/fsdp F/t', dw)                 # FSDP's reduce-scatter

Communication per layer, backward pass (``remat=saved``; each line is the transpose of a
forward collective, or the forward's own collective repeated to recompute what is not kept):

    all_gather over t,d   ln1, ln2                       recomputed (tiny)
    all_gather over t     x, h                           recomputed: the norms' inputs
    all_gather over d     w_q, w_kv, w_o, w_gate, w_up, w_down   recomputed, as FSDP does
    all_gather over t     dL/dh, dL/dout                 transposes of the output psum_scatters
    psum_scatter over d   the six matrices' gradients    transposes of their gathers
    psum_scatter over t,d ln1, ln2 gradients             transposes of their gathers
    psum_scatter over t   dL/dx twice                    transposes of the residual's gathers
    psum over t,d,e,c     q_norm, k_norm gradients       model.qk_norm only: the gains rest replicated
    with c > 1:           allgather: k, v gathered over c again (recomputed) and dk, dv
                          reduce-scattered over c (their transposes); ring: the backward's
                          own ring (c-1 shifts of k and v, c of dk and dv; context.py)

(d in the weights' gathers and reduce-scatters stands for (d, e, c): weights are split over all three.)

``remat=full`` recomputes the attention output's psum_scatter too (h is not kept);
``remat=none`` keeps every activation, gathered weights included, and recomputes nothing.
Outside the layers: the loss needs no collective (the per-position max and sums over the
vocab blocks were all-reduced in the forward and are kept), the unembedding and the three
norms reduce-scatter their gradients, and the embedding gathers dL/dx over t and
reduce-scatters its table over d. So the step holds exactly autodiff's collectives
(tests/model/test_backward.py counts them in the compiled HLO).

How the seed's open questions are resolved:

* **Residual 'B/dp L@zigzag/c M' or 'B/dp L@zigzag/c M/t'.** The forward's residual between blocks
  (``model.residual``: 'B/dp L@zigzag/c M/t', or 'B/dp L/t M' under sequence parallelism; every spec
  below that names the residual reads ``cfg.residual_spec``): the scan carries dL/dx split over t, and the seed's 'B/dp L@zigzag/c M' gradient exists only
  inside a block, gathered over t just before the output projections' backward (the
  transposes of the forward's psum_scatters). Keeping 'B/dp L@zigzag/c M' through the layer would need
  an all-reduce over t where the norms' partial sums meet the residual (the same bytes as
  reduce-scatter + all-gather) and t times the memory for the carry.
* **Where the sums over t happen.** Einsums that contract a t-split dimension (F/t into the
  FFN norm, K/t into the attention norm, V/t into the final norm) leave dL/d(normed input)
  owing a sum over t. The RMSNorm backward is linear in its cotangent (the gathered input it
  also reads is whole), so it runs on the partial sums, and the one reduce-scatter that
  transposes the residual's all_gather does the sum over t and lands it split over t: no
  all-reduce, nowhere.
* **Norm gains.** dL/dgain sums dy * x / rms(x) over this device's B/dp rows of a dy that owes
  a sum over t: 'M{U_t,dp,c}', reduced by one psum_scatter over (t, d) straight into
  'd_model/t/fsdp', t major, the one order weights.py declares for all three norms (ln1, ln2,
  final_norm) and their forward all_gathers read.
* **Why gather a weight only to reduce-scatter its gradient (the seed's TODO at unembed).**
  The table rests split 'V/t M/fsdp' (FSDP); the logits contract all of M, so it is gathered
  over d. Each d shard then holds other batch rows, so its gradient of the whole gathered
  table is a partial sum over d: the psum_scatter adds the shards' partials and hands each
  one its own M/fsdp block, the layout the optimizer updates. It is the gather's transpose and
  the gradient's only communication (the same for every matrix).
* **index_add.** :func:`seqshard.shardlib.shardops.index_add`, the transpose of ``index_unreduced``:
  each t shard scatter-adds the rows of its vocab block, owing the other d shards' rows, and
  a psum_scatter over d lands the table gradient 'V/t M/fsdp'.
* **Fused attention.** For ``attention_impl`` cudnn, xla, splash and pallas the backward calls the
  implementation's own VJP (``jax.vjp``) for the attention core only (softmax(q k^T) v); it
  re-runs the kernel's forward for its residuals, as those kernels do. Einsum attention
  (and everything around every core) is hand-written.

Numerics mirror autodiff of the forward: cotangents of compute-dtype values are in the
compute dtype (so matrix gradients are reduce-scattered in it, as autodiff transposes the
gather of the cast weight), norms, softmax, logits and the loss are in f32, and every gradient
is cast to f32, the weights' dtype. In f32 the gradients equal autodiff's to rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from seqshard.batch import TokenBatch
from seqshard.model.block import Activations as BlockActivations
from seqshard.model.block import Block, LayerInputs, has_aux, kept, weight_info
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, sequence_rows
from seqshard.model.grads import norm_backward
from seqshard.model.layers import (
    MTP_STACK,
    Stack,
    layer_forward,
    layer_inputs,
    read_after,
    run_stack,
    stacks,
    with_aux_losses,
)
from seqshard.model.mtp import gathered_tables, mtp_before_head, mtp_loss, with_mtp
from seqshard.model.transformer import (
    HEAD,
    embed,
    final_norm,
    forward_terms_and_aux,
    loss_terms_and_softmax,
    unembed,
)
from seqshard.model.weights import Weights
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.dataflow import after
from seqshard.shardlib.shapecheck import block_axes, block_axes_scope, shape_scope

__all__ = [
    "embed_backward",
    "explicit_run_stack",
    "explicit_terms_and_aux",
    "head_backward",
    "head_forward",
    "kept_activations",
    "layer_activations",
    "layer_backward",
]

Activations = dict[str, jax.Array]


def kept_activations(cfg: ModelConfig, blocks: tuple[Block, ...], c: int = 1) -> tuple[str, ...]:
    """What the forward pass keeps per layer of ``blocks`` under ``cfg.remat`` on a mesh whose
    context axis has size ``c`` (:func:`seqshard.model.block.kept`): ``saved`` the values the
    blocks mark, ``full`` the layer input, ``none`` everything the hand-written backwards read
    (fused attention has no probabilities, only the ring a logsumexp, and with c = 1 the keys
    are k itself). A block differentiated by ``jax.vjp`` keeps nothing: it re-runs."""
    return kept(blocks, cfg, c)


# ---------------------------------------------------------------------------------------------
# One layer: its forward rebuilt from what it kept, and its backward, block by block


def _block_fields(block: Block, w) -> list[str]:
    """The weight fields of ``block`` the layer ``w`` holds."""
    have = {f.name for f in dataclasses.fields(w)}
    return [name for name in weight_info(block.weights) if name in have]


def _block_vjp(cfg: ModelConfig, blocks, block: Block, inputs: LayerInputs, w, x: jax.Array):
    """(the block's output, the pullback of ``x`` and its weights): its forward from its input
    ``x``, differentiated by ``jax.vjp`` (it has no hand-written backward). Its auxiliary
    outputs' ``loss`` fields are outputs too (the loss adds them)."""
    fields = _block_fields(block, w)

    def forward(x, w_block):
        a = BlockActivations(blocks, {block.input: x})
        out = block.forward(cfg, inputs, dataclasses.replace(w, **w_block), a)
        if not has_aux(block, cfg):
            return out
        out, aux = out
        return out, tuple(aux[f] for f in block.aux.loss)

    out, pullback = jax.vjp(forward, x, {name: getattr(w, name) for name in fields})
    return (out if not has_aux(block, cfg) else out[0]), pullback


def layer_activations(
    cfg: ModelConfig, blocks: tuple[Block, ...], inputs: LayerInputs, w, kept_values
) -> tuple[BlockActivations, dict]:
    """One layer's forward again for its backward, from what the forward pass kept (at least
    its input): each block with a hand-written backward through one recorder, taking the kept
    values as they are and computing every other value a backward reads, nothing more; each
    block without one by ``jax.vjp`` (:func:`_block_vjp`), its output handed on. Returns
    (the recorder, {block: pullback})."""
    a = BlockActivations(blocks, kept_values, explicit=True, only_needed=True)
    pullbacks = {}
    for block in blocks:
        if block.backward is not None:
            block.forward(cfg, inputs, w, a)
            continue
        # Re-run inside the backward: its collectives and their transposes are the backward's.
        with collective_log.vjp_in_backward():
            out, pullbacks[block.name] = _block_vjp(cfg, blocks, block, inputs, w, a[block.input])
        a.values[block.output] = out
    return a, pullbacks


def layer_backward(
    cfg: ModelConfig,
    blocks: tuple[Block, ...],
    inputs: LayerInputs,
    w,
    a: BlockActivations,
    pullbacks: dict,
    d_out: jax.Array,
    d_loss: dict[str, jax.Array],
):
    """dL/d(the layer's input) (a residual) and its weights' gradients (the layer's type, each
    field in its own layout, f32), from its rebuilt activations and dL/d(output) ``d_out``:
    each block's backward in reverse. ``d_loss``: per block with loss fields, dL/d(each of
    them), in their order."""
    grads, d = {}, d_out
    for block in reversed(blocks):
        if block.backward is not None:
            d, block_grads = block.backward(cfg, inputs, w, a, d)
        else:
            cotangent = d
            if has_aux(block, cfg):
                cotangent = (d, d_loss.get(block.name, ()))
            with collective_log.vjp_in_backward():
                d, block_grads = pullbacks[block.name](cotangent)
            # The router bias is no trained weight: the forward reads it without a gradient.
            block_grads = {k: v.astype(jnp.float32) for k, v in block_grads.items()}
        grads.update(block_grads)
    return d, type(w)(**grads)


# ---------------------------------------------------------------------------------------------
# Outside the layers: the final norm, unembedding and loss; the embedding


def head_forward(
    cfg: ModelConfig, w: Weights, x: jax.Array, rows: SequenceRows
) -> tuple[jax.Array, Activations]:
    """transformer.py's final_norm, unembed and loss on the last residual: the loss terms f32[2]
    and what the backward keeps of them (everything it reads, as autodiff keeps outside the
    scanned layers): the head's activations (:data:`~seqshard.model.transformer.HEAD`) and
    the softmax's pieces."""
    a = BlockActivations((HEAD,))
    logits = unembed(cfg, w, final_norm(cfg, w, x, a), a)
    terms, exp, sum_exp = loss_terms_and_softmax(logits, rows.targets, rows.counted)
    return terms, {**a.values, "exp": exp, "sum_exp": sum_exp}


def head_backward(
    cfg: ModelConfig, kept: Activations, rows: SequenceRows, d_total: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dL/dx of the last residual and the gradients of ``final_norm`` and
    ``unembed`` in their layouts, given dL/d(summed loss) ``d_total`` (a scalar)."""
    dt, f32 = jnp.dtype(cfg.compute_dtype), jnp.float32
    targets, counted = rows.targets, rows.counted
    # The loss psum over (d, e, c) transposes to each shard taking d_total for its own positions.
    d_nll = d_total * counted.astype(f32)
    # nll = log(sum_exp) + shift - target_logit. The psum over t of sum_exp and target_logit
    # transposes to each t shard taking the whole cotangent for its vocab block: dL/dlogits is
    # softmax - onehot(target) on the block, no communication. (shift only stabilizes.)
    exp, sum_exp = kept["exp"], kept["sum_exp"]
    vocab_block = exp.shape[-1]
    local_target = targets - shardops.axis_index("t") * vocab_block
    is_target = jnp.arange(vocab_block)[None, None, :] == local_target[..., None]  # none elsewhere
    d_logits = (d_nll / sum_exp)[..., None] * exp - jnp.where(is_target, d_nll[..., None], 0.0)
    d_logits = d_logits.astype(dt)
    # unembed: logits = nx . table^T, the table gathered over d.
    ln, gx, nx, table = kept["ln"], kept["gx"], kept["nx"], kept["table"]
    d_nx = shardops.einsum_unreduced(
        "B/dp L@zigzag/c V/t, V/t M -> B/dp L@zigzag/c M{U_t}", d_logits, table
    )
    d_table = shardops.einsum_unreduced(
        "B/dp L@zigzag/c M, B/dp L@zigzag/c V/t -> V/t M{U_dp,c}", nx, d_logits
    )
    # Each d shard summed over its own B/dp rows: sum the shards, keep FSDP's M/fsdp.
    with part("logits"):
        d_unembed = shardops.psum_scatter("V/t M{U_fsdp} -> V/t M/fsdp", d_table).astype(f32)
    # final_norm, with d_nx owing the sum over the vocab blocks (as in layer_backward).
    with part("final_norm"):
        d_x, d_final_norm = norm_backward(cfg, gx, ln, d_nx)
    return d_x, d_final_norm, d_unembed


@part("embed")
def embed_backward(
    cfg: ModelConfig, tokens: jax.Array, d_x: jax.Array, d_table: jax.Array | None = None
) -> jax.Array:
    """The embedding table's gradient 'V/t M/fsdp' (f32) from dL/dx of the first
    residual: the transpose of transformer.py's ``embed``. ``d_table``: another use's
    gradient of the gathered table 'V/t M' (the multi-token prediction modules'), this
    device's share, summed in the same reduction."""
    # The forward's psum_scatter summed the vocab shards' lookups over t; its transpose gives
    # every t shard the gradient of all of M.
    g = shardops.all_gather(f"{cfg.residual_spec} -> B/dp L@zigzag/c M", d_x)
    # index_unreduced's transpose: each t shard adds up the rows of its vocab block, over its
    # own B/dp rows only.
    summed = shardops.index_add(
        "B/dp L@zigzag/c M, B/dp L@zigzag/c -> V/t M{U_dp,c}", g, tokens, vocab=cfg.vocab
    )
    if d_table is not None:
        summed = summed + d_table.astype(summed.dtype)
    # Each d shard summed its own rows: sum the shards, keep FSDP's M/fsdp (the gather's transpose).
    return shardops.psum_scatter("V/t M{U_fsdp} -> V/t M/fsdp", summed).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# A stack of layers, and the whole model as a custom VJP inside the shard_map


_RECOMPUTE = "rematted_computation"


def _stack_keeping(cfg: ModelConfig, stack: Stack, rows: SequenceRows, x: jax.Array, w):
    """The residual through the stacked layers ``w`` of ``stack`` (inside
    ``hand_differentiated``): (the output, per layer what ``cfg.remat`` keeps for
    :func:`_stack_backward`, per layer its auxiliary outputs)."""
    keep = kept_activations(cfg, stack.blocks, shardops.axis_size("c"))
    inputs = layer_inputs(cfg, rows)

    def layer(x, w_layer):
        a = BlockActivations(stack.blocks, {stack.blocks[0].input: x}, explicit=True)
        out, aux = layer_forward(cfg, stack.blocks, inputs, w_layer, a)
        return out, ({name: a[name] for name in keep}, aux)

    x, (kept_values, aux) = collective_log.scan(stack.name, layer, x, w)
    return x, kept_values, aux


def _stack_backward(cfg: ModelConfig, stack: Stack, rows: SequenceRows, w, kept, d_out, d_loss):
    """(dL/d(the stack's input), its layers' gradients): the layers in reverse, each one's
    activations rebuilt from what it kept (inside the backward's scopes). ``d_loss``: per
    block with loss fields, dL/d(each of them), f32[layers] each."""
    inputs = layer_inputs(cfg, rows)

    def layer(d_out, xs):
        w_layer, kept_layer, d_loss_layer = xs
        # Named as JAX names remat's recomputation, so HLO audits (seqshard.shardlib.comms)
        # put its re-gathers in the 'recompute' phase, as for autodiff.
        with jax.named_scope(_RECOMPUTE), collective_log.phase("recompute"):
            a, pullbacks = layer_activations(cfg, stack.blocks, inputs, w_layer, kept_layer)
        return layer_backward(cfg, stack.blocks, inputs, w_layer, a, pullbacks, d_out, d_loss_layer)

    return collective_log.scan(stack.name, layer, d_out, (w, kept, d_loss), reverse=True)


def _loss_cotangents(stack: Stack, d: jax.Array) -> dict[str, tuple[jax.Array, ...]]:
    """Per block of ``stack`` with loss fields, each one's cotangent per layer: ``d``, the
    summed loss's cotangent times the counted positions (the loss adds them so)."""
    out = {}
    for b in stack.aux_blocks:
        if b.aux.loss:
            d_layers = jnp.broadcast_to(d, (stack.n_layers,))
            out[b.name] = tuple(d_layers for _ in b.aux.loss)
    return out


def explicit_terms_and_aux(
    cfg: ModelConfig, w: Weights, batch: TokenBatch
) -> tuple[jax.Array, dict]:
    """:func:`~seqshard.model.transformer.forward_terms_and_aux`, whose gradient is the
    hand-written backward pass of this module (a block without one differentiated by
    ``jax.vjp`` inside it: :func:`layer_activations`)."""
    axes = block_axes()
    if axes is None:
        raise ValueError(
            "explicit_terms_and_aux runs on per-device blocks, inside the model's shard_map "
            "(loss_fn, batch_loss_terms); it was called outside one."
        )
    sizes = (tuple(axes.sizes.items()), axes.manual)
    return _with_explicit_backward(cfg, sizes, w, batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_explicit_backward(cfg, axes, w, batch):
    # Not differentiated (eval): the model's forward pass itself.
    return forward_terms_and_aux(cfg, w, batch)


def _forward(cfg: ModelConfig, axes, w: Weights, batch: TokenBatch):
    """The forward pass for differentiation: the loss terms, the auxiliary outputs, and what
    the backward reads."""
    with collective_log.hand_differentiated():  # _backward logs its own collectives
        rows = sequence_rows(batch.tokens, batch.is_seq_start, batch.loss_mask, cfg.mtp.depth)
        x = embed(cfg, w, rows.tokens)
        kept_values, aux = {}, {}
        for stack in stacks(cfg):
            x, kept_values[stack.name], out = _stack_keeping(
                cfg, stack, rows, x, getattr(w, stack.name)
            )
            if out:
                aux[stack.name] = out
        last = x if cfg.mtp.depth else None
        x, mtp, mtp_aux = mtp_before_head(cfg, w, rows, x)
        terms, head = head_forward(cfg, w, x, rows)
        terms, aux = with_mtp(with_aux_losses(cfg, terms, aux), mtp), {**aux, **mtp_aux}
    # The weights are kept as they are (FSDP shards): the backward gathers them again. The
    # last residual too, when the multi-token prediction modules re-run from it.
    return (terms, aux), (w, rows, kept_values, head, terms[1], last)


def _backward(cfg: ModelConfig, axes, residuals, cotangents):
    """The backward pass: Weights of gradients in their own layouts; the batch (ids, starts
    and the loss mask) gets none."""
    w, rows, kept_values, head, count, last = residuals
    d_total = cotangents[0][0]
    sizes, manual = axes
    grads = {}
    # Traced when JAX transposes the shard_map, after the body's scopes closed: reopen them.
    with block_axes_scope(dict(sizes), manual), shape_scope(), collective_log.phase("backward"):
        d_x, grads["final_norm"], grads["unembed"] = head_backward(cfg, head, rows, d_total)
        d_table = d_out_table = None
        if last is not None:
            # The modules read the last residual beside the head, and the shared embedding
            # and output head: their shares of those gradients add up. They run after the
            # head's backward (reading its result): one order of collectives on every device.
            d_last, grads[MTP_STACK], d_table, d_out_table = _mtp_backward(
                cfg, w, rows, after(last, d_x), d_total * count
            )
            d_x = d_x + d_last.astype(d_x.dtype)
        for stack in reversed(stacks(cfg)):
            # The loss fields joined the summed loss times the positions counted.
            d_loss = _loss_cotangents(stack, d_total * count)
            d_x, grads[stack.name] = _stack_backward(
                cfg, stack, rows, getattr(w, stack.name), kept_values[stack.name], d_x, d_loss
            )
        # The stacks' backwards are loops, the last stack's first: the gradients of every
        # stack but the first read the first one's result, as autodiff's do
        # (layers.gradients_after_input), so the optimizer's reductions of them follow it.
        for stack in stacks(cfg)[1:]:
            grads[stack.name] = read_after(grads[stack.name], d_x)
        grads["embed"] = embed_backward(cfg, rows.tokens, d_x, d_table)
        if d_out_table is not None:
            # The modules' share of the unembedding's gradient, summed over d, e, c once the
            # layers' loops are done (reading their result).
            with part("logits"):
                d_out = shardops.psum_scatter(
                    "V/t M{U_fsdp} -> V/t M/fsdp", after(d_out_table, d_x)
                )
            grads["unembed"] = grads["unembed"] + d_out.astype(jnp.float32)
    return type(w)(**grads), None


def _mtp_backward(cfg: ModelConfig, w: Weights, rows, last: jax.Array, d_value):
    """The multi-token prediction modules' backward: their forward re-run from the last
    residual under ``jax.vjp`` (as a block without a hand-written backward), pulled back from
    dL/d(their value) ``d_value`` (the summed loss adds it times the counted positions):
    (dL/d last residual, the modules' gradients, dL/d the gathered embedding and unembedding
    'V/t M', each device's share, owing the sum over d, e, c that their gradients' reductions
    do)."""
    tables = gathered_tables(cfg, w)  # the forward's gathers: one value each to XLA

    def value(x, w_mtp, tables):
        shared = dataclasses.replace(w, **{MTP_STACK: w_mtp})
        return mtp_loss(cfg, shared, rows, x, remat=False, tables=tables)[0]

    with collective_log.vjp_in_backward():
        primals = (last, getattr(w, MTP_STACK), tables)
        # The re-run is the backward's recomputation, named as _stack_backward's is.
        with jax.named_scope(_RECOMPUTE), collective_log.phase("recompute"):
            _, pullback = jax.vjp(value, *primals)
        d_x, d_mtp, (d_table, d_out_table) = pullback(d_value)
    d_mtp = jax.tree.map(lambda g: g.astype(jnp.float32), d_mtp)
    return d_x, d_mtp, d_table, d_out_table


_with_explicit_backward.defvjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------
# A pipeline stage's layers


def _stage_static(name: str):
    """What a stage's custom VJP needs to reopen its scopes: (the block's axes, the log's
    place). ``name``, the entry point, runs inside the model's shard_map only."""
    axes = block_axes()
    if axes is None:
        raise ValueError(f"{name} runs inside the model's shard_map.")
    return ((tuple(axes.sizes.items()), axes.manual), collective_log.place())


@contextlib.contextmanager
def _stage_scopes(static, scope: contextlib.AbstractContextManager):
    """The scopes of a stage's forward or backward, where JAX traces it after the tick loop's
    body closed them: the block's axes and shapes, the log's place, and ``scope`` (the log's
    hand-differentiated marker or its backward phase)."""
    (sizes, manual), where = static
    with block_axes_scope(dict(sizes), manual), shape_scope(), collective_log.at(where), scope:
        yield


def explicit_run_stack(cfg: ModelConfig, stack: Stack, rows: SequenceRows, x: jax.Array, w):
    """:func:`~seqshard.model.layers.run_stack` (the residual through a pipeline stage's
    block of ``stack``: (the residual, its layers' auxiliary outputs)), whose gradient is
    this module's layer backward, the layers in reverse; the auxiliary outputs' loss fields
    take their cotangents (the loss adds them), the rest have none. ``rows`` are the rows'
    ids and positions (no gradient)."""
    static = _stage_static("explicit_run_stack")
    return _stage_with_explicit_backward(cfg, (stack, static), w, x, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stage_with_explicit_backward(cfg, stack_static, layers, x, rows):
    stack, _ = stack_static
    with collective_log.hand_differentiated(), collective_log.custom_vjp_primal():
        return run_stack(cfg, stack, rows, x, layers)


def _stage_forward(cfg: ModelConfig, stack_static, layers, x: jax.Array, rows: SequenceRows):
    stack, static = stack_static
    # Traced when JAX differentiates the tick loop (the stage's scopes closed): reopen them.
    with _stage_scopes(static, collective_log.hand_differentiated()):
        y, kept_values, aux = _stack_keeping(cfg, stack, rows, x, layers)
    return (y, aux), (layers, rows, kept_values)


def _stage_backward(cfg: ModelConfig, stack_static, residuals, cotangents):
    stack, static = stack_static
    layers, rows, kept_values = residuals
    d_y, d_aux = cotangents
    # The loss fields' cotangents (the loss reads them); the other fields have none.
    d_loss = {
        b.name: tuple(d_aux[b.name][f] for f in b.aux.loss) for b in stack.aux_blocks if b.aux.loss
    }
    # Traced when JAX transposes the tick loop, after the body's scopes closed: reopen them.
    with _stage_scopes(static, collective_log.phase("backward")):
        d_x, d_layers = _stack_backward(cfg, stack, rows, layers, kept_values, d_y, d_loss)
    # rows: ids and positions, no gradient (per-step state such as the router bias is among
    # the layers, read without one: its own update is the train step's).
    return d_layers, d_x, None


_stage_with_explicit_backward.defvjp(_stage_forward, _stage_backward)
