"""Videos through the model: M-RoPE time positions and logits against transformers 4.57.1 Qwen2.5-VL.

Batches with a video, an image + a video (in both orders), and the same samples packed into one row;
the rope index against `Qwen2_5_VLModel.get_rope_index` with `second_per_grid_ts`.

transformers 4.57.1 casts `second_per_grid_t` to the integer dtype of the frame range before multiplying
(`torch.as_tensor(second_per_grid_t, dtype=range_tensor.dtype)`), so a fractional value such as 0.75 s
becomes 0 there; this project keeps Qwen2.5-VL's float product `int(i * second_per_grid * tokens_per_second)`.
Parity is therefore checked with whole seconds per grid (the default: 2 fps, temporal patch 2 -> 1.0 s),
and the fractional case against the hand-computed formula.
"""
import numpy as np
import pytest
import torch

from tests.support import hf_tiny as hf_tiny
from tests.support import infer_tiny as infer_tiny
from mindvl_ms.data.rope_index import rope_index
from mindvl_ms.data.collate import build_model_inputs, model_args

VIDEO = 253
TOL = 1e-4
PD = 3 * 2 * 14 * 14


def _sample(rng, items, text_len=4):
    """items: ('image', h, w) or ('video', frames, h, w, second_per_grid) in text order."""
    ids, img_pv, img_grid, vid_pv, vid_grid, spg = [], [], [], [], [], []
    for it in items:
        ids += list(rng.integers(0, 200, text_len))
        if it[0] == "image":
            gh, gw = it[1] // 14, it[2] // 14
            ids += [hf_tiny.VSTART] + [hf_tiny.IMAGE] * (gh * gw // 4) + [hf_tiny.VEND]
            img_pv.append(rng.standard_normal((gh * gw, PD)).astype(np.float32))
            img_grid.append([1, gh, gw])
        else:
            gt, gh, gw = it[1] // 2, it[2] // 14, it[3] // 14
            ids += [hf_tiny.VSTART] + [VIDEO] * (gt * gh * gw // 4) + [hf_tiny.VEND]
            vid_pv.append(rng.standard_normal((gt * gh * gw, PD)).astype(np.float32))
            vid_grid.append([gt, gh, gw])
            spg.append(it[4])
    ids += list(rng.integers(0, 200, text_len))
    s = {"input_ids": np.array(ids, np.int64)}
    if img_pv:
        s.update(pixel_values=np.concatenate(img_pv), image_grid_thw=np.array(img_grid, np.int64))
    if vid_pv:
        s.update(pixel_values_videos=np.concatenate(vid_pv), video_grid_thw=np.array(vid_grid, np.int64),
                 second_per_grid_ts=np.array(spg, np.float64))
    return s


SAMPLES = [
    [("video", 6, 56, 84, 1.0)],
    [("image", 56, 56), ("video", 4, 28, 56, 1.0)],
    [("video", 2, 56, 56, 2.0), ("image", 28, 84), ("video", 8, 28, 28, 1.0)],
]


@pytest.fixture(scope="module")
def hf_pair():
    """The infer tests' shared tiny pair (tests/support/infer_tiny.py, the hf_tiny checkpoint): its full
    forward graph, compiled once with dynamic inputs, serves these video batches too."""
    _, hf, model, _ = infer_tiny.setup()
    rng = np.random.default_rng(3)
    return hf, model, [_sample(rng, items) for items in SAMPLES]


def _hf_kwargs(s):
    kw = {"input_ids": torch.tensor(s["input_ids"][None])}
    if "pixel_values" in s:
        kw.update(pixel_values=torch.tensor(s["pixel_values"]), image_grid_thw=torch.tensor(s["image_grid_thw"]))
    if "pixel_values_videos" in s:
        kw.update(pixel_values_videos=torch.tensor(s["pixel_values_videos"]),
                  video_grid_thw=torch.tensor(s["video_grid_thw"]),
                  second_per_grid_ts=torch.tensor(s["second_per_grid_ts"]))
    return kw


def test_rope_index_matches_hf_with_time(hf_pair):
    hf, model, samples = hf_pair
    tps = hf.config.vision_config.tokens_per_second
    assert model.config.vision.tokens_per_second == tps
    for s in samples:
        kw = _hf_kwargs(s)
        ref, _ = hf.model.get_rope_index(kw["input_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                                         kw.get("second_per_grid_ts"))
        ours = rope_index(s["input_ids"], s.get("image_grid_thw"), hf_tiny.IMAGE, 2, tps,
                          video_grid_thw=s.get("video_grid_thw"), video_token_id=VIDEO,
                          second_per_grid_ts=s.get("second_per_grid_ts"))
        np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    # fractional seconds per grid: temporal patch i sits at int(i * 0.75 * tps) after the video's start
    ours = rope_index(samples[0]["input_ids"], None, hf_tiny.IMAGE, 2, tps, video_grid_thw=samples[0]["video_grid_thw"],
                      video_token_id=VIDEO, second_per_grid_ts=[0.75])
    start = int(np.flatnonzero(samples[0]["input_ids"] == VIDEO)[0])
    _, gh, gw = samples[0]["video_grid_thw"][0]
    per_t = gh * gw // 4  # merged tokens per temporal patch
    t_pos = ours[0, start::per_t][:3] - ours[0, start]
    np.testing.assert_array_equal(t_pos, [int(i * 0.75 * tps) for i in range(3)])


def test_logits_match_hf_videos_batched_and_packed(hf_pair):
    hf, model, samples = hf_pair
    with torch.no_grad():
        refs = [hf(**_hf_kwargs(s)).logits[0].numpy() for s in samples]
    for rows in ([[s] for s in samples], [samples]):
        logits = model(*model_args(build_model_inputs(rows, model.config)))[0].asnumpy()
        k = 0
        for r, row in enumerate(rows):
            col = 0
            for s in row:
                n = len(s["input_ids"])
                err = np.abs(logits[r, col:col + n] - refs[k]).max()
                assert err <= TOL, (r, k, err)
                col, k = col + n, k + 1


def test_video_token_mismatch_names_the_sample(hf_pair):
    _, model, samples = hf_pair
    s = dict(samples[0])
    s["input_ids"] = np.concatenate([s["input_ids"], [VIDEO]])
    with pytest.raises(ValueError, match="row 0 sample 0: sample has .* video tokens but its videos give"):
        build_model_inputs([[s]], model.config)


def test_accumulated_video_positions_by_hand():
    """text.mrope_accumulate: each temporal patch placed after the previous one, like separate images."""
    # 4 text tokens, a video of 3 temporal patches on a 2x3 merged grid (h/m=2, w/m=3), 2 text tokens
    ids = np.array([1, 2, 3, 4] + [VIDEO] * 18 + [5, 6])
    pos = rope_index(ids, None, hf_tiny.IMAGE, 2, 2, video_grid_thw=[[3, 4, 6]], video_token_id=VIDEO,
                     second_per_grid_ts=[1.0], accumulate=True)
    rows, cols = np.repeat([0, 1], 3), np.tile([0, 1, 2], 2)
    for i in range(3):  # patch i starts at 4 + 3 * i (max(h/m, w/m) = 3 per patch)
        blk = pos[:, 4 + 6 * i: 10 + 6 * i]
        np.testing.assert_array_equal(blk[0], np.full(6, 4 + 3 * i))
        np.testing.assert_array_equal(blk[1], 4 + 3 * i + rows)
        np.testing.assert_array_equal(blk[2], 4 + 3 * i + cols)
    np.testing.assert_array_equal(pos[:, -2:], [[13, 14]] * 3)  # text resumes at (10 + 2) + 1: last patch max col
    # without accumulation the three patches share the (row, col) grid and differ on t only
    plain = rope_index(ids, None, hf_tiny.IMAGE, 2, 2, video_grid_thw=[[3, 4, 6]], video_token_id=VIDEO,
                       second_per_grid_ts=[1.0])
    np.testing.assert_array_equal(plain[1, 4:10], plain[1, 10:16])
    np.testing.assert_array_equal(plain[0, 4:22:6], [4, 6, 8])


def test_greedy_generation_with_videos_equals_transformers():
    """KV-cache generation (the infer tests' shared tiny model) on a video and an image + video prompt gives
    transformers' greedy tokens, batched with left padding."""
    from mindvl_ms.infer.generate import generate

    _, hf, model, _ = infer_tiny.setup()
    rng = np.random.default_rng(11)
    samples = [_sample(rng, items) for items in SAMPLES[:2]]
    refs = []
    for s in samples:
        with torch.no_grad():
            out = hf.generate(**_hf_kwargs(s), max_new_tokens=5, do_sample=False)
        refs.append(out[0, len(s["input_ids"]):].tolist())
    assert generate(model, samples, 5) == refs
    assert [generate(model, [s], 5)[0] for s in samples] == refs


def test_accumulated_positions_across_two_images_and_a_video():
    """Every image starts after the previous item's largest position, and with accumulation so does every
    temporal patch of the video: no two visual items (or frames) share a position on any axis."""
    # text 2, image A (1x4x4 -> 2x2 merged), text 1, image B (1x2x6 -> 1x3), video (grid 2x2x2: 2 patches of 1x1)
    ids = np.array([1, 2] + [hf_tiny.IMAGE] * 4 + [3] + [hf_tiny.IMAGE] * 3 + [VIDEO] * 2 + [4])
    pos = rope_index(ids, [[1, 4, 4], [1, 2, 6]], hf_tiny.IMAGE, 2, 2, video_grid_thw=[[2, 2, 2]],
                     video_token_id=VIDEO, second_per_grid_ts=[1.0], accumulate=True)
    expect = np.array([
        [0, 1, 2, 2, 2, 2, 4, 5, 5, 5, 8, 9, 10],   # t
        [0, 1, 2, 2, 3, 3, 4, 5, 5, 5, 8, 9, 10],   # h
        [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10],   # w
    ])
    np.testing.assert_array_equal(pos, expect)
