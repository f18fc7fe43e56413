"""Module path patterns of the parallel plans: `*` is one path component, the first matching pattern wins,
skipped subtrees are left out; every style pattern of the plans names a module of a shipped model; and
`parallelize(..., recompute=...)` applies the recompute step with the others."""
import os

from mindspore import nn
from mindspore.nn.utils import no_init_parameters

from mindvl_ms.config import load_model_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.parallelize import DECODER_LAYER_PLAN, EP_MODULES, LLM_TP_PLAN, MTP_PLAN, VISION_PLAN
from mindvl_ms.parallel.paths import compile_plan, match_plan, under
from mindvl_ms.parallel.pipeline import STAGE_PLAN
from mindvl_ms.parallel.recompute import RECOMPUTE_PLAN
from tests.support.paths import ROOT


class _Tree(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([nn.Cell() for _ in range(2)])
        for layer in self.layers:
            layer.mlp = nn.Cell()
            layer.mlp.down_proj = nn.Dense(2, 2)
            layer.mlp.shared = nn.Cell()
            layer.mlp.shared.down_proj = nn.Dense(2, 2)


def test_star_is_one_component_first_match_wins_and_skip():
    plan = {"layers.*.mlp.down_proj": "down", "layers.1.mlp": "second mlp", "layers.*.mlp": "mlp"}
    got = {name: v for name, _, v in match_plan(_Tree(), plan) if v is not None}
    assert got == {"layers.0.mlp": "mlp", "layers.0.mlp.down_proj": "down",
                   "layers.1.mlp": "second mlp", "layers.1.mlp.down_proj": "down"}
    skipped = {name for name, _, _ in match_plan(_Tree(), plan, skip=("layers.0.mlp",))}
    assert not any(n.startswith("layers.0.mlp") for n in skipped) and "layers.0" in skipped
    assert under("layers.*", {"": 1, "mlp": 2}) == {"layers.*": 1, "layers.*.mlp": 2}


def test_every_plan_pattern_names_a_module():
    """A pattern that matches nothing would silently leave modules unsharded: each one matches a cell of
    MindVL-8B (dense, ViT), MindVL-671B-A37B (MLA, MoE), openPangu-VL-7B (plain ViT MLP, hierarchical
    connector), the tiny model (tied head) or the tiny MoE (MTP). A decoder-layer entry counts for the MTP depths too (they are
    decoder layers), so the MTP plan is checked for its own entries."""
    names = set()
    for yaml in ("mindvl-8b.yaml", "mindvl-671b-a37b.yaml", "openpangu-vl-7b.yaml", "tiny.yaml", "tiny-moe.yaml"):
        with no_init_parameters():
            model = MindVLModel(load_model_config(os.path.join(ROOT, "configs/model", yaml)))
        names |= {n for n, _ in model.cells_and_names()}
    mtp_own = {k: v for k, v in MTP_PLAN.items() if k not in DECODER_LAYER_PLAN}
    plans = {**under("model.layers.*", DECODER_LAYER_PLAN), **under("model.mtp.*", mtp_own),
             **{k: v for k, v in LLM_TP_PLAN.items() if not k.startswith(("model.layers.", "model.mtp."))},
             **VISION_PLAN, **dict.fromkeys(EP_MODULES), **STAGE_PLAN, **RECOMPUTE_PLAN}
    unused = [p for p, pattern, _ in compile_plan(plans) if not any(pattern.fullmatch(n) for n in names)]
    assert unused == []


def test_parallelize_applies_recompute_when_given():
    rc = load_run_config(data={"model": os.path.join(ROOT, "configs/model/tiny.yaml"),
                               "stages": [{"name": "s", "max_steps": 1}],
                               "recompute_config": {"recompute": True}}).recompute_config
    with no_init_parameters():
        m = MindVLModel(load_model_config(os.path.join(ROOT, "configs/model/tiny.yaml")))
    rep = parallelize(m, Layout(dp=2, tp=2), recompute=rc)
    assert rep.recompute == {"full_cells": 4, "select_primitives": 0}  # 2 decoder layers + 2 ViT blocks
    assert m.model.layers[0]._has_config_recompute
    assert parallelize(m, Layout(dp=2, tp=2)).recompute == {}
