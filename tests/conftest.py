"""Test set-up: MindSpore graph mode on CPU, fixed seeds, and the work units of a parallel run.

`python -m pytest -q -n 2 tests` (README, Makefile) runs the tests on two pytest-xdist workers, a work unit
at a time (pytest_xdist_make_scheduler below): the tests of one module are one unit, so a module's fixtures
(the `mindvl demo --quick` run, a module's compiled model, a module's msrun reference job) are built once, by
one worker; the tests/infer modules (with the model parity modules) are one unit, sharing the compiled tiny
model of tests/support/infer_tiny.py, and so are the post-training modules that share tests/support/post.py's
model (UNITS); and the units known to take longest are handed out first, so that no long unit
starts when the other worker is nearly done. The workers, and every process they start, run on oneTBB's
malloc (tests/support/allocator.py): set here in the controller's environment before `-n` starts them.
Without -n nothing of this applies to the tests' own process: one process, glibc's malloc, collection order.
"""
import os

import numpy as np
import pytest


os.environ.setdefault("GLOG_v", "3")  # MindSpore: errors only

import mindspore as ms  # noqa: E402

from mindvl_ms.ops.process import freeze_imported_objects  # noqa: E402

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")

from tests.support import allocator, compile_count, cpu_time  # noqa: E402

if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, before `-n` starts its workers: they (and every
    os.environ.update(allocator.env_with_preload())  # process they start) run on tbbmalloc (allocator.py)

_COMPILES, _CPU = os.environ.get("MINDVL_TEST_COMPILES"), os.environ.get("MINDVL_TEST_CPU")
if _COMPILES:  # graph compiles per test (tests/support/compile_count.py)
    compile_count.install()

    def pytest_terminal_summary(terminalreporter):
        compile_count.summary(terminalreporter)

if _COMPILES or _CPU:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        compile_count.set_test(item.nodeid)
        if _CPU:  # wall and CPU seconds per test (tests/support/cpu_time.py)
            yield from cpu_time.measure(item.nodeid, _CPU)
        else:
            yield


# path prefix -> one unit for all its modules: those that use the compiled model of tests/support/infer_tiny.py,
# and the post-training modules that share tests/support/post.py's model (and the graphs compiled on it)
POST_SHARED = "tests/train/post/ (fresh_model)"
UNITS = {"tests/infer/": "tests/infer/", "tests/models/test_video_parity.py": "tests/infer/",
         "tests/models/test_mindvl_parity.py": "tests/infer/",
         **{f"tests/train/post/test_{m}.py": POST_SHARED for m in ("post_msrun", "dpo_train", "ntp_mix", "grpo_train")}}

# modules (or unit names) in the order the workers take them, longest first: the slow lane's end-to-end
# runs, then the longest of the rest (docs/PERFORMANCE.md, ## tests); every other module follows in
# collection order
FIRST = (
    "tests/recipes/test_demo_quick.py",
    "tests/train/test_soak.py",
    "tests/parallel/test_worker_failure.py",
    "tests/parallel/test_moe_msrun.py",
    "tests/infer/",
    "tests/parallel/test_shard_consistency.py",
    POST_SHARED,
    "tests/train/test_variants.py",
    "tests/models/test_moe_parity.py",
    "tests/models/test_moe_sparse.py",
    "tests/ops/test_cpu_kernels.py",
    "tests/project/test_packaging.py",
    "tests/data/test_fuzz.py",
    "tests/parallel/test_knobs.py",
    "tests/parallel/test_msrun_dp.py",
    "tests/train/test_resume.py",
    "tests/train/test_row_grads.py",
    "tests/train/test_mf_step.py",
    "tests/train/test_loss_head.py",
    "tests/train/test_trainer_mindvl.py",
    "tests/train/test_train_step.py",
    "tests/train/test_pipeline_moe.py",
    "tests/train/test_moe_train.py",
)


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((name for prefix, name in UNITS.items() if path.startswith(prefix)), path)


def pytest_collection_finish(session):
    """Every test module is imported now (MindSpore, torch, transformers with it): freeze those objects, so
    the full collection MindSpore runs before each graph compile visits only what the tests create
    (mindvl_ms/ops/process.py)."""
    freeze_imported_objects()


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the units in the FIRST order, then in collection order (the same on every worker)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {u: i for i, u in enumerate(FIRST)}
    units = {}
    for item in items:
        units.setdefault(_unit(item.nodeid), []).append(item)
    items[:] = [item for u in sorted(units, key=lambda u: rank.get(u, len(rank))) for item in units[u]]


def pytest_xdist_make_scheduler(config, log):
    """`-n 2`: whole units to a worker, in the workers' collection order (pytest-xdist's LoadScopeScheduling
    with the unit of `_unit` as the scope and its reordering by test count off)."""
    from xdist.scheduler import LoadScopeScheduling  # only an xdist run calls this hook

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    ms.set_seed(0)
    yield


