"""GRPO stage in the trainer on a tiny MindVL (rollouts with the KV-cache engine's sampler, verifier rewards
from a `module:function` name): metrics per step, a rising reward, exact resume; rollouts reproducible from a
seed; a GRPO stage without a sampler is a clear error.

The GRPO and KV-cache sampling tests share one tiny model (`fresh`, the process's: tests/support/post.py
fresh_model), handed to each at its seed-0 initial weights, so the graphs compiled on it (the engine's vision,
prefill and decode cells, the post step kept on it) are compiled once."""
import os
import shutil

import mindspore as ms
import numpy as np
import pytest

from mindvl_ms.config.base import ConfigError
from mindvl_ms.infer.rollout import EngineSampler
from tests.support import post as H
from mindvl_ms.infer.generate import generate
from mindvl_ms.infer.rollout import sample_group, sample_groups
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.post.sampler import rollout_seed
from mindvl_ms.train.post.step import cached_post_step

GRPO_STAGE = {"name": "grpo", "type": "grpo", "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 2,
              "max_lr": 2e-2, "warmup_ratio": 0.0, "epochs": None, "max_steps": 4, "weight_decay": 0.0,
              "save_every": 1, "keep_last": 4,
              "grpo": {"group_size": 4, "mini_batch_size": 4, "max_new_tokens": 4,
                       "reward": "tests.support.post:low_ids", "kl_coef": 0.01}}


@pytest.fixture(scope="module")
def fresh():
    """fresh() -> the process's tiny MindVL at its seed-0 initial weights (tests/support/post.py fresh_model)."""
    return H.fresh_model()


@pytest.mark.slow
def test_grpo_stage_logs_learns_and_resumes_exactly(tmp_path, fresh):
    out = str(tmp_path / "g")
    model, summary, recs = H.run(out, GRPO_STAGE, lambda *a: H.prompt_source(), model=fresh())
    assert len(recs) == 4 and all(r["applied"] for r in recs)
    for r in recs:
        assert r["updates"] == 2 and r["response_length"] == 4.0
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_std"] >= 0 and 0 <= r["clip_frac"] <= 1
        assert r["entropy"] > 0 and r["kl"] >= 0
    assert 0 < recs[0]["kl"] < recs[-1]["kl"]  # step 0: 0 on the first update, > 0 on the second
    assert recs[0]["clip_frac"] >= 0 and os.path.isfile(os.path.join(out, "grpo", "reference_weights.npz"))
    assert os.path.isfile(os.path.join(out, "grpo", "post_metrics.png"))
    assert recs[-1]["reward_mean"] > recs[0]["reward_mean"] + 0.1  # measured: 0.31 -> 0.59
    # resume from the step-2 checkpoint (rollouts seeded by step and prompt; the KL reference reloaded), with
    # the step the first run built on the model (train/post/step.py post_train_step)
    final = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    engine = cached_post_step(model)
    b = str(tmp_path / "b")
    shutil.copytree(out, b)
    model_b, _, recs_b = H.run(b, GRPO_STAGE, lambda *a: H.prompt_source(), plot=False,
                               resume=os.path.join(b, "grpo", "checkpoint-000002"), model=fresh())
    for k, v in final.items():
        np.testing.assert_array_equal(model_b.parameters_dict()[k].asnumpy(), v, err_msg=k)
    assert cached_post_step(model_b) is engine and engine.compiles == 0
    keys = ("loss", "reward_mean", "clip_frac", "entropy", "kl", "response_length")
    assert [[r[k] for k in keys] for r in recs_b] == [[r[k] for k in keys] for r in recs]


