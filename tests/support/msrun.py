"""Test workers under msrun: scripts/msrun_train.sh with N CPU workers (mccl), each worker's log in a LOG_DIR.

    with msrun.launch(2, WORKER, [out_dir], tmp_path / "logs") as job:
        ...                       # e.g. the single-process reference, in this process, meanwhile
        logs = job.finish(timeout=400)   # every worker's log; a failed launch raises with the output and logs

    logs = msrun.run(2, WORKER, [out_dir], tmp_path / "logs", timeout=300)   # the same, waiting at once

    with msrun.launch(2, WORKER, [out_dir], logs, env={"FAILURE_TIMEOUT": "15"}) as job:
        status = job.wait(timeout=300)   # a job expected to fail: its exit status, job.output, job.ended
    assert not msrun.processes_with(out_dir)   # no worker or scheduler of it is left

The workers get the repository on PYTHONPATH (they import `tests.support`), this interpreter's bin first on
PATH (msrun and python from the same environment), MindSpore's C++ log at errors only, a free scheduler
port and a 1 s retry interval between a node and the scheduler (MS_RETRY_INTERVAL_LOWER/UPPER; MindSpore's
3-5 s default, meant for nodes across a network, leaves the local workers waiting to join and to finish:
docs/PERFORMANCE.md, ## tests); `env` adds to that (the launcher's FAILURE_TIMEOUT, a worker's own switches).

msrun starts its scheduler as one more process of the worker script (MS_ROLE=MS_SCHED), whose `init()` is the
scheduler; a worker script calls `schedule_only()` first in its `__main__`, so that process goes there at once
instead of building the workers' model and data first. `launch` runs the script through tests/workers/entry.py,
whose scheduler process does not even import the script's modules.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore.communication import init

from mindvl_ms.parallel.runtime import end_with_launcher
from tests.support.paths import ROOT

LAUNCHER = os.path.join(ROOT, "scripts", "msrun_train.sh")
ENTRY = os.path.join(ROOT, "tests", "workers", "entry.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule_only() -> None:
    """In msrun's scheduler process (MS_ROLE=MS_SCHED): be the scheduler (`init()`, which serves until the job
    ends), dying with msrun as the workers do (`end_with_launcher`), then exit. Elsewhere nothing."""
    if os.environ.get("MS_ROLE") != "MS_SCHED":
        return
    end_with_launcher()
    init()
    sys.exit(0)


def worker_env(**extra: str) -> dict:
    """The environment of a worker process (under msrun or alone)."""
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("MS_WORKER_NUM", None)  # a process started alone must not think it is one of a cluster
    env.update(extra)
    return env


def worker_logs(log_dir, tail: int = 3000) -> str:
    """The last `tail` characters of every worker_<rank>.log in log_dir, in rank order."""
    if not os.path.isdir(log_dir):
        return ""
    return "".join(open(os.path.join(log_dir, f), errors="replace").read()[-tail:]
                   for f in sorted(os.listdir(log_dir)) if f.startswith("worker"))


def processes_with(marker: str) -> List[int]:
    """The pids of this machine's processes (but this one) whose command line contains `marker`, e.g. the
    output directory a job's workers and scheduler were given: what is left of a job that has ended."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if marker in cmd and int(pid) != os.getpid():
            found.append(int(pid))
    return found


class MsrunJob:
    """A running `scripts/msrun_train.sh WORKERS ENTRY SCRIPT ARGS...`; a context manager that stops it on the way
    out if it is still running (a failed reference in the test process): SIGTERM, on which the launcher ends
    msrun, the workers and the scheduler, then SIGKILL after 30 s."""

    def __init__(self, workers: int, script: str, args: Sequence[str], log_dir, cwd: Optional[str] = None,
                 cluster_timeout: int = 120, env: Optional[Dict[str, str]] = None, nice: int = 0):
        self.log_dir = str(log_dir)
        full = worker_env(MASTER_PORT=str(free_port()), LOG_DIR=self.log_dir, CLUSTER_TIMEOUT=str(cluster_timeout),
                          MS_RETRY_INTERVAL_LOWER="1", MS_RETRY_INTERVAL_UPPER="1", **(env or {}))
        self.output, self.ended = "", None
        self.proc = subprocess.Popen([LAUNCHER, str(workers), ENTRY, script, *map(str, args)], env=full, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def wait(self, timeout: float) -> int:
        """Wait for the launcher; its exit status. Sets `output` (the launcher's) and `ended` (time.time())."""
        self.output, _ = self.proc.communicate(timeout=timeout)
        self.ended = time.time()
        return self.proc.returncode

    def finish(self, timeout: float) -> str:
        """Wait for the workers; their logs. Raises AssertionError (launcher output and logs) on a failure."""
        status = self.wait(timeout)
        logs = worker_logs(self.log_dir)
        if status != 0:
            raise AssertionError(f"msrun exited with {status}\n{self.output[-2000:]}{logs}")
        return logs

    def __enter__(self) -> "MsrunJob":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def launch(workers: int, script: str, args: Sequence[str], log_dir, cwd: Optional[str] = None,
           cluster_timeout: int = 120, env: Optional[Dict[str, str]] = None, nice: int = 0) -> MsrunJob:
    """A running job (MsrunJob); `nice` > 0 starts the launcher, msrun, the scheduler and the workers at that
    lower priority (a job started next to another job whose exit a test times)."""
    return MsrunJob(workers, script, args, log_dir, cwd, cluster_timeout, env, nice)


def run(workers: int, script: str, args: Sequence[str], log_dir, timeout: float, cwd: Optional[str] = None,
        cluster_timeout: int = 120, env: Optional[Dict[str, str]] = None) -> str:
    """Launch and wait; the workers' logs (see MsrunJob.finish)."""
    with launch(workers, script, args, log_dir, cwd, cluster_timeout, env) as job:
        return job.finish(timeout)


def assert_ranks_match(single: str, dp: str, ranks: int = 2, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Every rank's saved parameters (`DP/params_rank{r}.npz`) equal the single-process run's
    (`SINGLE/params_rank0.npz`), same names, within the tolerances; returns the largest difference."""
    ref = np.load(os.path.join(single, "params_rank0.npz"))
    worst = 0.0
    for rank in range(ranks):
        got = np.load(os.path.join(dp, f"params_rank{rank}.npz"))
        assert set(got.files) == set(ref.files), f"rank {rank}: {sorted(set(got.files) ^ set(ref.files))}"
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], rtol=rtol, atol=atol, err_msg=f"rank {rank} {k}")
            worst = max(worst, float(np.abs(got[k] - ref[k]).max()))
    return worst
