"""Tests of seqshard.config: layered YAML files, dotted overrides, typed errors, cross-field checks."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from seqshard.config import (
    Config,
    ConfigError,
    check_overrides_once,
    config_to_yaml,
    load_config,
)
from seqshard.model.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

# Small enough that every cross-field check passes on the meshes used below.
OK = ["data.vocab_size=256"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def load(*overrides: str, path=None) -> Config:
    return load_config(path, [*OK, *overrides])


# -- the shipped configs --------------------------------------------------------------------


def test_shipped_configs_load_and_layer():
    base = load_config(CONFIGS / "base.yaml")
    tiny = load_config(CONFIGS / "tiny-cpu.yaml")
    assert (tiny.mesh.d, tiny.mesh.t) == (4, 2)
    assert tiny.model.d_model == 128 and base.model.d_model == 256
    # Keys tiny-cpu.yaml does not set come from base.yaml, not from the dataclass defaults.
    assert tiny.model.vocab == base.model.vocab == 4096
    assert base.model.n_layers == 4 != ModelConfig().n_layers  # base.yaml beats the defaults
    assert tiny.train.weight_decay == base.train.weight_decay
    assert tiny.run.name == "tiny-cpu" and base.run.name == "base"


# -- layering -------------------------------------------------------------------------------


def test_base_layering_later_layers_win(tmp_path):
    write(
        tmp_path / "root.yaml",
        """
        model: {vocab: 512, d_model: 64, d_ff: 256}
        train: {steps: 50, lr: 1.0e-3, batch_size: 16}
        data: {vocab_size: 512}
        """,
    )
    # The base path is relative to the file naming it, not to the working directory.
    write(
        tmp_path / "sub" / "mid.yaml",
        """
        base: ../root.yaml
        train: {steps: 20}
        mesh: {d: 2}
        """,
    )
    leaf = write(
        tmp_path / "sub" / "leaf.yaml",
        """
        base: mid.yaml
        train: {lr: 5.0e-4}
        """,
    )
    cfg = load_config(leaf)
    assert cfg.model.d_model == 64 and cfg.model.vocab == 512  # from root
    assert cfg.train.steps == 20  # mid beats root
    assert cfg.train.lr == 5e-4  # leaf beats root
    assert cfg.train.batch_size == 16 and cfg.mesh.d == 2
    assert cfg.run.name == "leaf"  # the file's stem

    # Overrides beat every file, and a later override beats an earlier one.
    cfg = load_config(leaf, ["train.steps=7", "model.d_model=32", "model.d_model=16"])
    assert cfg.train.steps == 7 and cfg.model.d_model == 16
    assert cfg.train.lr == 5e-4


def test_dotted_overrides_parse_to_the_field_types():
    cfg = load(
        "train.lr=1e-3",
        "train.steps=12",
        "model.remat=full",
        "data.inputs=[a.txt,b]",
        "data.tokenizer=null",
        "run.name=exp",
        "mesh.d=2",
    )
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 12
    assert cfg.model.remat == "full"
    assert cfg.data.inputs == (str(Path.cwd() / "a.txt"), str(Path.cwd() / "b"))  # an override's
    assert cfg.data.tokenizer is None
    assert cfg.run.name == "exp" and cfg.mesh.d == 2


def test_yaml_float_without_a_dot_is_a_float(tmp_path):
    # PyYAML reads `1e-3` as a string (YAML 1.1); the typed schema must still make it a float.
    path = write(tmp_path / "c.yaml", "train: {lr: 1e-3}\ndata: {vocab_size: 256}\n")
    assert load_config(path).train.lr == 1e-3


def test_every_model_field_and_the_mesh_and_steps_keys_are_overridable():
    values = {
        "vocab": 512,
        "d_model": 64,
        "n_layers": 3,
        "n_q_per_kv": 4,
        "n_kv": 4,
        "d_head": 16,
        "d_ff": 128,
        "rope_theta": 500000.0,
        "norm_eps": 1e-6,
        "compute_dtype": "float32",
        "remat": "none",
        "attention_impl": "einsum",
        "attention_mask": "causal",
        "backward": "autodiff",
        "residual": "M/t",
        "context_impl": "ring",
        "rope_type": "llama3",
        "rope_factor": 32.0,
        "rope_low_freq_factor": 2.0,
        "rope_high_freq_factor": 8.0,
        "rope_original_max_position": 1024,
        "rope_beta_fast": 16.0,
        "rope_beta_slow": 2.0,
        "rope_mscale": 0.5,
        "rope_mscale_all_dim": 0.25,
        "qk_norm": True,
        "attention": "gqa",
        # read only with attention: mla, but set and kept all the same
        "mla": {
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "rope_interleave": False,
        },
        "mtp": {"depth": 1, "loss_weight": 0.1},
        "ffn": "swiglu",
        "moe": {
            "n_experts": 4,
            "top_k": 1,
            "d_ff": 32,
            "n_shared": 1,
            "n_dense_layers": 1,
            "router": "sigmoid",
            "balance": "bias",
            "aux_loss_weight": 0.02,
            "bias_rate": 0.01,
            "z_loss_weight": 0.001,
            "capacity_factor": 1.5,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.0,
        },
        "fp8": "delayed",
        "fp8_history": 8,
        "max_logit": False,  # true refuses the ring over c = 2 (checked below on its own)
    }
    assert set(values) == {f.name for f in dataclasses.fields(ModelConfig)}, (
        "a ModelConfig field was added or renamed: add it here"
    )
    nested = ("moe", "mla", "mtp")
    flat = {f"{n}.{k}": v for n in nested for k, v in values[n].items()}
    flat |= {k: v for k, v in values.items() if k not in nested}
    cfg = load(
        *(f"model.{k}={v}" for k, v in flat.items()),
        "mesh.d=2",
        "mesh.c=2",
        "mesh.t=2",
        "train.steps=5",
    )
    assert dataclasses.asdict(cfg.model) == values
    assert (cfg.mesh.d, cfg.mesh.c, cfg.mesh.t, cfg.train.steps) == (2, 2, 2, 5)
    assert load("model.max_logit=true").model.max_logit is True


def test_a_sequence_the_residual_cannot_split_is_rejected():
    with pytest.raises(ConfigError) as info:
        load("mesh.d=2", "mesh.t=4", "model.n_kv=4", "train.seq_len=130")
    msg = str(info.value)
    assert "model.residual=L/t splits the sequence over t" in msg
    assert (
        "train.seq_len=130 is not divisible by mesh.c x mesh.t = 4" in msg
        and "model.residual=M/t" in msg
    )
    cfg = load("mesh.d=2", "mesh.t=4", "model.n_kv=4", "train.seq_len=130", "model.residual=M/t")
    assert cfg.model.residual_spec == "B/dp L@zigzag/c M/t"


def test_a_sequence_the_context_axis_cannot_cut_in_zigzag_chunks_is_rejected():
    with pytest.raises(ConfigError) as info:
        load("mesh.c=4", "train.seq_len=132", "model.residual=M/t")
    msg = str(info.value)
    assert "mesh.c=4 splits the sequence over c in zigzag order (2c = 8 chunks" in msg
    assert "train.seq_len=132 is not divisible by 8" in msg
    assert load("mesh.c=4", "train.seq_len=136").mesh.c == 4


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(
        CONFIGS / "tiny-cpu.yaml",
        ["train.steps=17", "data.inputs=[x.txt]", "data.tokenizer=tok.json", "model.remat=full"],
    )
    path = write(tmp_path / "resolved.yaml", config_to_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert config_to_yaml(again) == config_to_yaml(cfg)


# -- malformed files and overrides ----------------------------------------------------------


def test_unknown_key_suggests_the_close_match(tmp_path):
    with pytest.raises(ConfigError, match="d_modle") as e:
        load("model.d_modle=3")
    assert "d_model" in str(e.value).replace("d_modle", "")

    with pytest.raises(ConfigError, match="modle") as e:
        load("modle.d_model=3")
    assert "'model'" in str(e.value)

    path = write(tmp_path / "typo.yaml", "train: {stesp: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "stesp" in str(e.value) and "steps" in str(e.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [("train.steps=abc", "Integer"), ("train.lr=fast", "Float"), ("train.steps=1.5", "Integer")],
)
def test_wrong_type_names_key_expected_type_and_value(override, expected):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load(override)
    msg = str(e.value)
    assert key in msg and expected in msg and value in msg


def test_wrong_type_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "mesh: {d: two}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "mesh.d" in msg and "two" in msg


def test_bad_choice_lists_the_choices():
    with pytest.raises(ConfigError, match=r"model\.remat") as e:
        load("model.remat=bogus")
    assert "bogus" in str(e.value) and "saved" in str(e.value) and "full" in str(e.value)
    with pytest.raises(ConfigError, match=r"model\.compute_dtype.*f16"):
        load("model.compute_dtype=f16")
    with pytest.raises(ConfigError, match=r"model\.d_head.*even.*7"):
        load("model.d_head=7")


def test_malformed_yaml_names_the_file(tmp_path):
    path = write(tmp_path / "broken.yaml", "model: {d_model: 64\ntrain: [\n")
    with pytest.raises(ConfigError, match="malformed YAML") as e:
        load_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        # Fault 3 of the campaign: two sections; this trained 300 steps at lr 0.003.
        ("train: {steps: 5, lr: 0.001}\ntrain: {batch_size: 16}\n", "train", (1, 2)),
        # ... and a nested duplicate, which ran 7 steps.
        ("train:\n  steps: 5\n  lr: 0.001\n  steps: 7\n", "train.steps", (2, 4)),
        ("model: {d_model: 64}\nmesh: {d: 1, t: 1, d: 2}\n", "mesh.d", (2, 2)),
    ],
)
def test_a_duplicate_key_names_the_file_the_key_and_both_lines(tmp_path, text, key, lines):
    """YAML keeps the last of two equal keys silently; seqshard refuses it, at any depth, in
    a base file too."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    child = tmp_path / "child.yaml"
    child.write_text("base: dup.yaml\n")
    for loaded in (path, child):
        with pytest.raises(ConfigError) as e:
            load_config(loaded)
        message = str(e.value)
        assert message.startswith(f"{path}: key {key!r} appears twice"), message
        assert f"on lines {lines[0]} and {lines[1]}" in message


