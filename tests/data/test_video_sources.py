"""Video settings per data source (`data.sources[].video` over `data.video`): the same clip read from two
sources gives each source's frame count, frame times and frame budget, predicted here in numpy (frames from
`fps`, indices as `round(linspace)`, fps draws from the seeded generator) with transformers' smart_resize and
Qwen2VLImageProcessor as the references for sizes and patches; the packer's metadata counts and the online
loader agree with them; the data fingerprint follows a source's video settings; the shipped openPangu-VL
configs load the report's settings (section 2.4)."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.config.base import ConfigError, load
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data.offline import sample_meta
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import parse_line
from mindvl_ms.data.skiplog import data_fingerprint, fingerprint_diff
from tests.support.paths import ROOT
from tests.support.video import write_video

FRAMES, FPS, W, H = 60, 10, 96, 64            # a 6-second clip
SEED = 1234
STAGE = {"fps_range": [5.0, 6.0], "video_min_pixels": 4 * 784, "video_max_pixels": 16 * 784,
         "video_total_pixels": 64 * 784}
SUMMARY = {"fps_range": [2.5, 4.0]}            # random FPS
LOCAL = {"fps": 1.0}                           # constant 1 FPS (the stage's fps_range must not apply)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    d = tmp_path_factory.mktemp("vsrc")
    frames = write_video(d / "clip.mkv", frames=FRAMES, fps=FPS, width=W, height=H)
    line = {"videos": ["clip.mkv"], "video_meta": [{"frames": FRAMES, "fps": FPS, "width": W, "height": H}],
            "messages": [{"role": "user", "content": "<video>\nWhat happens?"}, {"role": "assistant", "content": "x"}]}
    paths = {}
    for name in ("summary", "local", "plain"):
        paths[name] = str(d / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.write(json.dumps(line) + "\n")
    cfg = load(DataConfig, {"seed": SEED, "video": STAGE, "packing": "online", "seq_length": 4096,
                            "sources": [{"path": paths["summary"], "video": SUMMARY},
                                        {"path": paths["local"], "video": LOCAL},
                                        {"path": paths["plain"]}]})
    return cfg, paths, frames


def _predict(fps_range, fps, line=1, k=0):
    """(nframes, frame indices, frame times in s, sample fps) by hand: fps drawn like data/video.py's seeded
    generator, nframes = frames / video_fps * fps clamped to [4, frames] and floored to a multiple of 2."""
    if fps_range:
        fps = np.random.default_rng([SEED, line, k]).uniform(*fps_range)
    n = FRAMES / FPS * fps
    n = int(np.floor(min(max(n, 4), FRAMES) / 2) * 2)
    idx = np.round(np.linspace(0, FRAMES - 1, n)).astype(np.int64)
    return n, idx, idx / FPS, n / FRAMES * FPS


def _size(n):
    """Per-frame (h, w) under the stage's frame budget, by transformers' smart_resize."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    vmin, vmax, total = STAGE["video_min_pixels"], STAGE["video_max_pixels"], STAGE["video_total_pixels"]
    return smart_resize(H, W, 28, vmin, max(min(vmax, total / n * 2), int(vmin * 1.05)))


