"""Benchmark runner and resolution search with a deterministic fake generation backend.

The fake "reads" an image only inside an area window per image (READ_WINDOW), so every score of the
min/max-pixels grid is known in advance: the expected values are derived here from transformers'
`smart_resize` (an independent implementation of the resize rule) and the window, not from the code
under test. The fake also records what it generated and encoded, so the caches can be checked.

Run: pytest -q tests/eval/test_benchmark.py
"""
import json
import os

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from mindvl_ms import cli
from mindvl_ms.eval import benchmark
from mindvl_ms.eval import resolution_search
from mindvl_ms.eval.resolution_search import search
from mindvl_ms.eval.benchmark import evaluate, load_benchmark, resolve_pixels
from tests.support.paths import ROOT

UNIT = 28 * 28
SIZES = {"small.png": (60, 40), "medium.png": (400, 300), "large.png": (2000, 1500)}  # (width, height)
TEXT = {"small.png": "STOP", "medium.png": "EXIT 12", "large.png": "quarterly revenue"}
READ_WINDOW = {"small.png": (16 * UNIT, None), "medium.png": (None, None), "large.png": (None, 2560 * UNIT)}


class FakeBackend:
    """generate(samples) -> answers; encode_images([(path, h, w), ...]) -> features. Records every call."""

    def __init__(self, window=None, mc_answers=None):
        self.window = dict(READ_WINDOW, **(window or {}))
        self.mc_answers = mc_answers or {}
        self.encoded, self.generated, self.batches, self.calls = [], [], [], []

    def encode_images(self, requests):
        self.calls.append(len(requests))
        out = []
        for path, h, w in requests:
            self.encoded.append((os.path.basename(path), h, w))
            arr = np.asarray(Image.open(path).convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.float32)
            out.append({"path": path, "hw": (h, w), "mean": float(arr.mean())})
        return out

    def readable(self, name, hw):
        lo, hi = self.window[name]
        return (lo is None or hw[0] * hw[1] >= lo) and (hi is None or hw[0] * hw[1] <= hi)

    def generate(self, samples):
        self.batches.append(len(samples))
        out = []
        for s in samples:
            self.generated.append((s["id"], tuple(map(tuple, s["image_hw"]))))
            for p, hw, feat in zip(s["images"], s["image_hw"], s["image_features"]):
                assert feat["path"] == p and feat["hw"] == tuple(hw), "features of another image or size"
            qid = s["id"].split("#")[0]
            if qid in self.mc_answers:
                out.append(self.mc_answers[qid](s["messages"][-1]["content"]))
            else:
                name = os.path.basename(s["images"][0])
                out.append(TEXT[name] if self.readable(name, s["image_hw"][0]) else "???")
        return out


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture
def bench(tmp_path):
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
    ocr = [{"id": f"ocr-{n}", "images": [n], "task": "ocr_demo", "metric": "anls",
            "messages": [{"role": "user", "content": "<image>\nWhat is written?"},
                         {"role": "assistant", "content": TEXT[n]}]} for n in ("small.png", "medium.png")]
    doc = [{"id": f"doc-{i}", "images": ["large.png"], "image_sizes": [[2000, 1500]], "task": "docvqa",
            "answers": [TEXT["large.png"], "revenue"],
            "messages": [{"role": "user", "content": f"<image>\nQuestion {i}?"}]} for i in range(2)]
    return tmp_path, _jsonl(tmp_path / "ocr.jsonl", ocr), _jsonl(tmp_path / "doc.jsonl", doc)