def test_equal_keys_in_different_sections_are_not_duplicates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: base.yaml\nmodel: {d_model: 64}\ntrain: {steps: 5}\ndata: {seed: 1}\n")
    (tmp_path / "base.yaml").write_text("train: {seed: 3, steps: 4}\n")
    cfg = load_config(path)
    assert cfg.train.steps == 5 and cfg.train.seed == 3 and cfg.data.seed == 1


def test_a_file_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping") as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_an_empty_file_is_an_error_not_the_defaults(tmp_path):
    """An empty config trained silently on the built-in defaults; now it says so."""
    path = write(tmp_path / "empty.yaml", "# nothing yet\n")
    with pytest.raises(
        ConfigError, match=r"empty\.yaml is empty: it would run seqshard's built-in"
    ):
        load_config(path)
    base = Path(__file__).resolve().parent.parent / "configs" / "base.yaml"
    assert load_config(write(tmp_path / "b.yaml", f"base: {base}\n")).run.name == "b"


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory\. Pass a YAML file"):
        load_config(tmp_path)


def test_base_loop_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops") as e:
        load_config(tmp_path / "a.yaml")
    assert "a.yaml" in str(e.value) and "b.yaml" in str(e.value)
    write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "self.yaml")


def test_missing_file_and_missing_base(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value)
    write(tmp_path / "child.yaml", "base: gone.yaml\n")
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_config(tmp_path / "child.yaml")
    assert "gone.yaml" in str(e.value)
    write(tmp_path / "badbase.yaml", "base: [a, b]\n")
    with pytest.raises(ConfigError, match="'base' must be a file name"):
        load_config(tmp_path / "badbase.yaml")


