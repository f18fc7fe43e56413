"""Small JSONL data sets with real images (scikit-image photos) for the data tests."""
import json
import os

import numpy as np
from PIL import Image
from skimage import data as skdata

WORDS = "the a cat dog sits on mat red blue green house car tree sky runs fast slow big small".split()


def write_images(d):
    """A few real photos at modest sizes; returns {name: (path, (w, h))}."""
    os.makedirs(d, exist_ok=True)
    srcs = {"astro.png": (skdata.astronaut(), (120, 90)), "coffee.jpg": (skdata.coffee(), (200, 150)),
            "cat.png": (skdata.chelsea(), (60, 200)), "page.png": (skdata.text(), (300, 100)),
            "rocket.jpg": (skdata.rocket(), (90, 90))}
    out = {}
    for name, (arr, size) in srcs.items():
        img = Image.fromarray(arr).convert("RGB").resize(size)
        img.save(os.path.join(d, name))
        out[name] = size
    return out


def make_jsonl(path, n, seed=0, with_sizes=True, bad_lines=False):
    """n samples: captions, multi-image, multi-turn, text-only; images live in img/ next to the file."""
    rng = np.random.default_rng(seed)
    base = os.path.dirname(path)
    sizes = write_images(os.path.join(base, "img"))
    names = sorted(sizes)
    lines = []
    for i in range(n):
        kind = i % 4
        words = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
        if kind == 3:  # text-only, long
            obj = {"messages": [{"role": "user", "content": words(int(rng.integers(5, 40)))},
                                {"role": "assistant", "content": words(int(rng.integers(10, 120)))}]}
        else:
            k = 1 + (kind == 2)
            imgs = [str(rng.choice(names)) for _ in range(k)]
            obj = {"images": [f"img/{x}" for x in imgs],
                   "messages": [{"role": "user", "content": "<image>" * k + words(int(rng.integers(3, 12)))},
                                {"role": "assistant", "content": words(int(rng.integers(2, 30)))}]}
            if kind == 1:
                obj["messages"] += [{"role": "user", "content": "And? " + words(3)},
                                    {"role": "assistant", "content": words(int(rng.integers(2, 10)))}]
            if with_sizes and i % 8 != 0:  # some samples without sizes: the packer reads headers
                obj["image_sizes"] = [list(sizes[x]) for x in imgs]
        obj["id"] = f"s{i}"
        lines.append(json.dumps(obj))
    if bad_lines:
        lines[5] = "{not json"
        lines[9] = ""
        lines[13] = json.dumps({"images": ["img/missing.png"], "messages": [
            {"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}]})
        lines[17] = json.dumps({"messages": [{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": " ".join(["word"] * 5000)}]})
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
