"""The train step under semi/auto parallel: one compiled graph per optimizer step, built from MindFormers'
wrapper stack around this project's forward-loss Cell (`train.forward_loss.ForwardLoss`).

Stack (MindFormers 1.9 `mindformers.wrapper.wrapper`, imported on first use, see `_mindformers`):

    top cell        MFTrainOneStepCell            stand-alone, or one micro-batch per step
                    MFPipelineWithLossScaleCell   semi/auto parallel with accumulation or pipeline stages
      accumulation  GradAccumulationCellWithMultiOutputs(micro_batch_num)   pipeline_stage 1
                    PipelineCellWithMultiOutputs(micro_batch_num)           pipeline_stage > 1
        LossShare   ForwardLoss of one micro-batch -> its loss share (one output)
    optimizer       AdamWGrads: this project's fused AdamW (per-parameter LR coefficients, no decay on norms,
                    biases and 1-D tensors, bias correction folded into the kernel's scalars)

The host concatenates this rank's micro-batches along axis 0 (`concat_micro_batches`); the accumulation cell
cuts them apart again inside the graph (`_MicroBatch`: equal slices of axis 0), runs LossShare on each and
adds the shares, so forward, backward, accumulation, the gradient reduction, clipping, the finite check and
the update are one graph call with no host sync per micro-batch. Under semi/auto parallel the slicing tags
(`grad_accu_num` on GradAccumulationCell's slices, `pipeline_end` on PipelineCell's adds) let MindSpore
accumulate the micro-batch gradients into MFPipelineWithLossScaleCell's `accu_grads` (clones of the
parameters, so sharded like them) and reduce them over data parallel once per global batch; this is also
why MindFormers and MindSpore's own `build_train_network` pick the accumulating top cell whenever an
accumulation cell is present. In stand-alone mode nothing fills `accu_grads`, so MFTrainOneStepCell takes
the gradient of the unrolled sum directly (the CPU tests run this form).

Loss normalisation. Every share is already normalised by the global batch's counts (token_norm,
num_samples: computed on the host before the step, set as Parameters, as `TrainStep` passes them), so the
summed shares are the global loss and their gradient the global-batch gradient. MFPipelineWithLossScaleCell
scales its sensitivity by 1 / micro_batch_num (MindFormers' shares are per-micro-batch means); LossShare
then returns micro_batch_num x share, and the reported loss is divided back.

Global norm and finite check (the cells do this, not this module): MindFormers' `ClipGradNorm` sums the
squares of the (reduced) gradients per tensor and tags that ExpandDims with the `grad_scale` attribute
(its source: "needed for enabling the parallel mode"), the mark by which MindSpore's parallel pass
completes the norm over model-parallel shards and pipeline stages, so every stage clips with one factor
(that pass is Ascend-only and not exercised on CPU). The overflow flag of
`TrainOneStepWithLossScaleCell.get_overflow_status` is all-reduced over the whole world group (a plain
`ops.AllReduce()` whenever the mode is not stand-alone), so every stage takes the same skip decision.

`TrainStep` (train/train_step.py) stays the step for CPU stand-alone and CPU msrun data parallel: the
semi/auto wrappers cannot compile on CPU ("Invalid backend: CPU"), MFTrainOneStepCell's overflow check is
Ascend-only (NPUGetFloatStatusV2), and the CPU data-parallel step needs its explicit AllReduce, row-wise
table gradients and dynamic shapes (packed micro-batches of different patch counts), which the
equal-slice accumulation cell cannot take.
"""
from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindvl_ms.parallel import mindformers_moe  # noqa: F401  (points MindFormers' log dir before its import)
from mindvl_ms.train.forward_loss import ForwardLoss, WeightSumStep, has_sparse_head
from mindvl_ms.train.loss import IGNORE, TrainLoss
from mindvl_ms.train.optim import AdamWUpdate
from mindvl_ms.train.train_step import StepResult, find_bias_updater, local_counts, step_arrays

log = logging.getLogger(__name__)

NO_CLIP_NORM = 1e30  # ClipGradNorm's max_norm when clipping is off: its factor rounds to exactly 1.0


def _mindformers() -> SimpleNamespace:
    """MindFormers' wrapper classes, imported on first use: importing MindFormers is slow and writes a log
    directory (parallel/mindformers_moe.py), and only semi/auto parallel runs and their CPU test need them."""
    mod = importlib.import_module("mindformers.wrapper.wrapper")
    return SimpleNamespace(**{k: getattr(mod, k) for k in (
        "MFTrainOneStepCell", "MFPipelineWithLossScaleCell", "GradAccumulationCellWithMultiOutputs",
        "PipelineCellWithMultiOutputs")})


