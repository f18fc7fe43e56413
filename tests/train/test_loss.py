"""Token-mean and balanced loss (openPangu-VL eq. 1) against an independent numpy/torch reference:
values, gradients w.r.t. the logits, per-sample correctness inside a pack, and invariance of the
global loss to how the batch is split into micro-batches."""
import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindvl_ms.train.loss import IGNORE, TrainLoss


def ref_balanced(logits, targets, segs, tau1, tau2, l1, l2):
    """Eq. (1) straight from the report, per sample j and token i (order counted here), in torch.
    Weights are detached (stop-gradient)."""
    lg = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(lg, -1)
    num_t = den_t = 0.0
    per_sample = []
    for sid in sorted(set(segs[segs > 0].tolist())):
        rows, cols = np.nonzero((segs == sid) & (targets != IGNORE))
        if rows.size == 0:
            continue
        num = den = 0.0
        for i, (r, c) in enumerate(sorted(zip(rows.tolist(), cols.tolist()))):
            ce = -logp[r, c, targets[r, c]]
            w = 1.0 / math.log(math.e + tau1 * i) + 2.0 / (1.0 + math.exp(-(tau2 * ce.item() - 0.5)))
            num, den = num + w * ce, den + w
        num_t, den_t = num_t + num, den_t + den
        per_sample.append(num / den)
    loss = l1 * num_t / den_t + l2 * sum(per_sample) / len(per_sample)
    loss.backward()
    return loss.item(), lg.grad.numpy()


def pack(samples, row_len, layout):
    """Pack (ids, labels) samples into rows as given by `layout` (list of lists of sample indices)."""
    b = len(layout)
    targets = np.full((b, row_len), IGNORE, np.int32)
    segs = np.zeros((b, row_len), np.int32)
    tidx = np.full((b, row_len), -1, np.int32)
    for r, row in enumerate(layout):
        col = 0
        for j in row:
            tgt = samples[j]
            n = len(tgt)
            targets[r, col:col + n] = tgt
            segs[r, col:col + n] = j + 1
            sup = tgt != IGNORE
            tidx[r, col:col + n] = np.where(sup, np.cumsum(sup) - 1, -1)
            col += n
    return targets, segs, tidx


def make_samples(rng, n, vocab):
    out = []
    for _ in range(n):
        length = rng.randint(2, 9)
        t = rng.randint(0, vocab, size=length).astype(np.int32)
        t[: rng.randint(0, length)] = IGNORE  # unsupervised prompt part
        out.append(t)
    return out


def any_shape(cell, vocab):
    """`cell` compiled once for every [B, L] (dynamic shapes, as in the train step), vocabulary `vocab`."""
    ids = Tensor(shape=[None, None], dtype=ms.int32)
    scalar = Tensor(shape=[], dtype=ms.float32)
    cell.set_inputs(Tensor(shape=[None, None, vocab], dtype=ms.float32), ids, ids, ids, scalar, scalar)
    return cell


def run_loss(cell, logits, targets, segs, tidx, norm, j):
    return float(cell(Tensor(logits), Tensor(targets), Tensor(segs), Tensor(tidx),
                      Tensor(norm, ms.float32), Tensor(j, ms.float32)).asnumpy())


def test_token_mean_matches_numpy():
    rng = np.random.RandomState(0)
    samples = make_samples(rng, 4, 11)
    targets, segs, tidx = pack(samples, 20, [[0, 1], [2, 3]])
    logits = rng.randn(2, 20, 11).astype(np.float32)
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    m = targets != IGNORE
    ce = lse[m] - np.take_along_axis(x, np.where(m, targets, 0)[..., None], -1)[..., 0][m]
    got = run_loss(TrainLoss("token_mean"), logits, targets, segs, tidx, float(m.sum()), 4.0)
    assert got == pytest.approx(ce.mean(), rel=1e-5)


