"""MindVL-MoE under msrun data parallel: 2 CPU workers (mccl) vs one process on the same global batch.

The worker (tests/workers/moe_msrun.py) trains the tiny MindVL-MoE through the project trainer on a mixed
image/text set. Both ranks must end with the single-process parameters (fp32 tolerance), and training must
have moved the router, the stacked expert weights and the balancing bias (updated on the global load).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import msrun
from tests.support.paths import ROOT

WORKER = os.path.join(ROOT, "tests", "workers", "moe_msrun.py")


@pytest.mark.slow  # msrun data parallel: tests/parallel/test_msrun_dp.py; MoE training: tests/train/test_moe_train.py
def test_two_msrun_workers_train_moe_like_one_process(tmp_path):
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    # each run in its own working directory: MindSpore writes graph dumps (rank_0/...) into the cwd
    os.makedirs(tmp_path / "cwd_single")
    os.makedirs(tmp_path / "cwd_dp")
    with msrun.launch(2, WORKER, [dp], tmp_path / "logs", cwd=str(tmp_path / "cwd_dp")) as job:
        # the single-process reference meanwhile (a one-core compile next to the workers' start-up)
        r = subprocess.run([sys.executable, WORKER, single], env=msrun.worker_env(), capture_output=True,
                           text=True, timeout=400, cwd=str(tmp_path / "cwd_single"))
        logs = job.finish(timeout=500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "RANKS 1" in r.stdout
    assert logs.count("RANKS 2") == 2
    ref = np.load(os.path.join(single, "params_rank0.npz"))
    init = np.load(single + "_init.npz")
    moved = [k for k in ref.files if not np.array_equal(ref[k], init[k])]
    assert any(k.endswith("mlp.gate.weight") for k in moved) and any(k.endswith("mlp.experts.down_proj")
                                                                     for k in moved), moved
    # the trainer's aux-loss-free bias update ran on the global load: ranks must agree on it too
    assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in moved), moved
    msrun.assert_ranks_match(single, dp)
