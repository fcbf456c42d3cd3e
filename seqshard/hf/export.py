"""Write a model's weights as a Hugging Face model directory that transformers loads: a
Llama, or a Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 (``seqshard.hf.hf_config.architecture_of``:
the attention kind, qk_norm and experts decide).

    seqshard export runs/tiny-cpu hf/tiny-cpu            # the newest good checkpoint
    seqshard export runs/tiny-cpu hf/tiny-cpu --step 200 --dtype bfloat16

writes::

    config.json                        LlamaForCausalLM (...), untied, rope_theta, torch_dtype, ...
    generation_config.json             eos (and bos) token ids
    model.safetensors                  or model-0000k-of-0000n.safetensors + the index,
    model.safetensors.index.json         files of at most --max-file-size bytes
    tokenizer.json                     the tokenizer the run trained on
    tokenizer_config.json, special_tokens_map.json   what transformers.AutoTokenizer reads, with
                                       the chat template of a chat-tuned run (apply_chat_template)

This module knows weights, not runs: it imports neither seqshard.config nor seqshard.train.
The CLI wires a run to it (``seqshard.cli.export_checkpoint``): it builds the
:class:`ExportConfig` from the run's config (``seqshard.cli.export_config``: the model, the
tokenizer of ``data.dir``, the chat template its data was rendered with,
:func:`max_position` of ``train.seq_len``), calls
:meth:`ExportConfig.check` before restoring a possibly huge checkpoint, restores it, puts the
layers in the model's order and calls :func:`export_run`::

    export = ExportConfig(Path("hf/x"), cfg.model, Path("data/tokenizer.json"), 2048)
    export.check()                                  # OUT_DIR, tokenizer, free space
    export_run(weights, export, source="runs/x step 6")

One tensor at a time: each Hugging Face tensor is cut from its sharded seqshard weight (one
layer, one part), gathered to the host (every process takes part; process 0 writes), turned to
Hugging Face's layout (:mod:`seqshard.hf.table`), written and dropped. The directory is built
beside ``OUT_DIR`` and renamed into place when complete, so a failed export (a full disk, a
kill) leaves no half-written model where a finished one is expected.

A model with ``moe.balance=bias`` has a trained ``router_bias``, which shifts which experts each
token picks. DeepSeek-V3 holds it (``mlp.gate.e_score_correction_bias``). Neither Mixtral nor
Qwen3-MoE has one, and it cannot be folded into the router (it moves the choice, not the
gates), so their export of a nonzero bias is refused (it would load and run, choosing other
experts: wrong without a sign). Zero is exported as nothing.

A DeepSeek-V3 export holds ``model.mtp``'s multi-token prediction modules as DeepSeek's
checkpoints do (``num_nextn_predict_layers: depth``; module k as ``model.layers.{n_layers + k}.*``
with copies of the embedding and ``lm_head``: :mod:`seqshard.hf.table`); transformers' model runs
none and ignores those tensors (its load report lists them as unexpected). The other
architectures have no such module: a model with them and grouped-query attention is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqshard.data.sft import ChatTemplate
from seqshard.data.tokenizer import EOT, eot_id, load_tokenizer
from seqshard.hf.hf_config import CONFIG_FILE, DEEPSEEK_V3, architecture_of, hf_config_dict
from seqshard.hf.safetensors_io import (
    DTYPES,
    SINGLE_FILE,
    plan_files,
    write_index,
    write_safetensors,
)
from seqshard.hf.table import TensorRow, hf_tensor_names
from seqshard.launch import barrier, is_main_process
from seqshard.model.config import ModelConfig
from seqshard.model.weights import Weights
from seqshard.shardlib.tables import format_bytes

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "ExportConfig",
    "ExportResult",
    "export_run",
    "export_weights",
    "max_position",
]

DEFAULT_MAX_FILE_BYTES = 2 * 2**30
"""Safetensors files are split above this size (2 GiB)."""


def max_position(model: ModelConfig, seq_len: int) -> int:
    """The ``max_position_embeddings`` an export declares: the sequence length trained on, or
    llama3 or yarn rope's ``original_max_position * factor`` where that is longer (the length
    its rescaled frequencies were made for)."""
    if model.rope_type in ("llama3", "yarn"):
        return max(seq_len, int(model.rope_original_max_position * model.rope_factor))
    return seq_len


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What :func:`export_run` writes and where: ``model``'s weights in ``out_dir`` as
    ``dtype``, in safetensors files of at most ``max_file_bytes``, with the ``tokenizer``
    (a tokenizer.json, copied) and ``max_position`` (see :func:`max_position`) in its configs.
    ``chat_template``: written into tokenizer_config.json, where transformers'
    ``apply_chat_template`` reads it. ``overwrite``: replace a non-empty ``out_dir`` once the
    export is complete."""

    out_dir: Path
    model: ModelConfig
    tokenizer: Path
    max_position: int
    dtype: str = "float32"
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    overwrite: bool = False
    chat_template: ChatTemplate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))  # a str is welcome too
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if self.max_file_bytes <= 0:
            raise ValueError(
                f"--max-file-size must be a positive number of bytes, got {self.max_file_bytes}."
            )
        if self.max_position <= 0:
            raise ValueError(
                f"max_position must be positive (the longest sequence the model takes), got "
                f"{self.max_position}: use max_position(model, seq_len)."
            )
        architecture_of(self.model)  # a model no Hugging Face architecture computes: refused

    def check(self) -> None:
        """Raise, before anything is gathered or restored, if the export cannot be written:
        ``out_dir`` a file or a non-empty directory (without ``overwrite``), the tokenizer
        unreadable, the chat template rendering other text with the exported tokenizer's
        special tokens, or (process 0) too little free space for the weights."""
        _check_out_dir(self.out_dir, self.overwrite)
        tokenizer = load_tokenizer(self.tokenizer)
        if self.chat_template is not None:
            _check_chat_template(self.chat_template, eot_id(tokenizer) is not None)
        if is_main_process():
            _check_free_space(self.out_dir, self.model, self.dtype)


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    files: list[str]  # the safetensors files written
    tensor_bytes: int