def test_evaluate_scores_predictions_and_vision_cache(bench):
    root, ocr, doc = bench
    fake = FakeBackend()
    lo, hi = 16 * UNIT, 8192 * UNIT
    res = evaluate(None, ocr, str(root / "o1"), backend=fake, min_pixels=lo, max_pixels=hi)
    hw_small = hf_smart_resize(40, 60, 28, lo, hi)                    # upscaled to >= 16 units: readable
    assert res["tasks"]["ocr_demo"] == {"anls": 1.0, "primary": 1.0, "n": 2, "metric": "anls"}
    preds = [json.loads(x) for x in open(root / "o1" / "predictions.jsonl")]
    assert [p["prediction"] for p in preds] == ["STOP", "EXIT 12"]
    assert preds[0]["image_hw"] == [list(hw_small)] and preds[0]["line"] == 1
    assert json.load(open(root / "o1" / "scores.json"))["average"] == 1.0
    assert fake.calls == [2]                                            # the batch's two images: one call

    fake = FakeBackend()
    res = evaluate(None, doc, str(root / "o2"), backend=fake, min_pixels=lo, max_pixels=hi, batch_size=1)
    h, w = hf_smart_resize(1500, 2000, 28, lo, hi)
    assert h * w > 2560 * UNIT                                          # too large for the fake: wrong
    assert res["tasks"]["docvqa"]["anls"] == 0.0 and res["tasks"]["docvqa"]["metric"] == "anls"
    assert fake.encoded == [("large.png", h, w)]                        # shared image encoded once
    assert (res["vision_encoded"], res["vision_reused"], fake.batches) == (1, 1, [1, 1])
    res = evaluate(None, doc, str(root / "o3"), backend=FakeBackend(), min_pixels=lo, max_pixels=2048 * UNIT)
    assert res["tasks"]["docvqa"]["anls"] == 1.0


def test_vision_cache_keys_and_memory_bound():
    calls = []

    def enc(reqs):  # 4000 bytes each
        calls.append(list(reqs))
        return [np.zeros(1000, np.float32) for _ in reqs]

    cache = benchmark.VisionCache(max_bytes=2 * 4000)
    for p, hw in [("a", (28, 56)), ("a", (28, 56)), ("a", (56, 56)), ("b", (28, 56)), ("a", (28, 56))]:
        assert cache.get_many([(p, hw)], enc)[0].nbytes == 4000
    # ("a",28,56) was evicted when ("b",28,56) arrived (least recently used, bound of two entries)
    assert calls == [[("a", 28, 56)], [("a", 56, 56)], [("b", 28, 56)], [("a", 28, 56)]]
    assert (cache.hits, cache.misses, cache.nbytes) == (1, 4, 8000)


def test_vision_cache_encodes_a_batchs_new_images_in_one_call():
    calls = []

    def enc(reqs):
        calls.append(list(reqs))
        return [np.full(2, 10 * h + w, np.float32) for _, h, w in reqs]

    cache = benchmark.VisionCache(max_bytes=3 * 8)
    cache.get_many([("a", (1, 1))], enc)
    out = cache.get_many([("b", (2, 2)), ("a", (1, 1)), ("b", (2, 2)), ("c", (3, 1)), ("d", (1, 2))], enc)
    assert calls == [[("a", 1, 1)], [("b", 2, 2), ("c", 3, 1), ("d", 1, 2)]]  # each distinct miss once
    assert [float(f[0]) for f in out] == [22.0, 11.0, 22.0, 31.0, 12.0]      # in the order asked
    assert (cache.hits, cache.misses) == (2, 4)
    # bound applied after the batch: four entries of 8 bytes over a 24-byte bound drop the oldest, "a"
    assert list(cache.store) == [("b", 2, 2), ("c", 3, 1), ("d", 1, 2)] and cache.nbytes == 24
    with pytest.raises(RuntimeError, match="2 features for 1 images"):
        cache.get_many([("e", (1, 1))], lambda reqs: [np.zeros(2)] * 2)


def test_pixel_limits_precedence(tmp_path):
    assert resolve_pixels(None) == (56 * 56, 1280 * UNIT, "defaults")
    with open(tmp_path / "preprocessor_config.json", "w") as f:
        json.dump({"min_pixels": 3136, "max_pixels": 100 * UNIT}, f)
    assert resolve_pixels(str(tmp_path))[:2] == (3136, 100 * UNIT)
    with open(tmp_path / "inference_config.json", "w") as f:
        json.dump({"min_pixels": 4 * UNIT, "max_pixels": 4096 * UNIT}, f)
    assert resolve_pixels(str(tmp_path)) == (4 * UNIT, 4096 * UNIT, str(tmp_path / "inference_config.json"))
    assert resolve_pixels(str(tmp_path), max_pixels=2048 * UNIT) == (4 * UNIT, 2048 * UNIT, "command line")
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        resolve_pixels(None, 5000, 4000)


