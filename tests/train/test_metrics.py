"""Tests of seqshard/train/metrics.py: metrics.jsonl, torn lines and TensorBoard as the logger
writes them, the progress lines, log.txt. (The trackers alone: test_trackers.py; plots:
test_plot.py.)"""

import json
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from metrics_helpers import _metrics, _steps, _write_run

from seqshard.config import load_config
from seqshard.train.loop import train
from seqshard.train.metrics import MetricsLogger, format_duration, format_line, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- metrics.jsonl ----------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=3, tty=False) as log:
        log.log(1, _metrics(1))
        # numpy scalars (and 0-d JAX arrays) are written as plain floats.
        log.log(2, {**_metrics(2), "val_loss": np.float32(3.5), "extra": np.int32(7)})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for key, value in _metrics(1).items():
        assert records[0][key] == pytest.approx(value)
    assert records[1]["val_loss"] == 3.5 and records[1]["extra"] == 7.0
    assert "val_loss" not in records[0]
    assert all(isinstance(r["time"], float) for r in records)
    assert records[0]["time"] <= records[1]["time"]
    # One JSON object per line, each line complete.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["step"] for line in lines)


def test_line_is_flushed_before_close(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total_steps=3, tty=False)
    log.log(1, _metrics(1))
    assert _steps(tmp_path) == [1]  # readable while the logger is still open (kill-safe)
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.log(2, _metrics(2))


def test_resumed_run_appends(tmp_path, capsys):
    _write_run(tmp_path, range(1, 4))
    _write_run(tmp_path, range(4, 6))
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]


def test_truncate_after(tmp_path, capsys):
    _write_run(tmp_path, range(1, 8))  # crashed after step 7; last checkpoint at step 4
    with MetricsLogger(tmp_path, total_steps=10, start_step=4, tty=False) as log:
        assert log.truncate_after(4) == 3
        assert _steps(tmp_path) == [1, 2, 3, 4]
        log.log(5, _metrics(5))
        assert log.truncate_after(5) == 0
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]
    assert not list(tmp_path.glob("*.tmp"))  # the atomic rewrite left no temp file


def test_bad_metrics_rejected(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=3, tty=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 1.0})
        with pytest.raises(TypeError, match="'loss' must be a number"):
            log.log(1, {"loss": "low"})


# -- torn lines -------------------------------------------------------------------------------


