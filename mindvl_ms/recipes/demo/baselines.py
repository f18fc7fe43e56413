"""Image-blind baselines of the demo's held-out splits: the score of always giving the best constant answer
learned from the train split. That is the most frequent training answer (easy-VQA's majority-answer
baseline; for OCR, where every answer is nearly unique, the chance level of a model that ignores the
image) or, for grounding, the mean training box scored with Acc@IoU0.5; for easy-VQA also the stronger
per-question-template prior (`vqa_data.question_prior`)."""
from __future__ import annotations

from collections import Counter
from typing import Dict, Sequence

import numpy as np

from mindvl_ms.data.grounding import format_box
from mindvl_ms.eval.metrics import parse_box, score_sample
from mindvl_ms.recipes.demo.lines import METRIC, answer_of
from mindvl_ms.recipes.demo.vqa_data import VQA_TYPES, question_prior, vqa_type


def blind_baseline(task: str, train: Sequence[dict], heldout: Sequence[dict]) -> Dict[str, object]:
    """Held-out score of the best image-blind constant answer learned from the train split."""
    if task == "grounding":
        boxes = np.array([parse_box(answer_of(s)) for s in train], dtype=np.float64)
        guess = format_box(*[int(round(v)) for v in boxes.mean(axis=0)])
        kind = "mean training box"
    else:
        guess = Counter(answer_of(s) for s in train).most_common(1)[0][0]
        kind = "majority answer"
    hits = [score_sample(METRIC[task], guess, {"answers": [answer_of(s)]}) for s in heldout]
    out = {"kind": kind, "answer": guess, "score": float(np.mean(hits)) if hits else 0.0,
           "distinct_train_answers": len({answer_of(s) for s in train})}
    if task == "vqa":
        out["question_prior"] = question_prior(train, heldout, guess)
        out["by_type"] = {t: {"n": sum(vqa_type(s) == t for s in heldout),
                              "question_prior": question_prior(train, [s for s in heldout if vqa_type(s) == t], guess)}
                          for t in VQA_TYPES}
    return out
