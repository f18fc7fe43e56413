"""Demo data: easy-VQA, generated OCR and generated grounding, written as JSONL + PNG files.

Three tasks, each with a train split and a held-out split, all deterministic from one seed:
- `vqa`: questions and images of the `easy_vqa` package (MIT; 64x64 shapes, 13 answers). The train
  split samples the package's train questions, the held-out split its test questions (different
  images), so nothing held out is ever seen in training. Images are copied next to the JSONL. The train
  split can be drawn per question type (`vqa_mix`): easy-VQA is 73% yes/no questions that the question
  wording answers about 80% of the time, and at that mix the colour answers' gradient is drowned.
  With `vqa_describe` each train answer first describes the image ("is there not a red shape?" -> "a blue
  rectangle. red: absent. yes"), and the held-out lines tell `mindvl eval` to score the words after the last
  ". " (`answer_after`).
- `ocr`: one of 20 capitalised words rendered with DejaVu Sans Mono Bold (bundled with matplotlib),
  one character per 28-px visual-token column from a random start column, random dark colour on a
  random light 224x56 canvas (see `render_ocr`); the answer is the word.
- `grounding`: one coloured shape (circle, square, triangle; side 28..64 px, anywhere) on a 112x112
  canvas; the question names it by colour and shape and the answer is its box in the openPangu-VL
  syntax, `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`, coordinates normalised to integers 0..999. One
  shape, not a choice among several: the task is where, not which. Measured in grounding-only runs of
  the demo model: after 400 steps, 16% Acc@IoU0.5 with one shape per image, 4% with one or two (which
  needed 1,200 steps for 36%).

Every line follows the docs/DATA.md data format; `meta` carries the task, the metric used to score it
(`exact_match` or `grounding`) and, for grounding, the pixel box. Held-out lines also carry the
top-level `task` and `metric` fields of the `mindvl eval` benchmark format. The writer also reports each
task's blind baseline on the held-out split: the accuracy of always answering the most frequent
training answer (easy-VQA's majority-answer baseline; for OCR and grounding, where every answer is
nearly unique, this is the chance level of a model that ignores the image; for grounding the
constant guess is the mean training box, scored with Acc@IoU0.5).

Usage:
    from mindvl_ms.recipes.demo.datasets import write_demo_data
    info = write_demo_data("runs/demo/data", seed=0, sizes={"vqa": (2000, 200), ...})
    info["files"]["train"]["vqa"], info["files"]["heldout"]["ocr"], info["baselines"]["vqa"]
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mindvl_ms.data.grounding import box_iou, format_box, to_norm

TASKS = ("vqa", "ocr", "grounding")
METRIC = {"vqa": "exact_match", "ocr": "exact_match", "grounding": "grounding"}
OCR_WORDS = ["CAT", "DOG", "SUN", "MAP", "BOX", "CAR", "TREE", "BIRD", "FISH", "STAR", "MOON", "LION", "BEAR",
             "WOLF", "ROSE", "RAIN", "SNOW", "FIRE", "SHIP", "LAMP"]
OCR_SIZE = (224, 56)    # (width, height): 8 x 2 visual tokens at the demo's 12,544-pixel budget
OCR_CELL = 28           # px per character: one visual token column
OCR_FONT_SIZE = 40      # DejaVu Sans Mono Bold: every capital's ink is narrower than OCR_CELL
OCR_JITTER = 3          # px of random vertical offset
GROUND_SIZE = (112, 112)
GROUND_SHAPES = 1       # shapes per grounding image
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 50, 170), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
DEFAULT_SIZES = {"vqa": (2000, 200), "ocr": (1000, 100), "grounding": (1000, 100)}  # (train, held-out)


def font_path() -> str:
    """DejaVu Sans Mono Bold from matplotlib's bundled fonts (no system font needed)."""
    import matplotlib

    path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSansMono-Bold.ttf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bundled font not found: {path} (is matplotlib installed completely?)")
    return path


