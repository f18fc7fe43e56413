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
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

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
    logp_all = ops.log_softmax(logits.astype(ms.float32).reshape(b * l, v), -1)  # [B*L, V]
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
        self.objective = objective
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
