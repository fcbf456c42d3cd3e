"""ModelConfig: the sizes and numerics of the decoder; its field names name the weight dims.

Weight types are written in these names (``w_up: f32['d_model/fsdp d_ff/t']``), so a config gives
every weight's global shape through :meth:`ModelConfig.dim_sizes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

from seqshard.shardlib.fp8 import Fp8Mode
from seqshard.shardlib.remat import RematName

__all__ = [
    "DIM_FIELDS",
    "DIM_KEYS",
    "AttentionKind",
    "MLAConfig",
    "MTPConfig",
    "MoEConfig",
    "DTYPE_BYTES",
    "AttentionImpl",
    "AttentionMask",
    "Backward",
    "ContextImpl",
    "ModelConfig",
    "RESIDUAL_SPECS",
    "Residual",
    "RematName",
    "RopeType",
]

AttentionImpl = Literal["auto", "einsum", "cudnn", "xla", "splash", "pallas"]
AttentionMask = Literal["document", "causal"]
Backward = Literal["autodiff", "explicit"]
Residual = Literal["M/t", "L/t"]
ContextImpl = Literal["allgather", "ring"]
RopeType = Literal["default", "llama3", "yarn"]
AttentionKind = Literal["gqa", "mla"]

RESIDUAL_SPECS: Mapping[str, str] = {"M/t": "B/dp L@zigzag/c M/t", "L/t": "B/dp L@zigzag/c/t M"}
"""``model.residual`` -> the residual stream's layout between blocks, per device."""
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "bfloat16": 2}
"""The compute dtypes (``model.compute_dtype``) and their bytes: the one table of them."""
_DTYPES = tuple(DTYPE_BYTES)
_LOGITS = (
    "einsum",
    "auto",
)  # the attention_impl values whose attention may form logits (auto: on CPU)


DIM_FIELDS = {
    "layers": "n_layers",
    "vocab": "vocab",
    "d_model": "d_model",
    "n_q_per_kv": "n_q_per_kv",
    "n_kv": "n_kv",
    "d_head": "d_head",
    "d_ff": "d_ff",
    "fp8_history": "fp8_history",
}
"""Each dimension name of the weight types -> the ModelConfig field that sizes it."""

DIM_KEYS = {
    **DIM_FIELDS,
    "moe_layers": "n_layers",
    "experts": "moe.n_experts",
    "d_expert": "moe.d_ff",
    "d_shared": "moe.n_shared",
    "q_lora": "mla.q_lora_rank",
    "kv_lora": "mla.kv_lora_rank",
    "kv_a": "mla.kv_lora_rank + mla.qk_rope_head_dim",
    "d_kv_b": "mla.qk_nope_head_dim + mla.v_head_dim",
    "d_v": "mla.v_head_dim",
    "mtp": "mtp.depth",
    "mtp_in": "d_model (x 2)",
}
"""Each dimension name -> the config key (under ``model.``) that sizes it, for messages."""


