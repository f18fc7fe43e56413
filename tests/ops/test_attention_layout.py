"""Host-side attention layouts (TND actual lengths, ViT block gathers) on hand-computed packs, and a numpy
reference of FlashAttentionScore's TND semantics against the CPU attention path."""
import os

import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.config import load_model_config
from mindvl_ms.data.collate import block_gather, build_model_inputs, llm_actual_seq_len, segment_ends
from mindvl_ms.models.vision import VisionBlocks
from mindvl_ms.ops import CoreAttention, segment_bias
from tests.support.paths import ROOT

TINY = os.path.join(ROOT, "configs", "model", "tiny.yaml")


def _flat_ends(lens):
    """Row-local ends [B, K] -> the ends in the flattened [B*L] tokens (as models.mindvl adds them)."""
    return (lens + 6 * np.arange(lens.shape[0])[:, None]).reshape(-1)


def test_segment_ends_and_llm_pack():
    assert segment_ends([1, 1, 2, 2, 2, 0]).tolist() == [2, 5, 6]
    assert segment_ends([7]).tolist() == [1]
    # row 0: samples of 3 and 2 tokens + 1 padding; row 1: one sample of 4 + 2 padding; rows are 6 long
    seg = np.array([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 0, 0]], np.int32)
    assert llm_actual_seq_len(seg).tolist() == [[3, 5, 6], [4, 6, 6]]  # row-local ends
    assert llm_actual_seq_len(seg, slots=4).tolist() == [[3, 5, 6, 6], [4, 6, 6, 6]]
    # the model's flattened [B*L] ends: each row's plus its start r*L
    assert _flat_ends(llm_actual_seq_len(seg)).tolist() == [3, 5, 6, 10, 12, 12]
    assert _flat_ends(llm_actual_seq_len(seg, slots=4)).tolist() == [3, 5, 6, 6, 10, 12, 12, 12]
    with pytest.raises(ValueError, match="3 segments"):
        llm_actual_seq_len(seg, slots=2)


def test_build_model_inputs_gives_the_pack_lengths():
    cfg = load_model_config(TINY)
    rows = [[{"input_ids": np.arange(1, 4)}, {"input_ids": np.arange(1, 3)}], [{"input_ids": np.arange(1, 5)}]]
    batch = build_model_inputs(rows, cfg, pad_to=6)
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 0, 0]]
    assert _flat_ends(batch["actual_seq_len"]).tolist() == [3, 5, 6, 10, 12, 12]


def test_block_gather_hand_case():
    g = block_gather([1, 1, 1, 2, 2, 3])
    assert g.tolist() == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]
    with pytest.raises(ValueError, match="numbered 1, 2"):
        block_gather([1, 1, 3, 3])


def test_vit_windows_and_images_of_a_pack():
    """Two images: 4x12 patches (2x6 merge units) and 2x2 patches. Windows are 112 px = 8x8 patches = 4x4
    units, so image 1 has windows of 8 units (32 patches) and 4 units (16 patches), image 2 one unit (4)."""
    cfg = load_model_config(TINY)
    assert cfg.vision.window_size == 112 and cfg.vision.patch_size == 14
    k = 3 * 2 * 14 * 14
    s = {"input_ids": np.array([cfg.image_token_id] * 13), "pixel_values": np.zeros((52, k), np.float32),
         "image_grid_thw": np.array([[1, 4, 12], [1, 2, 2]])}
    b = {k: v[0] for k, v in build_model_inputs([[s]], cfg).items() if k in ("window_gather", "full_gather",
                                                                             "window_segment_ids", "full_segment_ids")}
    n = 52
    want_win = np.full((3, 32), n)
    want_win[0] = np.arange(32)
    want_win[1, :16] = np.arange(32, 48)
    want_win[2, :4] = np.arange(48, 52)
    assert b["window_gather"].tolist() == want_win.tolist()
    want_full = np.full((2, 48), n)
    want_full[0] = np.arange(48)
    want_full[1, :4] = np.arange(48, 52)
    assert b["full_gather"].tolist() == want_full.tolist()
    unpad, key_bias, ends = VisionBlocks()(Tensor(b["window_gather"]), Tensor(b["window_segment_ids"]), n)
    assert ends.asnumpy().tolist() == [32, 48, 52]  # TND actual_seq_qlen of the window layers
    flat = b["window_gather"].reshape(-1)
    assert np.array_equal(flat[unpad.asnumpy()], np.arange(n))  # every patch finds its slot
    assert (key_bias.asnumpy()[:, 0, 0] < -1e8).sum(1).tolist() == [0, 16, 28]
    _, _, full_ends = VisionBlocks()(Tensor(b["full_gather"]), Tensor(b["full_segment_ids"]), n)
    assert full_ends.asnumpy().tolist() == [48, 52]


