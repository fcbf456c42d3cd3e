"""Tests of seqshard/hf for DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention
(``model.attention: mla``), YaRN, a sigmoid router with its bias, expert groups, shared experts
and dense first layers, read and written by the modules test_load.py tests for the others.

    HF -> us     random tiny DeepseekV3ForCausalLM models (transformers, f32, every weight random,
                 the router's e_score_correction_bias too) saved with save_pretrained, read by
                 init.from_hf's entry points (read_hf_config, load_hf_weights): logits_fn on
                 e2 x d2 x t2 equals torch's within 1e-5; with and without the query latent,
                 YaRN (both mscales) or default rope, interleaved or rotate-half rope pairs,
                 groups, shared experts, one dense first layer; an MLA model without experts
    us -> HF     seqshard models with MLA exported: transformers loads them (experts or none)
                 with equal logits, and imported back every weight is bit-identical; with
                 multi-token prediction modules (depth 1, 2) too, written as DeepSeek's
                 checkpoints hold them (model.layers.{n_layers + k}.*), which transformers
                 ignores
    controls     the other rope pairing, no YaRN mscales or a zero router bias move the logits
                 by far more than 1e-5: the logits tests check each
    files        the modules' copies of lm_head and the embedding must equal the model's; a
                 module the files hold in part, or a layer past num_nextn_predict_layers, is
                 an error naming a tensor; files without modules (as transformers saves them)
                 import at depth 0 with one line, or at a depth the config asks for as
                 init_weights makes it; a shape config.json contradicts names the tensor and its
                 keys; shared experts of no element (n_shared_experts 0) import as none
    bad input    each field seqshard does not compute: an error naming it, expected and actual;
                 an MLA model DeepSeek-V3 cannot hold is refused before export

Tests that need transformers and torch (the ``hf`` extra) skip without them. Nothing downloads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_helpers import (
    HAS_TRANSFORMERS,
    LOGITS_TOL,
    needs_transformers,
    random_seqshard_weights,
    safetensors_names,
    seqshard_logits,
    tokens_and_starts,
    torch_logits,
    tree_equal,
)

from seqshard.hf.hf_config import HFFormatError, read_hf_config
from seqshard.hf.load import load_hf_weights
from seqshard.mesh import training_mesh
from seqshard.model import ModelConfig
from seqshard.model.config import MLAConfig, MoEConfig, MTPConfig
from seqshard.model.weights import init_weights

MOE_MESH = {"e": 2, "d": 2, "t": 2}  # the experts over e, their hidden dim and the heads over t
DENSE_MESH = {"d": 4, "t": 2}
# Extrapolated, ramped and interpolated rope pairs with qk_rope_head_dim 8, theta 1000 (YaRN's
# ramp runs over pairs 0..2); mscale and mscale_all_dim differ, so cos and sin are scaled
# (their ratio) and so is the softmax (mscale_all_dim's square).
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
SIZES = {  # 4 heads of q/k 16 + 8, v 12; latents 32; 3 layers, the first dense
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
VARIANTS = {
    # DeepSeek-V3's own shape: the query latent, YaRN, interleaved rope pairs, 4 groups of 2
    # experts (2 kept per token), 2 shared experts, gates x 2.5
    "q_lora-yarn-interleave-groups": {
        "q_lora_rank": 32,
        "rope_parameters": YARN,
        "rope_interleave": True,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    # queries straight from the residual, default rope, rotate-half pairs, no groups, one
    # shared expert, unnormalized gates x 1.5
    "no_q_lora-default-rotate_half": {
        "q_lora_rank": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "rope_interleave": False,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": False,
    },
}


def hf_deepseek_v3(path: Path, **changes):
    """A random DeepseekV3ForCausalLM of :data:`SIZES` with ``changes`` (f32; norm gains
    1 + N(0, 0.04), the embedding N(0, 1/4) as hf_llama's, other matrices N(0, 1/fan_in), the
    router's bias N(0, 0.01): it moves which experts are chosen), saved with save_pretrained
    into ``path``. An embedding as small as the matrices' (N(0, 1/64)) leaves the logits
    sensitive to rounding: 1-ulp noise on the weights alone moves them by up to 2e-5."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**SIZES, **changes})
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (2.0 if "embed" in name else p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def hf_cfg(path: Path) -> ModelConfig:
    return read_hf_config(path).model_config(
        ModelConfig(compute_dtype="float32", attention_impl="einsum")
    )


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    """A saved random DeepSeek-V3 (the first variant), made once: tests copy it."""
    if not HAS_TRANSFORMERS:
        pytest.skip("needs transformers and a CPU torch")
    path = tmp_path_factory.mktemp("deepseek_v3") / "model"
    hf_deepseek_v3(path, **VARIANTS["q_lora-yarn-interleave-groups"])
    return path


@pytest.fixture(scope="module")
def deepseek_weights(deepseek_dir):
    """deepseek_dir's weights imported on e2 x d2 x t2 (read only)."""
    return load_hf_weights(
        deepseek_dir, hf_cfg(deepseek_dir), training_mesh(MOE_MESH), log=lambda m: None
    )


@pytest.fixture
def deepseek_copy(deepseek_dir, tmp_path):
    out = tmp_path / "deepseek_v3"
    shutil.copytree(deepseek_dir, out)
    return out


def check_imports_with_equal_logits(path: Path, model) -> ModelConfig:
    cfg = hf_cfg(path)
    mesh = training_mesh(MOE_MESH if cfg.moe.enabled else DENSE_MESH)
    lines = []
    weights = load_hf_weights(path, cfg, mesh, log=lines.append)
    # transformers writes num_nextn_predict_layers 1 and no module: depth 0, said in one line
    said = [line for line in lines if "multi-token prediction" in line]
    assert len(said) == 1 and "num_nextn_predict_layers=1, but" in said[0], lines
    assert "imported without one (model.mtp.depth 0)" in said[0] and cfg.mtp.depth == 0
    if cfg.moe.enabled:
        bias = np.asarray(weights.moe_layers.router_bias)
        gate = model.model.layers[cfg.moe.n_dense_layers].mlp.gate
        assert bias.any() and np.array_equal(bias[0], gate.e_score_correction_bias.numpy())
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0  # logits of a size where 1e-5 means something
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)
    return cfg


@needs_transformers
@pytest.mark.parametrize(
    "variant",
    [
        "q_lora-yarn-interleave-groups",
        "no_q_lora-default-rotate_half",
    ],
)
def test_a_transformers_deepseek_v3_imports_with_equal_logits(tmp_path, variant):
    """HF -> seqshard on e2 x d2 x t2: logits_fn equals torch's logits within 1e-5 (measured
    max abs: q_lora-yarn 4.8e-6, no_q_lora-default 3.7e-6, of logits up to about 4.3)."""
    changes = VARIANTS[variant]
    model = hf_deepseek_v3(tmp_path, **changes)
    cfg = check_imports_with_equal_logits(tmp_path, model)
    assert (cfg.attention, cfg.n_q_per_kv, cfg.n_kv, cfg.d_head) == ("mla", 1, 4, 24)
    assert cfg.mla == MLAConfig(
        q_lora_rank=changes["q_lora_rank"] or 0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=changes["rope_interleave"],
    )
    moe = cfg.moe
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.n_dense_layers, cfg.d_ff) == (8, 2, 16, 1, 48)
    assert (moe.router, moe.n_shared, moe.n_group, moe.topk_group) == (
        "sigmoid",
        changes["n_shared_experts"],
        changes["n_group"],
        changes["topk_group"],
    )
    assert moe.routed_scaling_factor == changes["routed_scaling_factor"]
    assert moe.norm_topk_prob == changes["norm_topk_prob"]
    if changes["rope_parameters"]["rope_type"] == "yarn":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position) == ("yarn", 4, 64)
        assert (cfg.rope_mscale, cfg.rope_mscale_all_dim) == (0.8, 0.6)
    names = safetensors_names(tmp_path)  # per-expert tensors on disk, as DeepSeek's files
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names


