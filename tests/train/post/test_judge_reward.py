"""Judge rewards: a `package.module:function` reward that scores with a loaded checkpoint
(tests/train/post/judge_reward.py), used by name through the GRPO verifier as a stage's `grpo.reward` and as a
prompt line's `"reward"`; the checkpoint is loaded once and its scores are the saved model's.

    python -m pytest -q tests/train/post/test_judge_reward.py
"""
import math
import os

import pytest

from mindvl_ms import MindVLForConditionalGeneration, MindVLProcessor
from mindvl_ms.config import MindVLConfig, load, read_yaml
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.processor import save_processor
from mindvl_ms.train.post.rewards import Verifier
from mindvl_ms.train.post.stage import verifier_of
from tests.support.paths import ROOT
from tests.train.post import judge_reward as J

NAME = "tests.train.post.judge_reward:judge_reward"
RESPONSES = ["\\boxed{4}", "four", "The answer is 4."]


@pytest.fixture(scope="module")
def judge_ckpt(tmp_path_factory):
    """A tiny MindVL checkpoint written by save_pretrained (with its processor), and the expected scores computed
    with the in-memory model before it was saved."""
    d = read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    d["vision"].update(depth=1, fullatt_block_indexes=[0], hidden_size=32, intermediate_size=32, num_heads=2,
                       out_hidden_size=32)
    d["text"].update(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, mrope_section=[2, 3, 3], max_position_embeddings=128)
    model = MindVLForConditionalGeneration(load(MindVLConfig, d, "tiny.yaml"))
    path = str(tmp_path_factory.mktemp("judge") / "ckpt")
    model.save_pretrained(path)
    data = DataConfig(system_prompt="")
    save_processor(path, data_cfg=data)
    proc = MindVLProcessor(config=data)
    expected = {r: math.exp(-float(model(**proc(messages=J.judge_prompt(r, "4"))).loss.asnumpy())) for r in RESPONSES}
    return path, expected


def test_a_judge_checkpoint_scores_responses_through_the_grpo_verifier(judge_ckpt, monkeypatch):
    path, expected = judge_ckpt
    monkeypatch.setenv(J.JUDGE_ENV, path)
    stage = {"name": "rl", "type": "grpo", "global_batch_size": 2,
             "grpo": {"reward": NAME, "accuracy_weight": 1.0, "format_weight": 0.5}}
    verifier = verifier_of(load_run_config(data={"stages": [stage]}).stages[0])  # what the GRPO driver uses
    scores = {r: verifier(r, "4") for r in RESPONSES}
    for r in RESPONSES:
        assert 0.0 < expected[r] <= 1.0
        assert scores[r] == pytest.approx(expected[r] + 0.5 * (r == "\\boxed{4}"), rel=1e-5, abs=1e-9)
    assert len(set(expected.values())) == len(RESPONSES)             # the scores depend on the response
    # a prompt line naming the judge overrides the stage's default verifier
    line = Verifier("exact_match")
    assert line("four", "4") == 0.0
    assert line("four", "4", reward=NAME) == pytest.approx(expected["four"], rel=1e-5)
    assert J.LOADS.count(path) == 1                                    # loaded once for every call


def test_a_judge_without_its_checkpoint_is_named(monkeypatch):
    monkeypatch.delenv(J.JUDGE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="set MINDVL_JUDGE"):
        Verifier(NAME)("x", "y")
