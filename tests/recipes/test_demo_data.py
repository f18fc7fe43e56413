"""Demo data (mindvl_ms/recipes/demo/datasets.py): checked against the easy_vqa package, the pixels of the
generated images, and baselines recomputed by hand. Runs in seconds (no MindSpore).

    python -m pytest -q tests/recipes/test_demo_data.py
"""
import hashlib
import json
import os
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.data.grounding import parse_grounding
from mindvl_ms.data.schema import parse_sample
from mindvl_ms.recipes.demo.datasets import write_demo_data
from mindvl_ms.recipes.demo.grounding_data import COLOURS
from mindvl_ms.recipes.demo.ocr_data import OCR_CELL, OCR_WORDS
from mindvl_ms.eval.benchmark import load_benchmark

SIZES = {"vqa": (40, 12), "ocr": (30, 10), "grounding": (40, 12)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demo_data"))
    return d, write_demo_data(d, seed=3, sizes=SIZES, progress=False)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def _answer(obj):
    return [m["content"] for m in obj["messages"] if m["role"] == "assistant"][-1]


def _short(obj):
    """The short answer of a train line: `meta.short_answer` of a described easy-VQA answer, else the turn."""
    return obj["meta"].get("short_answer", _answer(obj))


def _digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for fn in sorted(files):
            if fn == "info.json":
                continue
            p = os.path.join(dirpath, fn)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_deterministic_from_seed(data, tmp_path):
    d, _ = data
    again = str(tmp_path / "again")
    write_demo_data(again, seed=3, sizes=SIZES, progress=False)
    assert _digest(again) == _digest(d)
    other = str(tmp_path / "other")
    write_demo_data(other, seed=4, sizes=SIZES, progress=False)
    assert _digest(other) != _digest(d)


def test_sizes_and_formats(data):
    d, info = data
    for task, (n_tr, n_ho) in SIZES.items():
        train, held = info["files"]["train"][task], info["files"]["heldout"][task]
        assert len(_lines(train)) == n_tr and len(_lines(held)) == n_ho
        for n, obj in enumerate(_lines(train), 1):  # the training schema accepts every line
            s = parse_sample(obj, train, n)
            assert len(s.images) == 1 and os.path.isfile(s.images[0])
            with Image.open(s.images[0]) as im:
                assert list(im.size) == obj["image_sizes"][0]
        items = load_benchmark(held)  # the evaluation runner accepts every held-out line
        assert {it.task for it in items} == {task}
        assert {it.metric for it in items} == {"grounding" if task == "grounding" else "exact_match"}


def test_vqa_matches_easy_vqa_package(data):
    import easy_vqa

    d, info = data
    for split, qs, paths in (("train", easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths()),
                             ("heldout", easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths())):
        for obj in _lines(info["files"][split]["vqa"]):
            i = int(obj["id"].rsplit("-", 1)[1])
            question, answer, image_id = qs[0][i], qs[1][i], qs[2][i]
            assert obj["messages"][0]["content"] == "<image>\n" + question
            assert _answer(obj) == answer
            with open(os.path.join(d, obj["images"][0]), "rb") as a, open(paths[image_id], "rb") as b:
                assert a.read() == b.read()
            assert obj["images"][0].startswith(f"images/vqa/{split}_")  # held-out images are test-split images


def test_grounding_box_bounds_the_named_shape(data):
    d, info = data
    for split in ("train", "heldout"):
        for obj in _lines(info["files"][split]["grounding"]):
            colour = obj["messages"][0]["content"].split("Where is the ")[1].split()[0]
            rgb = np.asarray(Image.open(os.path.join(d, obj["images"][0])).convert("RGB")).astype(int)
            ys, xs = np.nonzero((np.abs(rgb - np.array(COLOURS[colour])).sum(-1) == 0))
            assert xs.size > 50, obj["id"]
            h, w = rgb.shape[:2]
            ink = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float)  # exclusive max, pixels
            (shape,) = parse_grounding(_answer(obj), strict=True)[0].shapes
            box = np.array(shape.box, float) / 999.0 * np.array([w, h, w, h])
            assert np.abs(box - ink).max() <= 1.0, (obj["id"], box, ink)
            assert np.array_equal(obj["meta"]["box_pixels"], ink.astype(int))
            # one shape: every non-background pixel has the named colour
            colours = {tuple(c) for c in rgb.reshape(-1, 3)} - {(245, 245, 245)}
            assert colours == {tuple(COLOURS[colour])}, (obj["id"], colours)