@pytest.mark.parametrize("override", ["train.steps", "=3", "train..steps=3", "mesh=3"])
def test_bad_override_syntax(override):
    with pytest.raises(ConfigError) as e:
        load(override)
    assert repr(override) in str(e.value)


# -- cross-field checks: the key, its value and the axis size in the message ------------------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["train.batch_size=12", "mesh.d=4", "train.microbatches=2", "model.d_model=128"],
            ["train.batch_size", "12", "d=4", "mesh.d * train.microbatches = 8"],
        ),
        (["train.batch_size=10", "mesh.d=4"], ["train.batch_size", "10", "d=4"]),
        (
            ["train.batch_size=12", "train.microbatches=5"],
            ["train.batch_size=12", "train.microbatches=5"],
        ),
        (["model.n_kv=2", "mesh.t=4"], ["model.n_kv=2", "mesh axis t", "= 4"]),
        (["model.vocab=255", "mesh.t=2"], ["model.vocab=255", "mesh axis t", "= 2"]),
        (["model.d_ff=100", "mesh.t=8", "model.n_kv=8"], ["model.d_ff=100", "= 8"]),
        (
            ["model.d_model=36", "mesh.d=4", "mesh.t=2"],
            ["model.d_model=36", "t*d*e*c", "= 8", "d=4 x c=1 x t=2", "d_model/t/d/e/c"],
        ),
        (["data.vocab_size=4096"], ["data.vocab_size=4096", "model.vocab=256"]),
        (["mesh.d=0"], ["mesh.d=0", ">= 1, or -1 for the remaining devices"]),
        (["train.steps=0"], ["train.steps", "0"]),
        (["train.seq_len=1"], ["train.seq_len", "1"]),
        (["train.warmup_steps=-1"], ["train.warmup_steps", "-1"]),
        (["train.lr=0"], ["train.lr", "lr=0"]),
        (["train.min_lr_ratio=2"], ["train.min_lr_ratio", "2"]),
        (["data.val_fraction=0"], ["data.val_fraction", "0"]),
        (["train.lr=nan"], ["train.lr must be a finite number, got nan"]),
        (["train.lr=inf"], ["train.lr must be a finite number, got inf"]),
        (["train.checkpoint_every=-1"], ["train.checkpoint_every must be >= 0", "got -1"]),
        (["train.eval_every=-5"], ["train.eval_every must be >= 0", "got -5"]),
        (["train.max_nonfinite_skips=0"], ["train.max_nonfinite_skips must be >= 1"]),
        (["train.beta2=1"], ["train.beta2 must be in [0, 1)"]),
    ],
)
def test_cross_field_checks_name_key_value_and_axis(overrides, needles):
    with pytest.raises(ConfigError) as e:
        load("model.vocab=256", *overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_the_checks_accept_a_consistent_config():
    cfg = load(
        "mesh.d=4",
        "mesh.t=2",
        "train.batch_size=16",
        "train.microbatches=2",
        "model.n_kv=2",
        "model.d_model=128",
    )
    assert cfg.train.batch_size // cfg.train.microbatches % cfg.mesh.d == 0


def test_a_config_is_a_cache_key():
    """Configs key caches of what is derived from them (seqshard.plan.step_comms' traced step,
    the model's jitted shard_maps by ModelConfig): two loads of the same overrides are one key,
    list values from YAML included; a changed value is another key."""
    a = load("data.inputs=[a,b]", "train.steps=3")
    b = load("data.inputs=[a,b]", "train.steps=3")
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b, load("data.inputs=[a,b]", "train.steps=4"), load("train.steps=3")}) == 3
    assert hash(a.model) == hash(load("mesh.d=2").model)


