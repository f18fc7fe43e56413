"""Grounding syntax: format/parse round trips, malformed labels, normalisation, IoU against hand values.
Run: pytest -q tests/data/test_grounding.py"""
import numpy as np
import pytest

from mindvl_ms.data.grounding import (GroundingError, Shape, box_iou, format_box, format_object, format_point,
                                      format_quad, from_norm, grounding_errors, parse_grounding, to_norm)
from mindvl_ms.data.image import smart_resize
from mindvl_ms.data.processor import MindVLProcessor


def test_format_matches_report_syntax():
    assert format_box(10, 20, 300, 400) == "<|box_start|>(10,20),(300,400)<|box_end|>"
    assert format_point(8, 999, "zero_pad") == "<|point_start|>(008,999)<|point_end|>"
    assert format_quad([(1, 2), (30, 2), (30, 40), (1, 40)], "digits") == \
        "<|quad_start|>(0 0 1,0 0 2),(0 3 0,0 0 2),(0 3 0,0 4 0),(0 0 1,0 4 0)<|quad_end|>"
    with pytest.raises(GroundingError, match="outside 0..999"):
        format_box(0, 0, 1000, 5)


@pytest.mark.parametrize("fmt", ["plain", "zero_pad", "digits"])
def test_round_trip_all_formats(fmt):
    shapes = [Shape("box", [(5, 6), (700, 801)]), Shape("point", [(0, 999)]),
              Shape("quad", [(10, 10), (90, 12), (88, 70), (9, 69)])]
    text = "Here: " + format_object("red car", shapes[:2], fmt) + " and " + format_object(None, shapes[2:], fmt)
    objs = parse_grounding(text, strict=True)
    assert [o.ref for o in objs] == ["red car", "red car"] or [o.ref for o in objs] == ["red car"]
    got = [(s.kind, s.points) for o in objs for s in o.shapes]
    assert got == [(s.kind, s.points) for s in shapes]
    assert grounding_errors(text) == []


def test_refs_group_shapes():
    t = ("<|object_ref_start|>cat<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
         "<|box_start|>(5,6),(7,8)<|box_end|><|object_ref_start|>dog<|object_ref_end|><|point_start|>(9,9)<|point_end|>")
    objs = parse_grounding(t)
    assert [(o.ref, [s.points for s in o.shapes]) for o in objs] == [
        ("cat", [[(1, 2), (3, 4)], [(5, 6), (7, 8)]]), ("dog", [[(9, 9)]])]
    assert objs[0].shapes[1].box == (5, 6, 7, 8)


@pytest.mark.parametrize("bad, msg", [
    ("<|box_start|>(1,2),(3,4)", "never closed"),
    ("(1,2)<|box_end|>", "without its opening"),
    ("<|box_start|>(1,2)<|box_end|>", "expected 2"),
    ("<|box_start|>(1,2),(3,1000)<|box_end|>", "outside 0..999"),
    ("<|box_start|>(1.5,2),(3,4)<|box_end|>", "integers"),
    ("<|point_start|>(1,2)<|box_end|>", "closed by"),
    ("<|box_start|>(50,50),(10,10)<|box_end|>", "top-left"),
])
def test_malformed_labels(bad, msg):
    assert msg in grounding_errors(bad)[0]
    with pytest.raises(GroundingError):
        parse_grounding(bad, strict=True)


def test_lenient_parse_keeps_valid_shapes():
    text = "<|box_start|>(1,2),(3,4)<|box_end|> junk <|box_start|>(9,9)<|box_end|><|point_start|>(5,5)<|point_end|>"
    assert [s.points for o in parse_grounding(text) for s in o.shapes] == [[(1, 2), (3, 4)], [(5, 5)]]


def test_normalisation_original_and_resized():
    w, h = 640, 480
    px = np.array([[0, 0], [320, 240], [640, 480], [100.4, 33.3]])
    n = to_norm(px, w, h)
    assert n.tolist() == [[0, 0], [500, 500], [999, 999], [157, 69]]  # 100.4*999/640=156.7, 33.3*999/480=69.3
    back = from_norm(n, w, h)
    assert np.abs(back - px).max() <= max(w, h) / 999 / 2 + 1e-9
    rh, rw = smart_resize(h, w)  # the same label on the resized image: scale by the new size
    np.testing.assert_allclose(from_norm(n, rw, rh), back * [rw / w, rh / h])


def test_box_iou_hand_values():
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    m = box_iou([[0, 0, 10, 10], [0, 0, 5, 10]], [[0, 0, 10, 10], [5, 0, 10, 10], [0, 0, 0, 0]])
    np.testing.assert_allclose(m, [[1, 0.5, 0], [0.5, 0, 0]])


def test_coordinates_tokenize_digit_by_digit():
    tok = MindVLProcessor.from_pretrained().tokenizer
    ids = tok.encode(format_box(8, 123, 456, 999, "zero_pad"))
    assert ids[0] == 151648 and ids[-1] == 151649  # <|box_start|> ... <|box_end|> are single tokens
    pieces = [tok.decode([i]) for i in ids[1:-1]]
    assert "".join(pieces) == "(008,123),(456,999)"
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("008123456999")  # one token per digit
