"""A Hugging Face ``config.json``, read into seqshard's model fields and written from them.

Four architectures, one model (:data:`ARCHITECTURES`): ``LlamaForCausalLM``; ``Qwen3ForCausalLM``
(Llama with ``model.qk_norm``); ``MixtralForCausalLM`` (every layer's FFN a mixture of experts);
``Qwen3MoeForCausalLM`` (qk_norm, experts, and optionally leading dense layers). Export picks the
one that holds a config (:func:`architecture_of`).

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
    intermediate_size                     d_ff (Mixtral: moe.d_ff)
    rms_norm_eps                          norm_eps
    Qwen3, Qwen3-MoE                      qk_norm: true
    num_local_experts (Mixtral),          moe.n_experts
      num_experts (Qwen3-MoE)
    num_experts_per_tok                   moe.top_k
    moe_intermediate_size (Qwen3-MoE)     moe.d_ff
    mlp_only_layers [0 .. k-1]            moe.n_dense_layers = k (decoder_sparse_step 1)
    (the router)                          moe.router softmax, moe.n_shared 0, no groups
    norm_topk_prob (Qwen3-MoE)            moe.norm_topk_prob (Mixtral: always true)
    rope_theta                            rope_theta
    rope_type: default | llama3           rope_type, with llama3's factor, low_freq_factor,
                                          high_freq_factor, original_max_position_embeddings
                                          as rope_factor, rope_low_freq_factor,
                                          rope_high_freq_factor, rope_original_max_position

Anything seqshard does not compute (biases, another activation, another rope type, sliding
windows, partial rotary, sparse layers that are not all after
the dense ones, router jitter) is an error naming the field, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from seqshard.model.config import ModelConfig
from seqshard.model.layers import runs
from seqshard.model.moe import MOE

__all__ = [
    "ARCHITECTURES",
    "CONFIG_FILE",
    "HF_KEYS",
    "HFFormatError",
    "HFModel",
    "LLAMA",
    "MIXTRAL",
    "QWEN3",
    "QWEN3_MOE",
    "architecture_of",
    "hf_config_dict",
    "hf_keys",
    "read_hf_config",
]

CONFIG_FILE = "config.json"
LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = {LLAMA: "llama", QWEN3: "qwen3", MIXTRAL: "mixtral", QWEN3_MOE: "qwen3_moe"}
"""The architectures seqshard reads and writes -> their ``model_type``."""
_QK_NORM = (QWEN3, QWEN3_MOE)
_MOE = (MIXTRAL, QWEN3_MOE)
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
"""Each weight dimension's name -> the ``config.json`` key that sizes it (for messages): a
Llama's; :func:`hf_keys` gives each architecture's."""


def hf_keys(architecture: str) -> dict[str, str]:
    """:data:`HF_KEYS` of ``architecture``, with its experts' keys."""
    if architecture == MIXTRAL:
        return {**HF_KEYS, "experts": "num_local_experts", "d_expert": "intermediate_size"}
    if architecture == QWEN3_MOE:
        return {**HF_KEYS, "experts": "num_experts", "d_expert": "moe_intermediate_size"}
    return HF_KEYS


class HFFormatError(ValueError):
    """A Hugging Face model directory seqshard cannot read: the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a ``config.json`` says: the seqshard model fields it fixes, and the rest we use."""

    fields: dict[str, Any]  # ModelConfig field ('moe.top_k' for MoEConfig's) -> value
    architecture: str  # one of ARCHITECTURES
    tied: bool  # tie_word_embeddings: no lm_head.weight in the files
    dtype: str | None  # the weights' dtype as the file names it ('bfloat16'), if it does
    path: Path

    def disagreements(self, cfg: ModelConfig, fields=None) -> dict[str, tuple[Any, Any]]:
        """``{'d_ff': (128, 64)}``: each model field (of ``fields``, default every one this
        file fixes) where ``cfg``'s value differs from the file's, with both values."""
        return {
            k: (_field(cfg, k), v)
            for k, v in self.fields.items()
            if (fields is None or k in fields) and _field(cfg, k) != v
        }

    def model_config(self, base: ModelConfig | None = None) -> ModelConfig:
        """``base`` (default: seqshard's defaults) with this file's fields."""
        base = base or ModelConfig()
        top = {k: v for k, v in self.fields.items() if "." not in k}
        moe = {k.split(".", 1)[1]: v for k, v in self.fields.items() if k.startswith("moe.")}
        return dataclasses.replace(base, **top, moe=dataclasses.replace(base.moe, **moe))


