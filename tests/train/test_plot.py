"""Tests of seqshard.train.plot and `seqshard plot`: loss curves of one run or several, as PNG."""

from pathlib import Path

import pytest
from metrics_helpers import _write_run

from seqshard.cli import main
from seqshard.train.plot import plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- plot -------------------------------------------------------------------------------------


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 5_000


def test_plot_one_run_default_path(tmp_path, capsys):
    run = tmp_path / "run_a"
    _write_run(run, range(1, 21), val_every=5)
    out = plot_runs([run])
    assert out == run / "loss.png"
    _assert_png(out)


def test_plot_two_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path / "a", range(1, 21), val_every=5)
    _write_run(tmp_path / "b", range(1, 11))
    out = plot_runs([tmp_path / "a", str(tmp_path / "b")])
    assert out.resolve() == (tmp_path / "loss_compare.png").resolve()
    _assert_png(out)
    explicit = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "sub" / "x.png")
    assert explicit == tmp_path / "sub" / "x.png"
    _assert_png(explicit)


def test_plot_does_not_touch_pyplot(tmp_path, capsys):
    import matplotlib

    backend = matplotlib.get_backend()
    _write_run(tmp_path, range(1, 4))
    plot_runs([tmp_path])
    assert matplotlib.get_backend() == backend


def test_plot_missing_run(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        plot_runs([missing])
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in run dir.*nope"):
        plot_runs([missing])


def test_plot_empty_run(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty; run dir .*empty"):
        plot_runs([tmp_path / "empty"])
    with pytest.raises(ValueError, match="no run dirs"):
        plot_runs([])


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, range(1, 6))
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(tmp_path / "o.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o.png")
    _assert_png(tmp_path / "o.png")

    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["plot"]) == 2  # argparse usage error
    assert main(["plot", "--help"]) == 0
    assert "RUN_DIR" in capsys.readouterr().out


def test_a_run_with_tasks_gets_their_accuracy_panel(tmp_path):
    """eval.tasks' acc and acc_norm beside the losses: a figure twice as wide."""
    import json
    import struct

    plain, tasks = tmp_path / "plain", tmp_path / "tasks"
    _write_run(plain, range(1, 21), val_every=5)
    _write_run(tasks, range(1, 21), val_every=5)
    with (tasks / "metrics.jsonl").open("a") as f:
        for step, acc in ((5, 0.25), (10, 0.31), (20, 0.4)):
            f.write(
                json.dumps({"step": step, "task/t/acc": acc, "task/t/acc_norm": acc + 0.02}) + "\n"
            )

    def width(path: Path) -> int:
        return struct.unpack(">I", path.read_bytes()[16:20])[0]  # the PNG's IHDR width

    assert width(plot_runs([tasks])) == 1300 and width(plot_runs([plain])) == 800
