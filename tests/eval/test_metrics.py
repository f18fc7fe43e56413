"""Benchmark metrics on hand-computed cases (expected values worked out from the definitions).

Run: pytest -q tests/eval/test_metrics.py
"""
import pytest

from mindvl_ms.eval import metrics as M


def test_anls():
    assert M.anls("Hello  World ", ["hello world"]) == 1.0
    assert M.anls("helo", ["hello"]) == pytest.approx(0.8)           # 1 edit / 5 chars
    assert M.anls("abc", ["xyz"]) == 0.0                             # NL = 1
    assert M.anls("ab", ["abcd"]) == 0.0                             # NL = 0.5 is not < 0.5
    assert M.anls("abcde", ["abcdefgh"]) == pytest.approx(0.625)     # NL = 3/8
    assert M.anls("abc", ["zzz", "abcd"]) == pytest.approx(0.75)     # best answer: 1 edit / 4
    assert M.levenshtein("kitten", "sitting") == 3


def test_chartqa_relaxed_accuracy():
    assert M.relaxed_accuracy("10.4", ["10"]) == 1.0                 # 4% off
    assert M.relaxed_accuracy("10.6", ["10"]) == 0.0                 # 6% off
    assert M.relaxed_accuracy("9.6", ["10"]) == 1.0
    assert M.relaxed_accuracy("50%", ["0.5"]) == 1.0                 # percent reads as a fraction
    assert M.relaxed_accuracy("52%", ["50%"]) == 1.0                 # 0.52 vs 0.50: 4%
    assert M.relaxed_accuracy("53%", ["50%"]) == 0.0                 # 6%
    assert M.relaxed_accuracy("50", ["50%"]) == 0.0                  # 50 vs 0.5
    assert M.relaxed_accuracy(" Yes ", ["yes"]) == 1.0               # non-numeric: exact, case-insensitive
    assert M.relaxed_accuracy("0", ["0"]) == 1.0 and M.relaxed_accuracy("0.0", ["0"]) == 0.0  # zero target
    assert M.relaxed_accuracy("7", ["x", "7.2"]) == 1.0


def test_vqa_accuracy_official():
    answers = ["2", "2", "two", "3", "3", "3", "3", "4", "4", "4"]
    # "Two." -> "2": 3 humans agree; leave-one-out: 3 subsets with 2 matches (2/3), 7 with 3 (1) -> 0.9
    assert M.vqa_accuracy("Two.", answers) == pytest.approx(0.9)
    assert M.vqa_accuracy("3", answers) == pytest.approx(1.0)
    assert M.vqa_accuracy("5", answers) == 0.0
    one = ["yes"] + ["no"] * 9                                       # 1 match: 9 subsets 1/3, 1 subset 0
    assert M.vqa_accuracy("yes", one) == pytest.approx(0.3)
    assert M.vqa_accuracy("the dog", ["a dog", "dog"]) == pytest.approx(2 / 3)   # articles dropped
    assert M.vqa_normalize("dont") == "don't"
    assert M.vqa_normalize("yes!") == "yes"
    assert M.vqa_normalize("1,000") == "1000"
    assert M.vqa_normalize("None of the cats") == "0 of cats"
    assert M.vqa_normalize("left-hand") == "left hand"


def test_ocrbench():
    assert M.ocrbench_hit("The text says HELLO world", ["hello"]) == 1.0
    assert M.ocrbench_hit("helo", ["hello", "hi there"]) == 0.0
    assert M.ocrbench_hit("x ^ { 2 }", ["x^{2}"], category="HME100k") == 1.0
    assert M.ocrbench_hit("x ^ { 2 }", ["x^{2}"]) == 0.0
    recs = [{"score": s, "group": i} for i, s in enumerate([1.0, 0.0, 1.0])]
    agg = M.aggregate("ocrbench", recs)
    assert agg["sum"] == 2 and agg["accuracy"] == pytest.approx(2 / 3) and agg["n"] == 3


def test_multiple_choice_extraction_and_circular():
    opts = {"A": "dog", "B": "cat", "C": "bird"}
    assert M.extract_option("B", opts) == "B"
    assert M.extract_option("(C) a bird", opts) == "C"
    assert M.extract_option("The answer is A.", opts) == "A"
    assert M.extract_option("Answer: (B)", opts) == "B"
    assert M.extract_option("It is a cat", opts) == "B"              # by option text
    assert M.extract_option("A or B", opts) is None                  # ambiguous
    assert M.extract_option("no idea", opts) is None
    assert M.extract_option("D", opts) is None                       # not an option
    assert M.multiple_choice("B. cat", "B", opts) == 1.0
    assert M.multiple_choice("C", "cat", opts) == 0.0                # reference given as option text
    assert M.multiple_choice("B", "(B)", opts) == 1.0
    recs = ([{"group": "q1", "score": 1.0}] * 4 + [{"group": "q2", "score": s} for s in (1.0, 0.0, 1.0, 1.0)]
            + [{"group": "q3", "score": 1.0}] * 2)
    agg = M.aggregate("circular", recs)
    assert agg["circular_accuracy"] == pytest.approx(2 / 3)          # q2 fails one pass
    assert agg["vanilla_accuracy"] == pytest.approx(0.9) and agg["primary"] == agg["circular_accuracy"]