def test_circular_multiple_choice_and_mme(bench):
    root = bench[0]
    opts = {"A": "dog", "B": "cat", "C": "bird"}
    mm = [{"id": "q1", "task": "mmbench", "images": ["small.png"], "options": opts, "answers": ["B"],
           "messages": [{"role": "user", "content": "<image>\nWhich animal?"}]},
          {"id": "q2", "task": "mmbench", "images": ["small.png"], "options": opts, "answers": ["bird"],
           "messages": [{"role": "user", "content": "<image>\nWhich bird-like animal?"}]},
          {"id": "m1", "task": "mme", "images": ["medium.png"], "answers": ["Yes"],
           "messages": [{"role": "user", "content": "<image>\nIs there a sign?"}]},
          {"id": "m2", "task": "mme", "images": ["medium.png"], "answers": ["No"],
           "messages": [{"role": "user", "content": "<image>\nIs there a cat?"}]}]
    path = _jsonl(root / "mixed.jsonl", mm)
    items = load_benchmark(path)
    assert [it.uid for it in items] == ["q1#0", "q1#1", "q1#2", "q2#0", "q2#1", "q2#2", "m1", "m2"]
    assert items[1].messages[-1]["content"] == ("<image>\nWhich animal?\nA. cat\nB. bird\nC. dog\n"
                                                "Answer with the option's letter from the given choices directly.")
    assert [it.ref["answers"][0] for it in items[:6]] == ["B", "A", "C", "C", "B", "A"]
    plain = dict(mm[0], id="p1", task="quiz")  # options without a metric: one multiple-choice pass
    one = load_benchmark(_jsonl(root / "plain.jsonl", [plain]))
    assert [(it.uid, it.metric, it.ref["answers"]) for it in one] == [("p1", "multiple_choice", ["B"])]
    with pytest.raises(ValueError, match="options given but metric is 'anls'"):
        load_benchmark(_jsonl(root / "bad_mc.jsonl", [dict(plain, metric="anls")]))

    def pick_cat(prompt):  # always the letter whose option is "cat": right on every pass
        return next(line[0] for line in prompt.splitlines() if line.endswith(". cat"))
    fake = FakeBackend(mc_answers={"q1": pick_cat, "q2": lambda p: "A", "m1": lambda p: "Yes.",
                                   "m2": lambda p: "Yes, there is"})
    res = evaluate(None, path, str(root / "o"), backend=fake, min_pixels=4 * UNIT, max_pixels=1280 * UNIT)
    mmb = res["tasks"]["mmbench"]
    assert mmb["circular_accuracy"] == 0.5 and mmb["vanilla_accuracy"] == pytest.approx(4 / 6)  # q2 right once
    mme = res["tasks"]["mme"]
    assert (mme["acc"], mme["acc_plus"], mme["score"]) == (0.5, 0.0, 50.0)
    assert res["vision_encoded"] == 2 and res["vision_reused"] == 6     # two distinct images, 8 requests


def test_bad_lines_are_all_reported(tmp_path):
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}
    rows = [good, "{not json", "", {"id": "b", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "c", "images": ["x.png"], "answers": ["y"], "messages": [{"role": "user", "content": "no ph"}]},
            {"id": "d", "answer": "typo", "messages": [{"role": "user", "content": "q"}]},
            {"id": "e", "task": "refcoco", "answers": ["no box here"], "messages": [{"role": "user", "content": "q"}]},
            {"id": "f", "metric": "bleu", "answers": ["y"], "messages": [{"role": "user", "content": "q"}]},
            good,
            {"id": "g", "images": ["x.png"], "image_sizes": [[640]], "answers": ["y"],
             "messages": [{"role": "user", "content": "<image>q"}]}]
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as e:
        load_benchmark(path)
    msg = str(e.value)
    assert msg.startswith("9 bad line(s)")
    for n, text in [(2, "Expecting"), (3, "blank line"), (4, "no reference"), (5, "placeholder"),
                    (6, "no reference: give an 'answers' list or an assistant turn (unknown fields kept as metadata: answer)"), (7, "holds no box"), (8, "unknown metric 'bleu'"),
                    (9, "duplicate id 'a'"), (10, "image_sizes: expected 1 [width, height]")]:
        assert f"bad.jsonl:{n}: " in msg and text in msg, (n, text)


