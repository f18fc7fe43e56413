"""GRPO math: group advantages and the clipped surrogate against hand-computed cases; the compiled
objective (graph mode) against a float64 numpy reference, its gradient on the first mini-step against
the plain policy gradient, and which side clipping engages on."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.train.post.grpo import GRPOObjective, group_advantages, grpo_loss_numpy
from tests.support.post import LossGrad

IGN = -100


def test_group_advantages_hand_computed():
    # group 1: mean 0.5, std (Bessel) = sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.8660
    # group 2: all equal -> 0; group 3: [3, 1]: mean 2, std sqrt(2) -> +-0.7071
    a = group_advantages([1, 0, 0, 1, 2, 2, 2, 2, 3, 1, 3, 1][:8] + [3, 1, 3, 1], 4, eps=0.0 + 1e-12)
    np.testing.assert_allclose(a[:4], [0.8660254, -0.8660254, -0.8660254, 0.8660254], rtol=1e-6)
    np.testing.assert_allclose(a[4:8], 0.0, atol=1e-9)
    np.testing.assert_allclose(a[8:], [0.8660254, -0.8660254, 0.8660254, -0.8660254], rtol=1e-6)
    np.testing.assert_allclose(group_advantages([3, 1], 2, eps=1e-12), [1 / np.sqrt(2), -1 / np.sqrt(2)], rtol=1e-9)


@pytest.mark.parametrize("ratio,adv,expect_loss,clipped", [
    (1.5, 1.0, -1.28, 1),    # A > 0, ratio above 1 + eps_high: clipped at 1.28
    (0.5, 1.0, -0.5, 0),     # A > 0, ratio below 1 - eps_low: not clipped (min picks the unclipped term)
    (0.5, -1.0, 0.8, 1),     # A < 0, ratio below 1 - eps_low: clipped at 0.8
    (1.5, -1.0, 1.5, 0),     # A < 0, ratio above 1 + eps_high: not clipped
    (1.1, 2.0, -2.2, 0),     # inside the range
])
def test_surrogate_hand_computed(ratio, adv, expect_loss, clipped):
    lp = np.array([[np.log(ratio)]])
    loss, n = grpo_loss_numpy(lp, np.zeros((1, 1)), lp, np.array([[adv]]), np.ones((1, 1)), 0.2, 0.28, 0.0, 1.0)
    assert loss == pytest.approx(expect_loss, abs=1e-12)
    assert n == clipped


def test_kl_term_hand_computed():
    # ref - logp = 0.5: k3 = e^0.5 - 0.5 - 1 = 0.148721; ratio 1, A 0 -> loss = 0.1 * k3
    loss, _ = grpo_loss_numpy([[0.0]], [[0.0]], [[0.5]], [[0.0]], [[1.0]], 0.2, 0.28, 0.1, 1.0)
    assert loss == pytest.approx(0.1 * (np.exp(0.5) - 1.5), abs=1e-12)


def _case(seed=0, b=2, l=6, v=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, l, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, l)).astype(np.int32)
    targets[:, :2] = IGN                     # prompt positions
    targets[1, -1] = IGN                     # padding
    adv = np.repeat(rng.normal(size=(b, 1)), l, 1).astype(np.float32)
    lsm = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    mask = targets != IGN
    logp = np.where(mask, np.take_along_axis(lsm, np.where(mask, targets, 0)[..., None], -1)[..., 0], 0.0)
    return logits, targets, adv, logp, mask, lsm


def test_objective_matches_reference_and_first_step_is_policy_gradient():
    logits, targets, adv, logp, mask, lsm = _case()
    n = float(mask.sum()) + 3.0              # a global token count larger than this micro-batch's
    obj = LossGrad(GRPOObjective(0.2, 0.28, 0.0))
    old = logp.astype(np.float32)            # first mini-step: behaviour policy = current policy
    loss, g = obj(Tensor(logits), Tensor(targets), Tensor(old), Tensor(old), Tensor(adv), Tensor(n, ms.float32))
    ref_loss, _ = grpo_loss_numpy(logp, old, old, adv, mask, 0.2, 0.28, 0.0, n)
    assert float(loss.asnumpy()) == pytest.approx(ref_loss, abs=1e-5)
    assert float(loss.asnumpy()) == pytest.approx(-(adv * mask).sum() / n, abs=1e-5)  # ratio = 1
    # policy gradient of -sum A logp(target) / N w.r.t. the logits: -A (onehot - softmax) / N
    onehot = np.eye(logits.shape[-1])[np.where(mask, targets, 0)]
    pg = -(adv * mask)[..., None] * (onehot - np.exp(lsm)) / n
    np.testing.assert_allclose(g.asnumpy(), pg, atol=1e-6)
    _, stats = GRPOObjective(0.2, 0.28, 0.0)(Tensor(logits), Tensor(targets), Tensor(old), Tensor(old),
                                              Tensor(adv), Tensor(n, ms.float32))
    st = stats.asnumpy()
    assert st[0] == mask.sum() and st[1] == 0
    ent = -(np.exp(lsm) * lsm).sum(-1)
    assert st[2] == pytest.approx((ent * mask).sum(), rel=1e-5)


def test_clipping_engages_on_the_right_side():
    logits, targets, _, logp, mask, lsm = _case(seed=1)
    adv = np.array([[1.0], [-1.0]], np.float32).repeat(targets.shape[1], 1)
    obj = LossGrad(GRPOObjective(0.2, 0.28, 0.0))
    for shift, zero_row, live_row in ((-0.5, 0, 1), (0.5, 1, 0)):
        # shift -0.5: old = logp - 0.5 -> ratio = e^0.5 = 1.65 > 1.28: A > 0 (row 0) clipped, A < 0 live
        # shift +0.5: ratio = e^-0.5 = 0.61 < 0.8: A < 0 (row 1) clipped, A > 0 live
        old = (logp + shift).astype(np.float32)
        loss, g = obj(Tensor(logits), Tensor(targets), Tensor(old), Tensor(old), Tensor(adv), Tensor(10.0, ms.float32))
        ref_loss, n_clip = grpo_loss_numpy(logp, old, old, adv, mask, 0.2, 0.28, 0.0, 10.0)
        assert float(loss.asnumpy()) == pytest.approx(ref_loss, abs=1e-5)
        assert n_clip == mask[zero_row].sum()
        g = g.asnumpy()
        assert np.abs(g[zero_row]).max() == 0.0                     # clipped: no gradient
        assert np.abs(g[live_row][mask[live_row]]).min() > 0.0      # unclipped side still learns
        _, stats = GRPOObjective(0.2, 0.28, 0.0)(Tensor(logits), Tensor(targets), Tensor(old), Tensor(old),
                                                  Tensor(adv), Tensor(10.0, ms.float32))
        assert stats.asnumpy()[1] == n_clip


def test_kl_coefficient_in_graph():
    logits, targets, adv, logp, mask, _ = _case(seed=2)
    ref = (logp + 0.3 * np.random.default_rng(0).normal(size=logp.shape)).astype(np.float32)
    old = logp.astype(np.float32)
    loss, stats = GRPOObjective(0.2, 0.28, 0.05)(Tensor(logits), Tensor(targets), Tensor(old), Tensor(ref),
                                                  Tensor(adv), Tensor(7.0, ms.float32))
    ref_loss, _ = grpo_loss_numpy(logp, old, ref, adv, mask, 0.2, 0.28, 0.05, 7.0)
    assert float(loss.asnumpy()) == pytest.approx(ref_loss, abs=1e-5)
    d = ref - logp
    assert stats.asnumpy()[3] == pytest.approx(((np.exp(d) - d - 1) * mask).sum(), rel=1e-4)
