"""The compiled train step: forward + loss + gradients + accumulation per micro-batch, then once per
global batch all-reduce + unscale + finite check + clipping + AdamW + loss-scale update.

Graphs (each compiled once per stage; dynamic shapes via `set_inputs`, recompiles are counted):
- `MicroStep`: forward, loss share (+ MoE aux loss), gradients of the trainable parameters only (frozen ones are
  not in the weight list, so autodiff produces no gradient for them), added into fp32
  accumulators. No communication here. For models with `hidden_states` + `head_weight` (MindVL) the
  LM head runs only at the supervised positions, in chunks of `loss.logits_chunk_tokens`
  (`train/loss_head.py`; the host computes the gather grid); other models return full [B, L, V] logits.
  Their [V, D] tables (embedding, head) add their gradients into the accumulators row-wise from their
  own bprops (`train/row_grads.py`), so no dense [V, D] gradient is made (standalone / data parallel).
- `ReduceStep`: once per global batch: all-reduce (sum, in place) of the accumulated gradients and
  the loss across data-parallel ranks (the single gradient synchronisation of openPangu-VL's
  asynchronous accumulation), divided by dp when `parallel.gradients_mean`, and the global gradient
  norm. Under semi/auto parallel (`parallel_mode` 1/2) the compiler inserts the reduction, so this
  step reduces nothing (`compiler_reduces`).
- `PipelineMicroStep` (train/pipeline.py) replaces `MicroStep` when pipeline stages > 1 (Ascend).
- `AdamWUpdate` (optim.py): unscale x clip folded into one multiplier, fused in-place AdamW with
  per-parameter LR coefficients, accumulators zeroed. It runs only when loss and norm are finite;
  otherwise `ZeroAccum` clears the accumulators, so a non-finite step leaves every parameter and
  moment bit-identical; it is reported and the dynamic loss scale (float16) shrinks.
- `WeightSumStep` (balanced loss only, when the global batch is split): a forward-only pre-pass
  that measures the global sum of token weights so each micro-batch's share is exact.

MoE models (`DeepseekV3Model`): the per-micro-batch expert load is summed over the global batch
(and ranks) and, after an applied update, the aux-loss-free routing-bias update runs once.

`TrainStep` is the host-side driver: it feeds numpy micro-batches, computes the global counts
(all-reduced across ranks) and returns plain floats.

Why a micro-step graph and a separate update graph rather than one graph with a micro-batch loop:
packed multimodal micro-batches differ in patch count, so slicing them inside one graph would need
per-micro-batch index plumbing; the gradient synchronisation must happen once per global batch,
not per micro-batch; and deciding "skip or update" on the host (from two scalars) lets the update
be the fused in-place kernel instead of a masked update that materialises several optimizer-sized
temporaries (measured: +2.3 GB for the tiny model's 19M-entry embedding). Every graph is still
compiled once per stage; nothing runs op by op.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindvl_ms.train.loss_head import ChunkedHeadCE, ChunkedHeadCERowGrad, supervised_layout
from mindvl_ms.train.memory import release_heap
from mindvl_ms.train.loss import IGNORE, TrainLoss, token_ce
from mindvl_ms.train.optim import AdamWUpdate, GradNorm, ZeroAccum, zeros_like_params
from mindvl_ms.train.row_grads import RowGradEmbedding, row_grad_token

log = logging.getLogger(__name__)

_acc = ops.MultitypeFuncGraph("acc")


@_acc.register("Tensor", "Tensor")
def _acc_one(acc, g):
    if g.dtype != acc.dtype:  # resolved at compile time: no copy for float32 gradients
        g = g.astype(acc.dtype)
    return ops.assign_add(acc, g)


def backbone(model: nn.Cell) -> nn.Cell:
    """The model under an AMP wrapper (`auto_mixed_precision` O2 wraps it in `_OutputTo32`)."""
    return getattr(model, "_backbone", model)


def has_sparse_head(model: nn.Cell) -> bool:
    """True when the model exposes `hidden_states(*inputs)` and `head_weight()` (MindVL does): the
    step then runs the LM head only at supervised positions, in chunks (train/loss_head.py)."""
    net = backbone(model)
    hs, hw = getattr(net, "hidden_states", None), getattr(net, "head_weight", None)
    if not (callable(hs) and callable(hw)):
        return False
    names = getattr(net, "INPUT_NAMES", ())  # a subclass with other inputs (its own logits layout) opts out
    return len(inspect.signature(hs).parameters) == len(names)


class ForwardLoss(nn.Cell):
    """(*model_inputs, *loss_inputs, token_norm, num_samples, scale) -> (loss share * scale, expert load).

    loss_inputs: sparse head (`has_sparse_head`): sup_targets, sup_segment_ids, sup_token_index,
    logit_index, all [n, c] (`head.supervised_layout`); otherwise targets, token_index [B, L] (the model
    returns full [B, L, V] logits and segment_ids is the model input at `seg_pos`).

    `row_grads` {table Parameter name: accumulator} (sparse head only, `row_grad_tables`): the embedding
    lookup and/or the head add those tables' gradients into the accumulators themselves (train/row_grads.py);
    `self.token` then carries the dependency and the tables must be left out of the differentiated weights."""

    def __init__(self, model: nn.Cell, loss: TrainLoss, n_model: int, seg_pos: int, aux_weight: float = 1.0,
                 sparse: bool = False, row_grads: Optional[Dict[str, Parameter]] = None):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model, self.loss, self.n_model, self.seg_pos = model, loss, n_model, seg_pos
        self.sparse = sparse
        self.row_embed = self.row_head = False
        if row_grads and not sparse:
            raise ValueError("row-wise table gradients need the sparse head (has_sparse_head); got "
                             f"row_grads for {sorted(row_grads)}")
        self.row_tables = frozenset(row_grads or ())  # names of the tables MicroStep must not differentiate
        if sparse:
            self.net = backbone(model)
            row_grads = row_grads or {}
            table, head = self.net.model.embed_tokens.weight, self.net.head_weight()
            self.row_embed, self.row_head = table.name in row_grads, head.name in row_grads
            self.token = row_grad_token() if row_grads else None
            if self.row_embed:
                self.embed = RowGradEmbedding(table, row_grads[table.name], self.token)
            if self.row_head:
                self.head_acc = row_grads[head.name]
            self.head = ChunkedHeadCERowGrad() if self.row_head else ChunkedHeadCE()
        self.aux_weight = float(aux_weight)  # 1 / (micro-batches x ranks): the MoE aux loss is a batch mean

    def ce_and_aux(self, *args):
        """-> (ce, mask, segment_ids, token_index [n, c] or [B, L], model output tuple or None)."""
        model_args = args[:self.n_model]
        n = self.n_model
        if self.sparse:
            targets, seg, tok, index = args[n], args[n + 1], args[n + 2], args[n + 3]
            if self.row_embed:
                text = self.embed(model_args[0])                                 # [B, L, D]
                hidden, aux, load = self.net.hidden_states_from_embeds(text, *model_args[1:])
            else:
                hidden, aux, load = self.net.hidden_states(*model_args)          # [B, L, D]
            d = hidden.shape[-1]
            kept = ops.gather(hidden.reshape(-1, d), index.reshape(-1), 0)    # [n*c, D]
            kept = kept.reshape(index.shape[0], index.shape[1], d)            # [n, c, D]
            if self.row_head:
                ce = self.head(kept, self.net.head_weight(), targets, self.head_acc, self.token)  # [n, c]
            else:
                ce = self.head(kept, self.net.head_weight(), targets)         # [n, c]
            return ce, (targets != IGNORE).astype(ms.float32), seg, tok, (aux, load)
        out = self.model(*model_args)
        logits = out[0] if isinstance(out, tuple) else out                   # [B, L, V]
        ce, mask = token_ce(logits, args[n])
        extra = (out[1], out[2]) if isinstance(out, tuple) else None
        return ce, mask, model_args[self.seg_pos], args[n + 1], extra

    def construct(self, *args):
        ce, mask, seg, tok, extra = self.ce_and_aux(*args)
        token_norm, num_samples, scale = args[-3], args[-2], args[-1]
        loss = self.loss.from_ce(ce, mask, seg, tok, token_norm, num_samples)
        load = ops.zeros((1, 1), ms.float32)
        if extra is not None:
            loss = loss + extra[0].astype(ms.float32) * self.aux_weight      # MoE sequence-wise aux loss
            load = extra[1].astype(ms.float32)                               # [moe layers, E] routed tokens
        return loss * scale, load


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
            done = (self.hyper_map(_acc, self.accum, grads[:-1]), grads[-1])
        else:
            done = self.hyper_map(_acc, self.accum, grads)
        return ops.depend(scaled / args[-1], done), load


class WeightSumStep(nn.Cell):
    """Forward only: the sum of balanced-loss token weights of one micro-batch (same inputs as ForwardLoss
    without the three scalars)."""

    def __init__(self, forward: ForwardLoss):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.forward = forward

    def construct(self, *args):
        ce, mask, _, tok, _ = self.forward.ce_and_aux(*args)
        return self.forward.loss.weight_sum_ce(ce, mask, tok)


_allreduce_into = ops.MultitypeFuncGraph("allreduce_into")


@_allreduce_into.register("Function", "Tensor")
def _allreduce_into_one(op, acc):
    return ops.assign(acc, op(acc))


_scale_into = ops.MultitypeFuncGraph("scale_into")


@_scale_into.register("Tensor", "Tensor")
def _scale_into_one(k, acc):
    return ops.assign(acc, acc * k)


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
        self.norm = GradNorm(accum)
        self.hyper_map = ops.HyperMap()
        if self.reduce:
            self.allreduce = allreduce if allreduce is not None else ops.AllReduce()

    def construct(self, loss_sum, inv_scale):
        if self.reduce:
            done = self.hyper_map(ops.partial(_allreduce_into, self.allreduce), self.accum)
            if self.mean:
                done = ops.depend(self.hyper_map(ops.partial(_scale_into, self.inv_dp), self.accum), done)
            loss_sum = ops.depend(self.allreduce(loss_sum), done)
        return loss_sum, self.norm(ops.depend(inv_scale, loss_sum))


@dataclass
class StepResult:
    loss: float          # global-batch loss (before this step's update)
    grad_norm: float     # global gradient L2 norm (after unscaling, before clipping)
    applied: bool        # False: non-finite loss/gradient, update skipped
    loss_scale: float
    tokens: int          # non-padding tokens in this rank's micro-batches
    supervised: int      # supervised targets in the global batch
    patches: int         # vision patches on this rank
    expert_load: Optional[np.ndarray] = None  # MoE: routed tokens per expert [moe layers, E], global batch


def row_grad_tables(model: nn.Cell, params: Sequence[Parameter], accum: ParameterTuple) -> Dict[str, Parameter]:
    """{name: accumulator} of the trainable [V, D] tables whose gradients are added row-wise
    (train/row_grads.py): the token embedding (when the model can take looked-up embeddings,
    `hidden_states_from_embeds`) and the LM head, for models with the sparse head. Empty otherwise."""
    if not has_sparse_head(model):
        return {}
    net = backbone(model)
    by_name = {p.name: a for p, a in zip(params, accum)}
    tables = [net.head_weight()]
    if callable(getattr(net, "hidden_states_from_embeds", None)):
        tables.append(net.model.embed_tokens.weight)
    return {t.name: by_name[t.name] for t in tables if t.name in by_name}


def _ms_dtype(a: np.ndarray):
    return {np.dtype(np.int32): ms.int32, np.dtype(np.int64): ms.int64, np.dtype(np.float32): ms.float32,
            np.dtype(np.float16): ms.float16, np.dtype(np.bool_): ms.bool_}[a.dtype]


class TrainStep:
    """Host driver for one stage: owns the accumulators, moments, loss scale and the compiled graphs."""

    def __init__(self, model: nn.Cell, params: List[Parameter], input_names: Sequence[str], loss_cfg,
                 stage, dp: int = 1, allreduce_host=None, precision: str = "float32",
                 loss_scale_value: float = 65536.0, loss_scale_factor: float = 2.0, loss_scale_window: int = 1000,
                 gradients_mean: bool = False, compiler_reduces: bool = False, pipeline=None,
                 row_grads: bool = True):
        release_heap()  # the model is built: its loading's freed host copies go back to the OS
        self.input_names = list(input_names)
        if "segment_ids" not in self.input_names:
            raise ValueError(f"the model's INPUT_NAMES {self.input_names} must include segment_ids")
        n_model = len(self.input_names)
        self.loss = TrainLoss(loss_cfg.type, loss_cfg.lambda1, loss_cfg.lambda2, loss_cfg.tau1, loss_cfg.tau2)
        self.chunk = int(getattr(loss_cfg, "logits_chunk_tokens", 1024))
        self.sparse = has_sparse_head(model)
        self.params = params
        self.accum = zeros_like_params(params, "accum")
        self.update = AdamWUpdate(params, self.accum, stage.lr_prefixes(), stage.weight_decay,
                                  stage.adam_beta1, stage.adam_beta2, stage.adam_eps)
        self.dynamic = precision == "float16"
        self.scale = Parameter(Tensor(loss_scale_value if self.dynamic else 1.0, ms.float32), name="loss_scale",
                               requires_grad=False)
        self.good = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps", requires_grad=False)
        self.factor, self.window = float(loss_scale_factor), int(loss_scale_window)
        self.pipeline = pipeline  # (stages, micro_batch_num): Ascend pipeline parallel, see train/pipeline.py
        # row-wise table gradients (train/row_grads.py): not under a compiler-sharded layout or pipeline stages
        rows = (row_grad_tables(model, params, self.accum) if row_grads and not compiler_reduces and pipeline is None
                else {})
        self.row_grad_tables = sorted(rows)
        fwd = ForwardLoss(model, self.loss, n_model, self.input_names.index("segment_ids"),
                          1.0 / (stage.accumulation(dp) * dp), sparse=self.sparse, row_grads=rows)
        if pipeline is not None:
            from mindvl_ms.train.pipeline import PipelineMicroStep

            self.micro = PipelineMicroStep(fwd, params, self.accum, pipeline[1])
        else:
            self.micro = MicroStep(fwd, params, self.accum)
        self.reduce = ReduceStep(self.accum, dp, mean=gradients_mean, explicit=not compiler_reduces)
        self.zero = ZeroAccum(self.accum)
        self.weight_sum = WeightSumStep(fwd)
        self.need_prepass_kind = loss_cfg.type == "balanced" and loss_cfg.lambda1 > 0
        self.dp, self.clip = dp, float(stage.grad_clip)
        self.allreduce_host = allreduce_host or (lambda x: x)
        self._shaped = False
        self.compiles = 0
        self.bias_updater = self._find_bias_updater(model)

    @staticmethod
    def _find_bias_updater(model):
        """The MoE language model's expert-bias update cell, when balancing by bias is on."""
        net = getattr(model, "_backbone", model)  # AMP wraps the model
        lm = getattr(net, "model", None)
        moe = getattr(getattr(getattr(net, "config", None), "text", None), "moe", None)
        if lm is None or not hasattr(lm, "bias_updater") or moe is None or moe.bias_update_speed <= 0:
            return None
        return lm.bias_updater()

    # -- state (for checkpoints) ---------------------------------------------------------------
    def state_parameters(self) -> Dict[str, Parameter]:
        """Optimizer/loss-scale state by name (moments, step, loss scale); accumulators are zero between steps."""
        out = {p.name: p for p in list(self.update.m) + list(self.update.v)}
        for p in (self.update.step, self.scale, self.good):
            out[p.name] = p
        return out

    # -- one optimizer step --------------------------------------------------------------------
    def _set_inputs(self, feed: List[np.ndarray], arrays: List[np.ndarray]) -> None:
        def dyn(arrs):
            return [Tensor(shape=[None] * a.ndim, dtype=_ms_dtype(a)) for a in arrs]

        scalar = Tensor(shape=[], dtype=ms.float32)
        self.micro.set_inputs(*dyn(feed), scalar, scalar, scalar)
        self.weight_sum.set_inputs(*dyn(arrays))
        self._shaped = True

    def _micro_arrays(self, mb: Dict[str, np.ndarray], min_slots: int = 0) -> List[np.ndarray]:
        missing = [k for k in self.input_names + ["targets", "token_index"] if k not in mb]
        if missing:
            raise KeyError(f"micro-batch lacks arrays {missing}; has {sorted(mb)}")
        model_in = [np.ascontiguousarray(mb[k]) for k in self.input_names]
        if self.sparse:  # LM head only at supervised positions, chunked (train/loss_head.py)
            lay = supervised_layout(mb["targets"], mb["segment_ids"], mb["token_index"], self.chunk, min_slots)
            return model_in + [lay["sup_targets"], lay["sup_segment_ids"], lay["sup_token_index"],
                               lay["logit_index"]]
        return model_in + [mb["targets"].astype(np.int32), mb["token_index"].astype(np.int32)]

    def compile_micro(self, feed: List[np.ndarray]) -> None:
        """Compile the micro-step graph for inputs like `feed` (dynamic shapes), then hand the compiler's
        freed heap back to the OS (train/memory.py) before the first run allocates activations."""
        if not self._shaped:
            self._set_inputs(feed, feed)
        one = Tensor(1.0, ms.float32)
        self.micro.compile(*[Tensor(a) for a in feed], one, one, one)
        release_heap()

    def run(self, micro_batches: List[Dict[str, np.ndarray]], lr: float) -> StepResult:
        """Accumulate over this rank's micro-batches, then apply one update. Returns floats."""
        feeds = arrays = [self._micro_arrays(mb) for mb in micro_batches]
        if self.pipeline is not None:  # one call: the pipeline cell slices the stacked micro-batches
            from mindvl_ms.train.pipeline import stack_micro_batches

            slots = max(int((mb["targets"] != IGNORE).sum()) for mb in micro_batches)  # one head grid for all
            arrays = [self._micro_arrays(mb, slots) for mb in micro_batches]
            feeds = [stack_micro_batches(arrays, self.pipeline[1])]
        if not self._shaped:
            self._set_inputs(feeds[0], arrays[0])
        sup, samples, toks, patches = 0, 0, 0, 0
        for mb in micro_batches:
            t, seg = mb["targets"], mb["segment_ids"]
            sup += int((t != IGNORE).sum())
            samples += int(np.unique(seg[(t != IGNORE) & (seg > 0)]).size)
            toks += int((mb.get("attn_segment_ids", seg) > 0).sum())  # all tokens, also for compact-logit models
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
        loss_sum, load = 0.0, None
        before = len(self.micro.compile_cache)
        if not before:
            self.compile_micro(feeds[0])
        for arr in feeds:
            loss, mb_load = self.micro(*[Tensor(a) for a in arr], *scalars, scale)
            loss_sum += float(loss.asnumpy())
            load = mb_load.asnumpy() if load is None else load + mb_load.asnumpy()
        after = len(self.micro.compile_cache)
        if after != before:
            self.compiles += after - before
            if before:
                log.warning("train step recompiled (%d graphs now): input ranks/dtypes changed", after)
        loss, norm, applied = self.apply(loss_sum, lr)
        expert_load = None
        if self.bias_updater is not None:  # aux-loss-free balancing: once per global batch, on the global load
            expert_load = self.allreduce_host(load.astype(np.float32))
            if applied:
                self.bias_updater(Tensor(expert_load))
        return StepResult(loss, norm, applied, float(self.scale.asnumpy()), toks, int(g_sup), patches,
                          expert_load)

    def apply(self, loss_sum: float, lr: float):
        """Reduce the accumulated gradients (and the loss), clip, and take the AdamW step unless the loss or
        the gradient norm is not finite (then the accumulators are zeroed); updates the loss scale.
        Returns (loss, grad norm, applied)."""
        scale_now = float(self.scale.asnumpy())
        loss_t, norm_t = self.reduce(Tensor([loss_sum], ms.float32), Tensor(1.0 / scale_now, ms.float32))
        loss, norm = float(loss_t.asnumpy()[0]), float(norm_t.asnumpy())
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            t = int(self.update.step.asnumpy()) + 1
            clip = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
            lr_k, eps_k, wd_k = self.update.bias_corrected(lr, t)
            self.update(*(Tensor(x, ms.float32) for x in (clip / scale_now, lr_k, eps_k, wd_k)))
        else:
            self.zero()
        self._update_loss_scale(applied, scale_now)
        return loss, norm, applied

    def _update_loss_scale(self, applied: bool, scale: float) -> None:
        """Dynamic loss scaling (float16): divide on overflow, multiply after `window` good steps."""
        if not self.dynamic:
            return
        good = int(self.good.asnumpy()) + 1 if applied else 0
        if not applied:
            scale = max(scale / self.factor, 1.0)
        elif good >= self.window:
            scale, good = scale * self.factor, 0
        self.scale.set_data(Tensor(scale, ms.float32))
        self.good.set_data(Tensor(good, ms.int32))
