"""GRPO under msrun data parallel: 2 CPU workers, each sampling the rollouts of its own prompts, end with the
parameters of one process that runs the same global batch (rollout seeds come from the prompt's index and
the step, and the mini-batches are the same global response sets, so the global rollouts are identical).
Rows hold one response each in both runs: with different packings the same math sums in another order and
AdamW's normalisation magnifies the float differences of near-zero gradients (docs/PERFORMANCE.md, ## train)."""
import os

import pytest

from tests.support import msrun
from tests.support import post as H
from tests.support.paths import ROOT
from tests.workers import post_msrun as post_msrun_worker

WORKER = os.path.join(ROOT, "tests", "workers", "post_msrun.py")


@pytest.mark.slow  # msrun data parallel: tests/parallel/test_msrun_dp.py; GRPO steps: tests/train/post/test_grpo_train.py
def test_grpo_two_workers_match_single_process(tmp_path):
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    with msrun.launch(2, WORKER, [dp], tmp_path / "logs", cluster_timeout=300) as job:
        # the single-process reference, in this process, meanwhile, on the process's tiny model (its graphs
        # compiled once per process: tests/support/post.py fresh_model)
        post_msrun_worker.main(single, H.fresh_model()())
        logs = job.finish(timeout=600)
    assert "RANKS 2" in logs
    worst = msrun.assert_ranks_match(single, dp)
    print(f"max |dp - single| over all parameters: {worst:.3e}")
