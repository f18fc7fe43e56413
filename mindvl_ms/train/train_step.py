"""The train step: forward + loss + gradients + accumulation per micro-batch, then once per global batch
all-reduce + unscale + finite check + clipping + AdamW + loss-scale update.

Graphs (each compiled once per stage, or once for consecutive stages that fit them, `TrainStep.restart`;
dynamic shapes via `set_inputs`, recompiles are counted):
- `MicroStep` (train/step_cells.py) over `ForwardLoss` (train/forward_loss.py): forward, loss share
  (+ MoE aux loss), gradients of the trainable parameters added into fp32 accumulators. MindVL's LM head
  runs only at the supervised positions, in chunks (train/loss_head.py), and its [V, D] tables add their
  gradients row-wise (train/row_grads.py; standalone / data parallel). When a stage's micro-batch holds at
  most one chunk of positions (`one_block_head`), the head is one block with no chunk loop: a loop over a
  dynamic chunk count is control flow, which splits the graph into kernel graphs launched one by one.
- `ReduceStep` (train/step_cells.py): once per global batch, the data-parallel reduction of the
  accumulated gradients and the loss, and the global gradient norm. Under semi/auto parallel
  (`parallel_mode` 1/2) the compiler inserts the reduction, so this step reduces nothing
  (`compiler_reduces`).
- `AdamWUpdate` (optim.py): unscale x clip folded into one multiplier, fused in-place AdamW with
  per-parameter LR coefficients, accumulators zeroed (on CPU one `FusedAdamW` kernel per parameter). It
  runs only when loss and norm are finite; otherwise `ZeroAccum` clears the accumulators, so a non-finite
  step leaves every parameter and moment bit-identical; it is reported and the dynamic loss scale
  (float16) shrinks.
- `WeightSumStep` (train/forward_loss.py; balanced loss only, when the global batch is split): a
  forward-only pre-pass that measures the global sum of token weights so each micro-batch's share is exact.

MoE models (`DeepseekV3Model`): the per-micro-batch expert load is summed over the global batch
(and ranks) and, after an applied update, the aux-loss-free routing-bias update runs once.

`TrainStep` is the host-side driver: it feeds numpy micro-batches, computes the global counts
(all-reduced across ranks) and returns plain floats.

Why a micro-step graph and a separate update graph rather than one graph with a micro-batch loop:
packed multimodal micro-batches differ in patch count, so slicing them inside one graph would need
per-micro-batch index plumbing; the gradient synchronisation must happen once per global batch,
not per micro-batch; and deciding "skip or update" on the host (from two scalars) lets the update
be the fused in-place kernel instead of a masked update that materialises several optimizer-sized
temporaries (docs/PERFORMANCE.md, ## train). Every graph is still compiled at most once per stage; nothing
runs op by op.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindvl_ms.train.forward_loss import ForwardLoss, WeightSumStep, has_sparse_head, row_grad_tables
from mindvl_ms.train.loss import IGNORE, TrainLoss
from mindvl_ms.train.loss_head import supervised_layout
from mindvl_ms.train.memory import release_heap
from mindvl_ms.train.optim import AdamWUpdate, ZeroAccum, lr_coefficient, zeros_like_params
from mindvl_ms.train.step_cells import MicroStep, ReduceStep

log = logging.getLogger(__name__)


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



def ms_dtype(a: np.ndarray):
    """The MindSpore dtype of a numpy array (the dtypes micro-batches carry)."""
    return {np.dtype(np.int32): ms.int32, np.dtype(np.int64): ms.int64, np.dtype(np.float32): ms.float32,
            np.dtype(np.float16): ms.float16, np.dtype(np.bool_): ms.bool_}[a.dtype]


def dynamic_like(arrays: Sequence[np.ndarray], constant: Sequence[Sequence] = ()) -> List[Tensor]:
    """Placeholder Tensors in the arrays' dtypes (for `set_inputs`): every dimension dynamic except the
    constant ones `constant` gives (per array, a shape with None where dynamic: the model's
    `dynamic_inputs`), aligned to the array's last dimensions."""
    out = []
    for i, a in enumerate(arrays):
        shape = [None] * a.ndim
        if i < len(constant) and constant[i]:
            shape[a.ndim - len(constant[i]):] = constant[i]
        out.append(Tensor(shape=shape, dtype=ms_dtype(a)))
    return out


