"""`mindvl demo --quick` end to end (the CI run), checked against its own artefacts recomputed
independently: merged weights = numpy mean of the SFT checkpoints, reported scores = scores
recomputed from the prediction files, reported losses = the metrics logs, frozen parts untouched
by the projector-only warm-up; and `mindvl generate` on the merged checkpoint (a user's call, no
formatting flags: the checkpoint's processor files give the prompt format and pixel limits) prints the
same tokens as the demo's eval path (the training-time processor), held-out grounding boxes included.

    python -m pytest -q tests/recipes/test_demo_quick.py      # about 3 minutes on 2 CPU cores

Every test on the demo run is marked slow: `pytest -m "not slow"` leaves the run out (its training, merge,
eval and generate are each tested alone in tests/train, tests/checkpoint, tests/eval and tests/infer); CI
runs it.
"""
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mindvl_ms.checkpoint.io import read_tensors

from tests.support.paths import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`mindvl demo --quick` as the user calls it (`cli.main`, what `mindvl` runs), in this process: the quick
    run's phases run in the calling process (`demo.phase_processes: false`), so the merged checkpoint's
    evaluation backend (`recipes.demo.evaluation.eval_backend`, compiled graphs included) stays cached here
    for the tests below. MindSpore's execution mode is restored afterwards."""
    import mindspore as ms

    from mindvl_ms.cli import main

    out = str(tmp_path_factory.mktemp("demo"))
    mode, buf = ms.get_context("mode"), io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            code = main(["demo", "--quick", "--out", out, "--no-progress"])
    finally:
        ms.set_context(mode=mode)
    assert code == 0, buf.getvalue()[-4000:]
    with open(os.path.join(out, "report.json")) as f:
        return out, json.load(f), buf.getvalue()


