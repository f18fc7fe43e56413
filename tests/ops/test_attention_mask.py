"""The C++ attention-mask kernels (ops/csrc/attention_mask.cc): SegmentBias equals `segment_bias` and a numpy
mask bit for bit, and CoreAttention's ScaleBiasAdd path gives the composite's outputs and q/k/v gradients
bit for bit, with dynamic shapes as the train step compiles them."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindvl_ms.ops.attention import NEG_INF, BlocksToHeads, CoreAttention, SegmentBias, SwapHeads, attention_kernels


def _segments(rng, b, n):
    """int32 [b, n]: packed samples 1, 2, ... of random lengths, then padding (0)."""
    out = np.zeros((b, n), np.int32)
    for r in range(b):
        pos, sid = 0, 1
        while pos < n - 3:
            ln = int(rng.integers(1, n // 2))
            out[r, pos:pos + ln] = sid
            pos, sid = pos + ln, sid + 1
    return out


def numpy_bias(seg_q, seg_k, causal):
    l, s = seg_q.shape[1], seg_k.shape[1]
    allowed = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q > 0)[:, :, None]
    if causal:
        allowed &= np.arange(s)[None, None, :] <= np.arange(l)[None, :, None] + (s - l)
    return (np.logical_not(allowed).astype(np.float32) * np.float32(NEG_INF))[:, None]


class _Bias(nn.Cell):
    def __init__(self, causal, kernel):
        super().__init__()
        self.op = SegmentBias(causal)
        if not kernel:
            self.op.drop_kernel()

    def construct(self, q, k):
        return self.op(q, k)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_bias_kernel_equals_composite_and_numpy_bitwise(causal):
    ms.set_context(mode=ms.GRAPH_MODE)
    assert attention_kernels()  # the library builds here
    rng = np.random.default_rng(0)
    nets = {k: _Bias(causal, k) for k in (True, False)}
    for net in nets.values():
        net.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))
    for b, l, s in ((2, 9, 9), (3, 17, 17), (1, 4, 11)):  # one compile for all; S > L: keys before the queries
        seg_k = _segments(rng, b, s)
        seg_q = seg_k[:, s - l:]
        ref = numpy_bias(seg_q, seg_k, causal)
        outs = {k: net(Tensor(seg_q), Tensor(seg_k)).asnumpy() for k, net in nets.items()}
        for out in outs.values():
            assert out.shape == (b, 1, l, s)
            assert out.tobytes() == ref.tobytes()  # bitwise, the -0.0 of allowed entries included
        assert (ref == 0).any() and (ref == NEG_INF).any()


class _Attn(nn.Cell):
    def __init__(self, kernel):
        super().__init__()
        self.core = CoreAttention(4, 2, 8)
        self.bias = SegmentBias(True)
        if not kernel:
            self.core.drop_kernel()
            self.bias.drop_kernel()

    def construct(self, q, k, v, seg):
        return self.core(q, k, v, self.bias(seg, seg))


class _Loss(nn.Cell):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def construct(self, q, k, v, seg, w):
        return (self.attn(q, k, v, seg) * w).sum()


def test_core_attention_kernel_path_equals_composite():
    """The causal CPU core with 2 query heads per key/value head, kernel path (query heads grouped, one
    ScaleBiasAdd) against the composite (k/v repeated, scale Mul, BroadcastTo, bias Add): the forward and
    d(q) bit for bit, d(k) and d(v) to float32 rounding; the composite against a numpy softmax."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    b, l = 2, 13
    q = rng.standard_normal((b, 4, l, 8)).astype(np.float32)
    k = rng.standard_normal((b, 2, l, 8)).astype(np.float32)
    v = rng.standard_normal((b, 2, l, 8)).astype(np.float32)
    w = rng.standard_normal((b, 4, l, 8)).astype(np.float32)
    seg = _segments(rng, b, l)
    res = {}
    for kernel in (True, False):
        net = _Attn(kernel)
        assert net.core.kernel == kernel
        dyn = [Tensor(shape=[None] * a.ndim, dtype=ms.float32) for a in (q, k, v)]
        net.set_inputs(*dyn, Tensor(shape=[None, None], dtype=ms.int32))
        loss = _Loss(net)
        loss.set_inputs(*dyn, Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None] * 4, dtype=ms.float32))
        out = net(Tensor(q), Tensor(k), Tensor(v), Tensor(seg)).asnumpy()
        grads = ms.grad(loss, (0, 1, 2))(Tensor(q), Tensor(k), Tensor(v), Tensor(seg), Tensor(w))
        res[kernel] = (out, [g.asnumpy() for g in grads])
    np.testing.assert_array_equal(res[True][0], res[False][0])
    np.testing.assert_array_equal(res[True][1][0], res[False][1][0])  # d(q): per head, as the composite
    for gk, gc in zip(res[True][1][1:], res[False][1][1:]):  # d(k), d(v): summed over the 2 query heads
        np.testing.assert_allclose(gk, gc, rtol=1e-5, atol=1e-6)  # inside the matmul, not by a ReduceSum
    kk, vv = np.repeat(k, 2, 1), np.repeat(v, 2, 1)
    scores = q @ kk.transpose(0, 1, 3, 2) * np.float32(8 ** -0.5) + numpy_bias(seg, seg, True)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(res[True][0], (p / p.sum(-1, keepdims=True)) @ vv, rtol=1e-5, atol=1e-5)


