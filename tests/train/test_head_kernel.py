"""The LM head's C++ CPU kernels (ops/csrc/head_ce.cc, used by train/loss_head.py): HeadLogSoftmax and
HeadGradInto against float64 numpy (a hand-computed case, then register-tile, panel, thread and row-block
edges), the chunked head with the kernels against numpy and against its composite ops, and the switch back
to the composite ops. The kernels are not bitwise equal to the composite ops (polynomial exp, other
summation orders), so these comparisons have float32 tolerances.

    python -m pytest -q tests/train/test_head_kernel.py
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from mindvl_ms.ops import cpu_kernels
from mindvl_ms.train import loss_head, row_grads
from mindvl_ms.train.loss_head import IGNORE, ChunkedHeadCE, ChunkedHeadCERowGrad
from tests.train.test_loss_head import _numpy_ce_and_grads, head_case

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler to build the kernels")


def _kernels():
    kernels = loss_head.head_kernels()
    assert kernels is not None  # the library builds here
    return kernels


def _log_softmax64(x):
    x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


class _LogSoftmax(nn.Cell):
    def __init__(self):
        super().__init__()
        self.op = _kernels()[0]

    def construct(self, x):
        return self.op(x)


class _GradInto(nn.Cell):
    """HeadGradInto with the accumulator as a Parameter (the kernel adds into it in place)."""

    def __init__(self, acc):
        super().__init__()
        self.op = _kernels()[1]
        self.acc = Parameter(Tensor(acc), name="acc", requires_grad=False)

    def construct(self, logp, t, h, s, w):
        return self.op(logp, t, h, s, w, self.acc)


def test_log_softmax_kernel_by_hand_and_against_numpy():
    ms.set_context(mode=ms.GRAPH_MODE)
    op = _LogSoftmax()
    x = np.array([[0.0, np.log(3.0)], [5.0, 5.0]], np.float32)  # softmax [1/4, 3/4] and [1/2, 1/2]
    np.testing.assert_allclose(op(Tensor(x)).asnumpy(), np.log([[0.25, 0.75], [0.5, 0.5]]), rtol=1e-6)
    rng = np.random.default_rng(0)
    # a vector tail (1013 columns), one row, and enough rows for the two-thread split
    for c, v in ((5, 1013), (1, 70001), (6, 70001)):
        x = (rng.standard_normal((c, v)) * 4).astype(np.float32)
        x[0, 3] = -200.0  # exp underflows to 0 within the row sum
        got = op(Tensor(x)).asnumpy()
        np.testing.assert_allclose(got, _log_softmax64(x), rtol=1e-6, atol=1e-6)


def _grad_reference(logp, t, h, s, w, acc):
    """float64: acc + G^T (h * s) and (G @ W) * s, G = exp(logp) - onehot(t)."""
    g = np.exp(logp.astype(np.float64))
    g[np.arange(len(t)), t] -= 1.0
    hs = h.astype(np.float64) * s[:, None]
    return acc + g.T @ hs, (g @ w.astype(np.float64)) * s[:, None]


def test_grad_kernel_by_hand():
    """One row, V = 2, D = 1: G = [1/4, 3/4] - [0, 1], h * s = 1, so acc gains [1/4, -1/4] and
    dh = (1/4 * 1 - 1/4 * 3) * 1/2 = -1/4."""
    ms.set_context(mode=ms.GRAPH_MODE)
    op = _GradInto(np.array([[10.0], [20.0]], np.float32))
    logp = np.log(np.array([[0.25, 0.75]], np.float32))
    dh = op(Tensor(logp), Tensor([1.0], ms.float32), Tensor([[2.0]], ms.float32), Tensor([0.5], ms.float32),
            Tensor([[1.0], [3.0]], ms.float32))
    np.testing.assert_allclose(dh.asnumpy(), [[-0.25]], rtol=1e-6)
    np.testing.assert_allclose(op.acc.asnumpy(), [[10.25], [19.75]], rtol=1e-6)


# (rows, vocabulary, D): a vector tail in V and a D narrower than a register tile; D exactly one tile (the
# unpacked path); D of two tiles and a 2-column rest; more than 256 contributing rows (two row blocks) with
# both threads
@pytest.mark.parametrize("c,v,d", [(5, 1013, 37), (96, 3001, 64), (7, 4099, 130), (400, 20011, 19)])
def test_grad_kernel_against_numpy(c, v, d):
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(c)
    logp = _log_softmax64(rng.standard_normal((c, v)) * 3).astype(np.float32)
    t = rng.integers(0, v, c)
    t[0] = v - 1  # the last column
    s = rng.standard_normal(c).astype(np.float32)
    s[rng.random(c) < 0.2] = 0.0  # rows without a target (IGNORE): no dW, dh 0
    h = rng.standard_normal((c, d)).astype(np.float32)
    w = rng.standard_normal((v, d)).astype(np.float32)
    acc = rng.standard_normal((v, d)).astype(np.float32)
    op = _GradInto(acc)
    dh = op(Tensor(logp), Tensor(t.astype(np.float32)), Tensor(h), Tensor(s), Tensor(w)).asnumpy()
    ref_acc, ref_dh = _grad_reference(logp, t, h, s, w, acc)
    got_acc = op.acc.asnumpy()
    added = ref_acc - acc  # what the kernel had to add: compared at its own scale
    np.testing.assert_allclose(got_acc - acc, added, rtol=1e-4, atol=1e-5 * np.abs(added).max())
    np.testing.assert_allclose(got_acc, ref_acc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5 * np.abs(ref_dh).max())
    assert (dh[s == 0] == 0).all() and np.abs(ref_dh).max() > 0.1


def _row_head_grads(h, w, t, coef, one_block, kernel):
    """(loss, CE, dh, the accumulator after the backward) of ChunkedHeadCERowGrad on the chunk grid."""
    acc = Parameter(Tensor(np.zeros(w.shape, np.float32)), name="acc_head", requires_grad=False)
    head = ChunkedHeadCERowGrad(one_block, kernel=kernel)
    assert head.blocks.kernel == kernel

    def f(h_, tok):
        ce = head(h_, Tensor(w), Tensor(t), acc, tok)
        return (ce * Tensor(coef)).sum(), ce

    (loss, ce), (dh, _) = ms.value_and_grad(f, (0, 1), has_aux=True)(Tensor(h), row_grads.row_grad_token())
    return float(loss.asnumpy()), ce.asnumpy(), dh.asnumpy(), acc.asnumpy()


@pytest.mark.parametrize("one_block", [False, True])
def test_row_grad_head_with_kernels_matches_numpy_and_the_composite_head(one_block):
    """Three chunks (chunk 0 from the kept log-softmax, the others recomputed), or one block: loss, CE, dh and
    the accumulated dW equal float64 numpy and the composite ops' (kernel dropped) to float32 rounding."""
    ms.set_context(mode=ms.GRAPH_MODE)
    h, w, t, coef, _ = head_case(2)
    d = h.shape[-1]
    got = _row_head_grads(h, w, t, coef, one_block, kernel=True)
    composite = _row_head_grads(h, w, t, coef, one_block, kernel=False)
    ce, rh, rw = _numpy_ce_and_grads(h.reshape(-1, d), w, t.reshape(-1), coef.reshape(-1))
    assert got[0] == pytest.approx(float((ce * coef.reshape(-1)).sum()), rel=1e-5)
    np.testing.assert_allclose(got[1].reshape(-1), ce, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2].reshape(-1, d), rh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[3], rw, rtol=1e-5, atol=1e-6)
    assert got[0] == pytest.approx(composite[0], rel=1e-6)
    for a, b in zip(got[1:], composite[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert (got[1][t == IGNORE] == 0).all() and np.abs(rw).max() > 1e-2


def test_drop_kernel_and_the_vocab_parallel_form_hold_no_kernel():
    head = ChunkedHeadCE()
    assert head.blocks.kernel and head.blocks.grad_kernel is not None
    assert cpu_kernels.drop_kernels(head) == 1
    assert not head.blocks.kernel and head.blocks.lsm_kernel is None and head.blocks.grad_kernel is None
    sharded = ChunkedHeadCERowGrad()
    sharded.vocab_parallel = True  # parallel.parallelize.shard_loss_head: the compiler shards the composite ops
    assert not sharded.blocks.kernel and sharded.blocks.lsm_kernel is None
    assert not ChunkedHeadCE(kernel=False).blocks.kernel
