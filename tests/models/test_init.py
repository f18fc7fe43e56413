"""The init follows each tower's `initializer_range`: in the tiny MindVL built with different stds for the
ViT (0.2) and the LLM (0.05), every projection and embedding matrix is drawn N(0, its tower's std) (the
ViT's row/column position tables excepted: their std is scaled by the patch size), biases start at zero and
norm weights at one (configs/demo/full.yaml sets 0.2 for both towers; docs/DEMO.md)."""
import os

import mindspore as ms
import numpy as np

from mindvl_ms.config import load_model_config
from mindvl_ms.models.mindvl import MindVLModel

from tests.support.paths import ROOT


def test_weights_are_drawn_with_each_towers_initializer_range():
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    cfg.vision.initializer_range, cfg.text.initializer_range = 0.2, 0.05
    cfg.text.vocab_size = 512  # the embedding's rows do not change its std; a small table builds faster
    ms.set_seed(0)
    params = {p.name: p.asnumpy() for p in MindVLModel(cfg).get_parameters()}
    checked = {"visual": 0, "model": 0}
    for name, w in params.items():
        tower = name.split(".")[0]
        if name.endswith(".bias"):
            assert not w.any(), name
        elif "norm" in name or "ln_q" in name:
            assert np.all(w == 1), name
        elif w.ndim == 2 and w.size >= 4096 and "pos_embed" not in name and tower in checked:
            std = cfg.vision.initializer_range if tower == "visual" else cfg.text.initializer_range
            assert abs(w.mean()) < 0.1 * std and abs(w.std() / std - 1) < 0.05, (name, w.std())
            checked[tower] += 1
    assert checked["visual"] >= 6 and checked["model"] >= 8, checked  # patch embed, qkv, proj, MLP, merger...
