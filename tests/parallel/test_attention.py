"""FlashAttentionScore (TND) and dense-path strategies of the attention core, read back from the primitives."""
import os

import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.config import load_model_config
from mindvl_ms.data.collate import llm_actual_seq_len
from mindvl_ms.ops import CoreAttention, segment_bias
from mindvl_ms.parallel import Layout
from mindvl_ms.parallel.attention import shard_core_attention
from tests.ops.test_attention_layout import tnd_reference
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


def test_tnd_modes_follow_the_flash_attention_docstring():
    """MindSpore 2.9's FlashAttentionScore docstring: a TND core that passes a mask uses sparse_mode 2 or 3 with
    the (2048, 2048) mask and next_tokens 0, pre_tokens >= the longest query (the LLM); sparse_mode 0 without a
    mask performs no masking, next/pre tokens ignored (INT_MAX internally): the ViT's bidirectional windows."""
    llm, vit = CoreAttention(32, 8, 128), CoreAttention(16, 16, 80, causal=False)
    assert llm.fa.attrs["sparse_mode"] == 3 and llm.fa_mask.shape == (2048, 2048)
    assert llm.fa.attrs["next_tokens"] == 0 and llm.fa.attrs["pre_tokens"] == 2147483647
    assert vit.fa.attrs["sparse_mode"] == 0 and vit.fa_mask is None
    assert vit.fa.attrs["next_tokens"] == vit.fa.attrs["pre_tokens"] == 2147483647


def test_mla_core_passes_v_unpadded_and_bad_heads_raise():
    """MLA's TND call, as MindFormers 1.9's (v at v_head_dim, no zero pad): the kernel is stood in for by the
    numpy TND reference, which records what it was given; the result equals the CPU path."""
    rng = np.random.default_rng(0)
    core = CoreAttention(2, 2, 12, v_head_dim=8)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2]], np.int32)
    q, k = (rng.standard_normal((1, 2, 8, 12)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    seen = {}

    def kernel(qt, kt, vt, *rest):
        seen["v"], seen["k"] = tuple(vt.shape), tuple(kt.shape)
        lens = rest[-1].asnumpy()
        out = tnd_reference(qt.asnumpy(), kt.asnumpy(), vt.asnumpy(), lens, lens, core.scale, True)
        return None, None, None, Tensor(out.astype(np.float32))

    dense = core(Tensor(q), Tensor(k), Tensor(v), segment_bias(Tensor(seg), Tensor(seg), True)).asnumpy()
    object.__setattr__(core, "fa", kernel)
    lens = Tensor(llm_actual_seq_len(seg).reshape(-1))
    flash = core._flash(Tensor(q), Tensor(k), Tensor(v), lens, lens).asnumpy()  # pylint: disable=protected-access
    assert seen == {"v": (8, 2, 8), "k": (8, 2, 12)}                 # v [T, N, 8]: not padded to 12
    assert flash.shape == (1, 2, 8, 8) and np.abs(flash - dense).max() < 1e-5
    with pytest.raises(ValueError, match="v_head_dim 16 is larger"):
        CoreAttention(2, 2, 12, v_head_dim=16)
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