def test_two_sources_sample_the_same_clip_as_numpy_predicts(mix):
    from transformers import Qwen2VLImageProcessor

    cfg, paths, frames = mix
    proc = MindVLProcessor(config=cfg)
    expect = {"summary": _predict(SUMMARY["fps_range"], None), "local": _predict(None, LOCAL["fps"]),
              "plain": _predict(STAGE["fps_range"], None)}
    assert expect["local"][0] == 6 and expect["local"][1].tolist() == [0, 12, 24, 35, 47, 59]  # 1 fps over 6 s
    assert 15 <= expect["summary"][0] <= 24 and 30 <= expect["plain"][0] <= 36
    for name, (n, idx, times, sfps) in expect.items():
        s = parse_line(open(paths[name]).readline(), paths[name], 1)
        out = proc.process_sample(s)
        h, w = _size(n)
        assert out["video_grid_thw"].tolist() == [[n // 2, h // 14, w // 14]], name
        np.testing.assert_allclose(out["second_per_grid_ts"], [2 / sfps], rtol=1e-12)
        # the frame times: the patches are those of exactly the predicted frames
        pics = [Image.fromarray(frames[i]).resize((w, h), resample=Image.BICUBIC) for i in idx]
        ref = Qwen2VLImageProcessor(min_pixels=h * w, max_pixels=h * w)(images=None, videos=[pics],
                                                                          return_tensors="np")
        np.testing.assert_allclose(out["pixel_values_videos"], ref["pixel_values_videos"], atol=1e-6)
        assert times[0] == 0.0 and times[-1] == pytest.approx((FRAMES - 1) / FPS)
        # the packer counts from metadata what the loader decodes, with the source's own settings
        tokens, visual = sample_meta(proc, s)
        assert tokens == len(out["input_ids"]) and visual == n // 2 * (h // 28) * (w // 28), name
    assert expect["local"][3] == 1.0 and expect["summary"][0] != expect["local"][0] != expect["plain"][0]


def test_online_loader_applies_each_sources_settings(mix):
    cfg, paths, _ = mix
    loader = DataLoader.from_config(cfg)
    rows = [s for batch in loader for row in batch for s in row]
    got = {os.path.basename(r["source"]): int(r["video_grid_thw"][0, 0]) * 2 for r in rows}
    want = {f"{k}.jsonl": v[0] for k, v in {"summary": _predict(SUMMARY["fps_range"], None),
                                            "local": _predict(None, 1.0),
                                            "plain": _predict(STAGE["fps_range"], None)}.items()}
    assert got == want


def test_fingerprint_follows_a_sources_video_settings(mix):
    cfg, paths, _ = mix
    base = data_fingerprint(cfg)
    other = load(DataConfig, {"seed": SEED, "video": STAGE, "packing": "online",
                              "sources": [{"path": paths["summary"], "video": {"fps_range": [2.5, 3.0]}},
                                          {"path": paths["local"], "video": LOCAL}, {"path": paths["plain"]}]})
    assert base["sources"][1]["video"] == LOCAL and "video" not in base["sources"][2]
    assert fingerprint_diff(base, data_fingerprint(other)) == f"{os.path.abspath(paths['summary'])} changed (video)"


def test_source_settings_are_checked_over_the_stages():
    with pytest.raises(ConfigError, match=r"source a.jsonl: video.fps_range \[2.0, 1.0\]"):
        load(DataConfig, {"sources": [{"path": "a.jsonl", "video": {"fps_range": [2.0, 1.0]}}]})
    with pytest.raises(ConfigError, match="source b.jsonl: video: need 1 <= min_frames <= max_frames, got 4, 2"):
        load(DataConfig, {"video": {"min_frames": 4}, "sources": [{"path": "b.jsonl", "video": {"max_frames": 2}}]})
    with pytest.raises(ConfigError, match="listed twice with different video settings"):
        load(DataConfig, {"sources": [{"path": "a.jsonl", "video": {"fps": 1.0}}, {"path": "./a.jsonl"}]})
    with pytest.raises(ConfigError, match="did you mean 'fps_range'"):
        load(DataConfig, {"sources": [{"path": "a.jsonl", "video": {"fps_rang": [1.0, 2.0]}}]})


@pytest.mark.parametrize("name", ["run/openpangu-vl-7b-64npu.yaml", "stage/openpangu-vl-7b.yaml"])
def test_openpangu_video_sources_carry_the_reports_settings(name):
    """Section 2.4: random FPS for summary-type data, a constant FPS of 1 for temporal localisation, under a
    frame budget; in every stage that trains on video."""
    cfg = load_run_config(os.path.join(ROOT, "configs", name))
    stages = {s.name: cfg.stage_data(s) for s in cfg.stages}
    for stage in ("pretraining", "annealing", "sft"):
        data = stages[stage]
        by_name = {s.name: data.video_for(s.path) for s in data.sources}
        summary, local = by_name["video_summary"], by_name["video_temporal_localization"]
        assert summary.fps_range == [0.5, 2.0], stage
        assert (local.fps, local.fps_range) == (1.0, []), stage
        for v in (summary, local):
            assert (v.max_frames, v.video_total_pixels) == (224, 16384 * 28 * 28), stage
            assert v.max_frames // 2 * v.video_min_pixels // 784 <= data.visual_budget()
        assert data.video_for("other.jsonl") is data.video  # a file outside the mix: the stage's settings
    assert not stages["warmup"].sources and not stages["dpo"].sources