def micro_batch_num(global_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches per rank per optimizer step: global_batch_size / (dp x micro_batch_size); raises when it
    does not divide (the accumulation cell slices axis 0 into exactly this many equal parts)."""
    per_rank, rem = divmod(int(global_batch_size), int(dp))
    if rem or per_rank % int(micro_batch_size) or per_rank == 0:
        raise ValueError(f"global_batch_size {global_batch_size} is not data_parallel ({dp}) x "
                         f"micro_batch_size ({micro_batch_size}) x micro_batch_num")
    return per_rank // int(micro_batch_size)


def head_slots(micro_batches: Sequence[Dict[str, np.ndarray]], fixed: Optional[int] = None) -> int:
    """Supervised slots per row of the loss head's chunk grid, one for all of a step's micro-batches (they are
    joined into one feed): `fixed` (the stage's seq_length: no row supervises more, and semi/auto parallel's
    static graph needs one shape at every step), else the most supervised positions of a micro-batch."""
    if fixed is not None:
        return int(fixed)
    return max(int((mb["targets"] != IGNORE).sum()) for mb in micro_batches)


def semi_auto_mode() -> bool:
    """True when MindSpore's parallel mode is semi_auto_parallel or auto_parallel."""
    return ms.get_auto_parallel_context("parallel_mode") in ("semi_auto_parallel", "auto_parallel")


def concat_micro_batches(arrays: List[List[np.ndarray]]) -> List[np.ndarray]:
    """The rank's micro-batches (each a list of input arrays) -> one list, each input concatenated along
    axis 0; the accumulation cell's equal slices of axis 0 give back micro-batch i exactly, so every input
    must have the same shape in every micro-batch."""
    out = []
    for i in range(len(arrays[0])):
        shapes = {a[i].shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"input {i} has different shapes across micro-batches {sorted(shapes)}; the "
                             f"one-graph step needs equal shapes (pad rows to seq_length and images to a fixed "
                             f"visual budget per row)")
        out.append(np.ascontiguousarray(np.concatenate([a[i] for a in arrays], axis=0)))
    return out


def put(param: Parameter, value) -> None:
    """Write a host value into a Parameter the compiled step reads. An `ops.assign` (it writes the
    Parameter's device memory), not `set_data`: the wrappers call the optimizer inside a branch
    (`if not overflow`), and a graph reads a Parameter there from the memory it was compiled with, so a
    `set_data` (a new tensor object) is not seen by later calls (MindSpore 2.9, CPU)."""
    ops.assign(param, Tensor(np.asarray(value, np.float32).reshape(param.shape), ms.float32))


class LossShare(nn.Cell):
    """One micro-batch's inputs -> its loss share x `out_scale` (a single output, what MindFormers' wrappers
    differentiate). token_norm / num_samples are the global counts, set on the host before each step; the MoE
    expert load, when kept, is added into `load` (zeroed on the host before each step)."""

    def __init__(self, forward: ForwardLoss, out_scale: float = 1.0, load_shape: Optional[tuple] = None):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.forward = forward
        self.token_norm = Parameter(Tensor(1.0, ms.float32), name="mf_step.token_norm", requires_grad=False)
        self.num_samples = Parameter(Tensor(1.0, ms.float32), name="mf_step.num_samples", requires_grad=False)
        self.one = Tensor(1.0, ms.float32)
        self.out_scale = float(out_scale)
        self.keep_load = load_shape is not None
        self.load = Parameter(Tensor(np.zeros(load_shape or (1, 1), np.float32)), name="mf_step.expert_load",
                              requires_grad=False)

    def construct(self, *args):
        loss, load = self.forward(*args, self.token_norm, self.num_samples, self.one)
        if self.keep_load:
            loss = ops.depend(loss, ops.assign_add(self.load, load))
        if self.out_scale != 1.0:
            loss = loss * self.out_scale
        return loss


_adamw_grad = ops.MultitypeFuncGraph("adamw_grad")
_ADAMW_KERNEL = ops.AdamWeightDecay()


@_adamw_grad.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                      "Tensor", "Tensor", "Tensor", "Bool")
def _adamw_grad_one(lr, b1, b2, eps, wd, coef, wd_on, grad, param, m, v, mine):
    """One parameter: MindSpore's fused in-place AdamW from its (unscaled, clipped) gradient."""
    if mine:
        return _ADAMW_KERNEL(param, m, v, lr * coef, b1, b2, eps, wd * wd_on, grad)
    return param


