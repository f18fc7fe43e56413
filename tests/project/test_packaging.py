"""The YAML configs ship in the wheel and are found from any directory; `mindvl init-config` copies them.

test_wheel builds the wheel offline from a copy of the sources (`pip wheel --no-deps --no-build-isolation`),
checks every configs/**.yaml is inside it, installs it with `pip install --no-deps --target`, and runs
the installed `mindvl` (demo --quick --help, init-config, the config lookup of `train` and `demo`) in an
empty temporary directory with only the installed copy on PYTHONPATH.
"""
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from mindvl_ms.config import packaged
from mindvl_ms.config.base import to_dict
from mindvl_ms.config.train import load_run_config
from mindvl_ms.ops import cpu_kernels

from tests.support.paths import ROOT  # noqa: E402


def repo_configs():
    out = []
    for d, _, fs in os.walk(os.path.join(ROOT, "configs")):
        out += [os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "configs")).replace(os.sep, "/")
                for f in fs if f.endswith(".yaml")]
    return sorted(out)


def _load_any(path):
    """A packaged config loaded the way its command loads it (run, model or demo YAML)."""
    from mindvl_ms.config import load_model_config
    from mindvl_ms.recipes.demo.config import load_demo_config

    rel = path.replace(os.sep, "/")
    if "/model/" in rel:
        return to_dict(load_model_config(path))
    if "/parallel/" in rel:
        from mindvl_ms.config.base import read_yaml

        return read_yaml(path)
    if "/demo/" in rel:
        cfg, demo = load_demo_config(path, "/data")
        return to_dict(cfg), {k: v for k, v in demo.items() if k != "model"}
    return to_dict(load_run_config(path))


def test_source_checkout_lists_every_config():
    assert packaged.list_configs() == repo_configs()
    assert os.path.samefile(packaged.configs_dir(), os.path.join(ROOT, "configs"))


@pytest.mark.parametrize("name", ["stage/tiny-cpu.yaml", "stage/mindvl-671b.yaml", "demo/quick.yaml",
                                  "model/tiny-moe.yaml", "parallel/cpu-dp2.yaml"])
def test_init_config_copy_loads_like_the_original(tmp_path, name):
    written = packaged.copy_config("configs/" + name, str(tmp_path / "cfg"))
    assert written[0] == str(tmp_path / "cfg" / name)
    assert _load_any(written[0]) == _load_any(os.path.join(ROOT, "configs", name))
    if name == "demo/quick.yaml":  # quick includes full, full names the tiny model
        assert sorted(os.path.relpath(w, tmp_path / "cfg") for w in written) == \
            ["demo/full.yaml", "demo/quick.yaml", "model/tiny.yaml"]
    if name == "stage/tiny-cpu.yaml":
        assert sorted(os.path.relpath(w, tmp_path / "cfg") for w in written) == \
            ["model/tiny.yaml", "stage/tiny-cpu.yaml"]
    with pytest.raises(FileExistsError):
        packaged.copy_config(name, str(tmp_path / "cfg"))


def test_resolve_prefers_existing_files_then_the_package(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="mindvl_ms.config.packaged")
    path, from_pkg = packaged.resolve_config("configs/stage/tiny-cpu.yaml")
    assert from_pkg and os.path.samefile(path, os.path.join(ROOT, "configs", "stage", "tiny-cpu.yaml"))
    assert "using the packaged copy" in caplog.text
    os.makedirs("configs/stage")
    with open("configs/stage/tiny-cpu.yaml", "w") as f:
        f.write("seed: 1\n")
    assert packaged.resolve_config("configs/stage/tiny-cpu.yaml") == ("configs/stage/tiny-cpu.yaml", False)
    with pytest.raises(FileNotFoundError, match="no packaged config 'stage/nope.yaml'"):
        packaged.resolve_config("configs/stage/nope.yaml")


def _run(cmd, cwd, env, timeout=120):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in ("setup.py", "MANIFEST.in", "README.md", "requirements.txt", "requirements-test.txt"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("mindvl_ms", "configs"):
        shutil.copytree(os.path.join(ROOT, d), src / d, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"  # offline: only what is installed
    pip = [sys.executable, "-m", "pip"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
         str(src), env)
    (whl,) = [str(p) for p in (tmp_path / "dist").iterdir() if p.suffix == ".whl"]
    names = zipfile.ZipFile(whl).namelist()
    shipped = sorted(n[len("mindvl_ms/configs/"):] for n in names if n.startswith("mindvl_ms/configs/"))
    assert shipped == repo_configs()
    assert "mindvl_ms/config/packaged.py" in names
    for src in cpu_kernels.SOURCES:  # the CPU kernels' sources, built on first use
        assert f"mindvl_ms/ops/csrc/{src}" in names

    target = tmp_path / "site"
    _run(pip + ["install", "--no-deps", "-q", "--target", str(target), whl], str(tmp_path), env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env["PYTHONPATH"] = str(target)
    mindvl = [sys.executable, "-m", "mindvl_ms"]
    out = _run(mindvl + ["demo", "--quick", "--help"], str(work), env)
    assert "--quick" in out and "usage: mindvl demo" in out
    out = _run(mindvl + ["init-config", "stage/tiny-cpu.yaml"], str(work), env)
    assert (work / "configs" / "stage" / "tiny-cpu.yaml").is_file() and (work / "configs" / "model" / "tiny.yaml").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    check = f"""
import os, mindvl_ms
from mindvl_ms.config.packaged import resolve_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.recipes.demo.config import config_path, load_demo_config
assert mindvl_ms.__file__.startswith({str(target)!r}), mindvl_ms.__file__
p, pkg = resolve_config("configs/parallel/cpu-dp2.yaml")
assert pkg and p.startswith({str(target)!r}), p
cfg = load_run_config(resolve_config("configs/stage/tiny-cpu.yaml")[0])
local = load_run_config("configs/stage/tiny-cpu.yaml")   # the init-config copy
assert cfg == local and local.model.vision.depth > 0
run_cfg, demo = load_demo_config(config_path(True), "data")
assert config_path(True).startswith({str(target)!r}) and [s.name for s, _ in run_cfg.schedule()] == ["warmup", "multitask", "sft_256", "sft_512"], config_path(True)
from mindvl_ms.ops import cpu_kernels
assert all(os.path.isfile(os.path.join(cpu_kernels._source_dir(), s)) for s in cpu_kernels.SOURCES)
print("lookup ok", len(run_cfg.schedule()))

# `mindvl train` in this process (one MindSpore import for both commands): a missing packaged config, then
# from an empty directory a packaged config, resolved and named (then the config check stops it: no stages)
import sys
from mindvl_ms.cli import main
print("@@ rc", main(["train", "--config", "configs/stage/missing.yaml"]), file=sys.stderr, flush=True)
os.chdir({str(empty)!r})
print("@@ rc", main(["train", "--config", "configs/stage/tiny-cpu.yaml", "--set", "stages=[]"]), file=sys.stderr,
      flush=True)
"""
    r = subprocess.run([sys.executable, "-c", check], cwd=str(work), env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "lookup ok 4" in r.stdout, r.stderr
    missing, rc_missing, packaged, rc_packaged, _ = re.split(r"@@ rc (-?\d+)\n", r.stderr)
    assert rc_missing == "2" and "no packaged config 'stage/missing.yaml'" in missing, r.stderr
    assert rc_packaged == "2", r.stderr
    assert f"using the packaged copy {target}" in packaged and "`stages` is empty" in packaged
