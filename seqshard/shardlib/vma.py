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

__all__ = ["replication_checked", "vary_like", "varying_axes"]


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (empty outside shard_map or when unchecked)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.7 - 0.9


def vary_like(x: jax.Array, *like: jax.Array) -> jax.Array:
    """``x`` typed as varying over every mesh axis one of ``like`` varies over (a cast, no data
    moves): what a loop's carry, both branches of a ``lax.cond`` or a custom VJP's cotangent
    must match. ``x`` itself when it already does."""
    missing = frozenset().union(*(varying_axes(a) for a in like)) - varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def replication_checked(axes: Iterable[str] | None = None) -> bool:
    """True inside a shard_map that checks replication (``check_vma=True``).

    Probes a manual mesh axis of size > 1 (among ``axes`` when given): only over such an axis
    can replication checking refuse anything seqshard does, and an axis of size 1 may not be
    manual at all (``typed_shard_map`` leaves those out). False when there is none.
    """
    mesh = jax.sharding.get_abstract_mesh()
    wanted = None if axes is None else set(axes)
    probe = [
        name
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Manual and size > 1 and (wanted is None or name in wanted)
    ]
    return bool(probe) and probe[0] in varying_axes(lax.axis_index(probe[0]))
