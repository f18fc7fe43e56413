"""easy-VQA for the demo: questions and images of the `easy_vqa` package (MIT; 64x64 shapes, 13 answers).

The train split samples the package's train questions, the held-out split its test questions (different
images), so nothing held out is ever seen in training. Images are copied next to the JSONL. The train
split can be drawn per question type (`vqa_mix`): easy-VQA is 73% yes/no questions, most of which the
question wording answers alone (the question prior, docs/DEMO.md), and at that mix the colour answers'
gradient is drowned. With `vqa_describe` each train answer first describes the image ("is there not a red
shape?" -> "a blue rectangle. red: absent. yes"), and the held-out lines tell `mindvl eval` to score the
words after the last ". " (`answer_after`). The question types and the per-template question prior serve
the baselines and the per-type scores.
"""
from __future__ import annotations

import os
import shutil
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import easy_vqa
import numpy as np
from PIL import Image

from mindvl_ms.recipes.demo.lines import answer_of, sample_line


VQA_SHAPES = ("circle", "rectangle", "triangle")
VQA_COLOURS = ("red", "green", "blue", "yellow", "gray", "black", "teal", "brown")
VQA_WORDS = VQA_COLOURS + VQA_SHAPES
DESCRIBE_SEP = ". "     # between the description and the answer of a described easy-VQA answer
VQA_TYPES = ("yes/no", "colour", "shape")
YES_NO_CELLS = ("plain:yes", "plain:no", "negated:yes", "negated:no")


def answer_type(answer: str) -> str:
    """easy-VQA question type of a reference answer: yes/no, colour or shape."""
    return "yes/no" if answer in ("yes", "no") else "shape" if answer in VQA_SHAPES else "colour"


def vqa_type(line: dict) -> str:
    """easy-VQA question type (yes/no, colour or shape) from the reference answer of a training-format line
    or of an eval predictions.jsonl record (its `answers`)."""
    return answer_type(answer_of(line) if "messages" in line else line["answers"][0])


def type_quotas(n: int, mix: Dict[str, float]) -> Dict[str, int]:
    """n split over question types in proportion to mix (largest remainders; sums to n), in VQA_TYPES order
    whatever the mapping's key order, so the same mix draws the same questions however it was written
    (a YAML dumped with sorted keys included)."""
    weights = list(mix.values()) if isinstance(mix, dict) else []
    if not weights or set(mix) - set(VQA_TYPES) or \
            any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"vqa_mix {mix}: expected non-negative weights over {', '.join(VQA_TYPES)} "
                         "with a positive sum")
    return largest_remainders(n, {t: mix[t] for t in VQA_TYPES if t in mix})


def largest_remainders(n: int, weights: Dict[str, float]) -> Dict[str, int]:
    """n split over the keys in proportion to their (non-negative, positive-sum) weights; sums to n."""
    total = sum(weights.values())
    exact = {t: n * w / total for t, w in weights.items()}
    out = {t: int(np.floor(v)) for t, v in exact.items()}
    for t in sorted(exact, key=lambda t: out[t] - exact[t])[:n - sum(out.values())]:
        out[t] += 1
    return out


def yes_no_cell(question: str, answer: str) -> str:
    """(wording, answer) cell of a yes/no question: 'negated:yes', 'plain:no', ... easy-VQA's negated
    wordings ("is there not a ...", "does the image not contain ...", "is no ... present") mostly take
    'yes' and the plain ones mostly 'no', so the wording alone answers most of them (docs/DEMO.md)."""
    q = f" {question.lower()} "
    return f"{'negated' if ' not ' in q or ' is no ' in q else 'plain'}:{answer}"


