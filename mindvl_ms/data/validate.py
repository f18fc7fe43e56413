"""`mindvl data validate`: schema, image and grounding checks with a per-line report.

Checks per line (reason keys in the report):
  blank line, invalid json, schema            the line cannot be a sample (see schema.py)
  undecodable bytes                           the line is not UTF-8 (byte, column and field named)
  image count mismatch                        `<image>` placeholders != number of images
  raw vision token                            the text already contains <|image_pad|>/<|vision_start|>/...
  missing image, corrupt image                file absent, or PIL cannot decode it
  blank image                                 every pixel has the same value
  below minimum resolution                    a side shorter than data.image.min_side (quality filter)
  extreme aspect ratio                        long/short side above data.image.max_aspect_ratio
  image size mismatch                         `image_sizes` metadata differs from the file (the packer
                                              would count the wrong number of tokens)
  grounding                                   unbalanced tags, non-integer or out-of-range (0..999)
                                              coordinates, wrong point count for point/box/quad
  video count mismatch                        `<video>` placeholders != number of videos
  unreadable video                            missing file, no video stream, or (decoding) frames missing
  video metadata mismatch                     `video_meta` differs from the container header
  bad video                                   too short for the frame sampling (min_frames, temporal patch)
  video token count mismatch                  (decoding) the sampled clip's tokens differ from the count
                                              the packer derives from metadata
Images are checked once per path (many lines share images) and, with `decode=False`, only their
headers are read. Work is spread over processes with a tqdm bar. `--drop-bad` writes the lines
without errors to a new file and the report lists every dropped line with its reasons. Unknown
top-level fields are not errors: they are counted in the report (`unknown_fields`) and kept.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from PIL import Image
from tqdm import tqdm

from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.grounding import grounding_errors
from mindvl_ms.data.image import quality_errors
from mindvl_ms.data.preference import parse_line_any
from mindvl_ms.data.processor import video_metas, video_token_counts
from mindvl_ms.data.schema import (VIDEO_PLACEHOLDER, FIELDS, SampleError, count_placeholders, decode_line, load_json,
                                   read_raw_lines)
from mindvl_ms.data.tokens import VISION_TOKENS
from mindvl_ms.data.video import load_video, video_rng

RAW_TOKENS = VISION_TOKENS


def check_image(path: str, cfg: ImageConfig, decode: bool = True) -> Tuple[Optional[Tuple[int, int]], List[Tuple[str, str]]]:
    """((width, height) or None, [(reason, detail)]) for one image file."""
    if not os.path.isfile(path):
        return None, [("missing image", path)]
    try:
        with Image.open(path) as im:
            size = im.size
            if decode:
                im.load()
                lo_hi = im.convert("RGB").getextrema()
    except Exception as e:  # PIL raises many types for broken files
        return None, [("corrupt image", f"{path}: {e}")]
    w, h = size
    errs = []
    if decode and all(lo == hi for lo, hi in lo_hi):
        errs.append(("blank image", f"{path}: every pixel is {lo_hi[0][0]}"))
    return size, errs + quality_errors(w, h, cfg, path)


def check_line(raw: bytes, source: str, line: int, cfg: ImageConfig, decode: bool,
               cache: Dict) -> List[Tuple[str, str]]:
    """All problems of one raw JSONL line as (reason, detail)."""
    try:
        return _check_line(raw, source, line, cfg, decode, cache)
    except Exception as e:  # any per-line failure is reported for the line, never aborts the file
        return [("error", f"{type(e).__name__}: {e}")]


def _check_line(raw: bytes, source: str, line: int, cfg: ImageConfig, decode: bool,
                cache: Dict) -> List[Tuple[str, str]]:
    text = decode_line(raw, source, line)
    if not isinstance(text, SampleError) and text.strip():
        obj = load_json(text, source, line)  # JSON the parser refuses past its limits, before any reader sees it
        text = obj if isinstance(obj, SampleError) else text
    # SFT, preference (chosen/rejected) and RL prompt (answer) lines
    s = text if isinstance(text, SampleError) else parse_line_any(text, source, line)
    if isinstance(s, SampleError):
        return [(s.reason, s.detail)]
    errs = []
    n_ph = count_placeholders(s)
    if n_ph != len(s.images):
        errs.append(("image count mismatch", f"{n_ph} <image> placeholders for {len(s.images)} images"))
    for i, m in enumerate(s.messages):
        raw = [t for t in RAW_TOKENS if t in m["content"]]
        if raw:
            errs.append(("raw vision token", f"messages[{i}] contains {raw[0]}; use <image> placeholders"))
        for g in grounding_errors(m["content"]):
            errs.append(("grounding", f"messages[{i}]: {g}"))
    for k, p in enumerate(s.images):
        if p not in cache:
            cache[p] = check_image(p, cfg, decode)
        size, img_errs = cache[p]
        errs += img_errs
        if size is not None and s.image_sizes is not None and tuple(s.image_sizes[k]) != tuple(size):
            errs.append(("image size mismatch", f"field image_sizes[{k}]={list(s.image_sizes[k])} but {p} is "
                                                f"{size[0]}x{size[1]}"))
    if s.videos or count_placeholders(s, VIDEO_PLACEHOLDER):
        errs += check_videos(s, cfg, _CFG.get("video") or VideoConfig(), decode)
    return errs


def check_videos(s, image: ImageConfig, video: VideoConfig, decode: bool) -> List[Tuple[str, str]]:
    """Video problems of a sample: counts, readable containers, metadata against headers, and (decoding)
    the sampled clip's token count against the one derived from metadata."""
    seed = _CFG.get("seed", DataConfig().seed)
    try:
        metas = video_metas(s)
        counts = video_token_counts(s, metas, image, video, seed)
    except SampleError as e:
        return [(e.reason, e.detail)]
    errs = []
    if decode:
        for k, (path, meta) in enumerate(zip(s.videos, metas)):
            try:
                clip = load_video(path, image, video, video_rng(seed, s.line, k), meta)
            except (OSError, ValueError) as e:
                errs.append(("unreadable video", f"field videos[{k}]: {e}"))
                continue
            got = clip.pixel_values.shape[0] // image.merge_size ** 2
            if got != counts[k]:
                errs.append(("video token count mismatch", f"field videos[{k}]: {path} gives {got} tokens, "
                                                           f"metadata gives {counts[k]}"))
    return errs


