"""The formats by name, and telling a file's format (`--from auto`, `format: auto`).

A `.parquet` name or parquet's `PAR1` magic is parquet. Otherwise the first record that decodes to an
object decides (of a JSON array, or of a JSONL file): `messages`, `images` or a `system` field make
ShareGPT (LLaMA-Factory), `conversations` without them LLaVA; a record whose fields are all this
project's (`messages` with role/content turns) is this project's JSONL, which needs no conversion.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from mindvl_ms.data.formats.common import Record
from mindvl_ms.data.formats.files import count_lines, is_json_array, iter_json_array, iter_jsonl_records
from mindvl_ms.data.formats.llava import llava_record
from mindvl_ms.data.formats.parquet import iter_parquet, num_rows, parquet_record
from mindvl_ms.data.formats.sharegpt import sharegpt_record
from mindvl_ms.data.schema import FIELDS

# record converters by format name; this project's JSONL reads as ShareGPT (its superset)
CONVERTERS: Dict[str, Callable] = {"llava": llava_record, "sharegpt": sharegpt_record, "parquet": parquet_record,
                                   "jsonl": sharegpt_record}
PROBE = 100  # records looked at for one that decodes


def is_parquet(path: str) -> bool:
    if path.lower().endswith(".parquet"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def format_of(obj: Any) -> Optional[str]:
    """The format one decoded record is written in, or None."""
    if not isinstance(obj, dict):
        return None
    turns = obj.get("messages")
    if (isinstance(turns, list) and set(obj) <= set(FIELDS)
            and all(isinstance(t, dict) and "role" in t and "content" in t for t in turns)):
        return "jsonl"
    if "messages" in obj or "images" in obj or "system" in obj:
        return "sharegpt"
    if "conversations" in obj:
        return "llava"
    return None


def detect_format(path: str) -> str:
    """jsonl, llava, sharegpt or parquet (see module doc); a ValueError names what was found."""
    if is_parquet(path):
        return "parquet"
    records, _ = input_records(path, "sharegpt")
    seen = []
    for rec in itertools.islice(records, PROBE):
        fmt = format_of(rec.obj)
        if fmt is not None:
            return fmt
        if isinstance(rec.obj, dict):
            seen.append(f"{rec.where}: fields {', '.join(sorted(rec.obj)) or '(none)'}")
    found = f"; {seen[0]}" if seen else ""
    raise ValueError(f"{path}: cannot tell the format from its first records{found}: give it (llava, sharegpt "
                     f"or parquet)")


def input_records(path: str, fmt: str) -> Tuple[Iterator[Record], Optional[int]]:
    """(the records of `path` read as `fmt`, their number when it is known up front)."""
    if fmt == "parquet":
        return iter_parquet(path), num_rows(path)
    if is_json_array(path):
        return iter_json_array(path), None
    return iter_jsonl_records(path), count_lines(path)