@needs_transformers
def test_a_transformers_deepseek_v3_without_experts_imports_with_equal_logits(tmp_path):
    """first_k_dense_replace >= num_hidden_layers: every layer dense, no expert built by
    transformers, seqshard's model.moe.n_experts 0 (d4 x t2; measured max abs 4.1e-6)."""
    model = hf_deepseek_v3(tmp_path, q_lora_rank=16, rope_parameters=YARN, first_k_dense_replace=3)
    cfg = check_imports_with_equal_logits(tmp_path, model)
    assert not cfg.moe.enabled and cfg.mla.q_lora_rank == 16


def seqshard_mla(experts: bool, mtp_depth: int = 0) -> ModelConfig:
    """A seqshard model with multi-head latent attention (q latent, YaRN with both mscales,
    interleaved pairs) and, with ``experts``, one dense layer then two of 8 sigmoid-routed
    experts in 4 groups (2 kept), 2 shared experts, gates x 2.5; ``mtp_depth`` multi-token
    prediction modules."""
    moe = MoEConfig(
        n_experts=8, top_k=2, d_ff=16, n_shared=2, n_dense_layers=1, router="sigmoid",
        balance="bias", n_group=4, topk_group=2, routed_scaling_factor=2.5,
    ) if experts else MoEConfig()  # fmt: skip
    return ModelConfig(
        vocab=96, d_model=64, n_layers=3, n_q_per_kv=1, n_kv=4, d_head=24, d_ff=48,
        norm_eps=1e-6, compute_dtype="float32", attention_impl="einsum", attention="mla",
        mla=MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True),
        rope_theta=1000.0, rope_type="yarn", rope_factor=4.0, rope_original_max_position=64,
        rope_mscale=0.8, rope_mscale_all_dim=0.6, moe=moe, mtp=MTPConfig(depth=mtp_depth),
    )  # fmt: skip


