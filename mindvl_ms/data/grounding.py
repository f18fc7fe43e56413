"""Grounding labels in the openPangu-VL syntax: format, parse, validate, normalise, IoU.

Syntax (openPangu-VL report, appendix A.1), no whitespace between consecutive tags:
    <|object_ref_start|>cat<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>
    <|point_start|>(x,y)<|point_end|>
    <|quad_start|>(x1,y1),(x2,y2),(x3,y3),(x4,y4)<|quad_end|>
Coordinates are integers 0..999, relative to the image (origin top-left, x along the width).

Coordinate formats (report section 5.2.3): "zero_pad" (`008`, three digits, the report's better choice
and this project's default: `data.grounding.coord_format`, config/grounding.py), "plain" (`8`) and
"digits" (`0 0 8`, each digit its own word, for tokenizers that do not split numbers; the Qwen tokenizer
already emits one token per digit). `parse_grounding` reads all three, always. The format_* functions
write the format they are given (plain when none: a number as written); `reformat_grounding` rewrites
the labels of a text into one format, which is how the processor applies the configured format to every
sample (data/processor.py) and a checkpoint's recorded one to prompts (data/processor_files.py).

Normalisation: n = clip(floor(v * 999 / size + 0.5), 0, 999) and back v = n / 999 * size; since the
numbers are relative, the same label serves the original and the smart-resized image: pass the
size of the image you want pixels for.

Public API (used by evaluation code):
    parse_grounding(text, strict=False) -> list[GroundedObject]   # ref name + shapes
    grounding_errors(text) -> list[str]                             # empty when the text is valid
    format_point / format_box / format_quad / format_ref / format_object
    reformat_grounding(text, coord_format) / reformat_messages(messages, coord_format)
    to_norm(points, width, height) / from_norm(points, width, height)
    box_iou(a, b)  # boxes (x1, y1, x2, y2); [4] x [4] -> float, [N,4] x [M,4] -> [N, M]
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindvl_ms.config.grounding import COORD_FORMATS

REF_START, REF_END = "<|object_ref_start|>", "<|object_ref_end|>"
TAGS = {"point": ("<|point_start|>", "<|point_end|>", 1),
        "box": ("<|box_start|>", "<|box_end|>", 2),
        "quad": ("<|quad_start|>", "<|quad_end|>", 4)}
_NUM = r"(\d(?: ?\d)*)"
_PAIR = re.compile(r"\(\s*" + _NUM + r"\s*,\s*" + _NUM + r"\s*\)")
_ANY_TAG = re.compile("|".join(re.escape(t) for t in
                               [REF_START, REF_END] + [x for s, e, _ in TAGS.values() for x in (s, e)]))


class GroundingError(ValueError):
    """A malformed grounding label (unbalanced tags, bad coordinates, wrong point count)."""


@dataclass
class Shape:
    kind: str                       # point | box | quad
    points: List[Tuple[int, int]]   # normalised 0..999 coordinates

    @property
    def box(self) -> Tuple[int, int, int, int]:
        """Axis-aligned (x1, y1, x2, y2) enclosing the shape."""
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        return min(xs), min(ys), max(xs), max(ys)


@dataclass
class GroundedObject:
    ref: Optional[str]                        # object name, None when no <|object_ref_start|> preceded
    shapes: List[Shape] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# formatting

def format_coord(v: int, coord_format: str = "plain") -> str:
    v = int(v)
    if not 0 <= v <= 999:
        raise GroundingError(f"coordinate {v} outside 0..999")
    if coord_format == "plain":
        return str(v)
    if coord_format == "zero_pad":
        return f"{v:03d}"
    if coord_format == "digits":
        return " ".join(f"{v:03d}")
    raise GroundingError(f"coord_format {coord_format!r}: expected one of {COORD_FORMATS}")


def _pairs(points: Sequence[Sequence[int]], fmt: str) -> str:
    return ",".join(f"({format_coord(x, fmt)},{format_coord(y, fmt)})" for x, y in points)


def format_point(x: int, y: int, coord_format: str = "plain") -> str:
    return f"<|point_start|>{_pairs([(x, y)], coord_format)}<|point_end|>"


def format_box(x1: int, y1: int, x2: int, y2: int, coord_format: str = "plain") -> str:
    return f"<|box_start|>{_pairs([(x1, y1), (x2, y2)], coord_format)}<|box_end|>"


def format_quad(points: Sequence[Sequence[int]], coord_format: str = "plain") -> str:
    if len(points) != 4:
        raise GroundingError(f"a quad needs 4 points, got {len(points)}")
    return f"<|quad_start|>{_pairs(points, coord_format)}<|quad_end|>"


def format_ref(name: str) -> str:
    return f"{REF_START}{name}{REF_END}"


def format_object(ref: Optional[str], shapes: Sequence[Shape], coord_format: str = "plain") -> str:
    """Optional ref followed by its shapes, no whitespace between tags."""
    out = [format_ref(ref)] if ref is not None else []
    for s in shapes:
        start, end, n = TAGS[s.kind]
        if len(s.points) != n:
            raise GroundingError(f"a {s.kind} needs {n} point(s), got {len(s.points)}")
        out.append(f"{start}{_pairs(s.points, coord_format)}{end}")
    return "".join(out)


# ----------------------------------------------------------------------------------------------
# parsing

def _parse_shape(kind: str, body: str) -> Shape:
    n = TAGS[kind][2]
    pairs = list(_PAIR.finditer(body))
    rest = _PAIR.sub("", body).replace(",", "").strip()
    if rest or len(pairs) != n:
        raise GroundingError(f"{kind} body {body!r}: expected {n} '(x,y)' pair(s) of integers")
    pts = []
    for m in pairs:
        x, y = (int(g.replace(" ", "")) for g in m.groups())
        if not (0 <= x <= 999 and 0 <= y <= 999):
            raise GroundingError(f"{kind} coordinate ({x},{y}) outside 0..999")
        pts.append((x, y))
    if kind == "box" and (pts[0][0] > pts[1][0] or pts[0][1] > pts[1][1]):
        raise GroundingError(f"box {pts}: expected (x1,y1) top-left and (x2,y2) bottom-right")
    return Shape(kind, pts)


def parse_grounding(text: str, strict: bool = False) -> List[GroundedObject]:
    """All grounded objects in `text`. Shapes attach to the latest object ref (None before any).
    strict=False skips malformed shapes (evaluation of model output); strict=True raises GroundingError."""
    objects: List[GroundedObject] = []
    current: Optional[GroundedObject] = None
    pos, open_tag = 0, None
    for m in _ANY_TAG.finditer(text):
        tag = m.group(0)
        try:
            if open_tag is None:
                if tag == REF_START:
                    open_tag, pos = tag, m.end()
                elif any(tag == s for s, _, _ in TAGS.values()):
                    open_tag, pos = tag, m.end()
                else:
                    raise GroundingError(f"closing tag {tag} at char {m.start()} without its opening tag")
                continue
            body = text[pos:m.start()]
            if open_tag == REF_START and tag == REF_END:
                current = GroundedObject(body.strip())
                objects.append(current)
            else:
                kind = next((k for k, (s, e, _) in TAGS.items() if s == open_tag), None)
                if kind is None or tag != TAGS[kind][1]:
                    raise GroundingError(f"tag {open_tag} closed by {tag} at char {m.start()}")
                shape = _parse_shape(kind, body)
                if current is None:
                    current = GroundedObject(None)
                    objects.append(current)
                current.shapes.append(shape)
            open_tag = None
        except GroundingError:
            if strict:
                raise
            open_tag = None
    if open_tag is not None and strict:
        raise GroundingError(f"tag {open_tag} is never closed")
    return objects


def grounding_errors(text: str) -> List[str]:
    """Problems with the grounding tags in `text` (empty list: valid or no grounding at all)."""
    try:
        parse_grounding(text, strict=True)
    except GroundingError as e:
        return [str(e)]
    return []


def has_grounding(text: str) -> bool:
    return _ANY_TAG.search(text) is not None


# ----------------------------------------------------------------------------------------------
# rewriting the labels of a text into one format

_SHAPE = re.compile("|".join(f"(?P<{k}>{re.escape(s)})(?P<{k}_body>.*?){re.escape(e)}"
                             for k, (s, e, _) in TAGS.items()), re.S)


def _reformat_shape(m: "re.Match", coord_format: str) -> str:
    kind = next(k for k in TAGS if m.group(k) is not None)
    start, end, _ = TAGS[kind]
    try:
        shape = _parse_shape(kind, m.group(f"{kind}_body"))
    except GroundingError:
        return m.group(0)  # a malformed label stays as written (mindvl data validate names it)
    return f"{start}{_pairs(shape.points, coord_format)}{end}"


def reformat_grounding(text: str, coord_format: str) -> str:
    """`text` with the coordinates of every well-formed point/box/quad label written in `coord_format`;
    everything else, malformed labels included, unchanged (a text already in that format comes back equal)."""
    if coord_format not in COORD_FORMATS:
        raise GroundingError(f"coord_format {coord_format!r}: expected one of {COORD_FORMATS}")
    if "_start|>" not in text:
        return text
    return _SHAPE.sub(lambda m: _reformat_shape(m, coord_format), text)


def reformat_messages(messages: List[Dict[str, str]], coord_format: str) -> List[Dict[str, str]]:
    """The messages with `reformat_grounding` applied to every turn's content (new dicts; the input is kept)."""
    return [dict(m, content=reformat_grounding(m["content"], coord_format)) for m in messages]