@pytest.mark.parametrize("l1,l2,tau1,tau2", [(1.0, 1.0, 0.1, 2.0), (0.3, 0.7, 0.5, 1.0), (0.0, 1.0, 0.1, 2.0)])
def test_balanced_value_and_grad_match_reference(l1, l2, tau1, tau2):
    rng = np.random.RandomState(1)
    samples = make_samples(rng, 5, 13)
    samples[0][:] = rng.randint(0, 13, size=len(samples[0]))  # at least one fully supervised sample
    targets, segs, tidx = pack(samples, 24, [[0, 1, 2], [3, 4]])
    logits = (2 * rng.randn(2, 24, 13)).astype(np.float32)
    cell = TrainLoss("balanced", l1, l2, tau1, tau2)
    j = float(len({s for s in segs[targets != IGNORE].tolist()}))
    got = run_loss(cell, logits, targets, segs, tidx, -1.0, j)
    want, want_grad = ref_balanced(logits, targets, segs, tau1, tau2, l1, l2)
    assert got == pytest.approx(want, rel=1e-5)
    class OfLogits(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.cell = cell
            self.rest = (Tensor(targets), Tensor(segs), Tensor(tidx), Tensor(-1.0, ms.float32), Tensor(j, ms.float32))

        def construct(self, lg):
            return self.cell(lg, *self.rest)

    grad = ms.grad(OfLogits())(Tensor(logits))
    np.testing.assert_allclose(grad.asnumpy(), want_grad, rtol=1e-4, atol=1e-7)


def test_per_sample_terms_inside_a_pack():
    """Packing samples into one row gives the same balanced loss as one sample per row: the
    per-sample term is computed per segment, not per row."""
    rng = np.random.RandomState(2)
    samples = make_samples(rng, 3, 9)
    for s in samples:
        s[-1] = 3  # every sample has a supervised token
    logits_rows = [rng.randn(len(s), 9).astype(np.float32) for s in samples]
    t1, s1, i1 = pack(samples, 30, [[0, 1, 2]])
    packed = np.zeros((1, 30, 9), np.float32)
    col = 0
    for lg in logits_rows:
        packed[0, col:col + len(lg)] = lg
        col += len(lg)
    t2, s2, i2 = pack(samples, 10, [[0], [1], [2]])
    separate = np.zeros((3, 10, 9), np.float32)
    for r, lg in enumerate(logits_rows):
        separate[r, :len(lg)] = lg
    cell = any_shape(TrainLoss("balanced", 0.0, 1.0), 9)  # per-sample term only: a per-row version would differ
    a = run_loss(cell, packed, t1, s1, i1, -1.0, 3.0)
    b = run_loss(cell, separate, t2, s2, i2, -1.0, 3.0)
    assert a == pytest.approx(b, rel=1e-6)
    # and it is the mean of the three one-sample losses
    singles = [run_loss(cell, separate[r:r + 1], t2[r:r + 1], s2[r:r + 1], i2[r:r + 1], -1.0, 1.0) for r in range(3)]
    assert a == pytest.approx(np.mean(singles), rel=1e-6)


@pytest.mark.parametrize("kind", ["token_mean", "balanced"])
def test_global_loss_invariant_to_micro_batch_split(kind):
    """Sum of micro-batch shares (normalised with global counts) == loss of the whole batch."""
    rng = np.random.RandomState(3)
    samples = make_samples(rng, 8, 10)
    for s in samples:
        s[-1] = 1
    layout = [[0, 1], [2], [3, 4, 5], [6, 7]]
    targets, segs, tidx = pack(samples, 20, layout)
    logits = rng.randn(4, 20, 10).astype(np.float32)
    cell = any_shape(TrainLoss(kind, 0.6, 0.4, 0.1, 2.0), 10)
    j = 8.0
    sup = float((targets != IGNORE).sum())

    def norm_for(rows):
        if kind == "token_mean":
            return sup
        return sum(float(cell.weight_sum(Tensor(logits[r:r + 1]), Tensor(targets[r:r + 1]),
                                         Tensor(tidx[r:r + 1])).asnumpy()) for r in rows)

    whole = run_loss(cell, logits, targets, segs, tidx, sup if kind == "token_mean" else -1.0, j)
    for split in ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]):
        norm = norm_for(range(4))
        parts = sum(run_loss(cell, logits[m], targets[m], segs[m], tidx[m], norm, j) for m in map(list, split))
        assert parts == pytest.approx(whole, rel=1e-5), split
    if kind == "balanced":
        want, _ = ref_balanced(logits, targets, segs, 0.1, 2.0, 0.6, 0.4)
        assert whole == pytest.approx(want, rel=1e-5)
