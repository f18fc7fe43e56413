"""Scaled dot-product attention with block-diagonal (packed / varlen) and causal masking.

Masks come from per-token segment ids computed host-side: tokens attend only within the same segment
(one image, one window, or one packed sample); segment 0 is padding. `segment_bias` turns them into an
additive float32 bias [B, 1, L, S] inside the graph, so the compiled graph is the same for every layout.

CPU path: matmul -> +bias -> float32 softmax -> matmul (HF eager semantics, GQA by repeating k/v).
Ascend path: `FlashAttentionScore` (BNSD layout) with the same mask as a boolean `atten_mask`
(sparse_mode 0), i.e. the same semantics; only run on Ascend hardware.
"""
import mindspore as ms
from mindspore import nn, ops

from .dispatch import is_ascend

NEG_INF = -1e9  # finite: a fully masked (padding) row gives a uniform softmax instead of NaN


def segment_bias(seg_q, seg_k, causal: bool):
    """seg_q int32[B, L], seg_k int32[B, S] -> additive bias float32[B, 1, L, S] (0 allowed, NEG_INF masked).

    With `causal`, query i may see key j only when j <= i (queries and keys aligned at the end, which is
    the identity for self-attention over the same tokens).
    """
    allowed = ops.logical_and(seg_q[:, :, None] == seg_k[:, None, :], (seg_q > 0)[:, :, None])
    if causal:
        qi = ops.cumsum(ops.ones_like(seg_q), 1) + (seg_k.shape[1] - seg_q.shape[1])  # [B, L], 1-based
        kj = ops.cumsum(ops.ones_like(seg_k), 1)  # [B, S]
        allowed = ops.logical_and(allowed, kj[:, None, :] <= qi[:, :, None])
    bias = ops.logical_not(allowed).astype(ms.float32) * NEG_INF
    return bias[:, None, :, :]


class CoreAttention(nn.Cell):
    """softmax(q k^T * scale + bias) v for q [B, H, L, D], k/v [B, Hkv, S, D] -> [B, H, L, D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float = None):
        super().__init__()
        self.num_heads = num_heads
        self.n_rep = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.fused = is_ascend()
        if self.fused:
            self.fa = ops.operations.nn_ops.FlashAttentionScore(
                head_num=num_heads, scale_value=self.scale, input_layout="BNSD", sparse_mode=0)

    def construct(self, q, k, v, bias):
        if self.fused:
            mask = (bias < -1.0).astype(ms.uint8)
            out = self.fa(q, self._repeat(k), self._repeat(v), None, None, None, mask)
            return out[3]
        k = self._repeat(k)
        v = self._repeat(v)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale  # [B, H, L, S]
        scores = scores.astype(ms.float32) + bias
        probs = ops.softmax(scores, -1).astype(q.dtype)
        return ops.matmul(probs, v)  # [B, H, L, D]

    def _repeat(self, x):  # [B, Hkv, S, D] -> [B, H, S, D]
        if self.n_rep == 1:
            return x
        return ops.repeat_interleave(x, self.n_rep, 1)