def test_ocr_letters_fill_one_token_column_each(data):
    d, info = data
    starts = set()
    for split in ("train", "heldout"):
        for obj in _lines(info["files"][split]["ocr"]):
            text = _answer(obj)
            assert text in OCR_WORDS
            g = np.asarray(Image.open(os.path.join(d, obj["images"][0])).convert("L")).astype(int)
            assert g.shape == (56, 224)
            ink = np.abs(g - np.median(g)) > 60
            edge = np.concatenate([ink[0], ink[-1], ink[:, 0], ink[:, -1]])
            assert not edge.any(), obj["id"]          # not cut off by the border
            per_col = ink.reshape(56, 224 // OCR_CELL, OCR_CELL).sum(axis=(0, 2))  # ink per token column
            used = np.flatnonzero(per_col > 40)
            assert len(used) == len(text) and np.array_equal(used, np.arange(used[0], used[0] + len(text))), \
                (obj["id"], per_col)                  # one letter per column, consecutive columns ...
            assert per_col.sum() == per_col[used].sum(), obj["id"]  # ... and no ink anywhere else
            assert not ink[:, ::OCR_CELL].any(), obj["id"]  # no glyph crosses a column boundary
            starts.add(int(used[0]))
    assert len(starts) > 2                            # the start column varies


def test_blind_baselines_recomputed(data):
    d, info = data
    for task in ("vqa", "ocr"):
        train = [_answer(o) for o in _lines(info["files"]["train"][task])]
        held = [_answer(o) for o in _lines(info["files"]["heldout"][task])]
        counts = Counter(train)
        top = max(counts.values())
        b = info["baselines"][task]
        assert counts[b["answer"]] == top
        assert b["score"] == pytest.approx(sum(a.strip().lower() == b["answer"].lower() for a in held) / len(held))
    # question prior: hand-rolled per-template majority on the same files
    tr, ho = _lines(info["files"]["train"]["vqa"]), _lines(info["files"]["heldout"]["vqa"])
    words = ["red", "green", "blue", "yellow", "gray", "black", "teal", "brown", "circle", "rectangle", "triangle"]

    def key(o):
        t = o["messages"][0]["content"][len("<image>\n"):]
        for w in words:
            t = t.replace(w, "_")
        return t
    per = {}
    for o in tr:
        per.setdefault(key(o), Counter())[_answer(o)] += 1
    top = Counter(_answer(o) for o in tr).most_common(1)[0][0]
    want = np.mean([(per[key(o)].most_common(1)[0][0] if key(o) in per else top) == _answer(o) for o in ho])
    assert info["baselines"]["vqa"]["question_prior"] == pytest.approx(want)
    # per question type (yes/no, colour, shape): the same prior restricted to held-out questions of that type
    kind = {"yes": "yes/no", "no": "yes/no", "circle": "shape", "rectangle": "shape", "triangle": "shape"}
    by = info["baselines"]["vqa"]["by_type"]
    assert sum(v["n"] for v in by.values()) == len(ho)
    for t, v in by.items():
        sub = [o for o in ho if kind.get(_answer(o), "colour") == t]
        assert v["n"] == len(sub)
        if sub:
            assert v["question_prior"] == pytest.approx(
                np.mean([(per[key(o)].most_common(1)[0][0] if key(o) in per else top) == _answer(o) for o in sub]))
    boxes = np.array([parse_grounding(_answer(o))[0].shapes[0].box
                      for o in _lines(info["files"]["train"]["grounding"])], float)
    mean = np.round(boxes.mean(0))
    held = np.array([parse_grounding(_answer(o))[0].shapes[0].box
                     for o in _lines(info["files"]["heldout"]["grounding"])], float)
    lt, rb = np.maximum(held[:, :2], mean[:2]), np.minimum(held[:, 2:], mean[2:])
    inter = np.prod(np.clip(rb - lt, 0, None), 1)
    union = np.prod(held[:, 2:] - held[:, :2], 1) + np.prod(mean[2:] - mean[:2]) - inter
    assert info["baselines"]["grounding"]["score"] == pytest.approx(np.mean(inter / union >= 0.5))


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown demo task"):
        write_demo_data(str(tmp_path), sizes={"caption": (1, 1)}, progress=False)
    with pytest.raises(ValueError, match="at least one"):
        write_demo_data(str(tmp_path), sizes={"ocr": (0, 1)}, progress=False)


def test_demo_yaml_including_the_shipped_one_from_elsewhere(tmp_path):
    """A user YAML outside configs/demo that `_include_`s full.yaml finds the model YAML the shipped
    file names (relative to configs/demo/), `model:` sections override its fields, and a missing one is
    reported by name."""
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config

    mine = tmp_path / "mine.yaml"
    mine.write_text(f"_include_: {config_path(False)}\nstages:\n  - {{name: warmup, max_steps: 3}}\n"
                    "model: {text: {num_hidden_layers: 3}}\n")
    cfg, demo = load_demo_config(str(mine), str(tmp_path / "data"))
    assert cfg.model.text.vocab_size == 151936 and cfg.model.vision.depth == 2  # from demo.model
    assert cfg.model.text.num_hidden_layers == 3                                # this file's model: section
    assert [s.max_steps for s in cfg.stages] == [3]
    assert cfg.data.sources[0].path == str(tmp_path / "data" / "train_vqa.jsonl")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"_include_: {config_path(False)}\ndemo: {{model: nowhere.yaml}}\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_demo_config(str(bad), str(tmp_path / "data"))
    # a misspelt demo setting is refused by name, not silently ignored
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"_include_: {config_path(False)}\ndemo: {{vqa_question_frist: true}}\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: demo.vqa_question_frist is not a demo setting.*vqa_question_first"):
        load_demo_config(str(typo), str(tmp_path / "data"))
    # a yes/no setting must be a YAML boolean: the string "no" would otherwise read as true
    word = tmp_path / "word.yaml"
    word.write_text(f"_include_: {config_path(False)}\ndemo: {{vqa_question_first: 'no'}}\n")
    with pytest.raises(ConfigError, match=r"word.yaml: demo.vqa_question_first must be true or false, got 'no'"):
        load_demo_config(str(word), str(tmp_path / "data"))


