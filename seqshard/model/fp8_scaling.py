"""A block's FP8 scaling in one layer (``model.fp8``): the scale each of its sites quantizes
at, and, with delayed scaling, the amax history it reads and the amaxes it hands on.

A block with FP8 projections names its *sites*, the tensors its forward puts on e4m3's grid,
in order (the gradients go on e5m2's grid at their current scale in every mode:
:func:`seqshard.shardlib.fp8.gradient_quantized`)::

    attention  nx  w_q  w_kv  o_in  w_o          (seqshard.model.attention_block)
    swiglu     nh  w_gate  w_up  y  w_down       (seqshard.model.swiglu)

``current``: each site at the scale of its own amax, reduced over the axes the tensor is split
over before it is quantized. ``delayed`` (Transformer Engine's recipe for the forward
operands): at the scale of the largest amax of the site's last ``model.fp8_history`` steps, so
nothing waits on the amax's reduction; the amax is still taken (reduced over every axis but
p: the same on every device) and goes on:

    history  f32['layers/p <sites> fp8_history']   a weight of the block (``<block>_fp8_history``):
                                                    zeros at first, read without a gradient,
                                                    checkpointed and resharded with the weights
    aux      fp8_amax       [layers, sites]        this step's amax, the max over microbatches
             fp8_saturated  [layers, sites]        1 where it passed the scale's range (its
                                                    values saturated), summed over microbatches
    update   after the optimizer step each history shifts by one, this step's amax first

A site with no history yet (all zero: the first step) takes its current amax's scale. The log
shows ``fp8_saturated/<block>``, the saturated (site, layer, microbatch) tensors of the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.block import Aux, weight
from seqshard.model.config import ModelConfig
from seqshard.shardlib import collective_log, fp8

__all__ = ["Fp8Sites", "Scaling", "delayed", "fp8_aux", "history_weight", "no_history_gradient"]


def delayed(cfg: ModelConfig) -> bool:
    return cfg.fp8 == "delayed"


def history_weight() -> dataclasses.Field:
    """A block's amax history field (``<block>_fp8_history: f32['<sites> fp8_history']``):
    zeros at init, no decay, no Hugging Face tensor, present with ``model.fp8=delayed``."""
    return weight("zeros", decay=False, gathered_in="f32", present=delayed)


def no_history_gradient(cfg: ModelConfig, w, field: str) -> dict[str, jax.Array]:
    """The history's gradient for a hand-written backward: zeros (the forward reads it
    without one), or nothing when the layer has no history."""
    return {field: jnp.zeros_like(getattr(w, field))} if delayed(cfg) else {}


class Scaling:
    """One block's sites in one layer: :meth:`quantized` and :meth:`gathered` put a site's
    tensor on e4m3's grid at its scale (``model.fp8``; with ``none``, they change nothing and
    gather as usual); :meth:`aux` gives the amaxes seen (delayed)."""

    def __init__(self, cfg: ModelConfig, sites: Sequence[str], history: jax.Array | None):
        self.mode, self.sites = cfg.fp8, tuple(sites)
        self.history = None if history is None else lax.stop_gradient(history)
        self.amax: dict[str, jax.Array] = {}
        self.saturated: dict[str, jax.Array] = {}

    def _scale(self, site: str, spec: str, x: jax.Array) -> jax.Array | None:
        """Delayed: the site's scale from its history (and its amax now, recorded); else None
        (the quantizing function takes the current scale itself)."""
        if self.mode != "delayed":
            return None
        now = fp8.amax(spec, x, invariant=True)
        s = fp8.delayed_scale(self.history[self.sites.index(site)], now, fp8.FORWARD)
        self.amax[site] = now
        self.saturated[site] = (now > s * float(jnp.finfo(fp8.FORWARD).max)).astype(jnp.float32)
        return s

    def quantized(self, site: str, spec: str, x: jax.Array) -> jax.Array:
        """Activation ``x`` (layout ``spec``) on e4m3's grid: :func:`fp8.quantized`."""
        return fp8.quantized(self.mode, spec, x, self._scale(site, spec, x))

    def gathered(self, site: str, gather: str, w: jax.Array, dtype) -> jax.Array:
        """Weight ``w`` gathered by spec ``gather``, in e4m3 bits: :func:`fp8.gather_quantized`."""
        with collective_log.of_weight():
            s = self._scale(site, fp8.weight_spec(gather), w)
        return fp8.gather_quantized(self.mode, gather, w, dtype, s)

    def aux(self) -> dict[str, jax.Array]:
        """{'fp8_amax', 'fp8_saturated'}: f32 [sites], zero for a site not run here (a
        backward's rebuild that kept its value)."""
        zero = jnp.zeros((), jnp.float32)
        return {
            "fp8_amax": jnp.stack([self.amax.get(s, zero) for s in self.sites]),
            "fp8_saturated": jnp.stack([self.saturated.get(s, zero) for s in self.sites]),
        }


@dataclasses.dataclass(frozen=True)
class Fp8Sites:
    """A block's FP8 sites, declared once: the block's name, the sites in order, and its
    history weight's field. The block reads from it its :class:`Scaling` in a layer, its
    :class:`~seqshard.model.block.Aux` and its history's (zero) gradient."""

    block: str
    names: tuple[str, ...]
    field: str

    def scaling(self, cfg: ModelConfig, w) -> Scaling:
        """The block's scaling in the layer ``w`` (its history, when the layer has one)."""
        return Scaling(cfg, self.names, getattr(w, self.field, None))

    def aux(self) -> Aux:
        return fp8_aux(self.block, self.names, self.field)

    def no_history_gradient(self, cfg: ModelConfig, w) -> dict[str, jax.Array]:
        return no_history_gradient(cfg, w, self.field)


def fp8_aux(block: str, sites: Sequence[str], field: str) -> Aux:
    """The auxiliary outputs of ``block``'s FP8 sites under ``model.fp8=delayed`` (the module
    docstring): its amaxes (max over microbatches), its saturations, the history update."""
    n = str(len(sites))

    def metrics(cfg, aux, layer_names, stack_weights) -> dict[str, jax.Array]:
        return {f"fp8_saturated/{block}": jnp.sum(aux["fp8_saturated"])}

    def update(cfg, stack_weights, aux):
        history = getattr(stack_weights, field)  # [layers, sites, fp8_history]
        newest = aux["fp8_amax"].astype(history.dtype)[..., None]
        shifted = jnp.concatenate([newest, history[..., :-1]], axis=-1)
        return dataclasses.replace(stack_weights, **{field: shifted})

    return Aux(
        fields={"fp8_amax": n, "fp8_saturated": n},
        max=("fp8_amax",),
        metrics=metrics,
        update=update,
        present=delayed,
    )