def constant_dims(model: nn.Cell) -> List[List]:
    """The model inputs' constant dimensions (None where dynamic), from its `dynamic_inputs` if it has one."""
    net = getattr(model, "_backbone", model)  # AMP wraps the model
    if not callable(getattr(net, "dynamic_inputs", None)):
        return []
    return [[None if d is None or d < 0 else int(d) for d in t.shape] for t in net.dynamic_inputs()]


def local_counts(micro_batches: Sequence[Dict[str, np.ndarray]]) -> Tuple[int, int, int, int]:
    """(supervised targets, supervised samples, non-padding tokens, vision patches) of this rank's
    micro-batches."""
    sup, samples, toks, patches = 0, 0, 0, 0
    for mb in micro_batches:
        t, seg = mb["targets"], mb["segment_ids"]
        sup += int((t != IGNORE).sum())
        samples += int(np.unique(seg[(t != IGNORE) & (seg > 0)]).size)
        toks += int((mb.get("attn_segment_ids", seg) > 0).sum())  # all tokens, also for compact-logit models
        grid, pv = mb.get("image_grid_thw"), mb.get("pixel_values")  # real patches (the rows pad to a budget)
        patches += int(np.prod(grid, 1).sum()) if grid is not None else 0 if pv is None else int(pv.shape[0])
    return sup, samples, toks, patches


def step_arrays(mb: Dict[str, np.ndarray], input_names: Sequence[str], sparse: bool, chunk: int,
                min_slots: int = 0) -> List[np.ndarray]:
    """One micro-batch's graph inputs in ForwardLoss order: the model inputs, then the loss inputs (the
    sparse head's chunk grid, train/loss_head.py, sized for at least `min_slots` positions per row, or full
    targets and token_index). Both train steps (TrainStep, train/mf_step.MFStep) feed these."""
    missing = [k for k in list(input_names) + ["targets", "token_index"] if k not in mb]
    if missing:
        raise KeyError(f"micro-batch lacks arrays {missing}; has {sorted(mb)}")
    model_in = [np.ascontiguousarray(mb[k]) for k in input_names]
    if sparse:  # LM head only at supervised positions, chunked
        lay = supervised_layout(mb["targets"], mb["segment_ids"], mb["token_index"], chunk, min_slots)
        return model_in + [lay["sup_targets"], lay["sup_segment_ids"], lay["sup_token_index"], lay["logit_index"]]
    return model_in + [mb["targets"].astype(np.int32), mb["token_index"].astype(np.int32)]


def find_bias_updater(model: nn.Cell):
    """The MoE language model's expert-bias update cell, when balancing by bias is on; else None."""
    net = getattr(model, "_backbone", model)  # AMP wraps the model
    lm = getattr(net, "model", None)
    moe = getattr(getattr(getattr(net, "config", None), "text", None), "moe", None)
    if lm is None or not hasattr(lm, "bias_updater") or moe is None or moe.bias_update_speed <= 0:
        return None
    return lm.bias_updater()


def one_block_head(loss_cfg, stage) -> bool:
    """Whether a stage's LM head runs as one block, without the chunk loop (`loss_head._HeadBlocks`): when
    a micro-batch's positions (micro_batch_size x seq_length) fit `loss.logits_chunk_tokens`, so the loop
    could never take a second chunk. Decided per stage, not per micro-batch: a stage has one micro-step graph."""
    chunk = int(getattr(loss_cfg, "logits_chunk_tokens", 1024))
    return int(stage.micro_batch_size) * int(stage.seq_length) <= chunk


