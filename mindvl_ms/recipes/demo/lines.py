"""The demo's JSONL line format (docs/DATA.md), shared by its three tasks: one sample per line, with the
task and the metric that scores it in `meta`; and the JSONL writer."""
from __future__ import annotations

import json
import os
from typing import Sequence, Tuple


TASKS = ("vqa", "ocr", "grounding")
METRIC = {"vqa": "exact_match", "ocr": "exact_match", "grounding": "grounding"}


def sample_line(sid: str, image: str, size: Tuple[int, int], question: str, answer: str, task: str,
                question_first: bool = False, **meta) -> dict:
    """One JSONL object in the docs/DATA.md format (image path relative to the JSONL file); the user turn is
    "<image>\nquestion", or "question\n<image>" with `question_first`."""
    user = f"{question}\n<image>" if question_first else f"<image>\n{question}"
    return {"id": sid, "images": [image], "image_sizes": [[int(size[0]), int(size[1])]],
            "messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": answer}],
            "meta": {"task": task, "metric": METRIC[task], **meta}}


def answer_of(line: dict) -> str:
    """The short answer of a line: `meta.short_answer` (a described easy-VQA answer), else its assistant turn."""
    short = line.get("meta", {}).get("short_answer")
    return short or next(m["content"] for m in line["messages"] if m["role"] == "assistant")


def write_jsonl(path: str, lines: Sequence[dict]) -> None:
    """lines as JSONL at path, written under a temporary name and renamed (never a half-written file)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for obj in lines:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
