"""A training step's collectives, predicted from the notation without compiling.

    calls = collectives_per_step(cfg)      # cfg's mesh resolved; no device, nothing compiled
    print(format_planned_table(calls))     # per phase and per layer (`seqshard show`)

The step's loss and gradient (``seqshard.train.step.grads_and_loss``, every microbatch) are
traced with ``jax.eval_shape`` on an ``AbstractMesh`` of the config's sizes, under
:func:`seqshard.shardlib.collective_log.recording`: each shardops call logs the collective it lowers
to. From that log:

* **forward**: what the forward pass logged;
* **backward**: with ``model.backward=autodiff``, the transpose of each forward collective
  (:func:`seqshard.shardlib.collective_log.transpose`); with ``explicit``, what backward.py logged;
* **recompute**: with autodiff, the forward collectives of the layer body that the remat
  policy re-runs in the backward pass (:func:`recomputed`); with ``explicit``, what
  backward.py logged as recomputation.

* **update**: the optimizer's: with ``train.optimizer=muon``, the all_to_alls (and the Gram
  all-reduces of far-wide matrices) that move each matrix's momentum whole onto devices and
  back (:mod:`seqshard.train.muon`), traced from the optimizer's update the same way.

AdamW runs no shardops (its global gradient norm, Muon's too, is plain jit: XLA adds a few
all-reduces of f32 scalars there, not predicted). One XLA optimization is modelled because it
changes calls per step: with microbatches, the gathers of the weights outside the layer scan
(embedding, unembedding, final norm) do not depend on the microbatch, and XLA hoists them out
of the accumulation loop, once per step. tests/plan/test_step_comms.py holds the prediction
equal to the compiled HLO (:mod:`seqshard.shardlib.comms`) kind by kind, per phase, in and out
of loops.

A layer stack of one layer (a model of one layer; tiny-cpu-moe's dense first layer and its one
MoE layer) is a loop of one trip: XLA inlines it, so the layer's forward and backward pass land
in one computation (the step's, or the microbatch loop's body), where XLA's CSE merges an
instruction with an identical one on the same operands, and its all-reduce combiner merges
independent all-reduces over the same devices (:func:`_as_compiled`; stacks of two layers or
more run forward and backward in two loops, and compile as written). Per collective the
backward pass re-runs there:

* it reads the value the forward's read, so it is the forward's (merged): a weight's
  re-gather (the same shard; with microbatches also loop-invariant, hoisted out of the loop
  once per step like the weights outside the stacks), and a collective on the layer's input
  or on a value the forward kept (the log's ``operand``: ``'input'``, or ``'saved'`` under
  ``remat=saved``), such as the norms' gathers of x and h with ``model.residual=M/t`` or
  allgather's k and v over c;
* without microbatches, an activation the hand-written backward (``model.backward=explicit``)
  rebuilds from those (the normalized inputs' gathers, ``remat=full``'s attention-output
  psum_scatter): the forward's own functions on the same values, merged too. With
  microbatches XLA first hoists the forward's and the recompute's weight gathers out of the
  loop as two values (CSE merges them outside it), so the activations made from them inside
  the loop differ;
* what autodiff's remat or the MoE FFN's ``jax.vjp`` recomputes: JAX re-traces it through its
  JVP rules, other instructions for the same values (the norm's rsqrt on another shape), so
  neither its collectives nor what they feed (the exchanges over e) are merged; but its
  all-reduce (the routing statistics' psum) and the forward's are independent and over the
  same devices: combined, one call of two arrays (``PlannedCollective.arrays``), phase
  'recompute' (as XLA names the combined call).

A merged gather is named after the forward (XLA keeps its name), except with autodiff and
microbatches, where the MoE stack's hoisted gathers keep the recompute's name (calls and
bytes as predicted). Not modelled: with ``model.residual=M/t``, the MoE FFN's ``jax.vjp``
reads h as the forward kept it, but as a value of the vjp's own trace, not marked
``'input'``: its norm's gather is merged, one call fewer than predicted per MoE layer; a
pipeline stage of one layer (inside the schedule's loop); and one multi-token prediction
module (``model.mtp.depth: 1``, a loop XLA inlines), whose re-run in the backward XLA merges
and combines with the forward's in ways this does not follow (a few calls off; two or more
modules compile as predicted).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
from jax.sharding import AbstractMesh, AxisType

from seqshard.batch import batch_structs
from seqshard.config import Config
from seqshard.model.cost import recomputes
from seqshard.model.layers import MTP_STACK, STACK_NAMES
from seqshard.model.weights import weight_structs
from seqshard.shardlib import collective_log
from seqshard.shardlib.collective_log import LoggedCollective
from seqshard.shardlib.comms import ring_bytes_sent
from seqshard.shardlib.remat import SavedRemat, remat_policy
from seqshard.shardlib.tables import format_bytes, format_table

__all__ = [
    "PHASES",
    "PlannedCollective",
    "collectives_per_step",
    "format_planned_table",
    "logged_step",
    "logged_update",
    "recomputed",
]

PHASES = ("forward", "recompute", "backward", "update")


@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    """One collective of the step as the code writes it, and how often a step runs it."""

    what: str  # the model operation and the op spec, e.g. "q: all_gather('M/d Q K/t D -> ...')"
    phase: str  # 'forward', 'recompute' (re-run in the backward pass) or 'backward'
    kind: str  # 'all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all'
    axes: tuple[str, ...]  # mesh axes it runs over (those of size 1 left out)
    group_size: int
    result_bytes: int  # per device, per call
    calls: int  # per step
    weights: bool  # weight traffic (overlaps with compute) rather than activations
    in_layers: bool = False  # in the scanned layer body (calls = layers x microbatches)
    in_loop: bool = False  # inside any loop of the compiled step (layers or microbatches)
    result_shape: tuple[int, ...] = ()  # of each array
    dtype: str = "float32"
    arrays: int = 1  # per call: 2 where XLA combined two all-reduces (result_bytes counts both)

    @property
    def axis_key(self) -> str:
        """``'d'``, ``'t'``, ``'t/d'``: the axes as :func:`seqshard.shardlib.comms.format_comm_table` keys them."""
        return "/".join(self.axes)

    @property
    def bytes_per_call(self) -> float:
        return ring_bytes_sent(self.kind, self.group_size, self.result_bytes)

    @property
    def bytes_per_step(self) -> float:
        return self.calls * self.bytes_per_call


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
    )


def logged_step(cfg: Config) -> list[LoggedCollective]:
    """What the shardops calls of one training step's loss and gradient log (traced once,
    nothing compiled): the forward's collectives and, with ``model.backward=explicit``, the
    hand-written backward's."""
    return list(_logged_step(cfg))


