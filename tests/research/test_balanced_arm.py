"""The balanced-loss experiment's tau1 = tau2 = 0 arm: both terms of openPangu-VL eq. 1 with every token
weight equal, i.e. the token mean plus the mean of the per-sample means (numpy reference)."""
import numpy as np
import mindspore as ms

from mindvl_ms.recipes.demo.config import load_demo_config
from mindvl_ms.train.loss import TrainLoss
from tests.research.helpers import load
from tests.support.paths import ROOT

balanced = load("balanced_loss/run.py", "research_balanced")


def test_the_arm_sets_both_terms_and_zero_taus_on_the_sft_variants():
    sets = balanced.ARMS["balanced (1,1), tau=0"]
    assert sets == ["stages.0.loss.type=balanced", "stages.0.loss.lambda1=1.0", "stages.0.loss.lambda2=1.0",
                    "stages.0.loss.tau1=0.0", "stages.0.loss.tau2=0.0"]
    # a branch trains the recipe's last stage alone (index 0 there; index 2 in the whole recipe)
    cfg, _ = load_demo_config(f"{ROOT}/configs/demo/full.yaml", "/tmp/data",
                              [s.replace("stages.0.", "stages.2.") for s in sets])
    variants = [v for v, parent in cfg.schedule() if parent is not None]
    assert [v.name for v in variants] == ["sft_256", "sft_512"]
    for v in variants:
        assert (v.loss.type, v.loss.lambda1, v.loss.lambda2, v.loss.tau1, v.loss.tau2) == ("balanced", 1, 1, 0, 0)


def test_tau_zero_is_token_mean_plus_sample_mean():
    rng = np.random.default_rng(0)
    ce = rng.uniform(0.1, 3.0, (2, 8)).astype(np.float32)                  # [B, L]
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 4, 0]], np.int32)  # 4 samples, 0 = padding
    mask = (seg > 0).astype(np.float32)
    idx = np.zeros_like(seg)
    for b in range(2):
        for s in np.unique(seg[b][seg[b] > 0]):
            pos = np.where(seg[b] == s)[0]
            idx[b, pos] = np.arange(len(pos))
    ce = ce * mask
    loss = TrainLoss("balanced", 1.0, 1.0, 0.0, 0.0).from_ce(
        ms.Tensor(ce), ms.Tensor(mask), ms.Tensor(seg), ms.Tensor(idx), ms.Tensor(-1.0, ms.float32),
        ms.Tensor(4.0, ms.float32))
    token_mean = ce.sum() / mask.sum()
    sample_mean = np.mean([ce[seg == s].mean() for s in (1, 2, 3, 4)])
    np.testing.assert_allclose(float(loss.asnumpy()), token_mean + sample_mean, rtol=1e-5)
    # the default taus re-weight tokens: a different value on the same batch
    other = TrainLoss("balanced", 1.0, 1.0).from_ce(
        ms.Tensor(ce), ms.Tensor(mask), ms.Tensor(seg), ms.Tensor(idx), ms.Tensor(-1.0, ms.float32),
        ms.Tensor(4.0, ms.float32))
    assert abs(float(other.asnumpy()) - (token_mean + sample_mean)) > 1e-3
