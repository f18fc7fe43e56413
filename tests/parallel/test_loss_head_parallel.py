"""The chunked loss head under tensor parallel (train/loss_head.py ChunkedHeadCE, parallel/parallelize.py
shard_loss_head): semi-auto graphs cannot compile on CPU, so

- the strategies `shard_loss_head` declares are read back: every head MatMul carries MindFormers' vocab-parallel
  head strategy, the [c, V] block primitives (dp, vt), none is left without one; an unsharded model leaves the
  head alone (fused CPU path, no strategy);
- the vocab split is emulated in numpy from those read-back strategies: each (dp, vt) rank computes its
  logits shard, its partial max / sum of exp / target logit, combined as the all-reduces combine them, and its
  parts of dh and dW; the result equals the full cross entropy and gradients (float64, <= 1e-6);
- the split form the sharded head runs (`vocab_parallel`), run stand-alone on CPU, equals the fused path and
  the float64 reference (float32: within 1e-5 of each other).
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.config import load_model_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.audit import primitive_census, strategy_of
from mindvl_ms.parallel.parallelize import head_split, shard_loss_head
from mindvl_ms.parallel.styles import ParallelReport, ShardContext, VocabParallelCE
from mindvl_ms.train.forward_loss import ForwardLoss
from mindvl_ms.train.loss import TrainLoss
from mindvl_ms.train.loss_head import IGNORE, ChunkedHeadCE
from tests.train.test_loss_head import _numpy_ce_and_grads, head_case

AUDITED = ("MatMul", "BatchMatMul", "Gather")


def _forward_loss(model):
    names = list(model.INPUT_NAMES)
    return ForwardLoss(model, TrainLoss("token_mean"), len(names), names.index("segment_ids"), sparse=True)


@pytest.mark.parametrize("path,dp,tp,vocab_dp", [("configs/model/tiny.yaml", 2, 2, False),
                                                  ("configs/model/tiny-moe.yaml", 2, 2, False),
                                                  ("configs/model/tiny.yaml", 4, 1, True)])
def test_head_strategies_read_back(path, dp, tp, vocab_dp):
    cfg = load_model_config(path)
    model = MindVLModel(cfg)
    rep = parallelize(model, Layout(dp=dp, tp=tp, vocab_emb_dp=vocab_dp))
    vt = rep.vocab_split
    assert vt == (1 if vocab_dp or cfg.text.vocab_size % tp else tp)
    head = _forward_loss(model).head
    assert head.vocab_parallel and head_split(model) == (dp, vt)
    c = primitive_census(head)
    assert sum(c["without"].values()) == 0, dict(c["without"])
    assert c["with"]["MatMul"] == 3 and sum(c["with"][k] for k in AUDITED) == 3
    assert strategy_of(head.mm_nt) == ((dp, 1), (vt, 1))          # as lm_head: weight [V, D] split on V
    assert strategy_of(head.mm) == ((dp, vt), (vt, 1))
    assert strategy_of(head.mm_tn) == ((dp, vt), (dp, 1))
    for attr in ("max", "exp", "sum"):
        assert strategy_of(getattr(head, attr)) == ((dp, vt),), attr
    assert strategy_of(head.onehot) == ((dp, vt), (), ())


def test_unsharded_model_leaves_the_head_alone():
    model = MindVLModel(load_model_config("configs/model/tiny.yaml"))
    head = _forward_loss(model).head
    assert head_split(model) is None and not head.vocab_parallel
    c = primitive_census(head)
    assert sum(c["with"].values()) == 0 and c["without"]["MatMul"] == 3  # the fused CPU path, as before
    assert shard_loss_head(ChunkedHeadCE(), model) is False


def _split(n, parts, k):
    step = n // parts
    return slice(k * step, (k + 1) * step)


def _emulate(h, w, t, coef, head):
    """The sharded head's math, rank by rank, from the strategies read back from `head` (float64):
    -> (ce [c], dh [c, D], dW [V, D]) assembled from the ranks' pieces."""
    (dp, _), (vt, _) = strategy_of(head.mm_nt)
    assert strategy_of(head.sum) == ((dp, vt),) and strategy_of(head.mm_tn) == ((dp, vt), (dp, 1))
    c, v = t.shape[0], w.shape[0]
    ce, dh, dw = np.zeros(c), np.zeros(h.shape), np.zeros(w.shape)
    valid = (t != IGNORE)
    safe = np.where(valid, t, 0)
    for r in range(dp):                                       # rows of the block
        rows = _split(c, dp, r)
        hr, tr, s = h[rows], safe[rows], (coef * valid)[rows][:, None]
        shards = [_split(v, vt, k) for k in range(vt)]
        logits = [hr @ w[sl].T for sl in shards]             # mm_nt: each rank's [c/dp, V/vt]
        top = np.max([lg.max(-1) for lg in logits], 0)[:, None]  # all-reduce max over the vocab shards
        z = [lg - top for lg in logits]
        total = np.sum([np.exp(zk).sum(-1) for zk in z], 0)[:, None]  # all-reduce sum
        onehot = [(np.arange(sl.start, sl.stop)[None, :] == tr[:, None]).astype(np.float64) for sl in shards]
        picked = np.sum([(zk * oh).sum(-1) for zk, oh in zip(z, onehot)], 0)  # all-reduce sum
        ce[rows] = (np.log(total[:, 0]) - picked) * valid[rows]
        g = [np.exp(zk) / total - oh for zk, oh in zip(z, onehot)]
        dh[rows] = np.sum([gk @ w[sl] for gk, sl in zip(g, shards)], 0) * s  # mm: all-reduce over vocab shards
        for gk, sl in zip(g, shards):
            dw[sl] += gk.T @ (hr * s)                         # mm_tn: the vocab shard's rows, summed over dp
    return ce, dh, dw


