"""The SFT step kept on the network across `run_training` calls (train_step.keep_train_step): a second run on
the same model whose stage fits the first run's graphs (`train_step.graph_key`) trains on the kept step without
compiling, and bit-identically to a run on a new model with a new step from the same weights; a run whose graphs
differ (another recompute setting, other trainable parameters) builds its own step; keeping None drops the kept
step (what a DPO / GRPO stage does before its own step is allocated, and a new SFT step before it is built)."""
import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore.graph import api

from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from mindvl_ms.train.train_step import keep_train_step, kept_train_step
from tests.support.train_tiny import TinyVLM, collate, make_rows

ROWS = make_rows(24, seed=7)
STAGE = dict(name="sft", trainable="all", seq_length=28, global_batch_size=4, micro_batch_size=2, max_lr=5e-3,
             warmup_ratio=0.25, epochs=None, max_steps=3)


def run_cfg(**stage):
    return load_run_config(data={"seed": 3, "plot": False, "stages": [dict(STAGE, **stage)]})


@pytest.fixture
def compiles(monkeypatch):
    """Graph compiles since the test started (a Cell's compile reports whether the graph is new)."""
    seen, compile_ = [], api._CellGraphExecutor.compile

    def counting(self, obj, *args, **kwargs):
        result = compile_(self, obj, *args, **kwargs)
        if isinstance(result, tuple) and result[1]:
            seen.append(type(obj).__name__)
        return result

    monkeypatch.setattr(api._CellGraphExecutor, "compile", counting)
    return seen


def train(model, out, cfg=None):
    summary = run_training(cfg or run_cfg(), str(out), model=model, progress=False, collate=collate,
                           data_factory=lambda rc, st, i, d: RowSource(ROWS, seed=rc.seed + i))
    losses = [json.loads(x)["loss"] for x in open(os.path.join(str(out), "metrics.jsonl"))]
    return summary["stages"][0]["compiled_graphs"], losses, {p.name: p.asnumpy() for p in model.get_parameters()}


def test_a_second_run_on_the_same_network_reuses_its_step(tmp_path, compiles):
    ms.set_seed(0)
    model = TinyVLM()
    init = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    compiled, losses, _ = train(model, tmp_path / "first")
    assert compiled == 1 and {"MicroStep", "ReduceStep", "AdamWUpdate"} <= set(compiles)
    del compiles[:]
    step = kept_train_step(model, (repr(run_cfg().recompute_config),))
    assert step is not None

    for p in model.get_parameters():  # the second run starts where the first did
        p.set_data(ms.Tensor(init[p.name]))
    compiled2, losses2, params2 = train(model, tmp_path / "second", run_cfg(max_lr=2e-3, weight_decay=0.05))
    assert compiled2 == 0 and compiles == []
    assert kept_train_step(model, (repr(run_cfg().recompute_config),)) is step

    ms.set_seed(0)
    fresh = TinyVLM()  # a new model and a new step from the same weights: the same losses and parameters, bitwise
    for p in fresh.get_parameters():
        p.set_data(ms.Tensor(init[p.name]))
    compiled3, losses3, params3 = train(fresh, tmp_path / "fresh", run_cfg(max_lr=2e-3, weight_decay=0.05))
    assert compiled3 == 1 and "MicroStep" in compiles and losses3 == losses2 and losses2 != losses
    for name, value in params3.items():
        np.testing.assert_array_equal(params2[name], value, err_msg=name)


def test_runs_whose_graphs_differ_build_their_own_step(tmp_path, compiles):
    ms.set_seed(0)
    model = TinyVLM()
    train(model, tmp_path / "a")
    first = kept_train_step(model, (repr(run_cfg().recompute_config),))
    compiled, _, _ = train(model, tmp_path / "b", run_cfg(trainable="projector"))  # other trainable parameters
    assert compiled == 1 and compiles.count("MicroStep") == 2 and kept_train_step(model, (repr(run_cfg().recompute_config),)) is not first
    other = load_run_config(data={"seed": 3, "plot": False, "recompute_config": {"recompute": True},
                                  "stages": [STAGE]})
    assert kept_train_step(model, (repr(other.recompute_config),)) is None  # another recompute setting: not taken


def test_keeping_none_drops_the_kept_step():
    net, settings = TinyVLM(), ("a",)
    step = object()
    keep_train_step(net, settings, step)
    assert kept_train_step(net, settings) is step and kept_train_step(net, ("b",)) is None
    keep_train_step(net, settings, None)
    assert kept_train_step(net, settings) is None and "_mindvl_train_step" not in vars(net)
