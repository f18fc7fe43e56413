"""Test workers under msrun: scripts/msrun_train.sh with N CPU workers (mccl), each worker's log in a LOG_DIR.

    with msrun.launch(2, WORKER, [out_dir], tmp_path / "logs") as job:
        ...                       # e.g. the single-process reference, in this process, meanwhile
        logs = job.finish(timeout=400)   # every worker's log; a failed launch raises with the output and logs

    logs = msrun.run(2, WORKER, [out_dir], tmp_path / "logs", timeout=300)   # the same, waiting at once

The workers get the repository on PYTHONPATH (they import `tests.support`), this interpreter's bin first on
PATH (msrun and python from the same environment), MindSpore's C++ log at errors only, and a free
scheduler port.
"""
import os
import socket
import subprocess
import sys
from typing import Optional, Sequence

from tests.support.paths import ROOT

LAUNCHER = os.path.join(ROOT, "scripts", "msrun_train.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class MsrunJob:
    """A running `scripts/msrun_train.sh WORKERS SCRIPT ARGS...`; a context manager that kills it on the way
    out if it is still running (a failed reference in the test process)."""

    def __init__(self, workers: int, script: str, args: Sequence[str], log_dir, cwd: Optional[str] = None,
                 cluster_timeout: int = 120):
        self.log_dir = str(log_dir)
        env = worker_env(MASTER_PORT=str(free_port()), LOG_DIR=self.log_dir, CLUSTER_TIMEOUT=str(cluster_timeout))
        self.proc = subprocess.Popen([LAUNCHER, str(workers), script, *map(str, args)], env=env, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self, timeout: float) -> str:
        """Wait for the workers; their logs. Raises AssertionError (launcher output and logs) on a failure."""
        out, _ = self.proc.communicate(timeout=timeout)
        logs = worker_logs(self.log_dir)
        if self.proc.returncode != 0:
            raise AssertionError(f"msrun exited with {self.proc.returncode}\n{out[-2000:]}{logs}")
        return logs

    def __enter__(self) -> "MsrunJob":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def launch(workers: int, script: str, args: Sequence[str], log_dir, cwd: Optional[str] = None,
           cluster_timeout: int = 120) -> MsrunJob:
    return MsrunJob(workers, script, args, log_dir, cwd, cluster_timeout)


def run(workers: int, script: str, args: Sequence[str], log_dir, timeout: float, cwd: Optional[str] = None,
        cluster_timeout: int = 120) -> str:
    """Launch and wait; the workers' logs (see MsrunJob.finish)."""
    with launch(workers, script, args, log_dir, cwd, cluster_timeout) as job:
        return job.finish(timeout)
