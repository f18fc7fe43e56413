"""MindVL-MoE under msrun data parallel: 2 CPU workers (mccl) vs one process on the same global batch.

The worker (tests/workers/moe_msrun.py) trains the tiny MindVL-MoE (one dense and one MoE layer, the MTP layer,
a 1-block ViT) through the project trainer on a mixed image/text set; the reference runs in this process.
Both ranks must end with the single-process parameters (fp32 tolerance), and training must have moved the
router, the stacked expert weights and the balancing bias (updated on the global load).
"""
import os

import numpy as np
import pytest

from tests.support import msrun
from tests.support.paths import ROOT
from tests.workers import moe_msrun as moe_msrun_worker

WORKER = os.path.join(ROOT, "tests", "workers", "moe_msrun.py")


@pytest.mark.slow  # msrun data parallel: tests/parallel/test_msrun_dp.py; MoE training: tests/train/test_moe_train.py
def test_two_msrun_workers_train_moe_like_one_process(tmp_path, monkeypatch, capsys):
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    # each run in its own working directory: MindSpore writes graph dumps (rank_0/...) into the cwd
    os.makedirs(tmp_path / "cwd_single")
    os.makedirs(tmp_path / "cwd_dp")
    with msrun.launch(2, WORKER, [dp], tmp_path / "logs", cwd=str(tmp_path / "cwd_dp")) as job:
        # the single-process reference, in this process, meanwhile (a one-core compile next to the workers'
        # start-up, without a process of its own to start)
        monkeypatch.chdir(tmp_path / "cwd_single")
        moe_msrun_worker.main(single)
        logs = job.finish(timeout=500)
    assert "RANKS 1" in capsys.readouterr().out
    assert logs.count("RANKS 2") == 2
    ref = np.load(os.path.join(single, "params_rank0.npz"))
    init = np.load(single + "_init.npz")
    moved = [k for k in ref.files if not np.array_equal(ref[k], init[k])]
    assert any(k.endswith("mlp.gate.weight") for k in moved) and any(k.endswith("mlp.experts.down_proj")
                                                                     for k in moved), moved
    # the trainer's aux-loss-free bias update ran on the global load: ranks must agree on it too
    assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in moved), moved
    msrun.assert_ranks_match(single, dp)
