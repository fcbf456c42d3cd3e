"""README.md stays true: its example runs, and CI runs exactly its test command."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", README, re.S)]


def test_readme_has_two_setup_commands():
    main_job, tests = _bash_blocks()[:2]
    assert "seqshard train configs/tiny-cpu.yaml" in main_job and "\n" not in main_job
    assert "pytest" in tests and "\n" not in tests


def test_ci_runs_the_readme_test_command():
    test_command = _bash_blocks()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_notation_example_runs():
    example = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "'all-gather': 3, 'reduce-scatter': 1" in out.stdout
