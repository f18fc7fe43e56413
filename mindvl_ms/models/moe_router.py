"""DeepSeek-V3 routing: sigmoid scores, group-limited top-k, routed scaling, load statistics, balancing.

Router (HF `DeepseekV3TopkRouter` semantics, parameter names `gate.weight`, `gate.e_score_correction_bias`):
  scores  = sigmoid(x @ W^T)                                   float32 [T, E]
  choice  = scores + e_score_correction_bias                   (the bias only steers selection)
  groups  = sum of the top-2 `choice` in each of n_group groups -> keep the best topk_group groups
  experts = top-k of `choice` inside the kept groups (others filled with 0, as HF does)
  weights = scores gathered at the experts, renormalised to sum 1 (norm_topk_prob), x routed_scaling_factor

Balancing, both from DeepSeek-V3 section 2.1.2:
- aux-loss-free: after each step, b_i += speed * sign(mean_load - load_i) where load_i counts the routed
  token copies of expert i in the step (padding excluded). The model returns the per-layer loads
  (`expert_load` [num_moe_layers, E]); `ExpertBiasUpdate` applies the rule in graph (or
  `update_expert_bias` on the host). The bias is a non-trainable Parameter, saved with the checkpoint.
- sequence-wise auxiliary loss (optional, coefficient alpha): per sequence, f_i = E / (k T) * #tokens routed
  to i, P_i = mean over tokens of the normalised scores s_i / sum_j s_j, L = alpha * sum_i f_i P_i. A
  "sequence" here is one packed row (padding excluded); the loss is averaged over rows.

Under a parallel layout on Ascend the expert selection is MindFormers' `TopKRouter` code (`mindformers_select`,
set by `mindvl_ms.parallel` to a `parallel.mindformers_moe.MindFormersSelect`); scores, bias, routing weights
and parameters stay this cell's. MindFormers picks groups by the sum of the top (k / topk_group) scores per
group rather than DeepSeek-V3's top-2: equal when k / topk_group = 2 (DeepSeek-V3's 8 / 4), different
otherwise (tests/parallel/test_mindformers_moe.py shows both). On CPU the selection below is DeepSeek-V3's, with
`mindvl_ms.ops.moe.TopK`.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindvl_ms.ops.moe import TopK, tokens_per_expert


class TopkRouter(nn.Cell):
    """x [T, D] -> expert ids int32 [T, k], routing weights float32 [T, k], scores float32 [T, E]."""

    def __init__(self, hidden_size: int, moe, std: float = 0.02):
        super().__init__()
        self.num_experts = moe.n_routed_experts
        self.top_k = moe.num_experts_per_tok
        self.n_group = moe.n_group
        self.topk_group = moe.topk_group
        self.per_group = self.num_experts // self.n_group
        self.group_top = min(2, self.per_group)
        self.norm_topk_prob = moe.norm_topk_prob
        self.scale = float(moe.routed_scaling_factor)
        self.sigmoid_scores = moe.scoring_func == "sigmoid"
        self.weight = Parameter(initializer(Normal(std), (self.num_experts, hidden_size), ms.float32), name="weight")
        self.e_score_correction_bias = Parameter(initializer("zeros", (self.num_experts,), ms.float32),
                                                 name="e_score_correction_bias", requires_grad=False)
        self.gate_matmul = ops.MatMul(transpose_b=True)  # [T, D] x [E, D]^T; parallel strategies attach here
        self.topk = TopK()
        self.group_topk = TopK()
        self.expert_topk = TopK()
        # Set by mindvl_ms.parallel (Ascend): MindFormers' TopKRouter selection, biased scores [T, E] -> ids [T, k]
        self.mindformers_select = None

    def construct(self, x):
        logits = self.gate_matmul(x.astype(ms.float32), self.weight.astype(ms.float32))  # [T, E]
        scores = ops.sigmoid(logits) if self.sigmoid_scores else ops.softmax(logits, -1)
        choice = ops.stop_gradient(scores) + self.e_score_correction_bias[None, :]  # [T, E]
        t = choice.shape[0]
        if self.mindformers_select is not None:
            idx = self.mindformers_select(choice)  # [T, k]
        elif self.n_group > 1:
            grouped = choice.reshape(t, self.n_group, self.per_group)
            best, _ = self.group_topk(grouped, self.group_top)  # [T, G, 2]
            _, keep = self.topk(best.sum(-1), self.topk_group)  # [T, topk_group]
            gmask = ops.one_hot(keep, self.n_group, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)).sum(1)
            emask = ops.repeat_interleave(gmask, self.per_group, 1)  # [T, E]
            choice = ops.where(emask > 0.5, choice, ops.zeros_like(choice))
            _, idx = self.expert_topk(choice, self.top_k)  # [T, k]
        else:
            _, idx = self.expert_topk(choice, self.top_k)  # [T, k]
        weights = ops.gather_elements(scores, 1, idx)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return idx, weights * self.scale, scores


def seq_aux_loss(scores, idx, valid, batch: int, top_k: int):
    """Sequence-wise balance loss without its coefficient.

    scores float32 [B*L, E], idx int32 [B*L, k], valid float32 [B*L] (1 = real token) -> scalar.
    """
    e = scores.shape[-1]
    s = scores.reshape(batch, -1, e)  # [B, L, E]
    v = valid.reshape(batch, -1, 1)  # [B, L, 1]
    n = ops.maximum(v.sum(1), 1.0)  # [B, 1]
    probs = s / (s.sum(-1, keepdims=True) + 1e-20)
    p = (probs * v).sum(1) / n  # [B, E]
    onehot = ops.one_hot(idx, e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)).sum(1)  # [B*L, E]
    f = (onehot.reshape(batch, -1, e) * v).sum(1) * (e / top_k) / n  # [B, E]
    return (f * p).sum(-1).mean()


def expert_load(idx, num_experts: int, valid):
    """Routed token copies per expert, padding excluded: idx [T, k], valid [T] -> float32 [E]."""
    return tokens_per_expert(idx, num_experts, valid)


class ExpertBiasUpdate(nn.Cell):
    """Aux-loss-free balancing step: bias_i += speed * sign(mean(load) - load_i) for every MoE layer.

    `routers` are the TopkRouter cells in layer order; construct(expert_load [num_moe_layers, E]) assigns the
    new biases (graph side effect) and returns them stacked. Only the bias Parameters are held (in a
    ParameterTuple, no name prefix), so building this cell never renames the model's parameters. Under data
    parallel, pass the load summed over all ranks so every rank applies the same update.
    """

    def __init__(self, routers, speed: float):
        super().__init__(auto_prefix=False)
        self.biases = ParameterTuple([r.e_score_correction_bias for r in routers])
        self.speed = float(speed)

    def construct(self, load):
        out = []
        for i, bias in enumerate(self.biases):
            row = load[i]
            new = bias + ops.sign(row.mean() - row) * self.speed
            ops.assign(bias, new)
            out.append(new)
        return ops.stack(out)


def update_expert_bias(routers, load: np.ndarray, speed: float) -> np.ndarray:
    """Host-side version of ExpertBiasUpdate for a numpy load [num_moe_layers, E]; returns the new biases."""
    new = []
    for router, row in zip(routers, np.asarray(load, np.float32)):
        bias = router.e_score_correction_bias.asnumpy() + speed * np.sign(row.mean() - row)
        router.e_score_correction_bias.set_data(Tensor(bias.astype(np.float32)))
        new.append(bias)
    return np.stack(new)


def load_stats(load: np.ndarray) -> dict:
    """Per-layer load figures for logging: tokens per expert, max/mean and min/mean ratios."""
    load = np.asarray(load, np.float64)
    mean = np.maximum(load.mean(-1), 1e-12)
    return {"tokens_per_expert": load.tolist(),
            "max_over_mean": (load.max(-1) / mean).tolist(),
            "min_over_mean": (load.min(-1) / mean).tolist()}
