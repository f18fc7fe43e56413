"""JSONL sample reading and schema checks (docs/DATA.md).

A line is one sample:
    {"id": "s1", "images": ["img/0001.png"], "image_sizes": [[640, 480]],
     "messages": [{"role": "user", "content": "<image>\\nWhat is written here?"},
                  {"role": "assistant", "content": "HELLO"}]}
`images` are relative to the JSONL file; `image_sizes` ([width, height]) is optional metadata for
packing without decoding. `content` is a string with one `<image>` placeholder per image, or a
Hugging Face style list of parts ({"type": "image"} / {"type": "text", "text": ...}), which is
normalised to the string form here so the rest of the pipeline sees one shape.

Errors are `SampleError`s naming file, line and field; `iter_jsonl` never skips a line silently:
blank and unparsable lines come out as errors for the caller to count.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

IMAGE_PLACEHOLDER = "<image>"
ROLES = ("system", "user", "assistant")


class SampleError(ValueError):
    """A sample that cannot be used; `reason` is a short key for per-reason counts."""

    def __init__(self, source: str, line: int, reason: str, detail: str):
        super().__init__(f"{source}:{line}: {reason}: {detail}")
        self.source, self.line, self.reason, self.detail = source, line, reason, detail


@dataclass
class Sample:
    """One parsed line: messages with string content, absolute image paths and optional sizes."""

    messages: List[Dict[str, str]]
    images: List[str] = field(default_factory=list)
    image_sizes: Optional[List[Tuple[int, int]]] = None  # (width, height) per image
    id: str = ""
    source: str = ""
    line: int = 0


def content_to_text(content: Any, where: str) -> str:
    """Normalise message content (string or list of HF parts) to a string with `<image>` placeholders."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"{where}.content[{i}]: expected {{'type': 'image'|'text', ...}}, got {part!r}")
            if part["type"] == "image":
                out.append(IMAGE_PLACEHOLDER)
            elif part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{i}]: text part needs a string 'text'")
                out.append(part["text"])
            else:
                raise ValueError(f"{where}.content[{i}]: unsupported part type {part['type']!r} (image or text)")
        return "".join(out)
    raise ValueError(f"{where}.content: expected a string or a list of parts, got {type(content).__name__}")


def normalise_messages(messages: Any, where: str = "messages") -> List[Dict[str, str]]:
    """Check roles/contents of a conversation; returns [{'role', 'content': str}]."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{'role', 'content'}}")
    out = []
    for i, m in enumerate(messages):
        w = f"{where}[{i}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{w}: expected an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{w}.role: {m['role']!r} is not one of {', '.join(ROLES)}")
        if m["role"] == "system" and i != 0:
            raise ValueError(f"{w}: a system message may only come first")
        out.append({"role": m["role"], "content": content_to_text(m["content"], w)})
    return out


def parse_sample(obj: Any, source: str, line: int) -> Sample:
    """Validate one decoded JSON line against the schema; raises SampleError(reason='schema')."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - {"id", "images", "image_sizes", "messages", "source", "meta"}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)} (expected id, images, image_sizes, messages)")
        if "messages" not in obj:
            raise ValueError("missing field 'messages'")
        messages = normalise_messages(obj["messages"])
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("messages: no assistant turn (nothing to supervise)")
        images = obj.get("images") or []
        if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
            raise ValueError("images: expected a list of non-empty path strings")
        sizes = obj.get("image_sizes")
        if sizes is not None:
            ok = (isinstance(sizes, list) and len(sizes) == len(images)
                  and all(isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                      and v > 0 for v in s) for s in sizes))
            if not ok:
                raise ValueError(f"image_sizes: expected {len(images)} [width, height] pairs of positive integers")
            sizes = [(int(w), int(h)) for w, h in sizes]
    except ValueError as e:
        raise SampleError(source, line, "schema", str(e)) from None
    base = os.path.dirname(os.path.abspath(source))
    paths = [p if os.path.isabs(p) else os.path.join(base, p) for p in images]
    return Sample(messages=messages, images=paths, image_sizes=sizes, id=str(obj.get("id", f"line{line}")),
                  source=source, line=line)


def count_placeholders(sample: Sample) -> int:
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in sample.messages)


def iter_jsonl(path: str) -> Iterator[Tuple[int, Any]]:
    """Yield (1-based line, Sample or SampleError) for every line of `path`, blank lines included."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            yield n, parse_line(text, path, n)


def parse_line(text: str, source: str, line: int):
    """One raw line -> Sample, or a SampleError (returned, not raised) for blank/invalid lines."""
    if not text.strip():
        return SampleError(source, line, "blank line", "empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return SampleError(source, line, "invalid json", str(e))
    try:
        return parse_sample(obj, source, line)
    except SampleError as e:
        return e


def read_lines(path: str, lines: List[int]) -> Dict[int, str]:
    """Raw text of selected 1-based lines (one pass over the file)."""
    want = set(lines)
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if n in want:
                out[n] = text
    missing = want - set(out)
    if missing:
        raise ValueError(f"{path}: lines {sorted(missing)[:5]} do not exist (file has fewer lines)")
    return out
