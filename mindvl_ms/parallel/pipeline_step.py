"""Pipeline-parallel micro-batching of the train step (Ascend only): `parallel_config.pipeline_stage > 1`.

Nothing here imports the training code (train/ sits above parallel/): the forward-loss Cell and the
per-tensor gradient add come in as arguments (`train.train_step.TrainStep` passes
`train.forward_loss.ForwardLoss` and `train.grad_ops.accumulate`).

MindSpore's pipeline parallel needs every micro-batch of a rank inside one graph call, so the stages
can overlap them: `nn.PipelineCell(net, micro_batch_num)` slices each input along axis 0 into
micro_batch_num parts, runs the network on each and adds the results (its `Add`s carry the
`pipeline_end` marks the pipeline pass schedules by). `PipelineMicroStep` therefore replaces
the train step's `MicroStep`:
  - the host stacks the rank's micro-batches on a new axis 0 (`stack_micro_batches`; they must have
    equal shapes, so pixel arrays need a fixed visual budget per micro-batch), and the three scalars
    (token_norm, num_samples, loss scale) are broadcast to [micro_batch_num] inside the graph;
  - each slice runs `ForwardLoss` (same loss share as the micro-batch loop, so the summed loss and
    gradient equal the loop's);
  - under semi/auto parallel with pipeline stages set, the gradients go through
    `nn.PipelineGradReducer` (MindSpore's pipeline gradient accumulation, aware of optimizer sharding)
    before they are added to the step's accumulators; in stand-alone mode (CPU tests) it is not built.
What runs here on CPU: construction, the micro-batch count, and the stand-alone execution of the
PipelineCell (equal to the micro-batch loop); the pipeline schedule itself needs Ascend and
`pipeline_stages` in the auto-parallel context (set by `parallel.runtime.setup`). MoE expert load
is not collected through the pipeline cell (it returns zeros), so aux-loss-free bias updates need
pipeline_stage 1.
"""
from __future__ import annotations

from typing import List, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, nn, ops


def stack_micro_batches(arrays: List[List[np.ndarray]], micro_batch_num: int) -> List[np.ndarray]:
    """The rank's micro-batches (each a list of input arrays) -> one list of [micro_batch_num, ...] arrays."""
    if len(arrays) != micro_batch_num:
        raise ValueError(f"pipeline: {len(arrays)} micro-batches per step on this rank, but "
                         f"parallel_config.micro_batch_num is {micro_batch_num}; set global_batch_size = "
                         f"data_parallel x micro_batch_size x micro_batch_num")
    out = []
    for i in range(len(arrays[0])):
        shapes = {a[i].shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"pipeline: input {i} has different shapes across micro-batches {sorted(shapes)}; "
                             f"pipeline micro-batches must have equal shapes (pad rows to seq_length and images "
                             f"to a fixed visual budget per micro-batch)")
        out.append(np.stack([a[i] for a in arrays]))
    return out


class _SliceLoss(nn.Cell):
    """One PipelineCell slice: inputs [1, ...] -> ForwardLoss on [...] -> scaled loss share []."""

    def __init__(self, forward: nn.Cell):
        super().__init__(auto_prefix=False)
        self.forward = forward

    def construct(self, *args):
        inner = [a[0] for a in args]
        loss, _ = self.forward(*inner)
        return loss


class PipelineMicroStep(nn.Cell):
    """construct(*stacked inputs [k, ...], token_norm [], num_samples [], scale []) -> (loss share sum, load).

    `accumulate(acc, g)` is the per-tensor add of a gradient into its accumulator, mapped with HyperMap
    (the train step passes `train.grad_ops.accumulate`, the same add as its micro-batch loop)."""

    def __init__(self, forward: nn.Cell, params: Sequence[Parameter], accum: ParameterTuple, micro_batch_num: int,
                 accumulate: ops.MultitypeFuncGraph):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.micro_batch_num = int(micro_batch_num)
        self.pipe = nn.PipelineCell(_SliceLoss(forward), self.micro_batch_num)
        self.weights = ParameterTuple(params)
        self.accum = accum
        self.acc = accumulate
        self.hyper_map = ops.HyperMap()
        self.grad_fn = ops.value_and_grad(self.pipe, None, self.weights)
        mode = ms.get_auto_parallel_context("parallel_mode")
        self.reducer = None
        if mode in ("semi_auto_parallel", "auto_parallel") and ms.get_auto_parallel_context("pipeline_stages") > 1:
            self.reducer = nn.PipelineGradReducer(self.weights)

    def construct(self, *args):
        k = self.micro_batch_num
        scalars = [ops.broadcast_to(s.reshape(1), (k,)) for s in args[-3:]]  # [k] each: sliced with the rest
        loss, grads = self.grad_fn(*args[:-3], *scalars)
        if self.reducer is not None:
            grads = self.reducer(grads)
        done = self.hyper_map(self.acc, self.accum, grads)
        return ops.depend(loss / args[-1], done), ops.zeros((1, 1), ms.float32)
