"""JSONL sample reading and schema checks (docs/DATA.md).

A line is one sample:
    {"id": "s1", "images": ["img/0001.png"], "image_sizes": [[640, 480]],
     "messages": [{"role": "user", "content": "<image>\\nWhat is written here?"},
                  {"role": "assistant", "content": "HELLO"}]}
`images` are relative to the JSONL file; `image_sizes` ([width, height]) is optional metadata for
packing without decoding. `content` is a string with one `<image>` placeholder per image, or a
Hugging Face style list of parts ({"type": "image"} / {"type": "text", "text": ...}), which is
normalised to the string form here so the rest of the pipeline sees one shape.
Videos: `"videos": ["clip.mp4"]` with one `<video>` placeholder each ({"type": "video"} as a part), and
optional `"video_meta": [{"frames": 300, "fps": 30, "width": 640, "height": 360}]` so packing and
validation count tokens without opening the file (mindvl_ms/data/video.py).

Errors are `SampleError`s naming file, line and field; `iter_jsonl` never skips a line silently:
blank, undecodable (not UTF-8) and unparsable lines come out as errors for the caller to count.
Lines are read as bytes and decoded one at a time (`parse_raw`), so a bad byte costs one line, and
the error names the byte, its column and the JSON field it sits in. JSON the parser refuses past its
limits (an integer of more than `sys.get_int_max_str_digits()` digits, nesting past the recursion limit)
is "invalid json" too, and a string holding a lone UTF-16 surrogate escape (`"\\ud800"`: valid JSON, not
text) is a schema error naming its field, since it can be neither tokenized nor written back as UTF-8.

Top-level fields other than the schema's (e.g. a benchmark's `task` and `metric`) are kept in
`Sample.extra` as metadata; one warning per file names them (`warn_unknown`).
"""
from __future__ import annotations

import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = ("system", "user", "assistant")
FIELDS = ("id", "images", "image_sizes", "videos", "video_meta", "messages", "source", "meta")
META_KEYS = ("frames", "fps", "width", "height")
_WARNED = set()  # (source, field names) already warned about in this process


class SampleError(ValueError):
    """A sample that cannot be used; `reason` is a short key for per-reason counts."""

    def __init__(self, source: str, line: int, reason: str, detail: str):
        super().__init__(f"{source}:{line}: {reason}: {detail}")
        self.source, self.line, self.reason, self.detail = source, line, reason, detail

    def __reduce__(self):  # picklable: raised in a spawned worker, re-raised in the parent
        return type(self), (self.source, self.line, self.reason, self.detail)


@dataclass
class Sample:
    """One parsed line: messages with string content, absolute image paths and optional sizes."""

    messages: List[Dict[str, str]]
    images: List[str] = field(default_factory=list)
    image_sizes: Optional[List[Tuple[int, int]]] = None  # (width, height) per image
    id: str = ""
    source: str = ""
    line: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)  # unknown top-level fields, kept as metadata
    videos: List[str] = field(default_factory=list)
    video_meta: Optional[List[Dict[str, Any]]] = None  # {frames, fps, width, height} per video


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
            elif part["type"] == "video":
                out.append(VIDEO_PLACEHOLDER)
            elif part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{i}]: text part needs a string 'text'")
                out.append(part["text"])
            else:
                raise ValueError(f"{where}.content[{i}]: unsupported part type {part['type']!r} (image, video or text)")
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