@needs_transformers
@pytest.mark.parametrize("experts", [True, False])
def test_an_exported_deepseek_v3_loads_in_transformers_with_equal_logits(
    tmp_path, data_dir, experts
):
    """seqshard -> export -> AutoModelForCausalLM: a DeepseekV3ForCausalLM (the router bias as
    e_score_correction_bias; without experts every layer dense), logits within 1e-5 of
    seqshard's (measured max abs: experts 2.5e-6, none 3.6e-6); its config.json reads back as
    the model, and imported back every weight is bit-identical."""
    import torch
    from transformers import AutoModelForCausalLM

    from seqshard.hf.export import ExportConfig, export_run, max_position

    cfg = seqshard_mla(experts)
    mesh = training_mesh(MOE_MESH if experts else DENSE_MESH)
    weights = random_seqshard_weights(cfg, mesh, embed_std=0.5, router_bias_std=0.1)
    out = tmp_path / "hf"
    export = ExportConfig(out, cfg, data_dir / "tokenizer.json", max_position=64)
    export_run(weights, export, log=lambda m: None)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert raw["first_k_dense_replace"] == (1 if experts else 3)
    assert raw["num_nextn_predict_layers"] == 0
    assert max_position(cfg, seq_len=32) == 256  # the CLI's: YaRN's original context x factor
    names = safetensors_names(out)
    if experts:
        assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
        assert "model.layers.2.mlp.experts.7.gate_proj.weight" in names
        assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    else:
        assert not any(".mlp.gate." in n or ".experts." in n for n in names)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)
    assert read_hf_config(out).model_config(cfg) == cfg
    assert tree_equal(load_hf_weights(out, cfg, mesh, log=lambda m: None), weights)


def test_the_logits_tests_would_catch_a_wrong_pairing_scale_or_bias(deepseek_dir, deepseek_weights):
    """What the logits tests check: read with the other rope pairing, without YaRN's mscales
    (cos, sin and softmax unscaled but by factor's), or with the router bias left at zero (as
    Mixtral's and Qwen3-MoE's import), the model's logits move by far more than 1e-5."""
    cfg = hf_cfg(deepseek_dir)
    mesh = training_mesh(MOE_MESH)
    weights = deepseek_weights
    tokens, starts = tokens_and_starts(cfg.vocab)
    right = seqshard_logits(weights, tokens, starts, cfg, mesh)
    other_pairing = dataclasses.replace(
        cfg, mla=dataclasses.replace(cfg.mla, rope_interleave=False)
    )
    no_mscale = dataclasses.replace(cfg, rope_mscale=0.0, rope_mscale_all_dim=0.0)
    layers = weights.moe_layers
    no_bias = dataclasses.replace(
        weights, moe_layers=dataclasses.replace(layers, router_bias=0 * layers.router_bias)
    )
    for wrong in (
        seqshard_logits(weights, tokens, starts, other_pairing, mesh),
        seqshard_logits(weights, tokens, starts, no_mscale, mesh),
        seqshard_logits(no_bias, tokens, starts, cfg, mesh),
    ):
        assert np.abs(wrong - right).max() > 100 * LOGITS_TOL


