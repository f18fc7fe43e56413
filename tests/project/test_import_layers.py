"""The package's layer order and its absence of import circles (`.importlinter` at the repository root),
checked by import-linter, which reads every import statement, those inside functions included; and the
command line's start-up, which must build its parser without loading MindSpore.
Run: pytest -q tests/project/test_import_layers.py"""
import os
import shutil
import subprocess
import sys

from tests.support.paths import ROOT


def test_lint_imports_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert exe, "import-linter is not installed (it is in requirements-test.txt)"
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_help_does_not_load_mindspore():
    code = ("import sys; from mindvl_ms.cli import build_parser; build_parser(); "
            "heavy = sorted(m for m in ('mindspore', 'mindformers', 'torch', 'cv2') if m in sys.modules); "
            "print(','.join(heavy))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"`mindvl --help` imports {r.stdout.strip()}"
