"""DPO + MPO losses (compiled objective) against an independent torch implementation of the published
formulas: loss and gradient w.r.t. the logits, with pairs packed as segments of one row, an NTP row in the
same micro-batch and a dummy pair for a pair-less micro-batch."""
import mindspore as ms
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mindspore import Tensor

from mindvl_ms.train.post.dpo import DPOObjective, dpo_arrays, response_sums
from tests.support.post import LossGrad

IGN = -100


def _batch(rng, v=13):
    """Row 0: pair (chosen seg 1: 3 prompt + 3 response, rejected seg 2: 3 prompt + 2 response);
    row 1: pair (segs 3, 4); row 2: NTP sample (seg 5). Targets at positions t predict token t+1."""
    l = 12
    seg = np.zeros((3, l), np.int32)
    tgt = np.full((3, l), IGN, np.int32)
    layout = [[(1, 3, 3), (2, 3, 2)], [(3, 2, 4), (4, 2, 1)], [(5, 0, 7)]]  # (segment, prompt, response)
    for r, row in enumerate(layout):
        col = 0
        for s, p, n in row:
            seg[r, col:col + p + n] = s
            tgt[r, col + p - 1 if p else col:col + p + n - 1] = rng.integers(0, v, size=n if p else n - 1)
            col += p + n
    rows = [[{}, {}], [{}, {}], [{}]]
    logits = rng.normal(size=(3, l, v)).astype(np.float32)
    return logits, tgt, seg, rows


def _torch_reference(logits, tgt, seg, ref, beta, w_pref, w_qual, w_gen, delta, n_pairs, n_chosen, n_ntp):
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    logp_all = F.log_softmax(x, -1)
    t = torch.tensor(np.where(tgt == IGN, 0, tgt), dtype=torch.long)
    m = torch.tensor(tgt != IGN, dtype=torch.float64)
    lp = logp_all.gather(-1, t[..., None])[..., 0] * m
    s = torch.tensor(seg, dtype=torch.long)
    tot = lambda k: lp[s == k].sum()  # noqa: E731
    chosen, rejected = torch.stack([tot(1), tot(3)]), torch.stack([tot(2), tot(4)])
    lc = chosen - torch.tensor(ref[:, 0], dtype=torch.float64)
    lr = rejected - torch.tensor(ref[:, 1], dtype=torch.float64)
    pref = -F.logsigmoid(beta * (lc - lr))
    qual = -F.logsigmoid(beta * lc - delta) - F.logsigmoid(-(beta * lr - delta))
    gen = -(lp[(s == 1) | (s == 3)]).sum() / n_chosen
    ntp = -(lp[s == 5]).sum() / n_ntp
    loss = (w_pref * pref + w_qual * qual).sum() / n_pairs + w_gen * gen + ntp
    loss.backward()
    return float(loss.detach()), x.grad.numpy(), float((beta * (lc - lr)).sum().detach())


@pytest.mark.parametrize("w_qual,w_gen", [(0.0, 0.0), (0.2, 1.0)])
def test_dpo_mpo_loss_and_grad_vs_torch(w_qual, w_gen):
    rng = np.random.default_rng(0)
    logits, tgt, seg, rows = _batch(rng)
    ref = rng.normal(-8, 1, size=(2, 2)).astype(np.float32)
    beta, w_pref, delta = 0.1, 0.8, 0.05
    n_pairs, n_chosen, n_ntp = 3.0, 9.0, 8.0  # global counts (larger than this micro-batch's)
    mb = {"targets": tgt, "segment_ids": seg}
    arrays = dpo_arrays(mb, rows, 2, ref, n_pairs, n_chosen, n_ntp, w_gen)
    obj = DPOObjective(beta, w_pref, w_qual)
    loss, g = LossGrad(obj)(Tensor(logits), *[Tensor(a) for a in arrays], Tensor(delta, ms.float32))
    ref_loss, ref_grad, margin_sum = _torch_reference(logits, tgt, seg, ref, beta, w_pref, w_qual, w_gen, delta,
                                                      n_pairs, n_chosen, n_ntp)
    assert float(loss.asnumpy()) == pytest.approx(ref_loss, abs=2e-5)
    np.testing.assert_allclose(g.asnumpy(), ref_grad, atol=2e-6)
    _, stats = obj(Tensor(logits), *[Tensor(a) for a in arrays], Tensor(delta, ms.float32))
    assert stats.asnumpy()[0] == pytest.approx(margin_sum / n_pairs, abs=1e-5)
    assert stats.asnumpy()[4] == pytest.approx(2 / n_pairs)


def test_pairless_micro_batch_is_ntp_only():
    rng = np.random.default_rng(1)
    logits, tgt, seg, rows = _batch(rng)
    mb = {"targets": tgt[2:], "segment_ids": np.where(seg[2:] > 0, 1, 0).astype(np.int32)}
    arrays = dpo_arrays(mb, [[{}]], 0, np.zeros((0, 2)), 4.0, 1.0, 8.0, 1.0)
    assert arrays[-1].tolist() == [0.0]  # the dummy pair has weight 0
    loss, stats = DPOObjective(0.1, 1.0, 0.2)(Tensor(logits[2:]), *[Tensor(a) for a in arrays], Tensor(0.0, ms.float32))
    x = logits[2:].astype(np.float64)
    lsm = x - np.log(np.exp(x).sum(-1, keepdims=True))
    m = tgt[2:] != IGN
    ce = -np.take_along_axis(lsm, np.where(m, tgt[2:], 0)[..., None], -1)[..., 0]
    assert float(loss.asnumpy()) == pytest.approx((ce * m).sum() / 8.0, abs=1e-5)
    assert np.all(stats.asnumpy() == 0)


def test_response_sums():
    lp = np.array([[0.5, 1.0, 2.0, 0.0]])
    np.testing.assert_allclose(response_sums(lp, np.array([[1, 1, 2, 0]])), [0.0, 1.5, 2.0])
