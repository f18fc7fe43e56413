"""DPO stage in the trainer on a tiny MindVL (pairs as two segments of one row, NTP rows mixed in, MPO
losses): the chosen/rejected margin grows, the stage run again on the same model (its kept step, state reset)
is bit-identical, and resuming from a mid-stage checkpoint is exact (on the process's tiny model,
tests/support/post.py fresh_model)."""
import os
import shutil

import numpy as np
import pytest

from mindvl_ms.train import load_run_config
from mindvl_ms.train.post.sources import post_data_factory
from mindvl_ms.train.post.step import cached_post_step

from tests.support import post as H

DPO_STAGE = {"name": "dpo", "type": "dpo", "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 2,
             "max_lr": 5e-3, "warmup_ratio": 0.0, "epochs": None, "max_steps": 3, "save_every": 1,
             "weight_decay": 0.0,
             "dpo": {"beta": 0.5, "sft_weight": 0.5, "quality_weight": 0.2, "ntp_sources": ["unused.jsonl"],
                     "ntp_ratio": 1.0}}


@pytest.mark.slow  # about 12 s: a DPO stage, its kill and resume
def test_dpo_margin_grows_and_resume_is_exact(tmp_path):
    fresh = H.fresh_model()
    out = str(tmp_path / "a")
    model, summary, recs = H.run(out, DPO_STAGE, lambda *a: H.pair_source(), model=fresh())
    m = [r["margin"] for r in recs]
    assert abs(m[0]) < 1e-4                 # policy == reference at the first step
    assert m[2] > m[1] > m[0]               # the chosen/rejected margin grows
    assert recs[2]["pref_accuracy"] == 1.0
    assert all(r["bco_delta"] == 0.0 for r in recs[:1]) and recs[2]["bco_delta"] != 0.0
    assert os.path.isfile(os.path.join(out, "dpo", "reference_logps.npz"))
    assert os.path.isfile(os.path.join(out, "dpo", "post_metrics.png"))
    final = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    engine = cached_post_step(model)
    # the stage again from the initial weights: the step kept on the model (train/post/step.py post_train_step)
    # with its moments, step, accumulators and the BCO delta reset gives the same weights and metrics, bit for bit
    _, _, recs_c = H.run(str(tmp_path / "c"), DPO_STAGE, lambda *a: H.pair_source(), plot=False, model=fresh())
    assert cached_post_step(model) is engine and engine.compiles == 0
    for k, v in final.items():
        np.testing.assert_array_equal(model.parameters_dict()[k].asnumpy(), v, err_msg=k)
    clock = ("step_time", "tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in clock} for r in recs_c] == \
        [{k: v for k, v in r.items() if k not in clock} for r in recs]
    # resume from the step-2 checkpoint in a copy of the run: same final weights and metrics
    b = str(tmp_path / "b")
    shutil.copytree(out, b)
    model_b, _, recs_b = H.run(b, DPO_STAGE, lambda *a: H.pair_source(), resume=os.path.join(b, "dpo", "checkpoint-000002"),
                               model=fresh())
    for k, v in final.items():
        np.testing.assert_array_equal(model_b.parameters_dict()[k].asnumpy(), v, err_msg=k)
    assert [r["margin"] for r in recs_b] == m


def test_a_post_training_source_in_another_format_is_refused(tmp_path):
    """Preference and prompt lines are read as this project's JSONL only: a `format: llava` source is named."""
    src = tmp_path / "pairs.json"
    src.write_text("[]")
    stage = dict(DPO_STAGE, data={"sources": [{"path": str(src), "format": "llava"}]})
    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "plot": False, "stages": [stage]})
    with pytest.raises(ValueError, match=r"stage 'dpo' \(dpo\): source .*pairs.json: format 'llava'"):
        post_data_factory(cfg, cfg.stages[0], 0, None)
