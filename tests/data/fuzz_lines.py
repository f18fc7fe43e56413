"""Generated JSONL lines for the data fuzz test (tests/data/test_fuzz.py): good lines built from small real
images and videos, and mutations of them, each labelled with the paths that must reject it.

A line is built from a spec `(template, mutation, seed)`: `TEMPLATES[template]` writes a good sample over
the files of a `World`, `MUTATIONS[mutation]` (None: no mutation) changes it and says which of the three
readers must name the line as bad:
  "validate"  `mindvl data validate` (schema, files decoded, grounding, blank images, ...)
  "pack"      `mindvl data pack` (metadata only: headers, sizes, token counts under seq_length)
  "load"      the online loader (the packer's metadata pass, then every sample processed into a batch)
Most mutations are bad for all three; a few are, by design, seen by some readers only: a truncated image
has a readable header (pack keeps it, decoding fails), a blank image or a grounding box out of range
still trains (validate's quality checks), a sample longer than seq_length is a fine sample for validate.
"""
from __future__ import annotations

import json
import os
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
from PIL import Image

from tests.support.data import WORDS, write_images
from tests.support.video import write_video

ALL: FrozenSet[str] = frozenset({"validate", "pack", "load"})
GOOD: FrozenSet[str] = frozenset()
SEQ = 1024  # seq_length of the fuzz config: every template fits, the over-length mutations do not
VIDEO = {"frames": 8, "fps": 4, "width": 56, "height": 56}
# the data section every reader of the fuzz runs with (small video frames keep decoding cheap)
DATA_SECTION = {"seq_length": SEQ, "shuffle": False, "micro_batch_size": 4, "online_buffer": 64, "pack_workers": 1,
                "video": {"video_min_pixels": 4 * 28 * 28, "video_max_pixels": 16 * 28 * 28,
                          "video_total_pixels": 64 * 28 * 28}}


@dataclass(frozen=True)
class Line:
    raw: bytes                 # the line without its newline
    kind: str                  # template, or template/mutation
    bad: FrozenSet[str]        # the readers that must name it as bad


@dataclass
class World:
    """The files lines point at, under `root` (paths in lines are relative to it)."""

    root: str
    sizes: Dict[str, Tuple[int, int]]   # good image path -> (width, height)


def _png_with_header(path: str, width: int, height: int) -> None:
    """A 1x1 PNG whose IHDR claims width x height (a decompression bomb's header)."""
    Image.new("RGB", (1, 1), (9, 9, 9)).save(path)
    data = bytearray(open(path, "rb").read())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    with open(path, "wb") as f:
        f.write(bytes(data))


def build_world(root: str) -> World:
    """Real photos (scikit-image), a lossless video, and the broken files the mutations point at."""
    img, vid = os.path.join(root, "img"), os.path.join(root, "vid")
    sizes = {f"img/{k}": v for k, v in write_images(img).items()}
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8)).save(os.path.join(img, "tiny.png"))
    Image.fromarray(rng.integers(0, 256, (20, 2000, 3), dtype=np.uint8)).save(os.path.join(img, "strip.png"))
    Image.new("RGB", (64, 64), (7, 7, 7)).save(os.path.join(img, "blank.png"))
    Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(os.path.join(img, "full.png"))  # 128x96
    full = open(os.path.join(img, "full.png"), "rb").read()
    with open(os.path.join(img, "trunc.png"), "wb") as f:
        f.write(full[:len(full) // 2])
    open(os.path.join(img, "empty.png"), "wb").close()
    with open(os.path.join(img, "notes.png"), "w") as f:
        f.write("not an image\n" * 20)
    _png_with_header(os.path.join(img, "bomb.png"), 100_000, 100_000)
    os.makedirs(vid, exist_ok=True)
    write_video(os.path.join(vid, "clip.mkv"), **VIDEO)
    clip = open(os.path.join(vid, "clip.mkv"), "rb").read()
    with open(os.path.join(vid, "trunc.mkv"), "wb") as f:
        f.write(clip[:len(clip) // 2])
    open(os.path.join(vid, "empty.mkv"), "wb").close()
    with open(os.path.join(vid, "notes.mkv"), "w") as f:
        f.write("not a video\n" * 20)
    return World(root, sizes)


# ---------------------------------------------------------------------------------------------------------
# good samples

def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _turns(rng, prefix=""):
    return [{"role": "user", "content": prefix + _words(rng, 2, 12)},
            {"role": "assistant", "content": _words(rng, 1, 30)}]


def t_caption(w: World, rng) -> dict:
    p = rng.choice(sorted(w.sizes))
    return {"images": [p], "image_sizes": [list(w.sizes[p])], "messages": _turns(rng, "<image>")}


def t_caption_no_sizes(w, rng) -> dict:
    return {"images": [rng.choice(sorted(w.sizes))], "messages": _turns(rng, "<image>\n")}


def t_multi(w, rng) -> dict:
    ps = [rng.choice(sorted(w.sizes)) for _ in range(2)]
    return {"images": ps, "image_sizes": [list(w.sizes[p]) for p in ps],
            "messages": _turns(rng, "<image><image>") + _turns(rng, "And? ")}


def t_text(w, rng) -> dict:
    return {"messages": _turns(rng) + (_turns(rng) if rng.random() < 0.5 else [])}


def t_parts(w, rng) -> dict:
    p = rng.choice(sorted(w.sizes))
    return {"images": [p], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _words(rng, 1, 8)}]},
        {"role": "assistant", "content": [{"type": "text", "text": _words(rng, 1, 8)}]}]}


