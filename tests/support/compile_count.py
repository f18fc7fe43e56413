"""Graph compiles per test, a count of work that does not change with the machine's load.

    MINDVL_TEST_COMPILES=1 python -m pytest -q -p no:cacheprovider tests/infer

prints, after the run, the number of MindSpore graph compiles of the session and the tests that compiled
the most (count and seconds spent in them). A Cell compile is counted when `_CellGraphExecutor.compile`
reports a new graph, a `jit` function's when its phase joins the process-wide compile cache; a test that
reuses a graph compiled earlier (a shared fixture's) counts nothing. Compiles in subprocesses (msrun
workers, CLI calls) are not seen here.
"""
import time
from collections import defaultdict

from mindspore.graph import api

COUNTS = defaultdict(lambda: [0, 0.0])  # test node id -> [compiles, seconds]
_current = {"test": "<collection and fixtures outside a test>"}


def _wrap_cell(compile_):
    def compile(self, obj, *args, **kwargs):
        start = time.perf_counter()
        result = compile_(self, obj, *args, **kwargs)
        if isinstance(result, tuple) and result[1]:
            rec = COUNTS[_current["test"]]
            rec[0] += 1
            rec[1] += time.perf_counter() - start
        return result
    return compile


def _wrap_jit(compile_):
    def compile(self, *args, **kwargs):
        before, start = len(api.ms_compile_cache), time.perf_counter()
        result = compile_(self, *args, **kwargs)
        if len(api.ms_compile_cache) > before:
            rec = COUNTS[_current["test"]]
            rec[0] += 1
            rec[1] += time.perf_counter() - start
        return result
    return compile


def install() -> None:
    api._CellGraphExecutor.compile = _wrap_cell(api._CellGraphExecutor.compile)
    api._JitExecutor.compile = _wrap_jit(api._JitExecutor.compile)


def set_test(nodeid: str) -> None:
    _current["test"] = nodeid


def summary(terminalreporter, top: int = 25) -> None:
    total = sum(c for c, _ in COUNTS.values())
    seconds = sum(s for _, s in COUNTS.values())
    terminalreporter.write_sep("=", f"graph compiles: {total} in this process ({seconds:.1f} s)")
    for nodeid, (count, secs) in sorted(COUNTS.items(), key=lambda kv: -kv[1][0])[:top]:
        terminalreporter.write_line(f"{count:4d} compiles {secs:7.1f} s  {nodeid}")