@pytest.mark.parametrize("dp,vt", [(1, 4), (2, 2), (2, 1), (1, 1)])
def test_vocab_split_emulation_equals_the_full_cross_entropy(dp, vt):
    rng = np.random.default_rng(3)
    c, d, v = 8, 6, 40
    h, w = rng.standard_normal((c, d)), rng.standard_normal((v, d)) * 3
    t = rng.integers(0, v, c).astype(np.int32)
    t[[1, 6]] = IGNORE
    t[2] = v - 1                                              # a target in the last vocab shard
    coef = rng.random(c)
    head = ChunkedHeadCE()
    VocabParallelCE().apply("head", head, ShardContext({"dp": dp, "vt": vt}, None,
                                                       ParallelReport(None, "dp", vt)))
    ce, dh, dw = _emulate(h, w, t, coef, head)
    ref_ce, ref_dh, ref_dw = _numpy_ce_and_grads(h, w, t, coef)
    np.testing.assert_allclose(ce, ref_ce, rtol=0, atol=1e-6)
    np.testing.assert_allclose(dh, ref_dh, rtol=0, atol=1e-6)
    np.testing.assert_allclose(dw, ref_dw, rtol=0, atol=1e-6)


def _weighted_sum(head):
    def f(h, w, t, k):
        return (head(h, w, t) * k).sum()
    return f


def test_split_form_equals_the_fused_path_on_cpu():
    """The cell's vocab-parallel form (what runs sharded), stand-alone on CPU: CE and gradients equal the fused
    path's and the float64 reference."""
    ms.set_context(mode=ms.GRAPH_MODE)
    h, w, t, coef, _ = head_case(5)
    d = h.shape[-1]
    out = {}
    for split in (False, True):
        head = ChunkedHeadCE()
        head.vocab_parallel = split

        val, (gh, gw) = ms.jit(ms.value_and_grad(_weighted_sum(head), grad_position=(0, 1)))(
            Tensor(h), Tensor(w), Tensor(t), Tensor(coef))
        out[split] = (head(Tensor(h), Tensor(w), Tensor(t)).asnumpy(), gh.asnumpy(), gw.asnumpy(), val.asnumpy())
    ce, rh, rw = _numpy_ce_and_grads(h.reshape(-1, d), w, t.reshape(-1), coef.reshape(-1))
    np.testing.assert_allclose(out[True][0].reshape(-1), ce, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[True][1].reshape(-1, d), rh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[True][2], rw, rtol=1e-5, atol=1e-6)
    for a, b in zip(out[True], out[False]):  # two float32 computations of the same values
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
