"""The C++ CPU kernels (ops/cpu_kernels.py): the fused bias + RoPE pass over the vision qkv equals a numpy
float32 reference and the composite MindSpore ops bit for bit, forward and backward, also inside the whole
vision tower; without a compiler, or with a failing build, the composite ops are used after a warning."""
import logging

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from tests.support import hf_tiny as hf_tiny
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.models.vision import QkvBiasRope
from mindvl_ms.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler to build the kernels")

N, H, HD, SCALE = 37, 2, 16, 0.25


def rotate_half(x):  # [..., hd] -> [-x2, x1]
    return np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1)


def rotate_half_t(y):  # its transpose: [y2, -y1]
    return np.concatenate([y[..., HD // 2:], -y[..., :HD // 2]], -1)


def inputs(seed=0, n=N):
    rng = np.random.default_rng(seed)
    mm = rng.standard_normal((n, 3 * H * HD)).astype(np.float32) * 3
    bias = rng.standard_normal(3 * H * HD).astype(np.float32)
    ang = rng.uniform(-6, 6, (n, HD)).astype(np.float32)
    return mm, bias, np.cos(ang), np.sin(ang)


def reference(mm, bias, cos, sin):
    """numpy float32, one rounded op at a time: t = mm + b; q, k: t * c + rotate_half(t) * s; v: t."""
    n = len(mm)
    t = (mm + bias).reshape(n, 3, H, HD)
    c = np.stack([cos * np.float32(SCALE), cos], 1)[:, :, None]  # [N, 2, 1, hd]
    s = np.stack([sin * np.float32(SCALE), sin], 1)[:, :, None]
    qk = t[:, :2] * c + rotate_half(t[:, :2]) * s
    return np.concatenate([qk, t[:, 2:]], 1).reshape(n, -1), c, s


class _Loss(nn.Cell):
    """sum(QkvBiasRope(mm, bias) * w) with mm, bias as Parameters (their gradients are the op's backward)."""

    def __init__(self, op, mm, bias, w):
        super().__init__()
        self.op, self.w = op, Tensor(w)
        self.mm, self.bias = Parameter(Tensor(mm), name="mm"), Parameter(Tensor(bias), name="bias")

    def construct(self, cos, sin):
        return (self.op(self.mm, self.bias, cos, sin) * self.w).sum()


def run(kernel: bool, seed=0):
    mm, bias, cos, sin = inputs(seed)
    op = QkvBiasRope(H, HD)
    assert op.kernel  # the library builds here
    if not kernel:
        op.drop_kernel()
    tc, ts = op.tables(Tensor(cos), Tensor(sin), SCALE)
    out = op(Tensor(mm), Tensor(bias), tc, ts).asnumpy()
    w = np.random.default_rng(seed + 1).standard_normal(out.shape).astype(np.float32)
    loss = _Loss(op, mm, bias, w)
    grads = [g.asnumpy() for g in ms.grad(loss, None, loss.trainable_params())(tc, ts)]
    return out, grads, w


def test_kernel_equals_numpy_and_composite_bitwise():
    mm, bias, cos, sin = inputs()
    ref, c, s = reference(mm, bias, cos, sin)
    out_k, (dmm_k, db_k), w = run(kernel=True)
    out_c, (dmm_c, db_c), _ = run(kernel=False)
    np.testing.assert_array_equal(out_k, ref)
    np.testing.assert_array_equal(out_k, out_c)
    # backward: d(mm) = w * c + rotate_half^T(w * s) on q and k, w on v; d(bias) = its sum over rows
    w4 = w.reshape(N, 3, H, HD)
    dqk = w4[:, :2] * c + rotate_half_t(w4[:, :2] * s)
    dref = np.concatenate([dqk, w4[:, 2:]], 1).reshape(N, -1)
    np.testing.assert_array_equal(dmm_k, dref)
    np.testing.assert_array_equal(dmm_k, dmm_c)
    np.testing.assert_array_equal(db_k, db_c)
    np.testing.assert_allclose(db_k, dref.sum(0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    assert np.abs(out_k - (mm + bias)).max() > 0.1  # RoPE really moved the q/k rows


def test_kernel_under_dynamic_shapes():
    """One compile with a dynamic row count serves several N (the train step and the HF-style API compile
    with dynamic shapes); the output shape comes from the library's C++ shape inference."""
    op = QkvBiasRope(H, HD)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = op

        def construct(self, mm, bias, cos, sin):
            c, s = self.op.tables(cos, sin, SCALE)
            return self.op(mm, bias, c, s)

    net = Net()
    f32 = ms.float32
    net.set_inputs(Tensor(shape=[None, 3 * H * HD], dtype=f32), Tensor(shape=[3 * H * HD], dtype=f32),
                   Tensor(shape=[None, HD], dtype=f32), Tensor(shape=[None, HD], dtype=f32))
    for n in (5, 64):
        mm, bias, cos, sin = inputs(n, n)
        out = net(Tensor(mm), Tensor(bias), Tensor(cos), Tensor(sin)).asnumpy()
        np.testing.assert_array_equal(out, reference(mm, bias, cos, sin)[0])


@pytest.mark.slow  # about 12 s: two compiles of the vision tower
def test_vision_tower_with_and_without_kernel_bitwise(tmp_path):
    """The whole tower (windows and full attention, several images) gives the same outputs and parameter
    gradients with the kernel as with the composite ops, bit for bit (the composite path is checked against
    transformers in test_vision_blocks.py)."""
    path, _ = hf_tiny.tiny_qwen2_5_vl(tmp_path)
    ids, pv, grid = hf_tiny.image_sample(np.random.default_rng(3), [(28, 56), (112, 84), (252, 196)])
    keys = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
            "full_segment_ids", "window_gather", "full_gather"]
    results = []
    for kernel in (True, False):
        model = load_pretrained(MindVLModel, path)
        ops_ = [c for _, c in model.visual.cells_and_names() if isinstance(c, QkvBiasRope)]
        assert len(ops_) == model.config.vision.depth
        for op in ops_:
            if not kernel:
                op.drop_kernel()
        batch = build_model_inputs([[{"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}]],
                                   model.config)
        args = [Tensor(batch[k][0]) for k in keys]  # the one row's arrays: the ViT's inputs
        w = Tensor(np.random.default_rng(4).standard_normal((int(np.prod(grid, 1).sum()) // 4, 64))
                   .astype(np.float32))
        visual = model.visual

        def loss(*a):
            out_ = visual(*a)
            return (out_ * w).sum(), out_

        params = visual.trainable_params()
        # the output comes with the gradients (has_aux): one compiled graph per model, not two
        (_, out), grads = ms.jit(ms.value_and_grad(loss, None, params, has_aux=True))(*args)
        results.append((out.asnumpy(), [p.name for p in params], [g.asnumpy() for g in grads]))
    (out_k, names, g_k), (out_c, _, g_c) = results
    np.testing.assert_array_equal(out_k, out_c)
    assert len(g_k) == len(names) > 10
    for name, a, b in zip(names, g_k, g_c):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert any(np.abs(g).max() > 0 for n, g in zip(names, g_k) if "qkv.bias" in n)


def test_drop_kernel_runs_the_composite_ops_and_holds_no_custom_op():
    """`parallelize` drops the kernel (parallel graphs compile for Ascend): the values stay, and the cell no
    longer holds the C++ ops (the parallel audit counts every primitive a model holds)."""
    from mindvl_ms.parallel.audit import iter_primitives

    mm, bias, cos, sin = inputs()
    op = QkvBiasRope(H, HD)
    assert {p.name for _, _, p in iter_primitives(op)} == {"Custom"}
    op.drop_kernel()
    assert not op.kernel and not list(iter_primitives(op))
    tc, ts = op.tables(Tensor(cos), Tensor(sin), SCALE)
    np.testing.assert_array_equal(op(Tensor(mm), Tensor(bias), tc, ts).asnumpy(), reference(mm, bias, cos, sin)[0])


@pytest.mark.parametrize("cxx", ["/nonexistent/g++", "false"])
def test_without_a_working_compiler_the_composite_ops_run(tmp_path, monkeypatch, caplog, cxx):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", cxx)
    cpu_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mindvl_ms.ops.cpu_kernels"):
            assert cpu_kernels.library() is None
            op = QkvBiasRope(H, HD)
        assert not op.kernel
        assert ("not found" if cxx.startswith("/") else "build failed") in caplog.text
        mm, bias, cos, sin = inputs()
        tc, ts = op.tables(Tensor(cos), Tensor(sin), SCALE)
        assert tc.shape == (N, 3, H, HD)  # the composite's broadcast tables
        np.testing.assert_array_equal(op(Tensor(mm), Tensor(bias), tc, ts).asnumpy(), reference(mm, bias, cos, sin)[0])
    finally:
        cpu_kernels.library.cache_clear()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # a failed build leaves nothing behind


def test_a_library_mindspore_refuses_falls_back_with_one_warning(monkeypatch, caplog):
    """MindSpore only loads AOT libraries under MS_CUSTOM_AOT_WHITE_LIST when it is set: outside it the
    ops are refused, and the model keeps the composite ops (one warning per kernel, not per layer)."""
    monkeypatch.setenv("MS_CUSTOM_AOT_WHITE_LIST", "/nonexistent-white-list")
    with caplog.at_level(logging.WARNING, logger="mindvl_ms.ops.cpu_kernels"):
        ops_ = [QkvBiasRope(H, HD) for _ in range(3)]
    assert not any(op.kernel for op in ops_)
    assert caplog.text.count("QkvBiasRope not loaded") == 1 and caplog.text.count("QkvRopeGrad not loaded") == 1


@pytest.mark.slow  # about 12 s: builds the kernel library
def test_the_build_is_cached_by_source_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        first = cpu_kernels.library()
        assert first is not None and first.startswith(str(tmp_path))
        mtime = __import__("os").path.getmtime(first)
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() == first  # reused, not rebuilt
        assert __import__("os").path.getmtime(first) == mtime
        monkeypatch.setattr(cpu_kernels, "FLAGS", cpu_kernels.FLAGS + ("-DMINDVL_TEST",))
        cpu_kernels.library.cache_clear()
        other = cpu_kernels.library()
        assert other != first and len(list(tmp_path.rglob("*.so"))) == 2
    finally:
        cpu_kernels.library.cache_clear()
