"""The commands README.md, docs/*.md and scripts/README.md write out work as written (issue 41,
item 3: README's own override example failed, and docs ran scripts with a bare `python`).

Every concrete command is extracted (placeholders such as RUN_DIR, `[--flags]` or `...` are
left out): each `seqshard` command parses with its command's real parser, a `train` or `show`
command's config loads with its overrides on the devices it is planned for, and the commands on
the main job's run (eval, generate, plot) run on a small trained run in its place. Each script
a doc runs exists, and (slow) answers --help; `bench_hf.py --size small` runs whole (slow).
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from seqshard.cli import COMMANDS, _command_parser, main
from seqshard.config import load_config
from seqshard.plan.planner import config_target, target_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "scripts" / "README.md"]
_COMMAND = re.compile(
    r"(?:\.venv/bin/)?(seqshard (?:" + "|".join(c.name for c in COMMANDS) + r")\b[^`\n|]*"
    r"|\.venv/bin/python scripts/[^`\n|]*)"
)
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b|\.\.\.|\[|\$|<|\{")


def _lines(text: str) -> list[str]:
    """The text's lines, a command continued with a trailing backslash joined into one."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def _ends_in_a_bare_option(argv: list[str]) -> bool:
    """Whether ``seqshard COMMAND ... --option`` ends in an option that takes a value."""
    parser = _command_parser(next(c for c in COMMANDS if c.name == argv[1]))
    action = parser._option_string_actions.get(argv[-1])  # noqa: SLF001 (argparse's table)
    return action is not None and action.nargs != 0


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `seqshard` or `python`) of every concrete command in the docs."""
    found = []
    for path in DOCS:
        for n, line in enumerate(_lines(path.read_text()), start=1):
            for match in _COMMAND.finditer(line):
                command = re.split(r"  #| # | > | && | ; ", match.group(1))[0]
                command = command.strip().rstrip(".,;:")
                if _PLACEHOLDER.search(command):
                    continue
                try:
                    argv = shlex.split(command)
                except ValueError:  # an unclosed quote: prose around the command
                    continue
                if argv[0] == "seqshard" and (len(argv) < 3 or _ends_in_a_bare_option(argv)):
                    continue  # a command or option named in prose ("`seqshard show --chip`")
                found.append((f"{path.relative_to(REPO)}:{n}", argv))
    return found


COMMANDS_IN_DOCS = doc_commands()
SEQSHARD = [(w, a[1:]) for w, a in COMMANDS_IN_DOCS if a[0] == "seqshard"]
SCRIPTS = [(w, a[1:]) for w, a in COMMANDS_IN_DOCS if a[0] != "seqshard"]
RUN_COMMANDS = ("eval", "generate", "plot", "export")


def test_the_docs_hold_commands_of_every_kind():
    kinds = {argv[0] for _, argv in SEQSHARD}
    assert {"train", "show", "eval", "generate", "plot"} <= kinds, kinds
    assert len(SCRIPTS) >= 10, SCRIPTS


def test_no_doc_runs_a_script_with_a_bare_python():
    """The quick start never activates the venv: `python scripts/...` finds no seqshard."""
    for path in DOCS:
        bare = re.findall(r"(?<![/\w])python3? scripts/\S+", path.read_text())
        assert not bare, f"{path.relative_to(REPO)}: write .venv/bin/python: {bare}"


@pytest.mark.parametrize(("where", "argv"), SEQSHARD, ids=[w for w, _ in SEQSHARD])
def test_each_seqshard_command_parses_and_its_config_fits(where, argv):
    """The arguments parse as the command's own parser reads them; a train or show config
    loads with its overrides and fits the devices it is planned for (its --devices, else its
    config's `# target:` line)."""
    name, rest = argv[0], argv[1:]
    if name == "lm-eval":  # the harness's own flags (its parser reads sys.argv): the model's
        assert rest[rest.index("--model") + 1] == "seqshard"
        assert rest[rest.index("--model_args") + 1].startswith("run_dir=")
        return
    command = next(c for c in COMMANDS if c.name == name)
    args = _command_parser(command).parse_intermixed_args(rest)
    if name not in ("train", "show"):
        return
    config = REPO / args.config
    cfg = load_config(config, args.overrides)
    devices = getattr(args, "devices", None) or (config_target(config) or (None,))[0]
    if devices is not None:
        # A multi-node command (srun, mesh.d=-1) runs on as many nodes as its fixed axes need.
        fixed = math.prod(n for n in cfg.mesh.given().values() if n > 0)
        target_config(cfg, math.lcm(devices, fixed) if not cfg.mesh.is_resolved else devices)


@pytest.mark.parametrize(
    ("where", "argv"),
    [(w, a) for w, a in SEQSHARD if a[0] == "show"],
    ids=[w for w, a in SEQSHARD if a[0] == "show"],
)
def test_each_show_command_runs(where, argv, capsys):
    assert main([*argv, "--no-compile"] if "--no-compile" not in argv else argv) == 0, where
    assert "parameters" in capsys.readouterr().out


SMALL = {"generate": ["--max-new-tokens", "4"], "eval": ["--batches", "1"]}
"""What makes a command on the main job's run small (the run itself is the tests' tiny one)."""


@pytest.mark.parametrize(
    ("where", "argv"),
    [(w, a) for w, a in SEQSHARD if a[0] in RUN_COMMANDS[:3] and a[1] == "runs/tiny-cpu"],
    ids=[w for w, a in SEQSHARD if a[0] in RUN_COMMANDS[:3] and a[1] == "runs/tiny-cpu"],
)
def test_each_command_on_the_main_run_runs_on_a_small_run(where, argv, trained_run, tmp_path):
    """`seqshard eval runs/tiny-cpu` and the like, on a copy of the tests' trained run."""
    import shutil

    run_dir = Path(shutil.copytree(trained_run[1], tmp_path / "tiny-cpu"))
    name, rest = argv[0], argv[2:]
    assert main([name, str(run_dir), *rest, *SMALL.get(name, [])]) == 0, where


def _script(argv: list[str]) -> Path:
    return REPO / argv[0]


def test_each_script_a_doc_runs_exists():
    for where, argv in SCRIPTS:
        assert _script(argv).is_file(), f"{where}: {argv[0]} does not exist"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted({_script(a) for _, a in SCRIPTS}), ids=lambda p: p.name)
