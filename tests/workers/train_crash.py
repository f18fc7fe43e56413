"""Worker for tests/train/test_resume.py: trains the tiny stand-in and is killed with SIGKILL in the
middle of its second checkpoint save (after the weights file, before the optimizer state).

    python tests/workers/train_crash.py OUT_DIR
"""
import os
import signal
import sys

import mindspore as ms

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.train import run_training
from mindvl_ms.train.batches import RowSource
from tests.train.test_resume import ROWS, run_cfg
from tests.support.train_tiny import TinyVLM, collate

real_write = ts.write_file
calls = {"n": 0}


def killing_write(path, tensors, metadata=None):
    calls["n"] += 1
    if calls["n"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup code runs, like a power cut or kill -9
    return real_write(path, tensors, metadata)


if __name__ == "__main__":
    freeze_imported_objects()  # one model per process: MindSpore's gc.collect() before each compile skips them
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ts.write_file = killing_write
    ms.set_seed(0)
    run_training(run_cfg(), sys.argv[1], model=TinyVLM(), progress=False, collate=collate,
                 data_factory=lambda rc, st, i, d: RowSource(ROWS, seed=rc.seed))
