"""Pipeline mode with the tiny MoE (configs/model/tiny-moe.yaml language model, stand-alone on CPU):

- the rank is given more micro-batches than one pipeline round takes (4 micro-batches, micro_batch_num 2):
  the step runs two rounds into the same accumulators and takes one update, equal to the micro-batch loop;
- the step's expert load has one row per MoE layer (the [1, 1] zeros it returned before made
  ExpertBiasUpdate fail with "StridedSlice begin[0] must be in [-1, 1)"), equal to the loop's;
- with the layers placed on two pipeline stages, the aux-loss-free bias update runs once per step and every
  MoE layer's bias moves as numpy predicts from that load.

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
from mindvl_ms.parallel.pipeline_step import PipelineMicroStep, expert_load_shape, pipeline_feeds
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.train_step import TrainStep
from tests.support.paths import ROOT

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


def _run(pipeline, steps=2):
    st = load(StageConfig, dict(name="s", seq_length=LENGTH, global_batch_size=4, micro_batch_size=1, max_steps=1,
                                max_lr=1e-2))
    ms.set_seed(0)
    model = TinyMoELM(_text())
    if pipeline:
        placed = assign_pipeline_stages(model, pipeline[0], [1, 0])  # 3 layers: 2 on stage 0, 1 on stage 1
        assert [placed[f"layers.{i}"] for i in range(3)] == [0, 0, 1] and placed["lm_head"] == 1
    eng = TrainStep(model, select_trainable(model, [""]), model.INPUT_NAMES, st.loss, st, pipeline=pipeline)
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


def test_pipeline_step_of_the_tiny_moe_runs_the_bias_update_as_numpy_predicts():
    eng, out, params = _run((2, 2))
    assert isinstance(eng.micro, PipelineMicroStep) and eng.micro.load_shape == (2, 8)
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


def test_pipeline_feeds_consume_every_micro_batch_of_the_rank():
    """128 micro-batches on a rank (1024 rows / dp 8) with micro_batch_num 32: four stacked rounds, in order."""
    arrays = [[np.full((2, 3), i), np.full(4, -i)] for i in range(128)]
    feeds = pipeline_feeds(arrays, 32)
    assert len(feeds) == 4 and all([x.shape for x in f] == [(32, 2, 3), (32, 4)] for f in feeds)
    np.testing.assert_array_equal(np.concatenate([f[0][:, 0, 0] for f in feeds]), np.arange(128))
    with pytest.raises(ValueError, match="not a multiple of parallel_config.micro_batch_num 32"):
        pipeline_feeds(arrays[:100], 32)
    with pytest.raises(ValueError, match="different shapes"):
        pipeline_feeds([[np.zeros((2, 3))], [np.zeros((5, 3))]], 2)


def test_expert_load_shape_follows_the_moe_layers():
    assert expert_load_shape(TinyMoELM(_text())) == (2, 8)  # 1 dense + 2 MoE layers, 8 routed experts
    assert expert_load_shape(SimpleNamespace()) == (1, 1)
