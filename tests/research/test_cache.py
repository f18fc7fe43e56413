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


def test_branch_config_is_the_sft_stage_from_the_base_checkpoint(tmp_path, monkeypatch):
    from mindvl_ms.recipes.demo.config import load_demo_config

    monkeypatch.setattr(common, "OUT", str(tmp_path / "out"))
    path = common.branch_config(str(tmp_path / "base" / "multitask" / "checkpoint-000060"), common.SCALE)
    assert path == common.branch_config(str(tmp_path / "base" / "multitask" / "checkpoint-000060"), common.SCALE)
    cfg, demo = load_demo_config(path, str(tmp_path / "data"), ["seed=1", "stages.0.loss.type=balanced"])
    assert cfg.init_from == str(tmp_path / "base" / "multitask" / "checkpoint-000060")
    assert [s.name for s in cfg.stages] == ["sft"] and cfg.stages[0].loss.type == "balanced"
    assert [v.name for v, _ in cfg.schedule()] == ["sft_256", "sft_512"]
    assert demo["eval_variants"] is False and cfg.seed == 1
    other = common.branch_config(str(tmp_path / "other"), common.SCALE)
    assert other != path                       # another base: another config, so another cache key
