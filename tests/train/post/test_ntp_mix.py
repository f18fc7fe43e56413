"""The DPO stage's NTP mix is a ratio (`dpo.ntp_ratio`, NTP rows per preference pair; openPangu-VL report 4.2:
"we also proportionally mix in the remaining SFT data"): the count per step follows the pairs, a ratio without
SFT files is named, the old fixed-count key names its replacement. The stage test trains the process's tiny
model (tests/support/post.py fresh_model) with the objective constants of tests/train/post/test_dpo_train.py,
so in one process with that module it reuses the post step compiled there.

    python -m pytest -q tests/train/post/test_ntp_mix.py
"""
import json

import pytest

from mindvl_ms.config.base import ConfigError
from mindvl_ms.config.post import DPOConfig
from mindvl_ms.config.train import load_run_config
from mindvl_ms.train.post.sources import post_data_factory

from tests.support import post as H


@pytest.mark.parametrize("ratio,pairs,dp,rows", [
    (1.0, 128, 8, 128),   # the openPangu-VL DPO stage: one SFT row per pair
    (0.5, 4, 1, 2),       # configs/demo/post.yaml
    (0.5, 2, 1, 1),
    (0.25, 128, 8, 32),
    (2.0, 16, 2, 32),
    (0.01, 8, 2, 2),      # on means on: at least one row per rank
    (0.0, 128, 8, 0),
])
def test_ntp_rows_are_proportional_to_the_pairs(ratio, pairs, dp, rows):
    n = DPOConfig(ntp_ratio=ratio, ntp_sources=["sft.jsonl"] if ratio else []).ntp_rows(pairs, dp)
    assert n == rows and n % dp == 0  # every rank draws the same share


def _stage(tmp_path, **dpo):
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}],
                                                      "chosen": "a", "rejected": "b"}) + "\n")
    return {"name": "d", "type": "dpo", "epochs": None, "max_steps": 1, "global_batch_size": 1,
            "data": {"sources": [{"path": str(tmp_path / "pairs.jsonl")}]}, "dpo": dpo}


def test_a_ratio_without_sft_files_is_named(tmp_path):
    cfg = load_run_config(data={"stages": [_stage(tmp_path, ntp_ratio=1.0)]})  # loads: the files come later
    with pytest.raises(ValueError, match=r"stage 'd' \(dpo\): dpo.ntp_ratio 1.0 mixes in SFT rows, but "
                                         r"dpo.ntp_sources is empty"):
        post_data_factory(cfg, cfg.stages[0], 0, None)
    (tmp_path / "empty.jsonl").write_text("")
    cfg = load_run_config(data={"stages": [_stage(tmp_path, ntp_ratio=1.0, ntp_sources=[str(tmp_path / "empty.jsonl")])]})
    with pytest.raises(ValueError, match="hold no samples"):
        post_data_factory(cfg, cfg.stages[0], 0, None)


def test_the_old_fixed_count_names_the_ratio():
    with pytest.raises(ConfigError, match=r"dpo.ntp_batch_size' was replaced by dpo.ntp_ratio, NTP rows per "
                                          r"preference pair \(ntp_batch_size / global_batch_size"):
        load_run_config(data={"stages": [{"name": "d", "type": "dpo", "dpo": {"ntp_batch_size": 2}}]})


def test_a_dpo_step_draws_ratio_times_pairs_ntp_rows(tmp_path):
    """Two steps of 4 pairs at ntp_ratio 0.5 on the tiny model: the NTP stream (5 rows) advances 2 rows a step."""
    src = H.pair_source(n=8, n_ntp=5)
    stage = {"name": "dpo", "type": "dpo", "seq_length": 64, "global_batch_size": 4, "micro_batch_size": 2,
             "max_lr": 1e-3, "warmup_ratio": 0.0, "epochs": None, "max_steps": 2, "weight_decay": 0.0,
             "dpo": {"beta": 0.5, "sft_weight": 0.5, "quality_weight": 0.2, "ntp_sources": ["unused.jsonl"],
                     "ntp_ratio": 0.5}}
    _, _, recs = H.run(str(tmp_path / "run"), stage, lambda *a: src, plot=False, model=H.fresh_model()())
    assert len(recs) == 2 and all(r["applied"] for r in recs)
    assert (src.ntp.epoch, src.ntp.pos) == (0, 4) and (src.main.epoch, src.main.pos) == (1, 0)