def _expected_rows(fake, settings):
    """Per (min, max): scores of both benchmarks from the fake's read window and HF smart_resize."""
    out = {}
    for lo, hi in settings:
        ok = {n: fake.readable(n, hf_smart_resize(h, w, 28, lo, hi)) for n, (w, h) in SIZES.items()}
        out[(lo, hi)] = {"ocr_demo": (ok["small.png"] + ok["medium.png"]) / 2, "docvqa": float(ok["large.png"])}
    return out


def test_resolution_search_table_best_plot_cache_and_save(bench):
    root, ocr, doc = bench
    ck_a, ck_b = root / "merged", root / "sft_2k"
    ck_a.mkdir()
    ck_b.mkdir()
    fakes = {str(ck_a): FakeBackend(), str(ck_b): FakeBackend(window={"large.png": (None, 1280 * UNIT)})}
    mins, maxs = [4, 16, 64], [1280, 2560, 4096, 8192]
    res = search([str(ck_a), str(ck_b)], [ocr, doc], str(root / "search"), backend_factory=fakes.__getitem__,
                 min_grid=mins, max_grid=maxs, save=True)
    settings = [(a * UNIT, b * UNIT) for a in mins for b in maxs]
    for ck, fake in fakes.items():
        exp = _expected_rows(fake, settings)
        rows = [r for r in res["rows"] if r["checkpoint"] == ck]
        assert [(r["min_pixels"], r["max_pixels"]) for r in rows] == settings
        assert {(r["min_pixels"], r["max_pixels"]): r["scores"] for r in rows} == exp
        for task in ("ocr_demo", "docvqa"):  # best: highest score, first grid setting on ties
            top = max(settings, key=lambda s: exp[s][task])
            assert (res["best"][ck]["per_task"][task]["min_pixels"], res["best"][ck]["per_task"][task]["max_pixels"]) == top
        top = max(settings, key=lambda s: sum(exp[s].values()))
        assert (res["best"][ck]["average"]["min_pixels"], res["best"][ck]["average"]["max_pixels"]) == top
        # caching: each (sample, resized sizes) generated once; each (image, size) encoded once
        name_of = {"ocr-small.png": "small.png", "ocr-medium.png": "medium.png", "doc-0": "large.png",
                   "doc-1": "large.png"}
        want = {(u, (hf_smart_resize(SIZES[n][1], SIZES[n][0], 28, lo, hi),))
                for lo, hi in settings for u, n in name_of.items()}
        assert len(fake.generated) == len(set(fake.generated)) and set(fake.generated) == want
        want_enc = {(name_of[u], *hw[0]) for u, hw in want}
        assert sorted(fake.encoded) == sorted(want_enc)
        assert res["caching"][ck]["generated"] + res["caching"][ck]["reused"] == 4 * len(settings)
        saved = json.load(open(os.path.join(ck, "inference_config.json")))
        assert (saved["min_pixels"], saved["max_pixels"]) == top
    assert res["best"][str(ck_a)]["average"]["score"] == 1.0           # min >= 16 and max <= 2560
    table = open(root / "search" / "resolution_table.md").read()
    assert table.count("\n| merged |") == len(settings) and "docvqa" in table.splitlines()[0]
    png = Image.open(root / "search" / "resolution_grid.png")
    assert png.size[0] > 300 and png.size[1] > 200
    # eval now uses the saved setting by default
    res_eval = evaluate(str(ck_a), ocr, str(root / "e"), backend=FakeBackend())
    assert res_eval["pixels_from"].endswith("inference_config.json") and res_eval["average"] == 1.0


