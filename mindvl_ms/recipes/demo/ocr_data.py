"""Generated OCR for the demo: one of 20 capitalised words rendered with DejaVu Sans Mono Bold (bundled
with matplotlib), one character per 28-px visual-token column from a random start column, random dark
colour on a random light 224x56 canvas (`render_ocr`); the answer is the word."""
from __future__ import annotations

import os
from typing import Dict, List

import matplotlib
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mindvl_ms.recipes.demo.lines import sample_line


OCR_WORDS = ["CAT", "DOG", "SUN", "MAP", "BOX", "CAR", "TREE", "BIRD", "FISH", "STAR", "MOON", "LION", "BEAR",
             "WOLF", "ROSE", "RAIN", "SNOW", "FIRE", "SHIP", "LAMP"]
OCR_SIZE = (224, 56)    # (width, height): 8 x 2 visual tokens at the demo's 12,544-pixel budget
OCR_CELL = 28           # px per character: one visual token column
OCR_FONT_SIZE = 40      # DejaVu Sans Mono Bold: every capital's ink is narrower than OCR_CELL
OCR_JITTER = 3          # px of random vertical offset


def font_path() -> str:
    """DejaVu Sans Mono Bold from matplotlib's bundled fonts (no system font needed)."""
    path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSansMono-Bold.ttf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bundled font not found: {path} (is matplotlib installed completely?)")
    return path


def ocr_text(rng: np.random.Generator) -> str:
    """A word from OCR_WORDS."""
    return OCR_WORDS[int(rng.integers(len(OCR_WORDS)))]


def render_ocr(text: str, rng: np.random.Generator, font_file: str) -> Image.Image:
    """`text` in a random dark colour on a random light background, one character per 28-px column
    (the width of one visual token: two 14-px patches merged 2x2), starting at a random column;
    each glyph is centred in its column, the line vertically centred +-OCR_JITTER px.

    With each glyph inside one visual token, the tiny from-scratch ViT reads a letter from one token
    and the LLM can name the word from the set of letters it finds, wherever the word starts (freely placed
    words and numbers were not learned within the demo's budget: docs/PERFORMANCE.md, "recipes").
    """
    w, h = OCR_SIZE
    cols = w // OCR_CELL
    if len(text) > cols:
        raise ValueError(f"OCR text {text!r} has more than {cols} characters")
    bg = tuple(int(v) for v in rng.integers(200, 256, size=3))
    fg = tuple(int(v) for v in rng.integers(0, 90, size=3))
    im = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(im)
    font = ImageFont.truetype(font_file, OCR_FONT_SIZE)
    _, top, _, bottom = draw.textbbox((0, 0), text, font=font)
    y = (h - (bottom - top)) // 2 + int(rng.integers(-OCR_JITTER, OCR_JITTER + 1)) - top
    c0 = int(rng.integers(0, cols - len(text) + 1))
    for k, ch in enumerate(text):
        x0, _, x1, _ = draw.textbbox((0, 0), ch, font=font)
        draw.text(((c0 + k) * OCR_CELL + (OCR_CELL - (x1 - x0)) // 2 - x0, y), ch, fill=fg, font=font)
    return im


def ocr_lines(out_dir: str, n_train: int, n_heldout: int, rng: np.random.Generator) -> Dict[str, List[dict]]:
    font_file = font_path()
    img_dir = os.path.join(out_dir, "images", "ocr")
    os.makedirs(img_dir, exist_ok=True)
    out: Dict[str, List[dict]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        lines = []
        for i in range(n):
            text = ocr_text(rng)
            rel = f"images/ocr/{split}_{i:05d}.png"
            render_ocr(text, rng, font_file).save(os.path.join(out_dir, rel))
            lines.append(sample_line(f"ocr-{split}-{i}", rel, OCR_SIZE, "What is written in the image?", text, "ocr"))
        out[split] = lines
    return out
