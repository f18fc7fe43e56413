"""A worker that dies under msrun: 2-rank data parallel of the tiny stand-in (tests/workers/kill_target.py:
4 steps, a checkpoint after each) launched by scripts/msrun_train.sh, one rank SIGKILLed in the middle of a
step or in the middle of a checkpoint save.

- the launcher exits non-zero within FAILURE_TIMEOUT + 15 s of the death (FAILURE_TIMEOUT set to 8 s
  here, about a quarter of the default), and no worker, scheduler or log tail of the job is left;
- every checkpoint directory on disk is complete and loads; the killed save is only a temporary directory,
  never the resume point;
- `--resume` through the same launcher ends with both ranks' parameters bit-identical to an uninterrupted run
  (the reference and both resumes are three runs of one job's workers, tests/workers/kill_target.py).
A killed msrun takes its workers, scheduler and log tails with it (parallel/runtime.py end_with_launcher).
"""
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pytest

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.pretrained import load_into
from tests.support import msrun
from tests.support.paths import ROOT
from tests.support.train_tiny import TinyVLM

pytestmark = pytest.mark.slow

WORKER = os.path.join(ROOT, "tests", "workers", "kill_target.py")
FAILURE_TIMEOUT = 8  # seconds; scripts/msrun_train.sh passes it to MindSpore as MS_NODE_TIMEOUT
BOUND = FAILURE_TIMEOUT + 15  # death -> exit: the scheduler's heartbeat checks and exit, msrun's 1 s polls
KILLS = {"mid_step": (1, "step:2"), "mid_save": (0, "save:2")}  # name -> (rank, KILL_AT)
# priorities of the jobs started beside a killed job's exit (`jobs`): the second killed job below the first,
# the resuming job and `held` below both, so that no start-up slows an exit the test times
NICE_SECOND, NICE_REST = 10, 19


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Dict[str, str]:
    """The workers' environment for MindSpore's compile cache, shared by the module's jobs: every job runs the
    same script and graphs, so the first job's ranks save them and the later ones load them instead of
    compiling (rank r's graphs under rank_<r>)."""
    return {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(tmp_path_factory.mktemp("compile_cache"))}


@dataclass
class Killed:
    """A job one of whose ranks killed itself: what the launcher and the machine showed when it ended."""
    out: Path                # the run directory as the kill left it
    status: int              # the launcher's exit status
    elapsed: Optional[float]  # seconds from the death (the rank's marker file) to the launcher's exit
    left_job: list           # processes naming `out` still there when the launcher had exited (killed since)
    left_tails: list         # msrun's log tails still there (killed since)
    logs: str                # the launcher's output and the workers' logs, for the messages


def start_kill(base: Path, rank: int, kill_at: str, cache: Dict[str, str], nice: int = 0) -> msrun.MsrunJob:
    """Launch a job whose `rank` kills itself at `kill_at` (FAILURE_TIMEOUT as above); see `ended`."""
    env = {"FAILURE_TIMEOUT": str(FAILURE_TIMEOUT), "KILL_RANK": str(rank), "KILL_AT": kill_at, **cache}
    return msrun.launch(2, WORKER, [base / "out"], base / "logs", env=env, nice=nice)


def wait_for_death(job: msrun.MsrunJob, marker: Path) -> None:
    """Until the killed rank's marker file is there (or the job has ended without it)."""
    deadline = time.time() + 600
    while not marker.is_file() and job.proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)


def ended(job: msrun.MsrunJob, base: Path, rank: int) -> Killed:
    """Wait for a killed job's launcher; what it and the machine showed."""
    out = base / "out"
    with job:
        status = job.wait(timeout=600)
    marker = out / f"killed_rank{rank}"
    elapsed = job.ended - float(marker.read_text()) if marker.is_file() else None
    return Killed(out, status, elapsed, leftovers(str(out)), leftovers(str(base / "logs")),
                  job.output[-2000:] + msrun.worker_logs(base / "logs"))


def copy_run(src: Path, dst: Path) -> None:
    """A copy of a killed run directory, appearing at `dst` at once (the resuming workers wait for it)."""
    shutil.copytree(src, dst.with_name(dst.name + ".copying"))
    os.rename(dst.with_name(dst.name + ".copying"), dst)


class Held:
    """The job test_killed_msrun_takes_its_processes kills, rank 1 holding in step 1: `jobs` starts it while
    it waits for the killed jobs to end (the graphs are in the compile cache by then), else the test does."""

    def __init__(self, base: Path, cache: Dict[str, str]):
        self.out, self.logs, self.cache, self.job = base / "out", base / "logs", cache, None

    def start(self, nice: int = 0) -> msrun.MsrunJob:
        if self.job is None:
            env = {"KILL_RANK": "1", "KILL_AT": "hold:1", **self.cache}
            self.job = msrun.launch(2, WORKER, [self.out], self.logs, env=env, nice=nice)
        return self.job


@pytest.fixture(scope="module")
def held(tmp_path_factory, compile_cache):
    h = Held(tmp_path_factory.mktemp("held"), compile_cache)
    yield h
    if h.job is not None:
        h.job.__exit__(None, None, None)  # stopped if a failed test left it running


