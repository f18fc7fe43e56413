"""One spawned process per demo phase (`in_child`): MindSpore keeps a process's memory pool and compiled
graphs alive, and the phases together would not fit in memory next to each other; `child_setup` makes
the phase's process log and compile like the parent's command."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

import mindspore as ms


def child_setup() -> None:
    """A phase's process (spawned by `in_child`): log like the parent's CLI, graph mode on CPU."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")


def in_child(fn, *args):
    """Run fn(*args) in a fresh (spawned) process and return its result: MindSpore keeps the memory
    pool and compiled graphs of a process alive, so each phase gets its own and frees them on exit.
    The child ends with this process (`die_with_parent`), so a killed demo leaves no training behind."""
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
