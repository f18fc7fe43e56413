"""Row-wise gradients of the [V, D] tables (train/row_grads.py): the embedding lookup and the chunked head add
their gradients into the accumulators from their bprops. Checked against numpy, against the plain autodiff
gradient, and through the whole TrainStep (same parameters as plain autodiff after two steps)."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindvl_ms.config.base import load
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.config.train import StageConfig
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.ops import cpu_kernels
from mindvl_ms.train import loss_head, optim, row_grads, step_cells
from mindvl_ms.train.loss_head import IGNORE, ChunkedHeadCE, ChunkedHeadCERowGrad
from mindvl_ms.train.optim import select_trainable
from mindvl_ms.train.forward_loss import ForwardLoss
from mindvl_ms.train.train_step import TrainStep
from tests.train.test_loss_head import _batch, _numpy_ce_and_grads
from tests.train.test_trainer_mindvl import MODEL

V, D = 50, 8


class _LookupNet(nn.Cell):
    """loss = sum((table[ids] @ lin)^2); the table's gradient goes row-wise into `acc`."""

    def __init__(self, table, lin):
        super().__init__()
        self.table = Parameter(Tensor(table), name="table")
        self.lin = Parameter(Tensor(lin), name="lin")
        self.acc = Parameter(Tensor(np.zeros((V, D), np.float32)), name="acc", requires_grad=False)
        self.token = row_grads.row_grad_token()
        self.embed = row_grads.RowGradEmbedding(self.table, self.acc, self.token)

    def construct(self, ids):
        return (ops.matmul(self.embed(ids), self.lin) ** 2).sum()