def test_search_reuses_an_evaluations_answers_of_the_same_file_only(bench):
    """An `evaluate` that fills a pred_cache, then a `search` of the same backend given that cache: the settings
    that resize the file's images as the evaluation did generate nothing (the evaluation's answers stand), the
    table equals a search without the cache, and answers of another file with the same ids are not taken."""
    root, ocr, _ = bench
    mins, maxs = [4, 16], [1280, 2048]
    cold_fake = FakeBackend()
    cold = search([str(root)], [ocr], str(root / "cold"), backend_factory=lambda c: cold_fake, min_grid=mins,
                  max_grid=maxs, plot=False, progress=False)
    fake, answers = FakeBackend(), {}
    evaluate(None, ocr, str(root / "ev"), backend=fake, min_pixels=16 * UNIT, max_pixels=1280 * UNIT,
             pred_cache=answers)
    assert len(answers) == 2 and len(fake.generated) == 2
    warm = search([str(root)], [ocr], str(root / "warm"), backend_factory=lambda c: fake, min_grid=mins,
                  max_grid=maxs, plot=False, progress=False, pred_caches={str(root): answers})
    assert [(r["min_pixels"], r["max_pixels"], r["scores"]) for r in warm["rows"]] == \
        [(r["min_pixels"], r["max_pixels"], r["scores"]) for r in cold["rows"]]
    evaluated = {(u, hw) for u, hw in fake.generated[:2]}
    assert not evaluated & set(fake.generated[2:])                     # nothing the evaluation answered again
    assert set(fake.generated[2:]) == set(cold_fake.generated) - evaluated
    assert warm["caching"][str(root)]["generated"] == len(cold_fake.generated) - 2
    # the same ids in another file: that file's answers are its own
    other = _jsonl(root / "other.jsonl", [json.loads(x) for x in open(ocr)])
    theirs = {}
    evaluate(None, other, str(root / "ev2"), backend=FakeBackend(), min_pixels=16 * UNIT, max_pixels=1280 * UNIT,
             pred_cache=theirs)
    fresh = FakeBackend()
    res = search([str(root)], [ocr], str(root / "x"), backend_factory=lambda c: fresh, min_grid=[16],
                 max_grid=[1280], plot=False, progress=False, pred_caches={str(root): theirs})
    assert res["caching"][str(root)]["reused"] == 0 and len(fresh.generated) == 2


def test_cli_eval_and_search(bench, monkeypatch, capsys):
    """Also: both commands load the model in graph mode, whatever mode the process was in (MindSpore's
    default is PyNative, op by op, far slower for `mindvl eval`: docs/PERFORMANCE.md, ## infer)."""
    import mindspore as ms

    root, ocr, doc = bench
    modes = []

    def fake_load(ckpt, max_new_tokens=128):
        modes.append(ms.get_context("mode"))
        return FakeBackend()

    monkeypatch.setattr(benchmark, "load_backend", fake_load)
    monkeypatch.setattr(resolution_search, "load_backend", fake_load)
    (root / "ck").mkdir()
    try:
        ms.set_context(mode=ms.PYNATIVE_MODE)
        assert cli.main(["eval", "--ckpt", str(root / "ck"), "--data", ocr, doc, "--out", str(root / "ev"),
                         "--min-pixels", str(16 * UNIT), "--max-pixels", str(2048 * UNIT)]) == 0
        ms.set_context(mode=ms.PYNATIVE_MODE)
        assert cli.main(["search-resolution", "--ckpt", str(root / "ck"), "--data", ocr, "--out", str(root / "s"),
                         "--min-grid", "4", "16", "--max-grid", "1280", "--no-plot"]) == 0
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert modes == [ms.GRAPH_MODE, ms.GRAPH_MODE]
    assert json.load(open(root / "ev" / "doc" / "scores.json"))["tasks"]["docvqa"]["anls"] == 1.0
    out = capsys.readouterr().out
    assert "ocr_demo: best 100.0 at min 16, max 1280" in out
    assert not os.path.exists(root / "s" / "resolution_grid.png")
    _jsonl(root / "broken.jsonl", ["{"])
    assert cli.main(["eval", "--ckpt", str(root / "ck"), "--data", str(root / "broken.jsonl"),
                     "--out", str(root / "ev_broken")]) == 2
    assert "broken.jsonl:1:" in capsys.readouterr().err