def test_truncated_last_line_is_skipped_with_warning(tmp_path, capsys):
    _write_run(tmp_path, range(1, 4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # killed mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        assert _steps(tmp_path) == [1, 2, 3]


def test_bad_line_in_the_middle_raises(tmp_path, capsys):
    _write_run(tmp_path, range(1, 3))
    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text("garbage\n" + text)
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_metrics(tmp_path)


def test_append_after_torn_line_repairs_the_file(tmp_path, capsys):
    _write_run(tmp_path, range(1, 3))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    with pytest.warns(UserWarning, match="dropping the torn last line"):
        log = MetricsLogger(tmp_path, total_steps=5, start_step=2, tty=False)
    with log:
        log.log(3, _metrics(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _steps(tmp_path) == [1, 2, 3]


def test_lost_newline_keeps_the_record(tmp_path, capsys):
    _write_run(tmp_path, range(1, 3))
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text().rstrip("\n"))
    _write_run(tmp_path, range(3, 4))
    assert _steps(tmp_path) == [1, 2, 3]


def test_read_metrics_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in run dir"):
        read_metrics(tmp_path)


# -- TensorBoard ------------------------------------------------------------------------------


def _read_events(tb_dir: Path) -> list:
    """Every Event in tb_dir's event files (TFRecords: u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
    return events


def _scalars(events: list) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for event in events:
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_events(tmp_path, capsys):
    _write_run(tmp_path, range(1, 5), val_every=2)
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    scalars = _scalars(_read_events(tmp_path / "tb"))
    expected = {"train/" + k for k in _metrics(1)} | {"val/loss"}
    assert set(scalars) == expected
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert scalars["train/loss"][1][1] == pytest.approx(2.5)
    assert scalars["val/loss"] == [(2, pytest.approx(3.0)), (4, pytest.approx(1.5))]


def test_tensorboard_purged_on_truncate(tmp_path, capsys):
    from tensorboardX.proto.event_pb2 import SessionLog

    _write_run(tmp_path, range(1, 8))
    with MetricsLogger(tmp_path, total_steps=10, start_step=4, tty=False) as log:
        log.truncate_after(4)
        log.log(5, _metrics(5))
    # TensorBoard drops earlier events with step >= 5 when it meets this START at step 5.
    starts = [
        e.step for e in _read_events(tmp_path / "tb") if e.session_log.status == SessionLog.START
    ]
    assert starts == [5]


# -- progress display -------------------------------------------------------------------------


def test_non_tty_line_format(tmp_path, capsys):
    metrics = {
        "loss": 3.4121,
        "val_loss": 3.5,
        "lr": 2.9e-3,
        "grad_norm": 0.61,
        "tokens_per_s": 4512.3,
        "mfu": 0.012,
        "step_time_s": 0.91,
    }
    expected = (
        "step 120/300  loss 3.412  val_loss 3.5  lr 2.9e-03  grad_norm 0.61  tok/s 4,512  "
        "mfu 1.2%  (0.91 s/step, eta 2m44s)"  # 180 steps left at 0.91 s: 163.8 s
    )
    assert format_line(120, 300, metrics) == expected
    with MetricsLogger(tmp_path, total_steps=300, tty=False) as log:
        log.log(120, metrics)
        log.message("saved checkpoint 120")
    assert capsys.readouterr().out.splitlines() == [expected, "saved checkpoint 120"]


def test_eta_is_the_steps_left_at_the_step_time():
    assert format_line(300, 300, {"step_time_s": 0.91}) == "step 300/300  (0.91 s/step)"
    assert format_line(0, 40_000, {"step_time_s": 4.5}).endswith("(4.50 s/step, eta 2d02h)")
    assert format_line(1, 2, {"step_time_s": float("nan")}) == "step 1/2  (nan s/step)"
    assert [format_duration(s) for s in (0.4, 42, 164, 3599.6, 11_100, 183_600)] == [
        "0s",
        "42s",
        "2m44s",
        "1h00m",
        "3h05m",
        "2d03h",
    ]


def test_format_line_partial_and_extra_keys():
    line = format_line(1, 2, {"loss": float("nan"), "z": 0.25, "tokens_counted": 16384.0})
    assert line == "step 1/2  loss nan  z 0.25  tokens_counted 16,384"


def test_format_line_leaves_per_layer_and_per_expert_figures_to_the_files():
    """A run with 58 MoE layers of 256 experts logs ~15,000 moe_load/<layer>/<expert> values
    a step: the console shows the worst layer's load, the files keep them all."""
    metrics = {"loss": 3.0, "moe_load_max_over_mean": 1.25, "moe_load_max_over_mean/3": 1.25}
    metrics |= {f"moe_load/3/{j}": 1 / 8 for j in range(8)}
    line = format_line(7, 9, metrics)
    assert line == "step 7/9  loss 3  moe_load_max_over_mean 1.25"


def test_tty_progress_bar_with_the_lines_above_it(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=10, start_step=2, tty=True) as log:
        log.log(3, _metrics(3))
        log.message("hello")
        log.log(5, _metrics(5))
        assert log._bar.n == 5
    out = capsys.readouterr().out
    assert "hello" in out and "tok/s 4,512" in out and "loss" in out
    # Each logged step's line is written whole on a line of its own (tqdm.write clears the
    # bar, writes, redraws it), the bar's ETA and the line's alike.
    lines = re.split(r"[\r\n]", out)
    assert format_line(3, 10, _metrics(3)) in lines
    assert format_line(5, 10, _metrics(5)) in lines
    assert "eta 6s" in format_line(3, 10, _metrics(3))  # 7 steps at 0.91 s


# -- a run's console and log.txt --------------------------------------------------------------


def test_a_run_prints_a_line_every_log_every_and_keeps_its_notes_in_log_txt(
    tmp_path, tiny_overrides, capsys
):
    """Without a terminal: one line per train.log_every steps (with the ETA but at the end).
    Every note goes to log.txt, and the loader's Python warning (eval batches that repeat
    rows) is one of them, not a warning on stderr; a resumed run appends."""
    # 6 eval batches of 8 rows need 48 rows of 32 tokens; the val split has fewer.
    overrides = tiny_overrides(tmp_path, "logged", log_every=2, eval_every=0, eval_batches=6)
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(load_config(None, overrides), log=notes.append, tty=False)
    assert not [w for w in caught if "rows repeat" in str(w.message)]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert re.search(r"\(\d+\.\d\d s/step, eta \d+s\)$", lines[0]), lines[0]
    assert "eta" not in lines[-1] and "val_loss" in lines[-1]
    for label in ("loss", "grad_norm", "lr", "tok/s", "mfu"):
        assert f"  {label} " in lines[0], (label, lines[0])

    warning = next(n for n in notes if n.startswith("warning: eval_batches(6) needs 48 rows"))
    assert "rows repeat" in warning and "\n" not in warning
    log_txt = (tmp_path / "logged" / "log.txt").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  "
    assert all(re.match(stamp, line) for line in log_txt), log_txt
    assert [line[21:] for line in log_txt] == notes  # every note, in order, nothing else
    assert notes[0].startswith("starting ") and warning in notes
    assert any(n.startswith("compiled and ran the first step") for n in notes)

    train(load_config(None, [*overrides, "train.steps=8"]), log=notes.append, tty=False)
    again = (tmp_path / "logged" / "log.txt").read_text().splitlines()
    assert again[: len(log_txt)] == log_txt
    assert again[len(log_txt)][21:].startswith("resuming ")
