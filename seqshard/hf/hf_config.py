"""A Hugging Face ``config.json``, read into seqshard's model fields and written from them.

Five architectures, one model (:data:`ARCHITECTURES`): ``LlamaForCausalLM``; ``Qwen3ForCausalLM``
(Llama with ``model.qk_norm``); ``MixtralForCausalLM`` (every layer's FFN a mixture of experts);
``Qwen3MoeForCausalLM`` (qk_norm, experts, and optionally leading dense layers);
``DeepseekV3ForCausalLM`` (multi-head latent attention, ``model.attention: mla``; leading dense
layers, then experts with a sigmoid router, its bias, expert groups and shared experts). Export
picks the one that holds a config (:func:`architecture_of`).

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
    rope_type: yarn                       rope_type, with factor, original_max_position_embeddings,
                                          beta_fast, beta_slow, mscale, mscale_all_dim as
                                          rope_factor, rope_original_max_position,
                                          rope_beta_fast, rope_beta_slow, rope_mscale,
                                          rope_mscale_all_dim (absent mscales: 0)

DeepSeek-V3 (``model_type: deepseek_v3``; a key it leaves out takes transformers'
``DeepseekV3Config`` default, as transformers would)::

    num_attention_heads (= num_key_value_heads)  n_kv (attention: mla, n_q_per_kv 1)
    qk_nope_head_dim + qk_rope_head_dim   d_head
    q_lora_rank (null: 0), kv_lora_rank,  mla.q_lora_rank, mla.kv_lora_rank,
      qk_nope_head_dim, qk_rope_head_dim,   mla.qk_nope_head_dim, mla.qk_rope_head_dim,
      v_head_dim, rope_interleave           mla.v_head_dim, mla.rope_interleave
    intermediate_size                     d_ff (the dense layers')
    first_k_dense_replace k               moe.n_dense_layers = k (k >= num_hidden_layers:
                                          no experts, moe.n_experts 0)
    n_routed_experts, num_experts_per_tok,  moe.n_experts, moe.top_k,
      moe_intermediate_size, n_shared_experts  moe.d_ff, moe.n_shared
    n_group, topk_group (null: 1)          moe.n_group, moe.topk_group
    norm_topk_prob, routed_scaling_factor  moe.norm_topk_prob, moe.routed_scaling_factor
    (the router: sigmoid, noaux_tc)       moe.router sigmoid (its bias, the tensor
                                          e_score_correction_bias, is moe_layers.router_bias)
    num_nextn_predict_layers D            mtp.depth = D when the weights files hold the
                                          multi-token prediction modules (the layers
                                          model.layers.{num_hidden_layers + k}.*, k < D, as
                                          DeepSeek's checkpoints do); else left to the config
                                          (transformers saves none: model.mtp off)

``moe.balance`` stays the run's choice: the imported bias steers the choice of experts whatever
it is, and only ``balance: bias`` moves it on. ``head_dim`` and ``qk_head_dim`` in a
DeepSeek-V3 file are derived (transformers recomputes them) and not read.

Anything seqshard does not compute (biases, another activation, another rope type, sliding
windows, partial rotary, sparse layers that are not all after
the dense ones, router jitter, quantized weights; DeepSeek-V3's scoring_func other than sigmoid,
topk_method other than noaux_tc, moe_layer_freq other than 1, num_key_value_heads other than
num_attention_heads) is an error naming the field, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from seqshard.hf.errors import HFFormatError
from seqshard.hf.safetensors_io import tensor_names
from seqshard.model.attention import rope_attention_factor
from seqshard.model.config import ModelConfig
from seqshard.model.layers import runs
from seqshard.model.moe import MOE

__all__ = [
    "ARCHITECTURES",
    "CONFIG_FILE",
    "DEEPSEEK_V3",
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
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
ARCHITECTURES = {
    LLAMA: "llama",
    QWEN3: "qwen3",
    MIXTRAL: "mixtral",
    QWEN3_MOE: "qwen3_moe",
    DEEPSEEK_V3: "deepseek_v3",
}
"""The architectures seqshard reads and writes -> their ``model_type``."""
_QK_NORM = (QWEN3, QWEN3_MOE)
_MOE = (MIXTRAL, QWEN3_MOE)
_YARN = {  # Hugging Face's key -> the seqshard field, the default where the key is absent
    "factor": ("rope_factor", None),
    "original_max_position_embeddings": ("rope_original_max_position", None),
    "beta_fast": ("rope_beta_fast", 32.0),
    "beta_slow": ("rope_beta_slow", 1.0),
    "mscale": ("rope_mscale", 0.0),
    "mscale_all_dim": ("rope_mscale_all_dim", 0.0),
}
# transformers' DeepseekV3Config defaults, for the keys a file may leave out
_DEEPSEEK_V3_DEFAULTS = {
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
}
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
    """:data:`HF_KEYS` of ``architecture``, with its experts' (and DeepSeek-V3's latents') keys."""
    if architecture == MIXTRAL:
        return {**HF_KEYS, "experts": "num_local_experts", "d_expert": "intermediate_size"}
    if architecture == QWEN3_MOE:
        return {**HF_KEYS, "experts": "num_experts", "d_expert": "moe_intermediate_size"}
    if architecture == DEEPSEEK_V3:
        return {
            **HF_KEYS,
            "n_kv": "num_attention_heads",
            "d_head": "qk_nope_head_dim + qk_rope_head_dim",
            "experts": "n_routed_experts",
            "d_expert": "moe_intermediate_size",
            "d_shared": "n_shared_experts x moe_intermediate_size",
            "q_lora": "q_lora_rank",
            "kv_lora": "kv_lora_rank",
            "kv_a": "kv_lora_rank + qk_rope_head_dim",
            "d_kv_b": "qk_nope_head_dim + v_head_dim",
            "d_v": "v_head_dim",
            "mtp": "num_nextn_predict_layers",
        }
    return HF_KEYS


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a ``config.json`` says: the seqshard model fields it fixes, and the rest we use."""

    fields: dict[str, Any]  # ModelConfig field ('moe.top_k' for MoEConfig's) -> value
    architecture: str  # one of ARCHITECTURES
    tied: bool  # tie_word_embeddings: no lm_head.weight in the files
    dtype: str | None  # the weights' dtype as the file names it ('bfloat16'), if it does
    path: Path
    # DeepSeek-V3's num_nextn_predict_layers: the multi-token prediction modules the files
    # may hold as layers num_hidden_layers, ...; fields holds it as mtp.depth if they do
    mtp_depth: int = 0

    @property
    def mtp_prefixes(self) -> tuple[str, ...]:
        """The tensor name prefix of each multi-token prediction module config.json declares:
        ``model.layers.{num_hidden_layers + k}.`` for k < num_nextn_predict_layers."""
        n = self.fields["n_layers"]
        return tuple(f"model.layers.{n + k}." for k in range(self.mtp_depth))

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
        nested: dict[str, dict[str, Any]] = {}  # 'moe', 'mla' -> their fields
        for key, value in self.fields.items():
            if "." in key:
                group, name = key.split(".", 1)
                nested.setdefault(group, {})[name] = value
        parts = {g: dataclasses.replace(getattr(base, g), **f) for g, f in nested.items()}
        return dataclasses.replace(base, **top, **parts)


def _field(cfg: ModelConfig, key: str) -> Any:
    """``cfg``'s value of a field, ``'moe.top_k'`` for MoEConfig's."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def read_hf_config(directory: str | Path) -> HFModel:
    """Parse ``directory/config.json``; raise HFFormatError naming the field for anything
    seqshard's Llama does not compute. The weights files' tensor names are read too (not their
    values): whether they hold DeepSeek-V3's multi-token prediction modules."""
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
    hf = _parse(raw, path)
    # The modules' depth is the model's when the files hold them (DeepSeek's checkpoints);
    # transformers declares one and saves none, and then the config says (off by default).
    prefixes = hf.mtp_prefixes
    if prefixes and any(n.startswith(prefixes) for n in tensor_names(directory)):
        hf = dataclasses.replace(hf, fields={**hf.fields, "mtp.depth": hf.mtp_depth})
    return hf


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
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, dict) else method
        raise HFFormatError(
            f"{path}: quantization_config (quant_method {method!r}) is not supported: seqshard "
            f"imports F32, BF16 and F16 weights. Dequantize the checkpoint first (to bfloat16; "
            f"DeepSeek's fp8 weights with its fp8_cast_bf16.py) and drop quantization_config."
        )
    # Qwen's files name a window that only use_sliding_window turns on.
    windowed = raw.get("use_sliding_window", True) and raw.get("sliding_window") is not None
    if windowed:
        raise bad("sliding_window", raw["sliding_window"], "no sliding_window (full attention)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise bad("layer_types", layer_types, "full attention in every layer")

    def integer(key: str, default: int | None = None, least: int = 1) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            what = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise HFFormatError(
                f"{path}: {key} must be {what}, got {value!r}"
                + (" (missing)" if key not in raw else "")
                + "."
            )
        return value

    fields: dict[str, Any] = {
        "vocab": integer("vocab_size"),
        "d_model": integer("hidden_size"),
        "n_layers": integer("num_hidden_layers"),
        "d_ff": integer("intermediate_size"),
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "qk_norm": architecture in _QK_NORM,
        "moe.n_experts": 0,
    }
    mtp_depth = 0
    if architecture == DEEPSEEK_V3:
        fields.update(_latent_attention(raw, path, integer, bad))
        fields.update(_deepseek_v3_experts(raw, integer, bad))
        mtp_key = (
            "num_nextn_predict_layers" if "num_nextn_predict_layers" in raw else "num_mtp_layers"
        )
        mtp_depth = integer(mtp_key, _DEEPSEEK_V3_DEFAULTS["num_nextn_predict_layers"], least=0)
    else:
        fields.update(_grouped_heads(raw, path, integer))
        if architecture in _MOE:
            fields.update(_experts(raw, path, architecture, integer, bad))
    if architecture == MIXTRAL:  # its intermediate_size is the experts'; no layer is dense
        del fields["d_ff"]
    fields.update(_rope(raw, path, architecture))
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    tied = bool(raw.get("tie_word_embeddings", False))
    return HFModel(fields, architecture, tied, dtype, path, mtp_depth)


def _grouped_heads(raw: dict[str, Any], path: Path, integer) -> dict[str, Any]:
    """Grouped-query attention's head fields (Llama, Qwen3, Mixtral, Qwen3-MoE)."""
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
    return {"attention": "gqa", "n_q_per_kv": heads // n_kv, "n_kv": n_kv, "d_head": d_head}


def _latent_attention(raw: dict[str, Any], path: Path, integer, bad) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention fields (``attention: mla``, ``mla.*``)."""
    heads = integer("num_attention_heads")
    n_kv = raw.get("num_key_value_heads")
    if n_kv is not None and n_kv != heads:
        raise bad(
            "num_key_value_heads",
            n_kv,
            f"num_key_value_heads equal to num_attention_heads={heads} (multi-head latent "
            f"attention up-projects keys and values for every head)",
        )
    if "q_lora_rank" not in raw:
        raise HFFormatError(
            f"{path}: q_lora_rank is missing: it must be null (queries projected from the "
            f"residual) or the positive size of the query latent."
        )
    q_lora = 0 if raw["q_lora_rank"] is None else integer("q_lora_rank")
    interleave = raw.get("rope_interleave", _DEEPSEEK_V3_DEFAULTS["rope_interleave"])
    if not isinstance(interleave, bool):
        raise bad("rope_interleave", interleave, "rope_interleave true or false")
    nope, rope = integer("qk_nope_head_dim"), integer("qk_rope_head_dim")
    return {
        "attention": "mla",
        "n_q_per_kv": 1,
        "n_kv": heads,
        "d_head": nope + rope,
        "mla.q_lora_rank": q_lora,
        "mla.kv_lora_rank": integer("kv_lora_rank"),
        "mla.qk_nope_head_dim": nope,
        "mla.qk_rope_head_dim": rope,
        "mla.v_head_dim": integer("v_head_dim"),
        "mla.rope_interleave": interleave,
    }


def _deepseek_v3_experts(raw: dict[str, Any], integer, bad) -> dict[str, Any]:
    """The ``moe.`` fields of a DeepSeek-V3 ``config.json``: the layers from
    first_k_dense_replace on route by sigmoid scores plus the bias, in groups, beside shared
    experts; none do when first_k_dense_replace >= num_hidden_layers."""
    for key, want, why in (
        ("scoring_func", "sigmoid", "seqshard's moe.router=sigmoid"),
        ("topk_method", "noaux_tc", "the bias-corrected group-limited top-k"),
        ("moe_layer_freq", 1, "experts in every layer after the dense ones"),
    ):
        if raw.get(key, want) != want:
            raise bad(key, raw[key], f"{key}={want!r} ({why})")
    n_layers = integer("num_hidden_layers")
    n_dense = integer("first_k_dense_replace", _DEEPSEEK_V3_DEFAULTS["first_k_dense_replace"], 0)
    if n_dense >= n_layers:  # every layer dense: transformers builds no experts
        return {"moe.n_experts": 0}

    def given(key: str) -> Any:
        return raw.get(key, _DEEPSEEK_V3_DEFAULTS[key])

    groups = {}
    for key in ("n_group", "topk_group"):
        groups[key] = 1 if given(key) is None else integer(key, _DEEPSEEK_V3_DEFAULTS[key])
    norm = bool(given("norm_topk_prob"))  # null: transformers leaves the gates unnormalized
    scale = given("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise bad("routed_scaling_factor", scale, "routed_scaling_factor a number > 0")
    experts = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    return {
        "moe.n_experts": integer(experts),
        "moe.top_k": integer("num_experts_per_tok", _DEEPSEEK_V3_DEFAULTS["num_experts_per_tok"]),
        "moe.d_ff": integer("moe_intermediate_size"),
        "moe.n_shared": integer("n_shared_experts", _DEEPSEEK_V3_DEFAULTS["n_shared_experts"], 0),
        "moe.n_dense_layers": n_dense,
        "moe.router": "sigmoid",
        "moe.n_group": groups["n_group"],
        "moe.topk_group": groups["topk_group"],
        "moe.norm_topk_prob": norm,
        "moe.routed_scaling_factor": float(scale),
    }


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
            "moe.norm_topk_prob": True,
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
        "moe.n_group": 1,
        "moe.topk_group": 1,
        "moe.routed_scaling_factor": 1.0,
    }


def _rope(raw: dict[str, Any], path: Path, architecture: str) -> dict[str, Any]:
    """The rope fields from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (older files)."""
    if isinstance(raw.get("rope_parameters"), dict):
        key, params = "rope_parameters", dict(raw["rope_parameters"])
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        key, params = "rope_scaling", dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    # DeepSeek-V3's softmax scale reads mscale_all_dim of any rope type but default: only
    # yarn's is seqshard's (seqshard.model.mla.softmax_mscale).
    types = ("default", "yarn") if architecture == DEEPSEEK_V3 else ("default", "llama3", "yarn")
    if rope_type not in types:
        raise HFFormatError(
            f"{path}: {key}.rope_type={rope_type!r} is not supported: seqshard computes a "
            f"{architecture}'s RoPE as {' or '.join(map(repr, types))}."
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
    if rope_type == "yarn":
        out.update(_yarn(raw, params, f"{path}: {key}"))
    return out


def _yarn(raw: dict[str, Any], params: dict[str, Any], where: str) -> dict[str, Any]:
    """YaRN's fields, read as transformers' ``_compute_yarn_parameters`` reads them: the
    original context from the top-level key if there is one, else from the parameters, else
    max_position_embeddings; no factor: max_position_embeddings over it; beta_fast, beta_slow
    null or absent: 32, 1; mscale, mscale_all_dim null or absent: 0 (none)."""
    if params.get("truncate", True) is not True:
        raise HFFormatError(
            f"{where}.truncate={params['truncate']!r} is not supported: seqshard computes YaRN's "
            f"correction range truncated to whole pairs (truncate true, the default)."
        )
    original = raw.get(
        "original_max_position_embeddings",
        params.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
    )
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise HFFormatError(
            f"{where}: yarn needs original_max_position_embeddings (the context the model was "
            f"trained for) as a positive integer, got {original!r}."
        )
    factor = params.get("factor")
    if factor is None and isinstance(raw.get("max_position_embeddings"), int):
        factor = raw["max_position_embeddings"] / original
    out: dict[str, Any] = {"rope_original_max_position": original}
    for hf_key, (field, default) in _YARN.items():
        if field in out:
            continue
        value = factor if hf_key == "factor" else params.get(hf_key) or default
        zero_ok = hf_key.startswith("mscale")  # an mscale of 0: none given
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value < 0 or (value == 0 and not zero_ok):
            what = "a number >= 0" if zero_ok else "a positive number"
            raise HFFormatError(f"{where}.{hf_key} must be {what}, got {value!r}.")
        out[field] = float(value)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        inferred = rope_attention_factor(ModelConfig(rope_type="yarn", **out))
        if not math.isclose(attention_factor, inferred, rel_tol=1e-6):
            raise HFFormatError(
                f"{where}.attention_factor={attention_factor!r} is not supported: seqshard "
                f"infers YaRN's attention factor from factor, mscale and mscale_all_dim "
                f"({inferred:.6g} here). Set attention_factor to null (or {inferred:.6g})."
            )
    return out


def architecture_of(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes ``cfg``'s model: Llama, Qwen3 (qk_norm),
    Mixtral (experts in every layer), Qwen3-MoE (qk_norm and experts) or DeepSeek-V3
    (multi-head latent attention, with or without experts). Raises ValueError naming the field
    for a model none of them computes."""
    if cfg.ffn != "swiglu":
        raise ValueError(
            f"model.ffn={cfg.ffn!r} has no Hugging Face counterpart: the architectures seqshard "
            f"exports ({', '.join(ARCHITECTURES)}) run SwiGLU dense layers (model.ffn=swiglu)."
        )
    if cfg.attention == "mla":
        _check_deepseek_v3(cfg)
        return DEEPSEEK_V3
    if cfg.mtp.depth:
        raise ValueError(
            f"model.mtp.depth={cfg.mtp.depth} (multi-token prediction modules) with "
            f"grouped-query attention has no Hugging Face counterpart: {LLAMA}, {QWEN3}, "
            f"{MIXTRAL} and {QWEN3_MOE} hold no such module; only {DEEPSEEK_V3} does, with "
            f"multi-head latent attention (model.attention=mla). Export a run trained with "
            f"model.mtp.depth=0."
        )
    moe = cfg.moe
    if not runs(cfg, MOE):
        return QWEN3 if cfg.qk_norm else LLAMA
    if moe.n_shared:
        raise ValueError(
            f"model.moe.n_shared={moe.n_shared} (shared experts, which every token passes "
            f"through ungated) has no Hugging Face architecture seqshard exports with "
            f"grouped-query attention: {MIXTRAL} and "
            f"{QWEN3_MOE} have no shared experts. The Hugging Face families that hold shared "
            f"experts each differ in another way: Qwen2-MoE (Qwen2MoeForCausalLM) scales its "
            f"shared expert by a learned sigmoid gate; DeepSeek-V3 (DeepseekV3ForCausalLM) adds "
            f"them ungated but uses multi-head latent attention (seqshard exports it for "
            f"model.attention=mla); GLM-4-MoE (Glm4MoeForCausalLM), "
            f"the closest, adds them ungated beside grouped-query attention and a sigmoid router "
            f"(as model.moe.router=sigmoid), and is not exported yet: to export this model, "
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
                f"{what} has no Hugging Face counterpart: seqshard exports experts beside "
                f"grouped-query attention as {MIXTRAL} or {QWEN3_MOE}, which need {want} "
                f"({DEEPSEEK_V3}, with sigmoid routers, expert groups and scaled gates, needs "
                f"multi-head latent attention: model.attention=mla)."
            )
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL


def _check_deepseek_v3(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field where a model with multi-head latent attention is
    not a DeepseekV3ForCausalLM."""
    if cfg.rope_type not in ("default", "yarn"):
        raise ValueError(
            f"model.rope_type={cfg.rope_type!r} with model.attention=mla has no Hugging Face "
            f"counterpart: {DEEPSEEK_V3} computes RoPE 'default' or 'yarn'."
        )
    if runs(cfg, MOE) and cfg.moe.router != "sigmoid":
        raise ValueError(
            f"model.moe.router={cfg.moe.router!r} with model.attention=mla has no Hugging Face "
            f"counterpart: {DEEPSEEK_V3} routes by sigmoid scores (model.moe.router=sigmoid)."
        )


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
    if cfg.rope_type == "yarn":  # mscales of 0 (none given) left out, as transformers reads them
        rope_scaling = {"rope_type": "yarn"} | {
            hf_key: getattr(cfg, field)
            for hf_key, (field, _) in _YARN.items()
            if getattr(cfg, field) or not hf_key.startswith("mscale")
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
    elif architecture == DEEPSEEK_V3:
        experts = _deepseek_v3_keys(cfg)
    windows: dict[str, Any] = {}  # full attention (Llama's and DeepSeek's have no such keys)
    if architecture not in (LLAMA, DEEPSEEK_V3):
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
        # DeepSeek-V3's is the rotated part's (transformers derives it so)
        "head_dim": cfg.rope_dim if architecture == DEEPSEEK_V3 else cfg.d_head,
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


def _deepseek_v3_keys(cfg: ModelConfig) -> dict[str, Any]:
    """A DeepSeek-V3 ``config.json``'s attention, expert and MTP keys. Without experts every
    layer is dense (first_k_dense_replace = num_hidden_layers; transformers then builds no
    expert, and the expert keys, seqshard's moe fields, are never read). The router's kind is
    written out (scoring_func, topk_method), as DeepSeek's own code reads them.
    num_nextn_predict_layers is model.mtp.depth: the export holds the modules as DeepSeek's
    checkpoints do (transformers' model runs none and ignores their tensors)."""
    mla, moe = cfg.mla, cfg.moe
    return {
        "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "first_k_dense_replace": moe.n_dense_layers if runs(cfg, MOE) else cfg.n_layers,
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.d_ff,
        "n_shared_experts": moe.n_shared,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": cfg.mtp.depth,
        "output_router_logits": False,
    }
