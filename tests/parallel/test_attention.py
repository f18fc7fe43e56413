"""FlashAttentionScore (TND) and dense-path strategies of the attention core, read back from the primitives."""
import os

import pytest

from mindvl_ms.config import load_model_config
from mindvl_ms.ops import CoreAttention
from mindvl_ms.parallel import Layout
from mindvl_ms.parallel.attention import shard_core_attention
from tests.support.paths import ROOT

TINY = os.path.join(ROOT, "configs", "model", "tiny.yaml")


def test_llm_core_tnd_strategy():
    core = shard_core_attention(CoreAttention(32, 8, 128), Layout(dp=16, tp=4))
    fa = core.fa
    assert fa.attrs["input_layout"] == 4 and fa.attrs["sparse_mode"] == 3  # 4 = TND in the primitive's enum
    assert fa.attrs["next_tokens"] == 0 and fa.attrs["head_num"] == 32
    assert fa.in_strategy == ((16, 4, 1), (16, 4, 1), (16, 4, 1), (1, 1), (16,), (16,))
    assert core.fa_mask.shape == (2048, 2048)
    m = core.fa_mask.asnumpy()
    assert m[0, 1] == 1 and m[1, 0] == 0 and m.sum() == 2048 * 2047 // 2
    heads = (16, 4, 1, 1)
    assert core.qk_matmul.in_strategy == (heads, heads)
    assert core.pv_matmul.in_strategy == (heads, heads)
    assert core.softmax.in_strategy == (heads,)
    assert core.bias_add.in_strategy == (heads, (16, 1, 1, 1))
    assert core.scale_mul.in_strategy == (heads, ())


def test_vit_core_has_no_mask_and_mqa_keeps_kv_whole():
    vit = shard_core_attention(CoreAttention(16, 16, 80, causal=False), Layout(dp=8, tp=2))
    assert vit.fa.attrs["sparse_mode"] == 0 and vit.fa_mask is None
    assert vit.fa.in_strategy == ((8, 2, 1), (8, 2, 1), (8, 2, 1), (8,), (8,))
    whole = shard_core_attention(CoreAttention(16, 16, 80, causal=False), Layout(dp=8, tp=2), split_batch=False)
    assert whole.fa.in_strategy == ((1, 2, 1), (1, 2, 1), (1, 2, 1), (1,), (1,))
    assert whole.qk_matmul.in_strategy == ((1, 2, 1, 1), (1, 2, 1, 1))
    mqa = shard_core_attention(CoreAttention(8, 1, 64), Layout(dp=2, tp=4))
    assert mqa.fa.in_strategy == ((2, 4, 1), (2, 1, 1), (2, 1, 1), (1, 1), (2,), (2,))


def test_mla_core_pads_v_and_bad_heads_raise():
    core = CoreAttention(16, 16, 192, v_head_dim=128)
    assert core.v_pad == 64
    with pytest.raises(ValueError, match="model_parallel 3"):
        shard_core_attention(CoreAttention(16, 16, 64), Layout(dp=1, tp=3))
    with pytest.raises(ValueError, match="key/value heads 2"):
        shard_core_attention(CoreAttention(8, 2, 64), Layout(dp=1, tp=4))


def test_model_cores_are_tnd_everywhere():
    """Every core of the tiny MindVL carries the TND kernel with the mode its role needs."""
    from mindvl_ms.models.mindvl import MindVLModel

    model = MindVLModel(load_model_config(TINY))
    cores = [(n, c) for n, c in model.cells_and_names() if isinstance(c, CoreAttention)]
    assert cores
    for name, c in cores:
        assert c.fa.attrs["input_layout"] == 4
        assert c.fa.attrs["sparse_mode"] == (0 if name.startswith("visual.") else 3), name