@dataclass
class Jobs:
    killed: Dict[str, Killed]
    resumed: Dict[str, Path]   # a copy of each killed run directory, continued with --resume
    reference: Dict[int, Dict[str, np.ndarray]]  # both ranks' final parameters of the uninterrupted run
    logs: str                  # the workers' logs of the job that trained the reference and resumed


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, compile_cache, held) -> Jobs:
    """The two killed jobs, then one job through the same launcher whose workers train the uninterrupted
    reference and resume a copy of each killed run, one run after another (one start-up and cluster for the
    three runs instead of three jobs). The copies leave the killed directories as the kills left them.
    The jobs overlap where one waits: the second killed job starts when the first one's rank has died (its
    graphs are in the compile cache by then), the resuming job and the job test_killed_msrun_takes_its_processes
    kills (`held`) when the first killed job has ended, each at a lower priority than the killed job whose exit
    the test is timing (NICE_SECOND, NICE_REST); each copy is made when its killed job has ended, and the
    resuming workers wait for it (tests/workers/kill_target.py)."""
    base = tmp_path_factory.mktemp("jobs")
    (first, (rank_a, at_a)), (second, (rank_b, at_b)) = KILLS.items()
    resumed = {name: base / name / "resumed" for name in KILLS}
    args = [base / "reference"] + [a for name in KILLS for a in (resumed[name], "--resume")]
    job_a = start_kill(base / first, rank_a, at_a, compile_cache)
    with job_a:
        wait_for_death(job_a, base / first / "out" / f"killed_rank{rank_a}")
        job_b = start_kill(base / second, rank_b, at_b, compile_cache, nice=NICE_SECOND)
        with job_b:
            killed = {first: ended(job_a, base / first, rank_a)}
            copy_run(killed[first].out, resumed[first])
            with msrun.launch(2, WORKER, args, base / "logs_resume", env=compile_cache, nice=NICE_REST) as job:
                held.start(nice=NICE_REST)
                killed[second] = ended(job_b, base / second, rank_b)
                copy_run(killed[second].out, resumed[second])
                job.finish(timeout=900)
    logs = msrun.worker_logs(base / "logs_resume", tail=100_000)  # every run's DONE lines
    reference = {r: dict(np.load(base / "reference" / f"params_rank{r}.npz")) for r in (0, 1)}
    return Jobs(killed, resumed, reference, logs)


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


def check_kill(k: Killed, rank: int, kill_at: str) -> Path:
    """The rank died; the launcher exited non-zero within BOUND of it, leaving nothing running. The run dir."""
    assert k.elapsed is not None, k.logs  # the rank's marker file
    print(f"{kill_at} on rank {rank}: launcher exit status {k.status}, {k.elapsed:.1f} s after the death")
    assert k.status != 0, k.logs
    assert k.elapsed <= BOUND, f"the launcher took {k.elapsed:.1f} s (bound {BOUND} s)\n{k.logs}"
    assert not k.left_job, "processes of the job outlived the launcher"
    assert not k.left_tails, "msrun's log tails outlived the launcher"
    return k.out


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


def resume_matches(jobs: Jobs, name: str) -> None:
    """--resume through the same launcher; both ranks end bit-identical to the uninterrupted run."""
    out = jobs.resumed[name]
    assert sum(f"DONE rank {r} {out}\n" in jobs.logs for r in (0, 1)) == 2
    assert not [n for n in os.listdir(out / "dp") if ".tmp-" in n]  # the unfinished save was cleaned up
    for rank in (0, 1):
        got = np.load(out / f"params_rank{rank}.npz")
        assert set(got.files) == set(jobs.reference[rank])
        for k, want in jobs.reference[rank].items():
            assert np.array_equal(got[k], want), f"rank {rank} {k}: max diff {np.abs(got[k] - want).max()}"


def test_kill_mid_step_then_resume(jobs):
    """Rank 1 dies in step 2 (the third) before the gradient all-reduce: rank 0 is inside the step's collectives."""
    out = check_kill(jobs.killed["mid_step"], *KILLS["mid_step"])
    assert check_checkpoints(out) == 2
    assert sorted(os.listdir(out / "dp")) == ["checkpoint-000001", "checkpoint-000002"]
    resume_matches(jobs, "mid_step")


def test_kill_during_checkpoint_save_then_resume(jobs):
    """Rank 0 (the one that writes checkpoints) dies in its 2nd save, after the weights, before the
    optimizer state; rank 1 goes on into step 2's collectives."""
    out = check_kill(jobs.killed["mid_save"], *KILLS["mid_save"])
    assert check_checkpoints(out) == 1
    names = sorted(os.listdir(out / "dp"))
    assert names[0].startswith(".checkpoint-000002.tmp-") and names[1:] == ["checkpoint-000001"], names
    resume_matches(jobs, "mid_save")


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_killed_msrun_takes_its_processes(held):
    """SIGKILL to msrun itself (none of its code runs) while rank 1 holds in step 1 (the second): the workers and the
    scheduler die with it, the launcher ends what is left of msrun's process group (its log tails) and exits
    128 + 9."""
    out, logs = held.out, held.logs
    with held.start() as job:
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
