"""Explicit activation checkpointing: the layer body keeps only what it marks.

    q = save_for_backward(einsum_unreduced(...))     # kept for the backward pass
    body = explicit_activation_checkpointing(layer, policy='saved')

``saved`` keeps exactly the values wrapped in :func:`save_for_backward` (and the body's
inputs); everything else, gathered weights included, is recomputed in the backward pass, so
a weight all-gathered in the forward pass is all-gathered again there (as FSDP does).
``full`` keeps only the inputs. ``none`` applies no checkpointing: every intermediate of every
layer, each layer's gathered weights included, stays alive until its backward step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["SAVED", "RematPolicy", "explicit_activation_checkpointing", "save_for_backward"]

RematPolicy = Literal["saved", "full", "none"]

SAVED = "seqshard_saved"
"""The checkpoint name that :func:`save_for_backward` gives a value."""

T = TypeVar("T")


def save_for_backward(x: T) -> T:
    """Mark ``x`` to be kept for the backward pass under the ``saved`` policy."""
    return checkpoint_name(x, SAVED)


def explicit_activation_checkpointing(fn: Callable, policy: RematPolicy) -> Callable:
    """Wrap ``fn`` (a scanned layer body) so the backward pass keeps what ``policy`` says."""
    if policy == "none":
        return fn
    if policy == "saved":
        keep = jax.checkpoint_policies.save_only_these_names(SAVED)
    elif policy == "full":
        keep = jax.checkpoint_policies.nothing_saveable
    else:
        raise ValueError(f"remat policy must be 'saved', 'full' or 'none', got {policy!r}.")
    # prevent_cse=False: inside lax.scan there is no CSE across iterations to prevent, and
    # the extra optimization barriers would cost speed (JAX's advice for scanned bodies).
    return jax.checkpoint(fn, policy=keep, prevent_cse=False)
