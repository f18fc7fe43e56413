"""Sparse routed experts (the CPU default): layout invariants, and outputs and gradients equal to the dense
every-expert path and to a numpy per-token reference, on both branches: the [E, C] capacity layout
(balanced routing) and the expert-pure block layout it falls back to (fully skewed routing)."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from mindvl_ms.models.moe import RoutedExperts
from mindvl_ms.ops.moe import block_layout, capacity_layout, expert_block_size, expert_capacity, expert_ranks


def routing(rng, t, e, k, skew):
    if skew:  # every token picks the same k experts: one group holds all T rows
        return np.tile(np.arange(k, dtype=np.int32)[::-1], (t, 1))
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("e,k,block,skew", [(8, 2, 8, False), (8, 2, 8, True), (64, 4, 16, False),
                                            (5, 3, 4, True)])
def test_block_layout_places_every_copy_in_a_block_of_its_expert(e, k, block, skew):
    rng = np.random.default_rng(e + k)
    t = 37
    idx = routing(rng, t, e, k, skew)
    dest, slot_token, block_expert = (a.asnumpy() for a in block_layout(Tensor(idx), e, block))
    m = t * k
    assert len(block_expert) == (m + e * (block - 1)) // block and len(slot_token) == len(block_expert) * block
    assert len(set(dest.tolist())) == m  # distinct slots, nothing dropped
    flat = idx.reshape(-1)
    np.testing.assert_array_equal(slot_token[dest], np.arange(m) // k)  # the slot is fed by its token
    np.testing.assert_array_equal(block_expert[dest // block], flat)  # ... inside a block of its expert
    empty = np.setdiff1d(np.arange(len(slot_token)), dest)
    assert (slot_token[empty] == t).all()  # padding slots read the zero row


def test_capacity_layout_places_every_copy_in_its_expert_row():
    rng = np.random.default_rng(5)
    t, e, k = 40, 8, 2
    idx = routing(rng, t, e, k, False)
    _, rank, counts = expert_ranks(Tensor(idx), e)
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(idx.reshape(-1), minlength=e))
    cap = expert_capacity(t * k, e)
    assert cap == 24 and counts.asnumpy().max() <= cap  # mean 10 + 4 sqrt(10) = 22.6 -> 24
    dest, slot_token = (a.asnumpy() for a in capacity_layout(Tensor(idx), rank, e, cap))
    assert len(set(dest.tolist())) == t * k
    np.testing.assert_array_equal(dest // cap, idx.reshape(-1))  # slot row = the copy's expert
    np.testing.assert_array_equal(slot_token[dest], np.arange(t * k) // k)
    assert (np.delete(slot_token, dest) == t).all()


def test_block_size_choice():
    assert expert_block_size(2048, 8) == 128 and expert_block_size(2048, 64) == 16
    assert expert_block_size(16, 64) == 8  # never below 8


def numpy_moe(x, idx, w, gate, up, down):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, ex in enumerate(idx[t]):
            g, u = x[t] @ gate[ex], x[t] @ up[ex]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[ex])
    return out


class Objective(nn.Cell):
    """sum(experts(x) * g), with the experts' output as an auxiliary output: one compiled graph gives the
    output and the gradients."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def construct(self, x, idx, w, g):
        out = self.experts(x, idx, w)
        return (out * g).sum(), out


@pytest.mark.parametrize("e,k,skew", [(8, 2, False), (8, 2, True), (64, 4, False)])
def test_sparse_equals_dense_and_numpy_with_gradients(e, k, skew):
    rng = np.random.default_rng(3)
    t, d, inter = 45, 16, 24
    x = rng.standard_normal((t, d)).astype(np.float32)
    idx = routing(rng, t, e, k, skew)
    # balanced routing takes the capacity branch, the skewed one overflows it and takes the block branch
    assert (np.bincount(idx.reshape(-1), minlength=e).max() > expert_capacity(t * k, e)) == skew
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    g = rng.standard_normal((t, d)).astype(np.float32)
    params = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((e, d, inter), (e, d, inter), (e, inter, d))]
    results = {}
    for dispatch in ("sparse", "dense"):
        cell = RoutedExperts(e, d, inter, 0.02, dispatch)
        for p, v in zip((cell.gate_proj, cell.up_proj, cell.down_proj), params):
            p.set_data(Tensor(v))
        obj = Objective(cell)
        grad_fn = ms.value_and_grad(obj, (0, 2), obj.trainable_params(), has_aux=True)
        (_, out), (inputs_grad, param_grads) = grad_fn(Tensor(x), Tensor(idx), Tensor(w), Tensor(g))
        results[dispatch] = [out.asnumpy()] + [a.asnumpy() for a in inputs_grad] + [a.asnumpy() for a in param_grads]
    ref = numpy_moe(x, idx, w, *params)
    np.testing.assert_allclose(results["sparse"][0], ref, rtol=1e-4, atol=1e-4)
    names = ["out", "d x", "d routing weights", "d gate_proj", "d up_proj", "d down_proj"]
    for name, a, b in zip(names, results["sparse"], results["dense"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
    # unrouted experts get exactly zero gradient on the sparse path
    unused = np.setdiff1d(np.arange(e), idx)
    assert np.all(results["sparse"][3][unused] == 0)