def export_run(
    weights: Weights,
    export: ExportConfig,
    *,
    source: str = "",
    log: Callable[[str], None] = print,
) -> ExportResult:
    """Write ``weights`` (of ``export.model``, its layers in the model's order, sharded on any
    mesh; every process calls this) to ``export.out_dir`` as its Hugging Face model, with its
    configs and tokenizer. Logs one line, naming ``source`` (e.g. ``"runs/x step 6"``)."""
    export.check()
    out_dir, dtype = export.out_dir, export.dtype
    tokenizer = load_tokenizer(export.tokenizer)
    partial = out_dir.parent / f".{out_dir.name}.partial"
    main = is_main_process()
    if main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    try:
        files, total = export_weights(weights, export.model, partial, dtype, export.max_file_bytes)
        if main:
            _write_configs(partial, export, tokenizer)
            _move_into_place(partial, out_dir)
    except OSError as e:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        need = format_bytes(_weight_bytes(export.model, dtype))
        raise OSError(
            f"writing the export in {partial} failed: {e}. Nothing was left there and "
            f"{out_dir} is as it was; free space (the weights need {need}) or export elsewhere."
        ) from None
    except BaseException:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    barrier("seqshard: export written")
    what = f"{source} " if source else ""
    log(
        f"exported {what}to {out_dir}: {len(files)} safetensors file(s), "
        f"{format_bytes(total)} of {dtype} weights"
    )
    return ExportResult(out_dir, files, total)


