"""CPU equivalents of the Ascend MoE primitives (mindvl_ms.ops.moe) against numpy, values and gradients."""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from mindvl_ms.ops.moe import Cumsum, GroupedMatmul, Sort, TokenPermute, TokenUnpermute, TopK, tokens_per_expert


class _Call(nn.Cell):
    """Wrap a cell so that non-tensor arguments are compile-time constants."""

    def __init__(self, cell, *const):
        super().__init__()
        self.cell = cell
        self.const = const

    def construct(self, *args):
        return self.cell(*args, *self.const)


def test_topk_matches_numpy():
    x = np.random.randn(5, 7, 16).astype(np.float32)
    values, idx = _Call(TopK(), 3)(Tensor(x))
    ref_idx = np.argsort(-x, -1)[..., :3]
    assert idx.dtype == ms.int32
    np.testing.assert_array_equal(idx.asnumpy(), ref_idx)
    np.testing.assert_array_equal(values.asnumpy(), np.take_along_axis(x, ref_idx, -1))


def test_sort_and_cumsum_match_numpy():
    x = np.random.permutation(40).astype(np.float32).reshape(4, 10)
    values, idx = Sort()(Tensor(x))
    np.testing.assert_array_equal(values.asnumpy(), np.sort(x, -1))
    np.testing.assert_array_equal(idx.asnumpy(), np.argsort(x, -1))
    c = np.random.randint(0, 5, (3, 6)).astype(np.int64)
    np.testing.assert_array_equal(Cumsum(1)(Tensor(c)).asnumpy(), np.cumsum(c, 1))
    np.testing.assert_array_equal(Cumsum(0)(Tensor(c)).asnumpy(), np.cumsum(c, 0))


def _routing(t=9, k=3, e=5):
    ids = np.stack([np.random.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)  # [T, k]
    return ids


def test_token_permute_groups_rows_by_expert():
    t, k, e, d = 9, 3, 5, 4
    ids = _routing(t, k, e)
    x = np.random.randn(t, d).astype(np.float32)
    permuted, order = TokenPermute()(Tensor(x), Tensor(ids))
    flat = ids.reshape(-1)
    ref_order = np.argsort(flat, kind="stable")  # Megatron/MoeTokenPermute: stable sort of flattened ids
    np.testing.assert_array_equal(order.asnumpy(), ref_order)
    np.testing.assert_array_equal(permuted.asnumpy(), x[ref_order // k])
    assert (np.diff(flat[order.asnumpy()]) >= 0).all()


def test_token_unpermute_inverts_with_weights():
    t, k, e, d = 9, 3, 5, 4
    ids = _routing(t, k, e)
    probs = np.random.rand(t, k).astype(np.float32)
    order = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
    rows = np.random.randn(t * k, d).astype(np.float32)  # expert outputs in permuted order
    out = TokenUnpermute()(Tensor(rows), Tensor(order), Tensor(probs)).asnumpy()
    ref = np.zeros((t, d), np.float32)
    for i, src in enumerate(order):  # row i of `rows` belongs to copy src = token * k + j
        ref[src // k] += probs[src // k, src % k] * rows[i]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def _gmm_ref(x, w, counts):
    ends = np.cumsum(counts)
    out = np.zeros((x.shape[0], w.shape[2]), np.float32)
    start = 0
    for g, end in enumerate(ends):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def test_grouped_matmul_forward_and_grad():
    e, kdim, n = 4, 6, 5
    counts = np.array([3, 0, 4, 2], np.int64)  # an empty group too
    x = np.random.randn(counts.sum(), kdim).astype(np.float32)
    w = np.random.randn(e, kdim, n).astype(np.float32)
    gl = Tensor(np.cumsum(counts))
    gmm = GroupedMatmul()
    np.testing.assert_allclose(gmm(Tensor(x), Tensor(w), gl).asnumpy(), _gmm_ref(x, w, counts), rtol=1e-5, atol=1e-5)

    g = np.random.randn(counts.sum(), n).astype(np.float32)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gmm = GroupedMatmul()

        def construct(self, a, b, lst, up):
            return (self.gmm(a, b, lst) * up).sum()

    dx, dw = ms.grad(Loss(), grad_position=(0, 1))(Tensor(x), Tensor(w), gl, Tensor(g))
    ref_dx = np.zeros_like(x)
    ref_dw = np.zeros_like(w)
    start = 0
    for grp, end in enumerate(np.cumsum(counts)):
        ref_dx[start:end] = g[start:end] @ w[grp].T
        ref_dw[grp] = x[start:end].T @ g[start:end]
        start = end
    np.testing.assert_allclose(dx.asnumpy(), ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.asnumpy(), ref_dw, rtol=1e-5, atol=1e-5)


def test_tokens_per_expert_counts_and_masks():
    ids = _routing(12, 2, 6)
    valid = (np.arange(12) < 10).astype(np.float32)
    out = _Counts(6)(Tensor(ids), Tensor(valid)).asnumpy()
    ref = np.bincount(ids[:10].reshape(-1), minlength=6)
    np.testing.assert_array_equal(out, ref.astype(np.float32))


class _Counts(nn.Cell):
    def __init__(self, e):
        super().__init__()
        self.e = e

    def construct(self, ids, valid):
        return tokens_per_expert(ids, self.e, valid)
