"""Demo data: easy-VQA, generated OCR and generated grounding, written as JSONL + PNG files.

Three tasks, each with a train split and a held-out split, all deterministic from one seed: `vqa`
(`vqa_data`: easy-VQA's questions and images), `ocr` (`ocr_data`: rendered words) and `grounding`
(`grounding_data`: one coloured shape, answered with its box). Every line follows the docs/DATA.md data
format (`lines.sample_line`); `meta` carries the task, the metric used to score it (`exact_match` or
`grounding`) and, for grounding, the pixel box. Held-out lines also carry the top-level `task` and
`metric` fields of the `mindvl eval` benchmark format. The writer also reports each task's image-blind
baseline on the held-out split (`baselines`).

Usage:
    from mindvl_ms.recipes.demo.datasets import write_demo_data
    info = write_demo_data("runs/demo/data", seed=0, sizes={"vqa": (2000, 200), ...})
    info["files"]["train"]["vqa"], info["files"]["heldout"]["ocr"], info["baselines"]["vqa"]
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import numpy as np
from tqdm import tqdm

from mindvl_ms.recipes.demo.baselines import blind_baseline
from mindvl_ms.recipes.demo.grounding_data import grounding_lines
from mindvl_ms.recipes.demo.lines import METRIC, TASKS, write_jsonl
from mindvl_ms.recipes.demo.ocr_data import ocr_lines
from mindvl_ms.recipes.demo.vqa_data import easy_vqa_lines


DEFAULT_SIZES = {"vqa": (2000, 200), "ocr": (1000, 100), "grounding": (1000, 100)}  # (train, held-out)


def write_demo_data(out_dir: str, seed: int = 0, sizes: Optional[Dict[str, Tuple[int, int]]] = None,
                    progress: bool = True, vqa_mix: Optional[Dict[str, float]] = None,
                    vqa_balance_yes_no: bool = False, vqa_question_first: bool = False,
                    vqa_describe: bool = False) -> Dict[str, object]:
    """Write train_<task>.jsonl / heldout_<task>.jsonl + images under out_dir; returns files and baselines.

    sizes: {task: (n_train, n_heldout)} (default DEFAULT_SIZES). Same seed and sizes -> identical files.
    vqa_mix: {question type: weight} of the easy-VQA train split (`easy_vqa_lines`; None: the package's own).
    vqa_balance_yes_no: its yes/no questions equally over (negated wording, answer) (`sample_questions`).
    vqa_question_first: every easy-VQA question before its image (`sample_line`).
    vqa_describe: every easy-VQA train answer names the image's colour and shape first (`easy_vqa_lines`).
    Also writes out_dir/info.json with the same content as the return value.
    """
    sizes = dict(DEFAULT_SIZES, **(sizes or {}))
    unknown = set(sizes) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown demo task(s) {sorted(unknown)}: expected {', '.join(TASKS)}")
    for task, (n_tr, n_ho) in sizes.items():
        if n_tr < 1 or n_ho < 1:
            raise ValueError(f"task {task}: need at least one train and one held-out sample, got {n_tr}, {n_ho}")
    os.makedirs(out_dir, exist_ok=True)
    makers = {"vqa": lambda *a: easy_vqa_lines(*a, train_mix=vqa_mix, train_balance_yes_no=vqa_balance_yes_no,
                                               question_first=vqa_question_first, describe=vqa_describe),
              "ocr": ocr_lines, "grounding": grounding_lines}
    info: Dict[str, object] = {"seed": seed, "sizes": {t: list(sizes[t]) for t in TASKS}, "vqa_mix": vqa_mix,
                               "vqa_balance_yes_no": vqa_balance_yes_no, "vqa_question_first": vqa_question_first,
                               "vqa_describe": vqa_describe,
                               "files": {"train": {}, "heldout": {}}, "baselines": {}}
    for k, task in enumerate(tqdm(TASKS, desc="demo data", disable=not progress)):
        rng = np.random.default_rng([seed, k])  # one stream per task: changing one size leaves the others
        split_lines = makers[task](out_dir, *sizes[task], rng)
        for obj in split_lines["heldout"]:  # evaluation fields read by mindvl_ms.eval.benchmark
            obj["task"], obj["metric"] = task, METRIC[task]
        for split in ("train", "heldout"):
            path = os.path.join(out_dir, f"{split}_{task}.jsonl")
            write_jsonl(path, split_lines[split])
            info["files"][split][task] = path  # type: ignore[index]
        baseline = blind_baseline(task, split_lines["train"], split_lines["heldout"])
        info["baselines"][task] = baseline  # type: ignore[index]
    with open(os.path.join(out_dir, "info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    return info
