"""The compiled train step: accumulation invariance, frozen modules, AdamW vs numpy, non-finite skip,
dynamic loss scaling, one compile per stage, a step restarted for the next stage."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor

from mindvl_ms.config.base import load
from mindvl_ms.config.train import StageConfig
from mindvl_ms.train.batches import micro_batches
from mindvl_ms.train.optim import AdamWUpdate, GradNorm, select_trainable
from mindvl_ms.train.train_step import TrainStep
from tests.support.train_tiny import TinyVLM, collate, make_rows


def stage_cfg(**kw):
    base = dict(name="s", seq_length=28, global_batch_size=8, micro_batch_size=8, max_lr=1e-2, max_steps=3,
                weight_decay=0.1, grad_clip=1.0)
    base.update(kw)
    return load(StageConfig, base)


def fresh_model(snapshot=None):
    ms.set_seed(0)
    m = TinyVLM()
    if snapshot is not None:
        for p in m.get_parameters():
            p.set_data(Tensor(snapshot[p.name]))
    return m


def snapshot(m):
    return {p.name: p.asnumpy().copy() for p in m.get_parameters()}


@pytest.fixture(scope="module")
def kept_steps():
    """precision -> (model, its micro-batch-4 step), kept across this module's tests: a later test takes the
    step back restarted (`TrainStep.restart`: a new step's state, and training bit-identical to a new step's,
    test_restart_for_a_fitting_stage_equals_a_new_step) on the same model with its weights set, instead of
    compiling a new step's graphs."""
    return {}


def kept_step(kept, init, stage, **kw):
    """(model with the weights `init`, a step for `stage` with a new step's state) from `kept`, or new ones
    that `kept` keeps."""
    precision = kw.get("precision", "float32")
    if precision not in kept:
        m = fresh_model(init)
        kept[precision] = (m, TrainStep(m, select_trainable(m, stage.trainable_prefixes()), m.INPUT_NAMES,
                                        stage.loss, stage, **kw))
        return kept[precision]
    m, eng = kept[precision]
    for p in m.get_parameters():
        p.set_data(Tensor(init[p.name]))
    assert eng.restart(m, select_trainable(m, stage.trainable_prefixes()), m.INPUT_NAMES, stage.loss, stage, **kw)
    return m, eng


def train(model, stage, rows_per_step, steps=2, eng=None, **kw):
    params = select_trainable(model, stage.trainable_prefixes())
    eng = eng or TrainStep(model, params, model.INPUT_NAMES, stage.loss, stage, **kw)
    results = []
    for s in range(steps):
        rows = rows_per_step[s]
        mbs = [collate(r, stage) for r in micro_batches(rows, stage.micro_batch_size)]
        results.append(eng.run(mbs, 1e-2))
    return eng, results


def test_accumulation_invariance():
    """Same global batch, micro x accumulation = 8x1 and 2x4: same losses and parameters (balanced loss,
    the harder case: its per-token denominator spans micro-batches; token_mean is covered in test_train_loss)."""
    kind = "balanced"
    rows = make_rows(16, seed=5)
    steps = [rows[:8], rows[8:]]
    init = snapshot(fresh_model())
    out = {}
    for micro in (8, 2):
        st = stage_cfg(micro_batch_size=micro, loss={"type": kind, "lambda1": 0.5, "lambda2": 1.5})
        m = fresh_model(init)
        eng, res = train(m, st, steps)
        out[micro] = ([r.loss for r in res], snapshot(m), eng.compiles)
        assert all(r.applied for r in res)
    for micro in (2,):
        np.testing.assert_allclose(out[micro][0], out[8][0], rtol=2e-5)
        for k, v in out[8][1].items():
            np.testing.assert_allclose(out[micro][1][k], v, rtol=1e-4, atol=2e-5, err_msg=k)
        assert out[micro][2] == 1  # one compiled micro-step graph for all micro-batches and steps
    assert any(not np.array_equal(out[8][1][k], init[k]) for k in init)  # it did train


def test_frozen_modules_untouched_and_without_gradients():
    st = stage_cfg(trainable="projector", micro_batch_size=4)
    m = fresh_model()
    before = snapshot(m)
    rows = make_rows(16, seed=1)
    eng, res = train(m, st, [rows[:8], rows[8:]])
    after = snapshot(m)
    merger = {k for k in before if k.startswith("visual.merger.")}
    assert merger and all(not np.array_equal(before[k], after[k]) for k in merger)
    for k in set(before) - merger:
        assert np.array_equal(before[k], after[k]), k          # bit-identical
    # gradients exist only for the projector: grad weights, accumulators and moments
    assert {p.name for p in eng.micro.weights} == merger
    assert {p.name for p in eng.accum} == {f"accum.{k}" for k in merger}
    assert {p.name for p in eng.update.m} == {f"adam_m.{k}" for k in merger}
    assert all(not p.requires_grad for p in m.get_parameters() if p.name not in merger)


