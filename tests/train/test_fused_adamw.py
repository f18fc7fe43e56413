"""The `FusedAdamW` CPU kernel (ops/csrc/fused_adamw.cc) that `AdamWUpdate` runs per parameter on CPU: the
parameters, moments and accumulators it leaves are bitwise those of MindSpore's Mul, AdamWeightDecay and
ApplyGradientDescent chain (`kernel=False`), over three steps, for shapes whose sizes are not multiples of
any vector width, LR coefficients, decayed and undecayed tensors; and both follow a float64 numpy AdamW.

    python -m pytest -q tests/train/test_fused_adamw.py
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor

from mindvl_ms.train.optim import AdamWUpdate

SHAPES = {"visual.blocks.0.w": (3, 5), "visual.merger.bias": (7,), "model.embed.weight": (20011, 3),
          "model.norm.weight": (1,), "model.layers.0.w": (65, 129)}
COEFS = {"visual.": 0.1, "visual.merger.": 2.0}
LR, WD, B1, B2, EPS = 3e-3, 0.05, 0.9, 0.95, 1e-8


def run_update(kernel: bool, steps: int = 3):
    """Three AdamW steps from one seed's parameters and gradients -> ({name: (param, m, v, acc)}, update)."""
    rng = np.random.RandomState(0)
    params = [Parameter(Tensor(rng.randn(*s).astype(np.float32)), name=n) for n, s in SHAPES.items()]
    acc = ParameterTuple(Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"acc.{p.name}") for p in params)
    upd = AdamWUpdate(params, acc, COEFS, WD, B1, B2, EPS, kernel=kernel)
    grads = []
    for t in range(1, steps + 1):
        g = [(rng.randn(*p.shape) * 10.0 ** rng.uniform(-4, 2, p.shape)).astype(np.float32) for p in params]
        for a, x in zip(acc, g):
            a.set_data(Tensor(x))
        mult = float(np.float32(0.37 + 0.1 * t))
        upd(*(Tensor(x, ms.float32) for x in (mult, *upd.bias_corrected(LR, t))))
        grads.append((g, mult))
    out = {p.name: (p.asnumpy(), m.asnumpy(), v.asnumpy(), a.asnumpy())
           for p, m, v, a in zip(params, upd.m, upd.v, acc)}
    return out, upd, grads


def test_fused_kernel_is_bitwise_the_unfused_update():
    fused, upd, _ = run_update(kernel=True)
    assert upd.kernel is not None  # the CPU kernel library builds here
    plain, upd_plain, _ = run_update(kernel=False)
    assert upd_plain.kernel is None
    for name in SHAPES:
        for what, got, want in zip(("param", "m", "v", "acc"), fused[name], plain[name]):
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=f"{name} {what}")
        assert not fused[name][3].any()  # accumulator cleared
    assert int(upd.step.asnumpy()) == 3


def test_fused_kernel_follows_numpy_adamw():
    fused, _, grads = run_update(kernel=True)
    rng = np.random.RandomState(0)
    p_np = {n: rng.randn(*s).astype(np.float32).astype(np.float64) for n, s in SHAPES.items()}
    m_np = {n: np.zeros(s) for n, s in SHAPES.items()}
    v_np = {n: np.zeros(s) for n, s in SHAPES.items()}
    for t, (g, mult) in enumerate(grads, 1):
        for (n, s), gi in zip(SHAPES.items(), g):
            coef = 2.0 if n.startswith("visual.merger.") else 0.1 if n.startswith("visual.") else 1.0
            wd = WD if len(s) > 1 else 0.0
            x = gi.astype(np.float64) * mult
            m_np[n] = B1 * m_np[n] + (1 - B1) * x
            v_np[n] = B2 * v_np[n] + (1 - B2) * x * x
            step = (m_np[n] / (1 - B1 ** t)) / (np.sqrt(v_np[n] / (1 - B2 ** t)) + EPS) + wd * p_np[n]
            p_np[n] = p_np[n] - LR * coef * step
    for n in SHAPES:
        # float32 moments of float64 ones: relative to each tensor's scale (m cancels where g changes sign)
        np.testing.assert_allclose(fused[n][1], m_np[n], rtol=1e-5, atol=1e-6 * np.abs(m_np[n]).max())
        np.testing.assert_allclose(fused[n][2], v_np[n], rtol=1e-5, atol=1e-6 * np.abs(v_np[n]).max())
        np.testing.assert_allclose(fused[n][0], p_np[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [True, False])
def test_composite_path_when_asked(kernel):
    _, upd, _ = run_update(kernel=kernel, steps=1)
    assert (upd.kernel is not None) == kernel