def t_system(w, rng) -> dict:
    return {"messages": [{"role": "system", "content": _words(rng, 1, 6)}] + _turns(rng)}


def t_video(w, rng) -> dict:
    return {"videos": ["vid/clip.mkv"], "video_meta": [dict(VIDEO)], "messages": _turns(rng, "<video>\n")}


def t_video_image(w, rng) -> dict:
    p = rng.choice(sorted(w.sizes))
    return {"images": [p], "image_sizes": [list(w.sizes[p])], "videos": ["vid/clip.mkv"],
            "messages": [{"role": "user", "content": "<video><image>" + _words(rng, 1, 5)},
                         {"role": "assistant", "content": _words(rng, 1, 5)}]}


TEMPLATES: List[Callable] = [t_caption, t_caption_no_sizes, t_multi, t_text, t_parts, t_system, t_video,
                             t_video_image]
IMAGE_TEMPLATES = [t_caption, t_caption_no_sizes, t_multi, t_parts, t_video_image]
VIDEO_TEMPLATES = [t_video, t_video_image]


# ---------------------------------------------------------------------------------------------------------
# mutations: (sample object, World, Random) -> (object or raw bytes, readers that must reject it)

def _dump(obj) -> bytes:
    return json.dumps({k: v for k, v in obj.items() if k != "_t"}).encode()


def _with(templates, w, rng, obj) -> dict:
    """`obj` when it came from one of `templates`, else a fresh sample of one of them."""
    return obj if obj.get("_t") in {t.__name__ for t in templates} else dict(rng.choice(templates)(w, rng),
                                                                          id=obj.get("id"))


def _set_image(path: str, size: Optional[Tuple[int, int]] = None):
    def mutate(obj, w, rng):
        obj = _with(IMAGE_TEMPLATES, w, rng, obj)
        k = rng.randrange(len(obj["images"]))
        obj["images"][k] = path
        if size is not None and obj.get("image_sizes"):
            obj["image_sizes"][k] = list(size)
        return obj
    return mutate


def _set_video(path: str):
    def mutate(obj, w, rng):
        obj = _with(VIDEO_TEMPLATES, w, rng, obj)
        obj["videos"] = [path]
        obj["video_meta"] = [dict(VIDEO)]  # the clip's metadata: a broken file cannot match it
        return obj
    return mutate


def m_drop_key(obj, w, rng):
    del obj["messages"]
    return obj


def m_drop_assistant(obj, w, rng):
    obj["messages"] = [m for m in obj["messages"] if m["role"] != "assistant"]
    return obj


def m_messages_type(obj, w, rng):
    obj["messages"] = rng.choice(["hi", {}, 3, None, [], [1, 2], [{"role": "user"}], [{"content": "x"}],
                                  {"role": "user", "content": "x"}])
    return obj


