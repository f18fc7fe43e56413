"""Preference and RL-prompt lines: schema errors with line numbers through `mindvl data validate`, the
same image/grounding checks as SFT lines, and the token layout of prompt + response."""
import json

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.data.preference import encode_response, parse_post, read_post_file
from mindvl_ms.data.schema import SampleError
from mindvl_ms.data.validate import validate_file

BOX = "<|box_start|>(10,20),(300,400)<|box_end|>"


def _lines(tmp_path):
    (tmp_path / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(
        tmp_path / "img" / "ok.png")
    user = [{"role": "user", "content": "<image>Where?"}]
    rows = [
        {"images": ["img/ok.png"], "messages": user, "chosen": BOX, "rejected": "nowhere"},            # 1 ok
        {"images": ["img/ok.png"], "messages": user, "answer": BOX, "reward": "grounding_iou"},        # 2 ok
        {"images": ["img/ok.png"], "messages": user, "chosen": "a"},                                   # 3 no rejected
        {"images": ["img/ok.png"], "messages": user, "chosen": "a", "answer": "b"},                    # 4 mixed kinds
        {"images": ["img/ok.png"], "messages": user + [{"role": "assistant", "content": "x"}],
         "answer": "x"},                                                                                # 5 ends with assistant
        {"images": ["img/missing.png"], "messages": user, "answer": "2"},                              # 6 missing image
        {"images": ["img/ok.png"], "messages": user, "chosen": "<|box_start|>(1,2),(3,1200)<|box_end|>",
         "rejected": "b"},                                                                              # 7 grounding
        {"messages": user, "answer": "2"},                                                              # 8 count mismatch
        {"images": ["img/ok.png"], "messages": user, "chosen": "same", "rejected": "same"},             # 9 identical
        {"images": ["img/ok.png"], "messages": user, "answer": "2", "rewrd": "x"},                      # 10 typo
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},                             # 11 ok, text only
    ]
    path = tmp_path / "post.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_validate_reports_post_lines(tmp_path):
    rep = validate_file(_lines(tmp_path), workers=1, progress=False)
    by_line = {}
    for e in rep["errors"]:
        by_line.setdefault(e["line"], []).append(e["reason"])
    assert set(by_line) == {3, 4, 5, 6, 7, 8, 9, 10}
    assert by_line[6] == ["missing image"] and by_line[7] == ["grounding"]
    assert by_line[8] == ["image count mismatch"]
    assert all(r == ["schema"] for k, r in by_line.items() if k in (3, 4, 5, 9, 10))
    assert "rewrd" in next(e["detail"] for e in rep["errors"] if e["line"] == 10)


def test_read_post_file_kind_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}) + "\n")
    pairs = read_post_file(str(p), "preference")
    assert pairs[0].chosen == "a" and pairs[0].rejected == "b" and pairs[0].kind == "preference"
    with pytest.raises(SampleError, match="expected a prompt line"):
        read_post_file(str(p), "prompt")
    with pytest.raises(SampleError, match="must end with a user turn"):
        parse_post({"messages": [{"role": "assistant", "content": "q"}], "answer": "a"}, "f", 3)


def test_encode_response_layout():
    prompt = {"input_ids": np.array([5, 6, 7]), "pixel_values": None, "image_grid_thw": None}
    s = encode_response(prompt, [11, 12], end=[99])
    np.testing.assert_array_equal(s["input_ids"], [5, 6, 7, 11, 12, 99])
    np.testing.assert_array_equal(s["labels"], [-100, -100, -100, 11, 12, 99])
    s = encode_response(prompt, [11, 99], end=[99])  # already ends with the end token: not doubled
    np.testing.assert_array_equal(s["input_ids"], [5, 6, 7, 11, 99])