# ----------------------------------------------------------------------------------------------
# coordinates

def to_norm(points, width: float, height: float) -> np.ndarray:
    """Pixel (x, y) points [..., 2] -> integers 0..999 relative to an image of width x height."""
    p = np.asarray(points, dtype=np.float64)
    n = np.floor(p * 999.0 / np.array([width, height], dtype=np.float64) + 0.5)  # round half up
    return np.clip(n, 0, 999).astype(np.int64)


def from_norm(points, width: float, height: float) -> np.ndarray:
    """Normalised 0..999 points [..., 2] -> pixel coordinates on an image of width x height."""
    p = np.asarray(points, dtype=np.float64)
    return p * np.array([width / 999.0, height / 999.0])


def box_iou(a, b):
    """IoU of boxes (x1, y1, x2, y2): two boxes -> float; [N,4] and [M,4] -> float64[N, M]."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    single = a.ndim == 1 and b.ndim == 1
    a, b = a.reshape(-1, 4), b.reshape(-1, 4)
    area = lambda x: np.clip(x[:, 2] - x[:, 0], 0, None) * np.clip(x[:, 3] - x[:, 1], 0, None)  # noqa: E731
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    union = area(a)[:, None] + area(b)[None, :] - inter
    iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
    return float(iou[0, 0]) if single else iou