class AdamWGrads(AdamWUpdate):
    """`AdamWUpdate` (same moments, names, LR coefficients, decay rule and bias correction) that takes the
    gradients as its argument, the optimizer call of MindFormers' wrappers. The bias-corrected lr, eps and
    weight decay of the coming step are Parameters the host sets before each step (`set_step`)."""

    def __init__(self, params: Sequence[Parameter], lr_coefs: Dict[str, float], weight_decay: float,
                 beta1: float, beta2: float, eps: float):
        super().__init__(params, None, lr_coefs, weight_decay, beta1, beta2, eps, kernel=False)
        self.lr_k, self.eps_k, self.wd_k = (Parameter(Tensor(0.0, ms.float32), name=f"adamw.{k}", requires_grad=False)
                                            for k in ("lr", "eps", "wd"))

    def set_step(self, lr: float) -> None:
        """Set the bias-corrected scalars of the next step (its number read from `step`)."""
        t = int(self.step.asnumpy()) + 1
        for p, x in zip((self.lr_k, self.eps_k, self.wd_k), self.bias_corrected(lr, t)):
            put(p, x)

    def construct(self, grads):
        done = self.hyper_map(ops.partial(_adamw_grad, self.lr_k, self.b1, self.b2, self.eps_k, self.wd_k),
                              self.coefs, self.wd_on, grads, self.params, self.m, self.v, self.optim_filter)
        if self.use_parallel:
            done = self.broadcast_params(done)
        inc = ops.assign(self.step, self.step + 1)
        return ops.depend(inc, done)


def build_wrapped_step(loss_share_for, optimizer: nn.Optimizer, k: int, pipeline_stages: int, clip: float,
                       scale_sense):
    """(top cell, out_scale): MindFormers' wrapper stack (module docstring). `loss_share_for(out_scale)`
    builds the LossShare. Stand-alone (the CPU tests), the accumulation or pipeline cell runs under
    MFTrainOneStepCell: MFPipelineWithLossScaleCell refuses a stand-alone context ("ParallelMode must be one
    of [SEMI_AUTO_PARALLEL, AUTO_PARALLEL]") and nothing would fill its `accu_grads` there."""
    mf = _mindformers()
    accumulating = (pipeline_stages > 1 or k > 1) and semi_auto_mode()
    out_scale = float(k) if accumulating else 1.0
    net = loss_share_for(out_scale)
    if pipeline_stages > 1:
        net = mf.PipelineCellWithMultiOutputs(net, k)
    elif k > 1:
        net = mf.GradAccumulationCellWithMultiOutputs(net, k)
    kw = dict(use_clip_grad=True, max_grad_norm=float(clip) if clip > 0 else NO_CLIP_NORM, scale_sense=scale_sense)
    if accumulating:
        return mf.MFPipelineWithLossScaleCell(net, optimizer, micro_batch_num=k, **kw), out_scale
    return mf.MFTrainOneStepCell(net, optimizer, **kw), out_scale