def parse_sample(obj: Any, source: str, line: int, surrogates_possible: bool = True) -> Sample:
    """Validate one decoded JSON line against the schema; raises SampleError(reason='schema').
    `surrogates_possible` False skips the walk over every string for lone surrogates: the caller knows the
    line's text holds none and no escape that could make one (`parse_line`)."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        bad_text = _first_string(obj, _not_text) if surrogates_possible else None
        if bad_text is not None:
            raise ValueError(_surrogate_detail(bad_text))
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            warn_unknown(source, unknown, FIELDS)
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
        videos, vmeta = obj.get("videos") or [], obj.get("video_meta")
        if not isinstance(videos, list) or not all(isinstance(p, str) and p for p in videos):
            raise ValueError("videos: expected a list of non-empty path strings")
        if vmeta is not None:
            if not isinstance(vmeta, list) or len(vmeta) != len(videos):
                raise ValueError(f"video_meta: expected {len(videos)} objects {{frames, fps, width, height}}")
            for k, m in enumerate(vmeta):
                if not isinstance(m, dict) or set(m) != set(META_KEYS) or not all(
                        isinstance(m[x], (int, float)) and not isinstance(m[x], bool) and m[x] > 0 for x in META_KEYS) \
                        or not all(isinstance(m[x], int) for x in ("frames", "width", "height")):
                    raise ValueError(f"video_meta[{k}]: expected {{frames: int, fps: number, width: int, height: int}}, "
                                     f"all > 0, got {m!r}")
    except ValueError as e:
        raise SampleError(source, line, "schema", str(e)) from None
    base = os.path.dirname(os.path.abspath(source))
    paths = [p if os.path.isabs(p) else os.path.join(base, p) for p in images]
    vpaths = [p if os.path.isabs(p) else os.path.join(base, p) for p in videos]
    return Sample(messages=messages, images=paths, image_sizes=sizes, id=str(obj.get("id", f"line{line}")),
                  source=source, line=line, extra={k: obj[k] for k in unknown}, videos=vpaths,
                  video_meta=None if vmeta is None else [dict(m) for m in vmeta])


def warn_unknown(source: str, names: List[str], known) -> None:
    """One warning per (file, set of names) per process: unknown fields are kept as metadata."""
    key = (source, tuple(names))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{source}: unknown top-level field(s) {', '.join(names)} kept as metadata "
                      f"(the schema reads {', '.join(known)})", stacklevel=3)


def _not_text(s: str) -> bool:
    """True when `s` holds a surrogate (a lone JSON escape, or an undecodable byte kept by surrogateescape)."""
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _shown(key: str) -> str:
    """A key as it can be printed: an undecodable byte as \\xNN, a lone surrogate escape as \\udNNN."""
    try:
        return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _first_string(obj: Any, bad) -> Optional[Tuple[str, str]]:
    """(dotted path, string) of the first key or string value of a decoded JSON value for which `bad(string)`
    holds; keys come back as "path (the key)". Iterative, so any nesting depth the parser accepted is walked."""
    stack = [("", obj)]
    while stack:
        path, o = stack.pop()
        if isinstance(o, str):
            if bad(o):
                return path, o
            continue
        items = list(o.items()) if isinstance(o, dict) else list(enumerate(o)) if isinstance(o, list) else []
        for k, _ in items:
            if isinstance(k, str) and bad(k):
                return f"{path}.{_shown(k)}".lstrip(".") + " (the key)", k
        stack += [(f"{path}[{k}]" if isinstance(k, int) else f"{path}.{_shown(k)}".lstrip("."), v)
                  for k, v in reversed(items)]
    return None


def _surrogate_detail(found: Tuple[str, str]) -> str:
    path, text = found
    cp = next(ord(c) for c in text if "\ud800" <= c <= "\udfff")
    return (f"field '{path}' holds \\u{cp:04x}, half of a UTF-16 surrogate pair, which is not a character: "
            f"expected text (write the character itself, or both escapes of its pair)")


def decode_line(raw: bytes, source: str, line: int):
    """UTF-8 text of one raw line, or a SampleError (reason 'undecodable bytes') naming the byte,
    its column and, when the line is otherwise valid JSON, the field that holds it."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = ""
        try:
            found = _first_string(json.loads(raw.decode("utf-8", errors="surrogateescape")), _not_text)
            where = f" in field '{found[0]}'" if found else ""
        except (ValueError, RecursionError):  # not JSON either: the byte and column say enough
            pass
        return SampleError(source, line, "undecodable bytes",
                           f"byte 0x{raw[e.start]:02x} at column {e.start + 1}{where} is not UTF-8 "
                           f"(re-save the file as UTF-8)")


def parse_raw(raw: bytes, source: str, line: int):
    """One raw (bytes) line -> Sample or SampleError (returned): decoding, then `parse_line`."""
    text = decode_line(raw, source, line)
    return text if isinstance(text, SampleError) else parse_line(text, source, line)


def read_raw_lines(path: str) -> List[Tuple[int, bytes]]:
    """[(1-based line, raw bytes)] of a JSONL file (decoding is per line: see `decode_line`)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, "rb") as f:
        return list(enumerate(f, 1))


def count_placeholders(sample: Sample, placeholder: str = IMAGE_PLACEHOLDER) -> int:
    return sum(m["content"].count(placeholder) for m in sample.messages)


def iter_jsonl(path: str) -> Iterator[Tuple[int, Any]]:
    """Yield (1-based line, Sample or SampleError) for every line of `path`, blank lines included."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            yield n, parse_raw(raw, path, n)


def load_json(text: str, source: str, line: int):
    """The decoded JSON value of one line, or a SampleError (reason 'invalid json', returned): syntax errors,
    and values the parser refuses past its limits (see the module doc)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return SampleError(source, line, "invalid json", str(e))
    except RecursionError:
        return SampleError(source, line, "invalid json", f"arrays/objects nested deeper than the parser's limit "
                                                         f"(the recursion limit, {sys.getrecursionlimit()})")
    except ValueError as e:  # int() refuses a literal of more than sys.get_int_max_str_digits() digits
        return SampleError(source, line, "invalid json", f"a number the parser refuses: {e}")


# json.loads makes a lone surrogate only from a \uD800-\uDFFF escape (an escaped pair becomes one character),
# so a line of surrogate-free text without this pattern decodes to surrogate-free values; a line with it (an
# escaped backslash before "ud8..." included) gets the full walk that names the field.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_line(text: str, source: str, line: int):
    """One raw line -> Sample, or a SampleError (returned, not raised) for blank/invalid lines."""
    if not text.strip():
        return SampleError(source, line, "blank line", "empty line")
    obj = load_json(text, source, line)
    if isinstance(obj, SampleError):
        return obj
    try:
        return parse_sample(obj, source, line, _SURROGATE_ESCAPE.search(text) is not None or _not_text(text))
    except SampleError as e:
        return e


def read_lines(path: str, lines: List[int]) -> Dict[int, str]:
    """Raw text of selected 1-based lines (one pass over the file)."""
    want = set(lines)
    out = {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n in want:
                text = decode_line(raw, path, n)
                if isinstance(text, SampleError):
                    raise text
                out[n] = text
    missing = want - set(out)
    if missing:
        raise ValueError(f"{path}: lines {sorted(missing)[:5]} do not exist (file has fewer lines)")
    return out
