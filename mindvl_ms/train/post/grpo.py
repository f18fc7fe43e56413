"""GRPO with verifiable rewards and DAPO's clip-higher: the math (host and graph).

Per rollout batch (prompts x G sampled responses; the openPangu-VL report, section 4.2, uses G = 8,
temperature 1.0, no KL term):

    A_i       = (r_i - mean(r_group)) / (std(r_group) + eps)      group-normalised advantage, the
                                                                 same for every token of response i
                                                                 (std with Bessel's correction, as
                                                                 torch.std; a group with equal rewards
                                                                 has A = 0 and teaches nothing)
    rho_t     = exp(logp_t - logp_old_t)                         logp_old: the policy that sampled
    l_t       = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)   (DAPO clip-higher:
                                                                 eps_high > eps_low)
              + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)       (k3 KL estimator, beta = kl_coef,
                                                                 default 0)
    L         = sum over all response tokens of the mini-batch l_t / (number of those tokens)
                                                                 (token-level normalisation, DAPO)

The denominator is the global (all ranks, all micro-batches) token count of the optimizer mini-batch,
passed in from the host, so the micro-batch shares add up to exactly L (the same invariance as the SFT
loss, train/loss.py). On the first mini-step logp_old equals the current log-probs, rho = 1 and the
gradient is the plain policy gradient -sum A grad(logp) / N.

A token counts as clipped when the clipped term is the active one and its gradient is zero:
A > 0 and rho > 1 + eps_high, or A < 0 and rho < 1 - eps_low.

`GRPOObjective` is the graph cell (see train/post/step.py); `group_advantages` and `grpo_loss_numpy` are the
host-side reference used by the stage and by the tests.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindvl_ms.train.post.step import target_logp


def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """[n_prompts * G] rewards (grouped consecutively) -> [n_prompts * G] advantages."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r[:, :1])
    return ((r - r.mean(axis=1, keepdims=True)) / (std + eps)).reshape(-1)


def grpo_loss_numpy(logp, old_logp, ref_logp, adv, mask, clip_low, clip_high, kl_coef, token_norm):
    """Reference of the per-micro-batch loss share (float64). Arrays [B, L]; returns (loss, clipped)."""
    logp, old_logp, ref_logp, adv, mask = (np.asarray(x, np.float64) for x in (logp, old_logp, ref_logp, adv, mask))
    ratio = np.exp(logp - old_logp)
    surr = np.minimum(ratio * adv, np.clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
    d = ref_logp - logp
    kl = np.exp(d) - d - 1
    loss = ((-surr + kl_coef * kl) * mask).sum() / token_norm
    clipped = (((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))) & (mask > 0)
    return loss, int(clipped.sum())


class GRPOObjective(nn.Cell):
    """construct(logits [B,L,V], targets [B,L], old_logp [B,L], ref_logp [B,L], adv [B,L], token_norm [])
    -> (loss share [], stats [4] = tokens, clipped tokens, entropy sum, KL sum)."""

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.28, kl_coef: float = 0.0, temperature: float = 1.0):
        super().__init__()
        if not (0 <= clip_low < 1 and clip_high >= 0):
            raise ValueError(f"GRPO clip ranges: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
        self.lo, self.hi, self.kl_coef = 1.0 - float(clip_low), 1.0 + float(clip_high), float(kl_coef)
        self.temperature = float(temperature)
        self.key = ("grpo", self.lo, self.hi, self.kl_coef, self.temperature)  # the constants its graph holds

    def construct(self, logits, targets, old_logp, ref_logp, adv, token_norm):
        logp, mask, entropy = target_logp(logits, targets, self.temperature)  # [B, L] each
        ratio = ops.exp(logp - old_logp)
        clipped_ratio = ops.clamp(ratio, self.lo, self.hi)
        surr = ops.minimum(ratio * adv, clipped_ratio * adv)
        d = ref_logp - logp
        kl = ops.exp(d) - d - 1.0
        per_tok = (kl * self.kl_coef - surr) * mask
        loss = per_tok.sum() / ops.maximum(token_norm, 1.0)
        clipped = ops.logical_or(ops.logical_and(adv > 0, ratio > self.hi),
                                 ops.logical_and(adv < 0, ratio < self.lo)).astype(ms.float32) * mask
        stats = ops.stack([mask.sum(), ops.stop_gradient(clipped).sum(), entropy.sum(),
                           ops.stop_gradient(kl * mask).sum()])
        return loss, stats