def test_each_script_a_doc_runs_answers_help(script):
    ran = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr[-2000:]


@pytest.mark.slow
def test_bench_hf_small_runs_whole():
    """Issue 41, item 5: `bench_hf.py --size small` ("for a quick look") crashed reading
    model.safetensors.index.json, which a model saved as one file has not."""
    ran = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_hf.py"), "--size", "small"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:] + ran.stdout[-2000:]
    assert "re-exported tensors bit-identical to the originals: 4 checked" in ran.stdout


def test_the_docs_example_of_the_plan_holds_the_roofline_note_show_prints():
    """Issue 41, item 14: docs/launching.md's plan said a plain-jit 1B ran at 48% MFU on an H100
    while `seqshard show` printed seqshard's own H200 figures (50% / 39%)."""
    from seqshard.plan.planner import plan
    from seqshard.plan.show import format_plan

    cfg = load_config(REPO / "configs" / "h100-1b.yaml")
    note = next(
        line for line in format_plan(plan(cfg, 1, "h100")).splitlines() if "roofline:" in line
    )
    assert note.strip() in (REPO / "docs" / "launching.md").read_text()


def test_what_the_commands_write_at_the_repository_root_is_ignored_by_git():
    """Issue 41, item 14: `seqshard export RUN hf/NAME` and `seqshard plot A B` wrote files git
    showed as new; so do runs/ and data/, which were ignored already."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["hf/tiny-cpu/config.json", "loss_compare.png", "runs/a/metrics.jsonl", "data/x/a.bin"]
    ran = subprocess.run(
        ["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert ran.stdout.split() == paths, ran.stdout + ran.stderr
