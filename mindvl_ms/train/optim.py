"""AdamW for the compiled update graph: decay groups, per-module LR coefficients, global-norm
clipping, skippable updates.

Design:
- Parameters are selected by name prefix (`select_trainable`): frozen ones get
  `requires_grad=False` and never enter the gradient list, the accumulators or the moments, so
  no gradient memory exists for them and their values cannot change.
- No weight decay on norms, biases and any 1-D tensor (`decays`).
- Each parameter carries an LR coefficient from the longest matching prefix in
  `StageConfig.lr_coefficients` (e.g. `visual.` x0.1 in openPangu-VL SFT); the projector
  `visual.merger.` matches before `visual.`.
- Accumulators and moments are clones of the parameters (`Parameter.clone(init="zeros")`), never host
  arrays: a clone of an abstract (`initializer`) parameter stays abstract until the graph allocates it
  on the device, so building the step adds no parameter-sized host memory, and the clone carries the
  parameter's identity (`param_info.cloned_obj`), by which MindSpore gives it the parameter's tensor-
  and optimizer-parallel layout. Figures: docs/PERFORMANCE.md, ## train. That list holds its clones
  alive, so a new step (the next training stage) replaces the clones of the same name (`zero_clone`)
  rather than keeping the previous step's state in memory; a stage that fits the previous step's graphs
  keeps its clones and zeroes them (`AdamWUpdate.restart`).
- `AdamWUpdate` runs MindSpore's fused in-place AdamWeightDecay kernel per parameter (bias correction
  folded into its scalar inputs), so the update holds no optimizer-sized temporaries. It is an
  `nn.Optimizer` with moments cloned from the parameters, so `parallel.enable_parallel_optimizer`
  can shard its states on Ascend (MindSpore's optimizer parallel). A step with a
  non-finite gradient never calls it (the host decides from `GradNorm`), so parameters and moments
  stay bit-identical.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer

from mindvl_ms.ops.cpu_kernels import custom_op
from mindvl_ms.ops.dispatch import is_ascend

NO_DECAY_KEYS = ("norm", "bias", "ln_", "layernorm")


def select_trainable(model: nn.Cell, prefixes: Sequence[str]) -> List[Parameter]:
    """Mark parameters whose name starts with any prefix trainable, freeze the rest; return the trainable."""
    params = list(model.get_parameters())
    buffers = getattr(model, "_mindvl_buffers", None)
    if buffers is None:  # parameters that never train (e.g. the MoE routing bias): remembered on first call
        buffers = {p.name for p in params if not p.requires_grad}
        object.__setattr__(model, "_mindvl_buffers", buffers)
    trainable = []
    for p in params:
        on = any(p.name.startswith(pre) for pre in prefixes) and p.name not in buffers
        p.requires_grad = on
        if on:
            trainable.append(p)
    if not trainable:
        names = sorted({p.name.split(".")[0] + "." for p in params})
        raise ValueError(f"trainable prefixes {list(prefixes)} match no parameter; top-level names: {names}")
    return trainable


def decays(p: Parameter) -> bool:
    """True when weight decay applies (matrices/embeddings; not norms, biases or 1-D tensors)."""
    name = p.name.lower()
    return len(p.shape) > 1 and not any(k in name for k in NO_DECAY_KEYS)


def lr_coefficient(name: str, coefs: Dict[str, float]) -> float:
    """LR multiplier of a parameter: the longest matching prefix wins (default 1.0)."""
    best, val = -1, 1.0
    for pre, c in coefs.items():
        if name.startswith(pre) and len(pre) > best:
            best, val = len(pre), float(c)
    return val


def zero_clone(p: Parameter, prefix: str) -> Parameter:
    """A lazy zero clone `<prefix>.<param name>` of `p` (same shape, dtype and layout; not trainable). An
    earlier clone of that name (a previous step's state) leaves `p`'s clone list, which would keep it alive."""
    name = f"{prefix}.{p.name}"
    info = p.param_info
    if getattr(info, "cloned_obj", None):
        info.cloned_obj = [c for c in info.cloned_obj if c.name != name]
        p.param_info = info
    x = p.clone(init="zeros")
    x.name = name
    x.requires_grad = False
    return x


def zeros_like_params(params: Sequence[Parameter], prefix: str) -> ParameterTuple:
    """fp32 zero accumulators `<prefix>.<param name>`, one per parameter, cloned from it (`zero_clone`).
    A parameter that is not float32 (none under the trainer: AMP O2 keeps float32 master weights) gets a
    lazy float32 `initializer` tensor instead, since a clone keeps its parameter's dtype."""
    return ParameterTuple(zero_clone(p, prefix) if p.dtype == ms.float32 else
                          Parameter(initializer("zeros", p.shape, ms.float32), name=f"{prefix}.{p.name}",
                                    requires_grad=False) for p in params)


_adamw = ops.MultitypeFuncGraph("adamw")


_adamw_kernel = ops.AdamWeightDecay()
_inplace_sub = ops.ApplyGradientDescent()  # var -= alpha * delta, written into var


@_adamw.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                 "Tensor", "Tensor", "Tensor", "Tensor", "Bool")
def _adamw_one(mult, lr, b1, b2, eps, wd, coef, wd_on, acc, param, m, v, mine):
    """One parameter: the accumulated gradient scaled into its accumulator (acc = acc * mult), fused
    in-place AdamW reading it, then the accumulator zeroed in place (acc -= 1 * acc: exact, it is finite
    whenever the update runs). Measured on a [151936, 512] parameter: passing `acc * mult` to the kernel
    and `assign(acc, zeros_like(acc))` held three parameter-sized temporaries, this holds one.
    `mine` False (parallel optimizer in data-parallel mode: another rank owns it): only the zeroing."""
    one = ops.ones_like(mult)
    if mine:
        scaled = ops.assign(acc, acc * mult)
        done = _adamw_kernel(param, m, v, lr * coef, b1, b2, eps, wd * wd_on, ops.depend(acc, scaled))
        return _inplace_sub(acc, one, ops.depend(acc, done))
    return _inplace_sub(acc, one, acc)