@functools.lru_cache(maxsize=64)
def _logged_step(cfg: Config) -> tuple[LoggedCollective, ...]:
    from seqshard.train.step import grads_and_loss  # the train layer's step: imports this one

    mesh = _abstract_mesh(cfg.mesh.sizes())
    weights = weight_structs(cfg.model)
    batch = batch_structs(cfg.train.batch_size, cfg.train.seq_len)
    log = collective_log.traced(lambda w, b: grads_and_loss(w, b, cfg, mesh), weights, batch)
    return tuple(log.calls)


def logged_update(cfg: Config) -> list[LoggedCollective]:
    """What the shardops calls of one optimizer update log (traced once, nothing compiled):
    Muon's (:mod:`seqshard.train.muon`); AdamW's: none."""
    return list(_logged_update(cfg))


@functools.lru_cache(maxsize=64)
def _logged_update(cfg: Config) -> tuple[LoggedCollective, ...]:
    if cfg.train.optimizer == "adamw":
        return ()
    from seqshard.train.optimizer import make_optimizer  # the train layer's: imports this one

    mesh = _abstract_mesh(cfg.mesh.sizes())
    weights = weight_structs(cfg.model)
    opt = make_optimizer(cfg.train, cfg.model, mesh)
    state = jax.eval_shape(opt.init, weights)
    return tuple(collective_log.traced(opt.update, weights, state, weights).calls)


def recomputed(c: LoggedCollective, remat: str) -> bool:
    """Whether autodiff's backward pass re-runs forward collective ``c`` under ``remat``.

    Only the scanned layer body is checkpointed. No policy keeps a gathered weight (the
    ``saved`` policy keeps what the model marks, and it marks no weight), so under ``saved``
    and ``full`` every layer weight is gathered again; an activation collective is re-run when
    the policy re-runs the operation it belongs to (its declaration's ``recomputed_by``,
    :func:`seqshard.model.cost.recomputes`: the norms' gathers under both, the attention
    output's reduce-scatter under ``full``, the FFN output's never, since nothing in the
    backward pass reads it)."""
    in_layers = _in_layer_loop(c)
    if not in_layers or remat_policy(remat).checkpoint_policy is None:
        return False
    return c.weight or recomputes(remat, c.part or "")