# -- multi-token prediction modules ---------------------------------------------------------------


def export_mla(out: Path, cfg: ModelConfig, weights, tokenizer: Path) -> None:
    from seqshard.hf.export import ExportConfig, export_run

    export_run(weights, ExportConfig(out, cfg, tokenizer, max_position=64), log=lambda m: None)


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "np") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not iterable)


@needs_transformers
@pytest.mark.parametrize("experts, depth", [(True, 1), (True, 2), (False, 1)])
def test_an_export_with_mtp_modules_loads_in_transformers_and_imports_back_exactly(
    tmp_path, data_dir, experts, depth
):
    """seqshard with model.mtp.depth 1 or 2 -> export: num_nextn_predict_layers is the depth,
    module k is model.layers.{3 + k}.* as DeepSeek's checkpoints hold it (eh_proj [64, 128],
    its norms, the copies of the embedding and lm_head, the whole decoder layer with its
    experts, or the dense FFN without); transformers loads the directory (ignoring those) with
    logits within 1e-5 of seqshard's (e2 x d2 x t2 or d4 x t2; measured max abs: experts
    depth 1 2.9e-6, depth 2 2.8e-6, none 3.5e-6, of logits up to about 4.6; its load report
    lists the modules' tensors as unexpected), and imported back every weight, the modules'
    included, is bit-identical, the depth read from the files."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    cfg = seqshard_mla(experts, mtp_depth=depth)
    mesh = training_mesh(MOE_MESH if experts else DENSE_MESH)
    weights = random_seqshard_weights(cfg, mesh, embed_std=0.5, router_bias_std=0.1)
    out = tmp_path / "hf"
    export_mla(out, cfg, weights, data_dir / "tokenizer.json")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == depth
    shapes = tensor_shapes(out)
    for k in range(depth):
        layer = f"model.layers.{3 + k}."
        assert shapes[layer + "eh_proj.weight"] == (64, 128)
        for norm in ("enorm", "hnorm", "shared_head.norm", "input_layernorm"):
            assert shapes[f"{layer}{norm}.weight"] == (64,)
        assert shapes[layer + "shared_head.head.weight"] == shapes["lm_head.weight"] == (96, 64)
        assert shapes[layer + "embed_tokens.weight"] == (96, 64)
        assert shapes[layer + "self_attn.kv_b_proj.weight"] == (4 * (16 + 12), 32)
        if experts:
            assert shapes[layer + "mlp.experts.7.down_proj.weight"] == (64, 16)
            assert shapes[layer + "mlp.gate.e_score_correction_bias"] == (8,)
            assert shapes[layer + "mlp.shared_experts.up_proj.weight"] == (32, 64)
        else:
            assert shapes[layer + "mlp.gate_proj.weight"] == (48, 64)
    assert not any(n.startswith(f"model.layers.{3 + depth}.") for n in shapes)
    # the last module's eh_proj is its w_eh as it is: [enorm(emb) | hnorm(h)] columns
    eh_proj = load_file(out / "model.safetensors")[f"model.layers.{2 + depth}.eh_proj.weight"]
    np.testing.assert_array_equal(eh_proj, np.asarray(weights.mtp.w_eh[depth - 1]))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and len(model.model.layers) == 3
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)
    without = dataclasses.replace(cfg, mtp=MTPConfig())
    assert read_hf_config(out).model_config(without) == cfg  # the depth: the files'
    lines = []
    assert tree_equal(load_hf_weights(out, cfg, mesh, log=lines.append), weights)
    assert not any("multi-token prediction" in line for line in lines), lines


@pytest.fixture(scope="module")
def mtp_export(tmp_path_factory, data_dir):
    """seqshard_mla(experts, depth 1) exported: (its directory, its config, its weights)."""
    cfg = seqshard_mla(True, mtp_depth=1)
    weights = random_seqshard_weights(cfg, training_mesh(MOE_MESH), embed_std=0.5)
    out = tmp_path_factory.mktemp("mtp_export") / "hf"
    export_mla(out, cfg, weights, data_dir / "tokenizer.json")
    return out, cfg, weights


@pytest.fixture
def mtp_copy(mtp_export, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(mtp_export[0], out)
    return out


def add_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    save_file(load_file(file) | tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "copy, of", [("shared_head.head", "lm_head.weight"), ("embed_tokens", "model.embed_tokens")]
)
def test_a_module_copy_of_the_head_or_embedding_that_differs_is_an_error_naming_it(
    mtp_export, mtp_copy, copy, of
):
    """seqshard's modules share the model's embedding and head: a file whose module holds
    another (one value moved by 1 ulp) cannot be imported as it is, and the error names the
    tensor, what it copies, where they differ and the fix; a bf16 copy of equal values is fine."""
    from safetensors.numpy import load_file

    _, cfg, _ = mtp_export
    name = f"model.layers.3.{copy}.weight"
    changed = load_file(mtp_copy / "model.safetensors")[name]
    changed[5, 7] = np.nextafter(changed[5, 7], np.float32(np.inf))
    add_tensors(mtp_copy, {name: changed})
    with pytest.raises(HFFormatError) as info:
        load_hf_weights(mtp_copy, cfg, training_mesh(MOE_MESH), log=lambda m: None)
    msg = str(info.value)
    assert f"tensor {name}, a multi-token prediction module's copy of {of}" in msg, msg
    assert "differs from it (at [5, 7]:" in msg and "set num_nextn_predict_layers to 0" in msg


def test_files_without_modules_import_at_depth_0_or_the_asked_depth_as_init_weights_makes_it(
    deepseek_dir, deepseek_weights
):
    """transformers saves no module though its config.json says num_nextn_predict_layers 1:
    read_hf_config leaves model.mtp to the config (0 by default: one line says so). A config
    asking for depth 2 anyway gets modules as init_weights makes them from the key given (norm
    gains ones, not zeros), the model's weights as the files hold them, and a line saying so."""
    cfg = hf_cfg(deepseek_dir)
    assert cfg.mtp.depth == 0 and "mtp.depth" not in read_hf_config(deepseek_dir).fields
    mesh, plain = training_mesh(MOE_MESH), deepseek_weights
    asked = dataclasses.replace(cfg, mtp=MTPConfig(depth=2))
    key = jax.random.key(5)
    lines = []
    weights = load_hf_weights(deepseek_dir, asked, mesh, log=lines.append, key=key)
    said = [line for line in lines if "multi-token prediction" in line]
    assert len(said) == 1 and "no model.layers.3.*" in said[0], lines
    assert "model.mtp.depth=2's modules start as init_weights makes them" in said[0]
    assert tree_equal(weights.mtp, init_weights(asked, mesh, key).mtp)
    assert np.all(np.asarray(weights.mtp.enorm) == 1) and np.asarray(weights.mtp.w_eh).std() > 0
    for field in dataclasses.fields(plain):  # the model's: as the files hold them
        assert tree_equal(getattr(weights, field.name), getattr(plain, field.name)), field.name