def sample_questions(answers: Sequence[str], n: int, rng: np.random.Generator,
                     mix: Optional[Dict[str, float]] = None, questions: Optional[Sequence[str]] = None,
                     balance_yes_no: bool = False) -> List[int]:
    """Sorted indices of n questions: uniform over the split, or `type_quotas(n, mix)` per question type;
    with `balance_yes_no` (needs `mix` and `questions`) the yes/no quota is split equally over
    `YES_NO_CELLS`, so a question's wording does not predict its answer."""
    if n > len(answers):
        raise ValueError(f"asked for {n} questions, the split has {len(answers)}")
    if balance_yes_no and (not mix or questions is None):
        raise ValueError("balancing yes/no answers needs a vqa_mix (question type quotas) and the questions")
    if not mix:
        return sorted(rng.choice(len(answers), size=n, replace=False).tolist())
    kinds = np.array([answer_type(a) for a in answers])
    if balance_yes_no:
        kinds = np.array([yes_no_cell(q, a) if k == "yes/no" else k for q, a, k in zip(questions, answers, kinds)])
    out: List[int] = []
    for t, k in type_quotas(n, mix).items():
        cells = largest_remainders(k, dict.fromkeys(YES_NO_CELLS, 1)) if balance_yes_no and t == "yes/no" else {t: k}
        for c, kc in cells.items():
            pool = np.flatnonzero(kinds == c)
            if kc > len(pool):
                raise ValueError(f"vqa_mix asks for {kc} {c} questions, the split has {len(pool)}")
            out.extend(rng.choice(pool, size=kc, replace=False).tolist())
    return sorted(out)


def image_attributes(questions: Sequence[str], answers: Sequence[str], image_ids: Sequence[int]
                     ) -> Dict[int, Tuple[str, str]]:
    """(colour, shape) of each easy-VQA image whose questions name both: the answer of a colour or shape
    question, the other attribute its wording names ("what is the color of the circle?"), and the words
    of a yes/no question the image affirms (plain wording answered yes, negated wording answered no).
    easy-VQA images hold one shape, so each image has one colour and one shape (checked here)."""
    seen: Dict[int, Dict[str, set]] = {}
    for q, a, i in zip(questions, answers, image_ids):
        kind = answer_type(a)
        if kind == "yes/no" and yes_no_cell(q, a) not in ("plain:yes", "negated:no"):
            continue
        words = q.rstrip("?").split() + ([] if kind == "yes/no" else [a])
        got = seen.setdefault(int(i), {"colour": set(), "shape": set()})
        got["colour"].update(w for w in words if w in VQA_COLOURS)
        got["shape"].update(w for w in words if w in VQA_SHAPES)
    for i, got in seen.items():
        if len(got["colour"]) > 1 or len(got["shape"]) > 1:
            raise ValueError(f"easy-VQA image {i}: its questions name colours {sorted(got['colour'])} and "
                             f"shapes {sorted(got['shape'])}, expected one of each")
    return {i: (next(iter(g["colour"])), next(iter(g["shape"]))) for i, g in seen.items()
            if g["colour"] and g["shape"]}


def describe_answer(colour: str, shape: str, question: str, answer: str) -> str:
    """The described answer of `vqa_describe`: the description, then for a yes/no question the word it
    names with whether the image has it, then the answer:
        "what color is the shape?"  -> 'a blue rectangle. blue'
        "is there a red shape?"     -> 'a blue rectangle. red: no. no'
        "is there not a red shape?" -> 'a blue rectangle. red: absent. yes'   (negated: present / absent)
    The words carry a leading space, as in the questions, so they are the questions' tokens. A negated
    wording's step says present/absent, so the answer is a lookup of the step's word. With yes/no there
    too, the answer was an XOR of that word and the wording, and no run learned it (docs/DEMO.md)."""
    if answer not in ("yes", "no"):
        return f"a {colour} {shape}{DESCRIBE_SEP}{answer}"
    named = [w for w in question.rstrip("?").split() if w in VQA_WORDS]
    if len(named) != 1:
        raise ValueError(f"yes/no question {question!r}: expected one colour or shape word, got {named}")
    has = named[0] in (colour, shape)
    if yes_no_cell(question, answer).startswith("negated"):
        step = "present" if has else "absent"
    else:
        step = "yes" if has else "no"
    return f"a {colour} {shape}{DESCRIBE_SEP}{named[0]}: {step}{DESCRIBE_SEP}{answer}"


