"""`EvalItem`: one generation request of a benchmark and its reference, whatever file it came from
(this project's JSONL: `eval.benchmark`; VLMEvalKit TSV: `eval.tsv`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class EvalItem:
    """One generation request: a benchmark line (or one circular pass of it) and its reference."""

    uid: str                               # unique key: id, plus "#k" for circular pass k
    id: str
    line: int
    task: str
    metric: str
    messages: List[Dict[str, str]]          # prompt turns, the last one is the user's
    images: List[str]                       # absolute paths
    ref: dict                               # answers (+ options, category, matcher, breakdown keys)
    group: str
    sizes: Optional[List[Tuple[int, int]]] = None   # (width, height) per image when given
    extra: dict = field(default_factory=dict)
    source: str = ""                        # the benchmark file (for file:line in errors)
