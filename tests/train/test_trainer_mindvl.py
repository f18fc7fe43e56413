"""The trainer on the real MindVL model (tiny config): warm-up trains only the projector (everything else
bit-identical), SFT trains all with the vision tower at 0.1x LR, one compiled graph per stage across
different image sizes, the stage checkpoint loads with `load_pretrained`, and the loss goes down; a third
stage that fits SFT's graphs (longer rows, other LR, decay, epsilon, clipping, LM-head chunk) trains on SFT's
compiled step without compiling.
Runs with activation recompute on (decoder layers and vision blocks)."""
import json
import os

import mindspore as ms
import numpy as np
from mindspore.graph import api
import pytest

from tests.support import hf_tiny as hf_tiny
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource

MODEL = {
    "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
               "fullatt_block_indexes": [1], "window_size": 56},
    "text": {"vocab_size": hf_tiny.VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mrope_section": [2, 3, 3]},
    "image_token_id": hf_tiny.IMAGE, "video_token_id": 253, "vision_start_token_id": hf_tiny.VSTART,
    "vision_end_token_id": hf_tiny.VEND,
}


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        row = []
        for sizes in ([(28, 28)], [(28, 56)])[: rng.integers(1, 3)]:
            ids, pv, grid = hf_tiny.image_sample(rng, sizes, text_len=4, vocab=16)  # a small, learnable vocab
            labels = ids.copy()
            labels[: len(ids) // 2] = -100
            row.append({"input_ids": ids, "labels": labels, "pixel_values": pv, "image_grid_thw": grid})
        out.append(row)
    return out


@pytest.mark.slow
def test_stages_on_mindvl(tmp_path, monkeypatch):
    data = rows(24)
    cfg = load_run_config(data={"seed": 0, "model": MODEL, "plot": True, "recompute_config": {"recompute": True},
                                "stages": [
        {"name": "warmup", "trainable": "projector", "seq_length": 40, "global_batch_size": 4, "micro_batch_size": 2,
         "max_lr": 1e-2, "epochs": None, "max_steps": 3},
        {"name": "sft", "trainable": "all", "lr_coefficients": {"vision": 0.1}, "seq_length": 40,
         "global_batch_size": 4, "micro_batch_size": 2, "max_lr": 5e-3, "warmup_ratio": 0.0, "epochs": None,
         "max_steps": 6, "loss": {"type": "balanced", "logits_chunk_tokens": 64}},  # 2 x 40 positions: the chunk loop
        {"name": "sft_long", "trainable": "all", "lr_coefficients": {"vision": 0.1}, "seq_length": 56,
         "global_batch_size": 4, "micro_batch_size": 2, "max_lr": 2e-3, "warmup_ratio": 0.5, "epochs": None,
         "max_steps": 2, "weight_decay": 0.05, "adam_eps": 1e-6, "grad_clip": 0.5,
         "loss": {"type": "balanced", "logits_chunk_tokens": 16}}]})
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    init = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    seen, now, compiles = {}, ["set-up"], []
    compile_ = api._CellGraphExecutor.compile

    def counting(self, obj, *args, **kwargs):  # graph compiles, by the stage that made them
        result = compile_(self, obj, *args, **kwargs)
        if isinstance(result, tuple) and result[1]:
            compiles.append(now[0])
        return result

    monkeypatch.setattr(api._CellGraphExecutor, "compile", counting)

    def factory(rc, stage, i, dist):
        seen[stage.name] = {p.name: p.asnumpy().copy() for p in model.get_parameters()}  # the stage's start
        now[0] = stage.name
        return RowSource(data, seed=1)

    out = str(tmp_path / "run")
    summary = run_training(cfg, out, model=model, data_factory=factory, progress=False)
    changed = {k for k in init if not np.array_equal(init[k], seen["sft"][k])}
    assert changed and all(k.startswith("visual.merger.") for k in changed)
    assert {k for k in init if k.startswith("visual.merger.")} == changed
    for st in summary["stages"][:2]:
        assert st["compiled_graphs"] == 1  # one compile per stage across image sizes / packs
        assert os.path.isfile(st["plot"])
    sft_end = seen["sft_long"]
    assert any(not np.array_equal(sft_end[k], seen["sft"][k]) for k in sft_end if k.startswith("model."))
    assert any(not np.array_equal(sft_end[k], seen["sft"][k]) for k in sft_end if k.startswith("visual.blocks."))
    reloaded = load_pretrained(MindVLModel, summary["stages"][1]["checkpoint"])
    for p in reloaded.get_parameters():
        assert np.array_equal(p.asnumpy(), sft_end[p.name]), p.name

    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    sft = [r["loss"] for r in recs if r["stage"] == "sft"]
    assert np.mean(sft[-2:]) < np.mean(sft[:2])  # it learns
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0

    # sft_long fits sft's graphs (micro-step, reduction, update, the balanced loss's weight pre-pass): it
    # compiles nothing and trains on them (bit-identically to a new step: tests/train/test_train_step.py
    # restart test, and test_kept_step.py, which compares a run on a kept step with one on a new step)
    assert compiles.count("warmup") >= 3 and compiles.count("sft") >= 4 and "sft_long" not in compiles
    assert summary["stages"][2]["compiled_graphs"] == 0
    final = {p.name: p.asnumpy() for p in model.get_parameters()}
    assert any(not np.array_equal(final[k], sft_end[k]) for k in final if k.startswith("model."))
    long = [r for r in recs if r["stage"] == "sft_long"]
    assert [r["step"] for r in long] == [0, 1] and all(r["applied"] and np.isfinite(r["loss"]) for r in long)