def test_vqa_scores_by_type(tmp_path):
    from mindvl_ms.recipes.demo.evaluation import vqa_scores_by_type

    rows = [("yes", 1), ("no", 0), ("no", 1), ("teal", 1), ("brown", 0), ("circle", 0)]
    p = tmp_path / "predictions.jsonl"
    p.write_text("".join(json.dumps({"answers": [a], "score": float(sc)}) + "\n" for a, sc in rows))
    got = vqa_scores_by_type(str(p))
    assert got == {"yes/no": pytest.approx(2 / 3), "colour": 0.5, "shape": 0.0}


def _kind(answer):
    """easy-VQA question type of an answer, from the package's answer words."""
    return "yes/no" if answer in ("yes", "no") else "shape" if answer in ("circle", "rectangle", "triangle") else "colour"


def test_vqa_mix_sets_the_train_question_types(tmp_path):
    """`vqa_mix` fixes the train split's count of each easy-VQA question type (largest remainders); the
    held-out split keeps the package's own mix; a mix the split cannot fill is refused by name."""
    from mindvl_ms.recipes.demo.vqa_data import sample_questions, type_quotas

    assert type_quotas(10, {"yes/no": 1, "colour": 1, "shape": 1}) == {"yes/no": 4, "colour": 3, "shape": 3}
    assert type_quotas(7, {"yes/no": 2, "colour": 1, "shape": 0}) == {"yes/no": 5, "colour": 2, "shape": 0}
    with pytest.raises(ValueError, match="non-negative weights"):
        type_quotas(3, {"count": 1})
    with pytest.raises(ValueError, match="non-negative weights"):
        type_quotas(3, ["colour"])
    with pytest.raises(ValueError, match="3 colour questions, the split has 1"):
        sample_questions(["yes", "no", "red", "circle"], 3, np.random.default_rng(0), {"colour": 1})

    d = str(tmp_path / "mix")
    info = write_demo_data(d, seed=3, sizes={"vqa": (30, 60)}, progress=False,
                           vqa_mix={"yes/no": 1, "colour": 1, "shape": 1})
    train = Counter(_kind(_answer(o)) for o in _lines(info["files"]["train"]["vqa"]))
    assert train == {"yes/no": 10, "colour": 10, "shape": 10}
    held = Counter(_kind(_answer(o)) for o in _lines(info["files"]["heldout"]["vqa"]))
    assert held["yes/no"] > 30  # easy-VQA's test split is ~73% yes/no (binomial sd ~3.4 of 60)
    assert info["vqa_mix"] == {"yes/no": 1, "colour": 1, "shape": 1}