def test_a_partial_module_or_a_layer_past_the_modules_is_an_error_naming_a_tensor(
    deepseek_copy, mtp_copy, mtp_export
):
    """Files holding part of a module (two of its tensors) miss the rest, and a layer past
    num_nextn_predict_layers' (model.layers.4 with 1) is one seqshard does not compute: both
    are errors naming a tensor. A config asking for another depth than the files' is refused."""
    add_tensors(
        deepseek_copy,
        {
            "model.layers.3.eh_proj.weight": np.ones((64, 128), np.float32),
            "model.layers.3.enorm.weight": np.ones(64, np.float32),
        },
    )
    cfg = hf_cfg(deepseek_copy)
    assert cfg.mtp.depth == 1  # the files hold (part of) module 0
    with pytest.raises(HFFormatError, match=r"are missing, e\.g\. model\.layers\.3\."):
        load_hf_weights(deepseek_copy, cfg, training_mesh(MOE_MESH), log=lambda m: None)
    _, cfg, _ = mtp_export
    mesh = training_mesh(MOE_MESH)
    with pytest.raises(
        HFFormatError, match=re.escape("model.mtp.depth=2 but it says 1 (num_nextn_predict_layers)")
    ):
        load_hf_weights(mtp_copy, seqshard_mla(True, mtp_depth=2), mesh, log=lambda m: None)
    add_tensors(mtp_copy, {"model.layers.4.enorm.weight": np.ones(64, np.float32)})
    with pytest.raises(HFFormatError, match=re.escape("model.layers.4.enorm.weight")):
        load_hf_weights(mtp_copy, cfg, mesh, log=lambda m: None)


