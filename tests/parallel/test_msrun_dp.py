"""msrun data parallel: 2 CPU workers (mccl) vs one process on the same global batch.

Both runs see the same 8 rows per step (rank r takes rows [4r, 4r+4)), each rank accumulates its
micro-batches and the gradients are all-reduced once per step. The final parameters of both ranks
must equal the single-process parameters within fp32 tolerance.
"""
import os

from tests.support import msrun
from tests.support.paths import ROOT
from tests.workers import train_msrun as train_msrun_worker

WORKER = os.path.join(ROOT, "tests", "workers", "train_msrun.py")


def test_two_msrun_workers_match_single_process(tmp_path):
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    with msrun.launch(2, WORKER, [dp], tmp_path / "logs") as job:
        train_msrun_worker.main(single)  # the single-process reference, in this process, meanwhile
        logs = job.finish(timeout=400)
    assert "RANKS 2" in logs
    worst = msrun.assert_ranks_match(single, dp)
    print(f"max |dp - single| over all parameters: {worst:.3e}")
