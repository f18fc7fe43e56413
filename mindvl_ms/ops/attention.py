"""Scaled dot-product attention with block-diagonal (packed / varlen) and causal masking.

Two paths with the same semantics, chosen once at construction (`is_ascend()`):

CPU path (what the tests prove): masks come from per-token segment ids computed host-side: tokens attend
only within the same segment (one image, one window, or one packed sample); segment 0 is padding.
`segment_bias` turns them into an additive float32 bias [B, 1, L, S] inside the graph, and the core is
BatchMatMul -> *scale -> +bias -> float32 Softmax -> BatchMatMul (HF eager semantics; GQA by repeating
k/v). These are primitive instances so a parallel layout can attach strategies to them
(`mindvl_ms.parallel.attention.shard_core_attention`). On CPU the softmax and p.v run as `SoftmaxV`, whose
hand-written backward has no reduction, broadcast or subtraction over the [B, H, L, S] scores.

The ViT's block path (`CoreAttention.prescaled`, no parallel layout) has queries pre-scaled, its per-key
padding bias inside the q.k^T matmul and `SoftmaxV`'s hand-written backward (no reduction over the scores).

CPU float32 with the C++ kernels (ops/csrc/attention_mask.cc, where `ops.cpu_kernels` can build them; each
cell's `drop_kernel` returns it to the composite ops): `SegmentBias` builds the bias in one pass, the core
stacks the query heads of a key/value head along the rows instead of repeating k/v (`_grouped`), scales and
adds the bias in one pass (`_ScaleBiasAdd`) and returns the scale's gradient with the softmax backward's
product (`_SoftmaxVScaleGrad`); `SwapHeads` / `BlocksToHeads` are the heads <-> tokens transposes as row
copies. All of it gives the composite's values bit for bit, except d(k) and d(v) of grouped heads, summed
inside the matmuls (tests/ops/test_attention_mask.py; figures in docs/PERFORMANCE.md, "## ops").

Ascend path (only runs on Ascend hardware, never exercised here): `FlashAttentionScore` in TND layout
(tokens of all rows flattened, [T, N, D]) with `actual_seq_qlen` / `actual_seq_kvlen`, the cumulative
segment ends computed host-side (`mindvl_ms.data.collate`; no leading 0, last = T). The kernel attends
block-diagonally within those lengths, which equals the segment-id mask. Causal cores (the LLM) use
`sparse_mode` 3 (right-down causal inside each segment) with the compressed 2048x2048 upper-triangular
mask, next_tokens 0, as MindFormers does; non-causal cores (the ViT) use `sparse_mode` 0 without a mask.
MindSpore 2.9's FlashAttentionScore docstring (mindspore/ops/operations/manually_defined/ops_def.py, and
`ops.flash_attention_score` in ops/function/nn_func.py) lists for TND: "`attn_mask` must be a lower
triangular matrix, so `sparse_mode` should be 2 or 3. The shape of `attn_mask` should be (2048, 2048)" and
"`next_tokens` is 0": the rules of a TND core that passes a mask, which the causal cores follow. The same
docstring defines sparse_mode 0: "If `attn_mask` is not passed, the mask operation is not performed,
`next_tokens` and `pre_tokens` (internally assigned as INT_MAX) are ignored", which is the ViT's
bidirectional attention inside each window / image (tests/parallel/test_attention.py reads both back).
GQA is native (k/v keep their `num_kv_heads`, no repeat). When v is narrower than q/k (MLA: v 128 vs q/k
192) v goes to the kernel at its own head dim and the output has v's head dim, as MindFormers 1.9's MLA
does (parallel_core/training_graph/transformer/multi_latent_attention.py: `zero_pad_length` is only checked
to be >= 0, and `value` [T, N, v_head_dim] is passed to FlashAttentionScore's TND call unpadded). MindSpore
2.9's docstring still says "The `key` and `value` should have the same shape"; MindFormers' DeepSeek-V3
training on Ascend runs the narrower v, so this follows MindFormers. The primitive is always constructed
(also on CPU) so strategies can be declared and audited everywhere. Without actual lengths (KV-cache
decoding, whose keys run past the queries) the Ascend path falls back to the dense core.
"""
import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from mindvl_ms.ops.broadcast import expand_as
from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend

NEG_INF = -1e9  # finite: a fully masked (padding) row gives a uniform softmax instead of NaN
FA_MASK_SIZE = 2048  # the compressed causal mask of sparse_mode 2/3/4
MAX_TOKENS = 2147483647