def test_model_mtp_depth_beside_from_hf_is_filled_from_the_files_or_the_config(
    tmp_path, deepseek_dir, mtp_export, data_dir
):
    """Through the config layer (load_config with seqshard.cli.with_hf_model): files holding a
    module fill model.mtp.depth (1) and another written beside init.from_hf is an error; files
    holding none leave it to the config (0, or the depth written)."""
    from seqshard.cli import with_hf_model
    from seqshard.config import ConfigError, load_config

    config = tmp_path / "c.yaml"

    def model(source: Path, written: str = ""):
        tokenizer = data_dir / "tokenizer.json"
        config.write_text(
            f"init: {{from_hf: {source}}}\ndata: {{tokenizer: {tokenizer}}}\n{written}"
        )
        return load_config(config, from_hf=with_hf_model).model

    assert model(mtp_export[0]).mtp.depth == 1
    with pytest.raises(ConfigError, match=r"model.mtp.depth=2 but config.json says 1"):
        model(mtp_export[0], "model: {mtp: {depth: 2}}\n")
    assert model(deepseek_dir).mtp.depth == 0
    assert model(deepseek_dir, "model: {mtp: {depth: 2}}\n").mtp.depth == 2


def test_modules_beside_grouped_query_attention_are_refused_before_export(tmp_path):
    """Only DeepSeek-V3 holds multi-token prediction modules: a Llama (or Qwen3, Mixtral,
    Qwen3-MoE) with model.mtp would export weights no such model has."""
    from seqshard.hf.export import ExportConfig

    llama = ModelConfig(vocab=96, d_model=64, n_layers=2, mtp=MTPConfig(depth=1))
    with pytest.raises(ValueError, match=re.escape("model.mtp.depth=1 (multi-token prediction")):
        ExportConfig(tmp_path / "x", llama, tmp_path / "tokenizer.json", max_position=64)


def test_a_shape_config_json_contradicts_names_the_tensor_and_its_keys(deepseek_copy):
    raw = json.loads((deepseek_copy / "config.json").read_text())
    (deepseek_copy / "config.json").write_text(json.dumps(raw | {"v_head_dim": 8}))
    cfg = hf_cfg(deepseek_copy)
    with pytest.raises(HFFormatError) as info:
        load_hf_weights(deepseek_copy, cfg, training_mesh(MOE_MESH), log=lambda m: None)
    msg = str(info.value)
    assert "tensor model.layers.0.self_attn.kv_b_proj.weight has shape [112, 32]" in msg, msg
    assert "config.json implies [96, 32] ((n_kv d_kv_b) kv_lora with n_kv=4 " in msg, msg
    assert "d_kv_b=24 (qk_nope_head_dim + v_head_dim), kv_lora=32 (kv_lora_rank))" in msg, msg


@needs_transformers
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_no_shared_experts_import_though_the_files_hold_empty_tensors(tmp_path):
    """n_shared_experts 0: transformers saves the shared experts as tensors of no element;
    they hold no weight, and the model has none (model.moe.n_shared 0)."""
    hf_deepseek_v3(
        tmp_path, **(VARIANTS["no_q_lora-default-rotate_half"] | {"n_shared_experts": 0})
    )
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in safetensors_names(tmp_path)
    cfg = hf_cfg(tmp_path)
    weights = load_hf_weights(tmp_path, cfg, training_mesh(MOE_MESH), log=lambda m: None)
    assert cfg.moe.n_shared == 0 and not hasattr(weights.moe_layers, "s_up")


# -- what seqshard does not compute ---------------------------------------------------------------


