"""Records of JSON inputs: a JSON array of records (LLaVA's own files) or one record a line (JSONL).

A JSONL line that is blank, not UTF-8 or not JSON is a record that does not decode (its ConvertError
names the line, as `schema.decode_line` does for training files). A JSON array is read in one pass that
notes where each element starts and ends (bytes) and on which line it starts, so the loader can read one
element back by seeking to it (`read_element`) without holding the file's JSON; a file that is not a
valid JSON array is an error for the whole file (no element after the fault can be located).
"""
from __future__ import annotations

import json
from json.decoder import WHITESPACE
from typing import Any, Iterator, List, Tuple

from mindvl_ms.data.formats.common import ConvertError, Record
from mindvl_ms.data.schema import SampleError, decode_line

BOM = b"\xef\xbb\xbf"
Span = Tuple[int, int, int]  # (byte start, byte end, 1-based line where the element starts)


def is_json_array(path: str) -> bool:
    """Whether the file's first non-blank character is `[` (a JSON array, not JSONL)."""
    with open(path, "rb") as f:
        if f.read(len(BOM)) != BOM:
            f.seek(0)
        while True:
            b = f.read(1)
            if b not in (b" ", b"\t", b"\r", b"\n"):
                return b == b"["


def decode_jsonl_line(raw: bytes, path: str, line: int) -> Record:
    """One JSONL line as a Record (its obj a ConvertError when the line does not decode)."""
    text = decode_line(raw, path, line)
    if isinstance(text, SampleError):
        return Record(line, f"line {line}", ConvertError(text.reason, text.detail))
    if not text.strip():
        return Record(line, f"line {line}", ConvertError("blank line", "empty line"))
    try:
        return Record(line, f"line {line}", json.loads(text))
    except json.JSONDecodeError as e:
        return Record(line, f"line {line}", ConvertError("invalid json", str(e)))


def iter_jsonl_records(path: str) -> Iterator[Record]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            yield decode_jsonl_line(raw, path, n)


def _scan(path: str) -> Iterator[Tuple[Span, Any]]:
    """((byte start, byte end, line), element) for every element of a JSON array file, in order."""
    with open(path, "rb") as f:
        data = f.read()
    skip = len(BOM) if data.startswith(BOM) else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: byte 0x{data[skip + e.start]:02x} at offset {skip + e.start} is not UTF-8 "
                         f"(re-save the file as UTF-8)") from None
    ascii_only = len(text) == len(data) - skip
    dec = json.JSONDecoder()
    i = WHITESPACE.match(text, 0).end()
    if text[i:i + 1] != "[":
        raise ValueError(f"{path}: not a JSON array (starts with {text[i:i + 20]!r})")
    i = WHITESPACE.match(text, i + 1).end()
    char_at, byte_at, line_at, k = 0, skip, 1, 0
    while text[i:i + 1] != "]":
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: element {k} is not valid JSON: {e}") from None
        line_at += text.count("\n", char_at, i)
        start = skip + i if ascii_only else byte_at + len(text[char_at:i].encode("utf-8"))
        stop = skip + end if ascii_only else start + len(text[i:end].encode("utf-8"))
        yield (start, stop, line_at), obj
        line_at += text.count("\n", i, end)
        char_at, byte_at, k = end, stop, k + 1
        i = WHITESPACE.match(text, end).end()
        if text[i:i + 1] == ",":
            i = WHITESPACE.match(text, i + 1).end()
        elif text[i:i + 1] != "]":
            raise ValueError(f"{path}: expected ',' or ']' after element {k - 1} (line {line_at}), got "
                             f"{text[i:i + 20]!r}")


def element_where(k: int, line: int) -> str:
    return f"element {k} (line {line})"


def iter_json_array(path: str) -> Iterator[Record]:
    for k, ((_, _, line), obj) in enumerate(_scan(path)):
        yield Record(k + 1, element_where(k, line), obj)


def json_array_spans(path: str) -> List[Span]:
    """Where each element of a JSON array file sits (the elements themselves are not kept)."""
    return [span for span, _ in _scan(path)]


def read_element(path: str, span: Span) -> Any:
    """The element at `span` of a JSON array file, decoded."""
    with open(path, "rb") as f:
        f.seek(span[0])
        return json.loads(f.read(span[1] - span[0]))


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)