def segment_bias(seg_q, seg_k, causal: bool):
    """seg_q int32[B, L], seg_k int32[B, S] -> additive bias float32[B, 1, L, S] (0 allowed, NEG_INF masked).

    With `causal`, query i may see key j only when j <= i (queries and keys aligned at the end, which is
    the identity for self-attention over the same tokens). The head axis is put on the small [B, L] / [B, S]
    inputs before the comparisons: inserting it into the [B, L, S] result would be a StridedSlice copy of
    the whole bias (docs/PERFORMANCE.md, "## ops").
    """
    b, l, s = seg_q.shape[0], seg_q.shape[1], seg_k.shape[1]
    q4 = seg_q.reshape(b, 1, l, 1)
    allowed = ops.logical_and(q4 == seg_k.reshape(b, 1, 1, s), q4 > 0)  # [B, 1, L, S]
    if causal:
        qi = ops.cumsum(ops.ones_like(seg_q), 1) + (s - l)  # [B, L], 1-based
        kj = ops.cumsum(ops.ones_like(seg_k), 1)  # [B, S]
        allowed = ops.logical_and(allowed, kj.reshape(b, 1, 1, s) <= qi.reshape(b, 1, l, 1))
    return ops.logical_not(allowed).astype(ms.float32) * NEG_INF


# The C++ attention kernels (ops/csrc/attention_mask.cc), loaded once by `attention_kernels()`. Module-level,
# not held by the cells: a parallel layout gives every primitive its cells hold a strategy, and these CPU
# kernels never run under one (those compile for Ascend); the cells' `kernel` flag selects them.
_SEGMENT_BIAS = None
_SEGMENT_BIAS_CAUSAL = None
_SCALE_BIAS_ADD = None
_SWAP_AXES12 = None
_MUL_SCALE = None
_BLOCKS_TO_HEADS = None
_HEADS_TO_BLOCKS = None


def attention_kernels() -> bool:
    """True when the C++ attention kernels are available here (loading them on the first call); False on
    Ascend and where the kernel library cannot be built (the composite ops run instead)."""
    # pylint: disable-next=global-statement
    global _SEGMENT_BIAS, _SEGMENT_BIAS_CAUSAL, _SCALE_BIAS_ADD, _SWAP_AXES12, _MUL_SCALE, _BLOCKS_TO_HEADS
    global _HEADS_TO_BLOCKS  # pylint: disable=global-statement
    if _SCALE_BIAS_ADD is None and not is_ascend():
        loaded = (custom_op("SegmentBias", 2), custom_op("SegmentBiasCausal", 2), custom_op("ScaleBiasAdd", 3),
                  custom_op("SwapAxes12", 1), custom_op("MulScale", 3), custom_op("BlocksToHeads", 1),
                  custom_op("HeadsToBlocks", 1))
        if all(op is not None for op in loaded):
            (_SEGMENT_BIAS, _SEGMENT_BIAS_CAUSAL, _SCALE_BIAS_ADD, _SWAP_AXES12, _MUL_SCALE, _BLOCKS_TO_HEADS,
             _HEADS_TO_BLOCKS) = loaded
    return _SCALE_BIAS_ADD is not None


class _SwapAxes12Kernel(nn.Cell):
    """The C++ SwapAxes12 with its gradient (the same swap of dout)."""

    def construct(self, x):
        return _SWAP_AXES12(x)

    def bprop(self, x, out, dout):
        return (_SWAP_AXES12(dout),)


class SwapHeads(nn.Cell):
    """x [A, B, C, D] -> [A, C, B, D]: the LLM attention's [B, L, H, hd] <-> [B, H, L, hd] transposes. On CPU
    for float32 one C++ copy of hd-float rows (SwapAxes12: the same values, bit for bit, forward and
    backward), elsewhere, or after `drop_kernel`, `transpose(0, 2, 1, 3)`."""

    def __init__(self):
        super().__init__()
        self.kernel = attention_kernels()  # read by the graph; only drop_kernel changes it
        self.swap = _SwapAxes12Kernel()

    def drop_kernel(self):
        """The Transpose from now on (an exported graph must not name this machine's kernel library)."""
        self.kernel = False

    def construct(self, x):
        if self.kernel and x.dtype == ms.float32:
            return self.swap(x)
        return x.transpose(0, 2, 1, 3)


