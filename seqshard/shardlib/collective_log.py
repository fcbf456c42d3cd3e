"""Collectives predicted from the notation: each shardops call records the one it lowers to.

While a function is traced under :func:`recording`, every collective a shardops call emits is
logged with its kind, mesh axes, per-device operand and result shapes and dtype, and where it
is: the phase of the training step, the scans around it, and the model operation it belongs
to. Nothing is compiled or run (trace with ``jax.eval_shape``; an ``AbstractMesh`` needs no
devices)::

    log = collective_log.traced(jax.grad(loss), weight_structs, batch_structs)
    log.calls[0]   # LoggedCollective(op='all_gather', spec='V/t M/d -> V/t M', kind='all-gather',
                   #                  axes=('d',), phase='forward', loops=(), part='embed', ...)

Autodiff's backward pass runs no shardops: :func:`transpose` derives its collectives from the
forward's by JAX's transpose rules::

    all_gather   'M/d F/t -> M F/t'      <->  psum_scatter 'M F/t -> M/d F/t' (FSDP's gradient)
    psum         'B/d L{U_t} -> B/d L'    ->  nothing with check_vma=True (the cotangent of an
                                             invariant value is invariant: each device keeps
                                             it), an all-reduce with check_vma=False
    pmax                                  ->  nothing (no gradient)
    all_gather of FP8 bits                ->  nothing here: fp8.gather_quantized's backward
                                             rule logs its reduce-scatter itself
    all_to_all   'B/d L -> B L/d'         ->  all_to_all 'B L/d -> B/d L'

A hand-written backward (``model.backward=explicit``) runs shardops itself: it logs its own
collectives under :func:`phase` ``'backward'`` (``'recompute'`` for what it recomputes) and
marks its forward pass :func:`hand_differentiated`, so that no transposes are derived for it.

Scans are logged with their trip counts (:func:`scan`, a ``lax.scan`` that says its name), so a
collective's calls per step are the product of its loops' trips.

Each collective also says where its operand comes from (``operand``): ``'input'``, an input of
the scanned body or the checkpointed function it runs in (:func:`inputs`: a layer's residual,
its weights, what a hand-written forward kept for the backward), or ``'saved'``, a value
marked for the backward pass (:func:`saved`, which ``save_for_backward`` calls). A
re-run of the collective in the backward pass reads the very same value then (under a remat
policy that keeps the marked ones), which lets XLA merge the two where they meet
(:mod:`seqshard.plan.step_comms`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seqshard.shardlib.notation import parse_op

__all__ = [
    "Log",
    "LoggedCollective",
    "at",
    "backward_rule",
    "custom_vjp_primal",
    "vjp_in_backward",
    "emit",
    "hand_differentiated",
    "inputs",
    "of_weight",
    "part",
    "phase",
    "place",
    "recording",
    "saved",
    "scan",
    "traced",
    "transpose",
]


@dataclasses.dataclass(frozen=True)
class LoggedCollective:
    """One collective a shardops call emitted while a function was traced (per device)."""

    op: str  # the shardops function: 'all_gather', 'psum_scatter', 'psum', 'pmax', 'all_to_all'
    spec: str  # its op spec, e.g. 'M/d F/t -> M F/t'
    kind: str  # as the compiled HLO names it: 'all-gather', 'reduce-scatter', 'all-reduce', ...
    axes: tuple[str, ...]  # the mesh axes it runs over, major to minor (size-1 axes left out)
    group_size: int
    operand_shape: tuple[int, ...]
    result_shape: tuple[int, ...]
    dtype: str  # e.g. 'float32'
    phase: str = "forward"  # 'forward', 'recompute', 'backward' or 'update'
    loops: tuple[tuple[str, int], ...] = ()  # enclosing scans, outermost first: (name, trips)
    part: str | None = None  # the model operation it belongs to ('attn_norm', 'q', ...)
    checked: bool = True  # emitted inside a shard_map with check_vma=True
    invarying: bool = False  # an all_gather(..., to='invarying')
    autodiff: bool = True  # its backward is autodiff's (not hand-written)
    vjp_primal: bool = False  # in a custom VJP's primal function (see custom_vjp_primal)
    vjp_in_backward: bool = False  # differentiated by jax.vjp in a hand-written backward
    operand: str = ""  # 'input' or 'saved' (see the module docstring), '' otherwise
    of_weight: bool = False  # part of a weight's gather (its FP8 scale's amax: of_weight)

    @property
    def weight(self) -> bool:
        """A weight's gather (its input has no batch dimension B), or that gather's transpose.
        An all-reduce or all-to-all never is: those sum or exchange values the batch made (the
        loss, the router's statistics, the token copies routed over e), whatever their letters."""
        if self.of_weight:
            return True
        return self.kind in ("all-gather", "reduce-scatter") and "B" not in _input_labels(self.spec)

    @property
    def calls(self) -> int:
        """Calls per traced function: the product of the enclosing scans' trips."""
        return math.prod(trips for _, trips in self.loops)

    @property
    def result_bytes(self) -> int:
        return math.prod(self.result_shape) * np.dtype(self.dtype).itemsize

    def in_loop(self, name: str) -> bool:
        return any(n == name for n, _ in self.loops)


def _input_labels(spec: str) -> set[str]:
    return {label for shape in parse_op(spec).inputs for label in shape.labels}


@dataclasses.dataclass
class Log:
    """What :func:`recording` collected, in trace order."""

    calls: list[LoggedCollective] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _State:
    log: Log | None = None
    phase: str = "forward"
    loops: tuple[tuple[str, int], ...] = ()
    part: str | None = None
    autodiff: bool = True
    vjp_primal: bool = False
    vjp_in_backward: bool = False
    of_weight: bool = False
    # id -> (the traced value, 'input' or 'saved'): the values inputs() and saved() marked,
    # held so that no other value takes their id while the log records.
    marked: dict[int, tuple[object, str]] = dataclasses.field(default_factory=dict)


# The fields of the state that a logged call copies (all but the log).
_PLACE_FIELDS = (
    "phase",
    "loops",
    "part",
    "autodiff",
    "vjp_primal",
    "vjp_in_backward",
    "of_weight",
)

_local = threading.local()


def _state() -> _State:
    if not hasattr(_local, "state"):
        _local.state = _State()
    return _local.state


@contextlib.contextmanager
def _setting(**changes) -> Iterator[None]:
    state = _state()
    before = {k: getattr(state, k) for k in changes}
    for k, v in changes.items():
        setattr(state, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(state, k, v)


def traced(fn: Callable, *args) -> Log:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct`` s) with ``jax.eval_shape`` under
    :func:`recording`: nothing is compiled or run. ``fn`` is traced through a new closure, so
    that JAX's trace cache cannot serve an earlier trace of it, in which nothing was logged."""
    with recording() as log:
        jax.eval_shape(lambda *a: fn(*a), *args)
    return log


@contextlib.contextmanager
def recording() -> Iterator[Log]:
    """Log every collective shardops emit while the block traces; yields the :class:`Log`.

    Only code that is traced logs: a function JAX traced before with the same argument types
    may be served from its trace cache (``jax.jit``, ``jax.eval_shape`` of the same function
    object, a ``lax.scan`` of the same body function). :func:`traced` avoids the outer cache."""
    log = Log()
    with _setting(
        log=log,
        phase="forward",
        loops=(),
        part=None,
        autodiff=True,
        vjp_primal=False,
        vjp_in_backward=False,
        of_weight=False,
        marked={},
    ):
        yield log


def phase(name: str):
    """Collectives traced in this block belong to phase ``name`` ('forward', 'recompute',
    'backward', or 'update': the optimizer's)."""
    if name not in ("forward", "recompute", "backward", "update"):
        raise ValueError(
            f"phase must be 'forward', 'recompute', 'backward' or 'update', got {name!r}."
        )
    return _setting(phase=name)


def part(name: str):
    """Collectives traced in this block belong to the model operation ``name`` (the names of
    :func:`seqshard.model.cost.step_flops`, which remat policies are asked about)."""
    return _setting(part=name)


def hand_differentiated():
    """This block's backward pass is written by hand and logs its own collectives: derive no
    transposes for the ones logged here."""
    return _setting(autodiff=False)


def vjp_in_backward():
    """This block is differentiated by ``jax.vjp`` inside a hand-written backward (the MoE
    layers' FFN): its collectives are logged as they run (the forward's, re-run: phase
    ``'recompute'``), and a step's count adds their transposes in the backward."""
    return _setting(vjp_in_backward=True)


def custom_vjp_primal():
    """This block is a ``jax.custom_vjp``'s primal function. Under differentiation JAX traces
    it and, separately, the VJP's forward rule, and runs only the latter; the collectives
    logged here are marked, so a step's count (:mod:`seqshard.plan.step_comms`) takes them once."""
    return _setting(vjp_primal=True)


def inputs(tree) -> None:
    """Mark the arrays of ``tree`` as inputs of the body being traced (a scanned layer, a
    checkpointed function): a collective whose operand is one logs ``operand='input'``.
    A no-op unless recording."""
    _mark(tree, "input")


def saved(tree) -> None:
    """Mark the arrays of ``tree`` as kept for the backward pass (``save_for_backward``): a
    collective whose operand is one logs ``operand='saved'``. A no-op unless recording."""
    _mark(tree, "saved")


def _mark(tree, how: str) -> None:
    state = _state()
    if state.log is None:
        return
    for x in jax.tree.leaves(tree):
        state.marked.setdefault(id(x), (x, how))


def _operand(x) -> str:
    value, how = _state().marked.get(id(x), (None, ""))
    return how if value is x else ""


def place() -> tuple[tuple[tuple[str, int], ...], str | None]:
    """Where the code being traced is: (the enclosing scans, the model operation). A custom VJP
    passes it to its backward, which JAX traces later, outside those scans (:func:`at`)."""
    state = _state()
    return state.loops, state.part


def backward_rule(where: tuple[tuple[tuple[str, int], ...], str | None]):
    """A custom VJP's backward rule, traced when JAX transposes, logs its collectives in the
    backward phase, in the scans and operation of ``where`` (:func:`place` of its forward),
    as written by hand (no transposes derived for them)."""
    loops, name = where
    return _setting(
        loops=loops,
        part=name,
        phase="backward",
        autodiff=False,
        vjp_primal=False,
        vjp_in_backward=False,
    )


def of_weight():
    """Collectives traced in this block belong to a weight's gather (the amax of a weight that
    is gathered in FP8): every remat policy that gathers weights again re-runs them."""
    return _setting(of_weight=True)


def at(where: tuple[tuple[tuple[str, int], ...], str | None]):
    """Collectives traced in this block are logged as in the scans and operation of ``where``
    (:func:`place`'s)."""
    loops, name = where
    return _setting(loops=loops, part=name)


def scan(name: str, f: Callable, init, xs, **kwargs):
    """``lax.scan(f, init, xs, **kwargs)``, its body's collectives logged as run ``trips``
    times, the length of ``xs`` (or ``length``)."""
    trips = kwargs.get("length")
    if trips is None:
        trips = jax.tree.leaves(xs)[0].shape[0]
    state = _state()

    def body(carry, x):
        inputs((carry, x))
        return f(carry, x)

    with _setting(loops=(*state.loops, (name, int(trips)))):
        return lax.scan(f if state.log is None else body, init, xs, **kwargs)


def emit(
    op: str,
    spec: str,
    kind: str,
    axes: Sequence[str],
    group_size: int,
    operand: jax.Array,
    result: jax.Array,
    *,
    checked: bool,
    invarying: bool = False,
) -> None:
    """Called by shardops next to each collective they emit; a no-op unless recording."""
    state = _state()
    if state.log is None:
        return
    state.log.calls.append(
        LoggedCollective(
            op=op,
            spec=spec,
            kind=kind,
            axes=tuple(axes),
            group_size=group_size,
            operand_shape=tuple(operand.shape),
            result_shape=tuple(result.shape),
            dtype=np.dtype(result.dtype).name,
            checked=checked,
            invarying=invarying,
            operand=_operand(operand),
            # Where the call is: phase, loops, part and how it is differentiated.
            **{k: getattr(state, k) for k in _PLACE_FIELDS},
        )
    )


_TRANSPOSED_KIND = {
    "all-gather": "reduce-scatter",
    "reduce-scatter": "all-gather",
    "all-to-all": "all-to-all",
    "all-reduce": "all-reduce",
    "collective-permute": "collective-permute",
}


def transpose(c: LoggedCollective) -> LoggedCollective | None:
    """The collective autodiff's backward pass runs for ``c`` (see the module docstring), in
    the same loops, or None when its transpose moves nothing."""
    if c.op == "pmax" or not jnp.issubdtype(c.dtype, jnp.inexact):
        return None  # no gradient (a max of a stop-gradiented value; ids and flags)
    if jnp.dtype(c.dtype).itemsize == 1:
        return None  # FP8 bits: their gradient goes straight to the weight (seqshard.shardlib.fp8)
    if c.op == "psum" and c.checked:
        return None  # psum's result is invariant; so is its cotangent: no collective back
    if c.invarying:
        # The gather's result is invariant; its cotangent too, and each device slices its own
        # block out of it. (Where that value met varying ones, JAX inserted a pvary, whose
        # transpose is a psum: JAX's, not a shardops call, so not logged.)
        return None
    return dataclasses.replace(
        c,
        kind=_TRANSPOSED_KIND[c.kind],
        operand_shape=c.result_shape,
        result_shape=c.operand_shape,
        phase="backward",
    )
