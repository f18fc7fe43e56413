"""Random access into JSONL files by byte offset: one pass indexes the lines, a seek reads one back.

The loader (`dataset.py`) keeps only these offsets for its rank's lines and shards, and the offline packer
(`offline.py`) for the lines it writes into shards, so neither holds a file's JSON in memory.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple


def line_offsets(path: str, keep: Optional[Callable[[int], bool]] = None) -> List[Tuple[int, int]]:
    """[(1-based line, byte offset)] of the lines `keep` accepts (one pass, no JSON parsing)."""
    out, pos = [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if keep is None or keep(n):
                out.append((n, pos))
            pos += len(raw)
    return out


def read_raw_at(path: str, offset: int) -> bytes:
    """The raw bytes of the line starting at `offset` (with its newline)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.readline()


def read_at(path: str, offset: int) -> str:
    """The line starting at `offset`, decoded as UTF-8."""
    return read_raw_at(path, offset).decode("utf-8")
