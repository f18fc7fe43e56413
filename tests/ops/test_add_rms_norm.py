"""AddRMSNorm (residual add, then RMSNorm, both results): the CPU path equals an Add followed by an RMSNorm
bit for bit, forward and gradients (C++ kernel, composite ops, float16); the Ascend branch calls the fused
AddRmsNorm kernel with (residual, x, weight, eps) and returns its (y, sum); the decoder layers hold it as
`post_attention_layernorm` (checkpoint name unchanged) and take the fused kernel on Ascend; `parallelize`
runs the add as its own sharded primitive (MindSpore has no sharding rule for AddRmsNorm)."""
import os

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.nn.utils import no_init_parameters
from mindspore.ops.auto_generate import AddRmsNorm

from mindvl_ms.config import TextConfig, load_model_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.models.moe import DeepseekV3DecoderLayer
from mindvl_ms.models.text import DecoderLayer
from mindvl_ms.ops import AddRMSNorm, RMSNorm, cpu_kernels
from mindvl_ms.ops import norm as norm_module
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.audit import iter_primitives, strategy_of

from tests.support.paths import ROOT

EPS = 1e-6


class _Unfused(nn.Cell):
    """The pair AddRMSNorm replaces: h = residual + x, then RMSNorm(h)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.add = ops.Add()

    def construct(self, x, residual):
        h = self.add(residual, x)
        return self.norm(h), h


class _Loss(nn.Cell):
    """A scalar of both outputs, so the gradients flow through the norm and the sum; the outputs come along
    (auxiliary outputs: one compiled graph gives them and the gradients)."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, x, residual, dy, dh):
        y, h = self.cell(x, residual)
        return (y * dy).sum() + (h * dh).sum(), y, h


def _pair(dim, kernel, weight):
    fused, plain = AddRMSNorm(dim, EPS), RMSNorm(dim, EPS)
    for n in (fused, plain):
        n.weight.set_data(Tensor(weight))
        if not kernel:
            n.drop_kernel()
    return fused, _Unfused(plain)


def _outputs(cell, args):
    (_, y, h), grads = ms.value_and_grad(_Loss(cell), (0, 1), cell.trainable_params(), has_aux=True)(*args)
    (dx, dres), (dw,) = grads
    return [t.asnumpy() for t in (y, h, dx, dres, dw)]


@pytest.mark.parametrize("dtype,kernel", [(np.float32, True), (np.float32, False), (np.float16, False)])
def test_cpu_path_equals_the_unfused_pair_bitwise(dtype, kernel):
    if kernel and cpu_kernels.library() is None:
        pytest.skip("no C++ compiler to build the kernels")
    rng = np.random.default_rng(0)
    shape = (2, 7, 48)
    x, res, dy, dh = ((rng.standard_normal(shape) * 2).astype(dtype) for _ in range(4))
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    fused, unfused = _pair(shape[-1], kernel, w)
    assert not fused.fused_add and fused.kernel is (kernel and fused.cpu_kernel is not None)
    args = [Tensor(a) for a in (x, res, dy, dh)]
    got, want = _outputs(fused, args), _outputs(unfused, args)
    for name, g, r in zip(("y", "sum", "d_x", "d_residual", "d_weight"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        np.testing.assert_array_equal(g, r, err_msg=name)
    np.testing.assert_array_equal(got[1], res + x)
    assert np.abs(got[4]).max() > 0.1


def test_ascend_branch_calls_the_fused_kernel():
    """The fused branch as on Ascend (PyNative, the kernel replaced by a stand-in with its documented
    outputs (y, rstd, x1 + x2)): its inputs are (residual, x, weight in x's dtype, eps)."""
    calls = []

    def fake_kernel(x1, x2, gamma, epsilon):
        calls.append((x1.asnumpy(), x2.asnumpy(), gamma.asnumpy(), gamma.dtype, epsilon))
        return x1 * 2, x1[..., :1], x1 + x2

    norm = AddRMSNorm(8, 1e-5)
    assert isinstance(norm.add_rms_norm.kernel, AddRmsNorm)
    norm.fused_add = True
    norm.add_rms_norm.kernel = fake_kernel
    x, res = (np.random.default_rng(s).standard_normal((3, 8)).astype(np.float16) for s in (1, 2))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        y, total = norm(Tensor(x), Tensor(res))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    (x1, x2, gamma, gamma_dtype, eps), = calls
    np.testing.assert_array_equal(x1, res)
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(gamma, np.ones(8, np.float16))
    assert gamma_dtype == ms.float16 and eps == 1e-5
    np.testing.assert_array_equal(y.asnumpy(), res * 2)
    np.testing.assert_array_equal(total.asnumpy(), res + x)


def _tiny_text():
    tc = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, mrope_section=[2, 3, 3])
    tc.validate()
    return tc


def test_decoder_layers_take_the_fused_kernel_on_ascend(monkeypatch):
    moe_cfg = load_model_config(os.path.join(ROOT, "configs/model/tiny-moe.yaml")).text
    cpu = [DecoderLayer(_tiny_text()), DeepseekV3DecoderLayer(moe_cfg, 0)]
    monkeypatch.setattr(norm_module, "is_ascend", lambda: True)
    with no_init_parameters():
        ascend = [DecoderLayer(_tiny_text()), DeepseekV3DecoderLayer(moe_cfg, 0)]
    for layer in cpu:
        assert isinstance(layer.post_attention_layernorm, AddRMSNorm) and not layer.post_attention_layernorm.fused_add
    for layer in ascend:
        norm = layer.post_attention_layernorm
        assert norm.fused_add and isinstance(norm.add_rms_norm.kernel, AddRmsNorm)
        assert norm.cpu_kernel is None and not layer.input_layernorm.kernel
        names = [n for n, _ in layer.parameters_and_names()]
        assert "post_attention_layernorm.weight" in names  # the checkpoint key is unchanged
        assert not any("add_rms_norm" in n for n in names)


def test_parallelize_runs_the_add_as_its_own_sharded_primitive(monkeypatch):
    cfg = load_model_config(os.path.join(ROOT, "configs/model/tiny.yaml"))
    monkeypatch.setattr(norm_module, "is_ascend", lambda: True)  # the fused kernel, as on Ascend
    with no_init_parameters():
        m = MindVLModel(cfg)
    norm = m.model.layers[0].post_attention_layernorm
    assert norm.fused_add
    parallelize(m, Layout(dp=2, tp=2, seq_parallel=True))
    hid = (2, 2, 1)
    for layer in m.model.layers:
        norm = layer.post_attention_layernorm
        assert not norm.fused_add and norm.add_rms_norm is None
        assert not [p for _, _, p in iter_primitives(norm) if p.name == "AddRmsNorm"]
        assert strategy_of(norm.add) == (hid, hid) and strategy_of(norm.rms_norm) == (hid, (1,))
        assert strategy_of(layer.add) == (hid, hid)


def test_fused_branch_infers_up_to_kernel_selection():
    """Graph mode on CPU takes the fused branch through parsing and shape/dtype inference: only the Ascend
    kernel itself is missing."""
    norm = AddRMSNorm(8)
    norm.fused_add = True
    x = Tensor(np.ones((2, 3, 8), np.float32))
    with pytest.raises(RuntimeError, match=r"Unsupported op \[AddRmsNorm\] on CPU"):
        norm(x, x)