def _field(cfg: ModelConfig, key: str) -> Any:
    """``cfg``'s value of a field, ``'moe.top_k'`` for MoEConfig's."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


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
            f"{path}: {key}={value!r} is not supported: seqshard imports "
            f"{', '.join(ARCHITECTURES)} models with {expected}."
        )

    architectures = raw.get("architectures")
    if architectures is not None:
        known = [a for a in architectures if a in ARCHITECTURES]
        if not known:
            raise bad("architectures", architectures, f"architectures one of {list(ARCHITECTURES)}")
        architecture = known[0]
    else:
        by_type = {t: a for a, t in ARCHITECTURES.items()}
        if raw.get("model_type") not in by_type:
            raise bad("model_type", raw.get("model_type"), f"model_type one of {list(by_type)}")
        architecture = by_type[raw["model_type"]]
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise bad(key, raw[key], f"{key}={want!r}")
    # Qwen's files name a window that only use_sliding_window turns on.
    windowed = raw.get("use_sliding_window", True) and raw.get("sliding_window") is not None
    if windowed:
        raise bad("sliding_window", raw["sliding_window"], "no sliding_window (full attention)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise bad("layer_types", layer_types, "full attention in every layer")

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
        "qk_norm": architecture in _QK_NORM,
        "moe.n_experts": 0,
    }
    if architecture in _MOE:
        fields.update(_experts(raw, path, architecture, integer, bad))
    if architecture == MIXTRAL:  # its intermediate_size is the experts'; no layer is dense
        del fields["d_ff"]
    fields.update(_rope(raw, path))
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    tied = bool(raw.get("tie_word_embeddings", False))
    return HFModel(fields, architecture, tied, dtype, path)


def _experts(raw: dict[str, Any], path: Path, architecture: str, integer, bad) -> dict[str, Any]:
    """The ``moe.`` fields of a Mixtral or Qwen3-MoE ``config.json``."""
    n_layers = integer("num_hidden_layers")
    if architecture == MIXTRAL:
        if raw.get("router_jitter_noise", 0.0) != 0.0:
            raise bad(
                "router_jitter_noise",
                raw["router_jitter_noise"],
                "router_jitter_noise=0.0 (seqshard's router adds no noise)",
            )
        fields = {
            "moe.n_experts": integer("num_local_experts"),
            "moe.d_ff": integer("intermediate_size"),
            "moe.n_dense_layers": 0,
        }
    else:
        norm = raw.get("norm_topk_prob", False)  # transformers' Qwen3MoeConfig default
        if not isinstance(norm, bool):
            raise bad("norm_topk_prob", norm, "norm_topk_prob true or false")
        key = "num_experts" if "num_experts" in raw else "num_local_experts"
        step = raw.get("decoder_sparse_step", 1)
        only_mlp = set(raw.get("mlp_only_layers") or [])
        dense = [i for i in range(n_layers) if i in only_mlp or (i + 1) % step]
        if dense != list(range(len(dense))) or len(dense) == n_layers:
            raise bad(
                "mlp_only_layers, decoder_sparse_step",
                (sorted(only_mlp), step),
                f"the dense layers first and at least one layer of experts (seqshard runs "
                f"model.moe.n_dense_layers dense layers, then the rest with experts): "
                f"mlp_only_layers [0, ..., k-1] with k < num_hidden_layers={n_layers} and "
                f"decoder_sparse_step 1; these make layers {dense} dense",
            )
        fields = {
            "moe.n_experts": integer(key),
            "moe.d_ff": integer("moe_intermediate_size"),
            "moe.n_dense_layers": len(dense),
            "moe.norm_topk_prob": norm,
        }
    return {
        **fields,
        "moe.top_k": integer("num_experts_per_tok"),
        "moe.n_shared": 0,
        "moe.router": "softmax",
    }


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


def architecture_of(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes ``cfg``'s model: Llama, Qwen3 (qk_norm),
    Mixtral (experts in every layer) or Qwen3-MoE (qk_norm and experts). Raises ValueError
    naming the field for a model none of them computes."""
    moe = cfg.moe
    if not runs(cfg, MOE):
        return QWEN3 if cfg.qk_norm else LLAMA
    if moe.n_shared:
        raise ValueError(
            f"model.moe.n_shared={moe.n_shared} (shared experts, which every token passes "
            f"through ungated) has no Hugging Face architecture seqshard exports: {MIXTRAL} and "
            f"{QWEN3_MOE} have no shared experts. The Hugging Face families that hold shared "
            f"experts each differ in another way: Qwen2-MoE (Qwen2MoeForCausalLM) scales its "
            f"shared expert by a learned sigmoid gate; DeepSeek-V3 (DeepseekV3ForCausalLM) adds "
            f"them ungated but uses multi-head latent attention; GLM-4-MoE (Glm4MoeForCausalLM), "
            f"the closest, adds them ungated beside grouped-query attention and a sigmoid router "
            f"(as model.moe.router=sigmoid). seqshard exports none of these yet: to export, "
            f"train with model.moe.n_shared=0."
        )
    unsupported = [
        (moe.router != "softmax", f"model.moe.router={moe.router!r}", "'softmax'"),
        (moe.n_group != 1, f"model.moe.n_group={moe.n_group}", "no expert groups (1)"),
        (
            moe.routed_scaling_factor != 1.0,
            f"model.moe.routed_scaling_factor={moe.routed_scaling_factor:g}",
            "unscaled gates (1.0)",
        ),
        (
            not moe.norm_topk_prob and not cfg.qk_norm,
            "model.moe.norm_topk_prob=false without model.qk_norm",
            "norm_topk_prob true (Mixtral always normalizes the top k; Qwen3-MoE, which may "
            "not, normalizes q and k: model.qk_norm=true)",
        ),
        (
            moe.n_dense_layers and not cfg.qk_norm,
            f"model.moe.n_dense_layers={moe.n_dense_layers} without model.qk_norm",
            "0 (Mixtral has experts in every layer; Qwen3-MoE, which has dense layers, "
            "normalizes q and k: model.qk_norm=true)",
        ),
    ]
    for failed, what, want in unsupported:
        if failed:
            raise ValueError(
                f"{what} has no Hugging Face counterpart: seqshard exports experts as "
                f"{MIXTRAL} or {QWEN3_MOE}, which need {want}."
            )
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL


def hf_config_dict(
    cfg: ModelConfig,
    *,
    dtype: str,
    max_position: int,
    eos_token_id: int | None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as the Hugging Face model of :func:`architecture_of`,
    untied (seqshard's embed and unembed are two weights), in the format transformers 4 and 5
    both read."""
    architecture = architecture_of(cfg)
    rope_scaling = None
    if cfg.rope_type == "llama3":
        rope_scaling = {"rope_type": "llama3"} | {
            hf_key: getattr(cfg, field) for hf_key, field in _LLAMA3.items()
        }
    moe = cfg.moe
    experts: dict[str, Any] = {}
    if architecture == MIXTRAL:
        experts = {
            "num_local_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    elif architecture == QWEN3_MOE:
        experts = {
            "num_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.d_ff,
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.n_dense_layers)),
            "output_router_logits": False,
        }
    windows: dict[str, Any] = {}  # full attention (Llama's config has no such keys)
    if architecture != LLAMA:
        windows = {"sliding_window": None}
    if cfg.qk_norm:
        windows["use_sliding_window"] = False
    return {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": moe.d_ff if architecture == MIXTRAL else cfg.d_ff,
        **experts,
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
        **windows,
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
