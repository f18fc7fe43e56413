"""msrun data parallel: 2 CPU workers (mccl) vs one process on the same global batch.

Both runs see the same 8 rows per step (rank r takes rows [4r, 4r+4)), each rank accumulates its
micro-batches and the gradients are all-reduced once per step. The final parameters of both ranks
must equal the single-process parameters within fp32 tolerance. The same job's workers then run
`parallel.runtime.setup` again, as a worker that trains several runs does (tests/workers/train_msrun.py).
"""
import os
from types import SimpleNamespace

import pytest

from tests.support import msrun
from tests.support.paths import ROOT
from tests.workers import train_msrun as train_msrun_worker

pytestmark = pytest.mark.slow  # over ~12 s: -m 'not slow' leaves it out, CI runs it

WORKER = os.path.join(ROOT, "tests", "workers", "train_msrun.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The 2-rank job and the single-process reference (in this process, while the job runs): their output
    directories and the workers' logs, read by every test of the module."""
    base = tmp_path_factory.mktemp("msrun_dp")
    single, dp = str(base / "single"), str(base / "dp")
    with msrun.launch(2, WORKER, [dp], base / "logs") as running:
        train_msrun_worker.main(single)
        logs = running.finish(timeout=400)
    return SimpleNamespace(single=single, dp=dp, logs=logs)


def test_two_msrun_workers_match_single_process(job):
    assert "RANKS 2" in job.logs
    worst = msrun.assert_ranks_match(job.single, job.dp)
    print(f"max |dp - single| over all parameters: {worst:.3e}")


def test_setup_runs_again_in_a_joined_worker(job):
    """Rank 1's second setup keeps the device id init() gave it (MindSpore refuses set_device with id 0 then)."""
    for rank in (0, 1):
        assert f"SETUP AGAIN ok rank {rank} of 2\n" in job.logs, job.logs