def test_grounding_acc_at_iou_half():
    gt = "<|box_start|>(100,100),(300,300)<|box_end|>"
    ref = {"answers": [gt]}
    hit = "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(150,100),(350,300)<|box_end|>"
    assert M.score_sample("grounding", hit, ref) == 1.0              # IoU 30000/50000 = 0.6
    assert M.score_sample("grounding", "<|box_start|>(200,100),(400,300)<|box_end|>", ref) == 0.0  # 1/3
    assert M.score_sample("grounding", "(100,100),(300,300)", ref) == 1.0   # bare coordinates
    assert M.score_sample("grounding", "there is no cat", ref) == 0.0
    assert M.grounding_hit("<|box_start|>(0,0),(100,50)<|box_end|>", (0, 0, 100, 100)) == 1.0  # IoU exactly 0.5
    assert M.parse_box("a <|box_start|>(1,2),(3,4)<|box_end|> b <|box_start|>(5,6),(7,8)<|box_end|>") == (1, 2, 3, 4)


def test_mme_acc_and_acc_plus():
    preds = [("img1", "Yes", "Yes"), ("img1", "No, it isn't", "No"), ("img2", "No", "Yes"), ("img2", "no", "No"),
             ("img3", "I think yes", "Yes"), ("img3", "maybe", "No")]
    recs = [{"group": g, "score": M.score_sample("mme", p, {"answers": [a]})} for g, p, a in preds]
    agg = M.aggregate("mme", recs)
    assert agg["acc"] == pytest.approx(4 / 6) and agg["acc_plus"] == pytest.approx(1 / 3)
    assert agg["score"] == pytest.approx(100.0) and agg["primary"] == pytest.approx(0.5)
    assert M.yes_no("Yes and no") == "yes" and M.yes_no("I can't say") is None


def test_metric_dispatch():
    assert M.metric_for("DocVQA", None) == "anls"
    assert M.metric_for("chartqa", None) == "relaxed_accuracy"
    assert M.metric_for("mybench", None) == "exact_match"
    assert M.metric_for("docvqa_val", None) == "anls" and M.metric_for("mmbench_en_dev", None) == "circular"
    assert M.metric_for("docvqa", "vqa_accuracy") == "vqa_accuracy"
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        M.metric_for(None, "bleu")
    assert M.aggregate("anls", [{"score": 1.0, "group": 0}, {"score": 0.5, "group": 1}]) == {
        "anls": 0.75, "primary": 0.75, "n": 2}


def test_can_infer_vlmevalkit_rules():
    """VLMEvalKit's rule-based extraction (vlmeval/utils/matching_util.py), each case derived by hand from it."""
    o = {"A": "cat", "B": "dog", "C": "bird"}
    assert M.can_infer("B", o) == "B"
    assert M.can_infer("The answer is (C).", o) == "C"              # "( ) ." split words; C among the last four
    assert M.can_infer("A cat", o) == "A"                            # "A" counts as a letter, even as an article
    assert M.can_infer("B is the right one because the cat sits on the mat", o) is None  # B not in the last 4
    assert M.can_infer("The answer is B, not A", o) == "B"           # two letters, then "answer is B"
    assert M.can_infer("A and B are both wrong", o) is None          # two letters; 22 chars > 2 * 10: no text
    assert M.can_infer("dog", o) == "B" and M.can_infer("cat or dog", o) is None   # option text, only if unique
    assert M.can_infer("b", o) is None                               # lower-case is no letter
    assert M.can_infer("Cannot determine the answer", o) == "Z" and M.can_infer("Z", o) == "Z"
    ref = {"answers": ["B"], "options": o, "matcher": "vlmevalkit"}
    assert M.score_sample("circular", "dog", ref) == 1.0 and M.score_sample("multiple_choice", "A", ref) == 0.0
    assert M.chosen_letter("The answer is (C).", ref) == "C"


def test_ocrbench_hme_category_names():
    # spaces removed for the handwritten-math category under both names, case kept
    for cat in ("HME100k", "Handwritten Mathematical Expression Recognition"):
        assert M.ocrbench_hit("x ^ 2 + 1", ["x^2 + 1"], cat) == 1.0
    assert M.ocrbench_hit("x ^ 2 + 1", ["x^2 + 1"], "Regular Text Recognition") == 0.0
