"""Data-flow edges a program needs and XLA cannot see, inside a shard_map.

    x = after(x, loop_output)                 # x is read only once loop_output exists
    y = cotangent_after(y)                    # y's cotangent waits for y's forward
    w = varying_over_stages(w)                # typed per pipeline stage (varying over p)

XLA's CPU runtime orders a program by its data alone; a collective outside a loop of
collectives can start on one device while another is still inside the loop, and two devices
entering two collectives in different orders wait on each other for ever
(:mod:`seqshard.shardlib.collective_order` finds such pairs in a compiled program). These
helpers add the missing reads without changing a value or a type. Model code of any layer
(the layer stacks, the pipeline's schedules) uses them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.shardlib import shardops
from seqshard.shardlib.vma import replication_checked, varying_axes

__all__ = ["after", "cotangent_after", "varying_over_stages"]


def after(x: Any, *deps: Any) -> Any:
    """``x`` unchanged, but read off ``deps`` too: whatever uses it runs after they are made.

    XLA's CPU runtime orders a program by its data alone (optimization barriers are gone by
    then), and starts a collective that follows a loop of collectives without waiting for
    the loop unless it reads the loop's result; devices that then enter two collectives in
    different orders wait on each other for ever (:mod:`seqshard.shardlib.collective_order` finds
    such pairs in a compiled program). The dependency is a select on a flag that is always
    true (a count of NaNs, clamped to 0): no value changes, NaN or not. Each dep must vary
    over no mesh axis that ``x`` does not (``x``'s type stays as it is)."""
    flags = [jnp.isnan(jnp.ravel(d)[0]).astype(jnp.int32) for d in jax.tree.leaves(deps)]
    always = jnp.minimum(sum(flags), 0) == 0

    def select(a):
        extra = varying_axes(always) - varying_axes(a)
        if extra:
            raise ValueError(
                f"after(): a dependency varies over mesh axes {sorted(extra)} and the value "
                f"(varying over {sorted(varying_axes(a))}) does not, so its type would change;"
                " depend on a value typed like it (an activation, a cotangent) instead."
            )
        return jnp.where(always, a, jnp.zeros_like(a))

    return jax.tree.map(select, x)


@jax.custom_vjp
def cotangent_after(x: jax.Array) -> jax.Array:
    """``x``; its cotangent made to read ``x`` (:func:`after`), so the backward pass that
    consumes it runs after the forward that made ``x``."""
    return x


def _cotangent_after_forward(x):
    return x, x


def _cotangent_after_backward(x, g):
    return (after(g, x),)


cotangent_after.defvjp(_cotangent_after_forward, _cotangent_after_backward)


def varying_over_stages(tree: Any) -> Any:
    """``tree``'s arrays typed as varying over p: a scan carry that becomes per-stage must
    start so (a fresh ``zeros`` is replicated), and a replicated weight differentiated on
    one stage (its gradient then varies over p until the caller sums it)."""

    def cast(x):
        if shardops.axis_size("p") == 1 or "p" in varying_axes(x) or not replication_checked(["p"]):
            return x
        return lax.pcast(x, ("p",), to="varying")

    return jax.tree.map(cast, tree)
