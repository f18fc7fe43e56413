"""Pipeline-parallel micro-batching of the train step (Ascend only): `parallel_config.pipeline_stage > 1`.

Nothing here imports the training code (train/ sits above parallel/): the forward-loss Cell and the
per-tensor gradient add come in as arguments (`train.train_step.TrainStep` passes
`train.forward_loss.ForwardLoss` and `train.grad_ops.accumulate`).

MindSpore's pipeline parallel needs the micro-batches of a pipeline round inside one graph call, so the
stages can overlap them: `nn.PipelineCell(net, micro_batch_num)` slices each input along axis 0 into
micro_batch_num parts, runs the network on each and adds the results (its `Add`s carry the
`pipeline_end` marks the pipeline pass schedules by). `PipelineMicroStep` therefore replaces
the train step's `MicroStep`:
  - a rank is given global_batch / dp rows, i.e. n = global_batch / (dp x micro_batch_size)
    micro-batches per optimizer step (1024 / 8 = 128 at the 671B layout), and one graph call takes
    micro_batch_num of them (32). `pipeline_feeds` splits the n micro-batches into n / micro_batch_num
    rounds and stacks each round on a new axis 0; the step runs every round, each adding its
    gradients into the same accumulators, so the whole rank batch is consumed before the one update
    (n must be a multiple of micro_batch_num; micro-batches must have equal shapes, so pixel arrays
    need a fixed visual budget per micro-batch). The three scalars (token_norm, num_samples, loss
    scale) are broadcast to [micro_batch_num] inside the graph;
  - each slice runs `ForwardLoss` (same loss share as the micro-batch loop, so the summed loss and
    gradient equal the loop's) and returns one vector [1 + moe layers x E]: its loss share, then its
    expert load (gradient stopped). PipelineCell's adds sum both over the round, so the step returns
    the round's loss and its expert load [moe layers, E] (one row per MoE layer, `expert_load_shape`),
    which the aux-loss-free bias update consumes as in the micro-batch loop. Like the loss, the load is
    an output of the last stage;
  - under semi/auto parallel with pipeline stages set, the gradients go through
    `nn.PipelineGradReducer` (MindSpore's pipeline gradient accumulation, aware of optimizer sharding)
    before they are added to the step's accumulators; in stand-alone mode (CPU tests) it is not built.
What runs here on CPU: construction, the micro-batch arithmetic, and the stand-alone execution of the
PipelineCell (equal to the micro-batch loop, expert load included); the pipeline schedule itself needs
Ascend and `pipeline_stages` in the auto-parallel context (set by `parallel.runtime.setup`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, nn, ops

from mindvl_ms.parallel.pipeline import LANGUAGE_MODEL


def pipeline_feeds(arrays: List[List[np.ndarray]], micro_batch_num: int) -> List[List[np.ndarray]]:
    """The rank's n micro-batches (each a list of input arrays) -> n / micro_batch_num graph feeds, each a
    list of [micro_batch_num, ...] arrays (consecutive micro-batches stacked)."""
    if not arrays or len(arrays) % micro_batch_num:
        raise ValueError(f"pipeline: {len(arrays)} micro-batches per step on this rank is not a multiple of "
                         f"parallel_config.micro_batch_num {micro_batch_num}; global_batch_size / "
                         f"(data_parallel x micro_batch_size) must be a multiple of micro_batch_num")
    for i in range(len(arrays[0])):
        shapes = {a[i].shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"pipeline: input {i} has different shapes across micro-batches {sorted(shapes)}; "
                             f"pipeline micro-batches must have equal shapes (pad rows to seq_length and images "
                             f"to a fixed visual budget per micro-batch)")
    rounds = [arrays[r:r + micro_batch_num] for r in range(0, len(arrays), micro_batch_num)]
    return [[np.stack([a[i] for a in part]) for i in range(len(part[0]))] for part in rounds]


def expert_load_shape(model: nn.Cell) -> Tuple[int, int]:
    """[MoE layers, routed experts] of the model's expert load; [1, 1] for a dense language model (the
    zeros `ForwardLoss` returns then)."""
    lm = getattr(getattr(model, "_backbone", model), LANGUAGE_MODEL, None)  # AMP wraps the model
    routers = lm.routers() if hasattr(lm, "routers") else []
    return (len(routers), int(routers[0].num_experts)) if routers else (1, 1)


class _SliceLoss(nn.Cell):
    """One PipelineCell slice: inputs [1, ...] -> ForwardLoss on [...] -> [1 + moe layers x E]: the scaled
    loss share, then the expert load (no gradient), so PipelineCell's sum adds both over the round."""

    def __init__(self, forward: nn.Cell):
        super().__init__(auto_prefix=False)
        self.forward = forward

    def construct(self, *args):
        inner = [a[0] for a in args]
        loss, load = self.forward(*inner)
        return ops.concat((loss.reshape(1), ops.stop_gradient(load).reshape(-1)))


class PipelineMicroStep(nn.Cell):
    """construct(*stacked inputs [k, ...], token_norm [], num_samples [], scale []) -> (loss share sum [],
    expert load [moe layers, E] summed over the k micro-batches; [1, 1] zeros for a dense model).

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
        self.grad_fn = ops.value_and_grad(self.pipe, None, self.weights)  # d(sum of outputs) = d(loss share)
        self.load_shape = expert_load_shape(getattr(forward, "model", forward))
        mode = ms.get_auto_parallel_context("parallel_mode")
        self.reducer = None
        if mode in ("semi_auto_parallel", "auto_parallel") and ms.get_auto_parallel_context("pipeline_stages") > 1:
            self.reducer = nn.PipelineGradReducer(self.weights)

    def construct(self, *args):
        k = self.micro_batch_num
        scalars = [ops.broadcast_to(s.reshape(1), (k,)) for s in args[-3:]]  # [k] each: sliced with the rest
        out, grads = self.grad_fn(*args[:-3], *scalars)  # out [1 + moe layers x E]
        if self.reducer is not None:
            grads = self.reducer(grads)
        done = self.hyper_map(self.acc, self.accum, grads)
        return ops.depend(out[0] / args[-1], done), out[1:].reshape(self.load_shape)
