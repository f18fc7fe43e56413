"""Generated grounding for the demo: one coloured shape (circle, square, triangle; side 28..64 px, anywhere)
on a 112x112 canvas; the question names it by colour and shape and the answer is its box in the
openPangu-VL syntax, `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`, coordinates normalised to integers 0..999.
One shape, not a choice among several: the task is where, not which (in grounding-only runs of the demo
model, images with one or two shapes were learned several times slower than images with one:
docs/PERFORMANCE.md, "recipes")."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np
from PIL import Image, ImageDraw

from mindvl_ms.data.grounding import box_iou, format_box, to_norm
from mindvl_ms.recipes.demo.lines import sample_line


GROUND_SIZE = (112, 112)
GROUND_SHAPES = 1       # shapes per grounding image
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 50, 170), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: Tuple[int, int, int, int], colour) -> None:
    x1, y1, x2, y2 = box  # pixel box, (x2, y2) exclusive
    if kind == "circle":
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), fill=colour)
    elif kind == "square":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=colour)
    else:
        draw.polygon([((x1 + x2 - 1) / 2, y1), (x1, y2 - 1), (x2 - 1, y2 - 1)], fill=colour)


def _place(rng: np.random.Generator, taken: List[Tuple[int, int, int, int]], w: int, h: int):
    """A random box (side 28..64 px) not overlapping the ones in `taken` (None after 50 tries)."""
    for _ in range(50):
        side = int(rng.integers(28, 65))
        x1, y1 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        box = (x1, y1, x1 + side, y1 + side)
        if all(box_iou(box, t) == 0.0 for t in taken):
            return box
    return None


def grounding_image(rng: np.random.Generator, n_shapes: int = GROUND_SHAPES
                    ) -> Tuple[Image.Image, str, str, Tuple[int, int, int, int]]:
    """(image, target name e.g. 'red circle', answer, pixel box of the target); the target is one of
    `n_shapes` non-overlapping shapes of different colours."""
    w, h = GROUND_SIZE
    im = Image.new("RGB", (w, h), (245, 245, 245))
    draw = ImageDraw.Draw(im)
    colours = rng.choice(list(COLOURS), size=n_shapes, replace=False)
    objs, taken = [], []
    for c in colours:
        box = _place(rng, taken, w, h)
        if box is None:
            break
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        _draw_shape(draw, kind, box, COLOURS[str(c)])
        objs.append((f"{c} {kind}", box))
        taken.append(box)
    name, box = objs[int(rng.integers(len(objs)))]
    (nx1, ny1), (nx2, ny2) = to_norm([box[:2], box[2:]], w, h).tolist()
    return im, name, format_box(nx1, ny1, nx2, ny2), box


def grounding_lines(out_dir: str, n_train: int, n_heldout: int, rng: np.random.Generator) -> Dict[str, List[dict]]:
    img_dir = os.path.join(out_dir, "images", "grounding")
    os.makedirs(img_dir, exist_ok=True)
    out: Dict[str, List[dict]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        lines = []
        for i in range(n):
            im, name, answer, box = grounding_image(rng)
            rel = f"images/grounding/{split}_{i:05d}.png"
            im.save(os.path.join(out_dir, rel))
            lines.append(sample_line(f"grounding-{split}-{i}", rel, GROUND_SIZE, f"Where is the {name}?", answer,
                                     "grounding", box_pixels=list(box)))
        out[split] = lines
    return out
