"""The compiled train step: forward + loss + gradients + accumulation, then all-reduce + unscale +
finite check + clipping + AdamW + loss-scale update.

Graphs (each compiled once per stage; dynamic shapes via `set_inputs`, recompiles are counted):
- `MicroStep`: forward, loss share, gradients of the trainable parameters only (frozen ones are
  not in the weight list, so autodiff produces no gradient for them), added into fp32
  accumulators. No communication here.
- `ApplyStep`: once per global batch: all-reduce of the accumulated gradients and loss across
  data-parallel ranks (the single gradient synchronisation of openPangu-VL's asynchronous
  accumulation), unscale, finite check, global-norm clip, AdamW with per-parameter LR
  coefficients, zero the accumulators, dynamic loss-scale update. A non-finite loss/gradient
  leaves every parameter and moment bit-identical (masked update) and is reported.
- `WeightSumStep` (balanced loss only, when the global batch is split): a forward-only pre-pass
  that measures the global sum of token weights so each micro-batch's share is exact.

`TrainStep` is the host-side driver: it feeds numpy micro-batches, computes the global counts
(all-reduced across ranks) and returns plain floats.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from .loss import IGNORE, TrainLoss
from .optim import AdamWUpdate, _finite, _scale, zeros_like_params

log = logging.getLogger(__name__)

_acc = ops.MultitypeFuncGraph("acc")


@_acc.register("Tensor", "Tensor")
def _acc_one(acc, g):
    return ops.assign_add(acc, g.astype(ms.float32))


class ForwardLoss(nn.Cell):
    """(*model_inputs, targets, token_index, token_norm, num_samples, scale) -> loss share * scale."""

    def __init__(self, model: nn.Cell, loss: TrainLoss, n_model: int, seg_pos: int):
        super().__init__()
        self.model, self.loss, self.n_model, self.seg_pos = model, loss, n_model, seg_pos

    def construct(self, *args):
        model_args = args[:self.n_model]
        logits = self.model(*model_args)                                   # [B, L, V]
        loss = self.loss(logits, args[self.n_model], model_args[self.seg_pos], args[self.n_model + 1],
                         args[self.n_model + 2], args[self.n_model + 3])
        return loss * args[self.n_model + 4]


class MicroStep(nn.Cell):
    """Forward + backward of one micro-batch; gradients (scaled) are added to the accumulators."""

    def __init__(self, forward: ForwardLoss, params: Sequence[Parameter], accum: ParameterTuple):
        super().__init__()
        self.forward = forward
        self.weights = ParameterTuple(params)
        self.accum = accum
        self.hyper_map = ops.HyperMap()
        self.grad_fn = ops.value_and_grad(self.forward, None, self.weights)

    def construct(self, *args):
        scaled, grads = self.grad_fn(*args)
        done = self.hyper_map(_acc, self.accum, grads)
        return ops.depend(scaled / args[-1], done)


class WeightSumStep(nn.Cell):
    """Forward only: the sum of balanced-loss token weights of one micro-batch."""

    def __init__(self, model: nn.Cell, loss: TrainLoss, n_model: int):
        super().__init__()
        self.model, self.loss, self.n_model = model, loss, n_model

    def construct(self, *args):
        logits = self.model(*args[:self.n_model])
        return self.loss.weight_sum(logits, args[self.n_model], args[self.n_model + 1])


class ApplyStep(nn.Cell):
    """construct(loss_sum [1], lr [], clip []) -> (global loss [1], grad norm [], applied [], loss scale [])."""

    def __init__(self, accum: ParameterTuple, update: AdamWUpdate, scale: Parameter, good: Parameter,
                 dp: int, dynamic_scale: bool, factor: float, window: int):
        super().__init__()
        self.accum, self.update, self.scale, self.good = accum, update, scale, good
        self.dp, self.dynamic = dp, dynamic_scale
        self.factor, self.window = float(factor), int(window)
        self.hyper_map = ops.HyperMap()
        if dp > 1:
            self.allreduce = ops.AllReduce()

    def construct(self, loss_sum, lr, clip):
        grads = self.hyper_map(ops.partial(_scale, 1.0 / self.scale), self.accum)
        if self.dp > 1:
            grads = self.hyper_map(self.allreduce, grads)
            loss_sum = self.allreduce(loss_sum)
        finite = ops.logical_and(ops.stack(self.hyper_map(_finite, grads)).all(), ops.isfinite(loss_sum).all())
        norm, applied = self.update(grads, lr, finite, clip)
        if self.dynamic:
            good = self.good + 1
            grow = good >= self.window
            new_scale = ops.select(applied, ops.select(grow, self.scale * self.factor, self.scale),
                                   ops.maximum(self.scale / self.factor, 1.0))
            new_good = ops.select(applied, ops.select(grow, ops.zeros_like(good), good), ops.zeros_like(good))
            ops.assign(self.good, new_good)
            ops.assign(self.scale, new_scale)
        return loss_sum, norm, applied, self.scale


@dataclass
class StepResult:
    loss: float          # global-batch loss (before this step's update)
    grad_norm: float     # global gradient L2 norm (after unscaling, before clipping)
    applied: bool        # False: non-finite loss/gradient, update skipped
    loss_scale: float
    tokens: int          # non-padding tokens in this rank's micro-batches
    supervised: int      # supervised targets in the global batch
    patches: int         # vision patches on this rank


def _ms_dtype(a: np.ndarray):
    return {np.dtype(np.int32): ms.int32, np.dtype(np.int64): ms.int64, np.dtype(np.float32): ms.float32,
            np.dtype(np.float16): ms.float16, np.dtype(np.bool_): ms.bool_}[a.dtype]


class TrainStep:
    """Host driver for one stage: owns the accumulators, moments, loss scale and the compiled graphs."""

    def __init__(self, model: nn.Cell, params: List[Parameter], input_names: Sequence[str], loss_cfg,
                 stage, dp: int = 1, allreduce_host=None, precision: str = "float32",
                 loss_scale_value: float = 65536.0, loss_scale_factor: float = 2.0, loss_scale_window: int = 1000):
        self.input_names = list(input_names)
        if "segment_ids" not in self.input_names:
            raise ValueError(f"the model's INPUT_NAMES {self.input_names} must include segment_ids")
        n_model = len(self.input_names)
        self.loss = TrainLoss(loss_cfg.type, loss_cfg.lambda1, loss_cfg.lambda2, loss_cfg.tau1, loss_cfg.tau2)
        self.params = params
        self.accum = zeros_like_params(params, "accum")
        self.update = AdamWUpdate(params, self.accum, stage.lr_prefixes(), stage.weight_decay,
                                  stage.adam_beta1, stage.adam_beta2, stage.adam_eps)
        dynamic = precision == "float16"
        self.scale = Parameter(Tensor(loss_scale_value if dynamic else 1.0, ms.float32), name="loss_scale",
                               requires_grad=False)
        self.good = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps", requires_grad=False)
        fwd = ForwardLoss(model, self.loss, n_model, self.input_names.index("segment_ids"))
        self.micro = MicroStep(fwd, params, self.accum)
        self.apply = ApplyStep(self.accum, self.update, self.scale, self.good, dp, dynamic,
                               loss_scale_factor, loss_scale_window)
        self.weight_sum = WeightSumStep(model, self.loss, n_model)
        self.need_prepass_kind = loss_cfg.type == "balanced" and loss_cfg.lambda1 > 0
        self.dp, self.clip = dp, float(stage.grad_clip)
        self.allreduce_host = allreduce_host or (lambda x: x)
        self._shaped = False
        self.compiles = 0

    # -- state (for checkpoints) ---------------------------------------------------------------
    def state_parameters(self) -> Dict[str, Parameter]:
        """Optimizer/loss-scale state by name (moments, step, loss scale); accumulators are zero between steps."""
        out = {p.name: p for p in list(self.update.m) + list(self.update.v)}
        for p in (self.update.step, self.scale, self.good):
            out[p.name] = p
        return out

    # -- one optimizer step --------------------------------------------------------------------
    def _set_inputs(self, arrays: List[np.ndarray]) -> None:
        scalar = Tensor(shape=[], dtype=ms.float32)
        dyn = [Tensor(shape=[None] * a.ndim, dtype=_ms_dtype(a)) for a in arrays]
        self.micro.set_inputs(*dyn, scalar, scalar, scalar)
        self.weight_sum.set_inputs(*dyn)
        self._shaped = True

    def _micro_arrays(self, mb: Dict[str, np.ndarray]) -> List[np.ndarray]:
        missing = [k for k in self.input_names + ["targets", "token_index"] if k not in mb]
        if missing:
            raise KeyError(f"micro-batch lacks arrays {missing}; has {sorted(mb)}")
        return [np.ascontiguousarray(mb[k]) for k in self.input_names] + [
            mb["targets"].astype(np.int32), mb["token_index"].astype(np.int32)]

    def run(self, micro_batches: List[Dict[str, np.ndarray]], lr: float) -> StepResult:
        """Accumulate over this rank's micro-batches, then apply one update. Returns floats."""
        arrays = [self._micro_arrays(mb) for mb in micro_batches]
        if not self._shaped:
            self._set_inputs(arrays[0])
        sup, samples, toks, patches = 0, 0, 0, 0
        for mb in micro_batches:
            t, seg = mb["targets"], mb["segment_ids"]
            sup += int((t != IGNORE).sum())
            samples += int(np.unique(seg[(t != IGNORE) & (seg > 0)]).size)
            toks += int((seg > 0).sum())
            pv = mb.get("pixel_values")
            patches += 0 if pv is None else int(pv.shape[0])
        counts = self.allreduce_host(np.array([sup, samples], np.float32))
        g_sup, g_samples = float(counts[0]), float(counts[1])
        if self.loss.balanced:
            token_norm = -1.0
            if self.need_prepass_kind and (len(arrays) > 1 or self.dp > 1):
                w = sum(float(self.weight_sum(*[Tensor(a) for a in arr]).asnumpy()) for arr in arrays)
                token_norm = float(self.allreduce_host(np.array([w], np.float32))[0])
        else:
            token_norm = g_sup
        scalars = [Tensor(token_norm, ms.float32), Tensor(g_samples, ms.float32)]
        scale = Tensor(self.scale.asnumpy(), ms.float32)
        loss_sum = 0.0
        before = len(self.micro.compile_cache)
        for arr in arrays:
            loss_sum += float(self.micro(*[Tensor(a) for a in arr], *scalars, scale).asnumpy())
        after = len(self.micro.compile_cache)
        if after != before:
            self.compiles += after - before
            if before:
                log.warning("train step recompiled (%d graphs now): input ranks/dtypes changed", after)
        loss, norm, applied, new_scale = self.apply(Tensor([loss_sum], ms.float32), Tensor(lr, ms.float32),
                                                    Tensor(self.clip, ms.float32))
        return StepResult(float(loss.asnumpy()[0]), float(norm.asnumpy()), bool(applied.asnumpy()),
                          float(new_scale.asnumpy()), toks, int(g_sup), patches)
