"""What the LLaVA, ShareGPT and parquet converters share: the record and error types, role names, and
turning a conversation plus image paths into one line of this project's JSONL (docs/DATA.md).

A converted record is `{"id"?, "images", "image_sizes", "videos"?, "video_meta"?, "messages", "source"?,
"meta"?}`: roles mapped to system/user/assistant, `<image>`/`<video>` placeholders kept where the text put
them (LLaVA's `<image>` is this project's placeholder), image paths resolved against `Target.base` and
written relative to `Target.out_dir` (absolute when it is None), `image_sizes` read from the image
headers (PIL opens lazily: no pixel decoding). Fields outside the schema go into `meta`, so the output
has none of the unknown-field warnings of `schema.parse_sample`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from PIL import Image

from mindvl_ms.data.schema import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, content_to_text

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
PASSED = ("video_meta", "source")  # schema fields a converted record keeps as given


class ConvertError(ValueError):
    """A record that cannot be converted; `reason` is a short key for the per-reason counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass
class Record:
    """One record of an input file: `number` counts records from 1 (the line of a JSONL file; the loader
    reports it as the line), `where` names it for people (`line 3`, `element 2 (line 14)`, `row 2`),
    `obj` is the decoded record or the ConvertError of one that does not decode."""

    number: int
    where: str
    obj: Any


@dataclasses.dataclass
class Target:
    """Where a converted record's paths point: relative image paths of the input resolve against `base`;
    output paths are relative to `out_dir` (None: absolute); images stored as bytes are written to
    `image_dir`. `written` counts the image files written."""

    base: str
    out_dir: Optional[str]
    image_dir: str
    written: int = 0
    left_out: Counter = dataclasses.field(default_factory=Counter)  # field -> records whose value JSON cannot hold

    def output_path(self, path: str) -> str:
        return os.path.relpath(path, self.out_dir) if self.out_dir else path


def as_list(value: Any) -> List[Any]:
    """A field that holds one item or a list of them (LLaVA's `image`), None/absent being empty."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def turns(conv: Any, field: str) -> List[Dict[str, str]]:
    """[{'role', 'content': str}] of a conversation whose turns are {from, value} (LLaVA, ShareGPT) or
    {role, content} (OpenAI style, this project's); a system turn only first, at least one answer."""
    if not isinstance(conv, list) or not conv:
        raise ConvertError("no conversation", f"field {field}: expected a non-empty list of turns, got {conv!r:.80}")
    out = []
    for i, t in enumerate(conv):
        where = f"{field}[{i}]"
        role_key, text_key = ("from", "value") if isinstance(t, dict) and "from" in t else ("role", "content")
        if not isinstance(t, dict) or not isinstance(t.get(role_key), str) or text_key not in t:
            raise ConvertError("schema", f"{where}: expected an object with 'from' and 'value' (or 'role' and "
                                         f"'content'), got {t!r:.80}")
        role = ROLE_NAMES.get(t[role_key].strip().lower())
        if role is None:
            raise ConvertError("unsupported role", f"{where}.{role_key}: {t[role_key]!r} (expected one of "
                                                   f"{', '.join(ROLE_NAMES)})")
        if role == "system" and i:
            raise ConvertError("schema", f"{where}: a system turn may only come first")
        try:
            out.append({"role": role, "content": content_to_text(t[text_key], where)})
        except ValueError as e:
            raise ConvertError("schema", str(e)) from None
    if not any(m["role"] == "assistant" for m in out):
        raise ConvertError("schema", f"field {field}: no answer (gpt/assistant) turn: nothing to supervise")
    return out


def media(obj: Dict[str, Any], fields: Tuple[str, ...], target: Target) -> List[Tuple[str, str, str]]:
    """[(absolute path, field, as written)] of the paths in the first of `fields` that `obj` has."""
    name = next((f for f in fields if obj.get(f) is not None), fields[0])
    value = obj.get(name)
    items = as_list(value)
    field = (lambda k: name) if isinstance(value, str) else (lambda k: f"{name}[{k}]")
    return [(image_path(v, field(k), target), field(k), v) for k, v in enumerate(items)]


def image_path(value: Any, field: str, target: Target) -> str:
    """Absolute path of an image named by a path string, relative to `target.base`."""
    if not isinstance(value, str) or not value:
        raise ConvertError("schema", f"field {field}: expected an image path, got {value!r:.80}")
    return os.path.normpath(value if os.path.isabs(value) else os.path.join(target.base, value))


def header_size(path: str, field: str, shown: str) -> Tuple[int, int]:
    """(width, height) from the image header; a missing or unreadable file is a ConvertError naming it."""
    if not os.path.isfile(path):
        raise ConvertError("missing image", f"field {field}: {shown} not found ({path})")
    try:
        with Image.open(path) as im:
            return im.size
    except Exception as e:  # PIL raises many types for broken files
        raise ConvertError("unreadable image", f"field {field}: {shown}: {e}") from None


def project_record(messages: List[Dict[str, str]], images: List[Tuple[str, str, str]], target: Target,
                   obj: Dict[str, Any], known: Tuple[str, ...],
                   videos: Optional[List[Tuple[str, str, str]]] = None) -> Dict[str, Any]:
    """The output record from converted turns and media [(absolute path, field, as written)]; the fields
    of `obj` outside `known` and the schema go into `meta` (values JSON cannot hold are left out and
    counted in `target.left_out`)."""
    videos = videos or []
    for placeholder, items, kind in ((IMAGE_PLACEHOLDER, images, "image"), (VIDEO_PLACEHOLDER, videos, "video")):
        n = sum(m["content"].count(placeholder) for m in messages)
        if n != len(items):
            raise ConvertError(f"{kind} count mismatch", f"{n} {placeholder} in the text for {len(items)} {kind}(s)")
    sizes = [list(header_size(p, field, shown)) for p, field, shown in images]
    for p, field, shown in videos:
        if not os.path.isfile(p):
            raise ConvertError("missing video", f"field {field}: {shown} not found ({p})")
    out: Dict[str, Any] = {}
    if obj.get("id") is not None:
        out["id"] = str(obj["id"])
    if images:
        out["images"] = [target.output_path(p) for p, _, _ in images]
        out["image_sizes"] = sizes
    if videos:
        out["videos"] = [target.output_path(p) for p, _, _ in videos]
    out.update({k: obj[k] for k in PASSED if obj.get(k) is not None})
    out["messages"] = messages
    meta = obj.get("meta")
    extra = {}
    for k in sorted(set(obj) - set(known) - {"id", "meta", *PASSED}):
        if obj[k] is None:
            continue
        if _json_value(obj[k]):
            extra[k] = obj[k]
        else:
            target.left_out[k] += 1
    if extra:
        meta = {**meta, **extra} if isinstance(meta, dict) else {**({"meta": meta} if meta is not None else {}),
                                                                  **extra}
    if meta is not None:
        out["meta"] = meta
    return out


def _json_value(value: Any) -> bool:
    """Whether JSON can hold `value` (a parquet column of bytes or timestamps cannot: it is left out)."""
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
