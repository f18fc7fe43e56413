"""Pipeline stages with the tiny MoE (configs/model/tiny-moe.yaml language model, stand-alone on CPU), on
the one-graph step the trainer builds under semi/auto parallel (train/mf_step.py, pipeline_stages 2:
MindFormers' PipelineCellWithMultiOutputs over the rank's 4 micro-batches):

- the step's expert load has one row per MoE layer, [moe layers, E] (a [1, 1] load made ExpertBiasUpdate
  fail with "StridedSlice begin[0] must be in [-1, 1)");
- with the layers placed on two pipeline stages, the aux-loss-free bias update runs once per step and every
  MoE layer's bias moves as numpy predicts from that load;
- loss, expert load, biases and parameters equal the plain micro-batch accumulation (TrainStep, built as
  under semi/auto parallel: static shapes).

Stand-alone, MFStep runs the pipeline cell under MFTrainOneStepCell (MFPipelineWithLossScaleCell needs
semi/auto parallel); its finite check is Ascend-only, so monkeypatch swaps in the CPU check of
tests/train/test_mf_step.py. The pipeline schedule itself is Ascend-only.

    python -m pytest -q tests/train/test_pipeline_moe.py
"""
import dataclasses
import os
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest

from mindvl_ms.config import load_model_config
from mindvl_ms.config.base import load
from mindvl_ms.config.train import StageConfig
from mindvl_ms.models.moe import DeepseekV3ForCausalLM
from mindvl_ms.parallel.pipeline import assign_pipeline_stages
from mindvl_ms.train import mf_step
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.train_step import TrainStep
from tests.support.paths import ROOT
from tests.train.test_mf_step import cpu_overflow

pytestmark = pytest.mark.slow  # over ~12 s: -m 'not slow' leaves it out, CI runs it

VOCAB, LENGTH = 64, 16


class TinyMoELM(DeepseekV3ForCausalLM):
    """The tiny MoE language model as a train-step model: (input_ids, position_ids, segment_ids) ->
    (logits, aux, expert load), with the `config.text` the step reads the balancing speed from."""

    INPUT_NAMES = ("input_ids", "position_ids", "segment_ids")

    def __init__(self, text):
        super().__init__(text)
        self.config = SimpleNamespace(text=text)


def _text():
    cfg = load_model_config(os.path.join(ROOT, "configs/model/tiny-moe.yaml")).text
    return dataclasses.replace(cfg, vocab_size=VOCAB, moe=dataclasses.replace(cfg.moe, num_nextn_predict_layers=0))


def _micro_batch(rng):
    """One row of two packed arithmetic sequences (next = previous + 3), the last 3 positions padding."""
    seg = np.ones((1, LENGTH), np.int32) + (np.arange(LENGTH) >= 9)
    seg[0, -3:] = 0
    ids = ((rng.randint(0, VOCAB) + 3 * np.arange(LENGTH)) % VOCAB).astype(np.int32)[None]
    ids[seg == 0] = 0
    tgt = np.full((1, LENGTH), -100, np.int32)
    tgt[:, :-1] = np.where(seg[:, 1:] == seg[:, :-1], ids[:, 1:], -100)
    tgt[seg == 0] = -100
    pos = np.zeros((3, 1, LENGTH), np.int32)
    tok = np.full((1, LENGTH), -1, np.int32)
    for s in (1, 2):
        m = seg[0] == s
        pos[:, 0, m] = np.arange(m.sum())
        sup = m & (tgt[0] != -100)
        tok[0, sup] = np.arange(sup.sum())
    return {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "targets": tgt, "token_index": tok}


def _run(pipeline_stages, steps=2):
    """`steps` optimizer steps of 4 micro-batches: MFStep with pipeline stages, or TrainStep's plain loop."""
    st = load(StageConfig, dict(name="s", seq_length=LENGTH, global_batch_size=4, micro_batch_size=1, max_steps=1,
                                max_lr=1e-2))
    ms.set_seed(0)
    model = TinyMoELM(_text())
    params = select_trainable(model, [""])
    if pipeline_stages:
        placed = assign_pipeline_stages(model, pipeline_stages, [1, 0])  # 3 layers: 2 on stage 0, 1 on stage 1
        assert [placed[f"layers.{i}"] for i in range(3)] == [0, 0, 1] and placed["lm_head"] == 1
        eng = mf_step.MFStep(model, params, model.INPUT_NAMES, st.loss, st, pipeline_stages=pipeline_stages)
    else:  # as the trainer builds it under semi/auto parallel: static shapes, the compiler's reduction
        eng = TrainStep(model, params, model.INPUT_NAMES, st.loss, st, compiler_reduces=True)
    assert eng.bias_updater is not None
    routers = model.model.routers()
    rng = np.random.RandomState(0)
    out = []
    for _ in range(steps):
        before = np.stack([r.e_score_correction_bias.asnumpy() for r in routers])
        res = eng.run([_micro_batch(rng) for _ in range(4)], 1e-2)
        after = np.stack([r.e_score_correction_bias.asnumpy() for r in routers])
        out.append((res, before, after))
    params = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    return eng, out, params


def test_one_graph_pipeline_of_the_tiny_moe_runs_the_bias_update_as_numpy_predicts(monkeypatch):
    monkeypatch.setattr(mf_step._mindformers().MFTrainOneStepCell, "get_overflow_status", cpu_overflow)
    eng, out, params = _run(2)
    assert type(eng.cell.network).__name__ == "PipelineCellWithMultiOutputs" and eng.cell.network.micro_size == 4
    assert eng.share.load.shape == (2, 8)  # 1 dense + 2 MoE layers, 8 routed experts
    assert eng.compiles == 1
    speed = _text().moe.bias_update_speed
    valid = 4 * (LENGTH - 3)  # real tokens in the step's 4 micro-batches
    for res, before, after in out:
        assert res.applied
        load = res.expert_load
        assert load.shape == (2, 8)  # one row per MoE layer
        np.testing.assert_array_equal(load.sum(1), [valid * 2] * 2)  # top-2: two routed copies per real token
        want = before + speed * np.sign(load.mean(1, keepdims=True) - load)
        np.testing.assert_allclose(after, want, rtol=0, atol=1e-7)
        assert np.abs(after - before).max() == pytest.approx(speed)

    _, loop, loop_params = _run(None)  # the micro-batch loop on the same batches
    for (res, _, after), (ref, _, ref_after) in zip(out, loop):
        assert res.loss == pytest.approx(ref.loss, rel=1e-5)
        np.testing.assert_array_equal(res.expert_load, ref.expert_load)
        np.testing.assert_allclose(after, ref_after, rtol=0, atol=1e-7)
    for k, v in loop_params.items():
        np.testing.assert_allclose(params[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
