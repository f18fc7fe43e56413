"""The gradient graphs of the train step, each compiled once per stage (or once for consecutive stages that
fit them, `train_step.TrainStep.restart`).

- `MicroStep`: forward + backward of one micro-batch through a forward-loss Cell (`ForwardLoss`, or the
  post-training `PolicyForward`); the gradients of the trainable parameters only (frozen ones are not in
  the weight list, so autodiff makes no gradient for them) are added into fp32 accumulators. No
  communication here.
- `ReduceStep`: once per global batch: all-reduce (sum, in place) of the accumulated gradients and the
  loss across data-parallel ranks (the single gradient synchronisation of openPangu-VL's asynchronous
  accumulation), divided by dp when `parallel.gradients_mean`, and the global gradient norm (`grad_norm`:
  one C++ pass per accumulator on CPU, `optim.GradNorm` otherwise).
"""
from __future__ import annotations

from typing import Sequence

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend
from mindvl_ms.train.grad_ops import accumulate, allreduce_into, scale_into, sum_squares_into
from mindvl_ms.train.optim import GradNorm


class MicroStep(nn.Cell):
    """Forward + backward of one micro-batch; gradients (scaled) are added to the accumulators.

    Tables with row-wise gradients (`forward.row_tables`, with `forward.token`) are not differentiated:
    their accumulators are written by the forward's own bprops, and the output depends on the token's
    gradient, which depends on those writes. Forwards without the attribute (`PolicyForward`) have none."""

    def __init__(self, forward: nn.Cell, params: Sequence[Parameter], accum: ParameterTuple):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.forward = forward
        rows = getattr(forward, "row_tables", frozenset())
        pairs = [(p, a) for p, a in zip(params, accum) if p.name not in rows]
        self.rows = bool(rows)
        token = [forward.token] if self.rows else []
        self.weights = ParameterTuple([p for p, _ in pairs] + token)
        self.accum = ParameterTuple([a for _, a in pairs])
        self.hyper_map = ops.HyperMap()
        self.grad_fn = ops.value_and_grad(self.forward, None, self.weights, has_aux=True)

    def construct(self, *args):
        (scaled, load), grads = self.grad_fn(*args)
        if self.rows:  # the last gradient is the token's: it orders the row-wise adds before the output
            done = (self.hyper_map(accumulate, self.accum, grads[:-1]), grads[-1])
        else:
            done = self.hyper_map(accumulate, self.accum, grads)
        return ops.depend(scaled / args[-1], done), load


class KernelGradNorm(nn.Cell):
    """`optim.GradNorm`'s value with the `SumSquares` CPU kernel (ops/csrc/sum_squares.cc): construct(inv_scale
    []) -> sqrt(sum over accumulators of sum((acc * inv_scale)^2)). One pass over each accumulator where
    GradNorm runs Mul, Square and two ReduceSum kernels per row block with their temporaries; the [V, D]
    tables made the gradient norm the step's third cost on CPU (docs/PERFORMANCE.md, ## bench). The sums
    are kept in double, so the norm may differ from GradNorm's float32 one in the last bits."""

    def __init__(self, accum: ParameterTuple, kernel):
        super().__init__(auto_prefix=False)
        self.accum = accum
        self.kernel = kernel
        self.hyper_map = ops.HyperMap()

    def construct(self, inv_scale):
        sums = self.hyper_map(ops.partial(sum_squares_into, self.kernel, inv_scale), self.accum)  # [1] each
        return ops.sqrt(ops.addn(sums)).reshape(())


def grad_norm(accum: ParameterTuple, kernel: bool = True) -> nn.Cell:
    """The global gradient norm cell: `KernelGradNorm` when `kernel` and the CPU kernel library is available
    (not on Ascend, not under a compiler-sharded layout, where the kernel has no strategy), else GradNorm."""
    op = custom_op("SumSquares", 2) if kernel and not is_ascend() else None
    return GradNorm(accum) if op is None else KernelGradNorm(accum, op)


class ReduceStep(nn.Cell):
    """Once per global batch: reduce the accumulators (in place) and the loss over data-parallel ranks, then
    measure the global gradient norm. construct(loss_sum [1], inv_scale []) -> (global loss [1], grad norm []).

    - explicit (data parallel, `parallel_mode` 0/3): an AllReduce sum here; with `gradients_mean` the
      reduced gradients are then divided by dp (the default, sum, gives the single-process gradient of
      the global batch because every loss share is normalised by global counts). The reported loss is
      the global loss either way.
    - not explicit (semi/auto parallel, `parallel_mode` 1/2): the compiler already inserts the gradient
      reduction (honouring `gradients_mean` from the auto-parallel context) and the loss is a global-view
      value, so nothing is reduced here: an AllReduce here would double it.
    `allreduce` replaces the collective (tests stand in for it on one process)."""

    def __init__(self, accum: ParameterTuple, dp: int, mean: bool = False, explicit: bool = True,
                 allreduce=None):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.accum = accum
        self.reduce = bool(explicit) and dp > 1
        self.mean = self.reduce and bool(mean)
        self.inv_dp = Tensor(1.0 / dp, ms.float32)
        self.norm = grad_norm(accum, kernel=bool(explicit))
        self.hyper_map = ops.HyperMap()
        if self.reduce:
            self.allreduce = allreduce if allreduce is not None else ops.AllReduce()

    def construct(self, loss_sum, inv_scale):
        if self.reduce:
            done = self.hyper_map(ops.partial(allreduce_into, self.allreduce), self.accum)
            if self.mean:
                done = ops.depend(self.hyper_map(ops.partial(scale_into, self.inv_dp), self.accum), done)
            loss_sum = ops.depend(self.allreduce(loss_sum), done)
        return loss_sum, self.norm(ops.depend(inv_scale, loss_sum))
