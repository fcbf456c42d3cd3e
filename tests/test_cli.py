"""Tests of the ``seqshard`` command: prepare -> train -> eval -> generate -> plot, show, --help
of every subcommand, and errors that exit 2 with a message instead of a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from process_helpers import SEQSHARD, xla_flags

from seqshard.cli import _load, main

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def seqshard(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SEQSHARD, *map(str, args)],
        cwd=cwd,
        env={**os.environ, "XLA_FLAGS": xla_flags(8)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def test_end_to_end(tmp_path, corpus_dir, tiny_yaml, capsys):
    data = tmp_path / "data"
    out = ok(
        seqshard(
            "prepare", "--out", data, "--vocab-size", "300", "--val-fraction", "0.1",
            corpus_dir, cwd=tmp_path,
        )
    )  # fmt: skip
    assert (data / "meta.json").is_file() and (data / "tokenizer.json").is_file()
    assert str(data) in out

    config = tiny_yaml(tmp_path / "tiny.yaml", tmp_path / "runs", data)
    run_dir = tmp_path / "runs" / "tiny"  # run.name defaults to the config's stem
    out = ok(
        seqshard(
            "train", config, "train.steps=5", "train.eval_every=0", "--sample-tokens", "8",
            cwd=tmp_path,
        )
    )  # fmt: skip
    assert f"run directory: {run_dir}" in out
    final = re.search(r"^step 5: train loss (\d+\.\d+), val loss (\d+\.\d+), ", out, re.M)
    assert final, out
    assert re.search(r"^sample \(8 tokens after 'def __init__\(self'\):$", out, re.M), out
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "5").is_dir()

    out = ok(seqshard("eval", run_dir, cwd=tmp_path))
    # The same validation batches as the run's own final evaluation.
    assert f"step 5: val loss {final[2]} over 2 batches of 8x32" in out
    # On another mesh (in this process: it already has 8 devices), the same loss.
    capsys.readouterr()
    assert main(["eval", str(run_dir), "mesh.d=2", "mesh.t=4"]) == 0
    assert f"step 5: val loss {final[2]} over 2 batches" in capsys.readouterr().out

    out = ok(
        seqshard(
            "generate", run_dir, "--prompt", "def ", "--max-new-tokens", "8",
            "--num-samples", "2", "--temperature", "0", cwd=tmp_path,
        )
    )  # fmt: skip
    samples = out.split("-" * 40 + "\n")
    assert len(samples) == 3 and samples[-1] == ""
    assert samples[0] == samples[1]  # greedy: the same continuation twice

    out = ok(seqshard("plot", run_dir, cwd=tmp_path))
    png = run_dir / "loss.png"
    assert out.strip() == str(png)
    assert png.read_bytes().startswith(PNG_MAGIC)

    out = ok(seqshard("show", config, cwd=tmp_path))
    for needle in (
        "# resolved config",
        "d_model: 32",
        "parameters:",
        "PartitionSpec",
        "FLOPs per token",
        "(planning for the config's target: --devices 8 --chip cpu;",  # tiny-cpu.yaml's line
        "memory per device (peak of a step)",
        "verdict: fits",
        "communication per train step",
    ):
        assert needle in out, needle


def test_generate_a_prompts_file_in_one_batch_with_chat_and_stop_strings(
    trained_run, tmp_path, capsys
):
    """--prompts-file: one batch, one output per line in the file's order (blank lines
    skipped), each what generating its prompt alone gives (greedy). --chat sends each as a user
    message through the run's chat template (data.chat_template) and stops each reply at the
    template's end of turn, --stop at a string of one's own: each row is cut before the first.
    The ends are taken from the replies (every run here but the one alone compiles nothing new:
    the same shapes, a two-byte end or stop string)."""
    _, run_dir = trained_run
    questions = ["the word after def?", "", "what is a model of data?"]
    (tmp_path / "questions.txt").write_text("\n".join(questions) + "\n")
    questions.remove("")

    def chat(end: str | None, *args) -> list[str]:
        """The outputs of --chat with a template whose assistant turns end with ``end``
        (its user turns hold no end: the prompts are the same for any end)."""
        template = tmp_path / f"chat-{end}.jinja"
        template.write_text(
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
            + ("" if end is None else f"{{% if m.role == 'assistant' %}}{end}{{% endif %}}")
            + "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
        capsys.readouterr()
        argv = ["generate", str(run_dir), "--chat", f"data.chat_template={template}"]
        greedy = ["--temperature", "0", "--max-new-tokens", "10"]
        assert main([*argv, *map(str, args), *greedy]) == 0
        outputs = capsys.readouterr().out.split("-" * 40 + "\n")
        assert outputs[-1] == ""
        return [out.removesuffix("\n") for out in outputs[:-1]]

    prompts = [f"<|user|>{q}<|assistant|>" for q in questions]
    batch = chat("@@", "--prompts-file", tmp_path / "questions.txt")
    assert len(batch) == 2 and all(out.startswith(p) for out, p in zip(batch, prompts, strict=True))
    replies = [out[len(p) :] for out, p in zip(batch, prompts, strict=True)]
    assert all("@@" not in reply for reply in replies), replies  # "@@" stopped no row
    # The shorter prompt, alone: its padding in the batch changed nothing.
    assert chat("@@", "--prompt", questions[0]) == batch[:1]

    def cut(reply: str, end: str) -> str:
        return reply[: reply.index(end)] if end in reply else reply

    # A pair of printable characters from the middle of the first reply.
    middle = (replies[0][k : k + 2] for k in range(len(replies[0]) // 2, len(replies[0]) - 1))
    end = next(p for p in middle if p.isascii() and p.isprintable() and p.strip() == p)
    want = [p + cut(reply, end) for p, reply in zip(prompts, replies, strict=True)]
    assert len(want[0]) < len(batch[0])
    assert chat(end, "--prompts-file", tmp_path / "questions.txt") == want
    assert chat(None, "--prompts-file", tmp_path / "questions.txt", "--stop", end) == want


def test_the_end_of_run_sample_of_a_chat_run_is_a_reply_stopped_at_the_end_of_turn(
    trained_run, capsys
):
    from seqshard.cli import _end_of_run_sample, _run_config

    _, run_dir = trained_run
    template = REPO / "configs" / "sft" / "chat_template.jinja"
    cfg = _run_config(str(run_dir), [f"data.chat_template={template}"])
    capsys.readouterr()
    _end_of_run_sample(cfg, run_dir, None, 12)
    head, sample = capsys.readouterr().out.split("\n", 1)
    question = "What does `os.path.join` do?"
    assert head == f"sample (a reply of at most 12 tokens to {question!r}, stopped at '<|end|>'):"
    prompt = f"<|user|>\n{question}<|end|>\n<|assistant|>\n"
    assert sample.startswith(prompt) and "<|end|>" not in sample[len(prompt) :], sample


@pytest.mark.parametrize(
    ("command", "needles"),
    [
        ([], ["prepare", "train", "eval", "generate", "export", "plot", "show", "config"]),
        (["config"], ["section", "model.moe", "--markdown"]),
        (["prepare"], ["--out", "--vocab-size", "--tokenizer", "INPUTS"]),
        (["train"], ["config", "overrides", "resumes", "SIGTERM", "--sample-tokens"]),
        (["eval"], ["run_dir", "mesh.d=8", "--batches"]),
        (
            ["generate"],
            [
                "run_dir",
                "--prompt",
                "--prompts-file",
                "--chat",
                "--stop",
                "--max-new-tokens",
                "--temperature",
                "--top-k",
                "--num-samples",
                "--seed",
            ],
        ),
        (["plot"], ["RUN_DIR", "--out", "loss.png"]),
        (
            ["export"],
            ["run_dir", "out_dir", "--step", "--dtype", "--max-file-size", "init.from_hf"],
        ),
        (["show"], ["config", "overrides", "--no-compile", "--devices", "--chip", "v5p"]),
    ],
)
def test_help_of_every_subcommand(capsys, command, needles):
    try:
        code = main([*command, "--help"])
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: seqshard")
    for needle in needles:
        assert needle in out, needle
    # Issue 41, item 14: each default once, and none for an option left unset.
    flat = " ".join(out.split())
    assert "(default: None)" not in flat and "(default: False)" not in flat
    assert not re.search(r"\(default: [^)]*\) \(default:", flat), flat


def test_version(capsys):
    assert main(["--version"]) == 0
    assert re.fullmatch(r"seqshard \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_a_bad_config_exits_2_with_the_error_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_modle: 3}\n")
    # The installed console script, as users run it.
    script = Path(sys.executable).parent / "seqshard"
    cmd = [str(script)] if script.exists() else SEQSHARD
    result = subprocess.run(
        [*cmd, "train", str(bad)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.startswith("seqshard train: error:")
    assert "d_modle" in result.stderr and "d_model" in result.stderr
    assert str(bad) in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["train", "{missing}"], ["seqshard train: error:", "does not exist"]),
        (["train", "{tiny}", "mesh.d=3"], ["seqshard train: error:", "d=3"]),
        (["train", "{tiny}", "train.steps"], ["seqshard train: error:", "not key=value"]),
        (
            ["train", "{tiny}", "data.dir={file}/data", "data.inputs=[{corpus}]"],
            ["seqshard train: error:", "cannot prepare", "cannot be made a directory", "a-file"],
        ),
        (["show", "{tiny}", "model.d_modle=3"], ["seqshard show: error:", "d_model"]),
        (
            ["show", "{tiny}", "--chip", "v9"],
            ["seqshard show: error:", "unknown chip 'v9'", "h100"],
        ),
        (
            ["show", "{tiny}", "--devices", "16", "--no-compile"],
            ["seqshard show: error:", "uses 8 devices, not the 16", "mesh.d=-1"],
        ),
        (["show", "{tiny}", "mesh.d=-1", "--no-compile"], ["seqshard show: error:", "--devices N"]),
        (["eval", "{tmp}"], ["seqshard eval: error:", "not a run directory"]),
        (["generate", "{tmp}", "--prompt", "x"], ["seqshard generate: error:", "config.yaml"]),
        (["plot", "{tmp}/nope"], ["seqshard plot: error:", "nope"]),
        (["prepare", "--out", "{tmp}/d", "{tmp}/no-text"], ["seqshard prepare: error:", "no-text"]),
    ],
)
def test_errors_exit_2_with_a_message(tmp_path, tiny_yaml, corpus_dir, capsys, argv, needles):
    tiny = tiny_yaml(tmp_path / "tiny.yaml", tmp_path / "runs")
    file = tmp_path / "a-file"
    file.touch()
    names = {
        "missing": tmp_path / "missing.yaml",
        "tiny": tiny,
        "tmp": tmp_path,
        "file": file,
        "corpus": corpus_dir,
    }
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "runs").exists()  # nothing was trained


def test_a_run_finds_the_data_it_trained_on_from_any_directory(
    tmp_path, tiny_yaml, monkeypatch, data_dir
):
    """A run saves the resolved data directory in ``run.json``, so ``seqshard eval`` and
    ``generate`` find ``data.dir: data/x`` (relative to where `seqshard train` ran) from any
    directory; an explicit ``data.dir=`` still wins."""
    from seqshard.cli import _run_config
    from seqshard.train.loop import train

    project = tmp_path / "proj"
    shutil.copytree(data_dir, project / "data" / "x")
    monkeypatch.chdir(project)
    config = tiny_yaml(project / "tiny.yaml", Path("runs"), Path("data/x"))
    cfg = _load(str(config), ["train.steps=1", "train.eval_every=0"])
    train(cfg, log=lambda _: None, tty=False)
    assert json.loads((project / "runs" / "tiny" / "run.json").read_text()) == {
        "data_dir": str(project / "data" / "x")
    }

    monkeypatch.chdir(tmp_path)
    assert Path(_run_config("proj/runs/tiny", []).data.dir) == project / "data" / "x"
    assert _run_config("proj/runs/tiny", ["data.dir=elsewhere"]).data.dir == "elsewhere"
    assert main(["eval", "proj/runs/tiny", "--batches", "1"]) == 0


def test_a_mixture_run_finds_every_source_from_any_directory(
    tmp_path, tiny_yaml, monkeypatch, data_dir, capsys
):
    """Fault 16 of the second campaign: run.json held only the first source's path, the
    others resolved against the working directory, so `seqshard eval` of a mixture run worked
    only where it was trained. Now every source's resolved path is recorded and used."""
    from seqshard.cli import _run_config
    from seqshard.train.loop import train

    project = tmp_path / "proj"
    for name in ("web", "code"):
        shutil.copytree(data_dir, project / "data" / name)
    monkeypatch.chdir(project)
    config = tiny_yaml(project / "tiny.yaml", Path("runs"), Path("data/web"))
    mixture = "data.mixture=[{path: data/web, weight: 3}, {path: data/code, weight: 1}]"
    cfg = _load(str(config), ["train.steps=1", "train.eval_every=0", mixture])
    train(cfg, log=lambda _: None, tty=False)
    info = json.loads((project / "runs" / "tiny" / "run.json").read_text())
    web, code = (str(project / "data" / name) for name in ("web", "code"))
    assert info["sources"] == {web: web, code: code}  # the override's paths, made absolute

    monkeypatch.chdir(tmp_path)
    paths = [s.path for s in _run_config("proj/runs/tiny", []).data.mixture]
    assert paths == [str(project / "data" / "web"), str(project / "data" / "code")]
    assert main(["eval", "proj/runs/tiny", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "  web: val loss" in out and "  code: val loss" in out


def test_options_and_overrides_come_in_any_order(tmp_path, tiny_yaml, capsys):
    """argparse alone stops collecting overrides at the first option; seqshard does not."""
    config = tiny_yaml(tmp_path / "tiny.yaml", tmp_path / "runs")
    assert main(["show", str(config), "--no-compile", "mesh.d=2", "mesh.t=4"]) == 0
    assert "mesh d=2 x c=1 x t=4" in capsys.readouterr().out
    assert main(["show", "--no-compile", str(config), "mesh.d=8", "mesh.t=1"]) == 0
    assert "mesh d=8 x c=1 x t=1" in capsys.readouterr().out


def test_show_plans_for_other_machines_without_compiling(tmp_path, tiny_yaml, capsys):
    """--devices N with a -1 mesh: the plan for N devices; the step is not compiled for a
    device count this process does not have (8 here)."""
    config = tiny_yaml(tmp_path / "tiny.yaml", tmp_path / "runs")
    assert main(["show", str(config), "mesh.d=-1", "--devices", "16", "--chip", "v5e"]) == 0
    out = capsys.readouterr().out
    assert "not compiling the train step: mesh d=8 x c=1 x t=2 needs 16 devices" in out
    assert "plan for 16 chips (a v5e-16 slice), mesh d=8 x c=1 x t=2" in out
    assert re.search(r"^verdict: fits: ", out, re.M)
    assert "from the step compiled" not in out
    assert "communication per train step, predicted from the notation (nothing compiled" in out


@pytest.mark.parametrize("given", [["--train.steps=10"], ["--train.steps", "10"]])
def test_an_override_written_as_an_option_is_one_line_with_the_fix(
    tmp_path, tiny_yaml, capsys, given
):
    """``--train.steps=10`` (the torchtitan / draccus habit) got argparse's usage and
    "unrecognized arguments"; now one line says how to write it."""
    config = tiny_yaml(tmp_path / "tiny.yaml", tmp_path / "runs")
    assert main(["train", str(config), *given]) == 2
    assert capsys.readouterr().err == (
        f"seqshard train: error: {' '.join(given)} is not an option: a config override is "
        f"written without dashes, as train.steps=10.\n"
    )
    assert not (tmp_path / "runs").exists()
    # A command that takes no overrides keeps argparse's own message.
    assert main(["plot", str(tmp_path), "--train.steps=10"]) == 2
    assert "unrecognized arguments: --train.steps=10" in capsys.readouterr().err


def test_config_lists_the_keys_of_a_section(capsys):
    assert main(["config", "train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[train]\nThe optimization: AdamW")
    assert "\n  train.schedule: cosine | wsd = cosine\n" in out
    assert "\n  train.steps: int = 1000\n      optimizer steps in all" in out
    assert "model." not in out and "[data]" not in out
    assert main(["config", "trian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqshard config: error: no config section 'trian'; the sections are")
