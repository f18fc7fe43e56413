"""Checks of a training run that stopped on a fault (tests/train/test_faults.py, test_bad_data.py): the tiny
stand-in model from a fixed seed, its parameters and the run directory's files before and after, and that
a stop wrote nothing (no checkpoint, no metrics, no summary, no partial directory)."""
import os

import mindspore as ms

from tests.support.train_tiny import TinyVLM


def tiny_model():
    ms.set_seed(0)
    return TinyVLM()


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
