"""Run/stage configs (the paper recipes), strategy validation, CPU refusal of non-data parallelism,
the `mindvl train` command line, and fp16 training with dynamic loss scaling."""
import json
import os

import mindspore as ms
import numpy as np
import pytest

from mindvl_ms.cli import main
from mindvl_ms.config.base import ConfigError
from mindvl_ms.config.train import load_run_config
from mindvl_ms.parallel.runtime import setup, validate_strategy
from mindvl_ms.train import run_training
from mindvl_ms.train.batches import RowSource
from tests.support.paths import ROOT
from tests.support.train_tiny import TinyVLM, collate, make_rows

STAGE = os.path.join(ROOT, "configs", "stage")


def stage_table(path):
    c = load_run_config(os.path.join(STAGE, path))
    return c, [(s.name, s.trainable, s.token_budget, s.epochs, s.seq_length, s.global_batch_size, s.warmup_ratio,
                s.max_lr, s.min_lr) for s in c.stages]


def test_mindvl_table1_8b_and_671b():
    c, t = stage_table("mindvl-8b.yaml")
    assert t == [("warmup", "projector", 256e9, 1.0, 8192, 1024, 0.1, 1e-3, 0.0),
                 ("multitask", "all", 179e9, 1.0, 8192, 1024, 0.1, 2e-5, 1e-5),
                 ("sft", "all", 12e9, 1.0, 8192, 512, 0.1, 1e-5, 0.0)]
    assert c.model.text.hidden_size == 4096
    c, t = stage_table("mindvl-671b.yaml")
    assert [x[2] for x in t] == [16e9, 80e9, 12e9]
    assert [(x[7], x[8]) for x in t] == [(2e-4, 1e-5), (5e-6, 5e-7), (2e-6, 2e-7)]
    assert c.model.text.model_type == "deepseek_v3"
    validate_strategy(c.model, c.parallel_config, world=512)  # the shipped 671B layout fits the model


def test_openpangu_table2():
    c, _ = stage_table("openpangu-vl-7b.yaml")
    s = {x.name: x for x in c.stages}
    assert list(s) == ["warmup", "pretraining", "annealing", "sft", "dpo", "grpo"]  # post-training: test_post_config
    assert s["warmup"].trainable == "projector" and s["pretraining"].trainable == "all"
    assert [x.global_batch_size for x in c.stages[:4]] == [1024, 1024, 128, 128]
    assert [x.seq_length for x in c.stages[:4]] == [24576, 24576, 131072, 131072]
    assert [(x.max_lr, x.min_lr) for x in c.stages[:4]] == [(5e-4, 3e-5), (3e-5, 3e-6), (2.5e-6, 2.5e-6), (2e-5, 2e-6)]
    assert s["sft"].lr_prefixes()["visual."] == 0.1 and s["sft"].epochs == 2
    assert s["sft"].loss.type == "balanced" and s["sft"].loss.tau1 == 0.1 and s["sft"].loss.tau2 == 2.0


def base(**stage):
    st = {"name": "s", "max_steps": 1, "global_batch_size": 4, "micro_batch_size": 2}
    st.update(stage)
    return {"model": os.path.join(ROOT, "configs", "model", "tiny.yaml"), "stages": [st]}


def test_errors_name_the_key():
    with pytest.raises(ConfigError, match="did you mean 'max_lr'"):
        load_run_config(data=base(max_lrr=1.0))
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size"):
        load_run_config(data=base(global_batch_size=5))
    with pytest.raises(ConfigError, match="min_lr <= max_lr"):
        load_run_config(data=base(max_lr=1e-5, min_lr=1e-4))
    with pytest.raises(ConfigError, match="expected token_mean or balanced"):
        load_run_config(data=base(loss={"type": "focal"}))
    c = load_run_config(data=base())
    with pytest.raises(ConfigError, match=r"multiple of data_parallel \(4\) x micro_batch_size \(2\)"):
        c.stages[0].accumulation(4)


def test_set_overrides_reach_list_items():
    c = load_run_config(data=base(), overrides=["stages.0.max_lr=3e-4", "seed=9", "stages.0.loss.type=balanced"])
    assert c.stages[0].max_lr == 3e-4 and c.seed == 9 and c.stages[0].loss.type == "balanced"
    with pytest.raises(ConfigError, match="index 3 out of range"):
        load_run_config(data=base(), overrides=["stages.3.max_lr=1"])


def test_strategy_validation_and_cpu_refusal():
    c = load_run_config(data=base())  # tiny: 4 heads, 2 KV heads, 2 layers
    c.parallel_config.model_parallel = 4
    c.parallel_config.pipeline_stage = 3
    with pytest.raises(ConfigError) as e:
        validate_strategy(c.model, c.parallel_config, world=12)
    msg = str(e.value)
    assert "num_key_value_heads 2 is not divisible by 4" in msg and "num_hidden_layers 2 is not divisible by 3" in msg
    with pytest.raises(ConfigError, match="on CPU only data parallel is supported"):
        setup(c)
    c = load_run_config(data=base())
    c.parallel.parallel_mode = 1
    with pytest.raises(ConfigError, match="on CPU only data parallel"):
        setup(c)
    with pytest.raises(ConfigError, match="bfloat16 needs Ascend"):
        load_run_config(data={**base(), "context": {"precision": "bfloat16"}})


def test_cli_help_and_config_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "--set" in out and "--config" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {name: a, max_steps: 1, global_batch_sise: 4}\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "global_batch_sise" in err and "did you mean 'global_batch_size'" in err


def test_fp16_dynamic_loss_scale_tracks_fp32(tmp_path):
    rows = make_rows(16, seed=4)
    out = {}
    for prec in ("float32", "float16"):
        cfg = load_run_config(data={"seed": 1, "plot": False, "context": {"precision": prec, "loss_scale_value": 1024.0,
                                                                          "loss_scale_window": 2},
                                    "stages": [{"name": "s", "seq_length": 28, "global_batch_size": 4,
                                                "micro_batch_size": 2, "max_lr": 1e-2, "max_steps": 4}]})
        ms.set_seed(0)
        d = str(tmp_path / prec)
        run_training(cfg, d, model=TinyVLM(), data_factory=lambda rc, st, i, dd: RowSource(rows, seed=3),
                     collate=collate, progress=False)
        out[prec] = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    l32 = np.array([r["loss"] for r in out["float32"]])
    l16 = np.array([r["loss"] for r in out["float16"]])
    assert np.isfinite(l16).all() and np.allclose(l16, l32, rtol=1e-2)
    assert [r["loss_scale"] for r in out["float16"]] == [1024.0, 2048.0, 2048.0, 4096.0]  # grows every 2 good steps
    assert all(r["loss_scale"] == 1.0 for r in out["float32"])
