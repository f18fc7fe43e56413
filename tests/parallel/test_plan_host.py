"""`mindvl plan`'s host memory per process against hand arithmetic: the pinned input arrays of one step at
the visual budget (8B and 671B layouts, doubled under semi-auto parallel), and on CPU the accumulators and Adam
moments of the trainable parameters counted from the real cells.

    python -m pytest -q tests/parallel/test_plan_host.py
"""
import os

import numpy as np
from mindspore.nn.utils import no_init_parameters

from mindvl_ms.cli import main
from mindvl_ms.config.base import read_yaml
from mindvl_ms.config.train import load_run_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel.plan import GB, host_plan
from tests.support.paths import ROOT

RUN = os.path.join(ROOT, "configs", "run")
# one 8192-token row at an 8192-visual-token budget: 7 int32 token arrays, 8192 x 2 x 2 patches of
# 3 x 2 x 14 x 14 fp32 pixel values and 6 int32 index arrays each
ROW_8K = 4 * (7 * 8192 + 8192 * 4 * (3 * 2 * 14 * 14 + 6))


def test_pinned_data_8b_and_671b_by_hand(capsys):
    h8 = {(h.training_stage, h.pp): h for h in host_plan(load_run_config(os.path.join(RUN, "mindvl-8b-64npu.yaml")))}
    # 8B: dp 16, micro-batch 1: 1024 / 16 = 64 micro-batches (sft 512 / 16 = 32), one pipeline stage, held
    # twice under semi-auto parallel (the micro-batches and the one feed the step joins them into)
    assert h8["multitask", 0].memory == {"accumulators": 0.0, "moments": 0.0, "pinned data": 2 * 64 * ROW_8K}
    assert h8["sft", 0].memory["pinned data"] == 2 * 32 * ROW_8K
    assert ROW_8K == 155_156_480
    cfg = load_run_config(os.path.join(RUN, "mindvl-671b-512npu.yaml"))
    h671 = host_plan(cfg)
    # 671B: dp 8: 128 micro-batches, held twice (semi-auto parallel, as 8B)
    assert {h.memory["pinned data"] for h in h671 if h.training_stage == "multitask"} == {2 * 128 * ROW_8K}
    assert len(h671) == 3 * 8 and all(h.memory["accumulators"] == h.memory["moments"] == 0.0 for h in h671)
    assert main(["plan", "--config", os.path.join(RUN, "mindvl-671b-512npu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "host memory per process (GB)" in out
    assert f"{2 * 128 * ROW_8K / GB:.2f}" in out  # 36.99


def test_cpu_accumulators_and_moments_are_counted_from_the_cells():
    model = read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    cfg = load_run_config(data={
        "model": model, "context": {"device_target": "CPU"}, "data": {"max_image_tokens": 16},
        "stages": [
            {"name": "warmup", "trainable": "projector", "seq_length": 64, "global_batch_size": 4,
             "micro_batch_size": 2, "max_steps": 1},
            {"name": "sft", "trainable": "all", "seq_length": 64, "global_batch_size": 4, "micro_batch_size": 1,
             "max_steps": 1}]})
    with no_init_parameters():
        cells = MindVLModel(cfg.model)
    every = sum(int(np.prod(p.shape)) for p in cells.get_parameters())
    merger = sum(int(np.prod(p.shape)) for p in cells.get_parameters() if p.name.startswith("visual.merger."))
    h = {x.training_stage: x.memory for x in host_plan(cfg)}
    width = 3 * 2 * 14 * 14
    row = 4 * (7 * 64 + 16 * 4 * (width + 6))  # 64 tokens, 16 visual tokens = 64 patches
    assert h["warmup"] == {"accumulators": 4.0 * merger, "moments": 8.0 * merger, "pinned data": 2 * 2 * row}
    assert h["sft"] == {"accumulators": 4.0 * every, "moments": 8.0 * every, "pinned data": 4 * row}
