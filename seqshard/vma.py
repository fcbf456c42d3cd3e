"""Which mesh axes a value inside ``jax.shard_map`` varies over (JAX's "vma"), via public API.

With ``check_vma=True`` JAX tracks, per value, the set of manual mesh axes along which its
per-device blocks may differ. seqshard reads it to refuse a ``psum`` over an axis a value does
not vary over (JAX would silently multiply by the axis size) and to check replicated outputs.
With ``check_vma=False`` every value reports no axes; :func:`replication_checked` tells the
two cases apart by probing ``lax.axis_index``, which varies over its axis only when checked.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax import lax

__all__ = ["replication_checked", "varying_axes"]


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (empty outside shard_map or when unchecked)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.7 - 0.9


def replication_checked(axes: Iterable[str]) -> bool:
    """True inside a shard_map that checks replication (``check_vma=True``) over ``axes``."""
    axes = tuple(axes)
    if not axes:
        return False
    return axes[0] in varying_axes(lax.axis_index(axes[0]))