def collectives_per_step(cfg: Config) -> list[PlannedCollective]:
    """Every collective a training step of ``cfg`` (mesh resolved) runs, per device."""
    m, k = cfg.model, cfg.train.microbatches
    logged = logged_step(cfg)
    steps: list[tuple[LoggedCollective, str, str]] = []  # (collective, phase, how)
    gathered = set()  # the weights gathered outside every layer loop so far
    for c in logged:
        if c.vjp_primal:
            continue  # the step differentiates it: its custom VJP's forward rule runs instead
        # The same weight gathered again outside the layer loops (the multi-token prediction
        # modules' embedding and unembedding, the model's own): one value to XLA's CSE, one
        # collective. Its transpose stays: each use's gradient is reduce-scattered.
        merged = False
        if c.weight and c.kind == "all-gather" and not _in_layer_loop(c):
            merged = _gather_key(c) in gathered
            gathered.add(_gather_key(c))
        if c.vjp_in_backward:
            # jax.vjp inside the hand-written backward: its forward re-runs there, and JAX's
            # transposes of its collectives are the backward's. The re-run's own output is
            # discarded (only its pullback is used), so XLA drops the collectives that only
            # make it: the operations no policy re-runs (the block's residual add). The
            # multi-token prediction modules' re-run makes what their backward reads (each
            # module's output feeds the next and its head): all of it stays.
            rerun = c.weight or recomputes("full", c.part or "") or c.in_loop(MTP_STACK)
            if rerun and not merged:
                steps.append((c, "recompute", ""))
            back = collective_log.transpose(c)
            if back is not None:
                steps.append((back, "backward", " transposed"))
            continue
        if c.phase != "forward" or not c.autodiff:
            if not merged:
                steps.append((c, c.phase, ""))  # hand-written: as logged
            if c.phase == "forward" and m.backward == "autodiff" and recomputed(c, m.remat):
                # A custom VJP inside autodiff's model (the ring over c): remat re-runs its
                # forward, whose residuals nothing marks; its backward logs itself.
                steps.append((c, "recompute", ""))
            continue
        if not merged:
            steps.append((c, "forward", ""))
        if recomputed(c, m.remat):
            steps.append((c, "recompute", ""))
        back = collective_log.transpose(c)
        if back is not None:
            steps.append((back, "backward", " transposed"))
    steps += [(c, "update", "") for c in logged_update(cfg)]
    out = []
    for c, phase, how, arrays in _as_compiled(steps, m.remat, k):
        calls = c.calls
        # XLA inlines a loop of one trip (a stack of one layer, one microbatch).
        in_loop = any(trips > 1 for _, trips in c.loops)
        in_layers = _in_layer_loop(c)
        if (
            phase == "forward"
            and c.weight
            and c.kind == "all-gather"
            and (not in_layers or _in_inlined_stack(c))
        ):
            # Loop-invariant: XLA hoists it out of the microbatch loop (see the docstring).
            calls, in_loop = calls // k if c.in_loop("microbatches") else calls, False
        out.append(
            PlannedCollective(
                what=f"{c.part or '-'}: {c.op}('{c.spec}'){how}",
                phase=phase,
                kind=c.kind,
                axes=c.axes,
                group_size=c.group_size,
                result_bytes=c.result_bytes * arrays,
                calls=calls,
                weights=c.weight,
                in_layers=in_layers,
                in_loop=in_loop,
                result_shape=c.result_shape,
                dtype=c.dtype,
                arrays=arrays,
            )
        )
    return out


_LAYER_LOOPS = (*STACK_NAMES, MTP_STACK)
"""The scans over stacked layers: the model's stacks and the multi-token prediction modules
(each trip gathers its own layer's weights, under the layers' remat)."""


def _in_layer_loop(c: LoggedCollective) -> bool:
    return any(c.in_loop(name) for name in _LAYER_LOOPS)


def _gather_key(c: LoggedCollective):
    """What makes two weight gathers one value to XLA: the op, its spec, its shape (the
    microbatch loop around both is hoisted away)."""
    loops = tuple(n for n, _ in c.loops if n != "microbatches")
    return c.op, c.spec, c.part, c.result_shape, loops


def _in_inlined_stack(c: LoggedCollective) -> bool:
    """Whether ``c`` is in a layer stack of one layer, in no loop but the microbatches' around
    it and in no loop of more than one trip inside it: a loop of one trip, which XLA inlines
    (see the module docstring)."""
    for i, (name, trips) in enumerate(c.loops):
        if name in _LAYER_LOOPS:
            return (
                trips == 1
                and all(outer == "microbatches" for outer, _ in c.loops[:i])
                and all(inner == 1 for _, inner in c.loops[i + 1 :])
            )
    return False


