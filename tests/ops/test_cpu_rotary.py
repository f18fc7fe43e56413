"""The C++ RoPE kernel (ops/csrc/rotary.cc): forward and backward equal the composite MindSpore ops bit for
bit and a numpy float32 reference, with cos/sin broadcast over heads and batch, under static and dynamic
shapes; `parallelize` drops it."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from mindvl_ms.ops import ApplyRotary, cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler to build the kernels")


def rotate_half(x):  # [..., D] -> [-x2, x1]
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def rotate_half_t(y):  # its transpose: [y2, -y1]
    h = y.shape[-1] // 2
    return np.concatenate([y[..., h:], -y[..., :h]], -1)


class _Loss(nn.Cell):
    """sum(rope(x, cos, sin) * w) with x a Parameter (its gradient is the op's backward)."""

    def __init__(self, rope, x, w):
        super().__init__()
        self.rope, self.w = rope, Tensor(w)
        self.x = Parameter(Tensor(x), name="x")

    def construct(self, cos, sin):
        return (self.rope(self.x, cos, sin) * self.w).sum()


def run(x, cos, sin, w, kernel: bool, dynamic: bool):
    rope = ApplyRotary()
    assert rope.kernel  # the library builds here
    if not kernel:
        rope.drop_kernel()

    class Fwd(nn.Cell):
        def __init__(self):
            super().__init__()
            self.rope = rope

        def construct(self, x_, c, s):
            return self.rope(x_, c, s)

    fwd = Fwd()
    if dynamic:
        fwd.set_inputs(*[Tensor(shape=[None] * 4, dtype=ms.float32)] * 3)
    out = fwd(Tensor(x), Tensor(cos), Tensor(sin)).asnumpy()
    loss = _Loss(rope, x, w)
    (dx,) = ms.grad(loss, None, loss.trainable_params())(Tensor(cos), Tensor(sin))
    return out, dx.asnumpy()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("table", [(2, 1, 5, 8), (1, 1, 5, 8), (2, 3, 5, 8), (2, 1, 1, 8)])
def test_kernel_equals_composite_and_numpy_bitwise(table, dynamic):
    rng = np.random.default_rng(sum(table))
    x = (rng.standard_normal((2, 3, 5, 8)) * 3).astype(np.float32)
    ang = rng.uniform(-6, 6, table).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    w = rng.standard_normal(x.shape).astype(np.float32)
    out_k, dx_k = run(x, cos, sin, w, True, dynamic)
    out_c, dx_c = run(x, cos, sin, w, False, dynamic)
    ref = x * cos + rotate_half(x) * sin  # numpy float32, one rounded op at a time, broadcast over the table
    np.testing.assert_array_equal(out_k, ref)
    np.testing.assert_array_equal(out_k, out_c)
    dref = w * cos + rotate_half_t(w * sin)
    np.testing.assert_array_equal(dx_k, dref)
    np.testing.assert_array_equal(dx_k, dx_c)
    assert np.abs(out_k - x).max() > 0.1  # the rotation really moved x


def test_other_dtypes_and_ranks_take_the_composite_ops():
    """float16 x, and x of another rank than 4, run the composite ops."""
    rng = np.random.default_rng(0)
    ang = rng.uniform(-3, 3, (1, 1, 4, 8)).astype(np.float32)
    rope = ApplyRotary()
    x16 = rng.standard_normal((1, 2, 4, 8)).astype(np.float16)
    out = rope(Tensor(x16), Tensor(np.cos(ang)), Tensor(np.sin(ang))).asnumpy()
    x32 = x16.astype(np.float32)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, x32 * np.cos(ang) + rotate_half(x32) * np.sin(ang), rtol=2e-3, atol=2e-3)
    x3 = rng.standard_normal((2, 4, 8)).astype(np.float32)
    out3 = rope(Tensor(x3), Tensor(np.cos(ang[0])), Tensor(np.sin(ang[0]))).asnumpy()
    np.testing.assert_array_equal(out3, x3 * np.cos(ang[0]) + rotate_half(x3) * np.sin(ang[0]))


def test_parallelize_drops_every_rotary_kernel(tmp_path):
    from tests.support import hf_tiny as hf_tiny
    from mindvl_ms.checkpoint.pretrained import load_pretrained
    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.parallel.audit import iter_primitives
    from mindvl_ms.parallel.layout import Layout
    from mindvl_ms.parallel.parallelize import parallelize

    path, _ = hf_tiny.tiny_qwen2_5_vl(tmp_path)
    model = load_pretrained(MindVLModel, path)
    ropes = [c for _, c in model.cells_and_names() if isinstance(c, ApplyRotary)]
    assert ropes and all(r.kernel for r in ropes)
    parallelize(model, Layout(dp=2, tp=2))
    assert not any(r.kernel for r in ropes)
    assert not any(p.name == "Custom" for r in ropes for _, _, p in iter_primitives(r))
    assert all(r.mul_cos.in_strategy is not None for r in ropes)
