"""Explicit activation checkpointing: the layer body keeps only what it marks.

    q = save_for_backward(einsum_unreduced(...))     # kept for the backward pass
    body = explicit_activation_checkpointing(layer, 'saved')   # or remat_policy('saved')

A remat policy is a small typed object, one per value of the config key
``model.remat: saved | full | none``: the ``jax.checkpoint`` policy it wraps the layer with.
What each keeps and re-runs is declared with the blocks (:mod:`seqshard.model.block`: each
activation's ``saved``, each operation's ``recomputed_by``), where the forward marks it and the
cost model (:mod:`seqshard.model.cost`) and the collective prediction read it.

:class:`SavedRemat` keeps exactly the values wrapped in :func:`save_for_backward` (and the
body's inputs); :class:`FullRemat` keeps only the inputs; :class:`NoRemat` applies no
checkpointing. Each class's docstring says what it keeps and why.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import ClassVar, Literal, Protocol, TypeVar, runtime_checkable

import jax
from jax.ad_checkpoint import checkpoint_name

from seqshard.shardlib import collective_log

__all__ = [
    "REMAT_POLICIES",
    "SAVED",
    "FullRemat",
    "NoRemat",
    "RematName",
    "RematPolicy",
    "SavedRemat",
    "explicit_activation_checkpointing",
    "remat_policy",
    "save_for_backward",
]

RematName = Literal["saved", "full", "none"]
"""The values of the config key ``model.remat``; :data:`REMAT_POLICIES` maps each to its policy."""

SAVED = "seqshard_saved"
"""The checkpoint name that :func:`save_for_backward` gives a value."""

T = TypeVar("T")


def save_for_backward(x: T) -> T:
    """Mark ``x`` to be kept for the backward pass under the ``saved`` policy."""
    x = checkpoint_name(x, SAVED)
    collective_log.saved(x)  # a collective on x: its re-run reads x as kept
    return x


@runtime_checkable
class RematPolicy(Protocol):
    """What a scanned layer keeps for the backward pass: the ``jax.checkpoint`` policy."""

    name: ClassVar[str]
    """Its value of ``model.remat``."""

    @property
    def checkpoint_policy(self) -> Callable[..., bool] | None:
        """The ``jax.checkpoint`` policy the layer body is wrapped with; None: not wrapped."""
        ...


# One policy function for every use, so equal configs trace to equal jaxprs.
_SAVE_MARKED = jax.checkpoint_policies.save_only_these_names(SAVED)


@dataclasses.dataclass(frozen=True)
class SavedRemat:
    """``saved``: keep the layer input and what the layer marks with :func:`save_for_backward`.

    The model marks q, k and v (after RoPE), the attention output before ``w_o``, the
    post-attention residual h, and the FFN's gate and up: the operands the matmuls' backward
    needs, and the outputs whose recomputation would cost a matmul. Everything else is
    recomputed, the gathered weights included: a weight all-gathered in the forward pass is
    all-gathered again in the backward pass, as FSDP does, so no layer's gathered weights
    outlive its step.

    Recomputed (the operations whose ``recomputed_by`` names ``saved``): what the backward
    pass needs and nothing marks. The
    normalized block inputs (``attn_norm``, ``ffn_norm``), operands of the projections'
    weight gradients; ``q . k^T`` with its scale, mask and softmax (``scores``, ``mask``,
    ``softmax``), for the probabilities that the softmax's and ``probs . v``'s backward need;
    ``swish(gate) * up`` (``swiglu``), the down projection's weight-gradient operand; and with
    the sequence split over c, attention across it (``context``, a transfer:
    it moves data and computes nothing the FLOP table counts): allgather's k and v gathered
    over c, or, under autodiff, the ring's forward (its custom VJP's residuals are not marked;
    the hand-written backward keeps the ring's output and logsumexp instead). The
    only recomputed matmul is ``q . k^T``: the other projections' outputs are marked, and
    RoPE's backward needs only the cos / sin tables. A fused attention kernel (cudnn) re-runs
    ``q . k^T`` and the softmax in its own backward whatever the policy; that is not counted.
    """

    name: ClassVar[str] = "saved"

    @property
    def checkpoint_policy(self) -> Callable[..., bool]:
        return _SAVE_MARKED


@dataclasses.dataclass(frozen=True)
class FullRemat:
    """``full``: keep only the layer input; the backward pass re-runs the layer's forward.

    The least memory (one ``'B/dp L M/t'`` residual per layer) for the most recomputation:
    every operation of the layer but the last two (``down``, ``ffn_residual``). Nothing in the
    backward pass needs the down projection's output (only its input and weight), nor the
    layer's output, so JAX / XLA drop both from the recomputation (checked against XLA's
    count of the compiled step in tests/model/test_cost.py).
    """

    name: ClassVar[str] = "full"

    @property
    def checkpoint_policy(self) -> Callable[..., bool]:
        return jax.checkpoint_policies.nothing_saveable


@dataclasses.dataclass(frozen=True)
class NoRemat:
    """``none``: no checkpointing; autodiff keeps every residual the backward pass needs.

    Nothing is recomputed, and every intermediate of every layer stays alive until its
    backward step: the marked values, the layer's gathered weights, the normalized inputs,
    the ``'B/dp L L Q K/t'`` attention probabilities (quadratic in the sequence length) and
    the SwiGLU products. For small models or short sequences, where memory is not the limit.
    """

    name: ClassVar[str] = "none"

    @property
    def checkpoint_policy(self) -> None:
        return None


REMAT_POLICIES: Mapping[str, RematPolicy] = types.MappingProxyType(
    {p.name: p for p in (SavedRemat(), FullRemat(), NoRemat())}
)
"""``model.remat`` value -> policy, in the order of :data:`RematName`."""


def _choices() -> str:
    names = [repr(n) for n in REMAT_POLICIES]
    return ", ".join(names[:-1]) + " or " + names[-1]


def remat_policy(policy: RematName | RematPolicy) -> RematPolicy:
    """The policy named ``policy`` (a value of ``model.remat``); a policy object is returned as is.

    ``remat_policy('saved') == SavedRemat()``; an unknown name is a ValueError naming the
    allowed ones."""
    if isinstance(policy, str):
        if policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat policy must be {_choices()}, got {policy!r}. Set model.remat to one "
                f"of them."
            )
        return REMAT_POLICIES[policy]
    if isinstance(policy, RematPolicy) and not isinstance(policy, type):
        return policy
    raise TypeError(
        f"remat policy must be a name ({_choices()}) or a policy object such as SavedRemat(), "
        f"got {type(policy).__name__} {policy!r}."
    )


def explicit_activation_checkpointing(fn: Callable, policy: RematName | RematPolicy) -> Callable:
    """Wrap ``fn`` (a scanned layer body) so the backward pass keeps what ``policy`` says.

    ``policy`` is a name (``'saved'``, ``'full'``, ``'none'``) or a policy object; under
    ``'none'`` ``fn`` itself is returned."""
    keep = remat_policy(policy).checkpoint_policy
    if keep is None:
        return fn

    @functools.wraps(fn)  # its signature: JAX names the residuals after its arguments
    def kept_inputs(*args, **kwargs):
        collective_log.inputs((args, kwargs))  # a collective on one: its re-run reads it too
        return fn(*args, **kwargs)

    # prevent_cse=False: inside lax.scan there is no CSE across iterations to prevent, and
    # the extra optimization barriers would cost speed (JAX's advice for scanned bodies).
    # (A stack of one layer is no loop once XLA inlines it; XLA:CPU then merges what the
    # backward re-runs on the same values with the forward's (seqshard.plan.step_comms),
    # barriers or not: its CSE runs again after it removes them.)
    return jax.checkpoint(kept_inputs, policy=keep, prevent_cse=False)
