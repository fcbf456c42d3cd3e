"""A Hugging Face Llama ``config.json``, read into seqshard's model fields and written from them.

Two formats are read. transformers 5 writes ``rope_parameters: {rope_theta, rope_type, ...}``
and ``dtype``; older files have ``rope_theta``, ``rope_scaling: {type or rope_type, ...}`` (or
null) and ``torch_dtype``. Export writes the older form, which transformers 4 and 5 both read.

    Hugging Face key                      seqshard model field
    vocab_size                            vocab
    hidden_size                           d_model
    num_hidden_layers                     n_layers
    num_key_value_heads                   n_kv
    num_attention_heads / n_kv            n_q_per_kv
    head_dim (or hidden_size / heads)     d_head
    intermediate_size                     d_ff
    rms_norm_eps                          norm_eps
    rope_theta                            rope_theta
    rope_type: default | llama3           rope_type, with llama3's factor, low_freq_factor,
                                          high_freq_factor, original_max_position_embeddings
                                          as rope_factor, rope_low_freq_factor,
                                          rope_high_freq_factor, rope_original_max_position

Anything seqshard's Llama does not compute (biases, another activation, another rope type,
sliding windows, partial rotary) is an error naming the field, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from seqshard.model.config import ModelConfig

__all__ = [
    "CONFIG_FILE",
    "HF_KEYS",
    "HFFormatError",
    "HFModel",
    "hf_config_dict",
    "read_hf_config",
]

CONFIG_FILE = "config.json"
ARCHITECTURE = "LlamaForCausalLM"
_LLAMA3 = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position",
}


HF_KEYS = {
    "vocab": "vocab_size",
    "d_model": "hidden_size",
    "n_kv": "num_key_value_heads",
    "n_q_per_kv": "num_attention_heads / num_key_value_heads",
    "d_head": "head_dim",
    "d_ff": "intermediate_size",
}
"""Each weight dimension's name -> the ``config.json`` key that sizes it (for messages)."""


class HFFormatError(ValueError):
    """A Hugging Face model directory seqshard cannot read: the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a ``config.json`` says: the seqshard model fields it fixes, and the rest we use."""

    fields: dict[str, Any]  # ModelConfig field -> value
    tied: bool  # tie_word_embeddings: no lm_head.weight in the files
    dtype: str | None  # the weights' dtype as the file names it ('bfloat16'), if it does
    path: Path

    def disagreements(self, cfg: ModelConfig, fields=None) -> dict[str, tuple[Any, Any]]:
        """``{'d_ff': (128, 64)}``: each model field (of ``fields``, default every one this
        file fixes) where ``cfg``'s value differs from the file's, with both values."""
        return {
            k: (getattr(cfg, k), v)
            for k, v in self.fields.items()
            if (fields is None or k in fields) and getattr(cfg, k) != v
        }

    def model_config(self, base: ModelConfig | None = None) -> ModelConfig:
        """``base`` (default: seqshard's defaults) with this file's fields."""
        return dataclasses.replace(base or ModelConfig(), **self.fields)


def read_hf_config(directory: str | Path) -> HFModel:
    """Parse ``directory/config.json``; raise HFFormatError naming the field for anything
    seqshard's Llama does not compute."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise HFFormatError(
            f"{directory} is not a directory: init.from_hf needs a Hugging Face model directory "
            f"(config.json, model*.safetensors, tokenizer.json), e.g. one save_pretrained wrote."
        )
    if not path.is_file():
        raise HFFormatError(
            f"{path} does not exist: {directory} is not a Hugging Face model directory (it "
            f"needs config.json beside its model*.safetensors)."
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise HFFormatError(f"{path}: expected a JSON object, got {type(raw).__name__}.")
    return _parse(raw, path)


def _parse(raw: dict[str, Any], path: Path) -> HFModel:
    def bad(key: str, value: Any, expected: str) -> HFFormatError:
        return HFFormatError(
            f"{path}: {key}={value!r} is not supported: seqshard imports Llama models "
            f"({ARCHITECTURE}) with {expected}."
        )

    architectures = raw.get("architectures")
    if architectures is not None and ARCHITECTURE not in architectures:
        raise bad("architectures", architectures, f"architectures [{ARCHITECTURE!r}]")
    if architectures is None and raw.get("model_type") != "llama":
        raise bad("model_type", raw.get("model_type"), "model_type 'llama'")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise bad(key, raw[key], f"{key}={want!r}")
    for key in ("sliding_window", "layer_types"):
        if raw.get(key) is not None:
            raise bad(key, raw[key], f"no {key} (full attention in every layer)")

    def integer(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HFFormatError(
                f"{path}: {key} must be a positive integer, got {value!r}"
                + (" (missing)" if key not in raw else "")
                + "."
            )
        return value

    heads = integer("num_attention_heads")
    n_kv = integer("num_key_value_heads", heads)
    hidden = integer("hidden_size")
    if heads % n_kv:
        raise HFFormatError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={n_kv} "
            f"(grouped-query attention shares each kv head among a whole number of query heads)."
        )
    if raw.get("head_dim") is None and hidden % heads:
        raise HFFormatError(
            f"{path}: no head_dim, and hidden_size={hidden} is not a multiple of "
            f"num_attention_heads={heads}: the head size is unknown."
        )
    d_head = hidden // heads if raw.get("head_dim") is None else integer("head_dim")
    fields: dict[str, Any] = {
        "vocab": integer("vocab_size"),
        "d_model": hidden,
        "n_layers": integer("num_hidden_layers"),
        "n_q_per_kv": heads // n_kv,
        "n_kv": n_kv,
        "d_head": d_head,
        "d_ff": integer("intermediate_size"),
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
    }
    fields.update(_rope(raw, path))
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModel(fields, bool(raw.get("tie_word_embeddings", False)), dtype, path)


def _rope(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The rope fields from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (older files)."""
    if isinstance(raw.get("rope_parameters"), dict):
        key, params = "rope_parameters", dict(raw["rope_parameters"])
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        key, params = "rope_scaling", dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise HFFormatError(
            f"{path}: {key}.rope_type={rope_type!r} is not supported: seqshard computes RoPE "
            f"'default' and 'llama3' (Llama 3.1's rescaling)."
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFFormatError(
            f"{path}: partial_rotary_factor={partial!r} is not supported: seqshard rotates "
            f"the whole head (1.0)."
        )
    theta = params["rope_theta"]
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise HFFormatError(f"{path}: rope_theta must be a positive number, got {theta!r}.")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3 if k not in params]
        if missing:
            raise HFFormatError(
                f"{path}: {key} has rope_type 'llama3' but no {', '.join(missing)}: llama3 "
                f"scaling needs all of {', '.join(_LLAMA3)}."
            )
        for hf_key, field in _LLAMA3.items():
            value = params[hf_key]
            out[field] = int(value) if field == "rope_original_max_position" else float(value)
    return out


def hf_config_dict(
    cfg: ModelConfig,
    *,
    dtype: str,
    max_position: int,
    eos_token_id: int | None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as a Hugging Face Llama, untied (seqshard's embed and
    unembed are two weights), in the format transformers 4 and 5 both read."""
    rope_scaling = None
    if cfg.rope_type == "llama3":
        rope_scaling = {"rope_type": "llama3"} | {
            hf_key: getattr(cfg, field) for hf_key, field in _LLAMA3.items()
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "use_cache": True,
    }
