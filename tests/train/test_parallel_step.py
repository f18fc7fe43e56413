"""Parallel-aware pieces of the train step on one CPU process: the gradient reduction (explicit sum,
gradients_mean, none under semi/auto parallel), the AdamW update as an nn.Optimizer (parallel
optimizer contract) and the host counts over data-parallel replicas. Pipeline stages run the one-graph
step (train/mf_step.py; tests/train/test_pipeline_moe.py).

    python -m pytest -q tests/train/test_parallel_step.py
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor, nn

from mindvl_ms.config.base import load
from mindvl_ms.config.train import RunConfig, StageConfig
from mindvl_ms.parallel.runtime import DistInfo, HostAllReduce, fill_coords
from mindvl_ms.train.optim import AdamWUpdate, select_trainable
from mindvl_ms.train.step_cells import ReduceStep
from mindvl_ms.train.train_step import TrainStep
from tests.support.train_tiny import TinyVLM


def _accum(values):
    return ParameterTuple(Parameter(Tensor(v.astype(np.float32)), name=f"acc{i}", requires_grad=False)
                          for i, v in enumerate(values))


@pytest.mark.parametrize("mean,explicit", [(False, True), (True, True), (True, False), (False, False)])
def test_reduce_step_sum_mean_or_none(mean, explicit):
    """Two data-parallel ranks; the collective is stood in by a primitive that doubles (both ranks hold
    the same accumulators). Sum: 2g; mean: g; compiler-reduced (semi/auto parallel): untouched, no
    collective built. The reported loss is the global one, and the norm is taken after the reduction."""
    rng = np.random.default_rng(0)
    g = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    acc = _accum(g)
    step = ReduceStep(acc, dp=2, mean=mean, explicit=explicit, allreduce=_two_equal_ranks)
    loss, norm = step(Tensor([1.5], ms.float32), Tensor(1.0, ms.float32))
    want = 1.0 if (mean or not explicit) else 2.0
    for a, x in zip(acc, g):
        np.testing.assert_allclose(a.asnumpy(), want * x, rtol=1e-6)
    assert float(loss.asnumpy()[0]) == pytest.approx(3.0 if explicit else 1.5)
    assert float(norm.asnumpy()) == pytest.approx(want * np.sqrt(sum((x ** 2).sum() for x in g)), rel=1e-5)
    assert hasattr(step, "allreduce") == explicit


def _two_equal_ranks(x):
    """Stand-in for AllReduce(sum) over two ranks that hold equal values."""
    return x * 2


def test_gradients_mean_is_read_by_the_train_step():
    st = load(StageConfig, dict(name="s", seq_length=28, global_batch_size=4, micro_batch_size=2, max_steps=1))
    ms.set_seed(0)
    m = TinyVLM()
    params = select_trainable(m, [""])
    e_sum = TrainStep(m, params, m.INPUT_NAMES, st.loss, st, dp=2, gradients_mean=False)
    e_mean = TrainStep(m, params, m.INPUT_NAMES, st.loss, st, dp=2, gradients_mean=True)
    e_auto = TrainStep(m, params, m.INPUT_NAMES, st.loss, st, dp=2, gradients_mean=True, compiler_reduces=True)
    assert (e_sum.reduce.reduce, e_sum.reduce.mean) == (True, False)
    assert (e_mean.reduce.reduce, e_mean.reduce.mean) == (True, True)
    assert (e_auto.reduce.reduce, e_auto.reduce.mean) == (False, False)


def test_compiler_reduces_only_under_semi_or_auto_parallel_on_several_ranks():
    def dist(mode, world, device="Ascend", dp=None):
        cfg = load(RunConfig, {"stages": [{"name": "s", "max_steps": 1}], "parallel": {"parallel_mode": mode},
                               "context": {"device_target": device},
                               "parallel_config": {"data_parallel": dp or world}})
        return fill_coords(DistInfo(0, world), cfg)

    for mode in (1, 2):
        d = dist(mode, 8)
        assert d.compiler_reduces and not d.explicit_grad_reduce
    for mode in (0, 3):
        d = dist(mode, 8)
        assert not d.compiler_reduces and d.explicit_grad_reduce
    assert not dist(1, 1).compiler_reduces and not dist(1, 1).explicit_grad_reduce  # one rank: nothing to reduce
    d = dist(0, 2, "CPU")  # msrun data parallel on CPU: the step's own all-reduce
    assert d.explicit_grad_reduce and not d.compiler_reduces


def test_adamw_update_is_an_optimizer_with_cloned_states():
    rng = np.random.RandomState(0)
    w = Parameter(Tensor(rng.randn(3, 4).astype(np.float32)), name="model.w")
    b = Parameter(Tensor(rng.randn(4).astype(np.float32)), name="model.norm.bias")
    acc = _accum([rng.randn(3, 4), rng.randn(4)])
    upd = AdamWUpdate([w, b], acc, {}, 0.1, 0.9, 0.95, 1e-8)
    assert isinstance(upd, nn.Optimizer) and upd._support_parallel_optimizer
    assert [p.name for p in upd.m] == ["adam_m.model.w", "adam_m.model.norm.bias"]
    assert [p.name for p in upd.v] == ["adam_v.model.w", "adam_v.model.norm.bias"]
    assert not upd.use_parallel and upd.optim_filter == (True, True)
    # a rank that does not own `b` (parallel optimizer in data-parallel mode) leaves it and its moments alone
    upd.optim_filter = (True, False)
    b0, w0 = b.asnumpy().copy(), w.asnumpy().copy()
    upd(*(Tensor(x, ms.float32) for x in (1.0, *upd.bias_corrected(1e-2, 1))))
    assert np.array_equal(b.asnumpy(), b0) and not upd.v[1].asnumpy().any()
    assert not np.array_equal(w.asnumpy(), w0) and upd.v[0].asnumpy().any()
    assert all(not a.asnumpy().any() for a in acc)  # both accumulators cleared


def test_host_counts_are_summed_over_data_parallel_replicas(monkeypatch):
    """Under TP x PP the tp * pp ranks of a replica read the same rows: the world sum counts them once."""
    h = HostAllReduce(world=8, dp=2)  # 8 ranks = 2 replicas x (tp 2 x pp 2)
    per_rank = np.array([10.0, 3.0], np.float32)  # supervised tokens, samples of each rank's replica rows

    class FakeSum:  # the world all-reduce: 4 ranks of replica 0 report per_rank, 4 of replica 1 report 2x
        def __call__(self, v):
            return Tensor(4 * per_rank + 4 * 2 * per_rank)

    h._cell = FakeSum()
    np.testing.assert_allclose(h(per_rank), per_rank + 2 * per_rank)  # replica 0 + replica 1
    assert HostAllReduce(world=4).replica == 1  # plain data parallel: the world sum as is
