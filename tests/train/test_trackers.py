"""Tests of seqshard/train/trackers.py: run.trackers, each sink on a real run (TensorBoard left
out, Weights & Biases offline, read back from its own files), and the wandb extra missing.
(metrics.jsonl and TensorBoard as MetricsLogger writes them: test_metrics.py.)"""

import json
import struct
import sys
from pathlib import Path

import pytest
from run_helpers import by_step, quiet, run

from seqshard.config import TRACKERS, ConfigError, load_config
from seqshard.train.loop import train
from seqshard.train.trackers import SINKS, tb_tag


def test_tb_tag():
    assert tb_tag("loss") == "train/loss"
    assert tb_tag("val_loss") == "val/loss"
    assert tb_tag("tokens_per_s") == "train/tokens_per_s"


def test_the_config_offers_each_tracker_there_is():
    assert set(TRACKERS) == set(SINKS)


@pytest.mark.parametrize(
    ("trackers", "message"),
    [
        ("[jsonl,neptune]", r"'neptune' is not a tracker; choose from tensorboard, jsonl, wandb"),
        ("[jsonl,jsonl]", r"names a tracker twice"),
        ("[tensorboard]", r"leaves out jsonl.*run.trackers=\[tensorboard, jsonl\]"),
    ],
)
def test_run_trackers_are_checked(trackers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"run.trackers={trackers}"])


def test_a_run_without_tensorboard_writes_no_events(tmp_path, tiny_overrides):
    result = run([*tiny_overrides(tmp_path, "plain", steps=2), "run.trackers=[jsonl]"])
    assert sorted(by_step(result.run_dir)) == [1, 2]
    assert not (result.run_dir / "tb").exists()


def test_wandb_missing_is_one_line_naming_the_extra(tmp_path, tiny_overrides, monkeypatch):
    """Without the package (None in sys.modules: how Python marks a module that cannot be
    imported), the run stops before it writes anything, naming the pip extra."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config(None, [*tiny_overrides(tmp_path, "wb"), "run.trackers=[jsonl,wandb]"])
    with pytest.raises(ImportError, match=r"pip install 'seqshard\[wandb\]'") as e:
        train(cfg, log=quiet, tty=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "wb").exists()


# -- Weights & Biases, offline ----------------------------------------------------------------


def _wandb_records(path: Path) -> list:
    """The records of a W&B ``run-<id>.wandb`` file: a 7-byte header (":W&B", a magic, a
    version), then LevelDB's log format (32 KiB blocks of records, each a 7-byte header: crc,
    length, type FULL/FIRST/MIDDLE/LAST) holding ``wandb_internal_pb2.Record`` protos."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeroed: the end of what was written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _wandb_run(offline_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(config, {step: history row}) of one offline run directory."""
    (path,) = offline_dir.glob("run-*.wandb")
    config, history = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        items = ()
        if kind == "run":
            items = record.run.config.update
        elif kind == "config":
            items = record.config.update
        for item in items:
            config[item.key] = json.loads(item.value_json)
        if kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[row["_step"]] = row
    return config, history


def test_wandb_offline_run_holds_the_config_and_the_metrics(tmp_path, tiny_overrides, monkeypatch):
    """W&B gets the resolved config and, keyed by step, every value metrics.jsonl holds under
    its TensorBoard tag; a resumed run continues the same W&B run with the new steps."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    overrides = [
        *tiny_overrides(tmp_path, "wb", steps=4, log_every=2, eval_every=4),
        "run.trackers=[tensorboard,jsonl,wandb]",
    ]
    result = run(overrides)
    first = sorted((result.run_dir / "wandb").glob("offline-run-*"))
    assert len(first) == 1
    config, history = _wandb_run(first[0])
    assert config["model"]["d_model"] == 32 and config["train"]["steps"] == 4
    assert config["run"]["trackers"] == ["tensorboard", "jsonl", "wandb"]
    jsonl = by_step(result.run_dir)
    assert sorted(history) == sorted(jsonl) == [2, 4]
    for step, record in jsonl.items():
        for key, value in record.items():
            if key not in ("step", "time"):
                assert history[step][tb_tag(key)] == pytest.approx(value), (step, key)

    run([*overrides, "train.steps=6"])  # resumes at 4
    runs = sorted((result.run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and runs[0].name[-8:] == runs[1].name[-8:]  # one W&B run id
    config, history = _wandb_run(runs[1])
    assert config["train"]["steps"] == 6 and sorted(history) == [6]
    assert history[6]["train/loss"] == pytest.approx(by_step(result.run_dir)[6]["loss"])
