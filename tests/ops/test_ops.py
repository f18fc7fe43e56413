"""CPU paths of the kernel dispatch layer against numpy references."""
import numpy as np
import pytest
import torch

import mindspore as ms
from mindspore import Tensor

from mindvl_ms.ops import ApplyRotary, CoreAttention, RMSNorm, SwiGLU, is_ascend, segment_bias


def test_cpu_is_selected_here():
    assert not is_ascend()
    assert not RMSNorm(4).fused and not CoreAttention(2, 1, 4).fused


def test_rmsnorm_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.set_data(Tensor(w))
    ref = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    assert np.abs(norm(Tensor(x)).asnumpy() - ref).max() < 1e-5


def test_rotary_and_swiglu_match_numpy():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    ang = rng.standard_normal((1, 1, 5, 4)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    out = ApplyRotary()(Tensor(x), Tensor(cos), Tensor(sin)).asnumpy()
    # rotate pairs (i, i + D/2) by the angle: the rotate-half convention
    x1, x2 = x[..., :4], x[..., 4:]
    ref = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    assert np.abs(out - ref).max() < 1e-5
    g, u = rng.standard_normal((2, 3, 6)).astype(np.float32)
    assert np.abs(SwiGLU()(Tensor(g), Tensor(u)).asnumpy() - g / (1 + np.exp(-g)) * u).max() < 1e-5


def _np_attention(q, k, v, allowed):
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    s = np.where(allowed[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v


@pytest.mark.parametrize("causal", [False, True])
def test_segment_attention_is_block_diagonal(causal):
    rng = np.random.default_rng(2)
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3], [4, 4, 4, 4, 4, 5, 5, 5]], np.int32)
    q = rng.standard_normal((2, 4, 8, 4)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 8, 4)).astype(np.float32)
    allowed = seg[:, :, None] == seg[:, None, :]
    if causal:
        allowed &= np.tril(np.ones((8, 8), bool))
    bias = segment_bias(Tensor(seg), Tensor(seg), causal)
    out = CoreAttention(4, 2, 4)(Tensor(q), Tensor(k), Tensor(v), bias).asnumpy()
    assert np.abs(out - _np_attention(q, k, v, allowed)).max() < 1e-5
    # and the same as running each segment alone through torch's SDPA
    for b in range(2):
        for sid in np.unique(seg[b]):
            idx = np.flatnonzero(seg[b] == sid)
            ref = torch.nn.functional.scaled_dot_product_attention(
                torch.tensor(q[b:b + 1, :, idx]), torch.tensor(np.repeat(k[b:b + 1, :, idx], 2, 1)),
                torch.tensor(np.repeat(v[b:b + 1, :, idx], 2, 1)), is_causal=causal).numpy()
            assert np.abs(out[b:b + 1, :, idx] - ref).max() < 1e-5


def test_padding_rows_stay_finite():
    seg = np.array([[1, 1, 0, 0]], np.int32)
    q = np.ones((1, 1, 4, 2), np.float32)
    out = CoreAttention(1, 1, 2)(Tensor(q), Tensor(q), Tensor(q), segment_bias(Tensor(seg), Tensor(seg), True))
    assert np.isfinite(out.asnumpy()).all()


def test_plain_gelu_vision_mlp_matches_qwen2_vl():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

    from mindvl_ms.config import VisionConfig
    from mindvl_ms.models.vision import VisionMLP

    cfg = VisionConfig(hidden_size=16, intermediate_size=48, num_heads=2, mlp_type="plain", hidden_act="gelu",
                       depth=1, fullatt_block_indexes=[0])
    torch.manual_seed(0)
    ref = VisionMlp(16, 48, "gelu")
    ours = VisionMLP(cfg)
    params = dict(ours.parameters_and_names())
    for name, p in ref.named_parameters():
        params[name].set_data(Tensor(p.detach().numpy()))
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    with torch.no_grad():
        expect = ref(torch.tensor(x)).numpy()
    assert np.abs(ours(Tensor(x)).asnumpy() - expect).max() < 1e-5


