"""Optional learned absolute positions in the ViT (`vision.abs_pos_grid`): the encoder output equals a numpy
reference that adds row and column table entries to each patch embedding (clipped past the grid), on an
image with two attention windows (so window order differs from image order); configs that cannot be
written as Qwen2.5-VL say so."""
import numpy as np
import pytest
from math import erf
from mindspore import Tensor

from mindvl_ms.config import ConfigError, MindVLConfig, VisionConfig, to_hf_dict
from mindvl_ms.data.rope_index import vision_metadata
from mindvl_ms.models.vision import VisionTransformer

META = ("vision_pos_ids", "window_index", "reverse_index", "window_segment_ids", "full_segment_ids")


def _reference(vt, px, gh, gw, grid):
    """numpy: patch MatMul + row/col tables, then the merger (RMSNorm, Linear, exact GELU, Linear)."""
    p = {q.name: q.asnumpy().astype(np.float64) for q in vt.get_parameters()}
    x = px.astype(np.float64) @ p["patch_embed.proj.weight"].T  # [N, E], patches in merge-unit order
    units = [(i, j) for i in range(gh // 2) for j in range(gw // 2)]
    rows = np.array([2 * i + a for i, j in units for a in range(2) for b in range(2)])
    cols = np.array([2 * j + b for i, j in units for a in range(2) for b in range(2)])
    x = x + p["pos_embed.row"][np.minimum(rows, grid - 1)] + p["pos_embed.col"][np.minimum(cols, grid - 1)]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p["merger.ln_q.weight"]
    u = x.reshape(-1, 4 * x.shape[-1]) @ p["merger.mlp.0.weight"].T + p["merger.mlp.0.bias"]
    u = 0.5 * u * (1 + np.vectorize(erf)(u / np.sqrt(2)))
    return u @ p["merger.mlp.2.weight"].T + p["merger.mlp.2.bias"]


def test_abs_pos_embed_matches_numpy_on_a_two_window_image():
    grid = 6  # smaller than the 16 patch columns: later columns share the last entry
    cfg = VisionConfig(depth=0, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=24,
                       fullatt_block_indexes=[], window_size=112, abs_pos_grid=grid)
    cfg.validate()
    vt = VisionTransformer(cfg)
    gh, gw = 8, 16  # a 112 x 224 image: two 112-px windows side by side
    px = np.random.default_rng(0).normal(size=(gh * gw, 3 * 2 * 14 * 14)).astype(np.float32)
    md = vision_metadata(np.array([[1, gh, gw]]), cfg.window_size, cfg.patch_size)
    assert not np.array_equal(md["window_index"], np.arange(gh * gw // 4))  # window order != image order
    out = vt(Tensor(px), *[Tensor(md[k].astype(np.int32)) for k in META]).asnumpy()
    np.testing.assert_allclose(out, _reference(vt, px, gh, gw, grid), atol=2e-5, rtol=1e-4)
    # the tables matter: zeroing them changes the output
    for t in (vt.pos_embed.row, vt.pos_embed.col):
        t.set_data(Tensor(np.zeros(t.shape, np.float32)))
    assert np.abs(vt(Tensor(px), *[Tensor(md[k].astype(np.int32)) for k in META]).asnumpy() - out).max() > 1e-3


def test_abs_pos_off_by_default_and_refused_for_hf_layout():
    assert VisionConfig().abs_pos_grid == 0
    assert not [p for p in VisionTransformer(VisionConfig(depth=1, hidden_size=16, intermediate_size=16,
                                                          num_heads=2, out_hidden_size=24,
                                                          fullatt_block_indexes=[0])).get_parameters()
                if "pos_embed" in p.name]
    cfg = MindVLConfig()
    cfg.vision.abs_pos_grid = 16
    with pytest.raises(ConfigError, match="no absolute position embedding"):
        to_hf_dict(cfg)
    with pytest.raises(ConfigError, match="abs_pos_grid -1"):
        VisionConfig(abs_pos_grid=-1).validate()
