"""Explicit broadcasting under dynamic shapes (ops/broadcast.py) and the CPU paths that use it: RMSNorm (its
composite ops and its C++ kernel), RoPE (likewise), the attention bias and softmax, forward and backward, against numpy,
with dynamic and static shapes."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindvl_ms.ops import ApplyRotary, RMSNorm
from mindvl_ms.ops.attention import CoreAttention
from mindvl_ms.ops.broadcast import expand_as


class _Expand(nn.Cell):
    def construct(self, y, x):
        return expand_as(y, x)


def _dyn(*arrays):
    return [Tensor(shape=[None] * a.ndim, dtype=ms.float32) for a in arrays]


def test_expand_as_broadcasts_only_under_dynamic_shapes():
    ms.set_context(mode=ms.GRAPH_MODE)
    y, x = np.arange(4, dtype=np.float32).reshape(4, 1), np.zeros((4, 3), np.float32)
    static = _Expand()(Tensor(y), Tensor(x)).asnumpy()
    np.testing.assert_array_equal(static, y)  # left to the arithmetic kernel
    net = _Expand()
    net.set_inputs(*_dyn(y, x))
    np.testing.assert_array_equal(net(Tensor(y), Tensor(x)).asnumpy(), np.broadcast_to(y, (4, 3)))


def _np_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_norm_rope_and_masked_attention_match_numpy(dynamic, kernel):
    """RMSNorm and RoPE (their C++ kernels where they build, and the composite ops): RMSNorm -> RoPE (cos/sin [B, 1, L, hd] over
    heads) -> attention with a [B, 1, L, S] causal bias, and the gradient of a weighted sum with respect to
    the input and the norm weight, against numpy."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    b, h, l, hd = 2, 3, 6, 8
    x = rng.standard_normal((b, h, l, hd)).astype(np.float32)
    ang = rng.standard_normal((b, 1, l, hd)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    bias = np.where(np.tril(np.ones((l, l), bool)), 0.0, -1e9).astype(np.float32)[None, None].repeat(b, 0)
    w = rng.standard_normal((b, h, l, hd)).astype(np.float32)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm, self.rope = RMSNorm(hd), ApplyRotary()
            self.core = CoreAttention(h, h, hd, causal=True)

        def construct(self, x_, cos_, sin_, bias_, w_):
            q = self.rope(self.norm(x_), cos_, sin_)
            return (self.core(q, q, q, bias_) * w_).sum()

    net = Net()
    if kernel and not (net.norm.kernel and net.rope.kernel):
        pytest.skip("the C++ kernels do not build here")
    if not kernel:
        net.norm.drop_kernel()
        net.rope.drop_kernel()
    net.norm.weight.set_data(Tensor(rng.uniform(0.5, 1.5, hd).astype(np.float32)))
    gw = net.norm.weight.asnumpy().astype(np.float64)
    grad = ms.value_and_grad(net, 0, net.trainable_params())
    args = [x, cos, sin, bias, w]

    class Step(nn.Cell):
        def construct(self, *a):
            return grad(*a)

    step = Step()
    if dynamic:
        step.set_inputs(*_dyn(*args))
    loss, (gx, (g_weight,)) = step(*[Tensor(a) for a in args])

    def f(x64, g64):  # numpy float64 forward
        n = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * g64
        half = hd // 2
        q = n * cos + np.concatenate((-n[..., half:], n[..., :half]), -1) * sin
        p = _np_softmax(q @ q.transpose(0, 1, 3, 2) * hd ** -0.5 + bias)
        return ((p @ q) * w).sum()

    x64 = x.astype(np.float64)
    assert float(loss.asnumpy()) == pytest.approx(f(x64, gw), rel=1e-5)
    eps = 1e-6  # central differences in float64 for a few input entries and every weight entry
    for idx in [(0, 0, 0, 0), (1, 2, 5, 7), (0, 1, 3, 4)]:
        d = np.zeros_like(x64)
        d[idx] = eps
        num = (f(x64 + d, gw) - f(x64 - d, gw)) / (2 * eps)
        assert float(gx.asnumpy()[idx]) == pytest.approx(num, rel=1e-3, abs=1e-4)
    num_w = [(f(x64, gw + eps * np.eye(hd)[i]) - f(x64, gw - eps * np.eye(hd)[i])) / (2 * eps) for i in range(hd)]
    np.testing.assert_allclose(g_weight.asnumpy(), num_w, rtol=1e-3, atol=1e-4)
