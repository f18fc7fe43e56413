"""VLMEvalKit TSV benchmarks (`mindvl eval --data BENCH.tsv`) on small hand-written files, one per style,
with the deterministic fake backend of test_benchmark.py answering per row (FakeBackend.mc_answers keyed by
the TSV index). Every expected score is worked out by hand in the comments from the metric definitions
(VLMEvalKit's can_infer, ANLS, VQA accuracy, OCRBench substring hits), not from the code under test.

Run: pytest -q tests/eval/test_tsv.py
"""
import base64
import csv
import hashlib
import io
import json
import os

import pytest
from PIL import Image

from mindvl_ms import cli
from mindvl_ms.eval import benchmark
from mindvl_ms.eval.benchmark import evaluate, load_items
from mindvl_ms.eval.resolution_search import search
from mindvl_ms.eval.tsv import load_tsv
from tests.eval.test_benchmark import FakeBackend

UNIT = 28 * 28
MCQ_TAIL = "Please select the correct answer from the options above. \n"
VQA_TAIL = "\nAnswer the question using a single word or phrase."


def _png(color, size=(56, 42)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE, GREEN = (base64.b64encode(_png(c)).decode() for c in ("red", "blue", "green"))


def _tsv(path, header, rows):
    """Rows as pandas writes them: tab-separated, quoted where a field holds a tab, newline or quote."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def _sha1_png(b64):
    return hashlib.sha1(base64.b64decode(b64)).hexdigest() + ".png"


def _fake(said):
    """The fake backend answering `said[index]` (a string) to the TSV row with that index."""
    return FakeBackend(mc_answers={k: (lambda a: lambda prompt: a)(v) for k, v in said.items()})


def _preds(out):
    return {p["id"]: p for p in map(json.loads, open(os.path.join(out, "predictions.jsonl")))}


# --------------------------------------------------------------------------------------------------
# MMBench: circular copies as rows index + k * 1e6, hint, category breakdown, image references

MMB_HEADER = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "image"]
MMB_ROWS = [
    ["0", "What animal is shown?", "", "cat", "dog", "bird", "fish", "A", "perception", RED],
    ["1", "What colour is the sign?", "Look at the sign.", "red", "green", "blue", "", "B", "perception", BLUE],
    ["2", "How many signs?", "", "one", "two", "", "", "B", "reasoning", RED],
    # the circular copies, at the end of the file as in VLMEvalKit's MMBench TSVs: options rotated, answer moved
    ["1000000", "What animal is shown?", "", "dog", "bird", "fish", "cat", "D", "perception", RED],
    ["1000001", "What colour is the sign?", "Look at the sign.", "green", "blue", "red", "", "A", "perception", "1"],
    ["2000000", "What animal is shown?", "", "bird", "fish", "cat", "dog", "C", "perception", "0"],
    ["2000001", "What colour is the sign?", "Look at the sign.", "blue", "red", "green", "", "C", "perception", "1"],
    ["3000000", "What animal is shown?", "", "fish", "cat", "dog", "bird", "B", "perception", RED],
]
MMB_SAID = {
    "0": "A",                      # the letter alone: A (right)
    "1000000": "D. cat",           # "D  cat" after VLMEvalKit's punctuation split: D (right)
    "2000000": "The answer is C",  # one option letter among the last 4 words: C (right)
    "3000000": "cat",              # no letter; the only option text it contains is B's "cat" (right)
    "1": "B",                      # right
    "1000001": "A",                # right
    "2000001": "I think it is green, not blue",  # no letter; 29 chars > 2 * (4+3+5): no text match -> wrong
    "2": "B",                      # right (a question without copies is a group of one)
}


def test_mmbench_circular_prompt_extraction_and_categories(tmp_path):
    path = _tsv(tmp_path / "MMBench_DEV_EN.tsv", MMB_HEADER, MMB_ROWS)
    items = load_tsv(path, image_dir=str(tmp_path / "img"))
    assert [it.uid for it in items] == [r[0] for r in MMB_ROWS]
    assert {it.metric for it in items} == {"circular"}
    assert [it.group for it in items] == ["0", "1", "2", "0", "1", "0", "1", "0"]
    assert items[1].messages == [{"role": "user", "content": (
        "<image>Hint: Look at the sign.\nQuestion: What colour is the sign?\nOptions:\nA. red\nB. green\nC. blue\n"
        + MCQ_TAIL)}]
    assert items[4].ref["options"] == {"A": "green", "B": "blue", "C": "red"}   # D empty: three options
    # index references ("1", "0") show that row's image; equal base64 is one file: two files for 8 rows
    assert items[4].images == items[1].images and items[5].images == items[0].images == items[2].images
    assert len(os.listdir(tmp_path / "img")) == 2

    res = evaluate(None, path, str(tmp_path / "out"), backend=_fake(MMB_SAID), min_pixels=4 * UNIT,
                   max_pixels=64 * UNIT, image_dir=str(tmp_path / "img"))
    t = res["tasks"]["MMBench_DEV_EN"]
    # groups: 0 all 4 right (hit), 1 has a wrong copy (miss), 2 right (hit) -> 2/3; rows right 7/8
    assert t["circular_accuracy"] == pytest.approx(2 / 3) and t["vanilla_accuracy"] == pytest.approx(7 / 8)
    # perception: groups 0 (hit), 1 (miss) -> 1/2, rows 6/7; reasoning: group 2 -> 1
    cat = t["by_category"]
    assert cat["perception"]["circular_accuracy"] == 0.5 and cat["perception"]["vanilla_accuracy"] == pytest.approx(6 / 7)
    assert cat["reasoning"]["circular_accuracy"] == 1.0 and cat["reasoning"]["n"] == 1
    preds = _preds(str(tmp_path / "out"))
    assert [preds[i]["choice"] for i in ("1000000", "2000000", "3000000", "2000001")] == ["D", "C", "B", None]
    assert preds["1"]["category"] == "perception" and preds["2000001"]["score"] == 0.0
    assert res["vision_encoded"] == 2    # two distinct images, whatever the number of rows

    # --limit counts questions: the first two with all their copies (the file's 3rd row is left out)
    assert [it.uid for it in load_tsv(path, limit=2, image_dir=str(tmp_path / "img"))] == \
        ["0", "1", "1000000", "1000001", "2000000", "2000001", "3000000"]
    # --metric multiple_choice: every row its own question -> 7/8
    res = evaluate(None, path, str(tmp_path / "mc"), backend=_fake(MMB_SAID), min_pixels=4 * UNIT,
                   max_pixels=64 * UNIT, metric="multiple_choice")
    assert res["tasks"]["MMBench_DEV_EN"]["multiple_choice"] == pytest.approx(7 / 8)
    assert len(os.listdir(tmp_path / "mc" / "images")) == 2      # default image dir: OUT/images


# --------------------------------------------------------------------------------------------------
# open questions: DocVQA (ANLS), TextVQA (VQA accuracy, 10 answers, image_path), OCRBench, ChartQA

def test_docvqa_anls_with_answer_lists(tmp_path):
    rows = [["d1", BLUE, "What is the title?", "['Annual Report', 'annual report 2020']"],
            ["d2", BLUE, "What is the date?", "['12/05/2019']"],
            ["d3", RED, "Who signed?", "Smith"],                    # a plain string answer
            ["d4", RED, "Which row?", "total"]]
    path = _tsv(tmp_path / "DocVQA_VAL.tsv", ["index", "image", "question", "answer"], rows)
    said = {"d1": "annual report",     # equals answer 1 after lower-casing: 1
            "d2": "12/05/2018",        # 1 edit / 10 chars: 1 - 0.1 = 0.9
            "d3": "Smyth Jones",       # "smyth jones" vs "smith": >= 6 edits / 11 chars >= 0.5: 0
            "d4": "Totals"}            # 1 edit / 6 chars: 1 - 1/6 = 5/6
    res = evaluate(None, path, str(tmp_path / "o"), backend=_fake(said), min_pixels=4 * UNIT, max_pixels=64 * UNIT)
    t = res["tasks"]["DocVQA_VAL"]
    assert t["metric"] == "anls" and t["anls"] == pytest.approx((1 + 0.9 + 0 + 5 / 6) / 4)
    preds = _preds(str(tmp_path / "o"))
    assert preds["d1"]["answers"] == ["Annual Report", "annual report 2020"] and preds["d3"]["answers"] == ["Smith"]
    assert [preds[k]["score"] for k in ("d1", "d3")] == [1.0, 0.0]
    items = load_tsv(path, image_dir=str(tmp_path / "img"))
    assert items[0].messages[0]["content"] == "<image>What is the title?" + VQA_TAIL
    # --metric exact_match: only d1 matches exactly (case and spacing aside) -> 1/4
    res = evaluate(None, path, str(tmp_path / "em"), backend=_fake(said), min_pixels=4 * UNIT,
                   max_pixels=64 * UNIT, metric="exact_match")
    assert res["tasks"]["DocVQA_VAL"] == {"exact_match": 0.25, "primary": 0.25, "n": 4, "metric": "exact_match"}


def test_textvqa_vqa_accuracy_with_image_paths(tmp_path):
    for name, color in (("sign.png", "red"), ("door.png", "blue")):
        Image.new("RGB", (60, 40), color).save(tmp_path / name)
    rows = [["t1", "sign.png", "What does the sign say?", str(["stop"] * 10)],
            ["t2", "door.png", "What is written on the door?", str(["exit"] * 2 + ["exit 12"] * 8)],
            ["t3", str(tmp_path / "sign.png"), "How many?", str(["2"] * 3 + ["3"] * 7)]]
    path = _tsv(tmp_path / "TextVQA_VAL.tsv", ["index", "image_path", "question", "answer"], rows)
    said = {"t1": "Stop.",   # -> "stop": each leave-one-out subset has 9 matches: min(1, 9/3) = 1
            "t2": "exit",    # subsets without an "exit": 2 matches (2/3) x8; without one: 1 match (1/3) x2 -> 0.6
            "t3": "two"}     # -> "2": subsets without a "2": 3 matches (1) x7; without one: 2 (2/3) x3 -> 0.9
    res = evaluate(None, path, str(tmp_path / "o"), backend=_fake(said), min_pixels=4 * UNIT, max_pixels=64 * UNIT)
    t = res["tasks"]["TextVQA_VAL"]
    assert t["metric"] == "vqa_accuracy" and t["vqa_accuracy"] == pytest.approx((1 + 0.6 + 0.9) / 3)
    assert [p["score"] for p in _preds(str(tmp_path / "o")).values()] == pytest.approx([1.0, 0.6, 0.9])
    items = load_tsv(path)
    assert items[0].images == [str(tmp_path / "sign.png")] and items[2].images == [str(tmp_path / "sign.png")]


def test_ocrbench_hits_and_category_sums(tmp_path):
    hme = "Handwritten Mathematical Expression Recognition"
    rows = [["o1", RED, "What is written?", "['STOP']", "Regular Text Recognition"],
            ["o2", RED, "What is written?", "['EXIT']", "Regular Text Recognition"],
            ["o3", BLUE, "Write the formula.", "['x^2 + 1']", hme],
            ["o4", GREEN, "What is the total?", "['42', 'forty-two']", "Doc-oriented VQA"]]
    path = _tsv(tmp_path / "OCRBench.tsv", ["index", "image", "question", "answer", "category"], rows)
    said = {"o1": "The sign says stop",   # "stop" in the lower-cased prediction: hit
            "o2": "exlt",                 # miss
            "o3": "x ^ 2 + 1",            # HME: spaces removed on both sides, "x^2+1" in "x^2+1": hit
            "o4": "It is forty-two."}     # second answer is a substring: hit
    res = evaluate(None, path, str(tmp_path / "o"), backend=_fake(said), min_pixels=4 * UNIT, max_pixels=64 * UNIT)
    t = res["tasks"]["OCRBench"]
    assert (t["metric"], t["sum"], t["accuracy"]) == ("ocrbench", 3.0, 0.75)    # 3 hits of 4
    assert {c: v["sum"] for c, v in t["by_category"].items()} == {
        "Doc-oriented VQA": 1.0, hme: 1.0, "Regular Text Recognition": 1.0}
    assert t["by_category"]["Regular Text Recognition"]["accuracy"] == 0.5
    # OCRBench's prompt is the question alone
    assert load_tsv(path, image_dir=str(tmp_path / "img"))[0].messages[0]["content"] == "<image>What is written?"


def test_chartqa_limit_borrows_an_image_outside_it(tmp_path):
    """c1 shows c2's image (a short image field names another row); with --limit 1 only c1 is a question,
    and c2's image is decoded in a second pass."""
    rows = [["c1", "c2", "What share is blue?", "12%"],
            ["c2", GREEN, "Is the trend rising?", "Yes"],
            ["c3", RED, "What is the peak?", "100"]]
    path = _tsv(tmp_path / "ChartQA_TEST.tsv", ["index", "image", "question", "answer"], rows)
    one = load_tsv(path, limit=1, image_dir=str(tmp_path / "img"))
    assert [it.uid for it in one] == ["c1"] and os.listdir(tmp_path / "img") == [os.path.basename(one[0].images[0])]
    said = {"c1": "0.121",   # 12% reads as 0.12: 0.8% off -> right
            "c2": "yes",     # not a number: case-insensitive equality -> right
            "c3": "106"}     # 6% off -> wrong
    res = evaluate(None, path, str(tmp_path / "o"), backend=_fake(said), min_pixels=4 * UNIT, max_pixels=64 * UNIT)
    assert res["tasks"]["ChartQA_TEST"]["relaxed_accuracy"] == pytest.approx(2 / 3)


def test_mmmu_image_tags_open_questions_and_splits(tmp_path):
    rows = [["m1", str([RED, BLUE]), "Compare <image 2> with <image 1>. Which is larger?", "left", "right", "B", "dev"],
            ["m2", GREEN, "What is the value?", "", "", "3.5", "validation"],
            ["m3", RED, "Is it red?", "yes", "no", "A", "validation"]]
    path = _tsv(tmp_path / "MMMU_DEV_VAL.tsv", ["index", "image", "question", "A", "B", "answer", "split"], rows)
    items = load_tsv(path, image_dir=str(tmp_path / "img"))
    # placeholder order: <image 2> (blue) first; files are named by the SHA-1 of the image bytes
    assert [os.path.basename(p) for p in items[0].images] == [_sha1_png(BLUE), _sha1_png(RED)]
    assert items[0].messages[0]["content"] == ("Question: Compare <image> with <image>. Which is larger?\nOptions:\n"
                                               "A. left\nB. right\n" + MCQ_TAIL)
    # an open question: asked without options, scored against {A: answer, B: "Other Answers"}, right choice A
    assert items[1].messages[0]["content"] == "<image>Question: What is the value?\n"
    assert (items[1].ref["options"], items[1].ref["answers"]) == ({"A": "3.5", "B": "Other Answers"}, ["A"])
    said = {"m1": "B",       # right
            "m2": "3.5",     # no letter; contains option A's text "3.5" only -> A: right
            "m3": "B"}       # wrong
    res = evaluate(None, path, str(tmp_path / "o"), backend=_fake(said), min_pixels=4 * UNIT, max_pixels=64 * UNIT)
    t = res["tasks"]["MMMU_DEV_VAL"]
    assert t["metric"] == "multiple_choice" and t["multiple_choice"] == pytest.approx(2 / 3)
    assert {s: v["primary"] for s, v in t["by_split"].items()} == {"dev": 1.0, "validation": 0.5}


# --------------------------------------------------------------------------------------------------
# bad files

def test_bad_rows_are_all_named_by_line_and_field(tmp_path):
    header = ["index", "question", "A", "B", "answer", "image"]
    rows = [["1", "ok?", "yes", "no", "A", RED],
            ["2", "too few fields"],
            ["1", "dup?", "yes", "no", "A", RED],
            ["3", "bad image?", "yes", "no", "A", "@@not base64 at all, and longer than sixty-four characters!!@@@@@"],
            ["4", "names a missing row?", "yes", "no", "A", "99"],
            ["5", "answer?", "yes", "no", "C", RED],
            ["6", "", "yes", "no", "A", RED],
            ["x7", "index?", "yes", "no", "A", RED],
            ["2000008", "copy of a missing question", "yes", "no", "A", RED],
            ["9", "no options?", "", "", "A", RED],
            ["10", "no image?", "yes", "no", "A", ""]]
    path = _tsv(tmp_path / "MMBench_bad.tsv", header, rows)
    with pytest.raises(ValueError) as e:
        load_tsv(path, image_dir=str(tmp_path / "img"))
    msg = str(e.value)
    assert msg.startswith("10 bad row(s) in ")
    for line, text in [(3, "2 fields for 6 columns"), (4, "field index: '1' already on line 2"),
                       (5, "index 3: field image: not base64"), (6, "index 4: field image: '99' names no row"),
                       (7, "index 5: field answer: 'C' is not one of the option letters AB"),
                       (8, "index 6: field question: empty"), (9, "field index: 'x7' is not an integer"),
                       (10, "index 2000008: circular copy of question 8, which has no row"),
                       (11, "index 9: fields A, B: all empty (no options)"),
                       (12, "index 10: field image: empty (no image)")]:
        assert f"MMBench_bad.tsv:{line}: {text}" in msg, (line, text, msg)

    test_split = _tsv(tmp_path / "MMBench_TEST_EN.tsv", ["index", "question", "A", "B", "image"],
                      [["1", "q", "a", "b", RED]])
    with pytest.raises(ValueError, match=r"MMBench_TEST_EN.tsv:1: missing column\(s\) answer \(a test split"):
        load_tsv(test_split)
    with pytest.raises(ValueError, match="option columns .* but --metric is 'anls'"):
        load_tsv(path, metric="anls")
    open_file = _tsv(tmp_path / "MMStar.tsv", ["index", "question", "answer", "image"], [["1", "q", "A", RED]])
    with pytest.raises(ValueError, match="MMStar is a multiple-choice benchmark .* no option columns"):
        load_tsv(open_file)


# --------------------------------------------------------------------------------------------------
# the command line and the resolution search

def test_cli_eval_on_tsv_files(tmp_path, monkeypatch, capsys):
    mmb = _tsv(tmp_path / "MMBench_DEV_EN.tsv", MMB_HEADER, MMB_ROWS)
    doc = _tsv(tmp_path / "DocVQA_VAL.tsv", ["index", "image", "question", "answer"],
               [["d1", BLUE, "What is the title?", "['Annual Report']"], ["d2", RED, "Total?", "['42']"]])
    said = dict(MMB_SAID, d1="Annual report", d2="41")   # d1: ANLS 1; d2: 1 edit / 2 chars = 0.5, not < 0.5: 0
    monkeypatch.setattr(benchmark, "load_backend", lambda ckpt, max_new_tokens=128: _fake(said))
    (tmp_path / "ck").mkdir()
    out = tmp_path / "ev"
    assert cli.main(["eval", "--ckpt", str(tmp_path / "ck"), "--data", mmb, doc, "--out", str(out),
                     "--min-pixels", str(4 * UNIT), "--max-pixels", str(64 * UNIT)]) == 0
    scores = json.load(open(out / "MMBench_DEV_EN" / "scores.json"))
    assert scores["tasks"]["MMBench_DEV_EN"]["circular_accuracy"] == pytest.approx(2 / 3)
    assert json.load(open(out / "DocVQA_VAL" / "scores.json"))["tasks"]["DocVQA_VAL"]["anls"] == 0.5
    printed = capsys.readouterr().out
    assert "MMBench_DEV_EN [circular]: 66.67" in printed and "category perception: 50.00" in printed
    assert "DocVQA_VAL [anls]: 50.00" in printed
    assert os.listdir(out / "MMBench_DEV_EN" / "images")

    assert cli.main(["eval", "--ckpt", str(tmp_path / "ck"), "--data", doc, "--out", str(tmp_path / "em"),
                     "--metric", "exact_match", "--image-dir", str(tmp_path / "shared")]) == 0
    assert json.load(open(tmp_path / "em" / "scores.json"))["tasks"]["DocVQA_VAL"]["exact_match"] == 0.5
    assert len(os.listdir(tmp_path / "shared")) == 2
    capsys.readouterr()
    bad = _tsv(tmp_path / "TextVQA_VAL.tsv", ["index", "image", "question", "answer"], [["t1", "7", "q", "a"]])
    assert cli.main(["eval", "--ckpt", str(tmp_path / "ck"), "--data", bad, "--out", str(tmp_path / "b")]) == 2
    assert "TextVQA_VAL.tsv:2: index t1: field image: '7' names no row" in capsys.readouterr().err


def test_resolution_search_reads_tsv_and_plots_the_grid(tmp_path):
    doc = _tsv(tmp_path / "DocVQA_VAL.tsv", ["index", "image", "question", "answer"],
               [["d1", BLUE, "What is the title?", "['Annual Report']"]])
    res = search([str(tmp_path / "ck")], [doc], str(tmp_path / "s"), backend_factory=lambda c: _fake({"d1": "Annual"}),
                 min_grid=[4, 16, 32], max_grid=[16, 64])
    assert len(res["rows"]) == 5                              # (32, 16) has min > max: skipped
    assert os.listdir(tmp_path / "s" / "images")              # the TSV's image decoded under --out
    png = Image.open(tmp_path / "s" / "resolution_grid.png")
    shape = json.loads(png.info["Description"])               # the grid the heatmap shows
    assert (shape["min_grid"], shape["max_grid"], shape["checkpoints"]) == ([4, 16, 32], [16, 64], ["ck"])
    assert png.size[0] >= 600 and png.size[1] >= 300
    assert load_items(doc, image_dir=str(tmp_path / "img"))[0].task == "DocVQA_VAL"


def test_metric_flag_is_the_default_of_jsonl_lines_naming_none(tmp_path):
    rows = [{"id": "a", "task": "docvqa", "answers": ["x"], "messages": [{"role": "user", "content": "q"}]},
            {"id": "b", "task": "docvqa", "metric": "anls", "answers": ["x"], "messages": [{"role": "user", "content": "q"}]}]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [it.metric for it in load_items(str(path))] == ["anls", "anls"]            # docvqa's default
    assert [it.metric for it in load_items(str(path), metric="exact_match")] == ["exact_match", "anls"]
