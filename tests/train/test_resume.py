"""Checkpoints, resume and faults through `run_training` on the tiny stand-in model:
an interrupted run (SIGKILL in the middle of a save) resumed from the last good checkpoint logs exactly
the losses of an uninterrupted run; a crashed save never becomes the resume point; K non-finite
steps in a row stop training with a clear message and an intact checkpoint."""
import json
import os
import signal
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.pretrained import load_into
from mindvl_ms.train import TrainingStopped, load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from tests.support.train_tiny import TinyVLM, collate, make_rows
from tests.support.paths import ROOT

ROWS = make_rows(48, seed=11)


def run_cfg(**stage):
    st = dict(name="sft", trainable="all", seq_length=28, global_batch_size=4, micro_batch_size=2, max_lr=5e-3,
              warmup_ratio=0.25, epochs=None, max_steps=6, save_every=2, loss={"type": "balanced"})
    st.update(stage)
    return load_run_config(data={"seed": 3, "plot": False, "stages": [st]})


def factory(rc, stage, i, dist):
    return RowSource(ROWS, seed=rc.seed)


_LAST = {}  # the module's last new model and its seed-0 weights


def model(new=True):
    """The tiny model with seed 0's weights: a new one, or (new False) the module's last new one with its
    weights set back, so a run whose stage fits restarts the SFT step the previous run kept on it
    (`train_step.keep_train_step`) instead of compiling a new step."""
    if new or "model" not in _LAST:
        ms.set_seed(0)
        _LAST["model"] = TinyVLM()
        _LAST["init"] = {p.name: p.asnumpy().copy() for p in _LAST["model"].get_parameters()}
    m = _LAST["model"]
    for p in m.get_parameters():
        p.set_data(Tensor(_LAST["init"][p.name]))
    return m


def losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))]


@pytest.mark.slow  # about 12 s: a killed run and its resume
def test_kill_during_save_then_resume_is_bit_identical(tmp_path):
    """Run 6 steps; separately run, get SIGKILLed while saving step 4, resume: same logged losses."""
    ref_dir, dir_b = str(tmp_path / "ref"), str(tmp_path / "b")
    summary = run_training(run_cfg(), ref_dir, model=model(), data_factory=factory, collate=collate, progress=False)
    ref = losses(ref_dir)
    assert [s for s, _ in ref] == list(range(6)) and summary["stages"][0]["compiled_graphs"] == 1

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "train_crash.py"), dir_b],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    latest = json.load(open(os.path.join(dir_b, "latest.json")))
    assert latest["step"] == 2 and ts.is_complete(os.path.join(dir_b, latest["path"]))
    stage_dir = os.path.join(dir_b, "sft")
    assert not os.path.exists(os.path.join(stage_dir, "checkpoint-000004"))      # the killed save is invisible
    assert [d for d in os.listdir(stage_dir) if ".tmp-" in d]                    # ... its temp dir is left over
    assert len(losses(dir_b)) == 4                                               # steps 0..3 were logged

    run_training(run_cfg(), dir_b, resume=dir_b, model=model(new=False), data_factory=factory, collate=collate,
                 progress=False)
    got = losses(dir_b)
    assert [s for s, _ in got] == list(range(6))
    assert got == ref                                                            # bit-identical losses
    assert not [d for d in os.listdir(stage_dir) if ".tmp-" in d]                # partial save cleaned up
    _, a, _ = ts.load_checkpoint(os.path.join(ref_dir, "sft", "checkpoint-000006"))
    _, b, _ = ts.load_checkpoint(os.path.join(stage_dir, "checkpoint-000006"))
    assert all(np.array_equal(a[k].data, b[k].data) for k in a)
    assert os.path.isfile(os.path.join(dir_b, "summary.json"))


def test_nonfinite_steps_in_a_row_stop_with_intact_checkpoint(tmp_path):
    out = str(tmp_path / "nan")
    step = {"n": 0}

    def poisoned(rows, stage):
        arrays = collate(rows, stage)
        step["n"] += 1
        if step["n"] > 4:  # 2 micro-batches per step: steps 2, 3, ... see NaN inputs
            arrays["pixel_values"][:] = np.nan
        return arrays

    with pytest.raises(TrainingStopped, match="2 steps in a row had a non-finite"):
        run_training(run_cfg(max_nonfinite=2, save_every=1), out, model=model(new=False), data_factory=factory,
                     collate=poisoned, progress=False)
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["applied"] for r in recs] == [True, True, False, False]
    assert recs[-1]["skipped_total"] == 2
    latest = ts.find_latest(out)
    state, tensors, _ = ts.load_checkpoint(latest)
    assert state["step"] == 3  # saved after step 3 (a skipped step leaves the weights as they were)
    assert all(np.isfinite(t.data).all() for t in tensors.values())
    m = model()
    load_into(m, tensors)  # the checkpoint loads into a fresh model


def test_resume_rejects_incomplete_checkpoint(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ts.find_latest(str(d))
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        ts.find_latest(str(tmp_path))


class _Drawn:
    """A RowSource seen through the four methods a source must have (no `peek_global_batch`): the trainer
    collates each batch after drawing it, on its own thread."""

    def __init__(self, source):
        self.source, self.rows_per_epoch = source, source.rows_per_epoch

    def next_global_batch(self, n):
        return self.source.next_global_batch(n)

    def state_dict(self):
        return self.source.state_dict()

    def load_state_dict(self, d):
        self.source.load_state_dict(d)


def test_collating_ahead_on_a_thread_changes_no_value(tmp_path):
    """With a RowSource the next step's rows are collated on a thread while a step runs (batches.CollateAhead),
    except before a checkpoint, which records the global RNGs: here steps 1, 3 and 5 (save_every 2). A collate
    that draws pixel noise from the global RNGs gives the same losses and checkpoints (weights, optimizer, RNG and
    data states) as collating after each draw."""
    import random
    import threading

    def noisy(threads):
        def coll(rows, stage):
            threads.append(threading.current_thread() is threading.main_thread())
            arrays = collate(rows, stage)
            arrays["pixel_values"] += random.uniform(0.05, 0.15) * np.random.standard_normal(
                arrays["pixel_values"].shape).astype(np.float32)
            return arrays
        return coll

    runs = {}
    for name, fac in (("ahead", factory), ("after", lambda rc, st, i, d: _Drawn(RowSource(ROWS, seed=rc.seed)))):
        threads, out = [], str(tmp_path / name)
        run_training(run_cfg(keep_last=3), out, model=model(new=False), data_factory=fac, collate=noisy(threads),
                     progress=False)
        runs[name] = out, threads
    assert runs["ahead"][1] == [True, True, False, False] * 3  # steps 0, 2, 4 here, 1, 3, 5 on the thread
    assert all(runs["after"][1])
    assert losses(runs["ahead"][0]) == losses(runs["after"][0])
    for step in (2, 4, 6):
        a, b = (ts.load_checkpoint(os.path.join(runs[n][0], "sft", f"checkpoint-{step:06d}")) for n in runs)
        assert a[0]["data"] == b[0]["data"] and a[0]["rng"] == b[0]["rng"]
        assert a[1].keys() == b[1].keys() and all(np.array_equal(a[1][k].data, b[1][k].data) for k in a[1])
        assert a[2].keys() == b[2].keys() and all(np.array_equal(a[2][k], b[2][k]) for k in a[2])
