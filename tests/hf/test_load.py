"""Tests of seqshard/hf: the table, export, import (``init.from_hf``), against transformers.
Filed under load.py (the import, most of what is here); export.py, table.py and hf_config.py
are tested here too, mostly through round trips.

    table        every seqshard weight has one row; HF layouts round-trip through einops
    round trip   a trained run -> seqshard export -> import: bit-identical weights (1x1, 4x2)
    HF -> us     a random LlamaForCausalLM (GQA, f32) saved with save_pretrained, imported:
                 logits_fn on 4x2 equals torch's logits within 1e-5 (max abs, f32); with llama3
                 rope scaling (transformers 5's config.json) and with tied embeddings (the
                 older format: rope_theta, rope_scaling, torch_dtype)
    us -> HF     an exported run (llama3 rope) loaded by AutoModelForCausalLM: the same
    pairing      Meta's interleaved RoPE pairing instead moves the logits by far more than 1e-5
    tokenizer    the exported tokenizer, via AutoTokenizer, encodes as seqshard does; a chat
                 run's renders chats (apply_chat_template) as seqshard rendered its data
    train        init.from_hf starts a run from the HF weights and tokenizer, sizes filled
    bad input    a missing shard file, a shape config.json contradicts, another architecture,
                 a bias, a disagreeing model field: errors naming the file or field
    MoE, Qwen3   random Qwen3, Mixtral and Qwen3-MoE models (transformers, save_pretrained's
                 per-expert tensors) import with logits within 1e-5 of torch's on e=2 x d=2 x
                 t=2, and seqshard models export as them with equal logits; a router bias,
                 shared experts (naming the HF families that hold them) or a sigmoid router
                 refuse to export; an expert count or a
                 router the files contradict, sparse layers seqshard
                 cannot order: errors naming the key, both values and the fix

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

from seqshard.cli import _run_config, export_checkpoint, export_config, main, with_hf_model
from seqshard.config import ConfigError, load_config
from seqshard.hf.hf_config import HFFormatError, hf_config_dict, read_hf_config
from seqshard.hf.load import load_hf_weights
from seqshard.hf.table import TABLE, hf_tensor_names, row_of
from seqshard.mesh import training_mesh
from seqshard.model import ModelConfig
from seqshard.model.weights import weight_structs
from seqshard.train.checkpoint import latest_state
from seqshard.train.loop import train

LLAMA3 = {  # all three bands of llama3's rescaling occur with d_head 8, theta 1e4
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {  # extrapolated, ramped and interpolated pairs with d_head 8, theta 1e4; both mscales
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
SEQSHARD_LLAMA3 = [
    "model.rope_type=llama3",
    "model.rope_factor=8.0",
    "model.rope_low_freq_factor=1.0",
    "model.rope_high_freq_factor=4.0",
    "model.rope_original_max_position=64",
]


# -- the table ---------------------------------------------------------------------------------


def test_the_table_has_every_weight_once_and_its_layouts_round_trip():
    # qk_norm: the config with every dense weight a family has (TABLE holds them all)
    cfg = ModelConfig(
        vocab=48, d_model=16, n_layers=3, n_q_per_kv=3, n_kv=2, d_head=4, d_ff=24, qk_norm=True
    )
    structs = weight_structs(cfg)
    fields = {(r.field, r.part) for r in TABLE}
    assert len(fields) == len(TABLE)
    assert {f for f, _ in fields} == {
        "embed", "final_norm", "unembed", *(f"layers.{k}" for k in vars(structs.layers))
    }  # fmt: skip
    rng = np.random.default_rng(0)
    for row in TABLE:
        full = row.of(structs)
        block = full.shape[(1 if row.stacked else 0) + (row.part is not None) :]
        x = rng.standard_normal(block).astype(np.float32)
        hf = row.to_hf(x, cfg)
        assert hf.shape == row.hf_shape(cfg) and hf.size == x.size, row
        np.testing.assert_array_equal(row.from_hf(hf, cfg), x)
    names = [n for _, _, n in hf_tensor_names(cfg)]
    assert len(names) == len(set(names)) == 3 + 11 * cfg.n_layers  # q_norm, k_norm included
    without = [n for _, _, n in hf_tensor_names(dataclasses.replace(cfg, qk_norm=False))]
    assert len(without) == 3 + 9 * cfg.n_layers and not any(
        "_norm.weight" in n and "self_attn" in n for n in without
    )
    assert row_of("model.layers.2.mlp.down_proj.weight") == (TABLE[11], 2)
    assert row_of("model.layers.x.mlp.down_proj.weight") is None


def test_query_head_h_reads_kv_head_h_over_n_q_per_kv():
    """HF's q_proj rows are (n_kv n_q_per_kv d_head), kv head major (repeat_kv)."""
    cfg = ModelConfig(n_q_per_kv=3, n_kv=2, d_head=4, d_model=8)
    q_row = next(r for r in TABLE if r.field == "layers.w_q")
    x = np.zeros((8, 3, 2, 4), np.float32)  # seqshard: d_model n_q_per_kv n_kv d_head
    x[:, 1, 0, :] = 1.0  # query 1 of kv head 0: HF head 0 * 3 + 1
    hf = q_row.to_hf(x, cfg)
    heads_used = sorted({i // 4 for i in np.nonzero(hf.any(axis=1))[0]})
    assert heads_used == [1]


# -- a trained run, exported -------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, tiny_overrides):
    """A 4x2 run of the tiny model with llama3 rope, trained 3 steps: its directory."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, [*tiny_overrides(runs, "source", steps=3), *SEQSHARD_LLAMA3])
    train(cfg, log=lambda m: None)
    return runs / "source"


@pytest.fixture(scope="module")
def exported(source_run, tmp_path_factory):
    """``exported(mesh)``: the source run exported (restored on mesh (d, t)), cached."""
    cache = {}

    def make(d: int, t: int, **kwargs) -> Path:
        key = (d, t, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("hf") / f"source-{d}x{t}"
            cfg = _run_config(str(source_run), [f"mesh.d={d}", f"mesh.t={t}"])
            mesh = training_mesh(cfg.mesh.sizes())
            export = export_config(cfg, out, **kwargs)
            export_checkpoint(source_run, export, cfg, mesh, log=lambda m: None)
            cache[key] = out
        return cache[key]

    return make


@pytest.mark.parametrize("d,t", [(1, 1), (4, 2)])
def test_export_then_import_gives_bit_identical_weights(source_run, exported, d, t):
    out = exported(d, t, max_file_bytes=40_000)  # several files and the index
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    cfg = _run_config(str(source_run), [f"mesh.d={d}", f"mesh.t={t}"])
    mesh = training_mesh(cfg.mesh.sizes())
    saved = latest_state(source_run, cfg, mesh, log=lambda m: None).weights
    imported = load_hf_weights(out, cfg.model, mesh, log=lambda m: None)
    assert tree_equal(saved, imported)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(imported), strict=True):
        assert a.sharding == b.sharding


def test_the_exported_config_reads_back_as_the_run_model(source_run, exported):
    out = exported(4, 2)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["tie_word_embeddings"] is False
    assert raw["torch_dtype"] == "float32" and raw["rope_scaling"]["rope_type"] == "llama3"
    run_model = _run_config(str(source_run), []).model
    assert read_hf_config(out).model_config(run_model) == run_model
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_export_refuses_a_nonempty_directory_and_leaves_it(source_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    assert main(["export", str(source_run), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep"
    assert main(["export", str(source_run), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert not (out / "precious.txt").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not list(tmp_path.glob(".taken*"))  # no partial or old directory left


def test_export_refuses_a_disk_too_small_before_writing(source_run, tmp_path, monkeypatch, capsys):
    """The free space is read from the filesystem (here: reported as 1 KiB)."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    out = tmp_path / "hf"
    assert main(["export", str(source_run), str(out)]) == 2
    err = capsys.readouterr().err
    assert "has 1.00 KiB free, but the float32 weights need" in err and "--dtype bfloat16" in err
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_an_export_config_is_checked_when_made_and_before_a_restore(source_run, tmp_path):
    """Bad options fail when the ExportConfig is made; a taken OUT_DIR or a missing tokenizer
    fail in check(), which the CLI calls before it restores a checkpoint."""
    cfg = _run_config(str(source_run), [])
    with pytest.raises(ValueError, match=r"--dtype must be one of .*, got 'float16'"):
        export_config(cfg, tmp_path / "a", dtype="float16")
    with pytest.raises(ValueError, match="--max-file-size must be a positive number .* got 0"):
        export_config(cfg, tmp_path / "a", max_file_bytes=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        export_config(cfg, tmp_path / "file").check()
    with pytest.raises(FileNotFoundError, match="nowhere.json does not exist"):
        export_config(cfg, tmp_path / "a", tokenizer=tmp_path / "nowhere.json").check()
    assert not (tmp_path / "a").exists()


# -- against transformers ----------------------------------------------------------------------


def hf_llama(path: Path, *, tied: bool, rope: dict | None, old_format: bool, tokenizer: Path):
    """A random LlamaForCausalLM (GQA 8 query / 4 kv heads, f32, every weight random, norm
    gains too) saved with save_pretrained into ``path``, with ``tokenizer`` beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})},
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (2.0 if "embed" in name else p.shape[-1] ** 0.5))
    model.save_pretrained(path)
    shutil.copyfile(tokenizer, path / "tokenizer.json")
    if old_format:  # what transformers 4 wrote
        raw = json.loads((path / "config.json").read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = None if params["rope_type"] == "default" else params
        raw["torch_dtype"] = raw.pop("dtype")
        (path / "config.json").write_text(json.dumps(raw))
    return model


@needs_transformers
@pytest.mark.parametrize(
    "tied,rope,old_format",
    [(False, LLAMA3, False), (True, None, True), (False, YARN, True)],
    ids=["llama3-rope_parameters", "tied-rope_theta", "yarn-rope_scaling"],
)
def test_a_transformers_llama_imports_with_equal_logits(tmp_path, data_dir, tied, rope, old_format):
    """Measured max abs: llama3 3.4e-6, tied 7.4e-6 (of logits up to 14.5), yarn 2.7e-6
    (rope_scaling; cos and sin times YaRN's attention factor, no softmax scale without MLA)."""
    model = hf_llama(
        tmp_path, tied=tied, rope=rope, old_format=old_format, tokenizer=data_dir / "tokenizer.json"
    )
    hf = read_hf_config(tmp_path)
    assert hf.tied == tied and hf.fields["rope_type"] == (rope or {}).get("rope_type", "default")
    cfg = hf.model_config(ModelConfig(compute_dtype="float32", attention_impl="einsum"))
    assert (cfg.n_q_per_kv, cfg.n_kv) == (2, 4)
    mesh = training_mesh({"d": 4, "t": 2})
    weights = load_hf_weights(tmp_path, cfg, mesh, log=lambda m: None)
    if tied:
        assert np.array_equal(np.asarray(weights.embed), np.asarray(weights.unembed))
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0  # logits of a size where 1e-5 means something
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)


@needs_transformers
def test_an_exported_run_loads_in_transformers_with_equal_logits(source_run, exported):
    import torch
    from transformers import AutoModelForCausalLM

    out = exported(4, 2)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    cfg = _run_config(str(source_run), [])
    mesh = training_mesh(cfg.mesh.sizes())
    weights = latest_state(source_run, cfg, mesh, log=lambda m: None).weights
    tokens, starts = tokens_and_starts(300)
    got = seqshard_logits(weights, tokens, starts, cfg.model, mesh)
    np.testing.assert_allclose(got, torch_logits(model, tokens), rtol=0, atol=LOGITS_TOL)


@pytest.mark.slow
@needs_transformers
def test_the_other_rope_pairing_would_be_caught(tmp_path, data_dir):
    """Meta's (2i, 2i+1) pairing read as rotate-half: the q and k rows permuted within each
    head. The logits move by far more than the tolerance, so the logit tests check pairing."""
    model = hf_llama(
        tmp_path, tied=False, rope=None, old_format=False, tokenizer=data_dir / "tokenizer.json"
    )
    cfg = read_hf_config(tmp_path).model_config(
        ModelConfig(compute_dtype="float32", attention_impl="einsum")
    )
    mesh = training_mesh({"d": 4, "t": 2})
    weights = load_hf_weights(tmp_path, cfg, mesh, log=lambda m: None)
    half = cfg.d_head // 2
    interleaved = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    w_q = np.asarray(weights.layers.w_q)[..., interleaved]
    w_kv = np.asarray(weights.layers.w_kv).copy()
    w_kv[:, 0] = w_kv[:, 0][..., interleaved]
    layers = type(weights.layers)(**{**vars(weights.layers), "w_q": w_q, "w_kv": w_kv})
    wrong = type(weights)(**{**vars(weights), "layers": layers})
    tokens, starts = tokens_and_starts(cfg.vocab)
    error = np.abs(seqshard_logits(wrong, tokens, starts, cfg, mesh) - torch_logits(model, tokens))
    assert error.max() > 1000 * LOGITS_TOL


@needs_transformers
def test_the_exported_tokenizer_encodes_as_seqshard_does(exported, data_dir):
    from transformers import AutoTokenizer

    from seqshard.data import encode, load_tokenizer

    hf_tok = AutoTokenizer.from_pretrained(exported(4, 2))
    ours = load_tokenizer(data_dir / "tokenizer.json")
    for text in [
        "def train(step):\n    return loss  # ünïcode ✓",
        "the model of data",
        " x  y\t\n",
    ]:
        assert hf_tok(text)["input_ids"] == encode(ours, text)
        assert hf_tok.decode(encode(ours, text)) == text
    assert hf_tok.eos_token == "<|endoftext|>"


CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "sft" / "chat_template.jinja"
CHAT = [
    {"role": "user", "content": "What does `os.getcwd` do?"},
    {"role": "assistant", "content": "Return a string of the current directory."},
    {"role": "user", "content": "And `os.sep`?"},
]


@needs_transformers
def test_a_chat_run_exports_its_template_for_apply_chat_template(source_run, exported, tmp_path):
    """A run whose data has a chat template (``data.chat_template``, as sft-tiny-cpu.yaml's)
    writes it into tokenizer_config.json: transformers' apply_chat_template renders a chat as
    seqshard rendered the run's data. A run without one exports none, and transformers refuses
    to render. A template whose eos_token the exported tokenizer would render otherwise is
    refused before anything is restored."""
    from transformers import AutoTokenizer

    from seqshard.data.sft import ChatTemplate, load_chat_template
    from seqshard.hf.export import ExportConfig

    cfg = _run_config(str(source_run), [f"data.chat_template={CHAT_TEMPLATE}"])
    out = tmp_path / "chat"
    mesh = training_mesh(cfg.mesh.sizes())
    export_checkpoint(source_run, export_config(cfg, out), cfg, mesh, log=lambda m: None)
    ours = load_chat_template(CHAT_TEMPLATE)
    hf_tok = AutoTokenizer.from_pretrained(out)
    for prompt in (False, True):
        want = ours.render(CHAT, prompt, "test")
        assert (
            hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == want
        )
    with pytest.raises(ValueError, match="chat_template"):
        AutoTokenizer.from_pretrained(exported(4, 2)).apply_chat_template(CHAT, tokenize=False)

    ends = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    template = ChatTemplate("tokenizer_config.json", ends, eos_token="</s>")
    export = ExportConfig(tmp_path / "x", cfg.model, cfg.data.dir + "/tokenizer.json", 64)
    with pytest.raises(ValueError, match=r"renders bos_token '' / eos_token '</s>', but the expo"):
        dataclasses.replace(export, chat_template=template).check()
    assert not (tmp_path / "x").exists()


# -- init.from_hf ------------------------------------------------------------------------------


@needs_transformers
def test_a_run_starts_from_hf_weights_sizes_and_tokenizer(tmp_path, data_dir, tiny_yaml):
    """A config layered over one with other model sizes: init.from_hf fills them. With a
    learning rate far below f32's resolution the first checkpoint holds the imported weights
    unchanged, which are the torch model's, laid out by the table."""
    hf_dir = tmp_path / "llama"
    model = hf_llama(
        hf_dir, tied=True, rope=LLAMA3, old_format=False, tokenizer=data_dir / "tokenizer.json"
    )
    tiny_yaml(tmp_path / "base.yaml", tmp_path / "runs")
    config = tmp_path / "from_hf.yaml"
    config.write_text(f"base: base.yaml\ninit: {{from_hf: {hf_dir}}}\n")
    assert (
        main(["train", str(config), "train.steps=1", "train.lr=1e-30", "train.warmup_steps=0"]) == 0
    )
    run_dir = tmp_path / "runs" / "from_hf"
    cfg = _run_config(str(run_dir), [])
    assert (cfg.model.n_kv, cfg.model.d_ff, cfg.model.rope_type) == (4, 64, "llama3")
    assert cfg.data.tokenizer == str(hf_dir / "tokenizer.json")
    weights = latest_state(
        run_dir, cfg, training_mesh(cfg.mesh.sizes()), log=lambda m: None
    ).weights
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    q = state["model.layers.1.self_attn.q_proj.weight"].reshape(4, 2, 8, 32)  # n_kv n_q_per_kv D M
    np.testing.assert_array_equal(np.asarray(weights.layers.w_q[1]), q.transpose(3, 1, 0, 2))
    down = state["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(weights.layers.w_down[0]), down)
    embed = state["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(weights.unembed), embed)  # tied: a copy
    np.testing.assert_array_equal(np.asarray(weights.final_norm), state["model.norm.weight"])


@pytest.mark.slow
def test_two_processes_export_and_import_as_one_does(tmp_path, source_run, exported, data_dir):
    """`seqshard export` in two processes (4 devices each, the weights not fully addressable
    in either) writes the same bytes as one process; `seqshard train` with init.from_hf in two
    processes places the same weights (lr 1e-30: the checkpoint holds them unchanged)."""
    from process_helpers import two_seqshard_processes

    out = tmp_path / "two"
    with two_seqshard_processes(tmp_path, ["export", str(source_run), str(out)]) as group:
        assert group.wait(timeout=240) == [0, 0], group.outputs()
        assert "exported" in group.output(0) and "exported" not in group.output(1)
    one = exported(4, 2)
    for path in sorted(one.iterdir()):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    config = tmp_path / "from_hf.yaml"
    config.write_text(f"base: {source_run / 'config.yaml'}\ninit: {{from_hf: {out}}}\n")
    args = [
        "train", str(config), f"run.dir={tmp_path / 'runs'}", "run.name=from_hf", "train.steps=1",
        "train.lr=1e-30",
        "train.warmup_steps=0", "--sample-tokens", "0",
    ]  # fmt: skip
    with two_seqshard_processes(tmp_path, args) as group:
        assert group.wait(timeout=240) == [0, 0], group.outputs()
    run_dir = tmp_path / "runs" / "from_hf"
    cfg = _run_config(str(run_dir), [])
    mesh = training_mesh(cfg.mesh.sizes())
    started = latest_state(run_dir, cfg, mesh, log=lambda m: None).weights
    source = latest_state(source_run, _run_config(str(source_run), []), mesh, log=lambda m: None)
    assert tree_equal(started, source.weights)


def test_train_needs_the_loader_of_from_hf(tmp_path, tiny_overrides):
    """seqshard.train does not import seqshard.hf: train() with init.from_hf and no
    initial_weights says what to pass, before it writes anything."""
    cfg = load_config(None, tiny_overrides(tmp_path, "from_hf"))
    cfg = dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, from_hf="hf/llama"))
    with pytest.raises(ConfigError, match=r"initial_weights=seqshard.cli.hf_initial_weights"):
        train(cfg, log=lambda m: None)
    assert not (tmp_path / "from_hf").exists()


def test_a_model_field_written_beside_from_hf_must_agree(tmp_path, source_run, exported):
    config = tmp_path / "c.yaml"
    config.write_text(f"init: {{from_hf: {exported(4, 2)}}}\nmodel: {{d_ff: 128}}\n")
    with pytest.raises(ConfigError, match=r"model.d_ff=128 but config.json says 64"):
        load_config(config, from_hf=with_hf_model)
    config.write_text(f"init: {{from_hf: {tmp_path / 'nowhere'}}}\n")
    with pytest.raises(ConfigError, match="nowhere is not a directory"):
        load_config(config, from_hf=with_hf_model)


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture
def copy_of(exported, tmp_path):
    """A writable copy of the 4x2 export, split over several files."""
    out = tmp_path / "copy"
    shutil.copytree(exported(4, 2, max_file_bytes=40_000), out)
    return out


def load(path: Path, **fields):
    cfg = read_hf_config(path).model_config(ModelConfig(compute_dtype="float32", **fields))
    return load_hf_weights(path, cfg, training_mesh({"d": 4, "t": 2}), log=lambda m: None)


def test_a_missing_shard_file_is_named(copy_of):
    (copy_of / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(HFFormatError, match=r"model-00002-of-00005.safetensors is missing"):
        load(copy_of)


def test_a_shape_config_json_contradicts_names_the_tensor_and_field(copy_of):
    raw = json.loads((copy_of / "config.json").read_text())
    raw["intermediate_size"] = 96
    (copy_of / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFFormatError) as info:
        load(copy_of)
    msg = str(info.value)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32]" in msg
    assert "d_ff=96 (intermediate_size)" in msg and ".safetensors" in msg


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures=['MistralForCausalLM']"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
         "rope_scaling.rope_type='dynamic'"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)  # fmt: skip
def test_what_seqshard_does_not_compute_is_an_error_naming_the_field(copy_of, change, needle):
    raw = json.loads((copy_of / "config.json").read_text())
    (copy_of / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(HFFormatError) as info:
        read_hf_config(copy_of)
    assert needle in str(info.value) and "config.json" in str(info.value)


def test_a_tensor_seqshard_would_drop_is_an_error(copy_of):
    from safetensors.numpy import save_file

    index = json.loads((copy_of / "model.safetensors.index.json").read_text())
    save_file(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)},
        copy_of / "bias.safetensors",
    )
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "bias.safetensors"
    (copy_of / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFFormatError, match=r"q_proj.bias .*biases .* not supported"):
        load(copy_of)


def test_a_truncated_file_is_named(copy_of):
    path = copy_of / "model-00001-of-00005.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(HFFormatError, match=r"model-00001-of-00005.safetensors is not a readable"):
        load(copy_of)


def test_a_non_finite_weight_is_named_before_a_run_starts(copy_of):
    from safetensors.numpy import load_file, save_file

    index = json.loads((copy_of / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    path = copy_of / index[name]
    tensors = load_file(path)
    tensors[name][3, 5] = np.nan
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=rf"tensor {name} holds 1 non-finite values"):
        load(copy_of)


def test_a_huge_weight_warns_on_import_and_the_run_stops_standing_still(
    copy_of, tmp_path, tiny_yaml, capsys
):
    """Fault 6 of the campaign: one finite but huge value (1e30 in a down_proj) trained 40
    steps at loss ln(vocab) with gradient norm 0 and exited 0. Import now warns (the bound,
    1e4, is in seqshard.hf.load), and the first step with a zero gradient stops the run like a
    non-finite one (exit 3, one line, nothing saved after it)."""
    from safetensors.numpy import load_file, save_file

    from seqshard.cli import EXIT_NONFINITE

    index = json.loads((copy_of / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.mlp.down_proj.weight"
    path = copy_of / index[name]
    tensors = load_file(path)
    tensors[name][3, 5] = 1e30
    save_file(tensors, path, metadata={"format": "pt"})

    tiny_yaml(tmp_path / "base.yaml", tmp_path / "runs")
    config = tmp_path / "huge.yaml"
    config.write_text(f"base: base.yaml\ninit: {{from_hf: {copy_of}}}\n")
    capsys.readouterr()
    code = main(["train", str(config), "train.steps=4", "--sample-tokens", "0"])
    out, err = capsys.readouterr()
    assert code == EXIT_NONFINITE, out + err
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and f"tensor {name} holds 1 values above 10000" in warnings[0]
    assert "(largest 1e+30)" in warnings[0]
    assert err.startswith("seqshard train: error: step 1: loss finite, grad norm zero: zero "), err
    assert err.count("\n") == 1


def test_the_config_must_agree_with_config_json(copy_of):
    cfg = ModelConfig(
        compute_dtype="float32",
        vocab=320,
        d_model=32,
        n_layers=2,
        n_q_per_kv=2,
        n_kv=4,
        d_head=8,
        d_ff=64,
    )
    with pytest.raises(HFFormatError, match=r"model.rope_type='default' but it says 'llama3'"):
        load_hf_weights(copy_of, cfg, training_mesh({"d": 4, "t": 2}), log=lambda m: None)


# -- Qwen3, Mixtral and Qwen3-MoE ---------------------------------------------------------------

HF_MOE_SIZES = {  # tiny: 8 experts of 32, top 2, d_model 64, GQA 4 query / 2 kv heads of 16
    "vocab_size": 96,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MOE_MESH = {"e": 2, "d": 2, "t": 2}  # the experts over e, their hidden dim over t
DENSE_MESH = {"d": 4, "t": 2}


def hf_model(path: Path, architecture: str, **changes):
    """A random ``architecture`` model (f32, every weight random: norm gains, q_norm and k_norm
    1 + N(0, 0.04), matrices N(0, 1/fan_in)) saved with save_pretrained into ``path``.
    Mixtral: 2 layers, 8 experts of 32, top 2. Qwen3-MoE: 3 layers, the first dense
    (mlp_only_layers [0], intermediate_size 48), then 8 experts of 32, top 2, norm_topk_prob.
    Qwen3: 2 dense layers."""
    import torch
    import transformers

    made = {
        "MixtralForCausalLM": (
            transformers.MixtralConfig,
            {"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
             "intermediate_size": 32},
        ),
        "Qwen3MoeForCausalLM": (
            transformers.Qwen3MoeConfig,
            {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "intermediate_size": 48, "norm_topk_prob": True,
             "mlp_only_layers": [0], "decoder_sparse_step": 1},
        ),
        "Qwen3ForCausalLM": (transformers.Qwen3Config, {"num_hidden_layers": 2,
                                                        "intermediate_size": 48}),
    }  # fmt: skip
    config_type, sizes = made[architecture]
    torch.manual_seed(0)
    config = config_type(**{**HF_MOE_SIZES, **sizes, **changes})
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def hf_cfg(path: Path) -> ModelConfig:
    return read_hf_config(path).model_config(
        ModelConfig(compute_dtype="float32", attention_impl="einsum")
    )


ARCHITECTURES = ["Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]


@needs_transformers
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_transformers_qwen3_mixtral_or_qwen3_moe_imports_with_equal_logits(
    tmp_path, architecture
):
    """HF -> seqshard on e=2 x d=2 x t=2 (the experts split over e; dense Qwen3 on 4x2):
    logits_fn equals torch's logits within 1e-5 (measured max abs: Qwen3 3.3e-6, Mixtral 3.5e-6,
    Qwen3-MoE 4.7e-6, of logits up to about 4)."""
    model = hf_model(tmp_path, architecture)
    keys = json.loads((tmp_path / "config.json").read_text())
    cfg = hf_cfg(tmp_path)
    assert cfg.qk_norm == architecture.startswith("Qwen3")
    if architecture == "MixtralForCausalLM":
        assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.d_ff) == (8, 2, 32)
        assert cfg.moe.n_dense_layers == 0 and any(
            "block_sparse_moe" in k for k in safetensors_names(tmp_path)
        )
    if architecture == "Qwen3MoeForCausalLM":
        assert (cfg.moe.n_experts, cfg.moe.d_ff, cfg.d_ff, cfg.moe.n_dense_layers) == (8, 32, 48, 1)
        assert keys["norm_topk_prob"] is True
    mesh = training_mesh(MOE_MESH if cfg.moe.enabled else DENSE_MESH)
    weights = load_hf_weights(tmp_path, cfg, mesh, log=lambda m: None)
    if cfg.moe.enabled:
        assert not np.asarray(weights.moe_layers.router_bias).any()  # no HF tensor: zeros
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)


@needs_transformers
def test_a_qwen3_moe_without_norm_topk_prob_imports_with_equal_logits(tmp_path):
    """Qwen3-MoE's norm_topk_prob false (its config's default): each routed expert weighted by
    its plain softmax probability, model.moe.norm_topk_prob=false; the logits equal torch's
    within 1e-5 on e2 x d2 x t2, and the exported config.json says false again."""
    model = hf_model(tmp_path, "Qwen3MoeForCausalLM", norm_topk_prob=False)
    cfg = hf_cfg(tmp_path)
    assert cfg.moe.norm_topk_prob is False
    mesh = training_mesh(MOE_MESH)
    weights = load_hf_weights(tmp_path, cfg, mesh, log=lambda m: None)
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)
    normalized = seqshard_logits(
        weights,
        tokens,
        starts,
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True)),
        mesh,
    )
    assert np.abs(normalized - want).max() > 100 * LOGITS_TOL  # the flag matters here
    exported = hf_config_dict(cfg, dtype="float32", max_position=64, eos_token_id=None)
    assert exported["norm_topk_prob"] is False


@needs_transformers
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_exported_qwen3_mixtral_or_qwen3_moe_loads_in_transformers_with_equal_logits(
    tmp_path, data_dir, architecture
):
    """seqshard -> export -> AutoModelForCausalLM: the architecture export picks (qk_norm and
    experts decide), its per-expert tensors, logits within 1e-5 of seqshard's (measured max abs:
    Qwen3 3.1e-6, Mixtral 2.7e-6, Qwen3-MoE 2.5e-6); imported back, the weights are
    bit-identical."""
    import torch
    from transformers import AutoModelForCausalLM

    from seqshard.hf.export import ExportConfig, export_run
    from seqshard.model.config import MoEConfig

    moe = {
        "Qwen3ForCausalLM": MoEConfig(),
        "MixtralForCausalLM": MoEConfig(n_experts=8, top_k=2, d_ff=32),
        "Qwen3MoeForCausalLM": MoEConfig(n_experts=8, top_k=2, d_ff=32, n_dense_layers=1),
    }[architecture]
    cfg = ModelConfig(
        vocab=96, d_model=64, n_layers=3, n_q_per_kv=2, n_kv=2, d_head=16, d_ff=48,
        norm_eps=1e-6, compute_dtype="float32", attention_impl="einsum",
        qk_norm=architecture.startswith("Qwen3"), moe=moe,
    )  # fmt: skip
    mesh = training_mesh(MOE_MESH if moe.enabled else DENSE_MESH)
    weights = random_seqshard_weights(cfg, mesh)
    out = tmp_path / "hf"
    export = ExportConfig(out, cfg, data_dir / "tokenizer.json", max_position=64)
    export_run(weights, export, log=lambda m: None)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    if moe.enabled:
        router = "block_sparse_moe.gate" if architecture == "MixtralForCausalLM" else "mlp.gate"
        assert f"model.layers.2.{router}.weight" in safetensors_names(out)
        assert "model.layers.1.mlp.gate_proj.weight" not in safetensors_names(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    tokens, starts = tokens_and_starts(cfg.vocab)
    want = torch_logits(model, tokens)
    got = seqshard_logits(weights, tokens, starts, cfg, mesh)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_TOL)
    assert read_hf_config(out).model_config(cfg) == cfg
    assert tree_equal(load_hf_weights(out, cfg, mesh, log=lambda m: None), weights)


def test_an_export_refuses_a_router_bias_and_what_no_hf_model_computes(tmp_path):
    """A trained router bias (moe.balance=bias) moves the experts' choice, which Mixtral and
    Qwen3-MoE have no weight for: refused before anything is written. So are shared experts,
    a sigmoid router and dense layers without qk_norm (Mixtral has none)."""
    from seqshard.hf.export import ExportConfig, export_weights
    from seqshard.model.config import MoEConfig

    moe = MoEConfig(n_experts=4, top_k=2, d_ff=16)
    cfg = ModelConfig(vocab=32, d_model=16, n_layers=2, n_q_per_kv=1, n_kv=2, d_head=8, moe=moe)
    mesh = training_mesh({"e": 2})
    weights = random_seqshard_weights(cfg, mesh)
    bias = np.zeros((2, 4), np.float32)
    bias[1, 3] = 0.25
    layers = dataclasses.replace(weights.moe_layers, router_bias=jax.numpy.asarray(bias))
    weights = dataclasses.replace(weights, moe_layers=layers)
    with pytest.raises(ValueError) as info:
        export_weights(weights, cfg, tmp_path, "float32", 2**30)
    msg = str(info.value)
    assert "router_bias is nonzero (layer 1, expert 3: 0.25" in msg
    assert "MixtralForCausalLM has no such bias" in msg and "balance=aux_loss" in msg
    assert not list(tmp_path.iterdir())
    for change, needle in [
        ({"n_shared": 1}, "model.moe.n_shared=1 (shared experts, which every token passes"),
        ({"router": "sigmoid"}, "model.moe.router='sigmoid' has no Hugging Face counterpart"),
        ({"n_dense_layers": 1}, "model.moe.n_dense_layers=1 without model.qk_norm"),
        ({"n_group": 2}, "model.moe.n_group=2 has no Hugging Face counterpart"),
        ({"routed_scaling_factor": 2.5}, "model.moe.routed_scaling_factor=2.5 has no"),
        ({"norm_topk_prob": False}, "model.moe.norm_topk_prob=false without model.qk_norm"),
    ]:
        bad = dataclasses.replace(cfg, moe=dataclasses.replace(moe, **change))
        with pytest.raises(ValueError, match=re.escape(needle)):
            ExportConfig(tmp_path / "x", bad, tmp_path / "tokenizer.json", max_position=64)


@needs_transformers
def test_shared_experts_name_the_hf_families_that_hold_them(tmp_path):
    """The refusal of shared experts names the Hugging Face families that have them, each a
    transformers class whose config holds shared experts, and the fix."""
    import transformers

    from seqshard.hf.export import ExportConfig
    from seqshard.model.config import MoEConfig

    moe = MoEConfig(n_experts=4, top_k=2, d_ff=16, n_shared=2)
    cfg = ModelConfig(vocab=32, d_model=16, n_layers=2, n_q_per_kv=1, n_kv=2, d_head=8, moe=moe)
    with pytest.raises(ValueError) as info:
        ExportConfig(tmp_path / "x", cfg, tmp_path / "tokenizer.json", max_position=64)
    msg = str(info.value)
    assert "MixtralForCausalLM and Qwen3MoeForCausalLM have no shared experts" in msg, msg
    assert msg.endswith("train with model.moe.n_shared=0."), msg
    families = {  # the config key that sizes the shared experts
        "Qwen2MoeForCausalLM": "shared_expert_intermediate_size",
        "DeepseekV3ForCausalLM": "n_shared_experts",
        "Glm4MoeForCausalLM": "n_shared_experts",
    }
    for name, key in families.items():
        assert f"({name})" in msg, (name, msg)
        config = getattr(transformers, name).config_class()
        assert getattr(config, key) > 0, (name, key)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A saved random Mixtral (8 experts), made once: tests copy it before changing it."""
    if not HAS_TRANSFORMERS:
        pytest.skip("needs transformers and a CPU torch")
    path = tmp_path_factory.mktemp("mixtral") / "model"
    hf_model(path, "MixtralForCausalLM")
    return path


@pytest.fixture
def mixtral_copy(mixtral_dir, tmp_path):
    out = tmp_path / "mixtral"
    shutil.copytree(mixtral_dir, out)
    return out


def set_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | changes))


def load_moe(path: Path, **fields):
    cfg = read_hf_config(path).model_config(ModelConfig(compute_dtype="float32", **fields))
    return load_hf_weights(path, cfg, training_mesh(MOE_MESH), log=lambda m: None)


@pytest.mark.parametrize(
    "count, needle",
    [
        (4, "Layer 0 has experts up to 7, but config.json says num_local_experts=4: set "
            "num_local_experts to the number of experts the files hold (8?)"),
        (16, "Layer 0 lacks experts 8..15: config.json says num_local_experts=16; if the files "
             "hold only 8, set num_local_experts to 8."),
    ],
    ids=["fewer", "more"],
)  # fmt: skip
def test_an_expert_count_the_files_contradict_names_the_key_and_the_fix(
    mixtral_copy, count, needle
):
    set_config(mixtral_copy, num_local_experts=count)
    with pytest.raises(HFFormatError) as info:
        load_moe(mixtral_copy)
    assert needle in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__ is False


def test_a_router_of_another_expert_count_names_the_tensor_and_key(mixtral_copy):
    from safetensors.numpy import load_file, save_file

    path = mixtral_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.block_sparse_moe.gate.weight"
    tensors[name] = tensors[name][:6]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError) as info:
        load_moe(mixtral_copy)
    msg = str(info.value)
    assert f"tensor {name} has shape [6, 64], but config.json implies [8, 64]" in msg
    assert "experts=8 (num_local_experts)" in msg and "d_model=64 (hidden_size)" in msg


def test_a_config_disagreeing_on_experts_names_the_field_and_key(mixtral_copy):
    cfg = hf_cfg(mixtral_copy)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=4, top_k=1))
    with pytest.raises(HFFormatError) as info:
        load_hf_weights(mixtral_copy, cfg, training_mesh(MOE_MESH), log=lambda m: None)
    msg = str(info.value)
    assert "model.moe.n_experts=4 but it says 8 (num_local_experts)" in msg
    assert "model.moe.top_k=1 but it says 2" in msg


@pytest.mark.parametrize(
    "architecture, change, needle",
    [
        ("Qwen3MoeForCausalLM", {"mlp_only_layers": [1]}, "these make layers [1] dense"),
        ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 2}, "these make layers [0, 2, 4] dense"),
        ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("MixtralForCausalLM", {"sliding_window": 4096}, "sliding_window=4096"),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64"),
        ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]},
         "layer_types=['full_attention', 'sliding_attention']"),
    ],
)  # fmt: skip
def test_a_router_or_layout_seqshard_does_not_compute_is_an_error_naming_the_key(
    tmp_path, architecture, change, needle
):
    raw = {
        "architectures": [architecture], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    read_hf_config(tmp_path)  # as written, fine
    (tmp_path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(HFFormatError) as info:
        read_hf_config(tmp_path)
    assert needle in str(info.value) and "config.json" in str(info.value)