def tnd_reference(q, k, v, qlen, kvlen, scale, causal):
    """numpy FlashAttentionScore, TND layout: q [T, N, D], k/v [T, Nkv, D]; segment i spans
    (qlen[i-1], qlen[i]]; sparse_mode 3 is right-down-aligned causal inside each segment; GQA native."""
    t, n, _ = q.shape
    rep = n // k.shape[1]
    out = np.zeros((t, n, v.shape[-1]), np.float64)
    q0 = kv0 = 0
    for qe, ke in zip(qlen, kvlen):
        if qe > q0:
            for h in range(n):
                s = q[q0:qe, h].astype(np.float64) @ k[kv0:ke, h // rep].T.astype(np.float64) * scale
                if causal:
                    lq, lk = qe - q0, ke - kv0
                    s = np.where(np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                out[q0:qe, h] = (p / p.sum(-1, keepdims=True)) @ v[kv0:ke, h // rep]
        q0, kv0 = qe, ke
    return out


def _to_tnd(x):  # [B, H, L, D] -> [B*L, H, D]
    b, h, l, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * l, h, d)


@pytest.mark.parametrize("heads,kv,d,dv", [(4, 2, 8, 8), (2, 2, 12, 8)])
def test_tnd_semantics_equal_cpu_path_llm(heads, kv, d, dv):
    """Causal packs (GQA; MLA-like narrower v, at its own head dim as the TND kernel takes it)."""
    rng = np.random.default_rng(0)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 4, 4, 4]], np.int32)
    q = rng.standard_normal((2, heads, 8, d)).astype(np.float32)
    k = rng.standard_normal((2, kv, 8, d)).astype(np.float32)
    v = rng.standard_normal((2, kv, 8, dv)).astype(np.float32)
    core = CoreAttention(heads, kv, d, v_head_dim=dv)
    ours = core(Tensor(q), Tensor(k), Tensor(v), segment_bias(Tensor(seg), Tensor(seg), True)).asnumpy()
    lens = (llm_actual_seq_len(seg) + 8 * np.arange(2)[:, None]).reshape(-1)  # flattened [B*L] ends
    ref = tnd_reference(_to_tnd(q), _to_tnd(k), _to_tnd(v), lens, lens, core.scale, True)
    valid = (seg > 0).reshape(-1)  # padding rows: the kernel makes them a segment, the CPU mask none
    assert np.abs(_to_tnd(ours)[valid] - ref[valid]).max() < 1e-5


def test_tnd_semantics_equal_cpu_path_vit():
    rng = np.random.default_rng(1)
    seg = np.array([1] * 5 + [2] * 3 + [3] * 6, np.int32)  # windows of 5, 3, 6 patches
    q, k, v = rng.standard_normal((3, 1, 2, 14, 8)).astype(np.float32)
    core = CoreAttention(2, 2, 8, causal=False)
    ours = core(Tensor(q), Tensor(k), Tensor(v), segment_bias(Tensor(seg[None]), Tensor(seg[None]), False))
    ends = segment_ends(seg)
    ref = tnd_reference(_to_tnd(q), _to_tnd(k), _to_tnd(v), ends, ends, core.scale, False)
    assert np.abs(_to_tnd(ours.asnumpy()) - ref).max() < 1e-5