def sample_line(sid: str, image: str, size: Tuple[int, int], question: str, answer: str, task: str,
                question_first: bool = False, **meta) -> dict:
    """One JSONL object in the docs/DATA.md format (image path relative to the JSONL file); the user turn is
    "<image>\nquestion", or "question\n<image>" with `question_first`."""
    user = f"{question}\n<image>" if question_first else f"<image>\n{question}"
    return {"id": sid, "images": [image], "image_sizes": [[int(size[0]), int(size[1])]],
            "messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": answer}],
            "meta": {"task": task, "metric": METRIC[task], **meta}}


# ------------------------------------------------------------------------------------------ easy-VQA

def answer_type(answer: str) -> str:
    """easy-VQA question type of a reference answer: yes/no, colour or shape."""
    return "yes/no" if answer in ("yes", "no") else "shape" if answer in VQA_SHAPES else "colour"


def type_quotas(n: int, mix: Dict[str, float]) -> Dict[str, int]:
    """n split over question types in proportion to mix (largest remainders; sums to n)."""
    weights = list(mix.values()) if isinstance(mix, dict) else []
    if not weights or set(mix) - set(VQA_TYPES) or \
            any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"vqa_mix {mix}: expected non-negative weights over {', '.join(VQA_TYPES)} "
                         "with a positive sum")
    return largest_remainders(n, mix)


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
    'yes' and the plain ones mostly 'no' (the wording alone answers about 80%)."""
    q = f" {question.lower()} "
    return f"{'negated' if ' not ' in q or ' is no ' in q else 'plain'}:{answer}"


YES_NO_CELLS = ("plain:yes", "plain:no", "negated:yes", "negated:no")


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
    `answer_after` field (`mindvl eval` scores the text after the description)."""
    import easy_vqa

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
                      else sample_questions(answers, n, rng))
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


# ------------------------------------------------------------------------------------------ OCR

def ocr_text(rng: np.random.Generator) -> str:
    """A word from OCR_WORDS."""
    return OCR_WORDS[int(rng.integers(len(OCR_WORDS)))]


def render_ocr(text: str, rng: np.random.Generator, font_file: str) -> Image.Image:
    """`text` in a random dark colour on a random light background, one character per 28-px column
    (the width of one visual token: two 14-px patches merged 2x2), starting at a random column;
    each glyph is centred in its column, the line vertically centred +-OCR_JITTER px.

    With each glyph inside one visual token, the tiny from-scratch ViT reads a letter from one token
    and the LLM can name the word from the set of letters it finds, wherever the word starts (the
    earlier free placement of words and numbers stayed at 0% within the demo's budget).
    """
    w, h = OCR_SIZE
    cols = w // OCR_CELL
    if len(text) > cols:
        raise ValueError(f"OCR text {text!r} has more than {cols} characters")
    bg = tuple(int(v) for v in rng.integers(200, 256, size=3))
    fg = tuple(int(v) for v in rng.integers(0, 90, size=3))
    im = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(im)
    font = ImageFont.truetype(font_file, OCR_FONT_SIZE)
    _, top, _, bottom = draw.textbbox((0, 0), text, font=font)
    y = (h - (bottom - top)) // 2 + int(rng.integers(-OCR_JITTER, OCR_JITTER + 1)) - top
    c0 = int(rng.integers(0, cols - len(text) + 1))
    for k, ch in enumerate(text):
        x0, _, x1, _ = draw.textbbox((0, 0), ch, font=font)
        draw.text(((c0 + k) * OCR_CELL + (OCR_CELL - (x1 - x0)) // 2 - x0, y), ch, fill=fg, font=font)
    return im


def ocr_lines(out_dir: str, n_train: int, n_heldout: int, rng: np.random.Generator) -> Dict[str, List[dict]]:
    font_file = font_path()
    img_dir = os.path.join(out_dir, "images", "ocr")
    os.makedirs(img_dir, exist_ok=True)
    out: Dict[str, List[dict]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        lines = []
        for i in range(n):
            text = ocr_text(rng)
            rel = f"images/ocr/{split}_{i:05d}.png"
            render_ocr(text, rng, font_file).save(os.path.join(out_dir, rel))
            lines.append(sample_line(f"ocr-{split}-{i}", rel, OCR_SIZE, "What is written in the image?", text, "ocr"))
        out[split] = lines
    return out


# ------------------------------------------------------------------------------------------ grounding

def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: Tuple[int, int, int, int], colour) -> None:
    x1, y1, x2, y2 = box  # pixel box, (x2, y2) exclusive
    if kind == "circle":
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), fill=colour)
    elif kind == "square":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=colour)
    else:
        draw.polygon([((x1 + x2 - 1) / 2, y1), (x1, y2 - 1), (x2 - 1, y2 - 1)], fill=colour)


