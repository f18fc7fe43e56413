"""MoE training on CPU in graph mode: loss decreases, router load statistics, balancing bias update, aux/MTP."""
import dataclasses
import os

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn
import pytest

from mindvl_ms.config import load_model_config
from mindvl_ms.config.model import MoEConfig
from mindvl_ms.models.moe import CausalLMLoss, DeepseekV3ForCausalLM, mtp_targets
from mindvl_ms.models.moe_router import (ExpertBiasUpdate, TopkRouter, expert_load, load_stats, seq_aux_loss,
                                         update_expert_bias)
from tests.support.paths import ROOT

TINY = "configs/model/tiny-moe.yaml"


def _tiny_text(vocab=64):
    cfg = load_model_config(os.path.join(ROOT, TINY)).text
    return dataclasses.replace(cfg, vocab_size=vocab, moe=dataclasses.replace(cfg.moe))


def _task(b=4, length=16, vocab=64, seed=0):
    """Arithmetic sequences (next = previous + 3 mod vocab), two samples packed per row, one padded row."""
    rng = np.random.RandomState(seed)
    ids = ((rng.randint(0, vocab, (b, 1)) + 3 * np.arange(length)) % vocab).astype(np.int32)
    seg = np.ones((b, length), np.int32) + (np.arange(length) >= 11)
    seg[1:] += 2 * np.arange(1, b)[:, None]
    seg[-1, -3:] = 0
    ids[seg == 0] = 0
    tgt = np.full((b, length), -100, np.int32)
    tgt[:, :-1] = np.where(seg[:, 1:] == seg[:, :-1], ids[:, 1:], -100)
    tgt[seg == 0] = -100
    pos = np.zeros((3, b, length), np.int32)
    for r in range(b):
        for s in set(seg[r].tolist()) - {0}:
            m = seg[r] == s
            pos[:, r, m] = np.arange(m.sum())
    return ids, pos, seg, tgt


@pytest.mark.slow
def test_loss_decreases_with_mtp_aux_and_bias_update_in_graph_mode():
    cfg = _tiny_text()
    assert cfg.moe.num_nextn_predict_layers == 1 and cfg.moe.seq_aux_loss_coef > 0
    lm = DeepseekV3ForCausalLM(cfg)
    loss_cell = CausalLMLoss(lm)
    opt = nn.AdamWeightDecay(lm.trainable_params(), learning_rate=3e-3)
    grad_fn = ms.value_and_grad(loss_cell, None, opt.parameters, has_aux=True)
    names_before = [p.name for p in lm.get_parameters()]
    updater = lm.model.bias_updater()
    assert [p.name for p in lm.get_parameters()] == names_before  # the updater renames nothing
    bias_names = [n for n, _ in lm.parameters_and_names() if n.endswith("e_score_correction_bias")]
    assert all(n not in {p.name for p in opt.parameters} for n in bias_names)  # never trained by gradients

    @ms.jit
    def step(ids, pos, seg, tgt):
        (loss, load), grads = grad_fn(ids, pos, seg, tgt)
        opt(grads)
        return loss, load

    ids, pos, seg, tgt = (Tensor(a) for a in _task())
    valid = int((seg.asnumpy() > 0).sum())
    losses, stats = [], []
    for _ in range(25):
        loss, load = step(ids, pos, seg, tgt)
        updater(load)
        losses.append(float(loss))
        stats.append(load_stats(load.asnumpy()))
        # every real token sends k copies in each of the 2 MoE layers; padding is not counted
        np.testing.assert_array_equal(load.asnumpy().sum(1), [valid * cfg.moe.num_experts_per_tok] * 2)
    assert losses[-1] < 0.25 * losses[0], losses
    assert [p.name for p in lm.get_parameters()] == names_before
    assert all(len(s["max_over_mean"]) == 2 and min(s["max_over_mean"]) >= 1.0 for s in stats)
    bias = lm.model.layers[1].mlp.gate.e_score_correction_bias.asnumpy()
    assert np.abs(bias).max() > 0 and np.allclose(np.abs(bias) / cfg.moe.bias_update_speed,
                                                  np.round(np.abs(bias) / cfg.moe.bias_update_speed), atol=1e-3)


