"""Video sampling, frame budget and patches against transformers 4.57.1 and hand-computed cases.

transformers' own video processor needs torchvision, which does not install beside the pinned torch;
the references here are its `smart_resize` and `Qwen2VLImageProcessor.preprocess(videos=...)` (the
Qwen2.5-VL patch order of a frame list), torch.linspace(...).round() for the frame indices (as
qwen-vl-utils samples), and hand-computed frame counts.
"""
import numpy as np
import pytest
import torch

from mindvl_ms.config.data import ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data import video as V
from tests.support.video import write_video


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("vid") / "clip.mkv"
    data = write_video(path, frames=30, fps=10, width=96, height=64)
    return path, data


def test_probe_and_lossless_decode(clip):
    path, data = clip
    meta = V.probe_video(str(path))
    assert (meta.frames, meta.fps, meta.width, meta.height) == (30, 10.0, 96, 64)
    frames = V.decode_frames(str(path), [0, 7, 29])
    for i, f in zip([0, 7, 29], frames):
        np.testing.assert_array_equal(np.asarray(f), data[i])


@pytest.mark.parametrize("fps,min_frames,max_frames,expect", [
    (2.0, 4, 768, 6),     # 30 frames / 10 fps * 2 = 6
    (1.0, 4, 768, 4),     # 3 -> raised to min_frames 4
    (2.0, 3, 768, 6),     # min_frames rounds up to 4, 6 stays
    (5.0, 4, 9, 8),       # 15 -> capped at max_frames floor(9/2)*2 = 8
    (100.0, 4, 768, 30),  # more than the video has -> all 30 frames
    (3.0, 4, 768, 8),     # 9 -> floored to a multiple of the temporal patch: 8
])
def test_num_frames_hand_cases(fps, min_frames, max_frames, expect):
    cfg = VideoConfig(fps=fps, min_frames=min_frames, max_frames=max_frames)
    assert V.num_frames(30, 10.0, fps, cfg, 2) == expect


def test_num_frames_too_short_names_limits():
    with pytest.raises(ValueError, match="cannot give 2 <= nframes <= 1"):
        V.num_frames(1, 10.0, 2.0, VideoConfig(), 2)


@pytest.mark.parametrize("total,n", [(30, 6), (300, 16), (7, 4), (101, 10)])
def test_frame_indices_match_torch_linspace_round(total, n):
    ref = torch.linspace(0, total - 1, n).round().long().numpy()
    np.testing.assert_array_equal(V.frame_indices(total, n), ref)


@pytest.mark.parametrize("w,h,n,total", [(640, 360, 8, 128000 * 784 * 0.9), (1920, 1080, 64, 24576 * 784),
                                         (1280, 720, 300, 16384 * 784), (320, 240, 4, 128000 * 784)])
def test_frame_budget_matches_transformers_smart_resize(w, h, n, total):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_resize

    img, cfg = ImageConfig(), VideoConfig(video_total_pixels=int(total))
    vmin, vmax = 128 * 784, 768 * 784
    max_pixels = max(min(vmax, int(total) / n * 2), int(vmin * 1.05))
    assert V.frame_size(w, h, n, img, cfg) == hf_resize(h, w, 28, vmin, max_pixels)
    # the budget is inversely proportional to the frame count until the per-frame limits bind
    if int(total) / n * 2 < vmax:
        hh, ww = V.frame_size(w, h, n, img, cfg)
        h2, w2 = V.frame_size(w, h, 2 * n, img, cfg)
        assert h2 * w2 <= hh * ww


def test_random_fps_is_reproducible_and_in_range():
    cfg = VideoConfig(fps_range=[0.5, 3.0])
    a = [V.sample_fps(cfg, V.video_rng(7, 12, k)) for k in range(5)]
    b = [V.sample_fps(cfg, V.video_rng(7, 12, k)) for k in range(5)]
    assert a == b and all(0.5 <= f <= 3.0 for f in a) and len(set(a)) == 5
    with pytest.raises(ValueError, match="seeded"):
        V.sample_fps(cfg, None)


def test_load_video_equals_transformers_patches(clip):
    """Sampled frames -> patches equal Qwen2VLImageProcessor.preprocess(videos=[frames]) on the same frames."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    path, data = clip
    img = ImageConfig()
    cfg = VideoConfig(fps=2.0, video_min_pixels=4 * 784, video_max_pixels=16 * 784, video_total_pixels=64 * 784)
    out = V.load_video(str(path), img, cfg)
    idx = torch.linspace(0, 29, 6).round().long().numpy()
    np.testing.assert_array_equal(out.frame_indices, idx)
    h, w = V.frame_size(96, 64, 6, img, cfg)
    frames = [Image.fromarray(data[i]).resize((w, h), resample=Image.BICUBIC) for i in idx]
    ref = Qwen2VLImageProcessor(min_pixels=h * w, max_pixels=h * w)(images=None, videos=[frames], return_tensors="np")
    np.testing.assert_array_equal(out.grid_thw, ref["video_grid_thw"][0])
    np.testing.assert_allclose(out.pixel_values, ref["pixel_values_videos"], atol=1e-6)
    assert out.grid_thw[0] == 3 and out.sample_fps == pytest.approx(6 / 30 * 10)
    assert out.second_per_grid == pytest.approx(2 / 2.0)
    # metadata-only token count equals the decoded one
    assert V.video_tokens(V.probe_video(str(path)), img, cfg) == out.pixel_values.shape[0] // 4


def test_unreadable_video_names_the_file(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all" * 10)
    with pytest.raises(ValueError, match="bad.mp4: unreadable video"):
        V.probe_video(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        V.probe_video(str(tmp_path / "missing.mp4"))


def test_metadata_check_names_fields():
    with pytest.raises(ValueError, match="fps > 0"):
        V.VideoMeta(frames=10, fps=0, width=10, height=10).check()
