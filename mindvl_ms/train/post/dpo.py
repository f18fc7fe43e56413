"""DPO with the Mixed Preference Optimization losses and the NTP mix (openPangu-VL report 4.2, MPO [37]).

For a pair (chosen c, rejected r) of one prompt, with response log-probs summed over response tokens,
log-ratios to the reference policy lc = log pi(c) - log pi_ref(c), lr = log pi(r) - log pi_ref(r):

    L_pref = -log sigmoid(beta (lc - lr))                                   sigmoid DPO (Rafailov et al.)
    L_qual = -log sigmoid(beta lc - delta) - log sigmoid(-(beta lr - delta))  BCO-style quality loss (MPO);
             delta = running mean of the batch-mean rewards beta*(lc, lr) of the previous steps (0 at the
             first; TRL's bco_pair also folds in the current batch)
    L_gen  = token-mean cross entropy of the chosen responses              SFT on chosen (MPO generation loss)
    L_ntp  = token-mean cross entropy of the mixed-in SFT rows             the report's NTP mix
    L      = w_pref mean_pairs(L_pref) + w_qual mean_pairs(L_qual) + w_gen L_gen + L_ntp

Layout: the chosen and rejected sequences of a pair (each = prompt + response) are two segments of the
same packed row, so they share a micro-batch; NTP rows (SFT samples from a second data source) join the
same micro-batches. Per-response sums are segment sums of per-token log-probs (`segment_ids` from
`build_model_inputs`); the pair index arrays and per-token CE weights come from the host. Every mean is
over the global batch (all ranks and micro-batches) through host-side counts, so the micro-batch shares
add up to exactly L. A micro-batch without pairs carries one dummy pair of weight 0 (static shapes).

Reference log-probs: precomputed once per pair with the stage's starting weights (a forward-only pass
over the preference set before the first update, `reference_logps.npy` in the stage directory, reloaded
on resume). Memory: 8 bytes per pair on the host, nothing on the device; time: one forward pass over the
pairs. The alternative, a frozen copy of the model inside the same graph, costs a second copy of every
weight on each device (the full model size in the compute dtype, e.g. ~14 GB for a 7B model in bf16) plus
its forward activations at every step, and a second forward per step; it is not implemented.
`delta` (the BCO running mean) is checkpointed with the optimizer state so resume is exact.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindvl_ms.train.loss import IGNORE
from mindvl_ms.train.post.step import target_logp


def log_sigmoid(x):
    return -ops.softplus(-x)


class DPOObjective(nn.Cell):
    """construct(logits [B,L,V], targets [B,L], segment_ids [B,L], ce_weight [B,L], pair_c [P], pair_r [P],
    ref_c [P], ref_r [P], pair_w [P], delta []) -> (loss share [], stats [5]).

    ce_weight holds w_gen / N_chosen on chosen tokens and 1 / N_ntp on NTP tokens (0 elsewhere); pair_w is
    1 / N_pairs (0 for a dummy pair). stats = (sum w*margin, sum w*[margin > 0], sum w*beta*lc,
    sum w*beta*lr, sum w) over this micro-batch's pairs, margin = beta (lc - lr)."""

    def __init__(self, beta: float = 0.1, preference_weight: float = 1.0, quality_weight: float = 0.0):
        super().__init__()
        self.beta, self.w_pref, self.w_qual = float(beta), float(preference_weight), float(quality_weight)
        self.key = ("dpo", self.beta, self.w_pref, self.w_qual)  # the constants its graph holds

    def construct(self, logits, targets, segment_ids, ce_weight, pair_c, pair_r, ref_c, ref_r, pair_w, delta):
        logp, _, _ = target_logp(logits, targets)                           # [B, L]
        b, l = logp.shape
        n = ops.scalar_to_tensor(b * l + 1, ms.int32)
        seg = ops.unsorted_segment_sum(logp.reshape(-1), segment_ids.reshape(-1), n)  # [B*L+1] per response
        lc = ops.gather(seg, pair_c, 0) - ref_c                             # [P]
        lr = ops.gather(seg, pair_r, 0) - ref_r
        rc, rr = self.beta * lc, self.beta * lr
        margin = rc - rr
        pair_loss = -log_sigmoid(margin) * self.w_pref
        if self.w_qual:
            pair_loss = pair_loss - (log_sigmoid(rc - delta) + log_sigmoid(delta - rr)) * self.w_qual
        loss = (pair_loss * pair_w).sum() - (logp * ce_weight).sum()
        m = ops.stop_gradient(margin)
        stats = ops.stack([(m * pair_w).sum(), ((m > 0).astype(ms.float32) * pair_w).sum(),
                           (ops.stop_gradient(rc) * pair_w).sum(), (ops.stop_gradient(rr) * pair_w).sum(),
                           pair_w.sum()])
        return loss, stats


