"""openPangu-VL's hierarchical connector (`vision.hierarchical_layers`) against a numpy reference.

The merger alone: per-level RMSNorm, 2x2 grouping, the levels summed (`hierarchical_fusion: sum`, the
default) or concatenated (`concat`), Linear-GELU(erf)-Linear in numpy. The tower: the connector is fed the
outputs of the listed blocks (captured by running the same blocks one by one), and with a single level the
merger is the Qwen2.5-VL one. Parameter counts at openPangu-VL-7B size against hand arithmetic.
"""
import math
import os

import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor

from mindspore import ops

from mindvl_ms.config import ConfigError, MindVLConfig, load_model_config, to_hf_dict
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.models.vision import PatchMerger, VisionTransformer
from mindvl_ms.ops import segment_bias
from tests.support.paths import ROOT

MODEL_DIR = os.path.join(ROOT, "configs", "model")


def _cfg(layers, fusion="sum"):
    v = load_model_config(os.path.join(MODEL_DIR, "tiny.yaml")).vision
    v.depth, v.fullatt_block_indexes, v.hierarchical_layers, v.hierarchical_fusion = 3, [1], layers, fusion
    v.validate()
    return v


def _rms(x, w, eps=1e-6):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_merger(merger, xs, fusion="sum"):
    """xs: the levels' block outputs [N, E] in order (earlier ..., last)."""
    p = {n.split("merger.")[-1] if "merger." in n else n: q.asnumpy().astype(np.float64)
         for n, q in merger.parameters_and_names()}
    norms = [p[f"ln_hier.{i}.weight"] for i in range(len(xs) - 1)] + [p["ln_q.weight"]]
    unit = 4 * xs[0].shape[1]
    levels = [_rms(x, w).reshape(-1, unit) for x, w in zip(xs, norms)]  # each [N/4, 4E]
    h = np.concatenate(levels, -1) if fusion == "concat" else np.sum(levels, 0)
    h = h @ p["mlp.0.weight"].T + p["mlp.0.bias"]
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return h @ p["mlp.2.weight"].T + p["mlp.2.bias"]


@pytest.mark.parametrize("fusion,levels_in", [("sum", 1), ("concat", 3)])
def test_merger_levels_against_numpy(fusion, levels_in):
    cfg = _cfg([0, 1, 2], fusion)
    merger = PatchMerger(cfg)
    for k, (n, q) in enumerate(merger.parameters_and_names()):  # non-trivial norm weights, one draw per norm
        if "ln_" in n:
            q.set_data(Tensor(np.random.default_rng(k).uniform(0.5, 1.5, q.shape).astype(np.float32)))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((16, cfg.hidden_size)).astype(np.float32) for _ in range(3)]
    ours = merger(Tensor(xs[2]), (Tensor(xs[0]), Tensor(xs[1]))).asnumpy()
    ref = _np_merger(merger, xs, fusion)
    assert ours.shape == (4, cfg.out_hidden_size)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    assert merger.mlp[0].in_channels == levels_in * 4 * cfg.hidden_size
    # the levels are not interchangeable (each has its own norm gain): swapping two block outputs changes it
    swapped = merger(Tensor(xs[2]), (Tensor(xs[1]), Tensor(xs[0]))).asnumpy()
    assert np.abs(swapped - ours).max() > 1e-3


def test_connector_parameters_at_openpangu_size():
    """openPangu-VL-7B (configs/model/openpangu-vl-7b.yaml): width E 1536, 2x2 merge units of 4E = 6144, LLM
    width 4096, four levels. sum: 4 norms of 1536, Linear 6144->6144, Linear 6144->4096 (the single-level
    merger's MLP); concat: the first Linear takes 4 x 6144 = 24,576 inputs."""
    from mindspore.nn.utils import no_init_parameters

    v = load_model_config(os.path.join(MODEL_DIR, "openpangu-vl-7b.yaml")).vision
    assert (v.hidden_size, v.out_hidden_size, len(v.hierarchical_layers), v.hierarchical_fusion) == \
        (1536, 4096, 4, "sum")
    norms, second = 4 * 1536, 6144 * 4096 + 4096                       # 6,144; 25,169,920
    hand = {"sum": norms + 6144 * 6144 + 6144 + second,                # 62,930,944
            "concat": norms + 24576 * 6144 + 6144 + second}            # 176,177,152
    assert hand == {"sum": 62_930_944, "concat": 176_177_152}
    single = 1536 + 6144 * 6144 + 6144 + second                        # Qwen2.5-VL-style merger: 62,926,336
    for fusion in ("sum", "concat"):
        v.hierarchical_fusion = fusion
        with no_init_parameters():
            merger = PatchMerger(v)
        assert sum(int(np.prod(p.shape)) for p in merger.get_parameters()) == hand[fusion], fusion
    assert 24576 * 6144 + 6144 == 151_001_088 and hand["sum"] - single == 3 * 1536
    with pytest.raises(ConfigError, match="hierarchical_fusion 'mean': expected sum or concat"):
        _cfg([0, 2], "mean")


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
    b = {k: v[0] for k, v in b.items() if k in ("pixel_values", "vision_pos_ids", "window_index", "reverse_index",
                                              "window_segment_ids", "full_segment_ids")}  # the one row
    names = ["pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
             "full_segment_ids"]
    out = vit(*[Tensor(b[k]) for k in names]).asnumpy()
    # the same blocks run one by one (dense masks), capturing the outputs the connector should read; op by op
    # (PyNative): a graph compile per sub-cell would cost more than running its few ops
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        x = vit.patch_embed(Tensor(b["pixel_values"]))
        x = ops.gather(x.reshape(-1, 4, x.shape[1]), Tensor(b["window_index"]), 0).reshape(-1, x.shape[1])
        cos, sin = vit.rotary_pos_emb(Tensor(b["vision_pos_ids"]))
        ws, fs = Tensor(b["window_segment_ids"])[None], Tensor(b["full_segment_ids"])[None]
        outs = []
        for i, blk in enumerate(vit.blocks):
            x = blk(x, cos, sin, segment_bias(fs, fs, False) if vit.full[i] else segment_bias(ws, ws, False))
            outs.append(x.asnumpy())
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    ref = _np_merger(vit.merger, [outs[0], outs[-1]], cfg.vision.hierarchical_fusion)[b["reverse_index"]]
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