class _SoftmaxVLoss(ms.nn.Cell):
    def __init__(self, w):
        super().__init__()
        from mindvl_ms.ops.attention import SoftmaxV

        self.sv, self.w = SoftmaxV(), Tensor(w)

    def construct(self, scores, v):
        return (self.sv(scores, v) * self.w).sum()


def test_softmax_v_backward_matches_torch_autograd():
    """SoftmaxV's hand-written backward (rowsum(dO * O) instead of a reduction over the scores, the
    subtraction inside a widened matmul) equals torch autograd of softmax(s) @ v, masked keys included."""
    rng = np.random.default_rng(3)
    s = (rng.standard_normal((3, 2, 6, 9)) * 3).astype(np.float32)
    s[..., 7:] += -1e9                                        # masked keys (the key_bias of padding slots)
    v = rng.standard_normal((3, 2, 9, 5)).astype(np.float32)
    w = rng.standard_normal((3, 2, 6, 5)).astype(np.float32)
    ts, tv = torch.tensor(s, requires_grad=True), torch.tensor(v, requires_grad=True)
    out_ref = torch.softmax(ts, -1) @ tv
    (out_ref * torch.tensor(w)).sum().backward()
    loss = _SoftmaxVLoss(w)
    from mindvl_ms.ops.attention import SoftmaxV

    out = SoftmaxV()(Tensor(s), Tensor(v)).asnumpy()
    assert np.abs(out - out_ref.detach().numpy()).max() < 1e-5
    ds, dv = ms.jit(ms.grad(loss, (0, 1)))(Tensor(s), Tensor(v))
    assert np.abs(ds.asnumpy() - ts.grad.numpy()).max() < 1e-5
    assert np.abs(dv.asnumpy() - tv.grad.numpy()).max() < 1e-5
    assert np.abs(ds.asnumpy()[..., 7:]).max() == 0 and np.abs(ts.grad.numpy()).max() > 0.1


def test_linear_bias_gradient_matches_torch():
    """ops.Linear (its CPU bias gradient is a ones-row matmul) equals torch.nn.Linear in output and in
    the gradients of input, weight and bias; it stays an nn.Dense with nn.Dense's parameter names."""
    from mindvl_ms.ops import Linear

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 7, 5)).astype(np.float32)
    w = rng.standard_normal((2, 7, 3)).astype(np.float32)
    lin = Linear(5, 3)
    assert isinstance(lin, ms.nn.Dense) and lin.cpu_bias
    assert sorted(p.name.split(".")[-1] for p in lin.get_parameters()) == ["bias", "weight"]
    lin.bias.set_data(Tensor(rng.standard_normal(3).astype(np.float32)))
    ref = torch.nn.Linear(5, 3)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(lin.weight.asnumpy()))
        ref.bias.copy_(torch.tensor(lin.bias.asnumpy()))
    tx = torch.tensor(x, requires_grad=True)
    (ref(tx) * torch.tensor(w)).sum().backward()

    class Loss(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.lin, self.w = lin, Tensor(w)

        def construct(self, x):
            return (self.lin(x) * self.w).sum()

    assert np.abs(lin(Tensor(x)).asnumpy() - ref(tx).detach().numpy()).max() < 1e-5
    dx, (dw, db) = ms.jit(ms.grad(Loss(), 0, [lin.weight, lin.bias]))(Tensor(x))
    assert np.abs(dx.asnumpy() - tx.grad.numpy()).max() < 1e-5
    assert np.abs(dw.asnumpy() - ref.weight.grad.numpy()).max() < 1e-5
    assert np.abs(db.asnumpy() - ref.bias.grad.numpy()).max() < 1e-5 and np.abs(db.asnumpy()).max() > 0.1