def test_vqa_mix_draws_the_same_questions_in_any_key_order(tmp_path):
    """A mix's key order does not change the draw: the same weights written yes/no-colour-shape and sorted
    (as a YAML dumped with sorted keys has them) write the same train split."""
    mixes = [{"yes/no": 1, "colour": 2, "shape": 3}, {"colour": 2, "shape": 3, "yes/no": 1}]
    lines = [_lines(write_demo_data(str(tmp_path / str(i)), seed=0, sizes={"vqa": (12, 1)}, progress=False,
                                    vqa_mix=m)["files"]["train"]["vqa"]) for i, m in enumerate(mixes)]
    assert lines[0] == lines[1]


def test_demo_yamls_vqa_mix_reaches_the_writer(tmp_path):
    """full.yaml's `demo.vqa_mix` (1:2:3) draws its question types through `run.write_data` (largest remainders);
    quick.yaml resets it to null (easy-VQA's own mix, mostly yes/no). Sizes shrunk to 30 train questions."""
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config
    from mindvl_ms.recipes.demo.prepare import write_data

    counts = {}
    for quick in (False, True):
        _, demo = load_demo_config(config_path(quick), str(tmp_path))
        demo["data_sizes"] = {"vqa": [30, 1], "ocr": [1, 1], "grounding": [1, 1]}
        info = write_data(demo, str(tmp_path / str(quick)), seed=0, progress=False)
        counts[quick] = Counter(_kind(_short(o)) for o in _lines(info["files"]["train"]["vqa"]))
    assert counts[False] == {"yes/no": 5, "colour": 10, "shape": 15}  # 30 x (1, 2, 3) / 6
    assert counts[True]["yes/no"] > 15  # ~73% of 30 (binomial sd ~2.4)
    # `demo.vqa_balance_yes_no` reaches the writer too: 8 yes/no questions (48 x 1 / 6), 2 per (wording, answer) cell
    _, demo = load_demo_config(config_path(False), str(tmp_path))
    demo.update(data_sizes={"vqa": [48, 1], "ocr": [1, 1], "grounding": [1, 1]}, vqa_balance_yes_no=True)
    info = write_data(demo, str(tmp_path / "balanced"), seed=0, progress=False)
    yn = [o for o in _lines(info["files"]["train"]["vqa"]) if _short(o) in ("yes", "no")]
    cells = Counter((" not " in o["messages"][0]["content"] or "\nis no " in o["messages"][0]["content"], _short(o))
                    for o in yn)
    assert len(yn) == 8 and sorted(cells.values()) == [2, 2, 2, 2]


def test_balanced_yes_no_cells(tmp_path):
    """`vqa_balance_yes_no` splits the yes/no quota equally over (negated or plain wording) x (yes, no),
    so the wording no longer predicts the answer (easy-VQA's plain wordings are mostly 'no', the negated
    ones mostly 'yes'); colour and shape quotas are unchanged; it needs a mix."""
    from mindvl_ms.recipes.demo.vqa_data import sample_questions, yes_no_cell

    assert yes_no_cell("is there not a red shape?", "yes") == "negated:yes"
    assert yes_no_cell("does the image not contain a circle?", "no") == "negated:no"
    assert yes_no_cell("is no blue shape present?", "yes") == "negated:yes"
    assert yes_no_cell("is there a triangle in the image?", "yes") == "plain:yes"
    assert yes_no_cell("is a gray shape present?", "no") == "plain:no"
    with pytest.raises(ValueError, match="needs a vqa_mix"):
        sample_questions(["yes"], 1, np.random.default_rng(0), None, ["is there a red shape?"], True)

    d = str(tmp_path / "bal")
    info = write_demo_data(d, seed=1, sizes={"vqa": (36, 5)}, progress=False,
                           vqa_mix={"yes/no": 2, "colour": 1, "shape": 1}, vqa_balance_yes_no=True)
    train = _lines(info["files"]["train"]["vqa"])
    assert Counter(_kind(_answer(o)) for o in train) == {"yes/no": 18, "colour": 9, "shape": 9}
    cells = Counter()
    for o in train:
        if _answer(o) in ("yes", "no"):
            q = o["messages"][0]["content"].split("\n", 1)[-1]
            cells[("negated" if (" not " in q or q.startswith("is no ")) else "plain", _answer(o))] += 1
    # 18 over four cells by largest remainders: 5, 5, 4, 4 (ties go to the first cells)
    assert sorted(cells.values()) == [4, 4, 5, 5] and len(cells) == 4
    assert info["vqa_balance_yes_no"] is True