def m_role(obj, w, rng):
    obj["messages"][rng.randrange(len(obj["messages"]))]["role"] = rng.choice(
        ["robot", 3, None, ["user"], "User", "", {"r": 1}])
    return obj


def m_system_late(obj, w, rng):
    obj["messages"].append({"role": "system", "content": "late"})
    return obj


def m_content_type(obj, w, rng):
    obj["messages"][rng.randrange(len(obj["messages"]))]["content"] = rng.choice(
        [None, 3, 2.5, True, {"a": 1}, [1], [{"type": "audio"}], [{"type": "text", "text": 3}], [{"text": "x"}],
         [{"type": ["text"]}], [{"type": "text"}]])
    return obj


def m_images_type(obj, w, rng):
    obj["images"] = rng.choice(["img/astro.png", [3], [""], {"a": "b"}, [None], [["img/astro.png"]], 5, True,
                                [{"path": "img/astro.png"}]])
    return obj


def m_sizes_type(obj, w, rng):
    obj = _with([t_caption, t_multi, t_video_image], w, rng, obj)
    n = len(obj["images"])
    obj["image_sizes"] = rng.choice([[[-5, 90]] * n, [[0, 0]] * n, [[120.0, 90.0]] * n, [[True, 90]] * n,
                                     [[120]] * n, ["120x90"] * n, [[120, 90]] * (n + 1), [[[120, 90]]] * n,
                                     [None] * n, "120x90", [[120, 90, 3]] * n, [[-(2 ** 70), 5]] * n])
    return obj


def m_sizes_huge(obj, w, rng):
    obj = _with([t_caption, t_multi, t_video_image], w, rng, obj)
    obj["image_sizes"][0] = rng.choice([[10 ** 9, 10 ** 9], [2 ** 63, 2 ** 63], [2 ** 31, 7], [10 ** 30, 1]])
    return obj


def m_sizes_wrong(obj, w, rng):
    obj = _with([t_caption, t_multi, t_video_image], w, rng, obj)
    wd, ht = obj["image_sizes"][0]
    obj["image_sizes"][0] = rng.choice([[ht + 1, wd], [wd + 1, ht], [wd, ht * 2]])
    return obj


def m_extra_image_placeholder(obj, w, rng):
    m = next(m for m in obj["messages"] if m["role"] == "user")
    m["content"] = "<image>" + m["content"] if isinstance(m["content"], str) else m["content"] + [{"type": "image"}]
    return obj


def m_missing_image_placeholder(obj, w, rng):
    obj = _with([t_caption, t_caption_no_sizes, t_multi, t_video_image], w, rng, obj)
    for m in obj["messages"]:
        m["content"] = m["content"].replace("<image>", "", 1 if rng.random() < 0.5 else -1)
    return obj


def m_video_placeholder(obj, w, rng):
    obj["messages"][0]["content"] = "<video>" * rng.randint(1, 3) + str(obj["messages"][0]["content"])
    return obj


def m_raw_vision_token(obj, w, rng):
    m = next(m for m in obj["messages"] if m["role"] == "user")
    tok = rng.choice(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    m["content"] = (m["content"] + tok) if isinstance(m["content"], str) else m["content"] + [
        {"type": "text", "text": tok}]
    return obj


def m_grounding(obj, w, rng):
    obj["messages"][-1]["content"] = rng.choice(["<|box_start|>(10,20),(300,1200)<|box_end|>",
                                                 "<|box_start|>(10,20),(30,40)", "<|point_start|>(1)<|point_end|>"])
    return obj


def m_long_text(obj, w, rng):
    obj["messages"][-1]["content"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1200, 3000)))
    return obj


def m_many_images(obj, w, rng):
    n = rng.randint(40, 120)
    obj = {"id": obj.get("id"), "images": ["img/coffee.jpg"] * n, "image_sizes": [list(w.sizes["img/coffee.jpg"])] * n,
           "messages": _turns(rng, "<image>" * n)}
    return obj


