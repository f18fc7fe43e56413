"""The compiled step shared by the post-training objectives (DPO, GRPO).

`PostTrainStep` is a `TrainStep` (same accumulators, all-reduce, clipping, AdamW, loss scale, skip
on a non-finite loss, checkpointed state) whose micro-step differentiates an *objective* cell instead
of the SFT loss. An objective is `construct(logits [B, L, V], *extra) -> (loss share [], stats [K])`;
the extra inputs are per-micro-batch numpy arrays built on the host (targets, per-token weights,
old/reference log-probs, pair indices, ...), so the graph stays static: one compile per stage for
every sequence length and batch size (`set_inputs` with dynamic dims).

`LogProbs` is the forward-only graph of the per-token log-probabilities of the targets (0 where the
target is IGNORE): GRPO's behaviour-policy log-probs before the first mini-step and DPO's reference
log-probs are computed with it.

The MoE aux loss is added like in SFT; the aux-loss-free expert-bias update is not run in these
stages (the stats output takes the place of the expert load).

`post_train_step` keeps the last step built for a network on that network: a later post stage (a chain of
post stages, a resumed run on the same model) takes it back with its state reset. Its ReduceStep, AdamW and
zeroing graphs serve any post stage on the same trainable parameters and optimizer constants, its LogProbs
graph any stage at the same sampling temperature (DPO and GRPO score the same graph) and its micro-step any
stage with the same objective constants; only what differs is built and compiled again (figures in
docs/PERFORMANCE.md, ## train).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindvl_ms.ops.softmax import log_softmax
from mindvl_ms.parallel.moe import EPExperts
from mindvl_ms.train.loss import IGNORE
from mindvl_ms.train.step_cells import MicroStep
from mindvl_ms.train.train_step import StepResult, TrainStep, ms_dtype


def target_logp(logits, targets, temperature: float = 1.0):
    """log p(target) per position and the supervised mask. [B, L, V], [B, L] -> ([B, L], [B, L]) fp32.
    Also the entropy of the predictive distribution per position (stop-gradient; a metric).
    temperature != 1 scores the distribution softmax(logits / temperature) that sampling drew from."""
    if temperature != 1.0:
        logits = logits / temperature
    b, l, v = logits.shape
    mask = (targets != IGNORE).astype(ms.float32)                      # [B, L]
    safe = ops.select(targets != IGNORE, targets, ops.zeros_like(targets))
    logp_all = log_softmax(logits.astype(ms.float32).reshape(b * l, v), -1)  # [B*L, V]
    logp = ops.gather_elements(logp_all, 1, safe.reshape(-1, 1)).reshape(b, l)
    lp = ops.stop_gradient(logp_all)
    entropy = -(ops.exp(lp) * lp).sum(-1).reshape(b, l)                # [B, L]
    return logp * mask, mask, entropy * mask


class LogProbs(nn.Cell):
    """(*model inputs, targets [B, L]) -> log p(target) [B, L] (0 at IGNORE targets), forward only."""

    def __init__(self, model: nn.Cell, n_model: int, temperature: float = 1.0):
        super().__init__(auto_prefix=False)
        self.model, self.n_model, self.temperature = model, n_model, float(temperature)

    def construct(self, *args):
        out = self.model(*args[:self.n_model])
        logits = out[0] if isinstance(out, tuple) else out             # [B, L, V]
        logp, _, _ = target_logp(logits, args[self.n_model], self.temperature)
        return logp


class PolicyForward(nn.Cell):
    """(*model inputs, *objective inputs, aux_weight [], scale []) -> (loss share * scale, stats).
    aux_weight = 1 / (micro-batches x ranks) of this step: the MoE aux loss enters as a batch mean."""

    def __init__(self, model: nn.Cell, objective: nn.Cell, n_model: int):
        super().__init__(auto_prefix=False)
        self.model, self.objective, self.n_model = model, objective, n_model

    def construct(self, *args):
        out = self.model(*args[:self.n_model])
        logits = out[0] if isinstance(out, tuple) else out             # [B, L, V]
        loss, stats = self.objective(logits, *args[self.n_model:-2])
        if isinstance(out, tuple):
            loss = loss + out[1].astype(ms.float32) * args[-2]         # MoE sequence-wise aux loss
        return loss * args[-1], stats


class PostTrainStep(TrainStep):
    """TrainStep with an objective cell; `run_arrays` takes ready host arrays per micro-batch."""

    def __init__(self, model, params, input_names, objective: nn.Cell, stage, dp: int = 1, allreduce_host=None,
                 precision: str = "float32", loss_scale_value: float = 65536.0, loss_scale_factor: float = 2.0,
                 loss_scale_window: int = 1000, temperature: float = 1.0):
        super().__init__(model, params, input_names, stage.loss, stage, dp, allreduce_host, precision,
                         loss_scale_value, loss_scale_factor, loss_scale_window)
        n_model = len(self.input_names)
        self.objective, self.micro_model = objective, model
        self.micro = MicroStep(PolicyForward(model, objective, n_model), params, self.accum)
        self.logprobs = LogProbs(model, n_model, temperature)
        self._lp_shaped = False
        self.bias_updater = None
        self.extra_state: Dict[str, Parameter] = {}  # objective state checkpointed with the optimizer

    def state_parameters(self) -> Dict[str, Parameter]:
        return {**super().state_parameters(), **self.extra_state}

    def model_arrays(self, mb: Dict[str, np.ndarray]) -> List[np.ndarray]:
        return [np.ascontiguousarray(mb[k]) for k in self.input_names]

    def target_logp(self, mb: Dict[str, np.ndarray]) -> np.ndarray:
        """Forward-only per-token log-probs of mb['targets'] under the current weights. -> [B, L]."""
        arrays = self.model_arrays(mb) + [mb["targets"].astype(np.int32)]
        if not self._lp_shaped:
            self.logprobs.set_inputs(*[Tensor(shape=[None] * a.ndim, dtype=ms_dtype(a)) for a in arrays])
            self._lp_shaped = True
        return self.logprobs(*[Tensor(a) for a in arrays]).asnumpy()

    def run_arrays(self, arrays: Sequence[Sequence[np.ndarray]], lr: float) -> Tuple[StepResult, np.ndarray]:
        """One optimizer step over this rank's micro-batches (model arrays + objective arrays each).
        Returns the step result and the stats summed over micro-batches (this rank only)."""
        if not self._shaped:
            dyn = [Tensor(shape=[None] * a.ndim, dtype=ms_dtype(a)) for a in arrays[0]]
            self.micro.set_inputs(*dyn, Tensor(shape=[], dtype=ms.float32), Tensor(shape=[], dtype=ms.float32))
            self._shaped = True
        scale = Tensor(self.scale.asnumpy(), ms.float32)
        aux = Tensor(1.0 / (len(arrays) * self.dp), ms.float32)
        loss_sum, stats = 0.0, None
        before = len(self.micro.compile_cache)
        for arr in arrays:
            loss, st = self.micro(*[Tensor(a) for a in arr], aux, scale)
            loss_sum += float(loss.asnumpy())
            stats = st.asnumpy() if stats is None else stats + st.asnumpy()
        self.compiles += len(self.micro.compile_cache) - before
        loss, norm, applied = self.apply(loss_sum, lr)
        toks = sum(int((arr[self.input_names.index("segment_ids")] > 0).sum()) for arr in arrays)
        return StepResult(loss, norm, applied, float(self.scale.asnumpy()), toks, 0, 0), stats

    def reset_state(self, loss_scale_value: float) -> None:
        """The state a new step starts with: zero accumulators and AdamW moments, step 0, the initial loss
        scale, no objective state; the compiled graphs stay."""
        for p in list(self.accum) + list(self.update.m) + list(self.update.v):
            p.set_data(Tensor(np.zeros(p.shape, ms.dtype_to_nptype(p.dtype))))
        self.update.step.set_data(Tensor(0, ms.int32))
        self.scale.set_data(Tensor(loss_scale_value if self.dynamic else 1.0, ms.float32))
        self.good.set_data(Tensor(0, ms.int32))
        self.extra_state = {}
        self.compiles = 0

    def retarget(self, objective: nn.Cell, temperature: float) -> None:
        """Another objective (a new micro-step on the same accumulators) and/or sampling temperature (a new
        LogProbs); the reduce, AdamW and zeroing graphs stay compiled."""
        n_model = len(self.input_names)
        self.objective = objective
        self.micro = MicroStep(PolicyForward(self.micro_model, objective, n_model), self.params, self.accum)
        self._shaped = False
        if float(temperature) != self.logprobs.temperature:
            self.logprobs = LogProbs(self.micro_model, n_model, temperature)
            self._lp_shaped = False


_CACHED = "_mindvl_post_train_step"  # attribute of the network: (signatures, PostTrainStep) of its last post stage


def cached_post_step(net: nn.Cell):
    """The post-training step last built for `net` (None before the first)."""
    entry = vars(net).get(_CACHED)
    return entry[1] if entry else None


def drop_post_step(net: nn.Cell) -> None:
    """Drop the post-training step kept on `net` (an SFT stage follows: its state need not stay allocated)."""
    vars(net).pop(_CACHED, None)


def post_train_step(net, params, input_names, objective: nn.Cell, objective_key: tuple, stage, dp: int = 1,
                    allreduce_host=None, precision: str = "float32", loss_scale_value: float = 65536.0,
                    loss_scale_factor: float = 2.0, loss_scale_window: int = 1000,
                    temperature: float = 1.0) -> PostTrainStep:
    """A PostTrainStep for a post stage. The one kept on `net` when its reduce and AdamW graphs were built from
    the same parameters (the same Parameter objects), inputs, AdamW constants, dp, precision and expert-parallel
    dispatcher lengths (`parallel.moe.set_moe_seq_length`, read when a graph is traced): its state
    reset (`reset_state`), and its micro-step / LogProbs rebuilt only when the objective constants
    (`objective_key`) / the temperature differ (`retarget`); else a new one. The step is kept on `net` (one per
    network: its accumulators and moments live as long as the network or until the next post stage)."""
    traced = tuple(c.seq_length for _, c in net.cells_and_names() if isinstance(c, EPExperts))  # in the graphs
    base = (tuple(input_names), traced, dp, precision, tuple(sorted(stage.lr_prefixes().items())),
            float(stage.weight_decay), float(stage.adam_beta1), float(stage.adam_beta2), float(stage.adam_eps))
    entry = vars(net).get(_CACHED)
    if entry is not None and entry[0][0] == base and len(entry[1].params) == len(params) and \
            all(a is b for a, b in zip(entry[1].params, params)):
        engine = entry[1]
        if entry[0][1] != objective_key or engine.logprobs.temperature != float(temperature):
            engine.retarget(objective, temperature)
        engine.reset_state(loss_scale_value)
        engine.clip, engine.allreduce_host = float(stage.grad_clip), allreduce_host or (lambda x: x)
        engine.factor, engine.window = float(loss_scale_factor), int(loss_scale_window)
    else:
        vars(net).pop(_CACHED, None)  # the old step's state goes before the new one is allocated
        engine = PostTrainStep(net, params, input_names, objective, stage, dp, allreduce_host, precision,
                               loss_scale_value, loss_scale_factor, loss_scale_window, temperature)
    object.__setattr__(net, _CACHED, ((base, objective_key), engine))
    return engine