def test_vqa_question_first(data, tmp_path):
    """`demo.vqa_question_first` puts every easy-VQA question before its image, in both splits: the same
    questions, answers and images as the default order (same seed), the blind baselines unchanged (the
    question template ignores where the image token sits), and the other tasks untouched."""
    from mindvl_ms.recipes.demo.prepare import write_data

    d, info = data
    demo = {"data_sizes": {k: list(v) for k, v in SIZES.items()}, "vqa_question_first": True}
    flipped = write_data(demo, str(tmp_path / "qfirst"), seed=3, progress=False)
    assert flipped["vqa_question_first"] is True and info["vqa_question_first"] is False
    for split in ("train", "heldout"):
        before, after = _lines(info["files"][split]["vqa"]), _lines(flipped["files"][split]["vqa"])
        assert len(after) == len(before) > 0
        for a, b in zip(before, after):
            q = a["messages"][0]["content"]
            assert q.startswith("<image>\n") and "<image>" not in q[len("<image>\n"):]
            assert b["messages"][0]["content"] == q[len("<image>\n"):] + "\n<image>"
            assert (b["images"], b["messages"][1:]) == (a["images"], a["messages"][1:])
        for task in ("ocr", "grounding"):
            assert _lines(flipped["files"][split][task]) == _lines(info["files"][split][task])
    assert flipped["baselines"] == info["baselines"]


def test_image_attributes_from_questions():
    """(colour, shape) per easy-VQA image from its questions: answers, the other attribute a question names,
    yes/no questions the image affirms; images with only one attribute known are left out; a conflict fails."""
    from mindvl_ms.recipes.demo.vqa_data import image_attributes

    qs = ["what color is the shape?", "is there not a circle?", "is there a red shape?", "is no rectangle present?",
          "what is the color of the triangle?", "is there a blue shape?", "what shape is present?"]
    ans = ["red", "no", "yes", "yes", "teal", "no", "circle"]
    ids = [0, 0, 1, 1, 2, 3, 3]
    # image 0: red (answer) + circle (negated, answered no); image 1: red only (a negated 'yes' affirms nothing);
    # image 2: teal + triangle (named by the colour question); image 3: circle only (a plain 'no')
    assert image_attributes(qs, ans, ids) == {0: ("red", "circle"), 2: ("teal", "triangle")}
    with pytest.raises(ValueError, match=r"easy-VQA image 0: its questions name colours \['blue', 'red'\]"):
        image_attributes(qs[:2] + ["is a blue shape present?"], ans[:2] + ["yes"], [0, 0, 0])