def m_surrogate(obj, w, rng):
    where = rng.choice(["content", "meta", "task", "image"])
    if where == "content":
        m = obj["messages"][rng.randrange(len(obj["messages"]))]
        m["content"] = (m["content"] if isinstance(m["content"], str) else "x") + "@@SURROGATE@@"
    elif where == "image":
        obj = _with(IMAGE_TEMPLATES, w, rng, obj)
        obj["images"][0] += "@@SURROGATE@@"
    else:
        obj[where] = {"note": ["ok", "@@SURROGATE@@"]}
    return _dump(obj).replace(b"@@SURROGATE@@", rng.choice([b"\\ud800", b"\\udfff", b"\\udc80 x", b"\\ud83d"]))


def m_unknown_field(obj, w, rng):
    obj[rng.choice(["task", "metric", "weird"])] = rng.choice(["vqa", 3, None, [1, 2]])
    return obj


def m_drop_optional(obj, w, rng):
    for k in ("id", "image_sizes", "video_meta", "images"):
        if k in obj and (k != "images" or not obj[k]):
            del obj[k]
    return obj


def m_free_form(obj, w, rng):
    obj["meta"] = {"nested": json.loads("[" * 300 + "]" * 300), "score": 1e300, "text": "caf\u00e9 \U0001f600"}
    obj["source"] = rng.choice(["web", 7, None])
    return obj


def m_truncate(obj, w, rng):
    raw = _dump(obj)
    return raw[:rng.randint(1, len(raw) - 1)]


def m_bad_utf8(obj, w, rng):
    raw = _dump(obj)
    at = rng.randint(0, len(raw))
    return raw[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80", b"\xfe\xfe",
                                  b"\xf8\x88\x80\x80\x80", b"caf\xe9"]) + raw[at:]


def m_nul(obj, w, rng):
    raw = _dump(obj)
    at = rng.randint(0, len(raw))
    return raw[:at] + b"\x00" + raw[at:]


def m_bom(obj, w, rng):
    return "\ufeff".encode() + _dump(obj)


def m_not_object(obj, w, rng):
    return rng.choice([b"null", b"[]", b"42", b'"text"', b"true", b"[{}]", b"{}", b"1e999", b"NaN"])


def m_blank(obj, w, rng):
    return rng.choice([b"", b"   ", b"\t", b"\r", b" \x0c "])


def m_deep(obj, w, rng):
    depth = rng.choice([20_000, 200_000])  # past the recursion limit (MindSpore sets 10,000)
    raw = _dump(dict(obj, meta="@@DEEP@@"))
    return raw.replace(b'"@@DEEP@@"', b"[" * depth + b"]" * depth)


def m_big_int(obj, w, rng):
    return _dump(dict(obj, id="@@INT@@")).replace(b'"@@INT@@"', b"7" * rng.randint(4_400, 20_000))


def m_video_meta_lie(obj, w, rng):
    obj = _with(VIDEO_TEMPLATES, w, rng, obj)
    meta = dict(VIDEO)
    key = rng.choice(["frames", "fps", "width", "height"])
    meta[key] = rng.choice([meta[key] * 10, meta[key] + 2, 10 ** 12]) if key != "fps" else rng.choice([12, 4e9, 0.5])
    obj["video_meta"] = [meta]
    return obj


def m_video_meta_type(obj, w, rng):
    obj = _with(VIDEO_TEMPLATES, w, rng, obj)
    obj["video_meta"] = rng.choice([[{"frames": 8}], [dict(VIDEO, frames=-8)], [dict(VIDEO, fps="4")],
                                    [dict(VIDEO, frames=True)], dict(VIDEO), [[8, 4, 56, 56]],
                                    [dict(VIDEO, extra=1)], [dict(VIDEO, frames=8.0)], [], [dict(VIDEO)] * 2,
                                    [dict(VIDEO, fps=0)], [None]])
    return obj


def m_video_placeholder_count(obj, w, rng):
    obj = _with(VIDEO_TEMPLATES, w, rng, obj)
    obj["messages"][0]["content"] += "<video>"
    return obj