def test_bias_update_rule_matches_numpy():
    moe = MoEConfig(n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1)
    routers = nn.CellList([TopkRouter(8, moe), TopkRouter(8, moe)])  # unique names, as inside a model
    start = np.random.randn(2, 6).astype(np.float32) * 0.01
    for r, b in zip(routers, start):
        r.e_score_correction_bias.set_data(Tensor(b))
    load = np.array([[5, 1, 3, 3, 0, 6], [2, 2, 2, 2, 2, 2]], np.float32)
    new = ExpertBiasUpdate(routers, 0.01)(Tensor(load)).asnumpy()
    ref = start + 0.01 * np.sign(load.mean(1, keepdims=True) - load)
    np.testing.assert_allclose(new, ref, rtol=0, atol=1e-7)
    np.testing.assert_allclose(routers[0].e_score_correction_bias.asnumpy(), ref[0], atol=1e-7)
    host = update_expert_bias(routers, load, 0.01)  # host-side twin, one more step
    np.testing.assert_allclose(host, ref + 0.01 * np.sign(load.mean(1, keepdims=True) - load), atol=1e-6)


class _RouteAndBalance(nn.Cell):
    def __init__(self, router, speed):
        super().__init__()
        self.router = router
        self.update = ExpertBiasUpdate([router], speed)

    def construct(self, x, valid):
        idx, _, _ = self.router(x)
        load = expert_load(idx, self.router.num_experts, valid)[None]
        self.update(load)
        return load


def test_bias_update_balances_a_skewed_router():
    """Stated bound: from max/mean >= 2 to <= 1.15 within 100 steps, and it stays <= 1.2 afterwards."""
    moe = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
    rng = np.random.RandomState(0)
    d, t = 16, 512
    router = TopkRouter(d, moe)
    u = rng.randn(d)
    u /= np.linalg.norm(u)
    w = rng.randn(8, d) * 0.3 + np.linspace(2.0, -2.0, 8)[:, None] * u[None]  # expert 0 strongly preferred
    router.weight.set_data(Tensor(w.astype(np.float32)))
    x = Tensor((rng.randn(t, d) + u).astype(np.float32))
    valid = Tensor(np.ones(t, np.float32))
    net = _RouteAndBalance(router, 0.01)
    ratios = []
    for _ in range(140):
        load = net(x, valid).asnumpy()[0]
        ratios.append(load.max() / load.mean())
    assert ratios[0] >= 2.0, ratios[0]
    assert min(ratios[:100]) <= 1.15
    assert max(ratios[100:]) <= 1.2, ratios[100:]


def test_seq_aux_loss_matches_numpy():
    b, length, e, k = 2, 6, 8, 2
    scores = np.random.rand(b * length, e).astype(np.float32)
    idx = np.stack([np.random.choice(e, k, replace=False) for _ in range(b * length)]).astype(np.int32)
    valid = np.ones(b * length, np.float32)
    valid[-2:] = 0

    class Aux(nn.Cell):
        def construct(self, s, i, v):
            return seq_aux_loss(s, i, v, b, k)

    got = float(Aux()(Tensor(scores), Tensor(idx), Tensor(valid)))
    total = 0.0
    for r in range(b):
        rows = [t for t in range(r * length, (r + 1) * length) if valid[t] > 0]
        n = len(rows)
        probs = scores[rows] / scores[rows].sum(-1, keepdims=True)
        f = np.bincount(idx[rows].reshape(-1), minlength=e) * e / (k * n)
        total += (f * probs.mean(0)).sum()
    np.testing.assert_allclose(got, total / b, rtol=1e-5)


def test_mtp_targets_stay_inside_samples():
    _, _, seg, tgt = _task()

    class Targets(nn.Cell):
        def construct(self, t, s):
            return mtp_targets(t, s, 2)

    got = Targets()(Tensor(tgt), Tensor(seg)).asnumpy()
    ref = np.full_like(tgt, -100)
    for r in range(tgt.shape[0]):
        for i in range(tgt.shape[1] - 2):
            if seg[r, i + 2] == seg[r, i]:
                ref[r, i] = tgt[r, i + 2]
    np.testing.assert_array_equal(got, ref)