Router = Literal["softmax", "sigmoid"]
Balance = Literal["aux_loss", "bias", "none"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The FFN as a mixture of experts (``model.moe``); ``n_experts=0`` (the default) is the
    dense model. Layers ``n_dense_layers`` and up route each token to ``top_k`` of
    ``n_experts`` SwiGLU experts of hidden size ``d_ff`` (and through ``n_shared`` shared ones
    of that size), split over the mesh axis e (:mod:`seqshard.model.moe`).

    router: ``softmax``: top-k of softmax(logits), the k weights renormalized to sum 1
        (Mixtral, Qwen3-MoE); ``sigmoid``: top-k of sigmoid(logits), normalized to sum 1
        (DeepSeek-V3).
    balance: ``aux_loss``: ``aux_loss_weight`` x n_experts x sum_i f_i P_i (f_i the fraction
        of routed token copies, P_i the mean router probability of expert i; Switch / GShard);
        ``bias``: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the
        scores for the top-k choice only, moved by ``bias_rate`` towards balance after each
        optimizer step from the step's expert load; ``none``.
    z_loss_weight: ``weight`` x mean of logsumexp(router logits)^2 (ST-MoE), 0: off.
    n_group, topk_group: group-limited routing (DeepSeek-V3): the experts in ``n_group``
        groups of n_experts / n_group; each token first keeps the ``topk_group`` groups whose
        two best experts score highest (the scores the choice reads: bias included), then
        picks its top_k among their experts. 1, 1 (default): no groups.
    norm_topk_prob: the top_k gates normalized to sum 1 (default; Mixtral, DeepSeek-V3), or
        each the expert's plain score (Qwen3-MoE with ``norm_topk_prob: false``).
    routed_scaling_factor: the routed experts' gates multiplied by it (DeepSeek-V3: 2.5), the
        shared experts' output not.
    capacity_factor: 0 (dropless: no token copy is ever dropped, the exchange buffers sized
        for the worst case); > 0: each expert shard takes at most ``capacity_factor`` x its
        even share of the token copies, the rest are dropped (their gate's output is 0). A
        factor at or above the worst case (e x min(top_k, n_experts / e) / top_k: every copy
        to one shard) drops nothing and sizes the buffers as 0 does, however large it is.
    """

    n_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts each token is routed to
    d_ff: int = 256  # hidden size of each expert (and of each shared one)
    n_shared: int = 0  # shared experts every token passes through besides its top_k
    n_dense_layers: int = 0  # the first layers keep a dense FFN
    router: Router = "softmax"
    balance: Balance = "aux_loss"
    aux_loss_weight: float = 0.01  # balance=aux_loss: the load-balancing loss's weight
    bias_rate: float = 0.001  # balance=bias: how far each step moves the expert biases
    z_loss_weight: float = 0.0
    capacity_factor: float = 0.0
    n_group: int = 1  # expert groups (DeepSeek-V3's n_group); 1: no group limit
    topk_group: int = 1  # groups each token may route into (of n_group)
    norm_topk_prob: bool = True  # the top_k gates normalized to sum 1
    routed_scaling_factor: float = 1.0  # the routed experts' gates times this

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    def _check_groups(self) -> None:
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.moe.{name} must be a positive integer, got {value!r}.")
        if self.n_experts % self.n_group:
            raise ValueError(
                f"model.moe.n_group={self.n_group} does not divide model.moe.n_experts="
                f"{self.n_experts}: the experts form n_group equal groups. Choose n_group "
                f"dividing {self.n_experts} (1: no groups)."
            )
        per_group = self.n_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(
                f"model.moe.n_group={self.n_group} leaves {per_group} expert per group: a "
                f"group is scored by its two best experts (DeepSeek-V3). Use n_group <= "
                f"{self.n_experts // 2}, or 1."
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"model.moe.topk_group={self.topk_group} is more than model.moe.n_group="
                f"{self.n_group}: each token keeps topk_group of the n_group groups."
            )
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"model.moe.top_k={self.top_k} is more than the {self.topk_group * per_group} "
                f"experts in topk_group={self.topk_group} groups of {per_group}: raise "
                f"model.moe.topk_group or lower top_k."
            )

    def check(self, n_layers: int) -> None:
        """Raise ValueError naming the key, the values and the fix."""
        if not self.enabled:
            if self.n_experts < 0:
                raise ValueError(f"model.moe.n_experts must be >= 0, got {self.n_experts}.")
            return
        for name in ("top_k", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.moe.{name} must be a positive integer, got {value!r}.")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} is more than model.moe.n_experts="
                f"{self.n_experts}: each token picks top_k distinct experts. Lower top_k or "
                f"add experts."
            )
        if self.n_shared < 0:
            raise ValueError(f"model.moe.n_shared must be >= 0, got {self.n_shared}.")
        if not 0 <= self.n_dense_layers < n_layers:
            raise ValueError(
                f"model.moe.n_dense_layers={self.n_dense_layers} must be in 0 .. "
                f"model.n_layers - 1 = {n_layers - 1}: at least one layer routes to experts "
                f"(set model.moe.n_experts=0 for a dense model)."
            )
        self._check_groups()
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(
                f"model.moe.norm_topk_prob must be true or false, got {self.norm_topk_prob!r}."
            )
        if not 0 < self.routed_scaling_factor < math.inf:
            raise ValueError(
                f"model.moe.routed_scaling_factor must be finite and > 0, got "
                f"{self.routed_scaling_factor!r} (1: the gates as the router gives them)."
            )
        _check_choice("moe.router", self.router, Router)
        _check_choice("moe.balance", self.balance, Balance)
        for name in ("aux_loss_weight", "bias_rate", "z_loss_weight", "capacity_factor"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(
                    f"model.moe.{name} must be finite and >= 0, got {value!r}"
                    + (
                        " (0 means dropless: no token copy is ever dropped; a factor at or "
                        "above the dropless bound sizes the buffers as 0 does)."
                        if name == "capacity_factor"
                        else "."
                    )
                )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (``model.attention: mla``; DeepSeek-V2/V3), its fields named
    as Hugging Face's ``DeepseekV3Config`` names them (:mod:`seqshard.model.mla`).

    Keys and values come from one compressed latent per token: ``kv_lora_rank`` numbers (RMS
    normalized), up-projected per head to ``qk_nope_head_dim`` key and ``v_head_dim`` value
    numbers; beside it ``qk_rope_head_dim`` numbers carry RoPE, one key head shared by every
    head. Queries: per head ``qk_nope_head_dim + qk_rope_head_dim`` (= ``model.d_head``),
    projected from the residual, or with ``q_lora_rank`` > 0 through a normed latent of that
    size. ``rope_interleave``: the RoPE numbers pair as (0, 1), (2, 3), ... (DeepSeek's
    released weights; Hugging Face's default) rather than (i, i + half).
    """

    q_lora_rank: int = 0  # 0: queries projected from the residual directly
    kv_lora_rank: int = 64  # the kv latent per token (RMS normalized)
    qk_nope_head_dim: int = 32  # a query/key head's numbers without RoPE
    qk_rope_head_dim: int = 16  # a query/key head's numbers with RoPE (one shared key head)
    v_head_dim: int = 32  # a value head's numbers
    rope_interleave: bool = True  # RoPE pairs (0, 1), (2, 3), ...: DeepSeek's weights

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the key, the values and the fix (only with MLA)."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.mla.{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ValueError(
                f"model.mla.q_lora_rank must be an integer >= 0 (0: no query latent), got "
                f"{self.q_lora_rank!r}."
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"model.mla.qk_rope_head_dim must be even (RoPE rotates pairs), got "
                f"{self.qk_rope_head_dim}."
            )
        if not isinstance(self.rope_interleave, bool):
            raise ValueError(
                f"model.mla.rope_interleave must be true or false, got {self.rope_interleave!r}."
            )
        if cfg.n_q_per_kv != 1:
            raise ValueError(
                f"model.attention=mla gives every head its own keys and values: set "
                f"model.n_q_per_kv=1 (got {cfg.n_q_per_kv}) and model.n_kv to the number of "
                f"heads (Hugging Face's num_attention_heads, = num_key_value_heads)."
            )
        want = self.qk_nope_head_dim + self.qk_rope_head_dim
        if cfg.d_head != want:
            raise ValueError(
                f"model.attention=mla: model.d_head={cfg.d_head} must be the query/key head "
                f"size model.mla.qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim} + {self.qk_rope_head_dim} = {want}: set "
                f"model.d_head={want}."
            )


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (``model.mtp``; DeepSeek-V3): ``depth`` sequential modules after
    the layers, module k predicting the token k + 1 ahead (:mod:`seqshard.model.mtp`); their
    mean loss times ``loss_weight`` joins the training loss. ``depth: 0`` (default): off."""

    depth: int = 0  # modules after the layers, module k predicting token k + 1 ahead; 0: off
    loss_weight: float = 0.3  # their mean loss's weight in the training loss

    def check(self) -> None:
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or self.depth < 0:
            raise ValueError(f"model.mtp.depth must be an integer >= 0, got {self.depth!r}.")
        if not 0 <= self.loss_weight < math.inf:
            raise ValueError(
                f"model.mtp.loss_weight must be finite and >= 0, got {self.loss_weight!r} "
                f"(DeepSeek-V3: 0.3, then 0.1)."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder.

    remat: what the scanned layer keeps for the backward pass.
        ``saved``: only what the layer marks with ``save_for_backward`` (q, k, v, attention
        output, post-attention residual, gate and up projections); weights are re-gathered.
        ``full``: nothing but the layer input; everything is recomputed.
        ``none``: no rematerialization; every intermediate, gathered weights included, is kept.
    attention_impl: ``einsum`` (plain XLA einsums; CPU and reference), ``cudnn`` (fused
        ``jax.nn.dot_product_attention(implementation='cudnn')``, GPU only), ``xla``
        (``jax.nn.dot_product_attention``'s XLA path), ``splash`` (Pallas splash attention, TPU;
        seq_len a multiple of 128; elsewhere interpreted, slow), ``pallas`` (Pallas' GPU flash
        attention with segment ids, seqshard.model.pallas_gpu; seq_len a multiple of 16;
        elsewhere interpreted, slow), ``auto`` (splash on TPU; on GPU pallas for the document
        mask, cudnn for the causal one; else einsum).
    attention_mask: ``document`` restricts attention to the same packed document; ``causal``
        ignores document boundaries (faster with cudnn; leaks across packed documents).
    compute_dtype: matmul input dtype; master weights, norms, softmax, logits and loss are f32.
    backward: how ``jax.grad`` of the loss is computed. ``explicit`` (default): the
        hand-written backward of ``seqshard/model/backward.py`` (a ``jax.custom_vjp`` over the
        whole model), keeping what ``remat`` says; same values as autodiff to f32 rounding,
        the same collectives, less temporary memory, and faster on CPU (docs/benchmarks.md).
        ``autodiff``: JAX
        differentiates the forward pass (transposing each collective).
    residual: the residual stream's layout between blocks (:data:`RESIDUAL_SPECS`). ``L/t``
        (default; Megatron's sequence parallelism): ``'B/dp L@zigzag/c/t M'``, the sequence split over t
        (``train.seq_len`` divisible by c x t). ``M/t``: ``'B/dp L@zigzag/c M/t'``, d_model split over t.
        Either way each block gathers over t to ``'B/dp L@zigzag/c M'`` around its norm (M/t before it,
        L/t its normalized rows after it) and reduce-scatters its output back: the same model,
        other spec strings; L/t runs faster (docs/benchmarks.md); with t = 1 they are the
        same layout.
    context_impl: attention across the sequence split over mesh axis c (``mesh.c > 1``; with
        c = 1 there is nothing to choose). ``allgather`` (default): k and v gathered over c in
        each layer, queries local. ``ring``: k and v blocks passed around the c ring with an
        online softmax, never more than two blocks' keys on a device, and pairs of chunks
        that the causal or document mask hides skipped (:mod:`seqshard.model.context`).
    rope_type: ``default``: pair i of each head turns by position x rope_theta^(-2i/d_head).
        ``llama3``: Llama 3.1's long-context rescaling of those frequencies (the
        ``rope_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
        ``rope_original_max_position`` fields, named after Hugging Face's ``rope_parameters``
        keys ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
        ``original_max_position_embeddings``): wavelengths longer than original_max /
        low_freq_factor slow down by ``rope_factor``, shorter than original_max /
        high_freq_factor stay, the band between is interpolated
        (:func:`seqshard.model.attention.rope_frequencies`).
    attention: the layers' attention block kind: ``gqa`` (default; grouped-query attention,
        :mod:`seqshard.model.attention_block`) or ``mla`` (multi-head latent attention,
        ``model.mla``; :mod:`seqshard.model.mla`).
    rope_type ``yarn``: YaRN (Hugging Face's ``rope_type: yarn``, DeepSeek-V3's): frequencies
        between the ``rope_beta_fast`` and ``rope_beta_slow`` rotation counts over
        ``rope_original_max_position`` positions interpolated by ``rope_factor``, cos and sin
        times the attention factor from ``rope_mscale`` / ``rope_mscale_all_dim``; with MLA
        the softmax scale is times mscale(rope_factor, rope_mscale_all_dim)^2.
    ffn: the dense layers' FFN block kind: ``swiglu`` (default), or a kind added with
        :func:`seqshard.model.layers.register_ffn` (``tests/model/test_block_kinds.py``).
    fp8: FP8 matmuls for the projections (:mod:`seqshard.shardlib.fp8`). ``none`` (default):
        every matmul in ``compute_dtype``. ``current``: q, kv, o, gate, up and down multiply
        operands on e4m3's grid (weights gathered over FSDP in e4m3: half of bf16's bytes) and
        their gradients on e5m2's, each tensor at the scale of its own amax (reduced over the
        mesh axes it is split over). ``delayed``: the forward's operands at the scale of the
        largest amax of their last ``fp8_history`` steps (kept with the weights; the
        gradients at their current scale). The attention core, the embedding, the head and
        the MoE experts stay in compute_dtype (docs/fp8.md).
    """

    vocab: int = 4096  # embedding rows; >= the tokenizer's vocabulary
    d_model: int = 128  # width of the residual stream
    n_layers: int = 2  # decoder layers
    n_q_per_kv: int = 2  # query heads per key/value head (grouped-query attention)
    n_kv: int = 2  # key/value heads
    d_head: int = 32  # width of each head (even: RoPE rotates pairs)
    d_ff: int = 512  # hidden size of the SwiGLU FFN
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    compute_dtype: str = "bfloat16"
    remat: RematName = "saved"
    attention_impl: AttentionImpl = "auto"
    attention_mask: AttentionMask = "document"
    backward: Backward = "explicit"
    residual: Residual = "L/t"
    context_impl: ContextImpl = "allgather"
    rope_type: RopeType = "default"
    rope_factor: float = 8.0  # rope_type=llama3 (see there)
    rope_low_freq_factor: float = 1.0  # rope_type=llama3
    rope_high_freq_factor: float = 4.0  # rope_type=llama3
    rope_original_max_position: int = 8192  # rope_type=llama3
    rope_beta_fast: float = 32.0  # rope_type=yarn
    rope_beta_slow: float = 1.0  # rope_type=yarn
    rope_mscale: float = 0.0  # rope_type=yarn (0: none given)
    rope_mscale_all_dim: float = 0.0  # rope_type=yarn (0: none given)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    attention: AttentionKind = "gqa"  # the attention block kind: gqa, or mla (model.mla)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)
    ffn: str = "swiglu"  # the dense layers' FFN block kind (seqshard.model.layers.FFN_KINDS)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    fp8: Fp8Mode = "none"  # FP8 projections: none, current, delayed (seqshard.shardlib.fp8)
    fp8_history: int = 16  # model.fp8=delayed: the amax history's length, in steps
    max_logit: bool = False  # report each attention head's largest logit q k / sqrt(d_head)
    #   of the step (metric max_logit/attention); train.muon.qk_clip needs it. Einsum
    #   attention only (the fused kernels never form the logits)

    def __post_init__(self) -> None:
        for name in DIM_FIELDS.values():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}.")
        if self.d_head % 2 and self.attention != "mla":  # MLA's rope part: model.mla's check
            raise ValueError(
                f"model.d_head must be even for RoPE (it rotates pairs), got {self.d_head}."
            )
        if self.compute_dtype not in _DTYPES:
            raise ValueError(
                f"model.compute_dtype must be one of {_DTYPES}, got {self.compute_dtype!r}."
            )
        _check_choice("remat", self.remat, RematName)
        _check_choice("attention_impl", self.attention_impl, AttentionImpl)
        _check_choice("attention_mask", self.attention_mask, AttentionMask)
        _check_choice("backward", self.backward, Backward)
        _check_choice("residual", self.residual, Residual)
        _check_choice("context_impl", self.context_impl, ContextImpl)
        _check_choice("rope_type", self.rope_type, RopeType)
        if self.rope_type == "llama3" and not (
            self.rope_factor > 0
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_position > 0
        ):
            raise ValueError(
                f"model.rope_type=llama3 needs rope_factor > 0, 0 < rope_low_freq_factor < "
                f"rope_high_freq_factor and rope_original_max_position > 0; got "
                f"{self.rope_factor}, {self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
                f"{self.rope_original_max_position} (Llama 3.1: 8, 1, 4, 8192)."
            )
        if self.rope_type == "yarn" and not (
            self.rope_factor > 0
            and self.rope_original_max_position > 0
            and self.rope_beta_fast > 0
            and self.rope_beta_slow > 0
            and self.rope_mscale >= 0
            and self.rope_mscale_all_dim >= 0
        ):
            raise ValueError(
                f"model.rope_type=yarn needs rope_factor, rope_original_max_position, "
                f"rope_beta_fast and rope_beta_slow > 0 and rope_mscale, rope_mscale_all_dim "
                f">= 0; got {self.rope_factor}, {self.rope_original_max_position}, "
                f"{self.rope_beta_fast}, {self.rope_beta_slow}, {self.rope_mscale}, "
                f"{self.rope_mscale_all_dim} (DeepSeek-V3: 40, 4096, 32, 1, 1, 1)."
            )
        _check_choice("attention", self.attention, AttentionKind)
        if self.attention == "mla":
            self.mla.check(self)
            if self.qk_norm:
                raise ValueError(
                    "model.qk_norm normalizes grouped-query attention's heads; MLA normalizes "
                    "its latents instead: set model.qk_norm=false with model.attention=mla."
                )
        _check_choice("fp8", self.fp8, Fp8Mode)
        if self.fp8 != "none" and self.attention == "mla":
            raise ValueError(
                f"model.fp8={self.fp8} runs grouped-query attention's and the SwiGLU FFN's "
                f"projections in FP8; MLA's latent projections have no FP8 path yet: set "
                f"model.fp8=none with model.attention=mla."
            )
        self.mtp.check()
        if not isinstance(self.max_logit, bool):
            raise ValueError(f"model.max_logit must be true or false, got {self.max_logit!r}.")
        if self.max_logit and (self.attention == "mla" or self.attention_impl not in _LOGITS):
            raise ValueError(
                f"model.max_logit reads each head's logits, which only einsum attention forms "
                f"(grouped-query attention): got model.attention={self.attention}, "
                f"model.attention_impl={self.attention_impl}. Set model.attention_impl=einsum "
                f"and model.attention=gqa, or model.max_logit=false."
            )
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"model.qk_norm must be true or false, got {self.qk_norm!r}.")
        self.moe.check(self.n_layers)
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"model.rope_theta and model.norm_eps must be positive, got "
                f"{self.rope_theta} and {self.norm_eps}."
            )

    def check_mesh_kinds(self, mesh: Mapping[str, int], where: str) -> None:
        """Raise ValueError if the mesh's axis sizes ``mesh`` (every axis given) do not suit
        the model's block kinds: e > 1 splits the routed experts, so needs some; p > 1
        pipelines one layer stack, so not dense layers before the MoE ones. ``where``
        describes the mesh for the message."""
        if mesh["e"] > 1 and not self.moe.enabled:
            raise ValueError(
                f"mesh axis e={mesh['e']} splits the routed experts, but the model has none "
                f"(model.moe.n_experts=0) on a {where} mesh. Set mesh.e=1 (use mesh.d for data "
                f"parallelism), or give the model experts (model.moe.n_experts divisible by e)."
            )
        if self.max_logit and self.ring_over(mesh["c"]):
            raise ValueError(
                f"model.max_logit reads each head's logits, which ring attention over mesh.c="
                f"{mesh['c']} never holds whole on a {where} mesh. Set model.context_impl="
                f"allgather, or model.max_logit=false."
            )
        if mesh["p"] > 1 and self.moe.enabled and self.moe.n_dense_layers:
            # Both stacks split over p, stage s would run dense block s, then MoE block s:
            # not every dense layer before every MoE layer (seqshard.model.pipeline.pipelined).
            raise ValueError(
                f"a model with experts pipelines only MoE layers: model.moe.n_dense_layers="
                f"{self.moe.n_dense_layers} dense first layers with mesh.p={mesh['p']} would "
                f"run out of the model's order (each stage its dense block, then its MoE block) "
                f"on a {where} mesh. Set model.moe.n_dense_layers=0 to pipeline, or mesh.p=1."
            )

    def dim_sizes(self) -> dict[str, int]:
        """Global sizes of the dimension names used in the weight types: the model's shape.
        With experts, ``layers`` counts the first, dense layers and ``moe_layers`` the rest."""
        sizes = {dim: getattr(self, field) for dim, field in DIM_FIELDS.items()}
        moe = self.moe
        if moe.enabled:
            sizes["layers"] = moe.n_dense_layers
        sizes["moe_layers"] = self.n_layers - sizes["layers"]
        sizes["experts"] = moe.n_experts
        sizes["d_expert"] = moe.d_ff
        sizes["d_shared"] = moe.n_shared * moe.d_ff
        mla = self.mla
        sizes["q_lora"] = mla.q_lora_rank
        sizes["kv_lora"] = mla.kv_lora_rank
        sizes["kv_a"] = mla.kv_lora_rank + mla.qk_rope_head_dim
        sizes["d_kv_b"] = mla.qk_nope_head_dim + mla.v_head_dim
        sizes["d_v"] = mla.v_head_dim
        sizes["mtp"] = self.mtp.depth
        sizes["mtp_in"] = 2 * self.d_model
        return sizes

    @property
    def rope_dim(self) -> int:
        """The numbers of a query or key head that RoPE rotates: all d_head (GQA), or MLA's
        qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.d_head

    @property
    def d_v(self) -> int:
        """A value head's size: d_head (GQA), or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.attention == "mla" else self.d_head

    @property
    def residual_spec(self) -> str:
        """The residual stream between blocks: ``'B/dp L@zigzag/c M/t'`` or ``'B/dp L@zigzag/c/t M'``
        (the sequence in zigzag order over the context axis c: :mod:`seqshard.model.context`)."""
        return RESIDUAL_SPECS[self.residual]

    def ring_over(self, c: int) -> bool:
        """Whether attention runs as the ring over a context axis of size ``c``: only with
        ``context_impl=ring`` and the sequence really split (c > 1)."""
        return c > 1 and self.context_impl == "ring"

    @property
    def n_heads(self) -> int:
        return self.n_q_per_kv * self.n_kv

    @property
    def compute_bytes(self) -> int:
        """Bytes of one value in ``compute_dtype``."""
        return DTYPE_BYTES[self.compute_dtype]


def _check_choice(name: str, value: str, choices) -> None:
    allowed = choices.__args__
    if value not in allowed:
        raise ValueError(f"model.{name} must be one of {allowed}, got {value!r}.")
