"""`mindvl demo --seeds`: the per-seed table against hand-computed values, and the command's argument handling
with the demo itself replaced by a stand-in (no training here).

    python -m pytest -q tests/recipes/test_demo_seeds.py      # seconds
"""
import contextlib
import io
import json
import math
import os

import pytest

from mindvl_ms.cli import main
from mindvl_ms.recipes.demo import seeds as seeds_mod
from mindvl_ms.recipes.demo.seeds import format_seed_table, seed_table


def _report(ocr, grounding, vqa, colour, shape, yes_no, wall_s, priors=(0.8, 0.1, 0.3), ns=(300, 100, 100)):
    """A demo report (`run.run_demo`) carrying only what the table reads."""
    types = ("yes/no", "colour", "shape")
    return {"scores": {"sft_256": {"ocr": 0.0}, "merged": {"vqa": vqa, "ocr": ocr, "grounding": grounding}},
            "vqa_by_type": {"merged": {"yes/no": yes_no, "colour": colour, "shape": shape}},
            "baselines": {"vqa": {"question_prior": 0.56,
                                  "by_type": {t: {"n": n, "question_prior": p} for t, n, p in zip(types, ns, priors)}}},
            "wall_time_s": {"total": wall_s}}


# seed 0 meets every target; seed 1 misses OCR, shape and easy-VQA (14 points over its prior), and meets colour
# exactly on its target (95.0)
REPORTS = {0: _report(0.99, 0.95, 0.75, 1.0, 0.80, 0.80, 1200.0),
           1: _report(0.60, 0.92, 0.70, 0.95, 0.50, 0.78, 1500.0)}


def test_rows_priors_and_missed_targets():
    t = seed_table(REPORTS)
    r0, r1 = t["rows"][0], t["rows"][1]
    # prior: (300 x 0.8 + 100 x 0.1 + 100 x 0.3) / 500 = 280 / 500 = 56.0%
    assert r0["vqa_prior"] == pytest.approx(56.0) and r1["vqa_prior"] == pytest.approx(56.0)
    assert r0["vqa_margin"] == pytest.approx(19.0) and r1["vqa_margin"] == pytest.approx(14.0)
    assert r0["ocr"] == pytest.approx(99.0) and r1["grounding"] == pytest.approx(92.0)
    assert r1["colour"] == pytest.approx(95.0) and r0["shape"] == pytest.approx(80.0)
    assert r0["yes_no"] == pytest.approx(80.0) and r0["yes_no_prior"] == pytest.approx(80.0)
    assert r0["wall_min"] == pytest.approx(20.0) and r1["wall_min"] == pytest.approx(25.0)
    assert t["missed"] == {0: [], 1: ["ocr", "shape", "vqa"]}


def test_mean_sd_min_over_seeds():
    s = seed_table(REPORTS)["summary"]
    # OCR 99 and 60: mean 79.5, sd (n - 1) sqrt(2 x 19.5^2) = 19.5 x sqrt(2), min 60
    assert s["mean"]["ocr"] == pytest.approx(79.5)
    assert s["sd"]["ocr"] == pytest.approx(19.5 * math.sqrt(2))
    assert s["min"]["ocr"] == pytest.approx(60.0)
    assert s["mean"]["shape"] == pytest.approx(65.0) and s["sd"]["shape"] == pytest.approx(15 * math.sqrt(2))
    assert s["mean"]["vqa_margin"] == pytest.approx(16.5) and s["min"]["vqa_margin"] == pytest.approx(14.0)
    assert s["mean"]["wall_min"] == pytest.approx(22.5) and s["sd"]["vqa_prior"] == pytest.approx(0.0)
    one = seed_table({3: REPORTS[0]})["summary"]
    assert math.isnan(one["sd"]["ocr"]) and one["mean"]["ocr"] == pytest.approx(99.0)


def test_printed_table():
    text = format_seed_table(seed_table(REPORTS))
    lines = text.splitlines()
    row0 = next(x for x in lines if x.startswith("  0 "))
    row1 = next(x for x in lines if x.startswith("  1 "))
    assert row0.split() == ["0", "99.0", "95.0", "100.0", "80.0", "75.0", "56.0", "19.0", "80.0", "80.0", "20.0",
                            "none", "(all", "met)"]
    assert row1.split()[1:11] == ["60.0", "92.0", "95.0", "50.0", "70.0", "56.0", "14.0", "78.0", "80.0", "25.0"]
    assert row1.endswith("OCR, shape, easy-VQA")
    assert next(x for x in lines if x.startswith("  min")).split()[1] == "60.0"
    assert "seeds meeting every target: 1 of 2 (0)" in text
    assert "- " in next(x for x in format_seed_table(seed_table({3: REPORTS[0]})).splitlines()
                        if x.startswith("  sd"))


@pytest.fixture
def fake_demo(monkeypatch):
    """run_demo replaced: records each call, returns seed s's report from REPORTS (seed 2: seed 0's)."""
    calls = []

    def run_demo(out_dir, quick=False, config=None, overrides=None, progress=True):
        calls.append({"out": out_dir, "quick": quick, "config": config, "overrides": list(overrides),
                      "progress": progress})
        seed = int(overrides[-1].split("=")[1])
        return REPORTS.get(seed, REPORTS[0])
    monkeypatch.setattr(seeds_mod, "run_demo", run_demo)
    return calls


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_runs_each_seed_into_its_directory(fake_demo, tmp_path):
    out = str(tmp_path / "runs")
    code, stdout, _ = _cli(["demo", "--seeds", "0", "1", "--out", out, "--quick", "--set", "stages.1.max_steps=3",
                            "--no-progress"])
    assert code == 0
    assert fake_demo == [{"out": os.path.join(out, f"seed_{s}"), "quick": True, "config": None,
                          "overrides": ["stages.1.max_steps=3", f"seed={s}"], "progress": False} for s in (0, 1)]
    assert "seeds meeting every target: 1 of 2 (0)" in stdout
    with open(os.path.join(out, "seeds.json")) as f:
        saved = json.load(f)
    assert saved["seeds"] == [0, 1] and saved["missed"] == {"0": [], "1": ["ocr", "shape", "vqa"]}
    assert saved["rows"]["1"]["vqa_margin"] == pytest.approx(14.0)


def test_cli_seed_order_and_config_pass_through(fake_demo, tmp_path):
    code, _, _ = _cli(["demo", "--seeds", "2", "0", "--out", str(tmp_path), "--config", "x.yaml"])
    assert code == 0
    assert [c["out"] for c in fake_demo] == [str(tmp_path / "seed_2"), str(tmp_path / "seed_0")]
    assert {c["config"] for c in fake_demo} == {"x.yaml"} and fake_demo[0]["progress"] is True


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1", "1"], "a seed is repeated"),
    (["--seeds", "0", "-1"], "seeds are >= 0"),
    (["--seeds", "0", "--set", "seed=3"], "--set seed=... and --seeds both set the seed"),
    (["--seeds", "0", "--post-train"], "not --seeds"),
])
def test_cli_rejects_with_one_line(fake_demo, tmp_path, argv, message):
    code, _, err = _cli(["demo", "--out", str(tmp_path)] + argv)
    assert code == 2 and fake_demo == []
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--seeds"], ["--seeds", "one"]])
def test_cli_seeds_need_integers(fake_demo, argv):
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()):
        main(["demo"] + argv)
    assert e.value.code == 2 and fake_demo == []
