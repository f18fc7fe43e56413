"""research/common.py's `in_parallel` and research/prefetch.py: demo runs go `JOBS` at a time after the base,
a run two experiments share is trained once, and the results come back in the order asked."""
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from tests.research.helpers import load

common = load("common.py", "research_common")


@pytest.fixture
def timed_runs(tmp_path, monkeypatch):
    """common.run replaced by a stub that writes a report into --out and records when it ran and how many runs
    were active; with `pairs` = n the first n branches wait for a partner (a barrier), so runs going one at a
    time would time out."""
    runs, lock = SimpleNamespace(log=[], pairs=0), threading.Lock()
    active, started = [0], [0]
    pair = threading.Barrier(2, timeout=60)   # the first `pairs` branches meet in pairs: they must run at once

    def fake_run(cmd, log_path):
        out = cmd[cmd.index("--out") + 1]
        with lock:
            active[0] += 1
            start, peak = time.perf_counter(), active[0]
            branch = not os.path.basename(log_path).startswith("base-")
            started[0] += branch
            meet = branch and started[0] <= runs.pairs
        if meet:
            pair.wait()
        time.sleep(0.1)
        os.makedirs(out, exist_ok=True)
        sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({"sets": sets, "out_dir": out,
                       "stages": {"multitask": {"checkpoint": str(tmp_path / "mt" / "checkpoint-2")}}}, f)
        with lock:
            active[0] -= 1
            runs.log.append({"name": os.path.basename(log_path), "sets": sets, "start": start,
                             "end": time.perf_counter(), "peak": peak})
        return 0.1

    monkeypatch.setattr(common, "OUT", str(tmp_path / "out"))
    monkeypatch.setattr(common, "run", fake_run)
    monkeypatch.setattr(common.S, "recipe", common.SMOKE)
    monkeypatch.setattr(common, "JOBS", 2)
    return runs


def test_in_parallel_trains_the_base_alone_then_two_at_a_time_in_order(timed_runs):
    timed_runs.pairs = 4
    calls = [lambda s=s: common.branch("arm", s, ["stages.0.max_steps=2"]) for s in range(5)]
    runs = common.in_parallel(calls)
    assert [r["sets"] for r in runs] == [[f"seed={s}", "stages.0.max_steps=2"] for s in range(5)]  # in order
    base, branches = timed_runs.log[0], timed_runs.log[1:]
    assert base["name"].startswith("base-") and len(branches) == 5
    assert all(b["start"] >= base["end"] for b in branches)           # every branch after the base
    assert max(b["peak"] for b in branches) == 2                       # two at a time (they met), never more


def test_a_run_asked_for_twice_at_once_is_trained_once(timed_runs):
    runs = common.in_parallel([lambda: common.recipe_branch(1)] * 2)
    assert len(timed_runs.log) == 1 + 1                                   # the base, then the branch once
    assert sorted(r["cached"] for r in runs) == [False, True] and runs[0]["key"] == runs[1]["key"]


def test_branch_config_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "OUT", str(tmp_path / "out"))
    path = common.branch_config(str(tmp_path / "ckpt"), common.SMOKE)
    with open(path, "a") as f:      # a marker: a second call must not rewrite a file a branch may be reading
        f.write("# read by a running branch\n")
    assert common.branch_config(str(tmp_path / "ckpt"), common.SMOKE) == path
    assert open(path).read().endswith("# read by a running branch\n")


def test_prefetch_lists_each_shared_run_once_recipe_branches_first():
    prefetch = load("prefetch.py", "research_prefetch")
    runs = prefetch.needed(["balanced_loss", "grounding_share", "merge_vs_sft", "resolution_search"], (0, 1, 2))
    labels = list(runs)
    # (c) 4 arms x 3 seeds, one of them the recipe; (e) 2 arms, one the recipe; (a) and (b) the recipe only
    assert len(labels) == 3 * 3 + 3 + 3 and len(set(labels)) == len(labels)
    assert labels[:3] == ["sft_seed0", "sft_seed1", "sft_seed2"]
    assert {lb for lb in labels if lb.startswith("grounding_")} == {f"grounding_1x_seed{s}" for s in (0, 1, 2)}
    with pytest.raises(SystemExit, match="no demo_runs"):
        prefetch.needed(["packing"], (0,))


def test_runs_by_arm_groups_the_parallel_runs_arm_by_arm(timed_runs):
    def run(arm, seed):
        return common.branch(f"arm_{arm}", seed, [f"stages.0.max_steps={arm}"])

    runs = common.runs_by_arm(["2", "3"], (0, 1, 2), run)
    assert {a: [r["sets"] for r in rs] for a, rs in runs.items()} == {
        a: [[f"seed={s}", f"stages.0.max_steps={a}"] for s in (0, 1, 2)] for a in ("2", "3")}