def _records(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


@pytest.mark.slow
def test_prints_losses_accuracies_and_artefacts(run):
    out, rep, stdout = run
    for word in ("warmup", "multitask", "sft_256", "sft_512", "vqa", "ocr", "grounding", "majority-answer",
                 "resolution search", "artefacts in"):
        assert word in stdout
    assert list(rep["stages"]) == ["warmup", "multitask", "sft_256", "sft_512"]
    for name in ("data/train_vqa.jsonl", "data/heldout_grounding.jsonl", "merged/merge_record.json",
                 "warmup/loss_lr.png", "resolution_search/resolution_table.md", "eval/merged/ocr/scores.json"):
        assert os.path.isfile(os.path.join(out, name)), name


@pytest.mark.slow
def test_stage_losses_match_metrics_logs(run):
    out, rep, _ = run
    for stage in ("warmup", "multitask", "sft_256", "sft_512"):  # one run: OUT/metrics.jsonl
        losses = [r["loss"] for r in _records(os.path.join(out, "metrics.jsonl")) if r["stage"] == stage]
        s = rep["stages"][stage]
        assert s["steps"] == len(losses)
        assert s["first_loss"] == losses[0] and s["final_loss"] == losses[-1]
        assert all(math.isfinite(x) for x in losses)
    # an untrained model's loss is E[logsumexp] of random logits over the vocabulary: the ids the demo data
    # uses (demo.vocab: data), counted here from the subset file the checkpoints carry. The tied head reads
    # the final RMSNorm's unit-rms hidden state with N(0, std) rows (`initializer_range`), so each logit is
    # ~N(0, std^2 * hidden); numpy draws them (ln v alone at std -> 0). Training moves it down.
    with open(os.path.join(out, "merged", "vocab_subset.json")) as f:
        v = len(json.load(f)["ids"])
    assert rep["vocab"] == {"mode": "data", "size": v, "of": 151936} and 80 < v < 200
    with open(os.path.join(out, "merged", "config.json")) as f:
        text = json.load(f)["config"]["text"]
    logits = np.random.default_rng(0).normal(0, text["initializer_range"] * text["hidden_size"] ** 0.5, (4096, v))
    top = logits.max(1)
    untrained = float(np.mean(top + np.log(np.exp(logits - top[:, None]).sum(1))))
    assert abs(rep["stages"]["warmup"]["first_loss"] - untrained) < 0.5, (rep["stages"]["warmup"], untrained)
    assert rep["stages"]["sft_256"]["final_loss"] < rep["stages"]["warmup"]["first_loss"]


@pytest.mark.slow
def test_warmup_trains_only_the_projector(run):
    out, rep, _ = run
    warm = read_tensors(rep["stages"]["warmup"]["checkpoint"])
    multi = read_tensors(rep["stages"]["multitask"]["checkpoint"])
    # the multitask stage starts from the warm-up weights and trains everything
    changed = [k for k in warm if not np.array_equal(warm[k].float32(), multi[k].float32())]
    assert any(k.startswith("model.") for k in changed) and any(k.startswith("visual.blocks") for k in changed)
    # the warm-up changes the projector; everything else is still the seeded initialisation, which a
    # second model built with the same seed reproduces
    from mindvl_ms.checkpoint.pretrained import model_tensors
    from mindvl_ms.recipes.demo.config import load_demo_config
    from mindvl_ms.recipes.demo.training import train_model

    cfg, _ = load_demo_config(rep["config"], os.path.join(out, "data"))
    init = model_tensors(train_model(cfg))
    for k, t in warm.items():
        same = np.array_equal(t.float32(), init[k].float32())
        assert same != k.startswith("visual.merger."), k


@pytest.mark.slow
def test_merged_is_the_mean_of_the_sft_variants(run):
    out, rep, _ = run
    a, b = (read_tensors(rep["stages"][s]["checkpoint"]) for s in ("sft_256", "sft_512"))
    m = read_tensors(os.path.join(out, "merged"))
    assert set(m) == set(a) == set(b)
    for k in m:
        np.testing.assert_allclose(m[k].float32(), (a[k].float32().astype(np.float64) + b[k].float32()) / 2,
                                   rtol=0, atol=1e-6)


@pytest.mark.slow
def test_reported_scores_recomputed_from_predictions(run):
    out, rep, _ = run
    from mindvl_ms.eval.metrics import parse_box

    def iou(p, q):
        lt, rb = np.maximum(p[:2], q[:2]), np.minimum(p[2:], q[2:])
        inter = np.prod(np.clip(rb - lt, 0, None))
        return inter / (np.prod(p[2:] - p[:2]) + np.prod(q[2:] - q[:2]) - inter)

    for ckpt, tasks in rep["scores"].items():
        assert set(tasks) == {"vqa", "ocr", "grounding"}
        for task, score in tasks.items():
            preds = _records(os.path.join(out, "eval", ckpt, task, "predictions.jsonl"))
            held = _records(os.path.join(out, "data", f"heldout_{task}.jsonl"))
            assert len(preds) == len(held)
            hits = []
            for p, h in zip(preds, held):
                gold = h["messages"][-1]["content"]
                if task == "grounding":
                    box = parse_box(p["prediction"])
                    hits.append(box is not None and iou(np.array(box, float), np.array(parse_box(gold), float)) >= 0.5)
                else:  # a described easy-VQA answer ("a red circle. yes") is scored after its last ". "
                    said = p["prediction"].split(h["answer_after"])[-1] if "answer_after" in h else p["prediction"]
                    hits.append(" ".join(said.split()).lower() == gold.lower())
            assert score == pytest.approx(np.mean(hits))
    # the resolution search's row at the evaluation's own setting (12,544 pixels, in the quick grid) is the
    # merged checkpoint's OCR evaluation, whose answers it took over instead of generating them again
    search, n_ocr = rep["resolution_search"], len(_records(os.path.join(out, "data", "heldout_ocr.jsonl")))
    assert [s for lo, hi, s in search["scores"] if (lo, hi) == (12544, 12544)] == [rep["scores"]["merged"]["ocr"]]
    assert search["caching"]["reused"] >= n_ocr
    assert search["caching"]["generated"] + search["caching"]["reused"] == n_ocr * search["settings"]


BOX = re.compile(r"<\|box_start\|>\((\d{1,3}),(\d{1,3})\),\((\d{1,3}),(\d{1,3})\)<\|box_end\|>")


@pytest.mark.slow
def test_generate_cli_prints_the_eval_paths_boxes(run, tmp_path, monkeypatch, capsys):
    """The demo's eval path is replayed in-process (its predictions must equal the demo's file) with the
    generated ids recorded, through the demo's own backend of the merged checkpoint (`eval_backend`, cached
    in this process by the fixture's run); `mindvl generate` (`cli.main`, in this process: a model of its own,
    loaded from the checkpoint) then answers the first held-out grounding questions with a well-formed box
    whose tokens are those ids (`mindvl generate` prints the grounding tags as text)."""
    import mindspore as ms

    import mindvl_ms.infer.generate as gen
    from mindvl_ms.cli import main
    from mindvl_ms.recipes.demo.config import load_demo_config
    from mindvl_ms.recipes.demo.evaluation import eval_backend
    from mindvl_ms.eval.metrics import parse_box
    from mindvl_ms.eval.benchmark import evaluate

    out, rep, _ = run
    merged, heldout = os.path.join(out, "merged"), os.path.join(out, "data", "heldout_grounding.jsonl")
    cfg, demo = load_demo_config(rep["config"], os.path.join(out, "data"))
    recorded, real = [], gen.generate

    def recording(*args, **kwargs):  # the ids behind each prediction, in the order they are generated
        ids = real(*args, **kwargs)
        recorded.extend(ids)
        return ids

    monkeypatch.setattr(gen, "generate", recording)
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:  # what recipes.demo.evaluation.evaluate_all does for the merged checkpoint's grounding split
        backend = eval_backend(merged, cfg.data, int(demo["max_new_tokens"]))
        evaluate(merged, heldout, str(tmp_path / "eval"), backend=backend, min_pixels=cfg.data.image.min_pixels,
                 max_pixels=cfg.data.image.max_pixels, batch_size=int(demo["eval_batch_size"]),
                 max_new_tokens=int(demo["max_new_tokens"]), progress=False)
    finally:
        ms.set_context(mode=mode)
    replay = _records(str(tmp_path / "eval" / "predictions.jsonl"))
    demo_preds = _records(os.path.join(out, "eval", "merged", "grounding", "predictions.jsonl"))
    assert [p["prediction"] for p in replay] == [p["prediction"] for p in demo_preds]
    assert len(recorded) == len(replay)

    tok = backend.processor.tokenizer
    stops = set(gen.stop_token_ids(backend.processor))
    for ids in recorded:  # every held-out answer ends by itself and, printed as the CLI prints it, is a box
        assert ids[-1] in stops, "the eval answer was cut at max_new_tokens"
        assert BOX.fullmatch(gen.decode_answer(backend.processor, ids)), tok.decode(ids)
    monkeypatch.undo()  # the CLI's generation is not recorded
    capsys.readouterr()
    for line, ids in list(zip(_records(heldout), recorded))[:1]:  # one CLI call: three graph compiles
        question = line["messages"][0]["content"].replace("<image>\n", "")
        image = os.path.join(out, "data", line["images"][0])
        assert main(["generate", "--ckpt", merged, "--image", image, "--prompt", question]) == 0
        text = capsys.readouterr().out.strip()
        m = BOX.fullmatch(text)
        assert m, (line["id"], text)
        assert parse_box(text) == tuple(int(v) for v in m.groups())
        assert tok.encode(text) == ids[:-1], (line["id"], text, tok.decode(ids))


@pytest.mark.slow
def test_subset_vocab_checkpoint_has_no_hf_export(run, tmp_path):
    """The demo model's vocabulary is the data's ids (demo.vocab: data): `mindvl convert ms2hf` refuses it by
    name instead of writing a Hugging Face directory whose tokenizer ids are not the model's."""
    out, _, _ = run
    proc = subprocess.run([sys.executable, "-m", "mindvl_ms", "convert", "ms2hf", os.path.join(out, "merged"),
                           str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "vocab_subset.json" in proc.stderr and "no Hugging Face layout" in proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_post_train_on_the_quick_model(run, capsys):
    """`mindvl demo --post-train` on the quick run, a few steps per stage: the prompt images are new, the pairs
    are the rollout's own samples under the pair rule, the chain is DPO from merged then GRPO from DPO, and
    the held-out table is recomputed from the prediction files with a numpy IoU. The command runs in this
    process (`cli.main`, what `mindvl` calls), its phases too (`demo.phase_processes=false`: the rollout samples
    with the graphs the demo's evaluation compiled for the merged checkpoint, and the DPO and GRPO checkpoints
    are evaluated on that model, which has the merged weights back afterwards), without plots."""
    import hashlib

    import mindspore as ms

    from mindvl_ms.checkpoint.io import read_tensors as rt
    from mindvl_ms.cli import main
    from mindvl_ms.eval.metrics import parse_box

    out, _, _ = run  # the post-training run reads the demo's files and writes OUT/post only
    sets = ["demo.prompts=6", "demo.rollout.high=-1", "demo.rollout.low=1.01", "demo.rollout.k=3"] + [
        f"stages.{i}.{k}" for i in (0, 1) for k in ("max_steps=2", "global_batch_size=2", "micro_batch_size=2")] + [
        "stages.1.grpo.group_size=2", "stages.1.grpo.mini_batch_size=2", "stages.0.dpo.ntp_ratio=0.5",
        "stages.0.epochs=null", "plot=false", "demo.phase_processes=false"]
    mode = ms.get_context("mode")
    try:
        code = main(["demo", "--post-train", "--out", out, "--no-progress"] + [a for s in sets for a in ("--set", s)])
    finally:
        ms.set_context(mode=mode)
    assert code == 0
    stdout = capsys.readouterr().out
    post = os.path.join(out, "post")
    rep = json.load(open(os.path.join(post, "post_report.json")))
    assert "held-out grounding" in stdout and "merged" in stdout

    prompts = _records(os.path.join(post, "data", "prompts.jsonl"))
    assert len(prompts) == 6 and all(p["reward"] == "grounding_iou" for p in prompts)

    def digest(path):
        return hashlib.sha1(open(path, "rb").read()).hexdigest()
    seen = {digest(os.path.join(out, "data", x["images"][0])) for s in ("train", "heldout")
            for x in _records(os.path.join(out, "data", f"{s}_grounding.jsonl"))}
    assert not seen & {digest(os.path.join(post, "data", p["images"][0])) for p in prompts}

    def iou(a, b):  # a sampled box may be inverted (x2 < x1): its area is 0
        if a is None:
            return 0.0
        a, b = np.array(a, float), np.array(b, float)
        lt, rb = np.maximum(a[:2], b[:2]), np.minimum(a[2:], b[2:])
        inter = np.prod(np.clip(rb - lt, 0, None))
        union = np.prod(np.clip(a[2:] - a[:2], 0, None)) + np.prod(np.clip(b[2:] - b[:2], 0, None)) - inter
        return inter / union if union > 0 else 0.0

    sampled = re.compile(r"<\|box_start\|>\((\d+),(\d+)\),\((\d+),(\d+)\)<\|box_end\|>")  # any digit count

    pairs = _records(os.path.join(post, "data", "pairs.jsonl"))
    assert rep["rollout"]["pairs"] == len(pairs) >= 2  # any prompt passes -1 < best, worst < 1.01 unless its
    #                                                      best and worst samples are the same text
    answer = {p["id"]: parse_box(p["answer"]) for p in prompts}
    for pair in pairs:  # chosen is the best-scoring sample, rejected the worst
        s = pair["meta"]["scores"]
        assert len(s) == 3 and pair["chosen"] != pair["rejected"]
        for text, want in ((pair["chosen"], max(s)), (pair["rejected"], min(s))):
            m = sampled.search(text)
            assert iou(tuple(map(int, m.groups())) if m else None, answer[pair["meta"]["prompt_id"]]) == \
                pytest.approx(want, abs=1e-9)

    recs = _records(os.path.join(post, "train", "metrics.jsonl"))
    assert [r["stage"] for r in recs] == ["dpo", "dpo", "grpo", "grpo"] and all(r["applied"] for r in recs)
    assert abs(recs[0]["margin"]) < 1e-4 and np.isfinite(recs[0]["loss"])  # the policy starts as the reference
    assert all(r["updates"] == 2 and 1 <= r["response_length"] <= 24 and 0.0 <= r["reward_mean"] <= 1.0
               for r in recs[2:])  # 4 samples, 2 per update; the IoU reward is in [0, 1]
    assert list(rep["stages"]) == ["dpo", "grpo"]
    assert rep["stages"]["grpo"]["reward_mean"][0] == pytest.approx(np.mean([r["reward_mean"] for r in recs[2:]]))
    ck = {n: rt(p) for n, p in rep["checkpoints"].items()}
    assert rep["checkpoints"]["merged"] == os.path.join(out, "merged")
    w = "model.layers.0.mlp.down_proj.weight"
    assert not np.array_equal(ck["merged"][w].float32(), ck["dpo"][w].float32())
    assert not np.array_equal(ck["dpo"][w].float32(), ck["grpo"][w].float32())

    # merged: the demo's own evaluation is read (same checkpoint, split and settings), the others are run
    assert rep["heldout"]["merged"]["source"] == os.path.join(out, "eval", "merged", "grounding")
    assert rep["heldout"]["grpo"]["source"] == os.path.join(post, "eval", "grpo")
    held = _records(os.path.join(out, "data", "heldout_grounding.jsonl"))
    for name, s in rep["heldout"].items():
        preds = _records(os.path.join(s["source"], "predictions.jsonl"))
        assert s["n"] == len(held) == len(preds)
        gold = [parse_box(h["messages"][-1]["content"]) for h in held]
        ious = np.array([iou(parse_box(p["prediction"]), g) for p, g in zip(preds, gold)])
        assert s["mean_iou"] == pytest.approx(ious.mean(), abs=1e-9)
        assert s["acc_iou75"] == pytest.approx(np.mean(ious >= 0.75))
        assert s["acc_iou50"] == pytest.approx(np.mean(ious >= 0.5))

    # the demo's cached backend of merged (the one the evaluation of DPO and GRPO borrowed) answers for merged again
    from mindvl_ms.recipes.demo.evaluation import cached_backend
    lent = cached_backend(os.path.join(out, "merged"))
    assert lent is not None
    for name, p in lent.model.parameters_and_names():
        np.testing.assert_array_equal(p.asnumpy(), ck["merged"][name].float32(), err_msg=name)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_a_killed_demo_leaves_no_phase_process_behind():
    """`in_child` runs each phase in a spawned process; when the demo's process is killed (SIGKILL: no
    handler runs), that child ends too instead of training on as an orphan."""
    import time

    parent = subprocess.Popen([sys.executable, "-c", "import time; from mindvl_ms.recipes.demo.processes import in_child; "
                               "in_child(time.sleep, 300)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def phase_children():  # spawned workers whose parent is `parent`
        out = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/status") as f, open(f"/proc/{d}/cmdline", "rb") as g:
                    status, cmd = f.read(), g.read()
            except OSError:
                continue
            if f"\nPPid:\t{parent.pid}\n" in status and b"spawn_main" in cmd:
                out.append(int(d))
        return out

    deadline = time.time() + 120
    while not phase_children() and time.time() < deadline:
        time.sleep(0.2)
    child = phase_children()
    assert len(child) == 1, "the phase process did not start"
    parent.kill()
    parent.wait()
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{child[0]}") and time.time() < deadline:
        time.sleep(0.2)
    alive = os.path.exists(f"/proc/{child[0]}")
    if alive:
        os.kill(child[0], 9)
    assert not alive, "the phase process outlived the killed demo"
