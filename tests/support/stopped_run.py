"""Checks of a training run that stopped on a fault (tests/train/test_faults.py, test_bad_data.py): the tiny
stand-in model from a fixed seed (new, or one instance reused with its weights set back), its parameters and
the run directory's files before and after, and that a stop wrote nothing (no checkpoint, no metrics, no
summary, no partial directory)."""
import os

import mindspore as ms
from mindspore import Tensor

from tests.support.train_tiny import TinyVLM

_KEPT = {}  # "model": the process's reused tiny model, "init": tiny_model()'s weights


def tiny_model():
    ms.set_seed(0)
    return TinyVLM()


def kept_model():
    """tiny_model()'s weights on one model instance per process: each call sets them back and returns the same
    instance, so a `run_training` on it restarts the SFT step the previous run kept on it
    (`train_step.keep_train_step`) when its stage fits, instead of compiling a new step."""
    if "model" not in _KEPT:
        _KEPT["model"] = tiny_model()
        _KEPT["init"] = params(_KEPT["model"])
    model = _KEPT["model"]
    for p in model.get_parameters():
        p.set_data(Tensor(_KEPT["init"][p.name]))
    return model


def snapshot(d):
    """{path: (size, mtime)} of every file under d."""
    return {os.path.join(r, n): (os.path.getsize(os.path.join(r, n)), os.path.getmtime(os.path.join(r, n)))
            for r, _, fs in os.walk(d) for n in fs}


def params(model):
    return {p.name: p.asnumpy().copy() for p in model.get_parameters()}


def nothing_written(out):
    for name in ("latest.json", "summary.json", "metrics.jsonl"):
        assert not os.path.exists(os.path.join(out, name)), os.path.join(out, name)
    partial = [d for _, ds, _ in os.walk(out) for d in ds if d.startswith("checkpoint-") or ".tmp-" in d]
    assert not partial, partial