@_adamw.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                 "Tensor", "Tensor", "Tensor", "Tensor", "Bool")
def _adamw_fused(kernel, mult, lr, b1, b2, eps, wd, coef, wd_on, acc, param, m, v, mine):
    """One parameter by the `FusedAdamW` CPU kernel (ops/csrc/fused_adamw.cc): the same scaling, AdamW and
    zeroing as `_adamw_one`, bitwise, in one pass over parameter, moments and accumulator instead of four
    kernels (docs/PERFORMANCE.md, ## train). Returns the kernel's [1] zero. `mine` False (another rank owns
    the parameter, `optim_filter`): only the zeroing, as in `_adamw_one`."""
    if mine:
        return kernel(param, m, v, acc, mult, lr, coef, b1, b2, eps, wd, wd_on)
    return _inplace_sub(acc, ops.ones_like(mult), acc)


_sq = ops.MultitypeFuncGraph("sq")
_REDUCE_SUM = ops.ReduceSum()


NORM_ROW_BLOCK = 16384  # rows per block of the squared-sum of a large table (32 MB at D = 512)


@_sq.register("Tensor", "Tensor")
def _sq_one(s, g):
    """sum((g * s)^2) of one accumulator. Rows first: a single full reduction of the [V, D] embedding is
    much slower on CPU. Tables of more than `NORM_ROW_BLOCK` rows go in row blocks, so no table-sized
    temporary is made (whole, g * s and its square are two [V, D] temporaries). Figures:
    docs/PERFORMANCE.md, ## train."""
    if g.ndim < 2 or g.shape[0] <= NORM_ROW_BLOCK:
        sq = ops.square(g.astype(ms.float32) * s)
        if sq.ndim >= 2:
            sq = _REDUCE_SUM(sq, -1)
        return _REDUCE_SUM(sq)
    total = ops.zeros((), ms.float32)
    for start in range(0, g.shape[0], NORM_ROW_BLOCK):
        blk = g[start:min(start + NORM_ROW_BLOCK, g.shape[0])].astype(ms.float32) * s
        total = total + _REDUCE_SUM(_REDUCE_SUM(blk * blk, -1))
    return total


_zero = ops.MultitypeFuncGraph("zero")


@_zero.register("Tensor")
def _zero_one(acc):
    return ops.assign(acc, ops.zeros_like(acc))


