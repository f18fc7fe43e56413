"""`mindvl data convert`: a LLaVA, ShareGPT or parquet file -> this project's JSONL, with a report.

Every input record becomes one output line or one `skipped` entry naming the file, the record (`line 3`,
`element 2 (line 14)`, `row 2`), a reason and a detail, so converted + skipped = records. Besides the
format rules (common.py), a converted line must pass what `mindvl data validate` checks without decoding
pixels: the schema, no raw vision tokens in the text, well-formed grounding tags, and the quality filters
of `data.image` (min_side, max_aspect_ratio) on the header sizes; `mindvl data validate OUT` decodes the
images for the checks that need pixels (corrupt, blank). Images stored as bytes go to `images/` beside
the output; the output is the same every time the same input is converted.
"""
from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional

from tqdm import tqdm

from mindvl_ms.config.data import ImageConfig
from mindvl_ms.data.formats.common import ConvertError, Record, Target
from mindvl_ms.data.formats.detect import CONVERTERS, detect_format, input_records
from mindvl_ms.data.grounding import grounding_errors
from mindvl_ms.data.image import quality_errors
from mindvl_ms.data.schema import SampleError, parse_sample
from mindvl_ms.data.tokens import VISION_TOKENS


def check_output(obj: Dict[str, Any], out: str, line: int, image: ImageConfig) -> None:
    """The checks a converted line must pass (see module doc); raises ConvertError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parse_sample(obj, out, line)
    except SampleError as e:
        raise ConvertError(e.reason, e.detail) from None
    for i, m in enumerate(obj["messages"]):
        raw = [t for t in VISION_TOKENS if t in m["content"]]
        if raw:
            raise ConvertError("raw vision token", f"turn {i} contains {raw[0]}; images are <image> placeholders")
        bad = grounding_errors(m["content"])
        if bad:
            raise ConvertError("grounding", f"turn {i}: {bad[0]}")
    for k, (w, h) in enumerate(obj.get("image_sizes") or []):
        bad = quality_errors(w, h, image, obj["images"][k])
        if bad:
            raise ConvertError(bad[0][0], f"field images[{k}]: {bad[0][1]}")


def convert_record(rec: Record, fmt: str, target: Target) -> Dict[str, Any]:
    if isinstance(rec.obj, ConvertError):
        raise rec.obj
    return CONVERTERS[fmt](rec.obj, target)


def convert_file(src: str, out: str, fmt: str = "auto", image_root: Optional[str] = None,
                 image: Optional[ImageConfig] = None, progress: bool = True) -> Dict[str, Any]:
    """Convert `src` (read as `fmt`, or told from the file with "auto") into `out`; returns the report
    {"input", "format", "output", "image_dir", "num_records", "num_converted", "skipped_counts",
    "skipped": [{"file", "record", "where", "reason", "detail"}], "images_written", "left_out_fields"}."""
    if not os.path.isfile(src):
        raise FileNotFoundError(f"input not found: {src}")
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError(f"{out}: the output would overwrite the input")
    fmt = detect_format(src) if fmt == "auto" else fmt
    if fmt not in CONVERTERS:
        raise ValueError(f"format '{fmt}': expected one of {', '.join(CONVERTERS)} or auto")
    image = image or ImageConfig()
    out_dir = os.path.dirname(os.path.abspath(out))
    base = os.path.abspath(image_root or os.path.dirname(os.path.abspath(src)))
    target = Target(base=base, out_dir=out_dir, image_dir=os.path.join(out_dir, "images"))
    records, total = input_records(src, fmt)
    skipped: List[Dict[str, Any]] = []
    n_in = n_out = 0
    os.makedirs(out_dir, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f, \
            tqdm(total=total, desc="convert", unit="record", disable=not progress) as bar:
        for rec in records:
            n_in += 1
            bar.update(1)
            try:
                obj = convert_record(rec, fmt, target)
                check_output(obj, out, n_out + 1, image)
            except ConvertError as e:
                skipped.append({"file": src, "record": rec.number, "where": rec.where, "reason": e.reason,
                                "detail": e.detail})
                continue
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n_out += 1
    return {"input": src, "format": fmt, "output": out, "image_dir": target.image_dir, "num_records": n_in,
            "num_converted": n_out, "skipped_counts": dict(Counter(s["reason"] for s in skipped)),
            "skipped": skipped, "images_written": target.written, "left_out_fields": dict(target.left_out)}


def format_convert_report(report: Dict[str, Any]) -> str:
    """The summary line (records, converted, skipped by reason, images written), then every skipped record."""
    counts = sorted(report["skipped_counts"].items(), key=lambda kv: (-kv[1], kv[0]))
    why = f" ({', '.join(f'{k}: {n}' for k, n in counts)})" if counts else ""
    written = (f"; {report['images_written']} image(s) written to {report['image_dir']}"
               if report["images_written"] else "")
    out = [f"{report['input']} ({report['format']}) -> {report['output']}: {report['num_records']} records, "
           f"{report['num_converted']} converted, {len(report['skipped'])} skipped{why}{written}"]
    if report["left_out_fields"]:
        out.append("note: field(s) JSON cannot hold were left out: "
                   + ", ".join(f"{k} ({n} records)" for k, n in sorted(report["left_out_fields"].items())))
    out += [f"{s['file']}: {s['where']}: {s['reason']}: {s['detail']}" for s in report["skipped"]]
    return "\n".join(out)
