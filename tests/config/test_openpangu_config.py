"""The shipped openPangu-VL-7B configs carry the report's settings (configs/stage/openpangu-vl-7b.yaml, run
configs/run/openpangu-vl-7b-64npu.yaml): Table 2's image resolution in every stage, and the memory plan
still fits with the largest images. No MindSpore graphs: runs in seconds.

    python -m pytest -q tests/config/test_openpangu_config.py
"""
import os

import pytest

from mindvl_ms.config.base import deep_merge, load, to_dict
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.image import image_tokens, smart_resize
from mindvl_ms.parallel.plan import check, parse_memory, plan_run
from tests.support.paths import ROOT

RUN = os.path.join(ROOT, "configs", "run", "openpangu-vl-7b-64npu.yaml")
STAGE = os.path.join(ROOT, "configs", "stage", "openpangu-vl-7b.yaml")


def _stage_data(cfg, stage) -> DataConfig:
    """The stage's data section as its loader sees it (the stage's seq_length included)."""
    merged = deep_merge(to_dict(cfg.data), dict(stage.data, seq_length=stage.seq_length))
    return load(DataConfig, merged, source=stage.name)


@pytest.mark.parametrize("path", [RUN, STAGE])
def test_table2_resolution_in_every_stage(path):
    """Table 2: "Resolution: Min 56², Max 1344²", "# Tokens: Min 4, Max 2304"."""
    cfg = load_run_config(path)
    assert cfg.model.vision.patch_size * cfg.model.vision.spatial_merge_size == 28
    for stage in cfg.stages:
        img = _stage_data(cfg, stage).image
        assert (img.min_pixels, img.max_pixels) == (56 ** 2, 1344 ** 2), stage.name
        assert img.patch_size * img.merge_size == 28
        f = img.patch_size * img.merge_size
        assert smart_resize(56, 56, f, img.min_pixels, img.max_pixels) == (56, 56)
        assert smart_resize(1344, 1344, f, img.min_pixels, img.max_pixels) == (1344, 1344)
        assert image_tokens(56, 56, img) == 4 and image_tokens(10, 10, img) == 4        # up to the minimum
        assert image_tokens(1344, 1344, img) == 2304 and image_tokens(4000, 4000, img) == 2304  # down to the max
        assert max(image_tokens(w, h, img) for w, h in [(1400, 1300), (2688, 1344), (1343, 1345)]) <= 2304


def test_plan_fits_with_2304_token_images():
    """`mindvl plan` on the 64-NPU run: every stage fits its memory limit, and one largest image fits every
    stage's visual budget per pack (the ViT activations are counted over that budget)."""
    cfg = load_run_config(RUN)
    plans = plan_run(cfg)
    assert check(cfg, plans, parse_memory(cfg.context.max_device_memory)) == []
    for stage in cfg.stages:
        data = _stage_data(cfg, stage)
        assert data.visual_budget() >= image_tokens(1344, 1344, data.image) == 2304, stage.name