def easy_vqa_lines(out_dir: str, n_train: int, n_heldout: int, rng: np.random.Generator,
                   train_mix: Optional[Dict[str, float]] = None, train_balance_yes_no: bool = False,
                   question_first: bool = False, describe: bool = False) -> Dict[str, List[dict]]:
    """Sampled easy-VQA questions; the images used are copied to out_dir/images/vqa/.

    `train_mix` ({yes/no, colour, shape: weight}) sets the train split's share of each question type
    (easy-VQA itself is 73% yes/no, 13% colour, 13% shape); the held-out split keeps the package's own
    distribution. `train_balance_yes_no` draws the train split's yes/no questions equally over
    `YES_NO_CELLS` (`sample_questions`). `question_first` puts each question before its image, in both
    splits (`sample_line`). `describe`: every train answer first names the image's colour and shape
    (`describe_answer`; only questions on images whose attributes `image_attributes` knows are drawn,
    about 89% of them), `meta.short_answer` keeps the short answer, and each held-out line gets the
    `answer_after` field (`mindvl eval` scores the text after the description).
    The held-out split draws from a child stream of rng (`Generator.spawn`, which leaves rng's own draws as
    they were), so it depends on the seed and n_heldout only: a recipe's train settings (size, mix,
    balance, describe) do not change the questions it is scored on, nor their image-blind prior."""
    streams = {"train": rng, "heldout": rng.spawn(1)[0]}
    splits = {"train": (easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths(), n_train),
              "heldout": (easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths(), n_heldout)}
    img_dir = os.path.join(out_dir, "images", "vqa")
    os.makedirs(img_dir, exist_ok=True)
    out: Dict[str, List[dict]] = {}
    for split, ((questions, answers, image_ids), paths, n) in splits.items():
        attrs = image_attributes(questions, answers, image_ids) if describe and split == "train" else {}
        pool = (np.flatnonzero([int(i) in attrs for i in image_ids]) if attrs else np.arange(len(answers)))
        try:
            chosen = (sample_questions([answers[i] for i in pool], n, rng, train_mix, [questions[i] for i in pool],
                                       train_balance_yes_no) if split == "train"
                      else sample_questions(answers, n, streams[split]))
        except ValueError as e:
            raise ValueError(f"easy-VQA {split}: {e}") from None
        lines = []
        for i in (pool[chosen].tolist() if split == "train" else chosen):
            img_id = int(image_ids[i])
            src = paths[img_id]
            rel = f"images/vqa/{split}_{img_id}.png"
            dst = os.path.join(out_dir, rel)
            if not os.path.isfile(dst):
                shutil.copyfile(src, dst)
            with Image.open(dst) as im:
                size = im.size
            if attrs:  # a described train answer
                line = sample_line(f"vqa-{split}-{i}", rel, size, questions[i],
                                   describe_answer(*attrs[img_id], questions[i], answers[i]), "vqa",
                                   question_first=question_first,
                                   short_answer=answers[i], description=" ".join(attrs[img_id]))
            else:
                line = sample_line(f"vqa-{split}-{i}", rel, size, questions[i], answers[i], "vqa",
                                   question_first=question_first)
                if describe:  # a held-out line: score the words after the description
                    line["answer_after"] = DESCRIBE_SEP
            lines.append(line)
        out[split] = lines
    return out


def question_template(line: dict) -> str:
    """The user question with colour and shape words masked (what an image-blind model can key on)."""
    text = line["messages"][0]["content"].replace("<image>", "").strip()
    for w in VQA_WORDS:
        text = text.replace(w, "_")
    return text


def question_prior(train: Sequence[dict], heldout: Sequence[dict], fallback: str) -> float:
    """Held-out accuracy of answering each question template with its most frequent training answer
    (a stronger image-blind baseline than the global majority answer)."""
    by: Dict[str, Counter] = {}
    for s in train:
        by.setdefault(question_template(s), Counter())[answer_of(s)] += 1
    hits = [(by[t].most_common(1)[0][0] if t in by else fallback) == answer_of(s)
            for s in heldout for t in [question_template(s)]]
    return float(np.mean(hits)) if hits else 0.0
