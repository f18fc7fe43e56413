"""Verifiable rewards against hand-computed cases (mindvl_ms/train/post/rewards.py)."""

import pytest

from mindvl_ms.train.post import rewards as R

BOX = "<|box_start|>({},{}),({},{})<|box_end|>"


def test_extract_boxed_nested_and_last():
    assert R.extract_boxed(r"so \boxed{\frac{1}{2}} hence") == r"\frac{1}{2}"
    assert R.extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert R.extract_boxed(r"\boxed{3} and \boxed{4") == "3"  # the unbalanced tail is ignored
    assert R.extract_boxed("no box") is None


def test_exact_match():
    assert R.exact_match_reward("  Hello   World. ", "hello world") == 1.0
    assert R.exact_match_reward(r"The answer is \boxed{ HELLO }", "hello") == 1.0
    assert R.exact_match_reward("hello there", "hello") == 0.0
    assert R.exact_match_reward(r"\boxed{cat} dog", "dog") == 0.0  # the boxed content is the answer


def test_boxed_format():
    assert R.boxed_format_reward(r"x = \boxed{5}") == 1.0
    assert R.boxed_format_reward(r"x = \boxed{ }") == 0.0
    assert R.boxed_format_reward(r"x = \boxed{5") == 0.0
    assert R.boxed_format_reward("x = 5") == 0.0


def test_numeric_tolerance():
    assert R.parse_number("total 1,234.5 units") == 1234.5
    assert R.parse_number("ratio 3/4") == 0.75
    assert R.parse_number("-.5") == -0.5
    assert R.parse_number("50%") == 50.0
    assert R.numeric_reward(r"\boxed{0.75}", "3/4") == 1.0
    assert R.numeric_reward("about 101", "100", rel_tol=0.01) == 1.0      # |101-100| = 1 <= 0.01*100
    assert R.numeric_reward("about 101.5", "100", rel_tol=0.01) == 0.0
    assert R.numeric_reward("0.0000005", "0", rel_tol=0.01, abs_tol=1e-6) == 1.0
    assert R.numeric_reward("no number", "3") == 0.0
    assert R.numeric_reward("1 then 2", "2") == 1.0                         # the last number counts


def test_grounding_iou_hand_computed():
    ref = BOX.format(0, 0, 100, 100)
    # intersection 50*50 = 2500, union 10000 + 10000 - 2500 = 17500
    assert R.grounding_iou_reward("the cat " + BOX.format(50, 50, 150, 150), ref) == pytest.approx(2500 / 17500)
    assert R.grounding_iou_reward(BOX.format(0, 0, 100, 100), ref) == 1.0
    assert R.grounding_iou_reward(BOX.format(200, 200, 300, 300), ref) == 0.0
    assert R.grounding_iou_reward("no box here", ref) == 0.0
    assert R.grounding_iou_reward(BOX.format(100, 100, 50, 50), ref) == 0.0  # malformed box (x2 < x1) is no box
    with pytest.raises(ValueError, match="reference"):
        R.grounding_iou_reward(ref, "no box")


def test_callable_from_yaml_name(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def length_reward(response, answer):\n"
                                           "    return min(len(response), len(answer)) / max(len(answer), 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    v = R.Verifier(accuracy="my_reward:length_reward")
    assert v("ab", "abcd") == 0.5
    with pytest.raises(ValueError, match="cannot import"):
        R.resolve_reward("my_reward:nope")
    with pytest.raises(ValueError, match="unknown reward"):
        R.resolve_reward("exact")


def test_verifier_combines_accuracy_and_format():
    v = R.Verifier(accuracy="exact_match", accuracy_weight=1.0, format_weight=0.5)
    assert v(r"\boxed{7}", "7") == 1.5
    assert v("7", "7") == 1.0
    assert v(r"\boxed{8}", "7") == 0.5
    assert v(r"\boxed{7.001}", "7", reward="numeric") == 1.5     # a line's own verifier replaces the default
    tight = R.Verifier(accuracy="numeric", rel_tol=1e-5, abs_tol=0.0)
    assert tight("7.001", "7") == 0.0
