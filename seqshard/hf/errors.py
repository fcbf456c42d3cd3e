"""The error of :mod:`seqshard.hf`, below every module of it (:mod:`seqshard.hf.hf_config`
reads the weights files' tensor names through :mod:`seqshard.hf.safetensors_io`, which raises it)."""

from __future__ import annotations

__all__ = ["HFFormatError"]


class HFFormatError(ValueError):
    """A Hugging Face model directory seqshard cannot read: the message names the file and field."""