class _BlocksToHeadsKernel(nn.Cell):
    """The C++ BlocksToHeads with its gradient (HeadsToBlocks of dout, the inverse permutation)."""

    def construct(self, x):
        return _BLOCKS_TO_HEADS(x)

    def bprop(self, x, out, dout):
        return (_HEADS_TO_BLOCKS(dout),)


class BlocksToHeads(nn.Cell):
    """x [S, W, 3, H, hd] -> [3, S, H, W, hd]: the ViT block path's gathered qkv rows to per-head q/k/v
    blocks. On CPU for float32 one C++ copy of hd-float rows (the same values as the Transpose, bit for bit,
    forward and backward), elsewhere, or after `drop_kernel`, `transpose(2, 0, 3, 1, 4)`."""

    def __init__(self):
        super().__init__()
        self.kernel = attention_kernels()  # read by the graph; only drop_kernel changes it
        self.permute = _BlocksToHeadsKernel()

    def drop_kernel(self):
        """The Transpose from now on (an exported graph must not name this machine's kernel library)."""
        self.kernel = False

    def construct(self, x):
        if self.kernel and x.dtype == ms.float32:
            return self.permute(x)
        return x.transpose(2, 0, 3, 1, 4)


class SegmentBias(nn.Cell):
    """`segment_bias` as a cell: on CPU one C++ pass (SegmentBias / SegmentBiasCausal, the same values bit
    for bit: tests/ops/test_attention_mask.py) instead of the composite's eight kernels over [B, L, S]; the
    composite where the kernels are unavailable or after `drop_kernel`."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.kernel = attention_kernels()  # read by the graph; only drop_kernel changes it

    def drop_kernel(self):
        """The composite ops from now on (an exported graph must not name this machine's kernel library)."""
        self.kernel = False

    def construct(self, seg_q, seg_k):  # int32 [B, L], [B, S] -> float32 [B, 1, L, S]
        if not self.kernel:
            return segment_bias(seg_q, seg_k, self.causal)
        q, k = ops.stop_gradient(seg_q.astype(ms.float32)), ops.stop_gradient(seg_k.astype(ms.float32))
        if self.causal:
            return ops.stop_gradient(_SEGMENT_BIAS_CAUSAL(q, k))
        return ops.stop_gradient(_SEGMENT_BIAS(q, k))


class _ScaleBiasAdd(nn.Cell):
    """scores * scale + bias by the C++ ScaleBiasAdd (bias [B|1, 1, L, S] broadcast over heads). Always
    followed by `_SoftmaxVScaleGrad`, which returns d(scores) already multiplied by the scale (in the pass of
    its own product, as the composite's scale Mul gradient rounds it), so this bprop passes dout through;
    the bias comes from segment ids and gets none."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale_t = Tensor([scale], ms.float32)

    def construct(self, scores, bias):
        return _SCALE_BIAS_ADD(scores, bias, self.scale_t)

    def bprop(self, scores, bias, out, dout):
        return dout, ops.zeros_like(bias)


_SOFTMAX = ops.Softmax(-1)
_BMM = ops.BatchMatMul()                      # [.., L, S] x [.., S, Dv]
_BMM_TN = ops.BatchMatMul(transpose_a=True)   # [.., L, S]^T x [.., L, Dv] -> [.., S, Dv]
_BMM_NT = ops.BatchMatMul(transpose_b=True)   # [.., L, Dv+1] x [.., S, Dv+1]^T -> [.., L, S]
_ROW_SUM = ops.ReduceSum(keep_dims=True)


class SoftmaxV(nn.Cell):
    """softmax(scores) v: float32 scores [.., L, S], v [.., S, Dv] -> [.., L, Dv] (probabilities cast to
    v's dtype), with a hand-written backward that never reduces over an [.., L, S] tensor.

    Autodiff's softmax gradient is P * (dP - rowsum(dP * P)): a multiply and a last-axis reduction over
    every score, a large share of a ViT forward+backward at large image sizes, where a full-attention block
    has one [L, L] score matrix per head and image (timings: docs/PERFORMANCE.md, "## ops"). Here, as in
    FlashAttention's backward, rowsum(dP * P) = rowsum(dO * O) ([.., L, Dv]), and the subtraction rides in
    the dP matmul on operands widened by one column: [dO, -D] [v, 1]^T = dO v^T - D. The backward
    asks for softmax(scores) again; in a compiled graph that is the forward's kernel (common
    subexpression: a 4-block ViT forward+backward profiles 4 Softmax kernels, as its forward alone).
    Module-level primitives: it serves CPU paths only (the vision block path, the CPU attention core), which
    never run under a parallel layout (those compile for Ascend, whose core takes the fused kernel)."""

    def construct(self, scores, v):
        return _BMM(_SOFTMAX(scores).astype(v.dtype), v)                  # [.., L, Dv]

    def bprop(self, scores, v, out, dout):
        p, dp_minus_d, dv = _softmax_v_parts(scores, v, out, dout)
        return p * dp_minus_d, dv


def _softmax_v_parts(scores, v, out, dout):
    """SoftmaxV's backward before its last product: (P, dP - D, d(v))."""
    p = _SOFTMAX(scores)                                              # [.., L, S] float32
    dv = _BMM_TN(p.astype(v.dtype), dout)                             # [.., S, Dv]
    g = dout.astype(ms.float32)
    d = _ROW_SUM(g * out.astype(ms.float32), -1)                      # [.., L, 1] = rowsum(dP * P)
    ones = ops.ones(v.shape[:-1] + (1,), ms.float32)
    dp_minus_d = _BMM_NT(ops.cat((g, -d), -1), ops.cat((v.astype(ms.float32), ones), -1))  # [.., L, S]
    return p, dp_minus_d, dv


class _SoftmaxVScaleGrad(SoftmaxV):
    """SoftmaxV whose gradient of the scores comes out times `scale`: P * (dP - D) and the scale of the
    `_ScaleBiasAdd` before it in one C++ pass (MulScale, each product rounded as the two Mul kernels round
    them: the same values bit for bit)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale_t = Tensor([scale], ms.float32)

    def bprop(self, scores, v, out, dout):
        p, dp_minus_d, dv = _softmax_v_parts(scores, v, out, dout)
        return _MUL_SCALE(p, dp_minus_d, self.scale_t), dv


def causal_compressed_mask() -> Tensor:
    """uint8[2048, 2048], 1 above the diagonal: the mask FlashAttentionScore takes with sparse_mode 3."""
    return Tensor(np.triu(np.ones((FA_MASK_SIZE, FA_MASK_SIZE), np.uint8), k=1), ms.uint8)


class CoreAttention(nn.Cell):
    """softmax(q k^T * scale + bias) v for q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, H, L, Dv].

    `causal` selects the Ascend kernel's sparse mode (3 for the causal LLM, 0 for the ViT); on the CPU path
    causality is carried by `bias`. `actual_seq_qlen` / `actual_seq_kvlen` (int32[K], cumulative segment
    ends over the flattened B*L tokens) drive the Ascend TND kernel and are ignored on CPU.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float = None,
                 causal: bool = True, v_head_dim: int = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if v_head_dim > head_dim:
            raise ValueError(f"v_head_dim {v_head_dim} is larger than the q/k head dim {head_dim}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim  # <= head_dim; the TND kernel takes it unpadded (module docstring)
        self.n_rep = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.causal = causal
        self.sparse_mode = 3 if causal else 0
        self.fused = is_ascend()
        # Ascend: TND varlen flash attention (constructed everywhere so strategies can be declared)
        self.fa = FlashAttentionScore(head_num=num_heads, keep_prob=1.0, scale_value=self.scale,
                                      pre_tokens=MAX_TOKENS, next_tokens=0 if causal else MAX_TOKENS,
                                      inner_precise=0, input_layout="TND", sparse_mode=self.sparse_mode)
        self.fa_mask = causal_compressed_mask() if causal else None
        # CPU (dense) path primitives
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)  # [B, H, L, D] x [B, H, S, D]^T
        self.scale_mul = ops.Mul()
        self.bias_add = ops.Add()  # [B, H, L, S] + [B, 1, L, S]
        self.softmax = ops.Softmax(-1)
        self.pv_matmul = ops.BatchMatMul()  # [B, H, L, S] x [B, H, S, Dv]
        self.softmax_v = SoftmaxV()  # the pre-scaled path's softmax + p.v (hand-written backward)
        # CPU float32: scale and bias add in one C++ pass (ScaleBiasAdd, bit for bit the Mul and Add), query
        # heads grouped by their key/value head instead of k/v repeated (`_grouped`)
        self.kernel = attention_kernels()  # read by the graph; only drop_kernel changes it
        self.scale_bias = _ScaleBiasAdd(self.scale)
        self.softmax_v_scaled = _SoftmaxVScaleGrad(self.scale)  # its gradient times the scale (_ScaleBiasAdd)

    def drop_kernel(self):
        """The composite scale Mul and bias Add from now on (`ops.cpu_kernels.drop_kernels`)."""
        self.kernel = False

    def construct(self, q, k, v, bias, actual_seq_qlen=None, actual_seq_kvlen=None):
        if self.fused and actual_seq_qlen is not None:
            return self._flash(q, k, v, actual_seq_qlen, actual_seq_kvlen)
        if not self.fused and self.kernel and q.dtype == ms.float32 and bias.ndim == 4:
            return self._grouped(q, k, v, bias)
        k = self._repeat(k)
        v = self._repeat(v)
        scores = self.scale_mul(self.qk_matmul(q, k), self.scale).astype(ms.float32)  # [B, H, L, S]
        if self.fused:  # Ascend without sequence lengths: the primitives the parallel layout shards
            probs = self.softmax(self.bias_add(scores, bias)).astype(q.dtype)
        else:  # CPU: the [B, 1, L, S] bias broadcast first (ops/broadcast.py); softmax and p.v with SoftmaxV's
            # backward (no reduction, broadcast or subtraction over the [B, H, L, S] scores)
            return self.softmax_v(self.bias_add(scores, expand_as(bias, scores)), v)  # [B, H, L, Dv]
        return self.pv_matmul(probs, v)  # [B, H, L, Dv]

    def _grouped(self, q, k, v, bias):
        """The CPU float32 path: the n_rep query heads that share a key/value head stacked along the rows,
        q [B, H, L, D] -> [B, Hkv, n_rep * L, D], against the unrepeated k/v; ScaleBiasAdd applies bias row
        r % L to score row r. The same scores and outputs as repeating k/v to every query head, without the
        [B, H, S, D] copies of k and v and their gradients' reduction over the copies (the matmuls sum over
        the stacked rows instead: d(k), d(v) round differently from the repeat's ReduceSum)."""
        b, h, l, d = q.shape
        qg = q.reshape(b, self.num_kv_heads, self.n_rep * l, d)                      # [B, Hkv, n_rep*L, D]
        out = self.softmax_v_scaled(self.scale_bias(self.qk_matmul(qg, k), bias), v)  # [B, Hkv, n_rep*L, Dv]
        return out.reshape(b, h, l, out.shape[-1])                                   # [B, H, L, Dv]

    def prescaled(self, q, k, v, key_bias):
        """The CPU path for queries already multiplied by `scale` (e.g. folded into their RoPE cos/sin) and a
        bias that depends on the key only, `key_bias` float32 [B, 1, 1, S] (0 or NEG_INF): the bias rides in
        the q.k^T matmul as one extra column ([q, 1] [k, bias]^T), so no [B, H, L, S] multiply or add in
        either direction, and `SoftmaxV`'s backward (no reduction over the scores). For paths that run
        without a parallel layout (the ViT's block path)."""
        k, v = self._repeat(k), self._repeat(v)
        b, h, s = k.shape[0], k.shape[1], k.shape[2]
        q1 = ops.cat((q.astype(ms.float32), ops.ones(q.shape[:-1] + (1,), ms.float32)), -1)       # [B, H, L, D+1]
        kb = ops.broadcast_to(key_bias.reshape(b, 1, s, 1), (b, h, s, 1))                          # [B, H, S, 1]
        k1 = ops.cat((k.astype(ms.float32), kb), -1)                                               # [B, H, S, D+1]
        return self.softmax_v(self.qk_matmul(q1, k1), v)  # [B, H, L, Dv]

    def _flash(self, q, k, v, actual_seq_qlen, actual_seq_kvlen):
        """Ascend only: TND FlashAttentionScore (native GQA, v at its own head dim, as MindFormers' MLA)."""
        b, h, l, d = q.shape
        s = k.shape[2]
        qt = q.transpose(0, 2, 1, 3).reshape(b * l, h, d)  # [T, N, D]
        kt = k.transpose(0, 2, 1, 3).reshape(b * s, self.num_kv_heads, d)  # [T, Nkv, D]
        vt = v.transpose(0, 2, 1, 3).reshape(b * s, self.num_kv_heads, self.v_head_dim)  # [T, Nkv, Dv]
        out = self.fa(qt, kt, vt, None, None, None, self.fa_mask, None, actual_seq_qlen, actual_seq_kvlen)[3]
        return out.reshape(b, l, h, self.v_head_dim).transpose(0, 2, 1, 3)  # [B, H, L, Dv]

    def _repeat(self, x):  # [B, Hkv, S, D] -> [B, H, S, D]
        if self.n_rep == 1:
            return x
        return ops.repeat_interleave(x, self.n_rep, 1)
