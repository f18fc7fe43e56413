"""Videos in the JSONL format: processing, metadata-only token counts for packing, validation by line,
and the batch the model takes (mixed image + video samples packed into one row)."""
import json
import os

import numpy as np
import pytest

from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.offline import sample_meta
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import parse_line
from mindvl_ms.data.validate import validate_file
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.config import MindVLConfig
from tests.support.video import write_mixed_media

SMALL = dict(video_min_pixels=4 * 784, video_max_pixels=16 * 784, video_total_pixels=64 * 784)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("vj")
    write_mixed_media(d)
    (d / "broken.mp4").write_bytes(b"\x00" * 500)
    meta_a = {"frames": 30, "fps": 10, "width": 96, "height": 64}
    lines = [
        {"id": "v1", "videos": ["a.mkv"], "video_meta": [meta_a],
         "messages": [{"role": "user", "content": "<video>\nWhich way does the square move?"},
                      {"role": "assistant", "content": "right"}]},
        {"id": "v2", "images": ["img/astro.png"], "videos": ["b.mkv"],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " then "},
                                                   {"type": "video"}, {"type": "text", "text": " same?"}]},
                      {"role": "assistant", "content": "no"}]},
        {"id": "bad-file", "videos": ["broken.mp4"],
         "messages": [{"role": "user", "content": "<video> what?"}, {"role": "assistant", "content": "x"}]},
        {"id": "bad-meta", "videos": ["a.mkv"], "video_meta": [dict(meta_a, frames=300)],
         "messages": [{"role": "user", "content": "<video> what?"}, {"role": "assistant", "content": "x"}]},
        {"id": "bad-count", "videos": ["a.mkv", "b.mkv"],
         "messages": [{"role": "user", "content": "<video> what?"}, {"role": "assistant", "content": "x"}]},
        {"id": "bad-schema", "videos": ["a.mkv"], "video_meta": [{"frames": 30}],
         "messages": [{"role": "user", "content": "<video> what?"}, {"role": "assistant", "content": "x"}]},
    ]
    path = d / "v.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return str(path)


def _proc():
    return MindVLProcessor(config=DataConfig(video=VideoConfig(**SMALL)))


def test_processing_matches_metadata_counts(data):
    proc = _proc()
    for n, text in enumerate(open(data).read().splitlines()[:2], 1):
        s = parse_line(text, data, n)
        out = proc.process_sample(s)
        tokens, visual = sample_meta(proc, s)
        assert tokens == len(out["input_ids"])  # the packer's count, from metadata, is the real length
        n_video = int((out["input_ids"] == proc.video_pad_id).sum())
        assert n_video == out["pixel_values_videos"].shape[0] // 4
        n_image = int((out["input_ids"] == proc.image_pad_id).sum())
        assert visual == n_video + n_image
    # sample 1: 30 frames at 10 fps, 2 fps -> 6 frames -> 3 temporal patches of 1 s each
    s1 = proc.process_sample(parse_line(open(data).readline(), data, 1))
    assert s1["video_grid_thw"][0, 0] == 3 and s1["second_per_grid_ts"].tolist() == [1.0]
    assert s1["labels"][s1["input_ids"] == proc.video_pad_id].max() == -100  # pads are never supervised


def test_mixed_sample_builds_a_model_batch(data):
    proc = _proc()
    lines = open(data).read().splitlines()
    samples = [proc.process_sample(parse_line(lines[i], data, i + 1)) for i in range(2)]
    cfg = MindVLConfig()
    batch = build_model_inputs([samples], cfg)  # both samples packed into one row
    n_vis = sum(int(((s["input_ids"] == cfg.image_token_id) | (s["input_ids"] == cfg.video_token_id)).sum())
                for s in samples)
    flat = batch["embed_index"]  # row-local: into the row's concat(text [L], visual features)
    assert int((flat >= batch["input_ids"].shape[1]).sum()) == n_vis  # every visual token gathers a feature
    assert batch["pixel_values"].shape[1] == sum(
        s["pixel_values_videos"].shape[0] + (0 if s["pixel_values"] is None else s["pixel_values"].shape[0])
        for s in samples)


def test_validate_names_video_problems_by_line(data):
    rep = validate_file(data, workers=1, progress=False, video=VideoConfig(**SMALL))
    by_line = {}
    for e in rep["errors"]:
        by_line.setdefault(e["line"], []).append((e["reason"], e["detail"]))
    assert 1 not in by_line and 2 not in by_line
    assert by_line[3][0][0] == "unreadable video" and "videos[0]" in by_line[3][0][1] and "broken.mp4" in by_line[3][0][1]
    assert by_line[4][0][0] == "video metadata mismatch" and "frames=30" in by_line[4][0][1]
    assert by_line[5] == [("video count mismatch", "1 <video> placeholders for 2 videos")]
    assert by_line[6][0][0] == "schema" and "video_meta[0]" in by_line[6][0][1]


def test_call_with_a_video_path(data):
    proc = _proc()
    d = os.path.dirname(data)
    out = proc(messages=[{"role": "user", "content": "<video>\nDescribe."}], videos=[os.path.join(d, "a.mkv")])
    assert out["input_ids"].shape[0] == 1 and out["video_grid_thw"].tolist() == [[3, 4, 6]]
    assert int((out["input_ids"] == proc.video_pad_id).sum()) == 3 * 4 * 6 // 4
    with pytest.raises(Exception, match="1 <video> placeholders for 0 videos"):
        proc(messages=[{"role": "user", "content": "<video>\nDescribe."}])
