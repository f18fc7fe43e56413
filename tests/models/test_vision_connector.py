"""openPangu-VL's hierarchical connector (`vision.hierarchical_layers`) against a numpy reference.

The merger alone: per-level RMSNorm, 2x2 grouping, concatenation, Linear-GELU(erf)-Linear in numpy.
The tower: the connector is fed the outputs of the listed blocks (captured by running the same blocks one
by one), and with a single level the merger is the Qwen2.5-VL one.
"""
import math
import os

import numpy as np
import pytest
from mindspore import Tensor

from mindspore import ops

from mindvl_ms.config import ConfigError, MindVLConfig, load_model_config, to_hf_dict
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.models.vision import PatchMerger, VisionTransformer
from mindvl_ms.ops import segment_bias
from tests.support.paths import ROOT

MODEL_DIR = os.path.join(ROOT, "configs", "model")


def _cfg(layers):
    v = load_model_config(os.path.join(MODEL_DIR, "tiny.yaml")).vision
    v.depth, v.fullatt_block_indexes, v.hierarchical_layers = 3, [1], layers
    v.validate()
    return v


def _rms(x, w, eps=1e-6):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_merger(merger, xs):
    """xs: the levels' block outputs [N, E] in order (earlier ..., last)."""
    p = {n.split("merger.")[-1] if "merger." in n else n: q.asnumpy().astype(np.float64)
         for n, q in merger.parameters_and_names()}
    norms = [p[f"ln_hier.{i}.weight"] for i in range(len(xs) - 1)] + [p["ln_q.weight"]]
    unit = 4 * xs[0].shape[1]
    h = np.concatenate([_rms(x, w).reshape(-1, unit) for x, w in zip(xs, norms)], -1)
    h = h @ p["mlp.0.weight"].T + p["mlp.0.bias"]
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return h @ p["mlp.2.weight"].T + p["mlp.2.bias"]


def test_merger_levels_against_numpy():
    cfg = _cfg([0, 1, 2])
    merger = PatchMerger(cfg)
    for n, q in merger.parameters_and_names():  # non-trivial norm weights
        if "ln_" in n:
            q.set_data(Tensor(np.random.default_rng(len(n)).uniform(0.5, 1.5, q.shape).astype(np.float32)))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((16, cfg.hidden_size)).astype(np.float32) for _ in range(3)]
    ours = merger(Tensor(xs[2]), (Tensor(xs[0]), Tensor(xs[1]))).asnumpy()
    ref = _np_merger(merger, xs)
    assert ours.shape == (4, cfg.out_hidden_size)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    assert merger.mlp[0].in_channels == 3 * 4 * cfg.hidden_size
    # the levels are not interchangeable: swapping two block outputs changes the result
    swapped = merger(Tensor(xs[2]), (Tensor(xs[1]), Tensor(xs[0]))).asnumpy()
    assert np.abs(swapped - ours).max() > 1e-3


def test_tower_feeds_the_listed_blocks():
    cfg = MindVLConfig()
    depth = _cfg([]).depth
    assert depth >= 3  # a tap that is neither the first nor the last block would be missed otherwise
    cfg.vision = _cfg([0, depth - 1])
    vit = VisionTransformer(cfg.vision)
    rng = np.random.default_rng(1)
    grid = np.array([[1, 8, 12]])
    pd = 3 * 2 * 14 * 14
    sample = {"input_ids": np.array([cfg.image_token_id] * 24), "pixel_values": rng.standard_normal((96, pd)),
              "image_grid_thw": grid}
    b = build_model_inputs([[sample]], cfg)
    names = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
             "full_segment_ids"]
    out = vit(*[Tensor(b[k]) for k in names]).asnumpy()
    # the same blocks run one by one (dense masks), capturing the outputs the connector should read
    x = vit.patch_embed(Tensor(b["pixel_values"]))
    x = ops.gather(x.reshape(-1, 4, x.shape[1]), Tensor(b["window_index"]), 0).reshape(-1, x.shape[1])
    cos, sin = vit.rotary_pos_emb(Tensor(b["vision_pos_ids"]))
    ws, fs = Tensor(b["window_segment_ids"])[None], Tensor(b["full_segment_ids"])[None]
    outs = []
    for i, blk in enumerate(vit.blocks):
        x = blk(x, cos, sin, segment_bias(fs, fs, False) if vit.full[i] else segment_bias(ws, ws, False))
        outs.append(x.asnumpy())
    ref = _np_merger(vit.merger, [outs[0], outs[-1]])[b["reverse_index"]]
    np.testing.assert_allclose(out, ref, atol=5e-5)


def test_single_level_is_the_qwen_merger_and_validation():
    one = PatchMerger(_cfg([]))
    assert one.n_hier == 0 and one.mlp[0].in_channels == 4 * _cfg([]).hidden_size
    with pytest.raises(ConfigError, match=r"hierarchical_layers \[0, 1\]: expected increasing .* ending with the last block"):
        _cfg([0, 1])
    with pytest.raises(ConfigError, match=r"hierarchical_layers \[2, 0, 2\]"):
        _cfg([2, 0, 2])
    cfg = MindVLConfig()
    cfg.vision.hierarchical_layers = [5, cfg.vision.depth - 1]
    with pytest.raises(ConfigError, match="save it in native format"):
        to_hf_dict(cfg)