class _Swap(nn.Cell):
    def __init__(self, kernel, cell=SwapHeads):
        super().__init__()
        self.swap = cell()
        if not kernel:
            self.swap.drop_kernel()

    def construct(self, x):
        return self.swap(x)


class _SwapLoss(nn.Cell):
    def __init__(self, swap):
        super().__init__()
        self.swap = swap

    def construct(self, x, w):
        return (self.swap(x) * w).sum()


def test_swap_heads_kernel_equals_transpose_bitwise():
    """SwapAxes12 forward equals numpy's transpose(0, 2, 1, 3) and its gradient the transposed dout, bit for
    bit, under one dynamic-shape compile for several shapes; the Transpose path gives the same."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(2)
    for kernel in (True, False):
        net = _Swap(kernel)
        assert net.swap.kernel == kernel
        net.set_inputs(Tensor(shape=[None] * 4, dtype=ms.float32))
        loss = _SwapLoss(net)
        loss.set_inputs(Tensor(shape=[None] * 4, dtype=ms.float32), Tensor(shape=[None] * 4, dtype=ms.float32))
        grad = ms.grad(loss, 0)
        for shape in ((2, 5, 3, 4), (1, 7, 2, 8)):
            x = rng.standard_normal(shape).astype(np.float32)
            w = rng.standard_normal((shape[0], shape[2], shape[1], shape[3])).astype(np.float32)
            np.testing.assert_array_equal(net(Tensor(x)).asnumpy(), x.transpose(0, 2, 1, 3))
            np.testing.assert_array_equal(grad(Tensor(x), Tensor(w)).asnumpy(), w.transpose(0, 2, 1, 3))


def test_blocks_to_heads_kernel_equals_transpose_bitwise():
    """BlocksToHeads forward equals numpy's transpose(2, 0, 3, 1, 4) and its gradient the inverse permutation
    of dout, bit for bit, under one dynamic-shape compile; the Transpose path gives the same."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(3)
    for kernel in (True, False):
        net = _Swap(kernel, BlocksToHeads)
        assert net.swap.kernel == kernel
        net.set_inputs(Tensor(shape=[None] * 5, dtype=ms.float32))
        loss = _SwapLoss(net)
        loss.set_inputs(Tensor(shape=[None] * 5, dtype=ms.float32), Tensor(shape=[None] * 5, dtype=ms.float32))
        grad = ms.grad(loss, 0)
        for shape in ((2, 5, 3, 4, 8), (3, 7, 3, 2, 4)):
            x = rng.standard_normal(shape).astype(np.float32)
            w = rng.standard_normal(x.transpose(2, 0, 3, 1, 4).shape).astype(np.float32)
            np.testing.assert_array_equal(net(Tensor(x)).asnumpy(), x.transpose(2, 0, 3, 1, 4))
            np.testing.assert_array_equal(grad(Tensor(x), Tensor(w)).asnumpy(), w.transpose(1, 3, 0, 2, 4))