# -- saved configs: one reader, one diff ------------------------------------------------------


def test_a_saved_config_reads_back_equal_and_diffs_by_dotted_key(tmp_path):
    from seqshard.config import config_changes, config_from_yaml, config_to_yaml, read_run_config

    cfg = load_config(None, ["train.steps=300", "mesh.d=2"])
    assert config_from_yaml(config_to_yaml(cfg), "saved") == cfg
    other = load_config(None, ["train.steps=600", "mesh.d=2", "model.remat=full"])
    assert config_changes(cfg, other) == {
        "model.remat": ("saved", "full"),
        "train.steps": (300, 600),
    }
    assert config_changes(cfg, cfg) == {}

    run = tmp_path / "run"
    with pytest.raises(
        ConfigError, match=r"config\.yaml does not exist: .* is not a run directory"
    ):
        read_run_config(run)
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    assert read_run_config(run) == cfg
    (run / "config.yaml").write_text("model: {d_modle: 3}\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: .*d_modle"):
        read_run_config(run)
    with pytest.raises(ConfigError, match="saved: expected a saved seqshard config"):
        config_from_yaml("[1, 2]", "saved")


def test_from_hf_is_read_by_the_callers_reader_told_the_keys_written_beside_it(tmp_path):
    """seqshard.config does not import seqshard.hf: ``init.from_hf`` is read by the reader the
    caller passes (seqshard.cli.with_hf_model), told which model keys the file naming it and later
    layers write (those must agree; inherited ones are filled), before the cross-field checks.
    Without a reader, the error names the one to pass."""
    write(tmp_path / "base.yaml", "model: {d_ff: 128}\n")
    config = write(
        tmp_path / "c.yaml", "base: base.yaml\ninit: {from_hf: hf}\nmodel: {moe: {d_ff: 64}}\n"
    )
    seen = []

    def reader(cfg: Config, written: frozenset[str]) -> Config:
        seen.append((cfg.init.from_hf, written))
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_kv=2))

    cfg = load_config(config, [*OK, "model.n_layers=4"], from_hf=reader)
    assert seen == [(str(tmp_path / "hf"), frozenset({"moe.d_ff", "n_layers"}))]
    assert cfg.model.n_kv == 2
    with pytest.raises(ConfigError, match=r"pass from_hf=seqshard\.cli\.with_hf_model") as e:
        load_config(config, OK)
    assert str(e.value).startswith(f"init.from_hf={tmp_path / 'hf'}: load_config() does not ")