MUTATIONS: Dict[str, Tuple[Callable, FrozenSet[str]]] = {
    # kept good: optional fields, metadata
    "unknown_field": (m_unknown_field, GOOD),
    "drop_optional": (m_drop_optional, GOOD),
    "free_form": (m_free_form, GOOD),
    # schema
    "drop_messages": (m_drop_key, ALL),
    "drop_assistant": (m_drop_assistant, ALL),
    "messages_type": (m_messages_type, ALL),
    "role": (m_role, ALL),
    "system_late": (m_system_late, ALL),
    "content_type": (m_content_type, ALL),
    "images_type": (m_images_type, ALL),
    "sizes_type": (m_sizes_type, ALL),
    "video_meta_type": (m_video_meta_type, ALL),
    # sizes and counts
    "sizes_huge": (m_sizes_huge, ALL),
    "sizes_wrong": (m_sizes_wrong, ALL),
    "extra_image_placeholder": (m_extra_image_placeholder, ALL),
    "missing_image_placeholder": (m_missing_image_placeholder, ALL),
    "video_placeholder": (m_video_placeholder, ALL),
    "video_placeholder_count": (m_video_placeholder_count, ALL),
    "raw_vision_token": (m_raw_vision_token, ALL),
    "long_text": (m_long_text, frozenset({"pack", "load"})),
    "many_images": (m_many_images, frozenset({"pack", "load"})),
    "grounding": (m_grounding, frozenset({"validate"})),
    # bytes
    "truncate": (m_truncate, ALL),
    "bad_utf8": (m_bad_utf8, ALL),
    "surrogate": (m_surrogate, ALL),
    "nul": (m_nul, ALL),
    "bom": (m_bom, ALL),
    "not_object": (m_not_object, ALL),
    "blank": (m_blank, ALL),
    "deep": (m_deep, ALL),
    "big_int": (m_big_int, ALL),
    # files
    "missing_image": (_set_image("img/nope.png"), ALL),
    "image_is_dir": (_set_image("img"), ALL),
    "empty_image": (_set_image("img/empty.png"), ALL),
    "text_as_image": (_set_image("img/notes.png"), ALL),
    "video_as_image": (_set_image("vid/clip.mkv"), ALL),
    "tiny_image": (_set_image("img/tiny.png", (1, 1)), ALL),
    "strip_image": (_set_image("img/strip.png", (2000, 20)), ALL),
    "bomb_image": (_set_image("img/bomb.png", (100_000, 100_000)), ALL),
    "absolute_missing": (_set_image("/nonexistent/dir/x.png"), ALL),
    "nul_path": (_set_image("img/a\x00.png"), ALL),
    "long_path": (_set_image("img/" + "a" * 5000 + ".png"), ALL),
    "truncated_image": (_set_image("img/trunc.png", (128, 96)), frozenset({"validate", "load"})),
    "blank_image": (_set_image("img/blank.png", (64, 64)), frozenset({"validate"})),
    "video_meta_lie": (m_video_meta_lie, ALL),
    "missing_video": (_set_video("vid/nope.mkv"), ALL),
    "empty_video": (_set_video("vid/empty.mkv"), ALL),
    "text_as_video": (_set_video("vid/notes.mkv"), ALL),
    "truncated_video": (_set_video("vid/trunc.mkv"), ALL),
    "image_as_video": (_set_video("img/astro.png"), ALL),
}
MUTATION_NAMES = sorted(MUTATIONS)


def build_line(w: World, n: int, template: int, mutation: Optional[str], seed: int) -> Line:
    """Line `n` (1-based) from a spec; good lines carry the id `L<n>`."""
    rng = random.Random(seed)
    t = TEMPLATES[template % len(TEMPLATES)]
    obj = dict(t(w, rng), id=f"L{n}", _t=t.__name__)
    if mutation is None:
        obj.pop("_t")
        return Line(_dump(obj), t.__name__, GOOD)
    fn, bad = MUTATIONS[mutation]
    out = fn(obj, w, rng)
    if isinstance(out, dict):
        out.pop("_t", None)
        out = _dump(out)
    return Line(out, f"{t.__name__}/{mutation}", bad)


def write_lines(path: str, lines: List[Line]) -> str:
    with open(path, "wb") as f:
        for x in lines:
            f.write(x.raw + b"\n")
    return path
