"""Wall and CPU seconds per test, to find where a parallel run's cores sit idle.

    MINDVL_TEST_CPU=/tmp/cpu python -m pytest -q -n 2 tests

appends one JSON line per test (setup, call and teardown together) to /tmp/cpu/<worker>.jsonl: node id,
worker, start (epoch s), wall, CPU of this process and CPU of the subprocesses it waited for (msrun
workers, CLI calls; user + sys), and with MINDVL_TEST_COMPILES=1 also its graph compiles in this process
and their seconds (tests/support/compile_count.py). A test whose CPU is far below its wall leaves a core
idle for that long.
"""
import json
import os
import resource
import time

from tests.support import compile_count


def _cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def measure(nodeid: str, out_dir: str):
    """A generator for a hookwrapper: yields once while the test runs, then appends its line."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    start, (self0, kids0) = time.time(), _cpu()
    yield
    self1, kids1 = _cpu()
    compiles, compile_s = compile_count.COUNTS.get(nodeid, (0, 0.0))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps({"test": nodeid, "worker": worker, "start": round(start, 3),
                            "wall": round(time.time() - start, 3), "cpu": round(self1 - self0, 3),
                            "cpu_children": round(kids1 - kids0, 3), "compiles": compiles,
                            "compile_s": round(compile_s, 3)}) + "\n")