def graph_key(model: nn.Cell, params: Sequence[Parameter], input_names: Sequence[str], loss_cfg, stage, dp: int,
              precision: str, gradients_mean: bool, compiler_reduces: bool, row_grads: bool) -> tuple:
    """Everything a `TrainStep` built from these arguments bakes into its graphs as constants: the model and
    its parameters' shapes, its inputs, the trainable parameters (hence the sparse head, row-gradient tables
    and decay masks), the loss type and weights, each micro-batch's share 1/(accumulation x dp), the
    parameters' LR coefficients, the AdamW betas, the reduction (dp, mean, compiler-inserted) and whether the
    head is one block (`one_block_head`). Two stages with equal keys can train on one step's compiled graphs
    (`TrainStep.restart`); sequence length, batch shapes, learning rate, weight decay, epsilon and clipping
    are inputs or host values and may differ."""
    coefs = stage.lr_prefixes()
    shapes = tuple(tuple(p.shape) for p in model.get_parameters())  # e.g. a vocabulary subset resizes tables
    return (id(model), shapes, tuple(input_names), tuple(p.name for p in params),
            (loss_cfg.type, float(loss_cfg.lambda1), float(loss_cfg.lambda2), float(loss_cfg.tau1),
             float(loss_cfg.tau2)),
            stage.accumulation(dp) * dp, tuple(lr_coefficient(p.name, coefs) for p in params),
            (float(stage.adam_beta1), float(stage.adam_beta2)), int(dp), precision, bool(gradients_mean),
            bool(compiler_reduces), bool(row_grads and not compiler_reduces),
            has_sparse_head(model) and not compiler_reduces and one_block_head(loss_cfg, stage))


_KEPT = "_mindvl_train_step"  # attribute of the network: (settings, TrainStep) of its last SFT stage


def kept_train_step(net: nn.Cell, settings: tuple) -> Optional["TrainStep"]:
    """The SFT step last kept on `net` (`keep_train_step`) when it was built under the same `settings` (what
    shapes the graphs besides `graph_key`: the trainer passes the recompute configuration), else None. A later
    `run_training` on the same network restarts it when it fits (`TrainStep.restart`) instead of compiling."""
    entry = vars(net).get(_KEPT)
    return entry[1] if entry is not None and entry[0] == settings else None


def keep_train_step(net: nn.Cell, settings: tuple, step: Optional["TrainStep"]) -> None:
    """Keep `step` on `net` (None: drop the kept one, so its accumulators and moments can go before another
    step's are allocated). One per network: it lives as long as the network or until replaced."""
    vars(net).pop(_KEPT, None)
    if step is not None:
        object.__setattr__(net, _KEPT, (settings, step))