def deepseek_config_json(**changes) -> dict:
    """A DeepSeek-V3 config.json as DeepSeek published theirs (transformers 4's keys:
    rope_scaling with ``type``, the router's kind written out), small."""
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **SIZES, "q_lora_rank": 32, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "moe_layer_freq": 1, "ep_size": 1, "aux_loss_alpha": 0.001,
        "seq_aux": True, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "attention_bias": False, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    return raw | changes


def test_deepseeks_published_config_format_reads_as_transformers_does(tmp_path):
    """DeepSeek-V3's own config.json keys (rope_scaling with type yarn, scoring_func,
    topk_method, moe_layer_freq; no rope_interleave: its default, true) read into the model
    fields; a file without first_k_dense_replace gets transformers' default (3), and with it
    at num_hidden_layers or more the model has no experts."""
    (tmp_path / "config.json").write_text(json.dumps(deepseek_config_json()))
    hf = read_hf_config(tmp_path)
    cfg = hf.model_config()
    assert hf.architecture == "DeepseekV3ForCausalLM" and hf.mtp_depth == 1
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position) == ("yarn", 40, 4096)
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow) == (32, 1)
    assert (cfg.rope_mscale, cfg.rope_mscale_all_dim) == (1, 1)
    assert cfg.mla.rope_interleave and cfg.mla.q_lora_rank == 32
    assert (cfg.moe.router, cfg.moe.n_group, cfg.moe.topk_group) == ("sigmoid", 4, 2)
    assert cfg.moe.routed_scaling_factor == 2.5 and cfg.mtp.depth == 0
    raw = deepseek_config_json(num_hidden_layers=5)
    del raw["first_k_dense_replace"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(tmp_path).model_config().moe.n_dense_layers == 3
    (tmp_path / "config.json").write_text(json.dumps(raw | {"first_k_dense_replace": 5}))
    assert not read_hf_config(tmp_path).model_config().moe.enabled


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"num_key_value_heads": 2},
         "num_key_value_heads=2 is not supported: seqshard imports LlamaForCausalLM, "),
        ({"num_key_value_heads": 2}, "num_key_value_heads equal to num_attention_heads=4"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"scoring_func": "softmax"}, "with scoring_func='sigmoid'"),
        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ({"topk_method": "greedy"}, "with topk_method='noaux_tc'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}},
         "rope_scaling.rope_type='llama3' is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}},
         "rope_scaling.truncate=False is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 2.0}},
         "rope_scaling.attention_factor=2.0 is not supported"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
         "quantization_config (quant_method 'fp8') is not supported"),
        ({"q_lora_rank": 0}, "q_lora_rank must be a positive integer, got 0"),
        ({"rope_interleave": "yes"}, "rope_interleave='yes' is not supported"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor=0 is not supported"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace must be an integer >= 0, got -1"),
    ],
)  # fmt: skip
def test_what_seqshard_does_not_compute_is_an_error_naming_the_field(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps(deepseek_config_json()))
    read_hf_config(tmp_path)  # as written, fine
    (tmp_path / "config.json").write_text(json.dumps(deepseek_config_json(**change)))
    with pytest.raises(HFFormatError) as info:
        read_hf_config(tmp_path)
    msg = str(info.value)
    assert needle in msg and str(tmp_path / "config.json") in msg, msg
    assert info.value.__cause__ is None


def test_a_missing_q_lora_rank_says_what_it_may_be(tmp_path):
    raw = deepseek_config_json()
    del raw["q_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFFormatError, match=r"q_lora_rank is missing: it must be null \(queries"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"moe": MoEConfig(n_experts=8, top_k=2, d_ff=16)},
         "model.moe.router='softmax' with model.attention=mla has no Hugging Face counterpart: "
         "DeepseekV3ForCausalLM routes by sigmoid scores (model.moe.router=sigmoid)."),
        ({"rope_type": "llama3"},
         "model.rope_type='llama3' with model.attention=mla has no Hugging Face counterpart"),
    ],
)  # fmt: skip
def test_an_mla_model_deepseek_v3_cannot_hold_is_refused_before_export(tmp_path, change, needle):
    from seqshard.hf.export import ExportConfig

    bad = dataclasses.replace(seqshard_mla(experts=False), **change)
    with pytest.raises(ValueError, match=re.escape(needle)):
        ExportConfig(tmp_path / "x", bad, tmp_path / "tokenizer.json", max_position=64)