def test_rollouts_reproducible_from_seed(fresh):
    model = fresh()
    p = H.prompt(np.random.default_rng(3))
    a = sample_group(model, p, 4, rollout_seed(0, 1, 3), 6)
    b = sample_group(model, p, 4, rollout_seed(0, 1, 3), 6)
    c = sample_group(model, p, 4, rollout_seed(0, 2, 3), 6)
    assert a == b and a != c
    assert len({tuple(x) for x in a}) > 1   # temperature-1 sampling differs within the group
    greedy = generate(model, [{k: p[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}], 6)[0]
    cold = sample_group(model, p, 4, rollout_seed(0, 1, 3), 6, temperature=1e-4)
    assert cold == [greedy] * 4             # temperature -> 0 is greedy decoding
    assert rollout_seed(0, 1, 3) != rollout_seed(0, 1, 4) != rollout_seed(1, 1, 3)


def test_batched_groups_sample_what_each_prompt_samples_alone(fresh):
    """Several prompts of different lengths in one engine call (left-padded, one generator per prompt)
    give each prompt the responses of its own `sample_group` call."""
    model = fresh()
    rng = np.random.default_rng(5)
    prompts = [H.prompt(rng) for _ in range(3)]
    prompts[1] = dict(prompts[1], input_ids=np.concatenate([prompts[1]["input_ids"][:4], [11, 12, 13],
                                                            prompts[1]["input_ids"][4:]]))
    assert len({len(p["input_ids"]) for p in prompts}) > 1
    seeds = [rollout_seed(0, 1, i) for i in range(3)]
    together = sample_groups(model, prompts, 4, seeds, 8)
    alone = [sample_group(model, p, 4, s, 8) for p, s in zip(prompts, seeds)]
    assert together == alone
    assert together[0] != together[2]


def test_full_forward_path_samples_each_group_from_its_own_generator():
    """Without the KV cache (use_cache=False, the DeepSeek-V3 MLA path) the rows of a group still differ
    (they draw in turn from one generator) and a group draws what it draws alone."""
    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "stages": [{"name": "x", "max_steps": 1}]})
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    rng = np.random.default_rng(6)
    rows = [{k: p[k] for k in ("input_ids", "pixel_values", "image_grid_thw")} for p in
            (H.prompt(rng), H.prompt(rng))]
    kw = dict(do_sample=True, use_cache=False)
    both = generate(model, [rows[0]] * 3 + [rows[1]] * 3, 5, group_seeds=[(7, 3), (8, 3)], **kw)
    assert len({tuple(x) for x in both[:3]}) > 1
    assert both[3:] == generate(model, [rows[1]] * 3, 5, seed=8, **kw)
    assert both[:3] == generate(model, [rows[0]] * 3, 5, seed=7, **kw)


def test_grpo_stage_without_a_sampler_is_a_clear_error(tmp_path):
    """train/ cannot sample by itself (infer/ is above it): the caller passes the sampler."""
    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "plot": False, "stages": [GRPO_STAGE]})
    with pytest.raises(ValueError, match=r"stage 'grpo' \(grpo\) samples responses but no sampler was given"):
        run_training(cfg, str(tmp_path / "x"), model=MindVLModel(cfg.model),
                     data_factory=lambda *a: H.prompt_source(), progress=False)


def test_a_later_grpo_stage_is_checked_before_the_first_stage_trains(tmp_path):
    """A reward name that resolves to no verifier, or a missing sampler, in the chain's last stage stops the
    run before its first stage takes a step (nothing is written)."""
    sft = dict(GRPO_STAGE, name="sft", type="sft")
    sft.pop("grpo")
    bad = dict(GRPO_STAGE, grpo=dict(GRPO_STAGE["grpo"], reward="exactmatch"))
    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "plot": False, "stages": [sft, bad]})
    out = tmp_path / "x"
    with pytest.raises(ConfigError, match="stage 'grpo': grpo.reward: unknown reward 'exactmatch'"):
        run_training(cfg, str(out), model=MindVLModel(cfg.model), data_factory=lambda *a: H.prompt_source(),
                     progress=False, sampler=EngineSampler())
    assert not out.exists() or not any(out.iterdir())
    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "plot": False, "stages": [sft, GRPO_STAGE]})
    with pytest.raises(ValueError, match="no sampler was given"):
        run_training(cfg, str(out), model=MindVLModel(cfg.model), data_factory=lambda *a: H.prompt_source(),
                     progress=False)
    assert not out.exists() or not any(out.iterdir())