class _Step(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.grad = ops.value_and_grad(net, None, ParameterTuple([net.lin, net.token]))

    def construct(self, ids):
        loss, grads = self.grad(ids)
        return ops.depend(loss, grads[1]), grads[0]


def test_lookup_adds_its_rows_into_the_accumulator_like_numpy():
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    table, lin = rng.standard_normal((V, D)).astype(np.float32), rng.standard_normal((D, 3)).astype(np.float32)
    net = _LookupNet(table, lin)
    step = _Step(net)
    step.set_inputs(Tensor(shape=[None, None], dtype=ms.int32))  # dynamic, as the train step
    batches = [np.array([[1, 3, 3, 7], [1, 1, 49, 0]], np.int32), np.array([[5, 3, 2, 2, 3, 0]], np.int32)]
    ref = np.zeros((V, D), np.float64)
    for ids in batches:
        loss, g_lin = step(Tensor(ids))
        e = table[ids].astype(np.float64)  # [B, L, D]
        y = e @ lin
        assert float(loss.asnumpy()) == pytest.approx(float((y ** 2).sum()), rel=1e-5)
        np.add.at(ref, ids.reshape(-1), (2 * y @ lin.T).reshape(-1, D))  # repeated ids add up
        np.testing.assert_allclose(g_lin.asnumpy(), np.einsum("bld,blk->dk", e, 2 * y), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(net.acc.asnumpy(), ref, rtol=1e-5, atol=1e-4)
    assert np.abs(ref).max() > 1.0 and (np.abs(ref).sum(1) == 0).sum() > 30  # untouched rows stay zero
    np.testing.assert_array_equal(net.table.asnumpy(), table)  # the table itself is not written


def test_head_row_blocks_equal_the_dense_head_gradient(monkeypatch):
    """ChunkedHeadCERowGrad adds dW in blocks of rows (7 here: 8 blocks, the last one ragged); the sum is the
    dW that ChunkedHeadCE returns and that numpy computes, and dh is unchanged. Both heads on their composite
    ops: with the C++ kernels (tests/train/test_head_kernel.py) no row blocks run."""
    monkeypatch.setattr(row_grads, "HEAD_ROW_BLOCK", 7)
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((3, 4, D)).astype(np.float32)
    w = (rng.standard_normal((V, D)) * 0.5).astype(np.float32)
    t = rng.integers(0, V, (3, 4)).astype(np.int32)
    t[0, 1] = t[2, 3] = IGNORE
    coef = rng.standard_normal((3, 4)).astype(np.float32)
    acc = Parameter(Tensor(np.zeros((V, D), np.float32)), name="acc_head", requires_grad=False)
    token = row_grads.row_grad_token()
    dense, rows = ChunkedHeadCE(kernel=False), ChunkedHeadCERowGrad(kernel=False)

    def f_dense(h_, w_):
        return (dense(h_, w_, Tensor(t)) * Tensor(coef)).sum()

    def f_rows(h_, tok):
        return (rows(h_, Tensor(w), Tensor(t), acc, tok) * Tensor(coef)).sum()

    (loss_d, (dh_d, dw_d)) = ms.value_and_grad(f_dense, (0, 1))(Tensor(h), Tensor(w))
    loss_r, (dh_r, _) = ms.value_and_grad(f_rows, (0, 1))(Tensor(h), token)
    _, dh_np, dw_np = _numpy_ce_and_grads(h.reshape(-1, D), w, t.reshape(-1), coef.reshape(-1))
    assert float(loss_r.asnumpy()) == pytest.approx(float(loss_d.asnumpy()), rel=1e-6)
    np.testing.assert_allclose(dh_r.asnumpy(), dh_d.asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dh_r.asnumpy().reshape(-1, D), dh_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(acc.asnumpy(), dw_d.asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc.asnumpy(), dw_np, rtol=1e-4, atol=1e-5)
    assert np.abs(dw_np).max() > 1e-2


def _two_steps(model, st, cfg, rows):
    """Two TrainStep steps of `model` (`rows`: the tables row-wise): (losses, grad norms, {accumulator: its
    gradient after step 1, read before the update}, {parameter: value after step 2}, the engine)."""
    eng = TrainStep(model, select_trainable(model, [""]), model.INPUT_NAMES, st.loss, st, row_grads=rows)
    first, apply = {}, eng.apply

    def keep_then_apply(loss_sum, lr):
        if not first:
            first.update({a.name: a.asnumpy().copy() for a in eng.accum})
        return apply(loss_sum, lr)

    eng.apply = keep_then_apply
    res = [eng.run([build_model_inputs(_batch(s), cfg)], 1e-2) for s in range(2)]
    return ([r.loss for r in res], [r.grad_norm for r in res], first,
            {p.name: p.asnumpy() for p in model.get_parameters()}, eng)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_train_step_with_row_grads_equals_plain_autodiff(tied, monkeypatch):
    """Two steps of the tiny MindVL (one ViT block: the tables are the language model's), from one
    initialisation, three ways: plain autodiff, the tables (untied: embedding and head; tied: one table fed by
    both) row-wise on the head's composite ops, and row-wise with the head's C++ kernels (loss_head.head_kernels).
    - Row-wise against plain autodiff (both on the composite head): losses and every parameter after 2 steps.
    - The kernels against the composite head: step 1's loss, gradient norm and every accumulated gradient agree
      to float32 rounding. Not bitwise (the kernels sum in another order), and not compared after the updates:
      AdamW's first steps magnify those ulps in parameters whose gradient is near 0."""
    ms.set_context(mode=ms.GRAPH_MODE)
    spec = dict(MODEL, vision=dict(MODEL["vision"], depth=1, fullatt_block_indexes=[0]),
                text=dict(MODEL["text"], tie_word_embeddings=tied))
    cfg = load(MindVLConfig, spec, "test")
    st = load(StageConfig, {"name": "s", "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 2,
                            "max_steps": 2, "max_lr": 1e-2, "loss": {"logits_chunk_tokens": 5}})
    ms.set_seed(0)
    first = MindVLModel(cfg)
    init = {p.name: p.asnumpy().copy() for p in first.get_parameters()}
    tables = ["model.embed_tokens.weight"] if tied else ["lm_head.weight", "model.embed_tokens.weight"]
    out = {}
    for arm, rows, kernel in (("plain", False, False), ("rows", True, False), ("kernel", True, True)):
        model = first if arm == "plain" else MindVLModel(cfg)
        for p in model.get_parameters():
            p.set_data(Tensor(init[p.name]))
        with monkeypatch.context() as m:
            if not kernel:
                m.setattr(loss_head, "head_kernels", lambda: None)
            *out[arm], eng = _two_steps(model, st, cfg, rows)
        assert eng.row_grad_tables == (tables if rows else [])
        assert all(p.name not in eng.row_grad_tables for p in eng.micro.weights)  # not differentiated
        assert eng.micro.forward.head.blocks.kernel == kernel
    (pl_loss, _, _, pl_params), (rw_loss, rw_norm, rw_grads, rw_params) = out["plain"], out["rows"]
    np.testing.assert_allclose(rw_loss, pl_loss, rtol=1e-5)
    for name, value in pl_params.items():
        np.testing.assert_allclose(rw_params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    for name in tables:  # the tables did train
        assert not np.array_equal(rw_params[name], init[name])
    k_loss, k_norm, k_grads, _ = out["kernel"]
    assert k_loss[0] == pytest.approx(rw_loss[0], rel=1e-6)
    assert k_norm[0] == pytest.approx(rw_norm[0], rel=1e-5)
    head = "accum.model.embed_tokens.weight" if tied else "accum.lm_head.weight"
    assert sorted(k_grads) == sorted(rw_grads) and np.abs(k_grads[head]).max() > 1e-3
    for name, g in rw_grads.items():
        np.testing.assert_allclose(k_grads[name], g, rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name)


def test_row_grads_without_the_sparse_head_are_refused():
    """Only the sparse head's cells add rows into accumulators: a dense-logits forward given row-wise tables
    would differentiate nothing for them, so it raises instead of dropping their gradients."""
    cfg = load(MindVLConfig, MODEL, "test")
    model = MindVLModel(cfg)
    acc = Parameter(Tensor(np.zeros((V, D), np.float32)), name="acc", requires_grad=False)
    with pytest.raises(ValueError, match="sparse head.*model.embed_tokens.weight"):
        ForwardLoss(model, None, len(model.INPUT_NAMES), 0, sparse=False,
                    row_grads={"model.embed_tokens.weight": acc})


def test_gradient_norm_sums_large_tables_in_row_blocks(monkeypatch):
    """GradNorm over a table longer than NORM_ROW_BLOCK (row blocks, the ragged last one included) and a
    small tensor (whole): the unscaled global norm numpy computes."""
    monkeypatch.setattr(optim, "NORM_ROW_BLOCK", 8)
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(3)
    big, small = rng.standard_normal((37, 5)).astype(np.float32), rng.standard_normal((6, 5)).astype(np.float32)
    accum = ParameterTuple([Parameter(Tensor(big), name="acc_big"), Parameter(Tensor(small), name="acc_small")])
    got = float(optim.GradNorm(accum)(Tensor(0.25, ms.float32)).asnumpy())
    ref = 0.25 * np.sqrt((big.astype(np.float64) ** 2).sum() + (small.astype(np.float64) ** 2).sum())
    assert got == pytest.approx(ref, rel=1e-6)


def test_kernel_gradient_norm_matches_numpy_and_grad_norm():
    """ReduceStep's norm with the SumSquares CPU kernel (one pass per accumulator: a 3-D tensor, a table, a
    vector, a 9-element tail after the 8-wide partial sums) is the unscaled global norm numpy computes in
    float64, and GradNorm's within float32 rounding."""
    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler to build the kernels")
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s).astype(np.float32) * k for s, k in
              (((3, 4, 5), 1.0), ((41, 7), 30.0), ((9,), 1e-3))]
    accum = ParameterTuple([Parameter(Tensor(a), name=f"acc{i}") for i, a in enumerate(arrays)])
    norm = step_cells.grad_norm(accum)
    assert isinstance(norm, step_cells.KernelGradNorm)
    got = float(norm(Tensor(0.25, ms.float32)).asnumpy())
    ref = np.sqrt(sum(((a * np.float32(0.25)).astype(np.float64) ** 2).sum() for a in arrays))
    assert got == pytest.approx(ref, rel=2e-7)
    assert got == pytest.approx(float(optim.GradNorm(accum)(Tensor(0.25, ms.float32)).asnumpy()), rel=1e-6)
    assert isinstance(step_cells.grad_norm(accum, kernel=False), optim.GradNorm)
