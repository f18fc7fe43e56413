"""research/run_all.sh finds the launchers of the interpreter it is given: `PYTHON=ENV/bin/python bash
research/run_all.sh` without ENV activated must start ENV's `msrun` (packing's dp=2 arm,
scripts/msrun_train.sh) and `mindvl`, not fail on a PATH that lacks them."""
import os
import stat
import subprocess

from tests.support.paths import ROOT


def _script(path, text):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def test_the_interpreters_bin_comes_first_on_path(tmp_path):
    env_bin = tmp_path / "env" / "bin"
    env_bin.mkdir(parents=True)
    for tool in ("msrun", "mindvl"):
        _script(env_bin / tool, "exit 0\n")
    # stands in for ENV/bin/python running research/packing/run.py: reports what the experiment would start
    _script(env_bin / "python", 'echo "msrun=$(command -v msrun) mindvl=$(command -v mindvl)"\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(env_bin / "python"),
           "RESEARCH_OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", os.path.join(ROOT, "research", "run_all.sh"), "packing"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"msrun={env_bin}/msrun mindvl={env_bin}/mindvl" in out.stdout, out.stdout
