"""Worker for tests/train/test_soak.py: the tiny stand-in trained for 100 steps with a checkpoint every
20, resumed from OUT_DIR's latest checkpoint when --resume is given, optionally killed with SIGKILL.

    python tests/workers/soak.py OUT_DIR PROGRESS_FILE [--resume] [--kill KIND --at STEP]

The worker writes the step it is drawing the batch of into PROGRESS_FILE before each step, so the test
can follow it and kill it from outside at any moment. It kills itself (no cleanup code runs, like
kill -9 or a power cut) for KIND
- step:    in the middle of step STEP (its first micro-batch collated, the data position advanced);
- weights: in the middle of saving checkpoint STEP (weights written, optimizer state not yet);
- latest:  after checkpoint STEP is complete and in place, before latest.json points at it.

The collate adds noise drawn from numpy's and python's global RNGs to the pixel stand-in, as a random
augmentation would, so a resume that does not restore those RNGs trains on other inputs.
"""
import argparse
import json
import os
import random
import signal

import mindspore as ms
import numpy as np

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from tests.support.stopped_run import kept_model
from tests.support.train_tiny import collate, make_rows

STEPS, SAVE_EVERY, GLOBAL_BATCH = 100, 20, 4
ROWS = make_rows(48, seed=23)  # 48 rows, 4 per step: an epoch every 12 steps, 8 1/3 epochs in all


def soak_cfg():
    stage = dict(name="sft", trainable="all", seq_length=28, global_batch_size=GLOBAL_BATCH, micro_batch_size=2,
                 max_lr=2e-3, warmup_ratio=0.1, epochs=None, max_steps=STEPS, save_every=SAVE_EVERY,
                 loss={"type": "balanced"})
    return load_run_config(data={"seed": 5, "plot": False, "stages": [stage]})


class SoakSource(RowSource):
    """RowSource that counts the steps it hands batches to (every batch is supervised, so each draw is one
    optimizer step) from `first_step`, the step the run resumes at, and calls `on_step(step)` first. The
    count does not come from the data position, so a resume that lost the position still kills at the
    step the test chose."""

    def __init__(self, rows, seed, first_step=0, on_step=None):
        super().__init__(rows, seed=seed)
        self.on_step = on_step
        self.step, self.next_step = None, first_step

    def next_global_batch(self, n):
        self.step, self.next_step = self.next_step, self.next_step + 1
        if self.on_step is not None:
            self.on_step(self.step)
        return super().next_global_batch(n)


def resume_step(out):
    """The step the trainer resumes at from OUT/latest.json (0 after a stage-end checkpoint: nothing left)."""
    with open(os.path.join(out, ts.LATEST)) as f:
        latest = json.load(f)
    return 0 if latest["stage_done"] else latest["step"]


class NoisyCollate:
    """The tiny collate plus pixel noise from the global RNGs; `on_micro(k)` is called before the k-th
    micro-batch of a step is collated."""

    def __init__(self, on_micro=None):
        self.on_micro, self.k = on_micro, 0

    def __call__(self, rows, stage):
        if self.on_micro is not None:
            self.on_micro(self.k)
        self.k = (self.k + 1) % 2
        arrays = collate(rows, stage)
        scale = random.uniform(0.05, 0.15)
        arrays["pixel_values"] += scale * np.random.standard_normal(arrays["pixel_values"].shape).astype(np.float32)
        return arrays


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def step_of(path):
    """The step of a path inside checkpoint-<step>/ or its temporary .checkpoint-<step>.tmp-*/ directory."""
    for part in path.split(os.sep):
        name = part.lstrip(".")
        if name.startswith("checkpoint-"):
            return int(name[len("checkpoint-"):len("checkpoint-") + 6])
    return None


def arm(kind, at, source, coll):
    """Make the worker SIGKILL itself at `at` as `kind` says (module docstring)."""
    if kind == "step":
        coll.on_micro = lambda k: die() if source.step == at and k == 1 else None
    elif kind == "weights":
        real = ts.write_file

        def write_file(path, tensors, metadata=None):
            if step_of(path) == at:
                die()
            return real(path, tensors, metadata)
        ts.write_file = write_file
    elif kind == "latest":
        real_latest = ts.write_latest

        def write_latest(out_dir, path, state):
            if state.get("step") == at:
                die()
            return real_latest(out_dir, path, state)
        ts.write_latest = write_latest
    else:
        raise SystemExit(f"unknown kill kind {kind}")


def train(out, progress, resume=False, kill=None, at=None):
    """One run into `out`, from its latest checkpoint when `resume`, killed as `kill` says (module
    docstring); returns run_training's summary. The test also calls it in its own process, for the
    uninterrupted run and the last resume (they are not killed): both on the process's one tiny model
    (`stopped_run.kept_model`, its seed-0 weights set back), so the resume restarts the step the
    uninterrupted run compiled and kept on it."""
    def report(step):  # atomic: a kill between truncating and writing the file would leave it empty
        with open(progress + ".tmp", "w") as f:
            f.write(f"{step}\n")
        os.replace(progress + ".tmp", progress)
    coll = NoisyCollate()
    source = SoakSource(ROWS, seed=soak_cfg().seed, first_step=resume_step(out) if resume else 0, on_step=report)
    if kill:
        arm(kill, at, source, coll)
    return run_training(soak_cfg(), out, resume=out if resume else None, model=kept_model(),
                        data_factory=lambda rc, st, i, d: source, collate=coll, progress=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("progress")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", default=None)
    p.add_argument("--at", type=int, default=None)
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    train(args.out, args.progress, args.resume, args.kill, args.at)


if __name__ == "__main__":
    freeze_imported_objects()  # one model per process: MindSpore's gc.collect() before each compile skips them
    main()