def test_search_on_tiny_model_writes_table_and_plot(tmp_path):
    """The real generation backend (tiny random MindVL): one image, two max_pixels settings."""
    from mindvl_ms.config import load_model_config
    from mindvl_ms import MindVLForConditionalGeneration

    root = ROOT
    MindVLForConditionalGeneration(load_model_config(os.path.join(root, "configs", "model", "tiny.yaml"))) \
        .save_pretrained(str(tmp_path / "tiny"))
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (150, 200, 3), dtype=np.uint8)).save(tmp_path / "b.png")
    data = _jsonl(tmp_path / "ocr.jsonl", [{"id": "1", "images": ["b.png"], "task": "ocr", "metric": "ocrbench",
                                           "messages": [{"role": "user", "content": "<image>\nRead it."}],
                                           "answers": ["EXIT"]}])
    res = search([str(tmp_path / "tiny")], [data], str(tmp_path / "s"), min_grid=[4], max_grid=[16, 1280, 2048],
                 max_new_tokens=3)
    assert [(r["min_pixels"] // UNIT, r["max_pixels"] // UNIT) for r in res["rows"]] == [(4, 16), (4, 1280), (4, 2048)]
    # 200x150 resizes to 84x112 under 16 units and to 140x196 above: the 2048 setting reuses 1280's answer
    assert res["caching"][str(tmp_path / "tiny")] == {"generated": 2, "reused": 1, "vision_encoded": 2,
                                                      "vision_reused": 0}
    assert os.path.getsize(tmp_path / "s" / "resolution_grid.png") > 0
    assert len(open(tmp_path / "s" / "resolution_table.md").read().splitlines()) == 5


def test_answer_after_scores_the_text_after_the_description(bench):
    """`answer_after`: only the prediction's text after the last occurrence of the string is scored (all of it
    when the string is missing); predictions.jsonl keeps the whole prediction; a bad value is reported."""
    root = bench[0]
    said = {"v1": "a red circle. yes", "v2": "a red circle. no. yes", "v3": "yes", "v4": "a red circle. yes",
            "v5": "a red circle. red"}
    rows = [{"id": q, "images": ["small.png"], "answer_after": ". ", "answers": [a],
             "messages": [{"role": "user", "content": "<image>\nis there a red shape?"}]}
            for q, a in [("v1", "yes"), ("v2", "yes"), ("v3", "yes"), ("v4", "no"), ("v5", "red")]]
    rows.append({"id": "v6", "images": ["small.png"], "answers": ["yes"],          # no field: the whole text
                 "messages": [{"role": "user", "content": "<image>\nis there a red shape?"}]})
    said["v6"] = "a red circle. yes"
    fake = FakeBackend(mc_answers={q: (lambda a: lambda p: a)(a) for q, a in said.items()})
    res = evaluate(None, _jsonl(root / "vqa.jsonl", rows), str(root / "v"), backend=fake, min_pixels=16 * UNIT,
                   max_pixels=64 * UNIT)
    preds = [json.loads(x) for x in open(root / "v" / "predictions.jsonl")]
    assert [p["score"] for p in preds] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert [p["prediction"] for p in preds] == [said[f"v{i}"] for i in range(1, 7)]
    assert res["tasks"]["vqa"]["primary"] == pytest.approx(4 / 6)
    bad = dict(rows[0], answer_after="")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answer_after: expected a non-empty string, got ''"):
        load_benchmark(_jsonl(root / "bad.jsonl", [bad]))
