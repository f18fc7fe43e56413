"""research/common.py's table writer: mean ± sample sd over seeds and the seed-spread verdict."""
import math

import pytest

from tests.research.helpers import load

common = load("common.py", "research_common")


def test_mean_sd_is_the_sample_sd():
    m, sd = common.mean_sd([0.1, 0.2, 0.6])
    assert math.isclose(m, 0.3)
    assert math.isclose(sd, math.sqrt(((0.2) ** 2 + 0.1 ** 2 + 0.3 ** 2) / 2))   # ddof=1 by hand: 0.2646
    assert common.mean_sd([0.5]) == (0.5, None)
    assert common.fmt([0.1, 0.2, 0.6]) == "30.0 ± 26.5"
    assert common.fmt([0.5]) == "50.0"


def test_verdict_needs_the_means_apart_by_more_than_both_sds():
    assert common.verdict([0.50, 0.52, 0.54], [0.40, 0.42, 0.44]) == "exceeds the seed spread"  # 0.10 > 0.04
    assert common.verdict([0.50, 0.60, 0.70], [0.40, 0.50, 0.60]) == "within the seed spread"   # 0.10 < 0.20
    assert common.verdict([0.3, 0.3, 0.3], [0.3, 0.3, 0.3]) == "within the seed spread"         # identical
    assert common.verdict([0.3, 0.3], [0.2, 0.2]) == "exceeds the seed spread"                  # sd 0, apart
    assert common.verdict([0.3], [0.2]) == "untestable (one seed)"


def test_arms_table_and_effect_sentence():
    arms = {"a": {"vqa": [0.5, 0.52, 0.54], "average": [0.5, 0.52, 0.54]},
            "b": {"vqa": [0.4, 0.42, 0.44], "average": [0.4, 0.42, 0.44]},
            "c": {"vqa": [0.45, 0.55, 0.65], "average": [0.45, 0.55, 0.65]}}
    table = common.arms_table(arms, ["vqa", "average"], ["VQA", "average"], reference="a")
    lines = table.splitlines()
    assert lines[0] == "| arm | VQA | average | average: vs a |"
    assert lines[2] == "| a | 52.0 ± 2.0 | 52.0 ± 2.0 | - |"
    assert lines[3] == "| b | 42.0 ± 2.0 | 42.0 ± 2.0 | exceeds the seed spread |"
    assert lines[4] == "| c | 55.0 ± 10.0 | 55.0 ± 10.0 | within the seed spread |"
    assert common.effect_sentence(arms, "a") == "Effect vs a on average: exceeds the seed spread for b."
    same = {k: arms[k] for k in ("a", "c")}
    assert "no arm differs beyond the seed spread (3 seeds" in common.effect_sentence(same, "a")
    one = {"a": {"average": [0.5]}, "b": {"average": [0.1]}}
    assert common.effect_sentence(one, "a") == "Effect vs a: untestable with one seed."


def test_results_md_starts_with_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "commit", lambda: "abc1234")
    monkeypatch.setattr(common, "source_hash", lambda *a: "f" * 64)
    common.save(str(tmp_path), {"seeds": [0, 1, 2]}, "| x |\n|---|\n| 1 |")
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("Made at commit abc1234 (source hash ffffffffffff), seeds [0, 1, 2]")
    assert '"commit": "abc1234"' in (tmp_path / "results.json").read_text()


def test_train_views_evaluates_after_each_step_that_crosses_a_multiple_of_every():
    steps = []
    curve = common.train_views(lambda: steps.append(1), lambda seen: {"acc": seen / 1000}, views=100, every=40)
    # seen after each step of 32: 32, 64 (crosses 40), 96 (crosses 80), 128 (crosses 120; >= 100 ends)
    assert len(steps) == 4
    assert curve == [{"views": 64, "acc": 0.064}, {"views": 96, "acc": 0.096}, {"views": 128, "acc": 0.128}]
    assert common.first_at(curve, "acc", 0.09) == 96
    assert common.first_at(curve, "acc", 0.5) is None


def test_a_views_count_below_one_evaluation_is_refused_by_name():
    assert common.check_views(2000, 2000) == 2000
    with pytest.raises(SystemExit, match=r"--views 100: need at least 2,000"):
        common.check_views(100, 2000)


def test_blind_rows_give_each_task_and_the_vqa_question_prior():
    base = {"baselines": {"vqa": {"score": 0.036, "question_prior": 0.666}, "ocr": {"score": 0.02},
                          "grounding": {"score": 0.11}}}
    rows = common.blind_rows(base, ("vqa", "ocr", "grounding")).splitlines()
    assert rows == ["| blind baseline | 3.6 | 2.0 | 11.0 | | |",
                    "| VQA question prior (image-blind) | 66.6 |  |  | | |"]
    no_prior = {"baselines": {"ocr": {"score": 0.5}}}
    assert common.blind_rows(no_prior, ("ocr",), trailing=1) == "| blind baseline | 50.0 | |\n"
