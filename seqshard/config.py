"""Run configs: small YAML files layered over a base, dotted overrides, frozen typed dataclasses.

    # configs/tiny-cpu.yaml
    base: base.yaml            # path relative to this file; its keys are overridden here
    mesh: {d: 8, t: 1}
    train: {steps: 300}

    cfg = load_config("configs/tiny-cpu.yaml", ["train.steps=10", "model.remat=full"])

Paths: a relative path in a config file (``base``, ``data.dir``, ``data.inputs``,
``data.tokenizer``, ``data.chat_template``, mixture sources, ``init.from_run``,
``init.from_hf``, ``run.dir``) is relative to the file that names it; one in a dotted override
is relative to the working directory, and so is a default no file names. A loaded Config
holds every path absolute (a Hub tokenizer name stays a name), so a run's saved
``config.yaml`` means the same from anywhere. A run's own ``config.yaml`` loaded with
``saved=True`` is read as written, overrides included: its paths are absolute, or, saved
before this rule, relative to the working directory, as they meant then (and as the keys of
its ``run.json`` are). The fields holding paths are marked (:func:`_path`); the rule and its
one exception (a Hugging Face Hub tokenizer name) are in :mod:`seqshard.paths`.
``seqshard config [SECTION]`` lists every key, its type, default and meaning (:func:`config_keys`).

Loading goes through omegaconf structured configs, so an unknown key is an error with a
close-match suggestion and a wrong type names the key, the expected type and the value.
Cross-field checks (mesh vs model sizes, batch vs mesh and microbatches) run before anything
compiles. Keys users rely on: ``model.<any ModelConfig field>``, ``mesh.d``, ``mesh.c``, ``mesh.t``,
``train.steps``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from seqshard.evals.tasks import BUILTIN as BUILTIN_TASKS
from seqshard.mesh import MESH_AXES, axis_sizes, describe_sizes
from seqshard.model.config import ModelConfig
from seqshard.model.pipeline.schedule import Pipeline, make_schedule
from seqshard.model.weights import check_mesh
from seqshard.paths import is_hub_name, rebase

__all__ = [
    "Config",
    "ConfigError",
    "ConfigKey",
    "DataConfig",
    "FromHF",
    "InitConfig",
    "MeshConfig",
    "MixtureSource",
    "MixtureStage",
    "EvalConfig",
    "EvalTask",
    "MuonConfig",
    "ProfileConfig",
    "REMAINING",
    "SECTIONS",
    "TRACKERS",
    "RunConfig",
    "RuntimeConfig",
    "TrainConfig",
    "config_changes",
    "config_from_yaml",
    "config_keys",
    "config_reference",
    "check_overrides_once",
    "override_key",
    "check_run_name",
    "config_to_yaml",
    "load_config",
    "read_run_config",
    "resolve_mesh",
]


class ConfigError(ValueError):
    """A config file or override is malformed, or its values do not fit together."""


class _MeshSizes:
    """The methods of :class:`MeshConfig` (its fields come from the axis table)."""

    def given(self) -> dict[str, int]:
        """The sizes as written, ``-1`` included."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def is_resolved(self) -> bool:
        return REMAINING not in self.given().values()

    def resolved(self, n_devices: int) -> MeshConfig:
        """This mesh on ``n_devices`` devices: a ``-1`` axis takes the devices the others leave."""
        if self.is_resolved:
            return self
        given = self.given()
        fixed = math.prod(n for n in given.values() if n != REMAINING)
        free = next(a for a, n in given.items() if n == REMAINING)
        if n_devices % fixed:
            raise ConfigError(
                f"mesh.{free}=-1 takes the devices the other axes leave, but {n_devices} devices "
                f"do not divide by {describe_sizes({a: n for a, n in given.items() if a != free})} "
                f"= {fixed}. Choose sizes whose product divides {n_devices}."
            )
        return dataclasses.replace(self, **{free: n_devices // fixed})

    def sizes(self) -> dict[str, int]:
        """``{'d': 4, 't': 2}``: every mesh axis's size, in mesh order."""
        if not self.is_resolved:
            raise ConfigError(
                f"mesh {self.given()} has a -1 size (the remaining devices), which is known only "
                f"once the devices are: resolve it with seqshard.config.resolve_mesh(cfg, n_devices)."
            )
        return axis_sizes(self.given())

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes().values())

    def describe(self) -> str:
        """``'d=4 x t=2'`` (``'d=-1 x t=2'`` before resolving)."""
        sizes = self.sizes() if self.is_resolved else self.given()
        return describe_sizes(sizes)


MeshConfig = dataclasses.make_dataclass(
    "MeshConfig",
    [
        (axis.name, int, dataclasses.field(default=1, metadata={"doc": axis.meaning}))
        for axis in MESH_AXES
    ],
    bases=(_MeshSizes,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": """The size of each mesh axis, one field per row of the axis table
    (:data:`seqshard.shardlib.axes.MESH_AXES`: p pipeline, d data / FSDP, c context, t tensor);
    an axis left out has size 1. The product of the sizes is the number of devices used. One
    axis may be ``-1``: "the remaining devices" (``{d: -1, t: 8}`` on 64 devices is
    d=8 x t=8), fixed by :meth:`resolved` once the device count is known
    (:func:`resolve_mesh`).""",
    },
)


REMAINING = -1
"""A mesh size that means "the devices the other axes leave"."""


def _path(default: object = None, *, hub: bool | str = False):
    """A field that holds a path, or a list of paths: relative in a config file, it is
    relative to that file (:func:`_rebase_paths`). ``hub``: or a Hugging Face Hub name
    (:func:`seqshard.paths.is_hub_name`); ``'task'``: or a built-in task's name."""
    kind = hub if isinstance(hub, str) else "hub" if hub else "path"
    return dataclasses.field(default=default, metadata={"path": kind})


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: a prepared directory and its weight (normalized per stage)."""

    path: str = _path("???")  # a `seqshard prepare` output directory (required)
    weight: float = 1.0  # its share of the batches (the weights of a stage are normalized)


@dataclasses.dataclass(frozen=True)
class MixtureStage:
    """After ``start_step`` steps, draw from ``mixture``: the stage's first batch is the one
    of the logged step ``start_step + 1``."""

    start_step: int = 0  # the stage starts after this many steps
    mixture: list[MixtureSource] = dataclasses.field(default_factory=list)  # the stage's sources

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixture", tuple(self.mixture))  # hashable, like the rest


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from: ``dir``, prepared on first use if it does not exist, or a
    weighted ``mixture`` of prepared directories (which replaces ``dir``; ``dir`` is then
    ignored), its weights changed at steps by ``stages``
    (:mod:`seqshard.data.mixture`; :func:`seqshard.train.loop.data_mixture` reads them)."""

    dir: str = _path("data/stdlib")  # a `seqshard prepare` output directory
    mixture: list[MixtureSource] = dataclasses.field(default_factory=list)  # prepared
    #   directories drawn from by weight, in place of dir
    stages: list[MixtureStage] = dataclasses.field(default_factory=list)  # mixtures that take
    #   over at later steps
    inputs: tuple[str, ...] = _path(())  # text files/dirs to prepare from; empty: the
    #   Python standard library's source
    vocab_size: int = 4096  # BPE vocab trained when preparing
    tokenizer: str | None = _path(hub=True)  # an existing tokenizer.json to use instead of
    #   training one, or a Hugging Face Hub name (ORG/NAME, e.g. meta-llama/Llama-3.2-1B: no
    #   such path exists), fetched by tokenizers where there is network
    chat_template: str | None = _path()  # for chat 'messages' in inputs: a .jinja file, a
    #   tokenizer_config.json or a model directory (default: the one beside the tokenizer)
    val_fraction: float = 0.01  # share of the documents held out for validation
    seed: int = 0  # document order

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixture", tuple(self.mixture))
        object.__setattr__(self, "stages", tuple(self.stages))


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A ``jax.profiler`` trace of some steps, written to ``RUN_DIR/profile/``
    (:mod:`seqshard.train.profile`; ``scripts/profile_summary.py RUN_DIR`` sums it by op kind)."""

    start_step: int = 10  # the first step traced (the first step of a run compiles: start later)
    steps: int = 0  # steps traced; 0: no profile


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon for the weight matrices with ``train.optimizer=muon`` (:mod:`seqshard.train.muon`):
    momentum orthogonalized by a Newton-Schulz iteration on whole matrices, moved there by
    all_to_alls; the embedding, head, norm gains and router stay on AdamW (``train.beta1`` ...).
    Both share ``train.lr``'s schedule and ``train.weight_decay``."""

    momentum: float = 0.95  # the momentum's decay (an EMA of the gradients, bias-corrected)
    nesterov: bool = True  # orthogonalize momentum * m + (1 - momentum) * g, not m
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)  # (a, b, c) of
    #   the quintic X <- a X + (b A + c A^2) X, A = X X^T (Keller Jordan's)
    scale: Literal["rms", "width"] = "rms"  # rms: the update times rms * sqrt(max(in, out)),
    #   AdamW's RMS (Moonlight), so AdamW's lr and decay carry over; width: sqrt(max(1, out/in))
    rms: float = 0.2  # the update RMS that scale=rms matches
    qk_clip: float = 0.0  # MuonClip (Kimi K2): after each step, a head whose largest attention
    #   logit passed this has its q and k weights scaled so it is back at it; 0: off. Needs
    #   the model's max_logit: true


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimization: AdamW (or Muon for the matrices) with clipping, a warmup + cosine or
    warmup-stable-decay schedule."""

    steps: int = 1000  # optimizer steps in all (the schedule's length; a resumed run with
    #   more steps trains on)
    batch_size: int = 32  # global sequences per step
    seq_len: int = 256  # tokens per sequence
    microbatches: int = 1  # gradient accumulation: batch_size / microbatches per pass; with
    #   mesh.p > 1, the pipeline's microbatches (all in flight in one pass)
    pipeline_schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"  # with mesh.p > 1:
    #   the order of the microbatches' passes through the stages
    pipeline_repeats: int = 1  # circular: layer blocks per stage (virtual stages)
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon for the weight matrices
    #   (train.muon), AdamW for the rest
    muon: MuonConfig = dataclasses.field(default_factory=MuonConfig)  # with optimizer=muon
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup from 0
    schedule: Literal["cosine", "wsd"] = "cosine"  # the decay after warmup: cosine, or
    #   warmup-stable-decay (constant, then linear over decay_fraction)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1  # AdamW's decoupled decay; not applied to norm gains
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this; 0 disables
    seed: int = 0  # of the weight init
    log_every: int = 10  # steps between metrics lines (metrics.jsonl, TensorBoard)
    eval_every: int = 100  # steps between evaluations; 0: only at the end
    eval_batches: int = 8  # validation batches per evaluation
    checkpoint_every: int = 100  # steps between checkpoints; 0: only at the end (and on
    #   SIGTERM / Ctrl-C)
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are deleted
    resume: Literal["latest_good", "strict"] = "latest_good"  # a damaged newest checkpoint:
    #   latest_good skips it (with a warning) for the newest one that verifies; strict stops
    nonfinite: Literal["stop", "skip"] = "stop"  # loss or grad norm not finite, or grad norm 0
    #   applies no update; stop: exit non-zero; skip: go on with the next batch
    max_nonfinite_skips: int = 10  # skip: stop after this many non-finite steps in a row
    eval_on_stop: bool = False  # evaluate before stopping on SIGTERM / Ctrl-C (slower exit)
    peak_flops: float = 0.0  # per device, for MFU; 0: known accelerator peak or measured on CPU
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)  # default off

    @property
    def newton_schulz_steps(self) -> int:
        """Muon's iterations per step on every weight matrix: ``muon.ns_steps`` with
        ``optimizer=muon``, 0 with AdamW (what the FLOPs table and the planner count)."""
        return self.muon.ns_steps if self.optimizer == "muon" else 0

    def pipeline(self) -> Pipeline:
        """How a step with mesh.p > 1 runs its microbatches through the stages."""
        return Pipeline(self.pipeline_schedule, self.microbatches, self.pipeline_repeats)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How the processes of a run start, watch each other and stop, and the XLA flags set for
    the accelerator (``seqshard.launch``). Nothing here changes the math; it may change when a
    run resumes."""

    heartbeat_timeout_s: int = 100  # a process silent this long counts as dead: the others stop
    shutdown_timeout_s: int = 300  # at exit, how long a process waits for the others
    initialization_timeout_s: int = 300  # at start, how long to wait for every process to join
    overlap_collectives: bool = True  # XLA flags that overlap collectives with compute (GPU:
    #   the latency-hiding scheduler; TPU: async collective fusion); flags already in the
    #   environment win


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where a new run's weights come from (a resumed run restores its checkpoint instead).

    from_hf: a Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 directory
    (config.json, model*.safetensors, tokenizer.json):
    its weights, read into the sharded layout (:mod:`seqshard.hf.load`), its model sizes
    (model fields the config leaves to its bases are filled from config.json; those written in
    the file that names from_hf, or in overrides, must agree), and its tokenizer (unless
    data.tokenizer names one). None: random weights (``train.seed``).

    from_run: a seqshard run directory (e.g. ``runs/tiny-cpu``): the weights of its newest good
    checkpoint (not its optimizer state or step), for fine-tuning a run; the model must have
    the same weight shapes, and the data the same tokenizer."""

    from_hf: str | None = _path()
    from_run: str | None = _path()


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One downstream task scored during training (``seqshard.evals``)."""

    path: str = _path("???", hub="task")  # a JSON Lines task file, or a built-in task:
    #   stdlib_next_line (made from data.dir's held-out files)
    examples: int = 0  # its first this many examples; 0: all


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Downstream tasks scored beside the validation loss every ``train.eval_every`` steps
    (``seqshard.evals``): multiple-choice accuracy (plain and length-normalized) or a
    continuation's loss, logged as ``task/<name>/<metric>``; ``seqshard eval RUN_DIR --tasks``
    scores them after."""

    tasks: list[EvalTask] = dataclasses.field(default_factory=list)  # e.g. [{path:
    #   stdlib_next_line, examples: 200}]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where the run writes: ``<dir>/<name>``; the name defaults to the config file's stem."""

    name: str = ""  # one directory name; empty: the config file's stem
    dir: str = _path("runs")  # the directory holding runs
    trackers: tuple[str, ...] = ("tensorboard", "jsonl")  # where the metrics go, of
    #   tensorboard (RUN_DIR/tb), jsonl (RUN_DIR/metrics.jsonl, always: seqshard reads it to
    #   resume and plot) and wandb (Weights & Biases: pip install 'seqshard[wandb]'; WANDB_MODE,
    #   WANDB_PROJECT from the environment)


TRACKERS = ("tensorboard", "jsonl", "wandb")
"""The choices of ``run.trackers`` (:mod:`seqshard.train.trackers` has a class for each)."""


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    init: InitConfig = dataclasses.field(default_factory=InitConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


FromHF = Callable[[Config, frozenset[str]], Config]
"""``(cfg, written) -> cfg`` with the model sizes and tokenizer of the Hugging Face directory
``cfg.init.from_hf``: the model fields in ``written`` (``'d_ff'``, MoEConfig's as
``'moe.top_k'``: those the layer naming from_hf or a later one writes) must agree with its
config.json, the others are filled (``seqshard.cli.with_hf_model``, which reads it with
seqshard.hf.hf_config; this module does not import seqshard.hf)."""


def _safe_load(text: str, where: str):
    """``yaml.safe_load(text)``, refusing a key written twice in one mapping (YAML would keep
    the last silently: two ``train:`` sections train on the second alone)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: malformed YAML: {e}. Fix the file's syntax.") from None
    todo = [(root, "")]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, yaml.SequenceNode):
            todo += [(item, f"{prefix}[{i}]") for i, item in enumerate(node.value)]
        if not isinstance(node, yaml.MappingNode):
            continue
        first_line: dict[str, int] = {}
        for key, value in node.value:
            name = f"{prefix}.{key.value}" if prefix else str(key.value)
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode) and name in first_line:
                raise ConfigError(
                    f"{where}: key {name!r} appears twice, on lines {first_line[name]} and "
                    f"{line}; YAML would keep only the second. Merge the two into one."
                )
            first_line[name] = line
            todo.append((value, name))
    return yaml.safe_load(text)


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> list[tuple[str, dict]]:
    """The layers of ``path`` (its bases first) as (description, mapping) pairs."""
    if path in chain:
        raise ConfigError(f"{path}: 'base' chain loops: {' -> '.join(map(str, (*chain, path)))}.")
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory. Pass a YAML file such as configs/tiny-cpu.yaml."
        )
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist. Pass a YAML file such as configs/tiny-cpu.yaml."
        )
    data = _safe_load(path.read_text(), str(path))
    if data is None:
        raise ConfigError(
            f"config file {path} is empty: it would run seqshard's built-in defaults, which is "
            f"rarely what was meant. Write the sections to change, or `base: base.yaml` to use "
            f"the defaults on purpose."
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections (model, mesh, train, ...), got {type(data).__name__}."
        )
    layers = []
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file name, got {base!r}.")
        layers = _read_yaml((path.parent / base).resolve(), (*chain, path))
    return [*layers, (str(path), data)]


def _rebase_paths(layer: dict, cls: type, base: Path) -> dict:
    """``layer`` (one file's keys for ``cls``, a section or an item of a list) with each relative
    path in a path field (:func:`_path`) made relative to ``base``; a Hub name in a field that
    may hold one stays. Unknown keys and wrong types are left for the merge to name."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = dict(layer)
    for key, value in layer.items():
        if key not in fields:
            continue
        kind = fields[key].metadata.get("path")
        hint = hints[key]
        if kind is not None:
            out[key] = _rebase_value(value, base, kind)
        elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
            out[key] = _rebase_paths(value, hint, base)
        elif typing.get_origin(hint) in (list, tuple) and isinstance(value, (list, tuple)):
            item = typing.get_args(hint)[0]
            if dataclasses.is_dataclass(item):
                out[key] = [
                    _rebase_paths(v, item, base) if isinstance(v, dict) else v for v in value
                ]
    return out


def _rebase_value(value, base: Path, kind: str):
    if isinstance(value, (list, tuple)):
        return type(value)(_rebase_value(v, base, kind) for v in value)
    if not isinstance(value, str) or (kind == "hub" and is_hub_name(value, base)):
        return value
    if kind == "task" and value in BUILTIN_TASKS:  # a built-in task's name, not a file
        return value
    return rebase(value, base)


def _absolute_paths(obj, here: Path):
    """The dataclass ``obj`` (a Config, a section, a mixture source) with every relative path
    left after the files were read (an override's, a default's) made relative to ``here``,
    the working directory."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if "path" in f.metadata:
            changes[f.name] = _rebase_value(value, here, f.metadata["path"])
        elif dataclasses.is_dataclass(value):
            changes[f.name] = _absolute_paths(value, here)
        elif isinstance(value, tuple) and any(dataclasses.is_dataclass(v) for v in value):
            changes[f.name] = tuple(_absolute_paths(v, here) for v in value)
    return dataclasses.replace(obj, **changes)


def _merge(schema, layer, where: str):
    try:
        return OmegaConf.merge(schema, layer)
    except (OmegaConfBaseException, TypeError) as e:  # TypeError: a list against a mapping
        key = getattr(e, "full_key", None)
        problem = str(e).splitlines()[0]
        plain = OmegaConf.to_container(layer) if OmegaConf.is_config(layer) else layer
        shape = _container_mismatch(plain, Config) if isinstance(plain, dict) else None
        if shape is not None:  # omegaconf's "Cannot merge incompatible container types"
            raise ConfigError(f"{where}: {shape}") from None
        raise ConfigError(f"{where}: {problem}" + (f" (key: {key})" if key else "")) from None


def _container_mismatch(layer: dict, cls: type, prefix: str = "") -> str | None:
    """Where ``layer`` writes a mapping for a list field of ``cls`` or a list for a section:
    the key, what it expects (an example item) and what it got; None if nowhere."""
    hints = typing.get_type_hints(cls)
    for key, value in layer.items():
        hint = hints.get(key)
        if hint is None:
            continue  # an unknown key: omegaconf names it with a close match
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(hint):
            if isinstance(value, dict):
                found = _container_mismatch(value, hint, f"{name}.")
                if found is not None:
                    return found
            elif isinstance(value, list):
                fields = ", ".join(f.name for f in dataclasses.fields(hint))
                return f"{name} must be a mapping of {{{fields}}}, got a list {value!r}."
        elif typing.get_origin(hint) in (list, tuple) and isinstance(value, dict):
            (item,) = typing.get_args(hint)[:1]
            example = (
                "{" + ", ".join(f"{f.name}: ..." for f in dataclasses.fields(item)) + "}"
                if dataclasses.is_dataclass(item)
                else getattr(item, "__name__", str(item))
            )
            return (
                f"{name} must be a list, each item {example}, got a mapping {value!r}. Write "
                f"it as a YAML list: one '- ' line per item (or [{example}, ...])."
            )
    return None


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    saved: bool = False,
    from_hf: FromHF | None = None,
) -> Config:
    """Load ``path`` (and its ``base`` chain) and apply ``key=value`` overrides, then check it.

    Every path comes out absolute: a file's relative to that file, an override's or a
    default's relative to the working directory (see the module docstring).

    ``saved``: ``path`` is a run's own ``config.yaml``, which writes every key, a mixture
    run's ignored ``data.dir`` included (not an error there, as it is in a user's file); its
    paths and the overrides' are taken as written.

    ``from_hf`` reads the model sizes and tokenizer of ``init.from_hf`` (required when it is
    set: ``seqshard.cli.with_hf_model``) before the cross-field checks, which need them."""
    merged = OmegaConf.structured(Config)
    layers: list[dict] = []  # each YAML file's and override's keys, bases first
    if path is not None:
        for where, data in _read_yaml(Path(path).resolve(), ()):
            if not saved:  # a saved config.yaml is read as written (see the module docstring)
                data = _rebase_paths(data, Config, Path(where).parent)
            merged = _merge(merged, data, where)
            layers.append(data)
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not key=value (e.g. train.steps=100).")
        try:
            layer = OmegaConf.from_dotlist([override])
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {override!r}: {e}") from None
        merged = _merge(merged, layer, f"override {override!r}")
        layers.append(OmegaConf.to_container(layer))
    try:
        cfg = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"{path or 'config'}: {str(e).splitlines()[0]}") from None
    if not saved:  # a saved config.yaml is read as written, with its overrides
        cfg = _absolute_paths(cfg, Path.cwd())
        _check_data_dir_beside_mixture(cfg, layers, path)
    if not cfg.run.name and path is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=Path(path).stem))
    if cfg.init.from_hf:
        cfg = _fill_from_hf(cfg, layers, from_hf)
    check_config(cfg)
    return cfg


def override_key(override: str) -> str:
    """The dotted key of a ``key=value`` override: ``'train.steps'`` of ``'train.steps=5'``."""
    return override.split("=", 1)[0].strip()


def check_overrides_once(overrides: Sequence[str]) -> None:
    """ConfigError if a command line gives one key twice (``train.steps=5 train.steps=600``):
    an error, as a key written twice in a YAML file is. (:func:`load_config` itself lets a
    later override win, which is how code layers its own over a user's.)"""
    given: dict[str, str] = {}
    for override in overrides:
        key = override_key(override)
        if key in given:
            raise ConfigError(
                f"override {key} is given twice ({given[key]!r}, then {override!r}): a key "
                f"written twice is an error, on the command line as in a YAML file. Keep the "
                f"one you mean."
            )
        given[key] = override


def _check_data_dir_beside_mixture(cfg: Config, layers: Sequence[dict], path) -> None:
    """A mixture run reads its sources, not ``data.dir``: a data.dir written where the mixture
    is or after it (a later file, an override) would be ignored, so it is an error. One
    inherited from a file the mixture's file is based on (base.yaml's default) is not."""
    if not (cfg.data.mixture or cfg.data.stages):
        return

    def writes(layer: dict, keys: tuple[str, ...]) -> bool:
        data = layer.get("data")
        return isinstance(data, dict) and any(data.get(k) not in (None, [], ()) for k in keys)

    sets_dir = [i for i, layer in enumerate(layers) if writes(layer, ("dir",))]
    sets_mixture = [i for i, layer in enumerate(layers) if writes(layer, ("mixture", "stages"))]
    if sets_dir and sets_mixture and sets_dir[-1] >= sets_mixture[-1]:
        raise ConfigError(
            f"{path or 'config'}: data.dir={cfg.data.dir} is set beside data.mixture (or "
            f"data.stages), where it would be ignored: a mixture run reads its sources and "
            f"nothing else. Drop data.dir, or drop data.mixture and data.stages "
            f"(data.mixture=[] data.stages=[]) to train on data.dir alone."
        )


def _fill_from_hf(cfg: Config, layers: Sequence[dict], from_hf: FromHF | None) -> Config:
    """``cfg`` with the model sizes and tokenizer of its ``init.from_hf`` directory, read by
    ``from_hf``: model fields set by the layer naming from_hf or a later one must agree;
    inherited ones are filled."""
    if from_hf is None:
        raise ConfigError(
            f"init.from_hf={cfg.init.from_hf}: load_config() does not read Hugging Face "
            f"directories itself; pass from_hf=seqshard.cli.with_hf_model (which reads them with "
            f"seqshard.hf.hf_config.read_hf_config), or run `seqshard train CONFIG`."
        )
    names_it = max(i for i, d in enumerate(layers) if (d.get("init") or {}).get("from_hf"))
    # Model fields written there or later, MoEConfig's as 'moe.top_k'.
    written: set[str] = set()
    for d in layers[names_it:]:
        for k, value in (d.get("model") or {}).items():
            written |= {f"{k}.{sub}" for sub in value} if isinstance(value, dict) else {k}
    return from_hf(cfg, frozenset(written))


def check_config(cfg: Config) -> None:
    """Cross-field checks, with the values in the message. Raises ConfigError."""
    _check_mesh(cfg)
    _check_counts(cfg.train)
    _check_batch(cfg)
    _check_pipeline(cfg)
    _check_schedule(cfg.train)
    _check_cadence(cfg.train)
    _check_optimizer(cfg.train)
    _check_muon(cfg)
    _check_qk_clip(cfg)
    _check_eval(cfg)
    check_run_name(cfg.run.name)
    _check_trackers(cfg.run.trackers)
    _check_profile(cfg.train)
    _check_runtime(cfg.runtime)
    _check_data(cfg)


def _check_mesh(cfg: Config) -> None:
    """The mesh sizes, and (once the mesh is resolved) the model's splits over it."""
    mesh = cfg.mesh
    _check_mesh_sizes(mesh)
    if mesh.is_resolved:  # else resolve_mesh checks these once the device count is known
        try:
            check_mesh(cfg.model, mesh.sizes())
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_mesh_sizes(mesh: MeshConfig) -> None:
    given = mesh.given()
    bad = {a: n for a, n in given.items() if n != REMAINING and n < 1}
    if bad:
        raise ConfigError(
            f"mesh sizes must be >= 1, or -1 for the remaining devices; got "
            f"{', '.join(f'mesh.{a}={n}' for a, n in bad.items())}."
        )
    free = [a for a, n in given.items() if n == REMAINING]
    if len(free) > 1:
        raise ConfigError(
            f"at most one mesh axis may be -1 (the remaining devices), got "
            f"{', '.join(f'mesh.{a}=-1' for a in free)}. Give all sizes but one."
        )


def _check_counts(train: TrainConfig) -> None:
    """The train keys that count something (steps, sequences, batches) are positive."""
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "microbatches",
        "log_every",
        "eval_batches",
        "keep_checkpoints",
    ):
        if getattr(train, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(train, name)}.")


def _check_batch(cfg: Config) -> None:
    """The batch split into microbatches, and (once the mesh is resolved) the batch and the
    sequence split over the mesh."""
    mesh, train = cfg.mesh, cfg.train
    if train.seq_len < 2:
        raise ConfigError(
            f"train.seq_len must be >= 2 (a next-token target needs two tokens), got {train.seq_len}."
        )
    if train.batch_size % train.microbatches:
        raise ConfigError(
            f"train.batch_size={train.batch_size} is not divisible by train.microbatches={train.microbatches}. "
            f"Choose a batch size that is a multiple of the microbatch count."
        )
    micro = train.batch_size // train.microbatches
    rows = mesh.d * mesh.e if mesh.is_resolved else 1  # the batch is split over d and e
    if micro % rows:
        if mesh.e > 1:
            axes, product = f"mesh.d x mesh.e = {mesh.d} x {mesh.e} = {rows}", "mesh.d * mesh.e"
        else:
            axes, product = f"mesh axis d={mesh.d}", "mesh.d"
        raise ConfigError(
            f"each microbatch has train.batch_size / train.microbatches = {train.batch_size} / "
            f"{train.microbatches} = {micro} sequences, which {axes} does not divide (the "
            f"batch is split over d and e). Choose train.batch_size divisible by {product} * "
            f"train.microbatches = {rows * train.microbatches}."
        )
    if mesh.is_resolved and mesh.c > 1 and train.seq_len % (2 * mesh.c):
        raise ConfigError(
            f"mesh.c={mesh.c} splits the sequence over c in zigzag order (2c = {2 * mesh.c} "
            f"chunks, shard i holding chunks i and 2c-1-i), but train.seq_len={train.seq_len} "
            f"is not divisible by {2 * mesh.c}. Choose train.seq_len divisible by {2 * mesh.c}."
        )
    if mesh.is_resolved and cfg.model.residual == "L/t" and train.seq_len % (mesh.c * mesh.t):
        raise ConfigError(
            f"model.residual=L/t splits the sequence over t (within each c shard), but "
            f"train.seq_len={train.seq_len} is not divisible by mesh.c x mesh.t = "
            f"{mesh.c * mesh.t}. Choose train.seq_len divisible by {mesh.c * mesh.t}, or "
            f"model.residual=M/t."
        )


def _check_pipeline(cfg: Config) -> None:
    """The pipeline's keys against each other, the mesh and the model."""
    mesh, train = cfg.mesh, cfg.train
    p = mesh.p if mesh.is_resolved else max(mesh.p, 1)
    try:
        make_schedule(train.pipeline_schedule, p, train.microbatches, train.pipeline_repeats)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if p == 1:
        return
    blocks = p * train.pipeline_repeats
    if cfg.model.n_layers % blocks:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} does not split into mesh.p x "
            f"train.pipeline_repeats = {p} x {train.pipeline_repeats} = {blocks} equal layer "
            f"blocks. Choose n_layers divisible by {blocks}, or other mesh.p / pipeline_repeats."
        )


def _check_schedule(train: TrainConfig) -> None:
    """The learning-rate schedule's shape and the size of an update (lr, clipping, decay)."""
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {train.warmup_steps}.")
    if not 0 <= train.min_lr_ratio <= 1 or not 0 < train.decay_fraction <= 1:
        raise ConfigError(
            f"train.min_lr_ratio must be in [0, 1] and train.decay_fraction in (0, 1]; got "
            f"{train.min_lr_ratio} and {train.decay_fraction}."
        )
    if train.lr <= 0 or train.grad_clip < 0 or train.weight_decay < 0:
        raise ConfigError(
            f"train.lr must be > 0 and train.grad_clip, train.weight_decay >= 0; got lr={train.lr}, "
            f"grad_clip={train.grad_clip}, weight_decay={train.weight_decay}."
        )


def _check_cadence(train: TrainConfig) -> None:
    """How often the run evaluates and checkpoints, and how many bad steps it skips."""
    for name in ("eval_every", "checkpoint_every"):
        if getattr(train, name) < 0:
            raise ConfigError(
                f"train.{name} must be >= 0 (0: only at the end), got {getattr(train, name)}."
            )
    if train.max_nonfinite_skips < 1:
        raise ConfigError(
            f"train.max_nonfinite_skips must be >= 1, got {train.max_nonfinite_skips}."
        )


def _check_optimizer(train: TrainConfig) -> None:
    """The float keys are finite, and AdamW's moment decays and epsilon are in range."""
    for name in (
        "lr",
        "min_lr_ratio",
        "decay_fraction",
        "weight_decay",
        "beta1",
        "beta2",
        "eps",
        "grad_clip",
        "peak_flops",
    ):
        if not math.isfinite(getattr(train, name)):
            raise ConfigError(f"train.{name} must be a finite number, got {getattr(train, name)}.")
    if not 0 <= train.beta1 < 1 or not 0 <= train.beta2 < 1 or train.eps <= 0:
        raise ConfigError(
            f"train.beta1 and train.beta2 must be in [0, 1) and train.eps > 0; got "
            f"{train.beta1}, {train.beta2}, {train.eps}."
        )


def _check_muon(cfg: Config) -> None:
    """``train.muon``'s keys are in range (read with ``train.optimizer=muon`` only)."""
    muon = cfg.train.muon
    numbers = {"momentum": muon.momentum, "rms": muon.rms, "qk_clip": muon.qk_clip}
    numbers.update({f"ns_coefficients[{i}]": c for i, c in enumerate(muon.ns_coefficients)})
    for name, value in numbers.items():
        if not math.isfinite(value):
            raise ConfigError(f"train.muon.{name} must be a finite number, got {value}.")
    if not 0 <= muon.momentum < 1 or muon.ns_steps < 1 or muon.rms <= 0 or muon.qk_clip < 0:
        raise ConfigError(
            f"train.muon: momentum must be in [0, 1), ns_steps >= 1, rms > 0 and qk_clip >= 0 "
            f"(0: off); got momentum={muon.momentum}, ns_steps={muon.ns_steps}, rms={muon.rms}, "
            f"qk_clip={muon.qk_clip}."
        )


def _check_qk_clip(cfg: Config) -> None:
    """``train.muon.qk_clip`` clips Muon's attention heads by the logits the model reports."""
    train, model = cfg.train, cfg.model
    if not train.muon.qk_clip:
        return
    if train.optimizer != "muon":
        raise ConfigError(
            f"train.muon.qk_clip={train.muon.qk_clip} is MuonClip, Muon's query-key clipping: "
            f"set train.optimizer=muon, or train.muon.qk_clip=0."
        )
    if not model.max_logit or model.qk_norm or model.attention != "gqa":
        raise ConfigError(
            f"train.muon.qk_clip={train.muon.qk_clip} scales the q and k weights of each "
            f"grouped-query head whose largest logit passed it, which needs the heads' logits "
            f"reported (model.max_logit=true, got {model.max_logit}) and logits linear in those "
            f"weights (model.qk_norm=false, got {model.qk_norm}; model.attention=gqa, got "
            f"{model.attention}: MLA's clipping is not built). Set those, or train.muon.qk_clip=0."
        )


def _check_eval(cfg: Config) -> None:
    """Each of ``eval.tasks`` names a task and a count of examples >= 0."""
    for i, task in enumerate(cfg.eval.tasks):
        if task.examples < 0:
            raise ConfigError(
                f"eval.tasks[{i}].examples must be >= 0 (0: all of {task.path}), got "
                f"{task.examples}."
            )


def _check_trackers(trackers: Sequence[str]) -> None:
    """Each of ``run.trackers`` is a tracker, once; jsonl is one of them."""
    unknown = [t for t in trackers if t not in TRACKERS]
    if unknown:
        raise ConfigError(
            f"run.trackers={list(trackers)}: {', '.join(map(repr, unknown))} is not a tracker; "
            f"choose from {', '.join(TRACKERS)}."
        )
    if len(set(trackers)) != len(trackers):
        raise ConfigError(f"run.trackers={list(trackers)} names a tracker twice; name each once.")
    if "jsonl" not in trackers:
        raise ConfigError(
            f"run.trackers={list(trackers)} leaves out jsonl, which every run writes: seqshard "
            f"reads metrics.jsonl to resume (it truncates the crashed tail), to plot, and to "
            f"know a run directory's work. Add it: run.trackers=[{', '.join([*trackers, 'jsonl'])}]."
        )


def _check_profile(train: TrainConfig) -> None:
    """``train.profile`` traces steps the run has."""
    profile = train.profile
    if profile.steps < 0 or profile.start_step < 1:
        raise ConfigError(
            f"train.profile needs start_step >= 1 and steps >= 0 (0: no profile); got "
            f"start_step={profile.start_step}, steps={profile.steps}."
        )
    last = profile.start_step + profile.steps - 1
    if profile.steps and last > train.steps:
        raise ConfigError(
            f"train.profile traces steps {profile.start_step}-{last}, past train.steps="
            f"{train.steps}. Set train.profile.start_step <= {max(1, train.steps - profile.steps + 1)} "
            f"or fewer train.profile.steps."
        )


def _check_runtime(runtime: RuntimeConfig) -> None:
    """The timeouts between the processes of a run."""
    for name in ("heartbeat_timeout_s", "shutdown_timeout_s", "initialization_timeout_s"):
        if getattr(runtime, name) < 1:
            raise ConfigError(f"runtime.{name} must be >= 1 second, got {getattr(runtime, name)}.")


def _check_data(cfg: Config) -> None:
    """The data keys, and the tokenizer to train against the model's vocabulary."""
    data = cfg.data
    if cfg.init.from_hf and cfg.init.from_run:
        raise ConfigError(
            f"init.from_hf={cfg.init.from_hf} and init.from_run={cfg.init.from_run} both say "
            f"where the weights come from; set one."
        )
    if not 0 < data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {data.val_fraction}.")
    if data.tokenizer is None and data.vocab_size > cfg.model.vocab:
        raise ConfigError(
            f"data.vocab_size={data.vocab_size} (the tokenizer's) exceeds model.vocab="
            f"{cfg.model.vocab}: token ids would fall outside the embedding. Set model.vocab >= "
            f"{data.vocab_size}."
        )


def resolve_mesh(cfg: Config, n_devices: int) -> Config:
    """``cfg`` on ``n_devices`` devices: a ``mesh`` size of -1 becomes the remaining devices,
    and the checks that need the mesh (model splits, batch over d) run. Raises ConfigError."""
    if cfg.mesh.is_resolved:
        return cfg
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.resolved(n_devices))
    check_config(cfg)
    return cfg