class MFStep:
    """The one-graph step for one stage, with `TrainStep`'s interface (`run`, `state_parameters`, `compiles`):
    the trainer uses it under semi/auto parallel."""

    def __init__(self, model: nn.Cell, params: List[Parameter], input_names: Sequence[str], loss_cfg, stage,
                 dp: int = 1, allreduce_host=None, precision: str = "float32", loss_scale_value: float = 65536.0,
                 loss_scale_factor: float = 2.0, loss_scale_window: int = 1000, pipeline_stages: int = 1):
        self.input_names = list(input_names)
        self.loss = TrainLoss(loss_cfg.type, loss_cfg.lambda1, loss_cfg.lambda2, loss_cfg.tau1, loss_cfg.tau2)
        self.chunk = int(getattr(loss_cfg, "logits_chunk_tokens", 1024))
        self.sparse = has_sparse_head(model)
        self.k = micro_batch_num(stage.global_batch_size, dp, stage.micro_batch_size)
        self.seq_length = int(stage.seq_length)
        self.dp = dp
        self.allreduce_host = allreduce_host or (lambda x: x)
        self.params = params
        self.opt = AdamWGrads(params, stage.lr_prefixes(), stage.weight_decay, stage.adam_beta1, stage.adam_beta2,
                              stage.adam_eps)
        fwd = ForwardLoss(model, self.loss, len(self.input_names), self.input_names.index("segment_ids"),
                          1.0 / (self.k * dp), sparse=self.sparse)
        self.bias_updater = find_bias_updater(model)
        load_shape = None
        if self.bias_updater is not None:
            load_shape = (len(self.bias_updater.biases), int(self.bias_updater.biases[0].shape[0]))
        self.share: Optional[LossShare] = None

        def share_for(out_scale):
            self.share = LossShare(fwd, out_scale, load_shape)
            return self.share

        scale = (nn.DynamicLossScaleUpdateCell(loss_scale_value, loss_scale_factor, loss_scale_window)
                 if precision == "float16" else Tensor(1.0, ms.float32))
        self.cell, self.out_scale = build_wrapped_step(share_for, self.opt, self.k, pipeline_stages,
                                                       float(stage.grad_clip), scale)
        # The wrapper's deepcopy of the optimizer's `learning_rate` carries its name; MindSpore resolves a
        # duplicate name at compile by renaming every Parameter to its path in the wrapper, so the model's
        # non-trainable ones (the MoE routing bias) would lose their checkpoint names.
        self.cell.learning_rate.name = "mf_step.learning_rate"
        self.cell.set_train(True)
        self.need_prepass = loss_cfg.type == "balanced" and loss_cfg.lambda1 > 0
        self.weight_sum = None
        if self.need_prepass:  # forward only, the same accumulation cell: the sum over the micro-batches
            self.weight_sum = _mindformers().GradAccumulationCellWithMultiOutputs(WeightSumStep(fwd), self.k)
        self.compiles = 0

    def state_parameters(self) -> Dict[str, Parameter]:
        """Moments, step and loss scale, under `TrainStep`'s names (checkpoints move between the two steps;
        inside the wrapper the optimizer's Parameters carry an `optimizer.` prefix)."""
        out = {}
        for p, m, v in zip(self.params, self.opt.m, self.opt.v):
            out[f"adam_m.{p.name}"], out[f"adam_v.{p.name}"] = m, v
        out["adam_step"] = self.opt.step
        out["loss_scale"] = self.cell.scale_sense
        return out

    def feed(self, micro_batches: List[Dict[str, np.ndarray]]) -> List[np.ndarray]:
        """This rank's micro-batches as the graph's inputs (concatenated along axis 0, one chunk grid)."""
        if len(micro_batches) != self.k:
            raise ValueError(f"{len(micro_batches)} micro-batches per step on this rank, but the step was "
                             f"built for micro_batch_num {self.k} (global_batch_size / (dp x micro_batch_size))")
        slots = head_slots(micro_batches, self.seq_length if semi_auto_mode() else None)
        return concat_micro_batches([step_arrays(mb, self.input_names, self.sparse, self.chunk, slots)
                                     for mb in micro_batches])

    def _token_norm(self, feed: List[Tensor], g_sup: float) -> float:
        """The loss's global token denominator (as `TrainStep._token_norm`); the balanced loss's weight sum
        comes from one forward-only graph over all micro-batches (global under semi/auto parallel)."""
        if not self.loss.balanced:
            return g_sup
        if self.need_prepass and (self.k > 1 or self.dp > 1):
            w = float(self.weight_sum(*feed).asnumpy())
            return w if semi_auto_mode() else float(self.allreduce_host(np.array([w], np.float32))[0])
        return -1.0

    def run(self, micro_batches: List[Dict[str, np.ndarray]], lr: float) -> StepResult:
        """One optimizer step over this rank's micro-batches: one graph call. Returns floats."""
        feed = [Tensor(a) for a in self.feed(micro_batches)]
        sup, samples, toks, patches = local_counts(micro_batches)
        counts = self.allreduce_host(np.array([sup, samples], np.float32))
        g_sup, g_samples = float(counts[0]), float(counts[1])
        put(self.share.token_norm, self._token_norm(feed, g_sup))
        put(self.share.num_samples, g_samples)
        if self.share.keep_load:
            put(self.share.load, np.zeros(self.share.load.shape, np.float32))
        self.opt.set_step(lr)
        before = len(self.cell.compile_cache)
        loss, overflow, scale, _, norm = self.cell(*feed)[:5]
        after = len(self.cell.compile_cache)
        if after != before:
            self.compiles += after - before
            if before:
                log.warning("one-graph train step recompiled (%d graphs now): input shapes changed", after)
        applied = not bool(overflow.asnumpy())
        expert_load = None
        if self.bias_updater is not None:
            expert_load = self.share.load.asnumpy().copy()  # asnumpy aliases the Parameter the next step zeroes
            if not semi_auto_mode():
                expert_load = self.allreduce_host(expert_load)
            if applied:
                self.bias_updater(Tensor(expert_load))
        return StepResult(float(np.asarray(loss.asnumpy()).reshape(-1)[0]) / self.out_scale,
                          float(np.asarray(norm.asnumpy()).reshape(-1)[0]), applied,
                          float(np.asarray(scale.asnumpy()).reshape(-1)[0]), toks, int(g_sup), patches, expert_load)
