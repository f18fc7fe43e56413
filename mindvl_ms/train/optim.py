"""AdamW for the compiled update graph: decay groups, per-module LR coefficients, global-norm
clipping, masked (skippable) updates, dynamic loss scaling.

Design:
- Parameters are selected by name prefix (`select_trainable`): frozen ones get
  `requires_grad=False` and never enter the gradient list, the accumulators or the moments, so
  no gradient memory exists for them and their values cannot change.
- No weight decay on norms, biases and any 1-D tensor (`decays`).
- Each parameter carries an LR coefficient from the longest matching prefix in
  `StageConfig.lr_coefficients` (e.g. `visual.` x0.1 in openPangu-VL SFT); the projector
  `visual.merger.` matches before `visual.`.
- `AdamWUpdate` is a Cell called inside `ApplyStep`: the update is written with `select` on an
  `apply` flag instead of control flow, so a step with a non-finite gradient leaves parameters and
  moments bit-identical and the graph has no branches.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

NO_DECAY_KEYS = ("norm", "bias", "ln_", "layernorm")


def select_trainable(model: nn.Cell, prefixes: Sequence[str]) -> List[Parameter]:
    """Mark parameters whose name starts with any prefix trainable, freeze the rest; return the trainable."""
    params = list(model.get_parameters())
    trainable = []
    for p in params:
        on = any(p.name.startswith(pre) for pre in prefixes)
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


def zeros_like_params(params: Sequence[Parameter], prefix: str) -> ParameterTuple:
    return ParameterTuple(Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"{prefix}.{p.name}",
                                    requires_grad=False) for p in params)


_adamw = ops.MultitypeFuncGraph("adamw")


@_adamw.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                 "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor")
def _adamw_one(apply, lr, b1, b2, eps, bc1, bc2, wd_base, coef, wd_on, grad, param, m, v, acc):
    """One parameter: AdamW step where `apply` is true, unchanged otherwise; zero the accumulator."""
    g = grad.astype(ms.float32)
    m_new = b1 * m + (1.0 - b1) * g
    v_new = b2 * v + (1.0 - b2) * g * g
    upd = (m_new / bc1) / (ops.sqrt(v_new / bc2) + eps) + wd_base * wd_on * param
    p_new = param - lr * coef * upd
    ops.assign(param, ops.select(apply, p_new, param).astype(param.dtype))
    ops.assign(m, ops.select(apply, m_new, m))
    ops.assign(v, ops.select(apply, v_new, v))
    ops.assign(acc, ops.zeros_like(acc))
    return apply


_sq = ops.MultitypeFuncGraph("sq")


@_sq.register("Tensor")
def _sq_one(g):
    return (g.astype(ms.float32) * g.astype(ms.float32)).sum()


_finite = ops.MultitypeFuncGraph("finite")


@_finite.register("Tensor")
def _finite_one(g):
    return ops.isfinite(g).all()


_scale = ops.MultitypeFuncGraph("scale")


@_scale.register("Tensor", "Tensor")
def _scale_one(s, g):
    return g * s


class AdamWUpdate(nn.Cell):
    """AdamW over `params` with moments `m`, `v`; returns (grad_norm, applied).

    construct(grads tuple (unscaled, summed over the global batch), lr [], finite [] bool, clip [])
    """

    def __init__(self, params: Sequence[Parameter], accum: ParameterTuple, lr_coefs: Dict[str, float],
                 weight_decay: float, beta1: float, beta2: float, eps: float):
        super().__init__()
        self.params = ParameterTuple(params)
        self.accum = accum
        self.m = zeros_like_params(params, "adam_m")
        self.v = zeros_like_params(params, "adam_v")
        self.step = Parameter(Tensor(0, ms.int32), name="adam_step", requires_grad=False)
        self.coefs = tuple(Tensor(lr_coefficient(p.name, lr_coefs), ms.float32) for p in params)
        self.wd_on = tuple(Tensor(1.0 if decays(p) else 0.0, ms.float32) for p in params)
        self.wd = Tensor(weight_decay, ms.float32)
        self.b1, self.b2, self.eps = (Tensor(x, ms.float32) for x in (beta1, beta2, eps))
        self.hyper_map = ops.HyperMap()

    def construct(self, grads, lr, finite, clip):
        sq = self.hyper_map(_sq, grads)
        norm = ops.sqrt(ops.addn(sq))                                     # global L2 norm
        apply = ops.logical_and(finite, ops.isfinite(norm))
        coef = ops.select(clip > 0, ops.minimum(1.0, clip / (norm + 1e-6)), ops.ones_like(norm))
        grads = self.hyper_map(ops.partial(_scale, coef), grads)
        step = self.step + apply.astype(ms.int32)
        t = step.astype(ms.float32)
        bc1 = 1.0 - ops.pow(self.b1, ops.maximum(t, 1.0))
        bc2 = 1.0 - ops.pow(self.b2, ops.maximum(t, 1.0))
        self.hyper_map(ops.partial(_adamw, apply, lr, self.b1, self.b2, self.eps, bc1, bc2, self.wd),
                       self.coefs, self.wd_on, grads, self.params, self.m, self.v, self.accum)
        ops.assign(self.step, step)
        return norm, apply


def all_finite(grads) -> Tuple:
    """Helper used by ApplyStep: whether every gradient tensor is finite."""
    return ops.HyperMap()(_finite, grads)
