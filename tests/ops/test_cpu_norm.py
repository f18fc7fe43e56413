"""The C++ RMSNorm kernel (ops/csrc/rms_norm.cc): its forward equals the composite MindSpore ops bit for bit
(2-D, 3-D and 4-D inputs, a last axis that is and is not a multiple of 8, static and dynamic shapes); its
hand-written backward equals the float64 numpy gradient and autodiff of the composite ops to float32
rounding; `parallelize` and a missing compiler leave the composite ops."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from mindvl_ms.ops import RMSNorm, cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler to build the kernels")

EPS = 1e-6


class _Loss(nn.Cell):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def construct(self, x, dy):
        return (self.norm(x) * dy).sum()


def run(shape, kernel: bool, dynamic: bool, seed=0):
    """(y, dx, dw) of an RMSNorm with a random weight, for x of `shape` and the cotangent dy."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    norm = RMSNorm(shape[-1], EPS)
    assert norm.kernel  # the library builds here
    if not kernel:
        norm.drop_kernel()
    norm.weight.set_data(Tensor(w))
    loss = _Loss(norm)
    grad = ms.jit(ms.grad(loss, 0, norm.trainable_params()))

    class Fwd(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def construct(self, x_):
            return self.norm(x_)

    fwd = Fwd()
    if dynamic:
        dyn = Tensor(shape=[None] * len(shape), dtype=ms.float32)
        fwd.set_inputs(dyn)
    y = fwd(Tensor(x)).asnumpy()
    dx, (dw,) = grad(Tensor(x), Tensor(dy))
    return x, dy, w, y, dx.asnumpy(), dw.asnumpy()


SHAPES = [(37, 64), (5, 44), (3, 5, 256), (2, 7, 4, 37)]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_composite_forward_bitwise_and_numpy_backward(shape, dynamic):
    x, dy, w, y_k, dx_k, dw_k = run(shape, True, dynamic)
    _, _, _, y_c, dx_c, dw_c = run(shape, False, dynamic)
    np.testing.assert_array_equal(y_k, y_c)
    # float64 reference: y = w x r, dx = r g - x r^3 sum(g x) / D with g = dy w, dw = sum over rows dy x r
    x64, d = x.astype(np.float64), shape[-1]
    r = 1.0 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS)
    g = dy * w.astype(np.float64)
    np.testing.assert_allclose(y_k, w * x64 * r, rtol=1e-6, atol=1e-6)
    dx_ref = r * g - x64 * r ** 3 * (g * x64).sum(-1, keepdims=True) / d
    dw_ref = (dy * x64 * r).reshape(-1, d).sum(0)
    np.testing.assert_allclose(dx_k, dx_ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(dw_k, dw_ref, rtol=1e-5, atol=2e-6)
    # and autodiff of the composite ops, to float32 rounding
    np.testing.assert_allclose(dx_k, dx_c, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(dw_k, dw_c, rtol=1e-5, atol=2e-6)
    assert np.abs(dx_k).max() > 0.1 and np.abs(dw_k).max() > 0.1


def test_one_compile_serves_several_shapes():
    """Dynamic shapes (the train step): the output shapes come from the library's C++ shape inference,
    d(weight) included."""
    norm = RMSNorm(24, EPS)
    loss = _Loss(norm)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.grad = ms.grad(loss, 0, norm.trainable_params())

        def construct(self, x, dy):
            return norm(x), self.grad(x, dy)

    step = Step()
    dyn = Tensor(shape=[None, None, 24], dtype=ms.float32)
    step.set_inputs(dyn, dyn)
    for rows in (3, 11):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((2, rows, 24)).astype(np.float32)
        dy = rng.standard_normal((2, rows, 24)).astype(np.float32)
        y, (dx, (dw,)) = step(Tensor(x), Tensor(dy))
        r = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
        assert y.shape == dx.shape == (2, rows, 24) and dw.shape == (24,)
        np.testing.assert_allclose(y.asnumpy(), x * r, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dw.asnumpy(), (dy * x * r).reshape(-1, 24).sum(0), rtol=1e-5, atol=2e-6)


def test_other_dtypes_take_the_composite_ops():
    """The kernel is float32 only: a float16 input runs the composite ops (statistics in float32)."""
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float16)
    norm = RMSNorm(16, EPS)
    assert norm.kernel
    y = norm(Tensor(x)).asnumpy()
    assert y.dtype == np.float16
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS), rtol=2e-3, atol=2e-3)


def test_parallelize_drops_every_norm_kernel(tmp_path):
    """A parallel layout compiles for Ascend: every RMSNorm keeps only the composite primitives, which carry
    its strategy, and no C++ op is left for the audit to count."""
    from tests.support import hf_tiny as hf_tiny
    from mindvl_ms.checkpoint.pretrained import load_pretrained
    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.parallel.audit import iter_primitives
    from mindvl_ms.parallel.layout import Layout
    from mindvl_ms.parallel.parallelize import parallelize

    path, _ = hf_tiny.tiny_qwen2_5_vl(tmp_path)
    model = load_pretrained(MindVLModel, path)
    norms = [c for _, c in model.cells_and_names() if isinstance(c, RMSNorm)]
    assert norms and all(n.kernel for n in norms)
    parallelize(model, Layout(dp=2, tp=2))
    assert not any(n.kernel for n in norms)
    assert not any(p.name == "Custom" for n in norms for _, _, p in iter_primitives(n))
    assert all(n.mean.in_strategy is not None for n in norms)
