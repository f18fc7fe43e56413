"""msrun data parallel: 2 CPU workers (mccl) vs one process on the same global batch.

Both runs see the same 8 rows per step (rank r takes rows [4r, 4r+4)), each rank accumulates its
micro-batches and the gradients are all-reduced once per step. The final parameters of both ranks
must equal the single-process parameters within fp32 tolerance.
"""
import os
import socket
import subprocess
import sys

import numpy as np

from tests.workers import train_msrun as train_msrun_worker

from tests.support.paths import ROOT  # noqa: E402
WORKER = os.path.join(ROOT, "tests", "workers", "train_msrun.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_msrun_workers_match_single_process(tmp_path):
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env_dp = dict(env, MASTER_PORT=str(free_port()), LOG_DIR=str(tmp_path / "logs"), CLUSTER_TIMEOUT="120")
    proc = subprocess.Popen([os.path.join(ROOT, "scripts", "msrun_train.sh"), "2", WORKER, dp], env=env_dp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train_msrun_worker.main(single)  # the single-process reference, in this process, meanwhile
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = "".join(open(os.path.join(tmp_path / "logs", f)).read()[-3000:]
                   for f in sorted(os.listdir(tmp_path / "logs")) if f.startswith("worker"))
    assert proc.returncode == 0, out[-2000:] + logs
    assert "RANKS 2" in logs
    ref = np.load(os.path.join(single, "params_rank0.npz"))
    worst = 0.0
    for rank in (0, 1):
        got = np.load(os.path.join(dp, f"params_rank{rank}.npz"))
        assert set(got.files) == set(ref.files)
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {k}")
            worst = max(worst, float(np.abs(got[k] - ref[k]).max()))
    print(f"max |dp - single| over all parameters: {worst:.3e}")
