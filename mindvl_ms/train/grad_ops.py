"""Per-tensor gradient operations mapped over the accumulators with `ops.HyperMap` inside the step graphs.

- `accumulate(acc, g)`: add one gradient into its fp32 accumulator in place (the micro-steps:
  `train.step_cells.MicroStep`, the post-training step, and the pipeline micro-step, which receives it
  as an argument because it lives in `parallel/`).
- `allreduce_into(op, acc)`: replace an accumulator by `op(acc)` (the data-parallel AllReduce).
- `scale_into(k, acc)`: multiply an accumulator by `k` in place (the 1/dp of `gradients_mean`).
- `sum_squares_into(kernel, s, acc)`: sum((acc * s)^2) of one accumulator by the `SumSquares` CPU kernel
  (the global gradient norm, `train.step_cells.KernelGradNorm`).
"""
from __future__ import annotations

from mindspore import ops

accumulate = ops.MultitypeFuncGraph("accumulate")
allreduce_into = ops.MultitypeFuncGraph("allreduce_into")
scale_into = ops.MultitypeFuncGraph("scale_into")
sum_squares_into = ops.MultitypeFuncGraph("sum_squares_into")


@accumulate.register("Tensor", "Tensor")
def _accumulate_one(acc, g):
    if g.dtype != acc.dtype:  # resolved at compile time: no copy for float32 gradients
        g = g.astype(acc.dtype)
    return ops.assign_add(acc, g)


@allreduce_into.register("Function", "Tensor")
def _allreduce_into_one(op, acc):
    return ops.assign(acc, op(acc))


@scale_into.register("Tensor", "Tensor")
def _scale_into_one(k, acc):
    return ops.assign(acc, acc * k)


@sum_squares_into.register("Function", "Tensor", "Tensor")
def _sum_squares_one(kernel, s, acc):
    return kernel(acc, s)
