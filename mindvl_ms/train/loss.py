"""Training losses computed inside the compiled train step: token-mean CE and the openPangu-VL
balanced loss (report section 4.4, equation 1), correct per sample inside a pack.

    CE_t      = logsumexp(logits_t) - logits_t[target_t]         for supervised positions t
    w_t       = 1 / ln(e + tau1 * i_t)  +  2 * sigmoid(tau2 * CE_t - 0.5)
                (i_t = token_index: 0-based order of the target inside its sample)
    L_t       = sum_t w_t CE_t / sum_t w_t                        (per-token term)
    L_s       = 1/J sum_j [ sum_{t in j} w_t CE_t / sum_{t in j} w_t ]   (per-sample term)
    L         = lambda1 L_t + lambda2 L_s

Design choices:
- The weights are constants for the gradient (stop-gradient), as in other re-weighting schemes:
  the magnitude weight steers attention to hard tokens, it is not itself optimised.
- Samples are found by `segment_ids` (batch-unique id per packed sample, 0 = padding), so every
  sample in a pack gets its own L_s term; a sample never spans two micro-batches.
- Invariance to the micro-batch split (and to data-parallel ranks): each micro-batch returns its
  *share* of the global loss. The denominators that span the global batch come from the host:
  `token_norm` (token_mean: the global number of supervised tokens; balanced: the global sum of
  w, measured by a forward-only pre-pass, or <= 0 to use this micro-batch's own sum when it is the
  whole global batch) and `num_samples` (global J). Summing the shares over micro-batches and
  ranks gives exactly the global-batch loss, and so the same gradient.
"""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import nn, ops

from mindvl_ms.ops.softmax import log_softmax

IGNORE = -100


def token_ce(logits, targets):
    """Per-position cross entropy in fp32. logits [B, L, V], targets [B, L] -> (ce [B, L], mask [B, L]).

    log_softmax + gather rather than the fused SoftmaxCrossEntropyWithLogits on a one-hot: faster on CPU
    for vocabulary-sized logits and closer to a float64 reference (docs/PERFORMANCE.md, ## train)."""
    b, l, v = logits.shape
    mask = (targets != IGNORE).astype(ms.float32)                    # [B, L]
    safe = ops.select(targets != IGNORE, targets, ops.zeros_like(targets))
    logp = log_softmax(logits.astype(ms.float32).reshape(b * l, v), -1)  # [B*L, V]
    ce = -ops.gather_elements(logp, 1, safe.reshape(-1, 1))          # [B*L, 1]
    return ce.reshape(b, l) * mask, mask


def balanced_weights(ce, mask, token_index, tau1: float, tau2: float):
    """w = order weight + magnitude weight on supervised positions (stop-gradient). -> [B, L]."""
    idx = ops.maximum(token_index, 0).astype(ms.float32)             # [B, L]
    w_ord = 1.0 / ops.log(math.e + tau1 * idx)
    w_mag = 2.0 * ops.sigmoid(tau2 * ops.stop_gradient(ce) - 0.5)
    return ops.stop_gradient((w_ord + w_mag) * mask)


def segment_total(values, segment_ids):
    """Sum of `values` over each segment, broadcast back to its positions. [B, L] -> [B, L]."""
    flat_seg = segment_ids.reshape(-1)
    n = ops.scalar_to_tensor(values.shape[0] * values.shape[1] + 1, ms.int32)
    sums = ops.unsorted_segment_sum(values.reshape(-1), flat_seg, n)  # [B*L+1]
    return ops.gather(sums, flat_seg, 0).reshape(values.shape)


class TrainLoss(nn.Cell):
    """This micro-batch's share of the global-batch loss (see module doc).

    construct(logits [B,L,V], targets [B,L], segment_ids [B,L], token_index [B,L],
              token_norm [] float32, num_samples [] float32) -> loss []
    from_ce(ce [B,L], mask [B,L], segment_ids, token_index, token_norm, num_samples) -> loss []
      (the train step's path: CE from `train.loss_head.ChunkedHeadCE` on the supervised-only grid)
    """

    def __init__(self, kind: str = "token_mean", lambda1: float = 1.0, lambda2: float = 1.0,
                 tau1: float = 0.1, tau2: float = 2.0):
        super().__init__()
        if kind not in ("token_mean", "balanced"):
            raise ValueError(f"loss type '{kind}': expected token_mean or balanced")
        self.balanced = kind == "balanced"
        self.lambda1, self.lambda2, self.tau1, self.tau2 = float(lambda1), float(lambda2), float(tau1), float(tau2)

    def construct(self, logits, targets, segment_ids, token_index, token_norm, num_samples):
        ce, mask = token_ce(logits, targets)                          # [B, L]
        return self.from_ce(ce, mask, segment_ids, token_index, token_norm, num_samples)

    def from_ce(self, ce, mask, segment_ids, token_index, token_norm, num_samples):
        """The loss share from per-position CE (0 where unsupervised) and its mask, any [B, L] layout
        (the full one, or the compact supervised-only grid of `train.loss_head`)."""
        if not self.balanced:
            return ce.sum() / ops.maximum(token_norm, 1.0)
        w = balanced_weights(ce, mask, token_index, self.tau1, self.tau2)
        wce = w * ce                                                  # [B, L]
        w_total = ops.select(token_norm > 0, token_norm, w.sum())
        loss_t = wce.sum() / ops.maximum(w_total, 1e-12)
        den = segment_total(w, segment_ids)                           # [B, L] sample's sum of w
        loss_s = (wce / ops.maximum(den, 1e-12)).sum() / ops.maximum(num_samples, 1.0)
        return self.lambda1 * loss_t + self.lambda2 * loss_s

    def weight_sum(self, logits, targets, token_index):
        """Sum of balanced weights in this micro-batch (the pre-pass for a split global batch)."""
        ce, mask = token_ce(logits, targets)
        return self.weight_sum_ce(ce, mask, token_index)

    def weight_sum_ce(self, ce, mask, token_index):
        return balanced_weights(ce, mask, token_index, self.tau1, self.tau2).sum()
