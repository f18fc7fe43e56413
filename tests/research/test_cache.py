"""research/common.py's run cache: keyed by the code (source hash) and the resolved config, not by the
command alone, so a changed code or config never reuses an old result."""
import json
import os

import pytest

from tests.research.helpers import load

common = load("common.py", "research_common")


def _tree(root, body="x = 1\n"):
    os.makedirs(os.path.join(root, "mindvl_ms", "sub", "__pycache__"), exist_ok=True)
    with open(os.path.join(root, "mindvl_ms", "sub", "a.py"), "w") as f:
        f.write(body)
    with open(os.path.join(root, "mindvl_ms", "sub", "__pycache__", "a.pyc"), "w") as f:
        f.write("ignored")


def test_source_hash_follows_file_contents_and_names(tmp_path):
    root = str(tmp_path)
    _tree(root)
    h1 = common.source_hash(root, ("mindvl_ms",))
    common._SOURCE_HASH.clear()
    assert common.source_hash(root, ("mindvl_ms",)) == h1          # same tree, same hash
    with open(os.path.join(root, "mindvl_ms", "sub", "__pycache__", "a.pyc"), "w") as f:
        f.write("changed")                                         # bytecode is not source
    common._SOURCE_HASH.clear()
    assert common.source_hash(root, ("mindvl_ms",)) == h1
    _tree(root, "x = 2\n")
    common._SOURCE_HASH.clear()
    assert common.source_hash(root, ("mindvl_ms",)) != h1          # an edited source file
    common._SOURCE_HASH.clear()


def test_run_key_changes_with_command_config_include_and_source(tmp_path):
    inc, cfg = tmp_path / "inc.yaml", tmp_path / "run.yaml"
    inc.write_text("stages: [{name: a, max_steps: 4}]\n")
    cfg.write_text("_include_: inc.yaml\nseed: 0\n")
    k = common.run_key(["demo", "--set", "seed=0"], [str(cfg)], source="s1")
    assert k == common.run_key(["demo", "--set", "seed=0"], [str(cfg)], source="s1")
    assert k != common.run_key(["demo", "--set", "seed=1"], [str(cfg)], source="s1")
    assert k != common.run_key(["demo", "--set", "seed=0"], [str(cfg)], source="s2")
    inc.write_text("stages: [{name: a, max_steps: 5}]\n")           # only the included file changes
    assert k != common.run_key(["demo", "--set", "seed=0"], [str(cfg)], source="s1")


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """common.demo with `run` replaced by a stub that writes report.json into --out; returns the calls."""
    calls = []

    def fake_run(cmd, log_path):
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({"scores": {"merged": {"vqa": len(calls)}}, "out_dir": out}, f)
        calls.append(cmd)
        return 1.0

    monkeypatch.setattr(common, "OUT", str(tmp_path / "out"))
    monkeypatch.setattr(common, "run", fake_run)
    return calls


def test_demo_reruns_when_the_config_changes_and_reuses_otherwise(tmp_path, fake_runs):
    cfg = tmp_path / "scale.yaml"
    cfg.write_text("seed: 0\nstages: [{name: a, max_steps: 4}]\n")
    first = common.demo("arm", ["seed=0"], str(cfg))
    again = common.demo("arm", ["seed=0"], str(cfg))
    assert len(fake_runs) == 1 and again["cached"] and not first["cached"]
    assert again["scores"] == first["scores"] and again["commit"] == first["commit"]
    cfg.write_text("seed: 0\nstages: [{name: a, max_steps: 5}]\n")  # same name and command, new config
    changed = common.demo("arm", ["seed=0"], str(cfg))
    assert len(fake_runs) == 2 and not changed["cached"]
    assert changed["scores"]["merged"]["vqa"] == 1


def test_demo_reruns_when_the_code_changes(tmp_path, fake_runs, monkeypatch):
    cfg = tmp_path / "scale.yaml"
    cfg.write_text("seed: 0\n")
    common.demo("arm", [], str(cfg))
    monkeypatch.setattr(common, "source_hash", lambda *a: "another code version")
    rerun = common.demo("arm", [], str(cfg))
    assert len(fake_runs) == 2 and not rerun["cached"]


def test_branch_config_is_the_sft_stage_from_the_base_checkpoint_on_the_base_data(tmp_path, monkeypatch):
    from mindvl_ms.recipes.demo.config import data_seed, load_demo_config

    monkeypatch.setattr(common, "OUT", str(tmp_path / "out"))
    ckpt = str(tmp_path / "base" / "multitask" / "checkpoint-002000")
    path = common.branch_config(ckpt, common.RECIPE)
    assert path == common.branch_config(ckpt, common.RECIPE)          # named by content: the same file
    cfg, demo = load_demo_config(path, str(tmp_path / "data"), ["seed=1", "stages.0.loss.type=token_mean"])
    assert cfg.init_from == ckpt
    assert [s.name for s in cfg.stages] == ["sft"] and cfg.stages[0].loss.type == "token_mean"
    assert [v.name for v, _ in cfg.schedule()] == ["sft_256", "sft_512"]
    assert demo["eval_variants"] is False and cfg.seed == 1
    # the branch draws the base's data (seed 0) whatever its own seed, and evaluates at one resolution
    assert data_seed(demo, cfg.seed) == common.BASE_SEED == 0
    assert demo["resolution_grid"] == {"min": [16], "max": [16]} and demo["phase_processes"] is False
    _, with_variants = load_demo_config(common.branch_config(ckpt, common.RECIPE, eval_variants=True), "/tmp/d")
    assert with_variants["eval_variants"] is True
    other = common.branch_config(str(tmp_path / "other"), common.RECIPE)
    assert other != path                       # another base: another config, so another cache key


def test_one_base_for_every_branch(tmp_path, fake_runs, monkeypatch):
    """Branches of three seeds train the base once (the demo recipe at seed 0) and start from its multitask
    checkpoint; the recipe's branch is one run shared by its callers."""
    monkeypatch.setattr(common, "RECIPE", common.SMOKE)
    monkeypatch.setattr(common.S, "recipe", common.SMOKE)
    base_report = {"stages": {"multitask": {"checkpoint": str(tmp_path / "mt" / "checkpoint-2")}}}
    real_demo = common.demo

    def demo(name, sets=(), config=None):
        rep = real_demo(name, sets, config)
        return dict(rep, **base_report) if name == "base" else rep

    monkeypatch.setattr(common, "demo", demo)
    runs = [common.branch("arm", s, ["stages.0.max_steps=2"]) for s in (0, 1, 2)]
    again = common.recipe_branch(1), common.recipe_branch(1)
    cmds = [" ".join(c) for c in fake_runs]
    assert sum("--set seed=0" in c and "smoke.yaml" in c for c in cmds) == 1     # the base, once
    assert len(fake_runs) == 1 + 3 + 1 and again[1]["cached"]
    branch_cfgs = {c[c.index("--config") + 1] for c in fake_runs[1:4]}
    assert len(branch_cfgs) == 1                                   # one config: the seeds differ in --set only
    assert [c[c.index("--set") + 1] for c in fake_runs[1:4]] == ["seed=0", "seed=1", "seed=2"]
    assert str(tmp_path / "mt" / "checkpoint-2") in open(branch_cfgs.pop()).read()
    assert all(r["base_commit"] == runs[0]["base_commit"] for r in runs)
