"""The one-graph train step (train/mf_step.py: MindFormers' GradAccumulationCellWithMultiOutputs +
MFTrainOneStepCell around ForwardLoss, this project's AdamW) against the host-driven TrainStep on the tiny
MindVL config: 3 optimizer steps with 2 micro-batches of 2 rows each, stand-alone on CPU.

MFTrainOneStepCell's finite check uses NPUGetFloatStatusV2 (Ascend only); inside this test only, monkeypatch
replaces `get_overflow_status` by an all-finite check of the gradients (same meaning: True = overflow)."""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from mindvl_ms.config import load_model_config
from mindvl_ms.config.base import load
from mindvl_ms.config.train import StageConfig
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import mf_step
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.train_step import TrainStep
from tests.support.paths import ROOT

_finite = ops.MultitypeFuncGraph("finite")


@_finite.register("Tensor")
def _finite_one(g):
    return ops.isfinite(g).all().reshape(1)


def cpu_overflow(self, status, grads):
    """CPU stand-in for TrainOneStepWithLossScaleCell.get_overflow_status: True when a gradient is not finite."""
    return ops.logical_not(ops.concat(self.hyper_map(_finite, grads)).all())


def rows(n, seed, cfg):
    """n one-sample rows, each one 56x56 image (16 patches, 4 merged tokens) in 20 tokens: equal shapes in
    every micro-batch, as the one-graph step needs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.array(list(rng.integers(100, 5000, 6)) + [cfg.vision_start_token_id] + [cfg.image_token_id] * 4
                       + [cfg.vision_end_token_id] + list(rng.integers(100, 5000, 8)), np.int64)
        labels = ids.copy()
        labels[:12] = -100
        out.append([{"input_ids": ids, "labels": labels, "image_grid_thw": np.array([[1, 4, 4]], np.int64),
                     "pixel_values": rng.standard_normal((16, 1176)).astype(np.float32)}])
    return out


def micro_batches(step, cfg, stage):
    """One step's rows as micro-batches of `stage.micro_batch_size` rows, padded to the stage's seq_length."""
    n = stage.micro_batch_size
    return [build_model_inputs(step[i:i + n], cfg, pad_to=stage.seq_length) for i in range(0, len(step), n)]


def skip_nonfinite(eng, model, mbs):
    """A step whose gradients are not finite (an inf pixel) is skipped inside the graph: not applied,
    parameters, moments and the step counter bit-identical; the same compiled graph runs it."""
    before = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    state = {k: v.asnumpy().copy() for k, v in eng.state_parameters().items()}
    mbs[-1]["pixel_values"][0, 0] = np.inf
    res = eng.run(mbs, 1e-3)
    assert not res.applied and eng.compiles == 1
    for p in model.get_parameters():
        assert np.array_equal(p.asnumpy(), before[p.name]), p.name
    for k, v in eng.state_parameters().items():
        assert np.array_equal(v.asnumpy(), state[k]), k


def test_micro_batch_num():
    assert mf_step.micro_batch_num(1024, 8, 1) == 128
    assert mf_step.micro_batch_num(64, 2, 4) == 8
    with pytest.raises(ValueError, match="micro_batch_size"):
        mf_step.micro_batch_num(30, 4, 2)


def test_head_grid_is_the_stage_seq_length_under_semi_auto():
    """The joined feed's loss-head grid: under semi/auto parallel sized by the stage's seq_length at every
    step (one static shape, whatever the rows supervise); stand-alone by the step's largest micro-batch."""
    t = np.full((2, 64), -100, np.int32)
    a, b = t.copy(), t.copy()
    a[0, :5], b[1, :30] = 1, 1
    mbs = [{"targets": a}, {"targets": b}]
    assert mf_step.head_slots(mbs) == 30
    assert mf_step.head_slots(mbs, fixed=64) == 64
    assert mf_step.head_slots([{"targets": t}], fixed=64) == 64


@pytest.mark.slow
def test_one_graph_step_equals_train_step(monkeypatch):
    """Same loss (to 1 float32 ulp) and parameters (to 1e-6) as TrainStep after 3 steps x 2 micro-batches
    (2 rows each: the one-graph step unrolls one forward and backward per micro-batch, so 2 is its smallest
    accumulation and the smallest graph to compile), with active clipping, lr coefficients (vision x0.1),
    weight decay and the balanced loss (its token-weight denominator spans the micro-batches: the forward-only
    pre-pass graph). Not bitwise: the tied embedding / head gradient of the micro-batches is summed in another
    order (the unrolled graph's autodiff vs TrainStep's accumulator adds; with clipping off every other tensor
    is bitwise after step 1), and ClipGradNorm sums the squares in another order than GradNorm, which moves the
    clip factor by an ulp; Adam's m / sqrt(v) carries these ulps into the later steps."""
    monkeypatch.setattr(mf_step._mindformers().MFTrainOneStepCell, "get_overflow_status", cpu_overflow)
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    stage = load(StageConfig, dict(name="s", seq_length=24, global_batch_size=4, micro_batch_size=2, max_lr=1e-3,
                                   max_steps=3, weight_decay=0.1, grad_clip=1.0, lr_coefficients={"vision": 0.1},
                                   loss={"type": "balanced", "lambda1": 0.5, "lambda2": 1.5}))
    data = [rows(4, s, cfg) for s in range(3)]
    out = {}
    for kind in ("host", "graph"):
        ms.set_seed(0)
        model = MindVLModel(cfg)
        params = select_trainable(model, stage.trainable_prefixes())
        if kind == "host":  # TrainStep as it runs under semi/auto parallel: dense table gradients, static shapes
            eng = TrainStep(model, params, model.INPUT_NAMES, stage.loss, stage, compiler_reduces=True)
        else:
            eng = mf_step.MFStep(model, params, model.INPUT_NAMES, stage.loss, stage)
            assert eng.k == 2 and type(eng.cell).__name__ == "MFTrainOneStepCell"
        res = [eng.run(micro_batches(step, cfg, stage), 1e-3) for step in data]
        if kind == "graph":
            skip_nonfinite(eng, model, micro_batches(data[0], cfg, stage))
        out[kind] = (res, {p.name: p.asnumpy().copy() for p in model.get_parameters()},
                     {k: v.asnumpy().copy() for k, v in eng.state_parameters().items() if k.startswith("adam_")},
                     eng.compiles)
    (h, hp, hs, hc), (g, gp, gs, gc) = out["host"], out["graph"]
    assert gc == 1 and hc == 1  # one compiled graph for all 3 steps
    assert all(r.applied for r in h + g)
    assert all(r.grad_norm > stage.grad_clip for r in h)  # clipping was active
    np.testing.assert_allclose([r.loss for r in g], [r.loss for r in h], rtol=2e-7)
    np.testing.assert_allclose([r.grad_norm for r in g], [r.grad_norm for r in h], rtol=1e-6)
    assert sorted(gs) == sorted(hs) and int(gs["adam_step"]) == 3
    for k, v in hp.items():
        np.testing.assert_allclose(gp[k], v, rtol=0, atol=1e-6, err_msg=k)
    assert np.abs(hp["model.norm.weight"] - 1.0).max() > 1e-3  # it trained (norms start at 1)
