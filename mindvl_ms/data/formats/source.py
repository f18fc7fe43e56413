"""A data source as the online loader reads it: this rank's records, each handed over as one line of this
project's JSONL, converted from the source's `format` as it is read (docs/DATA.md).

- `jsonl`: the file's own lines (byte offsets, `data/jsonl.py`); nothing is converted.
- `llava` / `sharegpt` in JSONL: a line is read back by its byte offset and converted.
- `llava` / `sharegpt` in a JSON array: one pass notes where each element sits (`files.json_array_spans`);
  an element is read back by seeking to it and converted.
- `parquet`: rows cannot be read one at a time cheaply (a read decodes a whole row group), so this rank's
  rows are converted when the source is opened, the converted lines (text and paths, no pixels) are
  kept, and the images are written once to `<file stem>_images/` beside the file.
Image paths of a converted line are absolute. A record that does not convert raises a `SampleError`
naming the file, the record number (the loader's line) and, for a JSON array or parquet file, the
element or row, which the loader counts as a skipped line like any other.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Tuple, Union

from mindvl_ms.config.data import DataSource
from mindvl_ms.data.formats.common import ConvertError, Record, Target
from mindvl_ms.data.formats.detect import CONVERTERS, detect_format
from mindvl_ms.data.formats.files import (decode_jsonl_line, element_where, is_json_array, json_array_spans,
                                          read_element)
from mindvl_ms.data.formats.parquet import iter_parquet
from mindvl_ms.data.jsonl import line_offsets, read_raw_at
from mindvl_ms.data.schema import SampleError


def loader_image_dir(path: str) -> str:
    """Where the loader writes the images stored in a parquet file: `<stem>_images/` beside it."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(os.path.dirname(os.path.abspath(path)), f"{stem}_images")


class SourceRecords:
    """`offsets`: [(record number, key)] of the records `keep` accepts; `raw(line, key)`: that record as a
    line of this project's JSONL (bytes), or a raised SampleError (see module doc)."""

    def __init__(self, source: DataSource, keep: Callable[[int], bool]):
        self.path = source.path
        self.format = detect_format(self.path) if source.format == "auto" else source.format
        self.offsets: List[Tuple[int, Any]]
        self.array = False
        if self.format == "jsonl":
            self.offsets = line_offsets(self.path, keep)
            return
        base = source.image_root or os.path.dirname(os.path.abspath(self.path))
        self.target = Target(base=os.path.abspath(base), out_dir=None, image_dir=loader_image_dir(self.path))
        self.convert = CONVERTERS[self.format]
        if self.format == "parquet":
            self.lines: Dict[int, Union[bytes, SampleError]] = {
                rec.number: self._line(rec) for rec in iter_parquet(self.path, keep)}
            self.offsets = [(n, n) for n in self.lines]
        elif is_json_array(self.path):
            self.array = True
            self.offsets = [(k + 1, span) for k, span in enumerate(json_array_spans(self.path)) if keep(k + 1)]
        else:
            self.offsets = line_offsets(self.path, keep)

    def raw(self, line: int, key: Any) -> bytes:
        if self.format == "jsonl":
            return read_raw_at(self.path, key)
        if self.format == "parquet":
            out = self.lines[line]
        elif self.array:
            out = self._line(Record(line, element_where(line - 1, key[2]), read_element(self.path, key)))
        else:
            out = self._line(decode_jsonl_line(read_raw_at(self.path, key), self.path, line))
        if isinstance(out, SampleError):
            raise out
        return out

    def _line(self, rec: Record) -> Union[bytes, SampleError]:
        try:
            if isinstance(rec.obj, ConvertError):
                raise rec.obj
            obj = self.convert(rec.obj, self.target)
        except ConvertError as e:
            detail = e.detail if rec.where == f"line {rec.number}" else f"{rec.where}: {e.detail}"
            return SampleError(self.path, rec.number, e.reason, detail)
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