def _merged_with_forward(c: LoggedCollective, remat: str, microbatches: int) -> bool:
    """Whether XLA's CSE merges ``c``, re-run in the backward pass of an inlined stack, with
    the forward's same collective (see the module docstring): when it reads the same value,
    a weight, the layer's input or what the forward kept; and without microbatches, anything
    the hand-written backward rebuilds from those."""
    if c.weight or c.operand == "input":
        return True
    if c.operand == "saved" and isinstance(remat_policy(remat), SavedRemat):
        return True
    return microbatches == 1 and c.phase == "recompute" and not c.vjp_in_backward


def _as_compiled(
    steps: list[tuple[LoggedCollective, str, str]], remat: str, microbatches: int
) -> list[tuple[LoggedCollective, str, str, int]]:
    """``steps`` (collective, phase, how) as XLA compiles a stack of one layer, each with its
    arrays per call: the re-runs XLA merges with the forward's collectives left out, and each
    all-reduce re-run there combined with the forward's into one call of two arrays."""

    def inlined_rerun(c: LoggedCollective, phase: str) -> bool:
        return phase == "recompute" and _in_inlined_stack(c)

    def key(c: LoggedCollective):
        return c.op, c.spec, c.part, c.loops, c.result_shape

    # The forward all-reduces XLA combines with a re-run of theirs (the routing statistics').
    reruns = collections.Counter(
        key(c)
        for c, phase, _ in steps
        if inlined_rerun(c, phase)
        and c.kind == "all-reduce"
        and not _merged_with_forward(c, remat, microbatches)
    )
    combined = collections.Counter()
    out = []
    for c, phase, how in steps:
        if phase == "forward" and c.kind == "all-reduce" and combined[key(c)] < reruns[key(c)]:
            combined[key(c)] += 1  # the re-run's call carries it
            continue
        if inlined_rerun(c, phase) and _merged_with_forward(c, remat, microbatches):
            continue  # the forward's collective, CSE'd
        if inlined_rerun(c, phase) and c.kind == "all-reduce":
            out.append((c, phase, how + " and the forward's, combined", 2))
            continue
        out.append((c, phase, how, 1))
    if combined != reruns:  # each re-run must meet the forward call XLA combines it with
        raise RuntimeError(
            f"step_comms: the all-reduces re-run in one-layer stacks {dict(reruns)} did not each "
            f"find their forward call to combine with (found {dict(combined)}); the logged "
            f"collectives disagree with themselves: report this with the config."
        )
    return out


def format_planned_table(calls: list[PlannedCollective], n_layers: int) -> str:
    """One row per collective of the step, by phase, the layer body's per layer (with calls
    per step): operation and spec, kind, axes, result per device, calls, bytes sent."""
    order = {p: i for i, p in enumerate(PHASES)}
    rows = collections.OrderedDict()
    for c in sorted(calls, key=lambda c: (order[c.phase], not c.in_layers)):
        key = (
            c.phase,
            "per layer" if c.in_layers else "outside",
            c.what,
            c.kind,
            c.axis_key,
            ("" if c.arrays == 1 else f"{c.arrays} x ")
            + f"{_short_dtype(c.dtype)}[{','.join(map(str, c.result_shape))}]",
        )
        n, sent = rows.get(key, (0, 0.0))
        rows[key] = (n + c.calls, sent + c.bytes_per_step)
    header = ("phase", "where", "operation: op(spec)", "collective", "axes", "result", "calls",
              "sent per device")  # fmt: skip
    body = [(*key, str(n), format_bytes(sent)) for key, (n, sent) in rows.items()]
    lines = format_table(body, header).split("\n")
    by_phase = collections.Counter()
    for c in calls:
        by_phase[c.phase] += c.bytes_per_step
    per_layer = sum(c.bytes_per_step for c in calls if c.in_layers) / max(n_layers, 1)
    lines.append(
        "sent per device per step: "
        + ", ".join(f"{p} {format_bytes(by_phase[p])}" for p in PHASES)
        + f"; per layer {format_bytes(per_layer)} (x {n_layers} layers)"
    )
    return "\n".join(lines)


def _short_dtype(dtype: str) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    short |= {"float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2"}
    return short.get(dtype, dtype)