class AdamWUpdate(nn.Optimizer):
    """Fused AdamW (MindSpore's in-place `AdamWeightDecay` kernel) over `params` from the accumulators.

    construct(mult [], lr [], eps [], wd []): grad = accum * mult (unscale x clip), then per parameter
    lr * coef_p and wd * (1 if it decays). The kernel has no bias correction, so the caller folds it in:
    lr = lr0 * sqrt(1 - b2^t) / (1 - b1^t), eps = eps0 * sqrt(1 - b2^t), wd = wd0 * (1 - b1^t) / sqrt(1 - b2^t)
    gives exactly  p -= lr0 * (m_hat / (sqrt(v_hat) + eps0) + wd0 * p)  (`bias_corrected`).
    Written in place, one parameter at a time, so the update needs no optimizer-sized temporaries. On CPU
    with `kernel` (stand-alone and data-parallel steps) each parameter's scaling, AdamW and zeroing is one
    `FusedAdamW` C++ kernel (ops/csrc/fused_adamw.cc, bitwise the same values; `_adamw_fused`); on Ascend,
    under a compiler-sharded layout or without the kernel library, MindSpore's kernels (`_adamw_one`).

    An `nn.Optimizer` subclass (declared `_support_parallel_optimizer`) with its moments cloned from the
    parameters (`zero_clone`, names `adam_m.<param>` / `adam_v.<param>`), which is what
    MindSpore's optimizer parallel (`parallel.enable_parallel_optimizer`) recognises to shard optimizer
    states: under semi/auto parallel the compiler splits the cloned states like their parameters; in
    data-parallel mode on Ascend the base class assigns each parameter to one rank (`optim_filter`),
    only that rank updates it and `broadcast_params` shares the result. Both are Ascend-only; on CPU
    every `optim_filter` entry is True and the update is the plain fused AdamW.
    """

    _support_parallel_optimizer = True

    def __init__(self, params: Sequence[Parameter], accum: ParameterTuple, lr_coefs: Dict[str, float],
                 weight_decay: float, beta1: float, beta2: float, eps: float, kernel: bool = True):
        super().__init__(0.0, list(params), 0.0)  # LR and decay come in per call (bias-corrected scalars)
        self.params = self._parameters
        self.kernel = custom_op("FusedAdamW", 12) if kernel and not is_ascend() and not self.use_parallel else None
        self.accum = accum
        self.m = ParameterTuple(zero_clone(p, "adam_m") for p in self._parameters)
        self.v = ParameterTuple(zero_clone(p, "adam_v") for p in self._parameters)
        self.step = Parameter(Tensor(0, ms.int32), name="adam_step", requires_grad=False)
        self.coefs = tuple(Tensor(lr_coefficient(p.name, lr_coefs), ms.float32) for p in params)
        self.wd_on = tuple(Tensor(1.0 if decays(p) else 0.0, ms.float32) for p in params)
        self.weight_decay_value, self.beta1, self.beta2, self.eps = weight_decay, beta1, beta2, eps
        self.b1, self.b2 = Tensor(beta1, ms.float32), Tensor(beta2, ms.float32)

    def restart(self, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
        """A fresh optimizer on these compiled graphs (the next stage's, `train_step.TrainStep.restart`):
        moments and step zeroed, the host-side weight decay and epsilon replaced. The betas are graph
        constants, so they must be the ones this update was built with."""
        if (float(beta1), float(beta2)) != (float(self.beta1), float(self.beta2)):
            raise ValueError(f"AdamWUpdate.restart: betas ({beta1}, {beta2}) differ from the compiled "
                             f"({self.beta1}, {self.beta2}); build a new update")
        for p in list(self.m) + list(self.v) + [self.step]:
            p.set_data(ops.zeros(p.shape, p.dtype))
        self.weight_decay_value, self.eps = weight_decay, eps

    def bias_corrected(self, lr: float, t: int):
        """(lr, eps, wd) for the kernel at optimizer step t (1-based), with bias correction folded in."""
        bc1, bc2 = 1.0 - self.beta1 ** t, math.sqrt(1.0 - self.beta2 ** t)
        return lr * bc2 / bc1, self.eps * bc2, self.weight_decay_value * bc1 / bc2

    def construct(self, mult, lr, eps, wd):
        if self.kernel is None:
            one = ops.partial(_adamw, mult, lr, self.b1, self.b2, eps, wd)
        else:
            one = ops.partial(_adamw, self.kernel, mult, lr, self.b1, self.b2, eps, wd)
        done = self.hyper_map(one, self.coefs, self.wd_on, self.accum, self.params, self.m, self.v, self.optim_filter)
        if self.use_parallel:
            done = self.broadcast_params(done)
        inc = ops.assign(self.step, self.step + 1)
        return ops.depend(mult, ops.depend(inc, done))


class GradNorm(nn.Cell):
    """construct(inv_scale []) -> global L2 norm of the accumulators x inv_scale (unscaled first, so a
    large loss scale does not overflow the squares)."""

    def __init__(self, accum: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.accum = accum
        self.hyper_map = ops.HyperMap()

    def construct(self, inv_scale):
        return ops.sqrt(ops.addn(self.hyper_map(ops.partial(_sq, inv_scale), self.accum)))


class ZeroAccum(nn.Cell):
    """Clear the accumulators (after a skipped step)."""

    def __init__(self, accum: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.accum = accum
        self.hyper_map = ops.HyperMap()

    def construct(self):
        return self.hyper_map(_zero, self.accum)
