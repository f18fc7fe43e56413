"""Gradients of the two [V, D] tables (token embedding, LM head) added straight into their fp32
accumulators, a block of rows at a time, so no dense [V, D] gradient exists during the micro-step.

Why: with the Qwen3 vocabulary (151,936 rows) each table's gradient is 297 MB at D = 512 (1.2 GB at
D = 2,048). Autodiff materialises it as a temporary (the embedding's Gather backward scatters into a
zero [V, D] tensor; the head's dW is a [V, D] MatMul output) before `MicroStep` adds it into the
accumulator, and those pool pages stay resident (the memory this saves: docs/PERFORMANCE.md, ## train).

How (graph side; standalone and data-parallel runs: `TrainStep` keeps plain autodiff under
semi/auto parallel and pipeline stages, where the accumulators are sharded by the compiler):
- The table is left out of the autodiff weight list. The cell that reads it (`RowGradEmbedding`
  for the lookup, `train.loss_head.ChunkedHeadCERowGrad` for the head) takes the accumulator and a one-element
  `token` Parameter as inputs; its custom bprop adds the table's gradient into the accumulator in
  place (`ops.scatter_add`: the looked-up rows; the head: `HEAD_ROW_BLOCK` rows of dW per MatMul)
  and returns the token's gradient, a zero that depends on those adds. The token *is* in the weight
  list, and `MicroStep` makes its output depend on the token's gradient, so the adds are neither
  pruned nor reordered after the step returns. For the table and the accumulator themselves the bprop
  returns a scalar (`NO_GRAD`): neither is differentiated.
- Cost: MindSpore's CPU `ScatterAdd` adds a row block slower than `AssignAdd` adds a whole tensor; with
  `ops/broadcast.py` the step was still faster than before (docs/PERFORMANCE.md, ## train). Where the C++
  head kernels load, the head adds its dW with `HeadGradInto` (ops/csrc/head_ce.cc, see train/loss_head.py)
  and `head_weight_grad_into` is its composite fallback.
- The added values are those autodiff would have added (`tests/train/test_row_grads.py` compares the
  accumulators with the plain path's, and with numpy for the lookup): only the order of the float
  additions differs.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

# the "gradient" returned for a table and its accumulator: never used (neither is differentiated); a
# scalar, because a zeros_like([V, D]) is folded into a table-sized constant at compile time
NO_GRAD = Tensor(0.0, ms.float32)
HEAD_ROW_BLOCK = 16384  # rows of the head's dW per MatMul (a 32 MB fp32 block at D = 512)


def row_grad_token() -> Parameter:
    """The one-element Parameter whose (zero) gradient carries the in-place adds' dependency."""
    return Parameter(Tensor(np.zeros((1,), np.float32)), name="row_grad_token", requires_grad=True)


def add_rows(acc, ids, rows):
    """acc[ids[i]] += rows[i] in place (repeated ids add up); rows cast to the accumulator's dtype."""
    if rows.dtype != acc.dtype:
        rows = rows.astype(acc.dtype)
    return ops.scatter_add(acc, ids, rows)


class _LookupWithRowGrad(nn.Cell):
    """construct(ids [B, L], weight [V, D], acc [V, D], token [1]) -> weight[ids] [B, L, D]; the backward adds
    dout's rows into acc at ids (no [V, D] gradient)."""

    def construct(self, ids, weight, acc, token):
        return ops.gather(weight, ids, 0)

    def bprop(self, ids, weight, acc, token, out, dout):
        d = dout.shape[-1]
        done = add_rows(acc, ids.reshape(-1), dout.reshape(-1, d))
        return (ops.zeros_like(ids), NO_GRAD, NO_GRAD,
                ops.depend(ops.zeros_like(token), done))


class RowGradEmbedding(nn.Cell):
    """Stands in for a model's token embedding cell (same table Parameter, same output) during training."""

    def __init__(self, table: Parameter, acc: Parameter, token: Parameter):
        super().__init__(auto_prefix=False)  # the table keeps its model name
        self.weight, self.acc, self.token = table, acc, token
        self.lookup = _LookupWithRowGrad()

    def construct(self, ids):  # [B, L] -> [B, L, D]
        return self.lookup(ids, self.weight, self.acc, self.token)


_MM_TN = ops.MatMul(transpose_a=True)  # [c, rows]^T x [c, D] -> [rows, D] (no Transpose kernel)


def head_weight_grad_into(acc, g, hs):
    """acc += g^T @ hs in blocks of `HEAD_ROW_BLOCK` rows. g [c, V] (softmax - onehot), hs [c, D] ->
    the head's dW contribution; each block's [rows, D] product is added into acc's rows in place.
    Returns the tuple of adds (for `ops.depend`)."""
    v = g.shape[1]
    done = ()
    for start in range(0, v, HEAD_ROW_BLOCK):
        stop = min(start + HEAD_ROW_BLOCK, v)
        block = _MM_TN(g[:, start:stop], hs)  # [rows, D]
        done += (add_rows(acc, ops.arange(start, stop, dtype=ms.int32), block),)
    return done