class TrainStep:
    """Host driver for a stage: owns the accumulators, moments, loss scale and the compiled graphs. The next
    stage may run on the same graphs (`restart`, the trainer's `StageChain` does) when they fit it."""

    def __init__(self, model: nn.Cell, params: List[Parameter], input_names: Sequence[str], loss_cfg,
                 stage, dp: int = 1, allreduce_host=None, precision: str = "float32",
                 loss_scale_value: float = 65536.0, loss_scale_factor: float = 2.0, loss_scale_window: int = 1000,
                 gradients_mean: bool = False, compiler_reduces: bool = False, row_grads: bool = True):
        release_heap()  # the model is built: its loading's freed host copies go back to the OS
        self.input_names = list(input_names)
        if "segment_ids" not in self.input_names:
            raise ValueError(f"the model's INPUT_NAMES {self.input_names} must include segment_ids")
        self.key = graph_key(model, params, input_names, loss_cfg, stage, dp, precision, gradients_mean,
                             compiler_reduces, row_grads)
        self.loss = TrainLoss(loss_cfg.type, loss_cfg.lambda1, loss_cfg.lambda2, loss_cfg.tau1, loss_cfg.tau2)
        self.sparse = has_sparse_head(model)
        # static shapes (compiler_reduces) keep the loop, which the compiler unrolls
        self.one_block = self.sparse and not compiler_reduces and one_block_head(loss_cfg, stage)
        self.params = params
        self.accum = zeros_like_params(params, "accum")
        self.update = AdamWUpdate(params, self.accum, stage.lr_prefixes(), stage.weight_decay,
                                  stage.adam_beta1, stage.adam_beta2, stage.adam_eps, kernel=not compiler_reduces)
        self.dynamic = precision == "float16"
        self.scale = Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False)
        self.good = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps", requires_grad=False)
        self._host_values(loss_cfg, stage, allreduce_host, loss_scale_value, loss_scale_factor, loss_scale_window)
        self._build_graphs(model, stage, dp, gradients_mean, compiler_reduces, row_grads and not compiler_reduces)
        self.need_prepass_kind = loss_cfg.type == "balanced" and loss_cfg.lambda1 > 0
        self.dp = dp
        self._shaped = False
        self.static = compiler_reduces  # semi/auto parallel: a stage's RowBudget fixes every input shape
        self.constant = constant_dims(model)
        self.compiles = 0
        self.bias_updater = find_bias_updater(model)

    def _host_values(self, loss_cfg, stage, allreduce_host, loss_scale_value: float, loss_scale_factor: float,
                     loss_scale_window: int) -> None:
        """The stage's values that live on the host, not in a graph (a restarted step takes the next
        stage's): the LM head chunk, clipping, the host all-reduce, and the loss scale at its start."""
        self.chunk = int(getattr(loss_cfg, "logits_chunk_tokens", 1024))
        self.clip = float(stage.grad_clip)
        self.allreduce_host = allreduce_host or (lambda x: x)
        self.scale.set_data(Tensor(loss_scale_value if self.dynamic else 1.0, ms.float32))
        self.good.set_data(Tensor(0, ms.int32))
        self.factor, self.window = float(loss_scale_factor), int(loss_scale_window)

    def restart(self, model: nn.Cell, params: List[Parameter], input_names: Sequence[str], loss_cfg, stage,
                dp: int = 1, allreduce_host=None, precision: str = "float32", loss_scale_value: float = 65536.0,
                loss_scale_factor: float = 2.0, loss_scale_window: int = 1000, gradients_mean: bool = False,
                compiler_reduces: bool = False, row_grads: bool = True) -> bool:
        """Take the next stage (the constructor's arguments) on this step's compiled graphs, when everything
        they bake in (`graph_key`) is what a new step would bake in: the state becomes a new step's
        (accumulators, moments and optimizer step zero, the loss scale at its initial value), the host-side
        values the stage's (AdamW weight decay and epsilon, clipping, chunk, loss-scale schedule) and the
        compile count restarts; the stage then trains bit-identically to one on a new step without
        compiling (the graphs are cached per Cell instance). Returns False, changing nothing, otherwise."""
        if not isinstance(self.micro.forward, ForwardLoss) or self.key != graph_key(
                model, params, input_names, loss_cfg, stage, dp, precision, gradients_mean, compiler_reduces,
                row_grads):
            return False
        for a in self.accum:
            a.set_data(ops.zeros(a.shape, a.dtype))
        self.update.restart(stage.weight_decay, stage.adam_beta1, stage.adam_beta2, stage.adam_eps)
        self._host_values(loss_cfg, stage, allreduce_host, loss_scale_value, loss_scale_factor, loss_scale_window)
        self.compiles = 0
        release_heap()
        return True

    def _build_graphs(self, model: nn.Cell, stage, dp: int, gradients_mean: bool, compiler_reduces: bool,
                      row_grads: bool) -> None:
        """The step's Cells. Row-wise table gradients (train/row_grads.py) only when `row_grads`: not
        under a compiler-sharded layout."""
        rows = row_grad_tables(model, self.params, self.accum) if row_grads else {}
        self.row_grad_tables = sorted(rows)
        fwd = ForwardLoss(model, self.loss, len(self.input_names), self.input_names.index("segment_ids"),
                          1.0 / (stage.accumulation(dp) * dp), sparse=self.sparse, row_grads=rows,
                          one_block=self.one_block)
        self.micro = MicroStep(fwd, self.params, self.accum)
        self.reduce = ReduceStep(self.accum, dp, mean=gradients_mean, explicit=not compiler_reduces)
        self.zero = ZeroAccum(self.accum)
        self.weight_sum = WeightSumStep(fwd)

    # -- state (for checkpoints) ---------------------------------------------------------------
    def state_parameters(self) -> Dict[str, Parameter]:
        """Optimizer/loss-scale state by name (moments, step, loss scale); accumulators are zero between steps."""
        out = {p.name: p for p in list(self.update.m) + list(self.update.v)}
        for p in (self.update.step, self.scale, self.good):
            out[p.name] = p
        return out

    # -- one optimizer step --------------------------------------------------------------------
    def _set_inputs(self, feed: List[np.ndarray]) -> None:
        """Dynamic shapes (constant dims excepted) for CPU training; static ones, compiled as fed, under
        semi/auto parallel, where every rank's arrays have the stage's fixed shapes (data.collate.RowBudget)."""
        if not self.static:
            scalar = Tensor(shape=[], dtype=ms.float32)
            self.micro.set_inputs(*dynamic_like(feed, self.constant), scalar, scalar, scalar)
            self.weight_sum.set_inputs(*dynamic_like(feed, self.constant))
        self._shaped = True

    def _feeds(self, micro_batches: List[Dict[str, np.ndarray]]) -> List[List[np.ndarray]]:
        """One graph feed per micro-batch (`step_arrays`)."""
        return [step_arrays(mb, self.input_names, self.sparse, self.chunk) for mb in micro_batches]

    def compile_micro(self, feed: List[np.ndarray]) -> None:
        """Compile the micro-step graph for inputs like `feed` (dynamic shapes), then hand the compiler's
        freed heap back to the OS (train/memory.py) before the first run allocates activations."""
        if not self._shaped:
            self._set_inputs(feed)
        one = Tensor(1.0, ms.float32)
        self.micro.compile(*[Tensor(a) for a in feed], one, one, one)
        release_heap()

    def _token_norm(self, arrays: List[List[np.ndarray]], g_sup: float) -> float:
        """The loss's global token denominator: supervised targets (token mean); for the balanced loss the
        global sum of token weights when the global batch is split (forward-only pre-pass), else -1
        (each micro-batch's own sum)."""
        if not self.loss.balanced:
            return g_sup
        if self.need_prepass_kind and (len(arrays) > 1 or self.dp > 1):
            w = sum(float(self.weight_sum(*[Tensor(a) for a in arr]).asnumpy()) for arr in arrays)
            return float(self.allreduce_host(np.array([w], np.float32))[0])
        return -1.0

    def _accumulate(self, feeds: List[List[np.ndarray]], scalars: List[Tensor]):
        """Run the micro-step on every feed (gradients into the accumulators); counts recompiles.
        Returns (this rank's loss sum, summed expert load)."""
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
        return loss_sum, load

    def run(self, micro_batches: List[Dict[str, np.ndarray]], lr: float) -> StepResult:
        """Accumulate over this rank's micro-batches, then apply one update. Returns floats."""
        feeds = self._feeds(micro_batches)
        if not self._shaped:
            self._set_inputs(feeds[0])
        sup, samples, toks, patches = local_counts(micro_batches)
        counts = self.allreduce_host(np.array([sup, samples], np.float32))
        g_sup, g_samples = float(counts[0]), float(counts[1])
        token_norm = self._token_norm(feeds, g_sup)
        scalars = [Tensor(token_norm, ms.float32), Tensor(g_samples, ms.float32)]
        loss_sum, load = self._accumulate(feeds, scalars)
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