def test_adamw_matches_numpy():
    """Bias-corrected AdamW with decoupled weight decay only on matrices, LR coefficient by longest
    prefix, global-norm clipping, on the fused kernel (bias correction folded into its scalars)."""
    rng = np.random.RandomState(0)
    w = Parameter(Tensor(rng.randn(3, 4).astype(np.float32)), name="visual.blocks.0.w")
    b = Parameter(Tensor(rng.randn(4).astype(np.float32)), name="visual.merger.bias")
    params = [w, b]
    acc = ParameterTuple(Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"acc.{p.name}") for p in params)
    upd = AdamWUpdate(params, acc, {"visual.": 0.1, "visual.merger.": 2.0}, 0.05, 0.9, 0.95, 1e-8)
    norm_cell = GradNorm(acc)
    p_np = [w.asnumpy().astype(np.float64), b.asnumpy().astype(np.float64)]
    m_np = [np.zeros_like(p) for p in p_np]
    v_np = [np.zeros_like(p) for p in p_np]
    lr, clip = 1e-2, 0.5
    for t in range(1, 4):
        g = [rng.randn(*p.shape) * 3 for p in p_np]
        for a, x in zip(acc, g):
            a.set_data(Tensor(x.astype(np.float32)))
        gn = math.sqrt(sum((x ** 2).sum() for x in g))
        norm = float(norm_cell(Tensor(1.0, ms.float32)).asnumpy())
        assert norm == pytest.approx(gn, rel=1e-5)
        c = min(1.0, clip / (norm + 1e-6))
        upd(*(Tensor(x, ms.float32) for x in (c, *upd.bias_corrected(lr, t))))
        assert all(not a.asnumpy().any() for a in acc)  # accumulators cleared
        for i, (coef, wd) in enumerate([(0.1, 1.0), (2.0, 0.0)]):
            gi = g[i] * c
            m_np[i] = 0.9 * m_np[i] + 0.1 * gi
            v_np[i] = 0.95 * v_np[i] + 0.05 * gi * gi
            upd_i = (m_np[i] / (1 - 0.9 ** t)) / (np.sqrt(v_np[i] / (1 - 0.95 ** t)) + 1e-8) + 0.05 * wd * p_np[i]
            p_np[i] = p_np[i] - lr * coef * upd_i
    np.testing.assert_allclose(w.asnumpy(), p_np[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.asnumpy(), p_np[1], rtol=1e-5, atol=1e-6)
    assert int(upd.step.asnumpy()) == 3


def test_nonfinite_step_is_skipped_bit_identically(kept_steps):
    st = stage_cfg(micro_batch_size=4)
    m, eng = kept_step(kept_steps, snapshot(fresh_model()), st)
    rows = make_rows(16, seed=2)
    good = [collate(r, st) for r in micro_batches(rows[:8], 4)]
    assert eng.run(good, 1e-2).applied
    before = snapshot(m)
    state_before = {k: p.asnumpy().copy() for k, p in eng.state_parameters().items()}
    bad = [collate(r, st) for r in micro_batches(rows[8:], 4)]
    bad[1]["pixel_values"][0, 0] = np.nan
    res = eng.run(bad, 1e-2)
    assert not res.applied and not math.isfinite(res.loss)
    after = snapshot(m)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    for k, p in eng.state_parameters().items():
        assert np.array_equal(state_before[k], p.asnumpy()), k   # moments and step untouched
    assert all(not a.asnumpy().any() for a in eng.accum)          # accumulators cleared for the next step
    assert eng.run(good, 1e-2).applied                            # training continues


def test_dynamic_loss_scale_halves_on_overflow_and_matches_unscaled(kept_steps):
    """A loss scale that overflows fp32 skips the step and halves; once finite, the update equals the
    unscaled run (power-of-two scaling is exact)."""
    st = stage_cfg(micro_batch_size=4)
    rows = make_rows(40, seed=3)
    steps = [rows[i * 8:(i + 1) * 8] for i in range(5)]
    init = snapshot(fresh_model())
    fp16 = dict(precision="float16", loss_scale_value=2.0 ** 130 / 2 ** 3, loss_scale_factor=2.0,
                loss_scale_window=1000)
    m2, eng2 = kept_step(kept_steps, init, st, **fp16)
    _, res = train(m2, st, steps, steps=5, eng=eng2)
    scales = [r.loss_scale for r in res]
    skipped = [not r.applied for r in res]
    assert skipped[0] and scales[0] == 2.0 ** 126
    first_ok = skipped.index(False)
    assert all(skipped[:first_ok])
    # after the overflow steps, the same updates happen (shifted by the skipped steps)
    m3, eng3 = kept_step(kept_steps, init, st)
    _, ref_shift = train(m3, st, steps[first_ok:], steps=5 - first_ok, eng=eng3)
    np.testing.assert_allclose([r.loss for r in res[first_ok:]], [r.loss for r in ref_shift], rtol=1e-5)
    assert all(r.applied for r in ref_shift)


def test_restart_for_a_fitting_stage_equals_a_new_step(kept_steps):
    """A step restarted for the next stage (same trainable set, loss and micro-batch share; other rows'
    length, LR, weight decay, epsilon, clipping and LM-head chunk) holds a new step's state (moments, step,
    accumulators, the float16 loss scale and its good-step count back at the start) and trains
    bit-identically to a new step for that stage, on its first stage's graphs. A stage whose graphs
    differ (betas, trainable set, loss, share) is refused and changes nothing."""
    a = stage_cfg(micro_batch_size=4)
    b = stage_cfg(name="b", seq_length=40, micro_batch_size=4, weight_decay=0.02, adam_eps=1e-6, grad_clip=0.5,
                  loss={"logits_chunk_tokens": 64})
    fp16 = dict(precision="float16", loss_scale_value=2.0 ** 100, loss_scale_factor=2.0, loss_scale_window=2)
    rows = make_rows(48, seed=3)
    m, eng = kept_step(kept_steps, snapshot(fresh_model()), a, **fp16)
    eng, res = train(m, a, [rows[i * 8:(i + 1) * 8] for i in range(3)], steps=3, eng=eng)
    state = {k: p.asnumpy().copy() for k, p in eng.state_parameters().items()}
    assert all(r.applied for r in res) and int(state["adam_step"]) == 3
    assert float(state["loss_scale"]) == 2.0 ** 101 and int(state["loss_scale_good_steps"]) == 1
    for other in (stage_cfg(adam_beta2=0.99), stage_cfg(trainable="projector"), stage_cfg(loss={"type": "balanced"}),
                  stage_cfg(micro_batch_size=2)):
        assert not eng.restart(m, select_trainable(m, other.trainable_prefixes()), m.INPUT_NAMES, other.loss,
                               other, **fp16), other
    assert all(np.array_equal(state[k], p.asnumpy()) for k, p in eng.state_parameters().items())
    start = snapshot(m)
    assert eng.restart(m, select_trainable(m, b.trainable_prefixes()), m.INPUT_NAMES, b.loss, b, **fp16)
    ref_m = fresh_model(start)
    ref = TrainStep(ref_m, select_trainable(ref_m, b.trainable_prefixes()), ref_m.INPUT_NAMES, b.loss, b, **fp16)
    fresh = {k: p.asnumpy() for k, p in ref.state_parameters().items()}
    assert sorted(fresh) == sorted(eng.state_parameters())
    for k, p in eng.state_parameters().items():
        assert np.array_equal(p.asnumpy(), fresh[k]), k
    assert all(not x.asnumpy().any() for x in eng.accum)
    graphs = [len(c.compile_cache) for c in (eng.micro, eng.reduce, eng.update)]
    for s in range(3):
        mbs = [collate(r, b) for r in micro_batches(rows[24 + s * 8:32 + s * 8], 4)]
        x, y = eng.run(mbs, 3e-3 * (s + 1)), ref.run(mbs, 3e-3 * (s + 1))
        np.testing.assert_array_equal([x.loss, x.grad_norm, x.loss_scale], [y.loss, y.grad_norm, y.loss_scale])
        assert x.applied and y.applied
    after, ref_after = snapshot(m), snapshot(ref_m)
    assert any(not np.array_equal(after[k], start[k]) for k in start)  # it trained
    for k, v in ref_after.items():
        assert np.array_equal(after[k], v), k
    for k, p in ref.state_parameters().items():
        assert np.array_equal(eng.state_parameters()[k].asnumpy(), p.asnumpy()), k
    assert eng.compiles == 0 and ref.compiles == 1
    assert [len(c.compile_cache) for c in (eng.micro, eng.reduce, eng.update)] == graphs
