"""The post-training step kept on a network (train/post/step.py `post_train_step`): a later post stage on the
same network takes it back, its state reset, its micro-step and LogProbs rebuilt only when the objective or
the temperature differ, and trains bit-identically to the new step it was (TinyVLM: small graphs)."""
import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindvl_ms.config.base import load
from mindvl_ms.config.train import StageConfig
from mindvl_ms.train.loss import IGNORE
from mindvl_ms.train.post.grpo import GRPOObjective
from mindvl_ms.train.post.step import cached_post_step, post_train_step
from tests.support.train_tiny import TinyVLM, collate, make_rows

STAGE = load(StageConfig, {"name": "g", "seq_length": 24, "global_batch_size": 2, "micro_batch_size": 2,
                           "max_steps": 2, "max_lr": 1e-2, "weight_decay": 0.0}, "test")


def _model():
    ms.set_seed(0)
    return TinyVLM()


def _train(engine, steps=2):
    """`steps` GRPO updates of two micro-batches each (old log-probs from the engine's LogProbs, fixed
    advantages). -> (per-step losses and stats, final parameters)."""
    out = []
    for step in range(steps):
        arrays = []
        for k in range(2):
            mb = collate(make_rows(2, seed=10 * step + k), STAGE)
            adv = np.random.default_rng(step + k).standard_normal(mb["targets"].shape).astype(np.float32)
            adv = np.where(mb["targets"] != IGNORE, adv, 0.0).astype(np.float32)
            old = engine.target_logp(mb)
            arrays.append(engine.model_arrays(mb) + [mb["targets"].astype(np.int32), old, old - 0.05, adv,
                                                     np.float32((mb["targets"] != IGNORE).sum())])
        res, stats = engine.run_arrays(arrays, 1e-2)
        out.append((res.loss, res.grad_norm, stats.tolist()))
    return out, {p.name: p.asnumpy().copy() for p in engine.params}


def _step(model, kl_coef, temperature=1.0, stage=STAGE):
    objective = GRPOObjective(0.2, 0.28, kl_coef, temperature)
    return post_train_step(model, model.trainable_params(), model.INPUT_NAMES, objective, objective.key, stage,
                           temperature=temperature)


def _reset(model, init):
    for p in model.get_parameters():
        p.set_data(Tensor(init[p.name]))


def test_a_kept_step_trains_like_a_new_one():
    model = _model()
    init = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    first = _step(model, 0.05)
    assert cached_post_step(model) is first
    ref, ref_params = _train(first)  # a new step: the reference
    assert any(not np.array_equal(v, init[k]) for k, v in ref_params.items())  # it did train
    reduce, update, logprobs, micro = first.reduce, first.update, first.logprobs, first.micro

    # another objective on the same network: the same step and graphs but a new micro-step; it trains
    # otherwise (and leaves moments, step and accumulators of its own)
    _reset(model, init)
    other = _step(model, 0.5)
    assert other is first and other.micro is not micro and other.logprobs is logprobs
    assert other.reduce is reduce and other.update is update
    assert int(other.update.step.asnumpy()) == 0 and not any(np.abs(m.asnumpy()).max() for m in other.update.m)
    got, _ = _train(other)
    assert got != ref

    # back to the first objective: rebuilt, its state reset, the reference bit for bit
    _reset(model, init)
    back = _step(model, 0.05)
    assert back is first and back.micro is not micro
    got, params = _train(back)
    assert got == ref
    for k, v in ref_params.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)

    # the same objective again: nothing rebuilt, nothing compiled, the reference again
    micro = back.micro
    _reset(model, init)
    again = _step(model, 0.05)
    assert again is first and again.micro is micro
    got, params = _train(again)
    assert got == ref and again.compiles == 0
    for k, v in ref_params.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)

    # another sampling temperature: a new LogProbs; other AdamW constants: a new step
    assert _step(model, 0.05, 0.7).logprobs is not logprobs and first.logprobs.temperature == 0.7
    wd = load(StageConfig, {"name": "g", "seq_length": 24, "max_steps": 2, "weight_decay": 0.1}, "test")
    fourth = _step(model, 0.05, stage=wd)
    assert fourth is not first and cached_post_step(model) is fourth