def unknown_fields(raw: bytes) -> List[str]:
    """Top-level fields of a line outside the schema (kept as metadata; reported, not errors)."""
    try:  # strict UTF-8 (json.loads of bytes would let encoded surrogates through): the line's error says why
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return []
    return sorted(set(obj) - set(FIELDS)) if isinstance(obj, dict) else []


_CFG: Dict[str, Any] = {}


def _init(cfg: ImageConfig, decode: bool, video: Optional[VideoConfig] = None, seed: Optional[int] = None) -> None:
    _CFG.update(cfg=cfg, decode=decode, cache={}, video=video or VideoConfig(),
                seed=DataConfig().seed if seed is None else seed)


def _chunk(args) -> List[Tuple[int, List[Tuple[str, str]], List[str]]]:
    source, lines = args
    with warnings.catch_warnings():  # unknown fields are counted in the report instead
        warnings.simplefilter("ignore")
        return [(n, check_line(t, source, n, _CFG["cfg"], _CFG["decode"], _CFG["cache"]), unknown_fields(t))
                for n, t in lines]


def validate_file(path: str, cfg: Optional[ImageConfig] = None, decode: bool = True, workers: int = 0,
                  drop_bad: Optional[str] = None, progress: bool = True, chunk: int = 500,
                  video: Optional[VideoConfig] = None, seed: Optional[int] = None) -> Dict[str, Any]:
    """Check every line of `path`; returns {"file", "num_lines", "num_ok", "counts", "errors": [...]}.
    `video` and `seed` (the data section's) size the video frame sampling as training does."""
    cfg = cfg or ImageConfig()
    lines = read_raw_lines(path)
    chunks = [(path, lines[i:i + chunk]) for i in range(0, len(lines), chunk)]
    workers = workers or os.cpu_count() or 1
    results: List[Tuple[int, List[Tuple[str, str]], List[str]]] = []
    bar = tqdm(total=len(lines), desc="validate", unit="line", disable=not progress)
    if workers > 1 and len(chunks) > 1:
        with mp.get_context("fork").Pool(workers, initializer=_init, initargs=(cfg, decode, video, seed)) as pool:
            for res in pool.imap(_chunk, chunks):
                results += res
                bar.update(len(res))
    else:
        _init(cfg, decode, video, seed)
        for c in chunks:
            res = _chunk(c)
            results += res
            bar.update(len(res))
    bar.close()
    errors = [{"line": n, "reason": r, "detail": d} for n, errs, _ in results for r, d in errs]
    bad = sorted({n for n, errs, _ in results if errs})
    report = {"file": path, "num_lines": len(lines), "num_ok": len(lines) - len(bad), "num_bad": len(bad),
              "counts": dict(Counter(e["reason"] for e in errors)), "errors": errors,
              "unknown_fields": dict(sorted(Counter(k for _, _, ks in results for k in ks).items()))}
    if drop_bad:
        bad_set = set(bad)
        base_in, base_out = os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.abspath(drop_bad))
        with open(drop_bad, "w", encoding="utf-8") as f:
            for n, raw in lines:
                if n not in bad_set:
                    text = raw.decode("utf-8")  # lines without errors decode
                    f.write(_rebase(text, base_in, base_out) if base_in != base_out else text.rstrip("\n") + "\n")
        report["dropped_lines"] = bad
        report["clean_file"] = drop_bad
    return report


def _rebase(text: str, base_in: str, base_out: str) -> str:
    """Rewrite relative image paths so the clean file in another directory still finds the images."""
    obj = json.loads(text)
    if obj.get("images"):
        obj["images"] = [p if os.path.isabs(p) else os.path.relpath(os.path.join(base_in, p), base_out)
                         for p in obj["images"]]
    return json.dumps(obj, ensure_ascii=False) + "\n"


def format_report(report: Dict[str, Any], max_list: int = 50) -> str:
    """Human-readable report: totals, counts per reason, then errors with line numbers."""
    out = [f"{report['file']}: {report['num_lines']} lines, {report['num_ok']} ok, {report['num_bad']} with errors"]
    for reason, n in sorted(report["counts"].items(), key=lambda kv: -kv[1]):
        out.append(f"  {n:8d}  {reason}")
    if report.get("unknown_fields"):
        out.append("note: unknown top-level field(s) kept as metadata: "
                   + ", ".join(f"{k} ({n} lines)" for k, n in report["unknown_fields"].items()))
    for e in report["errors"][:max_list]:
        out.append(f"{report['file']}:{e['line']}: {e['reason']}: {e['detail']}")
    if len(report["errors"]) > max_list:
        out.append(f"... {len(report['errors']) - max_list} more (see --report for all)")
    if "clean_file" in report:
        out.append(f"wrote {report['num_ok']} clean lines to {report['clean_file']}; dropped lines: "
                   f"{', '.join(map(str, report['dropped_lines'][:max_list]))}"
                   + (" ..." if len(report["dropped_lines"]) > max_list else ""))
    return "\n".join(out)
