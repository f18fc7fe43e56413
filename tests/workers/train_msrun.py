"""Worker for tests/parallel/test_msrun_dp.py: trains the tiny stand-in model for a few steps and saves the
final parameters. Run under msrun (2 data-parallel ranks) or as one process with the same global batch.
Under msrun it then runs `parallel.runtime.setup` a second time, as a worker that trains several runs does,
and prints how that went (SETUP AGAIN ...).

    python tests/workers/train_msrun.py OUT_DIR
"""
import os
import sys

import mindspore as ms
import numpy as np

from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.parallel.runtime import setup
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from tests.support import msrun
from tests.support.train_tiny import TinyVLM, collate, make_rows


def run_cfg():
    return load_run_config(data={"seed": 5, "plot": False, "stages": [
        {"name": "dp", "trainable": "all", "seq_length": 28, "global_batch_size": 8, "micro_batch_size": 2,
         "max_lr": 5e-3, "warmup_ratio": 0.0, "epochs": None, "max_steps": 3,
         "loss": {"type": "balanced", "lambda1": 1.0, "lambda2": 1.0}}]})


def main(out: str) -> None:
    rows = make_rows(24, seed=7)
    ms.set_seed(0)
    model = TinyVLM()
    summary = run_training(run_cfg(), out, model=model, progress=False,
                           data_factory=lambda rc, st, i, d: RowSource(rows, seed=rc.seed), collate=collate)
    rank = int(os.environ.get("RANK_ID", "0"))
    np.savez(os.path.join(out, f"params_rank{rank}.npz"), **{p.name: p.asnumpy() for p in model.get_parameters()})
    print("RANKS", summary["ranks"], "LOSS", summary["final_loss"], flush=True)


def setup_again() -> str:
    """A second `setup` in this process (the first ran in `main`): 'ok rank R of W' or the error."""
    try:
        info = setup(run_cfg())
    except RuntimeError as e:
        return f"failed: {e}"
    return f"ok rank {info.rank} of {info.world}"


if __name__ == "__main__":
    msrun.schedule_only()  # msrun's scheduler runs this script too: it only schedules
    freeze_imported_objects()  # the gc.collect() before each graph compile skips the imports (ops/process.py)
    main(sys.argv[1])
    print("SETUP AGAIN", setup_again(), flush=True)