_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")


def check_run_name(name: str) -> None:
    """``run.name`` is one path component, so the run directory lies inside ``run.dir``."""
    if name and (not _RUN_NAME.fullmatch(name) or name in (".", "..")):
        raise ConfigError(
            f"run.name={name!r} is not allowed: it names one directory inside run.dir, so it may "
            f"hold only letters, digits, '.', '_' and '-' (no '/', no '..', not absolute). "
            f"Put the path in run.dir instead, e.g. run.dir=experiments run.name=tiny."
        )


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML; ``load_config`` of it gives back an equal Config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml(text: str, where: str) -> Config:
    """A config saved by :func:`config_to_yaml` (a run's ``config.yaml``, a checkpoint's
    metadata), parsed into a Config as it was saved: field checks, no cross-field checks.
    ``where`` names the source in errors."""
    data = _safe_load(text, where)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: expected a saved seqshard config (a mapping), got {data!r:.80}."
        )
    merged = _merge(OmegaConf.structured(Config), data, where)
    try:
        return OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run was started with: ``RUN_DIR/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: {run_dir} is not a run directory. Pass the directory "
            f"`seqshard train` printed (e.g. runs/tiny-cpu)."
        )
    return config_from_yaml(path.read_text(), str(path))


def config_changes(old: Config, new: Config) -> dict[str, tuple[object, object]]:
    """``{'train.steps': (300, 600), ...}``: every dotted key whose value differs. Paths are
    compared resolved, a relative one against the working directory (what it meant in a
    config saved before paths were relative to their file), so ``data.dir: data/stdlib`` saved
    then equals ``/repo/data/stdlib`` loaded from ``/repo`` now."""
    here = Path.cwd()
    before, after = (
        _flatten(_rebase_paths(dataclasses.asdict(cfg), Config, here)) for cfg in (old, new)
    )
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# -- the reference of every key (`seqshard config`, docs/config.md) ----------------------------


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of the config, as ``seqshard config`` lists it."""

    key: str  # dotted: 'train.steps', 'model.moe.top_k', 'data.mixture[].path'
    section: str  # the class it is listed under: 'train', 'model.moe', 'data'
    type: str  # 'int', 'cosine | wsd', 'path | null', 'list of {path, weight}'
    default: str  # as YAML writes it
    meaning: str


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))
"""The sections of a config file, in order: model, mesh, data, train, run, runtime, init."""


def config_keys(section: str | None = None) -> tuple[ConfigKey, ...]:
    """Every key of the config (or those under ``section``: ``train``, ``model.moe``), read from
    the dataclasses: the type and default of each field, and its meaning from the source (the
    ``#`` comment beside the field and the comment lines under it; else the field's
    ``name: ...`` entry in its class's docstring; the mesh axes' from the axis table).
    ConfigError for an unknown section."""
    keys = tuple(_keys_of(Config, "", "", set()))
    if section is None:
        return keys
    found = tuple(k for k in keys if k.key.startswith(f"{section}.") or k.key == section)
    if not found:
        raise ConfigError(
            f"no config section {section!r}; the sections are {', '.join(SECTIONS)} (or a part "
            f"of one, e.g. model.moe)."
        )
    return found


def _keys_of(cls: type, prefix: str, section: str, seen: set[type]):
    hints = typing.get_type_hints(cls)
    meanings = _field_meanings(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):  # a section, or model.moe
            yield from _keys_of(hint, f"{key}.", key, seen)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        type_text = _type_text(hint, f.metadata.get("path"))
        yield ConfigKey(key, section, type_text, _yaml_text(default), meanings.get(f.name, ""))
        item = typing.get_args(hint)[0] if typing.get_origin(hint) in (list, tuple) else None
        if dataclasses.is_dataclass(item) and item not in seen:  # each item's keys, once
            seen.add(item)
            yield from _keys_of(item, f"{key}[].", section, seen)


def _type_text(hint, kind: str | None) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [_type_text(a, kind) for a in args if a is not type(None)]
        return " | ".join(named) + (" | null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_text(args[0], kind)}"
    if dataclasses.is_dataclass(hint):
        return "{" + ", ".join(f.name for f in dataclasses.fields(hint)) + "}"
    if kind is not None and hint is str:
        return "path or Hub name" if kind == "hub" else "path"
    return getattr(hint, "__name__", str(hint))


def _yaml_text(value) -> str:
    if value == "???":
        return "(required)"
    if isinstance(value, (list, tuple)) and not value:
        return "[]"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _field_meanings(cls: type) -> dict[str, str]:
    """{field: meaning} of ``cls``: see :func:`config_keys`."""
    names = [f.name for f in dataclasses.fields(cls)]
    found = {f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made by dataclasses.make_dataclass (MeshConfig): no source
        source = ""
    if source:
        lines = source.splitlines()
        comments = {
            token.start[0]: token.string.lstrip("#").strip()
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT
        }
        for node in ast.parse(source).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            line = node.end_lineno + 1  # the comment lines under the field continue its comment
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                line += 1
            text = [comments[i] for i in range(node.lineno, line) if i in comments]
            if text and node.target.id not in found:
                found[node.target.id] = " ".join(text)
    entry = None  # the docstring's 'name: ...' paragraphs, up to a blank line or the next one
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        start = re.match(r"(\w+): ", line)
        if start and start.group(1) in names:
            entry = start.group(1)
            if entry not in found:
                found[entry] = line[start.end() :]
            else:
                entry = None  # the comment beside the field wins
        elif not line.strip():
            entry = None
        elif entry is not None:
            found[entry] += " " + line.strip()
    return {name: _plain(text) for name, text in found.items()}


def _plain(text: str) -> str:
    """Docstring markup as Markdown: ``x`` and :func:`x` -> `x`; runs of spaces -> one."""
    text = re.sub(r":\w+:`~?", "`", text).replace("``", "`")
    return " ".join(text.split())


def config_reference(section: str | None = None, *, markdown: bool = False) -> str:
    """The reference of :func:`config_keys` as text for a terminal, or as Markdown
    (docs/config.md: ``seqshard config --markdown``)."""
    keys = config_keys(section)
    out = []
    if markdown:
        out += [
            "# Config keys",
            "",
            "Generated from the dataclasses of `seqshard/config.py` and "
            "`seqshard/model/config.py` by `seqshard config --markdown > docs/config.md` "
            "(tests/test_config.py checks it is current). A `path` is relative to the config "
            "file that names it; in a dotted override, to the working directory. The same "
            "list in a terminal: `seqshard config [SECTION]`.",
        ]
    by_section: dict[str, list[ConfigKey]] = {}  # a section's own keys before its parts'
    for k in keys:
        by_section.setdefault(k.section, []).append(k)
    for section, section_keys in by_section.items():
        about = _plain(_section_doc(section))
        if markdown:
            out += ["", f"## {section}", "", about, "", "| key | type | default | meaning |"]
            out += ["|---|---|---|---|"]
        else:
            out += ["", f"[{section}]", textwrap.fill(about, 96)]
        for k in section_keys:
            if markdown:
                cells = (f"`{k.key}`", k.type, f"`{k.default}`", k.meaning)
                out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
            else:
                out.append(f"  {k.key}: {k.type} = {k.default}")
                indent = " " * 6
                out.append(
                    textwrap.fill(k.meaning, 96, initial_indent=indent, subsequent_indent=indent)
                )
    return "\n".join(out).lstrip("\n") + "\n"


def _section_doc(section: str) -> str:
    """The first paragraph of the docstring of the class behind ``section`` (``model.moe``)."""
    cls = Config
    for name in section.split("."):
        cls = typing.get_type_hints(cls)[name]
    return inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