def export_weights(
    weights: Weights, model: ModelConfig, directory: Path, dtype: str, max_file_bytes: int
) -> tuple[list[str], int]:
    """Write ``weights`` (of ``model``) as Hugging Face safetensors files in ``directory``
    (process 0; every process gathers). Returns the file names and the bytes of tensor data.
    Raises ValueError, before writing, for a nonzero ``router_bias`` an architecture without
    one would drop (module docstring)."""
    _check_router_bias(weights, model)
    names = hf_tensor_names(model, architecture_of(model))
    by_name = {name: (row, where) for row, where, name in names}
    planned = plan_files(
        [(n, r.hf_shape(model)) for r, _, n in names], DTYPES[dtype][1].itemsize, max_file_bytes
    )
    n = len(planned)
    files = (
        [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )

    def produce(name: str) -> np.ndarray:
        row, where = by_name[name]
        return row.to_hf(_gather(weights, row, where), model)

    total, weight_map = 0, {}
    for file, tensors in zip(files, planned, strict=True):
        if is_main_process():
            total += write_safetensors(directory / file, tensors, dtype, produce)
        else:
            for name, _ in tensors:
                produce(name)  # every process takes part in each gather
        weight_map.update({name: file for name, _ in tensors})
    if n > 1 and is_main_process():
        write_index(directory, weight_map, total)
    return files, total


def _check_router_bias(weights: Weights, model: ModelConfig) -> None:
    if "moe_layers" not in weights.stacks:  # no MoE layers, no router bias
        return
    if architecture_of(model) == DEEPSEEK_V3:  # exported as e_score_correction_bias
        return
    bias = weights.moe_layers.router_bias  # every process gathers it (a collective)
    if bias.is_fully_addressable:
        values = np.asarray(bias)
    else:
        values = np.asarray(multihost_utils.process_allgather(bias, tiled=True))
    if np.any(values != 0):
        layer, expert = np.argwhere(values != 0)[0]
        raise ValueError(
            f"moe_layers.router_bias is nonzero (layer {model.moe.n_dense_layers + layer}, "
            f"expert {expert}: {values[layer, expert]:.4g}; largest "
            f"{np.max(np.abs(values)):.4g}): the model was trained with model.moe.balance=bias, "
            f"whose bias moves which experts each token picks. {architecture_of(model)} has no "
            f"such bias, so the exported model would pick other experts. Export a run trained "
            f"with balance=aux_loss or none."
        )


def _gather(weights: Weights, row: TensorRow, index: tuple[int, ...]) -> np.ndarray:
    """One tensor's block of a seqshard weight (``index``: its layer, [expert,] [part]),
    whole, on the host."""
    x = row.of(weights)
    if index:
        x = _slicer(len(index))(x, *index)
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.cache
def _slicer(n_index: int):
    return jax.jit(lambda x, *index: x[index])


def _weight_bytes(model: ModelConfig, dtype: str) -> int:
    size = DTYPES[dtype][1].itemsize
    names = hf_tensor_names(model, architecture_of(model))
    return sum(int(np.prod(r.hf_shape(model))) * size for r, _, _ in names)


def _check_free_space(out_dir: Path, model: ModelConfig, dtype: str) -> None:
    """Refuse, before gathering anything, an export the filesystem cannot hold."""
    parent = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    need, free = _weight_bytes(model, dtype), shutil.disk_usage(parent).free
    if free < need:
        raise OSError(
            f"{parent} has {format_bytes(free)} free, but the {dtype} weights need "
            f"{format_bytes(need)}: free space, export elsewhere, or use --dtype bfloat16."
        )


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUT_DIR {out_dir} is a file; pass a directory to export into.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(
            f"OUT_DIR {out_dir} exists and is not empty; seqshard will not write over it. "
            f"Pass another directory, or --overwrite to replace it once the export is complete."
        )


def _move_into_place(partial: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the finished ``partial`` (the old one is removed only after)."""
    old = out_dir.parent / f".{out_dir.name}.old"
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _write_configs(directory: Path, export: ExportConfig, tokenizer) -> None:
    eos = eot_id(tokenizer)
    config = hf_config_dict(
        export.model, dtype=export.dtype, max_position=export.max_position, eos_token_id=eos
    )
    _write_json(directory / CONFIG_FILE, config)
    generation = {"eos_token_id": eos, "bos_token_id": None, "pad_token_id": None}
    _write_json(directory / "generation_config.json", generation)
    shutil.copyfile(export.tokenizer, directory / "tokenizer.json")
    special = {"eos_token": EOT} if eos is not None else {}
    template = export.chat_template
    chat = {} if template is None else {"chat_template": template.text}
    _write_json(directory / "special_tokens_map.json", special)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": export.max_position,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            **special,
            **chat,
        },
    )


def _check_chat_template(template: ChatTemplate, has_eot: bool) -> None:
    """transformers renders the template with the exported tokenizer's special tokens (eos
    ``<|endoftext|>`` if it has one, no bos), seqshard rendered the data with the template's own
    (:class:`~seqshard.data.sft.ChatTemplate`): a probe chat must render the same both ways."""
    exported = dataclasses.replace(template, bos_token="", eos_token=EOT if has_eot else "")
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    where = "a probe chat (checking the exported chat template)"
    for messages, prompt in ((chat, False), (chat[:1], True)):
        ours = template.render(messages, prompt, where)
        theirs = exported.render(messages, prompt, where)
        if ours != theirs:
            raise ValueError(
                f"the chat template of {template.source} renders bos_token "
                f"{template.bos_token!r} / eos_token {template.eos_token!r}, but the exported "
                f"tokenizer's are {exported.bos_token!r} / {exported.eos_token!r}, so "
                f"transformers' apply_chat_template would give {theirs!r} where the run "
                f"trained on {ours!r}. Export with a template that renders neither "
                f"(`seqshard export RUN_DIR OUT_DIR data.chat_template=PATH`)."
            )


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
