"""3D-IM-RoPE positions of video and time (`rope_index(..., accumulate=True)`, openPangu-VL sections 2.3-2.4):
with accumulation the positions follow frame order, so a clip sampled at 2 fps and the same frames sampled at
1 fps get the same positions; without it they follow seconds (Qwen2.5-VL's absolute time). Both against a
hand computation in numpy."""
import numpy as np

from mindvl_ms.data.rope_index import rope_index

IMG, VID, TPS = 151655, 151656, 2
T, H, W = 3, 4, 6                    # 3 temporal patches (6 frames) of 2 x 3 merged tokens each
LH, LW = H // 2, W // 2
IDS = np.array([1, 2] + [VID] * (T * LH * LW) + [3, 4])


def _positions(spg, accumulate):
    return rope_index(IDS, None, IMG, 2, TPS, video_grid_thw=np.array([[T, H, W]]), video_token_id=VID,
                      second_per_grid_ts=[spg], accumulate=accumulate)


def _hand(t_of_patch, step):
    """Two text tokens at 0, 1; temporal patch i's token (r, c) at (2 + i*step + t_of_patch[i], 2 + i*step + r,
    2 + i*step + c); then the text after the largest position."""
    cols = [(0, 0, 0), (1, 1, 1)]
    for i in range(T):
        for r in range(LH):
            for c in range(LW):
                s = 2 + i * step
                cols.append((s + t_of_patch[i], s + r, s + c))
    nxt = max(max(col) for col in cols) + 1
    cols += [(nxt,) * 3, (nxt + 1,) * 3]
    return np.array(cols, np.int64).T


def test_accumulated_positions_follow_frames_not_seconds():
    fps2 = _positions(2 / 2.0, True)   # 2 fps: one temporal patch (2 frames) spans 1 s
    fps1 = _positions(2 / 1.0, True)   # 1 fps: 2 s
    want = _hand([0, 0, 0], max(LH, LW))  # each patch starts after the previous one, like an image
    np.testing.assert_array_equal(fps2, want)
    np.testing.assert_array_equal(fps1, want)
    assert want[:, -1].tolist() == [12, 12, 12]  # last patch starts at 2 + 2*3 = 8, widest at 8 + 2; text 11, 12


def test_without_accumulation_positions_follow_seconds():
    fps2, fps1 = _positions(1.0, False), _positions(2.0, False)
    np.testing.assert_array_equal(fps2, _hand([int(i * 1.0 * TPS) for i in range(T)], 0))   # t = 0, 2, 4
    np.testing.assert_array_equal(fps1, _hand([int(i * 2.0 * TPS) for i in range(T)], 0))   # t = 0, 4, 8
    assert not np.array_equal(fps1, fps2)
