"""Every module imports on its own, in a fresh interpreter (no import cycle depends on order)."""

import pkgutil
import subprocess
import sys

import seqshard

MODULES = sorted(m.name for m in pkgutil.walk_packages(seqshard.__path__, "seqshard."))


def test_each_module_imports_first():
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    # One interpreter per module: a cycle only shows when its module is imported first.
    procs = {
        m: subprocess.Popen([sys.executable, "-c", code, m], stderr=subprocess.PIPE, text=True)
        for m in MODULES
    }
    failures = {
        m: p.communicate()[1].strip().splitlines()[-1] for m, p in procs.items() if p.wait()
    }
    assert not failures, failures
