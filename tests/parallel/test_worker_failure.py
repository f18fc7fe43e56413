"""A worker that dies under msrun: 2-rank data parallel of the tiny stand-in (tests/workers/kill_target.py:
8 steps, a checkpoint every 2) launched by scripts/msrun_train.sh, one rank SIGKILLed in the middle of a
step or in the middle of a checkpoint save.

- the launcher exits non-zero within FAILURE_TIMEOUT + 15 s of the death (FAILURE_TIMEOUT set to 15 s
  here, half the default), and no worker, scheduler or log tail of the job is left;
- every checkpoint directory on disk is complete and loads; the killed save is only a temporary directory,
  never the resume point;
- `--resume` through the same launcher ends with both ranks' parameters bit-identical to an uninterrupted run.
A killed msrun takes its workers, scheduler and log tails with it (parallel/runtime.py end_with_launcher).
"""
import os
import signal
import time

import numpy as np
import pytest

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.pretrained import load_into
from tests.support import msrun
from tests.support.paths import ROOT
from tests.support.train_tiny import TinyVLM

pytestmark = pytest.mark.slow

WORKER = os.path.join(ROOT, "tests", "workers", "kill_target.py")
FAILURE_TIMEOUT = 15  # seconds; scripts/msrun_train.sh passes it to MindSpore as MS_NODE_TIMEOUT
BOUND = FAILURE_TIMEOUT + 15  # death -> exit: the scheduler's heartbeat checks and exit, msrun's 1 s polls


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Both ranks' final parameters of the uninterrupted 2-rank run."""
    base = tmp_path_factory.mktemp("reference")
    msrun.run(2, WORKER, [base / "out"], base / "logs", timeout=600)
    return {r: dict(np.load(base / "out" / f"params_rank{r}.npz")) for r in (0, 1)}


def leftovers(marker: str, wait: float = 0.0) -> list:
    """Processes whose command line names `marker`, after up to `wait` seconds for them to go; any found
    are killed (they are this test's) and returned."""
    deadline = time.time() + wait
    while True:
        left = msrun.processes_with(marker)
        if not left or time.time() >= deadline:
            break
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def killed_run(tmp_path, rank: int, kill_at: str):
    """Run until `rank` kills itself at `kill_at`; checks the exit and leftovers. Returns the output dir."""
    out = tmp_path / "out"
    env = {"FAILURE_TIMEOUT": str(FAILURE_TIMEOUT), "KILL_RANK": str(rank), "KILL_AT": kill_at}
    with msrun.launch(2, WORKER, [out], tmp_path / "logs", env=env) as job:
        status = job.wait(timeout=600)
    logs = job.output[-2000:] + msrun.worker_logs(tmp_path / "logs")
    marker = out / f"killed_rank{rank}"
    assert marker.is_file(), logs
    elapsed = job.ended - float(marker.read_text())
    print(f"{kill_at} on rank {rank}: launcher exit status {status}, {elapsed:.1f} s after the death")
    assert status != 0, logs
    assert elapsed <= BOUND, f"the launcher took {elapsed:.1f} s (bound {BOUND} s)\n{logs}"
    assert not leftovers(str(out)), "processes of the job outlived the launcher"
    assert not leftovers(str(tmp_path / "logs")), "msrun's log tails outlived the launcher"
    return out


def check_checkpoints(out) -> int:
    """Every checkpoint directory complete and loadable, anything else an unfinished save's temporary
    directory; returns the step of the resume point (a complete checkpoint)."""
    stage_dir = out / "dp"
    for name in sorted(os.listdir(stage_dir)):
        path = str(stage_dir / name)
        if name.startswith("checkpoint-"):
            assert ts.is_complete(path), name
            state, tensors, optim = ts.load_checkpoint(path)
            assert state["step"] == int(name.split("-")[1]) and optim
            load_into(TinyVLM(), tensors)
        else:
            assert name.startswith(".") and ".tmp-" in name, name
    latest = ts.find_latest(str(out))
    assert os.path.dirname(latest) == str(stage_dir)
    return ts.load_checkpoint(latest)[0]["step"]


def resume_matches(out, tmp_path, reference) -> None:
    """--resume through the same launcher; both ranks end bit-identical to the uninterrupted run."""
    logs = msrun.run(2, WORKER, [out, "--resume"], tmp_path / "logs_resume", timeout=600)
    assert logs.count("DONE rank") == 2
    assert not [n for n in os.listdir(out / "dp") if ".tmp-" in n]  # the unfinished save was cleaned up
    for rank in (0, 1):
        got = np.load(out / f"params_rank{rank}.npz")
        assert set(got.files) == set(reference[rank])
        for k, want in reference[rank].items():
            assert np.array_equal(got[k], want), f"rank {rank} {k}: max diff {np.abs(got[k] - want).max()}"


def test_kill_mid_step_then_resume(tmp_path, reference):
    """Rank 1 dies in step 5 before the gradient all-reduce: rank 0 is inside the step's collectives."""
    out = killed_run(tmp_path, 1, "step:5")
    assert check_checkpoints(out) == 4
    assert sorted(os.listdir(out / "dp")) == ["checkpoint-000002", "checkpoint-000004"]
    resume_matches(out, tmp_path, reference)


def test_kill_during_checkpoint_save_then_resume(tmp_path, reference):
    """Rank 0 (the one that writes checkpoints) dies in its 2nd save, after the weights, before the
    optimizer state; rank 1 goes on into step 4's collectives."""
    out = killed_run(tmp_path, 0, "save:2")
    assert check_checkpoints(out) == 2
    names = sorted(os.listdir(out / "dp"))
    assert names[0].startswith(".checkpoint-000004.tmp-") and names[1:] == ["checkpoint-000002"], names
    resume_matches(out, tmp_path, reference)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_killed_msrun_takes_its_processes(tmp_path):
    """SIGKILL to msrun itself (none of its code runs) while rank 1 holds in step 3: the workers and the
    scheduler die with it, the launcher ends what is left of msrun's process group (its log tails) and exits
    128 + 9."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    with msrun.launch(2, WORKER, [out], logs, env={"KILL_RANK": "1", "KILL_AT": "hold:3"}) as job:
        deadline = time.time() + 600
        while not (out / "held_rank1").exists() and job.proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert job.proc.poll() is None, job.output + msrun.worker_logs(logs)
        running = msrun.processes_with(str(out))  # the launcher, msrun, the scheduler and 2 workers
        (msrun_pid,) = [p for p in running if parent(p) == job.proc.pid]
        assert len(running) == 5, running
        os.kill(msrun_pid, signal.SIGKILL)
        status = job.wait(timeout=60)
    assert status == 128 + signal.SIGKILL
    assert not leftovers(str(out), wait=10), "workers or the scheduler outlived msrun"
    assert not leftovers(str(logs)), "msrun's log tails outlived it"
    assert not (out / "params_rank0.npz").exists()