# -- the second fault campaign (issue 40): config errors that named nothing ------------------


def test_an_override_given_twice_on_the_command_line_is_an_error(capsys):
    """Fault 18: `train.steps=5 train.steps=600` was last-wins, silently."""
    from seqshard.cli import EXIT_ERROR, main

    with pytest.raises(ConfigError, match=r"override train\.steps is given twice") as e:
        check_overrides_once(["train.steps=5", "train.lr=1", "train.steps=600"])
    assert "'train.steps=5', then 'train.steps=600'" in str(e.value)
    check_overrides_once(["train.steps=5", "train.lr=1e-3"])  # other keys: fine
    args = ["show", str(CONFIGS / "tiny-cpu.yaml"), "train.steps=5", "train.steps=600"]
    assert main([*args, "--no-compile"]) == EXIT_ERROR
    assert "error: override train.steps is given twice" in capsys.readouterr().err


def test_a_mixture_written_as_a_mapping_names_the_key_and_the_expected_list(tmp_path):
    """Fault 7: only "Cannot merge incompatible container types" (a TypeError inside
    omegaconf), with no file, no key and no hint of the list of {path, weight} expected."""
    path = write(
        tmp_path / "mix.yaml",
        f"""\
        base: {CONFIGS / "tiny-cpu.yaml"}
        data:
          mixture:
            web: 0.7
            code: 0.3
        """,
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(
        f"{path}: data.mixture must be a list, each item {{path: ..., weight: ...}}"
    )
    assert "got a mapping {'web': 0.7, 'code': 0.3}" in msg
    with pytest.raises(ConfigError, match=r"override 'train=\[1\]': train must be a mapping of"):
        load("train=[1]")


def test_an_explicit_data_dir_beside_a_mixture_is_an_error(tmp_path):
    """Fault 17: data.dir set with data.mixture was ignored silently. Inherited from a base
    (base.yaml's default) it is still fine, as docs/data.md says."""
    mixture = "data.mixture=[{path: data/web, weight: 1}]"
    assert load(mixture, path=CONFIGS / "tiny-cpu.yaml").data.dir == str(REPO / "data/stdlib")
    with pytest.raises(ConfigError, match=r"data\.dir=\S*/data/x is set beside data\.mixture") as e:
        load(mixture, "data.dir=data/x", path=CONFIGS / "tiny-cpu.yaml")
    assert "Drop data.dir, or drop data.mixture and data.stages" in str(e.value)
    both = write(
        tmp_path / "both.yaml",
        f"""\
        base: {CONFIGS / "tiny-cpu.yaml"}
        data: {{dir: data/x, stages: [{{start_step: 5, mixture: [{{path: data/web}}]}}]}}
        """,
    )
    with pytest.raises(ConfigError, match=r"both\.yaml: data\.dir=\S*/data/x is set beside"):
        load_config(both)
    # A data.dir before the file or override that sets the mixture is inherited: fine.
    assert load("data.dir=data/x", mixture).data.mixture[0].path == str(Path.cwd() / "data/web")


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_capacity_factor_that_is_not_finite_and_non_negative_is_refused(value):
    """Fault 2: capacity_factor=inf reached moe.py (OverflowError: cannot convert float
    infinity to integer); NaN and negatives were already refused."""
    moe = ["model.moe.n_experts=4", "model.moe.top_k=2", "mesh.d=8", "mesh.t=1"]
    with pytest.raises(ConfigError, match=r"model\.moe\.capacity_factor must be finite and >= 0"):
        load(*moe, f"model.moe.capacity_factor={value}")


# -- paths: relative to the file that names them (issue 41) ---------------------------------


def test_a_relative_path_is_relative_to_the_file_that_names_it(tmp_path, monkeypatch):
    """Only `base` was read relative to its file; data.dir, inputs, tokenizer, chat_template,
    mixture sources, init and run.dir meant the working directory, so a config worked from one
    directory only. An override's path still means the working directory."""
    root = tmp_path / "proj"
    write(
        root / "configs" / "base.yaml",
        """
        data: {dir: ../data/x, vocab_size: 256, inputs: [text, ../more.txt],
               tokenizer: tok/tokenizer.json}
        run: {dir: ../runs}
        """,
    )
    leaf = write(
        root / "configs" / "sub" / "leaf.yaml",
        """
        base: ../base.yaml
        data: {chat_template: chat.jinja,
               stages: [{start_step: 5, mixture: [{path: ../../data/web}]}]}
        init: {from_run: /elsewhere/run}
        """,
    )
    monkeypatch.chdir(tmp_path)  # neither file's directory
    cfg = load_config(leaf)
    assert cfg.data.dir == str(root / "data" / "x")
    assert cfg.data.inputs == (str(root / "configs" / "text"), str(root / "more.txt"))
    assert cfg.data.tokenizer == str(root / "configs" / "tok" / "tokenizer.json")
    assert cfg.data.chat_template == str(root / "configs" / "sub" / "chat.jinja")
    assert cfg.data.stages[0].mixture[0].path == str(root / "data" / "web")
    assert cfg.init.from_run == "/elsewhere/run"  # absolute: as written
    assert cfg.run.dir == str(root / "runs")
    # An override's path is the working directory's; the saved config reads back equal.
    cfg = load_config(leaf, ["data.tokenizer=mine.json", "run.dir=out"])
    assert (cfg.data.tokenizer, cfg.run.dir) == (str(tmp_path / "mine.json"), str(tmp_path / "out"))
    saved = write(tmp_path / "elsewhere" / "config.yaml", config_to_yaml(cfg))
    assert load_config(saved, saved=True) == cfg


def test_the_shipped_configs_mean_the_repo_from_any_directory(tmp_path, monkeypatch):
    """configs/sft-tiny-cpu.yaml failed from another directory (its chat template, inputs and
    tokenizer were read relative to it); the README runs it from the repo root, and from
    there every shipped config means what it did."""
    monkeypatch.chdir(tmp_path)
    sft = load_config(CONFIGS / "sft-tiny-cpu.yaml")
    assert sft.init.from_run == str(REPO / "runs" / "tiny-cpu")  # the main job's run
    assert sft.data.tokenizer == str(REPO / "data" / "stdlib" / "tokenizer.json")
    assert sft.data.dir == str(REPO / "data" / "sft-chat-stdlib")
    assert Path(sft.data.chat_template).is_file()
    assert sft.data.inputs == (str(CONFIGS / "sft" / "chat-stdlib.jsonl"),)
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.run.dir == str(REPO / "runs"), path
        assert cfg.data.dir.startswith(str(REPO / "data") + "/"), path


def test_a_saved_config_keeps_the_working_directory_meaning_it_was_saved_with(
    tmp_path, monkeypatch
):
    """A run's config.yaml saved before paths were relative to their file holds them
    relative to the directory `seqshard train` ran in: loaded as a run's own (saved=True), and
    compared on resume (config_changes), they still mean that directory."""
    from seqshard.config import config_changes, config_from_yaml

    monkeypatch.chdir(REPO)
    new = load_config(CONFIGS / "tiny-cpu.yaml")
    old_data = dataclasses.replace(new.data, dir="data/stdlib")
    old = dataclasses.replace(new, data=old_data, run=dataclasses.replace(new.run, dir="runs"))
    saved = write(tmp_path / "runs" / "tiny-cpu" / "config.yaml", config_to_yaml(old))
    assert load_config(saved, saved=True).data.dir == "data/stdlib"  # as written: the cwd's
    assert config_changes(config_from_yaml(saved.read_text(), "saved"), new) == {}
    monkeypatch.chdir(tmp_path)  # from elsewhere the old words mean other data
    changes = config_changes(config_from_yaml(saved.read_text(), "saved"), new)
    assert changes["data.dir"] == (str(tmp_path / "data/stdlib"), str(REPO / "data/stdlib"))


def test_a_hub_tokenizer_name_stays_a_name_unless_the_path_exists(tmp_path, monkeypatch):
    """data.tokenizer: ORG/NAME names a Hugging Face Hub tokenizer when no such path exists
    beside the file; a path that exists wins (and is made absolute)."""
    config = write(
        tmp_path / "c.yaml", "data: {tokenizer: meta-llama/Llama-3.2-1B, vocab_size: 256}\n"
    )
    monkeypatch.chdir(REPO)
    assert load_config(config).data.tokenizer == "meta-llama/Llama-3.2-1B"
    assert load_config(None, [*OK, "data.tokenizer=org/name"]).data.tokenizer == "org/name"
    (tmp_path / "meta-llama" / "Llama-3.2-1B").mkdir(parents=True)
    assert load_config(config).data.tokenizer == str(tmp_path / "meta-llama" / "Llama-3.2-1B")


# -- the reference of every key: seqshard config, docs/config.md -----------------------------


def test_docs_config_md_is_current():
    from seqshard.config import config_reference

    docs = REPO / "docs" / "config.md"
    assert docs.read_text() == config_reference(markdown=True), (
        "docs/config.md is not the reference of the config's fields: regenerate it with "
        "`seqshard config --markdown > docs/config.md`."
    )


def test_every_config_key_has_a_type_a_default_and_a_meaning():
    """Read from the dataclasses and the comment beside each field (or its docstring entry):
    a new field without one fails here."""
    from seqshard.config import config_keys

    keys = {k.key: k for k in config_keys()}
    missing = [k for k, v in keys.items() if not v.meaning]
    assert not missing, f"write a `# meaning` comment beside these fields: {missing}"
    assert (keys["train.steps"].type, keys["train.steps"].default) == ("int", "1000")
    assert keys["train.schedule"].type == "cosine | wsd"
    assert keys["data.tokenizer"].type == "path or Hub name | null"
    assert keys["data.inputs"].type == "list of path"
    assert keys["data.mixture"].type == "list of {path, weight}"
    assert keys["data.mixture[].path"].default == "(required)"
    assert keys["mesh.t"].meaning.startswith("tensor")  # from the axis table
    assert keys["model.remat"].meaning.startswith("what the scanned layer keeps")  # docstring
    assert "model.moe.top_k" in keys and "model.moe" not in keys
    with pytest.raises(ConfigError, match=r"no config section 'trian'; the sections are model"):
        config_keys("trian")
