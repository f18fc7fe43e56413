"""Post-training stage config: the openPangu-VL-7B dpo/grpo stages (report 4.2) and the errors that name
the key."""
import os

import pytest

from mindvl_ms.config.base import ConfigError
from mindvl_ms.config.train import load_run_config

from tests.support.paths import ROOT  # noqa: E402


def test_openpangu_post_training_stages():
    c = load_run_config(os.path.join(ROOT, "configs", "stage", "openpangu-vl-7b.yaml"))
    s = {x.name: x for x in c.stages}
    assert [x.type for x in c.stages] == ["sft"] * 4 + ["dpo", "grpo"]
    g = s["grpo"]
    assert (g.max_lr, g.min_lr, g.global_batch_size, g.seq_length) == (1e-6, 1e-6, 512, 24576)
    assert (g.grpo.group_size, g.grpo.mini_batch_size, g.grpo.temperature, g.grpo.kl_coef) == (8, 2048, 1.0, 0.0)
    assert g.grpo.clip_high > g.grpo.clip_low                      # clip-higher
    assert g.grpo.updates_per_step(g.global_batch_size) == 2       # 512 x 8 / 2048
    assert g.grpo.format_weight > 0 and g.grpo.accuracy_weight > 0  # format + accuracy rewards
    d = s["dpo"]
    assert d.dpo.preference_weight > 0 and d.dpo.sft_weight > 0 and d.dpo.quality_weight == 0
    assert d.dpo.ntp_ratio == 1.0 and d.dpo.ntp_rows(d.global_batch_size, 8) == 128  # the NTP mix is on


def _stage(**kw):
    st = {"name": "p", "epochs": None, "max_steps": 1, "global_batch_size": 4, "micro_batch_size": 1}
    st.update(kw)
    return {"stages": [st]}


@pytest.mark.parametrize("stage,msg", [
    ({"type": "ppo"}, "expected sft, dpo or grpo"),
    ({"type": "grpo", "grpo": {"group_size": 1}}, "group_size must be >= 2"),
    ({"type": "grpo", "grpo": {"mini_batch_size": 3}}, "must divide global_batch_size x group_size = 32"),
    ({"type": "grpo", "grpo": {"reward": "exact match"}}, "grpo.reward 'exact match': expected a verifier name"),
    ({"type": "grpo", "grpo": {"clip_low": 1.0}}, "0 <= clip_low < 1"),
    ({"type": "grpo", "grpo": {"top_p": 0.0}}, "0 < top_p <= 1"),
    ({"type": "dpo", "dpo": {"beta": 0.0}}, "dpo.beta must be > 0"),
    ({"type": "dpo", "dpo": {"preference_weight": 0.0}}, "not all 0"),
    ({"type": "dpo", "dpo": {"ntp_sources": ["sft.jsonl"]}}, "mixed in only with dpo.ntp_ratio > 0"),
    ({"type": "dpo", "dpo": {"ntp_ratio": -0.5}}, "dpo.ntp_ratio must be >= 0"),
    ({"type": "dpo", "dpo": {"ntp_batch_size": 2}}, "dpo.ntp_batch_size' was replaced by dpo.ntp_ratio"),
    ({"type": "dpo", "dpo": {"bta": 0.1}}, "did you mean 'beta'"),
])
def test_errors(stage, msg):
    with pytest.raises(ConfigError, match=msg):
        load_run_config(data=_stage(**stage))


def test_unknown_reward_is_an_error_naming_the_key_when_the_stage_is_built():
    from mindvl_ms.train.post.stage import verifier_of

    st = load_run_config(data=_stage(type="grpo", grpo={"reward": "exactmatch"})).stages[0]  # a well-formed name
    with pytest.raises(ConfigError, match="stage 'p': grpo.reward: unknown reward 'exactmatch'"):
        verifier_of(st)