class RunningMean(nn.Cell):
    """BCO's delta: the running mean of batch-mean rewards, as checkpointed parameters."""

    def __init__(self):
        super().__init__()
        self.mean = Parameter(Tensor(0.0, ms.float32), name="dpo_delta_mean", requires_grad=False)
        self.count = Parameter(Tensor(0.0, ms.float32), name="dpo_delta_count", requires_grad=False)

    def update(self, batch_mean: float) -> float:
        c = float(self.count.asnumpy()) + 1.0
        m = float(self.mean.asnumpy())
        m += (batch_mean - m) / c
        self.mean.set_data(Tensor(m, ms.float32))
        self.count.set_data(Tensor(c, ms.float32))
        return m


# -- host side ----------------------------------------------------------------------------------------

def pair_rows(pairs: Sequence[Tuple[Dict, Dict]]) -> List[List[Dict]]:
    """One packed row per pair: [chosen sample, rejected sample]."""
    return [[c, r] for c, r in pairs]


def response_sums(logp: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Per-segment sums of per-token log-probs [B, L] -> [max segment id + 1] (index = segment id)."""
    return np.bincount(segment_ids.reshape(-1), weights=logp.reshape(-1).astype(np.float64),
                       minlength=int(segment_ids.max()) + 1)


def segment_of_rows(rows: Sequence[Sequence[Dict]]) -> List[List[int]]:
    """The batch-unique segment id of each sample, as `build_model_inputs` numbers them (1, 2, ...)."""
    out, k = [], 0
    for row in rows:
        out.append(list(range(k + 1, k + 1 + len(row))))
        k += len(row)
    return out


def dpo_arrays(mb: Dict[str, np.ndarray], rows: Sequence[Sequence[Dict]], n_pair_rows: int,
               ref: np.ndarray, n_pairs: int, n_chosen_tokens: float, n_ntp_tokens: float,
               sft_weight: float) -> List[np.ndarray]:
    """The objective inputs of one micro-batch whose first `n_pair_rows` rows are pairs (ref: [n, 2]
    reference log-probs of those pairs) and the rest NTP rows; counts are global."""
    segs = segment_of_rows(rows)
    seg = mb["segment_ids"]
    sup = mb["targets"] != IGNORE
    ce_w = np.zeros(seg.shape, np.float32)
    pc = [s[0] for s in segs[:n_pair_rows]]
    pr = [s[1] for s in segs[:n_pair_rows]]
    if sft_weight and n_pair_rows:
        ce_w[np.isin(seg, pc) & sup] = sft_weight / max(n_chosen_tokens, 1.0)
    ntp = [x for s in segs[n_pair_rows:] for x in s]
    if ntp:
        ce_w[np.isin(seg, ntp) & sup] = 1.0 / max(n_ntp_tokens, 1.0)
    w = np.full(len(pc), 1.0 / n_pairs, np.float32)
    ref = np.asarray(ref, np.float32).reshape(-1, 2)
    if not pc:  # a dummy pair on the padding segment, weight 0
        pc, pr, ref, w = [0], [0], np.zeros((1, 2), np.float32), np.zeros(1, np.float32)
    return [mb["targets"].astype(np.int32), seg.astype(np.int32), ce_w, np.asarray(pc, np.int32),
            np.asarray(pr, np.int32), ref[:, 0].copy(), ref[:, 1].copy(), w]