def _place(rng: np.random.Generator, taken: List[Tuple[int, int, int, int]], w: int, h: int):
    """A random box (side 28..64 px) not overlapping the ones in `taken` (None after 50 tries)."""
    for _ in range(50):
        side = int(rng.integers(28, 65))
        x1, y1 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        box = (x1, y1, x1 + side, y1 + side)
        if all(box_iou(box, t) == 0.0 for t in taken):
            return box
    return None


def grounding_image(rng: np.random.Generator, n_shapes: int = GROUND_SHAPES
                    ) -> Tuple[Image.Image, str, str, Tuple[int, int, int, int]]:
    """(image, target name e.g. 'red circle', answer, pixel box of the target); the target is one of
    `n_shapes` non-overlapping shapes of different colours."""
    w, h = GROUND_SIZE
    im = Image.new("RGB", (w, h), (245, 245, 245))
    draw = ImageDraw.Draw(im)
    colours = rng.choice(list(COLOURS), size=n_shapes, replace=False)
    objs, taken = [], []
    for c in colours:
        box = _place(rng, taken, w, h)
        if box is None:
            break
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        _draw_shape(draw, kind, box, COLOURS[str(c)])
        objs.append((f"{c} {kind}", box))
        taken.append(box)
    name, box = objs[int(rng.integers(len(objs)))]
    (nx1, ny1), (nx2, ny2) = to_norm([box[:2], box[2:]], w, h).tolist()
    return im, name, format_box(nx1, ny1, nx2, ny2), box


def grounding_lines(out_dir: str, n_train: int, n_heldout: int, rng: np.random.Generator) -> Dict[str, List[dict]]:
    img_dir = os.path.join(out_dir, "images", "grounding")
    os.makedirs(img_dir, exist_ok=True)
    out: Dict[str, List[dict]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        lines = []
        for i in range(n):
            im, name, answer, box = grounding_image(rng)
            rel = f"images/grounding/{split}_{i:05d}.png"
            im.save(os.path.join(out_dir, rel))
            lines.append(sample_line(f"grounding-{split}-{i}", rel, GROUND_SIZE, f"Where is the {name}?", answer,
                                     "grounding", box_pixels=list(box)))
        out[split] = lines
    return out


# ------------------------------------------------------------------------------------------ baselines

def answer_of(line: dict) -> str:
    """The short answer of a line: `meta.short_answer` (a described easy-VQA answer), else its assistant turn."""
    short = line.get("meta", {}).get("short_answer")
    return short or next(m["content"] for m in line["messages"] if m["role"] == "assistant")


def blind_baseline(task: str, train: Sequence[dict], heldout: Sequence[dict]) -> Dict[str, object]:
    """Held-out score of the best image-blind constant answer learned from the train split."""
    from mindvl_ms.eval.metrics import parse_box, score_sample

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


VQA_SHAPES = ("circle", "rectangle", "triangle")
VQA_COLOURS = ("red", "green", "blue", "yellow", "gray", "black", "teal", "brown")
VQA_WORDS = VQA_COLOURS + VQA_SHAPES
DESCRIBE_SEP = ". "     # between the description and the answer of a described easy-VQA answer
VQA_TYPES = ("yes/no", "colour", "shape")


def vqa_type(line: dict) -> str:
    """easy-VQA question type (yes/no, colour or shape) from the reference answer of a training-format line
    or of an eval predictions.jsonl record (its `answers`)."""
    return answer_type(answer_of(line) if "messages" in line else line["answers"][0])


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


# ------------------------------------------------------------------------------------------ writer

def write_jsonl(path: str, lines: Sequence[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for obj in lines:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


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
    from tqdm import tqdm

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
