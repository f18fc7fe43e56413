"""Worker for tests/parallel/test_worker_failure.py: 2-rank data parallel of the tiny stand-in model under
msrun (4 steps, a checkpoint after each), one rank of which kills itself with SIGKILL at a chosen point:

    KILL_RANK=1 KILL_AT=step:2 scripts/msrun_train.sh 2 tests/workers/kill_target.py OUT_DIR
    KILL_RANK=0 KILL_AT=save:2 ...   # in the 2nd checkpoint save, after the weights, before the optimizer state
    scripts/msrun_train.sh 2 tests/workers/kill_target.py REF_DIR OUT_A --resume OUT_B --resume

step:N  the rank dies in step N after its micro-batches' forward and backward, before the gradient
        all-reduce, so its peer is inside the step's collectives when it goes;
save:N  the rank dies in its N-th checkpoint save (rank 0 writes checkpoints), between model.safetensors
        and optimizer.safetensors, so the checkpoint's temporary directory is half-written;
hold:N  the rank stops in step N where step:N would die and sleeps (its peer waits in the collective), so
        the job is sure to be running when a test kills something else.
Before dying (holding) the rank writes OUT_DIR/killed_rank<r> (held_rank<r>), OUT_DIR the first run's; a
test's clock starts there. Without KILL_AT the runs are uninterrupted.

Each OUT_DIR is a run, trained one after another in the same processes (one job's start-up and cluster for
all of them); an OUT_DIR followed by `--resume` continues from its latest checkpoint, any other trains from
the start. An OUT_DIR to resume that is not there yet is waited for: the test copies a killed run there when
its job has ended, while this job trains the runs before it; one without a checkpoint (a kill that left
none, which its test reports) is skipped. Both ranks save each run's final parameters to OUT_DIR/params_rank<r>.npz.
"""
import os
import signal
import sys
import time
from typing import List, Tuple

import mindspore as ms
import numpy as np

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from mindvl_ms.train.train_step import TrainStep
from tests.support import msrun
from tests.support.train_tiny import TinyVLM, collate, make_rows

STEPS, SAVE_EVERY = 4, 1


def run_cfg():
    return load_run_config(data={"seed": 5, "plot": False, "stages": [
        {"name": "dp", "trainable": "all", "seq_length": 28, "global_batch_size": 8, "micro_batch_size": 2,
         "max_lr": 5e-3, "warmup_ratio": 0.25, "epochs": None, "max_steps": STEPS, "save_every": SAVE_EVERY,
         "keep_last": STEPS, "loss": {"type": "balanced", "lambda1": 1.0, "lambda2": 1.0}}]})


def mark(out: str, name: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(repr(time.time()))


def die(out: str, rank: int) -> None:
    """SIGKILL this process (no cleanup code runs, like kill -9 or the OOM killer), after a marker file."""
    mark(out, f"killed_rank{rank}")
    os.kill(os.getpid(), signal.SIGKILL)


def hold(out: str, rank: int) -> None:
    """Sleep until killed, after a marker file."""
    mark(out, f"held_rank{rank}")
    while True:
        time.sleep(60)


def arm(out: str, rank: int, kill_at: str) -> None:
    """Patch the step's gradient reduction (step:N, hold:N) or the checkpoint's optimizer write (save:N)."""
    where, n = kill_at.split(":")
    calls = {"n": 0}
    if where in ("step", "hold"):
        real_apply = TrainStep.apply

        def apply(self, loss_sum, lr):
            calls["n"] += 1
            if calls["n"] == int(n) + 1:  # steps count from 0
                (die if where == "step" else hold)(out, rank)
            return real_apply(self, loss_sum, lr)
        TrainStep.apply = apply
    elif where == "save":
        real_write = ts.write_file

        def write_file(path, tensors, metadata=None):
            calls["n"] += 1
            if calls["n"] == int(n):
                die(out, rank)
            return real_write(path, tensors, metadata)
        ts.write_file = write_file
    else:
        raise SystemExit(f"KILL_AT={kill_at}: expected step:N, save:N or hold:N")


def runs(argv) -> List[Tuple[str, bool]]:
    """(OUT_DIR, resume) of each run named on the command line: OUT_DIR [--resume] [OUT_DIR [--resume]] ..."""
    out = []
    for arg in argv:
        if arg == "--resume":
            if not out:
                raise SystemExit("--resume: expected an OUT_DIR before it")
            out[-1] = (out[-1][0], True)
        else:
            out.append((arg, False))
    return out


def wait_for(path: str, timeout: float = 600.0) -> None:
    """Until `path` is there (the test renames a finished copy into place)."""
    deadline = time.time() + timeout
    while not os.path.isdir(path):
        if time.time() > deadline:
            raise SystemExit(f"{path}: not there after {timeout:.0f} s")
        time.sleep(0.2)


def main(out: str, resume: bool) -> None:
    """One run: train (or, resuming, continue) OUT_DIR and save this rank's final parameters there."""
    rank = int(os.environ.get("RANK_ID", "0"))
    if resume:
        wait_for(out)
        if not os.path.isfile(os.path.join(out, ts.LATEST)):
            print("NO CHECKPOINT rank", rank, out, flush=True)
            return
    rows = make_rows(64, seed=7)
    ms.set_seed(0)
    model = TinyVLM()
    run_training(run_cfg(), out, resume=out if resume else None, model=model, progress=False,
                 data_factory=lambda rc, st, i, d: RowSource(rows, seed=rc.seed), collate=collate)
    np.savez(os.path.join(out, f"params_rank{rank}.npz"), **{p.name: p.asnumpy() for p in model.get_parameters()})
    print("DONE rank", rank, out, flush=True)


if __name__ == "__main__":
    msrun.schedule_only()  # msrun's scheduler runs this script too: it only schedules
    freeze_imported_objects()  # the gc.collect() before each graph compile skips the imports (ops/process.py)
    todo = runs(sys.argv[1:])
    kill_at = os.environ.get("KILL_AT", "")
    if kill_at and int(os.environ.get("KILL_RANK", "1")) == int(os.environ.get("RANK_ID", "0")):
        arm(todo[0][0], int(os.environ.get("RANK_ID", "0")), kill_at)
    for run in todo:  # each run's setup keeps the device init() gave this rank (parallel/runtime.set_device)
        main(*run)
