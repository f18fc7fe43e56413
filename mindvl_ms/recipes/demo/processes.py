"""One spawned process per demo phase (`in_child`): MindSpore keeps a process's memory pool and compiled
graphs alive, and the phases of the full demo together would not fit in memory next to each other;
`child_setup` makes the phase's process log and compile like the parent's command. The quick demo's
phases fit in one process (`demo.phase_processes: false` in configs/demo/quick.yaml): they run in the
calling process, which saves each phase's MindSpore import and lets the post-training rollout reuse the
evaluation's compiled graphs of the merged checkpoint."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

import mindspore as ms

from mindvl_ms.ops.process import freeze_imported_objects


def child_setup() -> None:
    """A phase's process (spawned by `in_child`): log like the parent's CLI, graph mode on CPU, and the
    objects alive now (the imports) frozen out of the garbage collection MindSpore runs before every graph
    compile (`ops.process.freeze_imported_objects`). A phase builds its models after this call, so they stay
    collectable; a process freezes once (as `mindvl`'s commands do), so phases run one after another in one
    process (`in_child(spawn=False)`) do not pin the models of the earlier ones."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    freeze_imported_objects()


def in_child(fn, *args, spawn: bool = True):
    """Run fn(*args) in a fresh (spawned) process and return its result: MindSpore keeps the memory
    pool and compiled graphs of a process alive, so each phase gets its own and frees them on exit.
    The child ends with this process (`die_with_parent`), so a killed demo leaves no training behind.
    spawn=False runs fn(*args) in this process instead (a run small enough to keep every phase's graphs)."""
    if not spawn:
        return fn(*args)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        return pool.submit(fn, *args).result()


def die_with_parent(parent: int) -> None:
    """Child-process initializer: on Linux the kernel sends this process SIGTERM when `parent` ends
    (prctl PR_SET_PDEATHSIG), however it ends (`kill -9` included); a parent already gone ends it now.
    The signal follows the thread that started the child: `in_child` starts it in the calling thread and
    waits there for the result, so that thread outlives the work. Elsewhere the child outlives a killed
    parent, as before."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