def test_vqa_describe(tmp_path):
    """`demo.vqa_describe` (off in full.yaml and quick.yaml): every train answer is 'a <colour> <shape>.
    <answer>', a yes/no one 'a <colour> <shape>. <word>: <yes|no, or present|absent if negated>. <answer>',
    and each agrees with easy-VQA's own answer (colour/shape questions name the described attribute; a
    yes/no answer is yes iff the image has the word the question names, XOR the wording is negated);
    held-out lines keep the short answer and carry answer_after '. ', which `mindvl eval` reads."""
    from mindvl_ms.recipes.demo.lines import answer_of
    from mindvl_ms.recipes.demo.vqa_data import VQA_WORDS
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config
    from mindvl_ms.recipes.demo.prepare import write_data

    _, quick = load_demo_config(config_path(True), str(tmp_path))
    _, demo = load_demo_config(config_path(False), str(tmp_path))
    assert not quick.get("vqa_describe") and not demo.get("vqa_describe")
    demo["vqa_describe"] = True
    demo["data_sizes"] = {"vqa": [90, 20], "ocr": [1, 1], "grounding": [1, 1]}
    demo["vqa_mix"] = {"yes/no": 1, "colour": 1, "shape": 1}
    info = write_data(demo, str(tmp_path / "d"), seed=0, progress=False)
    train = _lines(info["files"]["train"]["vqa"])
    kinds, steps = Counter(), Counter()
    for o in train:
        said, short = _answer(o), o["meta"]["short_answer"]
        colour, shape = o["meta"]["description"].split()
        assert answer_of(o) == short
        q = o["messages"][0]["content"].split("\n", 1)[1].rstrip("?")
        kind = _kind(short)
        kinds[kind] += 1
        if kind == "colour":
            assert said == f"a {colour} {shape}. {short}" and short == colour
        elif kind == "shape":
            assert said == f"a {colour} {shape}. {short}" and short == shape
        else:  # the plain wording's answer, then the answer itself
            named = [w for w in q.split() if w in VQA_WORDS]
            has = named[0] in (colour, shape)
            negated = " not " in f" {q} " or q.startswith("is no ")
            step = ("present" if has else "absent") if negated else ("yes" if has else "no")
            assert len(named) == 1 and said == f"a {colour} {shape}. {named[0]}: {step}. {short}"
            assert short == ("yes" if has != negated else "no"), o
            steps[(negated, step, short)] += 1
    assert kinds == {"yes/no": 30, "colour": 30, "shape": 30}
    # the answer is a lookup of the step's word: yes -> yes, no -> no, present -> no, absent -> yes
    assert {(st, a) for _, st, a in steps} <= {("yes", "yes"), ("no", "no"), ("present", "no"), ("absent", "yes")}
    assert {neg for neg, _, _ in steps} == {True, False}
    assert info["vqa_describe"] is True and info["baselines"]["vqa"]["answer"] in ("yes", "no")
    heldout = _lines(info["files"]["heldout"]["vqa"])
    assert all(o["answer_after"] == ". " and "." not in _answer(o) for o in heldout)
    items = load_benchmark(info["files"]["heldout"]["vqa"])
    assert [it.ref for it in items] == [{"answers": [_answer(o)], "category": "", "answer_after": ". "}
                                        for o in heldout]
    # without it, the same held-out questions and plain answers
    demo["vqa_describe"] = False
    plain = write_data(demo, str(tmp_path / "p"), seed=0, progress=False)
    assert [(o["messages"], o["images"]) for o in _lines(plain["files"]["heldout"]["vqa"])] == \
        [(o["messages"], o["images"]) for o in heldout]
    assert all("." not in _answer(o) and "short_answer" not in o["meta"]
               for o in _lines(plain["files"]["train"]["vqa"]))


class _DataWritten(Exception):
    """Raised by the stand-in writer below: run_demo stops once it has chosen the data's seed."""


@pytest.mark.parametrize("data_seed, seed, expected", [(None, 2, 2), (0, 2, 0), (5, 0, 5)])
def test_demo_data_seed_draws_the_data_whatever_the_run_seed(tmp_path, monkeypatch, data_seed, seed, expected):
    """`demo.data_seed` is the seed run_demo hands the data writer (absent: the run's `seed`), so a run with
    another `seed` and the same data_seed trains on the same files; a bad value is refused by name."""
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.recipes.demo import run as run_mod
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config

    yaml_path = tmp_path / "demo.yaml"
    extra = "" if data_seed is None else f"demo: {{data_seed: {data_seed}}}\n"
    yaml_path.write_text(f"_include_: {config_path(True)}\n{extra}")
    seen = []

    def writer(demo, data_dir, s, progress=True):
        seen.append(s)
        raise _DataWritten

    monkeypatch.setattr(run_mod, "write_data", writer)
    with pytest.raises(_DataWritten):
        run_mod.run_demo(str(tmp_path / "out"), config=str(yaml_path), overrides=[f"seed={seed}"], progress=False)
    assert seen == [expected]   # the writer is deterministic in its seed (test_deterministic_from_seed)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"_include_: {config_path(True)}\ndemo: {{data_seed: -1}}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: demo.data_seed must be an integer >= 0"):
        load_demo_config(str(bad), str(tmp_path / "data"))
