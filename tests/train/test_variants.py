"""Stage variants (MindVL section 5.3) on the tiny config (configs/model/tiny.yaml) through the default data
pipeline (JSONL over a real photo, online packing): a stage with three variants, each with its own sequence
length and pixel budget, each started from the multitask checkpoint; the trainer's merge equals the numpy
mean of the three saved variant checkpoints; and a run killed between two variants, then resumed, ends
bit-identical to an uninterrupted one (losses, every variant's checkpoint, the merge), as does a resume
after the last variant whose merge was not written.

The killed run continues the uninterrupted run's multitask stage: it starts from a copy of that run's
directory as it was when multitask ended (latest.json naming multitask's end), trains the first variant in
a process of its own and is killed there; so the module trains multitask once. The model's vocabulary is
the token ids the data uses (data/vocab_subset.py): none of this depends on the vocabulary's size, and
Qwen3's 151,936 rows would be most of each step, checkpoint and merge."""
import json
import os
import shutil
import signal
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest

from mindvl_ms.checkpoint.io import read_tensors
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import iter_jsonl
from mindvl_ms.data.vocab_subset import follow_vocab_subset, subset_ids, write_subset
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import LoaderSource
from mindvl_ms.train.build import default_data_factory
from PIL import Image
from skimage import data as skdata

from tests.support.paths import ROOT

UNIT = 28 * 28  # pixels of one visual token (a 2x2 merge of 14-pixel patches)
VARIANTS = {"sft_2k": (192, 8 * UNIT), "sft_4k": (256, 16 * UNIT), "sft_8k": (320, 32 * UNIT)}  # seq_length, max_pixels
STEPS = 2
PHOTO = (448, 336)  # width, height: 150,528 px, above every variant's budget
WORDS = "the a cat dog sits on mat red blue green house car tree sky".split()
# the tiny model (configs/model/tiny.yaml) with one decoder layer and one ViT block: the variants train on
# multitask's compiled step (same trainable parameters, loss and micro-batch share, train_step.graph_key), so
# the module compiles a train step three times (the reference run, the killed worker, the resume)
SMALLER = {"text": {"num_hidden_layers": 1}, "vision": {"depth": 1, "fullatt_block_indexes": [0]}}


def resized_area(w, h, max_pixels, f=28):
    """Qwen2-VL smart_resize, written out: the area of an image larger than max_pixels after resizing."""
    beta = np.sqrt(w * h / max_pixels)
    return int(np.floor(h / beta / f) * f * np.floor(w / beta / f) * f)


def write_data(d, n=24, seed=2):
    """n one-image samples on the same 448x336 photo (short question and answer) in d/train.jsonl, and in
    d/tokenizer the vocabulary subset they use (`run_cfg` trains over it)."""
    os.makedirs(d, exist_ok=True)
    Image.fromarray(skdata.astronaut()).convert("RGB").resize(PHOTO).save(os.path.join(d, "photo.png"))
    rng = np.random.default_rng(seed)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for i in range(n):
            words = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
            f.write(json.dumps({"id": f"s{i}", "images": ["photo.png"], "image_sizes": [list(PHOTO)], "messages": [
                {"role": "user", "content": "<image>" + words(int(rng.integers(3, 8)))},
                {"role": "assistant", "content": words(int(rng.integers(2, 10)))}]}) + "\n")
    proc = MindVLProcessor()  # the full Qwen3 tokenizer
    write_subset(os.path.join(d, "tokenizer"), proc.tokenizer,
                 subset_ids(proc, [s for _, s in iter_jsonl(os.path.join(d, "train.jsonl"))]))
    return os.path.join(d, "train.jsonl")


def run_cfg(data_path):
    """The run over write_data's files: the model's vocabulary their subset (as run_training would set it,
    set here so that `tiny_model` builds the model run_training trains)."""
    common = dict(trainable="all", global_batch_size=2, micro_batch_size=2, max_lr=1e-3, warmup_ratio=0.0,
                  epochs=None, max_steps=STEPS)
    cfg = load_run_config(data={
        "seed": 5, "plot": False,
        "model": {"_include_": os.path.join(ROOT, "configs", "model", "tiny.yaml"), **SMALLER},
        "data": {"sources": [{"path": data_path}], "tokenizer": os.path.join(os.path.dirname(data_path), "tokenizer"),
                 "packing": "online", "max_skip_fraction": 0.9},
        "stages": [dict(common, name="multitask", seq_length=256),
                   dict(common, name="sft", seq_length=256, variants={
                       n: {"seq_length": s, "data": {"image": {"max_pixels": p}}} for n, (s, p) in VARIANTS.items()})]})
    follow_vocab_subset(cfg)
    return cfg


def tiny_model(cfg):
    ms.set_seed(cfg.seed)
    return MindVLModel(cfg.model)


class Recorder:
    """data_factory: the default loader per stage, recording the model's parameters when the stage starts,
    the stage's pixel budget and the shape of every micro-batch it gives the trainer. `stop_at`: SIGKILL the
    process when that stage starts; `copy_at` (stage, run directory, copy): copy the run directory when that
    stage starts (the previous stage's end saved, latest.json naming it)."""

    def __init__(self, model, stop_at=None, copy_at=None):
        self.model, self.stop_at, self.copy_at, self.seen = model, stop_at, copy_at, {}

    def __call__(self, rc, stage, i, dist):
        if stage.name == self.stop_at:  # between two variants, the first one's end saved
            os.kill(os.getpid(), signal.SIGKILL)
        if self.copy_at and stage.name == self.copy_at[0]:
            shutil.copytree(self.copy_at[1], self.copy_at[2])
        src = default_data_factory(rc, stage, i, dist)
        rec = self.seen[stage.name] = {"params": {p.name: p.asnumpy().copy() for p in self.model.get_parameters()},
                                       "max_pixels": src.loader.config.image.max_pixels, "batches": []}
        return Recording(src.loader, src.rows_per_epoch, rec["batches"])


class Recording(LoaderSource):
    def __init__(self, loader, rows, log):
        super().__init__(loader, rows)
        self.log = log

    def next_micro_batches(self, k):
        mbs = super().next_micro_batches(k)
        self.log += [(mb["input_ids"].shape, np.asarray(mb["image_grid_thw"]).reshape(-1, 3)) for mb in mbs]
        return mbs


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["stage"], r["step"], r["loss"]) for r in map(json.loads, f)]


def test_mindvl_8b_recipe_runs_the_papers_three_variants_then_their_average():
    """configs/run/mindvl-8b-64npu.yaml trains warm-up, multitask and the section 5.3 variants: 2K/4K/8K tokens
    with max_pixels 1280, 3072 and 4096 x 28^2, merged by a uniform average."""
    cfg = load_run_config(os.path.join(ROOT, "configs", "run", "mindvl-8b-64npu.yaml"))
    got = [(st.name, st.seq_length, cfg.stage_data(st).image.max_pixels, g.name if g else None)
           for st, g in cfg.schedule()]
    assert got == [("warmup", 8192, 1280 * UNIT, None), ("multitask", 8192, 1280 * UNIT, None),
                   ("sft_2k", 2048, 1280 * UNIT, "sft"), ("sft_4k", 4096, 3072 * UNIT, "sft"),
                   ("sft_8k", 8192, 4096 * UNIT, "sft")]
    sft = cfg.stages[2]
    assert sft.merge.method == "linear" and sft.merge.weights == {} and sft.merge.out == ""
    assert all(st.token_budget == 12_000_000_000 and st.max_lr == 1e-5 for st, _ in cfg.schedule()[2:])


@pytest.mark.parametrize("variants, merge, first, message", [
    ({"a": {"seq_lenght": 8}, "b": {}}, {}, True, "variant 'a': key 'seq_lenght' is not a field of StageConfig; "
                                                  "did you mean 'seq_length'"),
    ({"a": {"name": "x"}, "b": {}}, {}, True, "variant 'a' sets \\['name'\\]"),
    ({"a": {}}, {}, True, "give at least two to merge"),
    ({"a": {}, "b": {}}, {"weights": {"a": 1}}, True, "give one weight per variant"),
    ({"a": {}, "b": {}}, {"method": "mean"}, True, "merge.method 'mean'"),
    ({"a": {}, "first": {}}, {}, True, "repeated: \\['first'\\]"),
    ({"a": {}, "b": {}}, {}, False, "as the first stage it needs `init_from`"),
])
def test_variant_config_errors_name_the_key(variants, merge, first, message):
    from mindvl_ms.config.base import ConfigError

    stages = [{"name": "first", "max_steps": 1}] * first + [
        {"name": "sft", "max_steps": 1, "variants": variants, "merge": merge}]
    with pytest.raises(ConfigError, match=message):
        load_run_config(data={"stages": stages})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: multitask, then the three variants, then their merge; and a copy of its
    directory as it was when multitask ended (the killed run starts there)."""
    d = tmp_path_factory.mktemp("variants")
    data = write_data(str(d / "data"))
    cfg = run_cfg(data)
    model = tiny_model(cfg)
    rec = Recorder(model, copy_at=("sft_2k", str(d / "ref"), str(d / "after_multitask")))
    summary = run_training(cfg, str(d / "ref"), model=model, data_factory=rec, progress=False)
    return data, str(d / "ref"), summary, rec.seen, str(d / "after_multitask"), model


@pytest.mark.slow
def test_three_variants_from_one_checkpoint_with_their_own_lengths_and_pixels(reference):
    _, out, summary, seen, _, _ = reference
    assert [s["stage"] for s in summary["stages"]] == ["multitask", *VARIANTS]
    assert [s["compiled_graphs"] for s in summary["stages"]] == [1, 0, 0, 0]  # the variants reuse multitask's step
    start = read_tensors(summary["stages"][0]["checkpoint"])  # the multitask stage's final checkpoint
    for name, (seq, pixels) in VARIANTS.items():
        got = seen[name]
        assert got["max_pixels"] == pixels
        for k, t in start.items():  # every variant starts from the multitask weights, bit for bit
            assert np.array_equal(got["params"][k], t.float32()), (name, k)
        assert len(got["batches"]) == STEPS
        areas = set()
        for shape, grid in got["batches"]:
            assert shape[-1] == seq  # rows padded to the variant's own sequence length
            areas |= set((grid[:, 1] * grid[:, 2] * 14 * 14).tolist())  # resized pixels of each image
        # the photo resized to the variant's own budget: 4,704, 9,408 and 18,816 px (6, 12 and 24 tokens)
        assert areas == {resized_area(*PHOTO, pixels)} and resized_area(*PHOTO, pixels) <= pixels, (name, areas)
        with open(os.path.join(summary["stages"][list(VARIANTS).index(name) + 1]["checkpoint"],
                               "preprocessor_config.json")) as f:
            assert json.load(f)["max_pixels"] == pixels  # the checkpoint serves at the budget it trained at
    # the variants differ after training (different rows and images), so the merge is not a copy
    ends = [read_tensors(s["checkpoint"]) for s in summary["stages"][1:]]
    w = "model.layers.0.mlp.down_proj.weight"
    assert not np.array_equal(ends[0][w].float32(), ends[1][w].float32())


@pytest.mark.slow
def test_merge_is_the_mean_of_the_three_variants(reference):
    _, out, summary, _, _, _ = reference
    (m,) = summary["merges"]
    assert m["stage"] == "sft" and m["checkpoint"] == os.path.join(out, "sft", "merged")
    ends = [read_tensors(s["checkpoint"]) for s in summary["stages"][1:]]
    assert m["inputs"] == [s["checkpoint"] for s in summary["stages"][1:]]
    merged = read_tensors(m["checkpoint"])
    assert set(merged) == set(ends[0])
    for k in merged:  # within 1e-7, plus one float32 rounding of the value itself: the mean of three float32
        # numbers is in general no float32 number, and merge sums them in float32 (1 ulp is 1.19e-7 at 1.0)
        mean = np.mean([e[k].float32().astype(np.float64) for e in ends], axis=0)
        np.testing.assert_allclose(merged[k].float32(), mean, rtol=np.finfo(np.float32).eps, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_kill_between_variants_then_resume_is_bit_identical(reference, tmp_path):
    data, ref_dir, summary, _, after_multitask, model = reference
    out = str(tmp_path / "killed")
    shutil.copytree(after_multitask, out)  # the uninterrupted run when multitask ended
    with open(os.path.join(out, "latest.json")) as f:
        assert json.load(f)["stage"] == "multitask"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "train_variants_kill.py"), data, out,
                        "sft_4k"], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT))
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    with open(os.path.join(out, "latest.json")) as f:
        latest = json.load(f)
    assert latest["stage"] == "sft_2k" and latest["stage_done"]  # killed after the first variant ended
    assert not os.path.exists(os.path.join(out, "sft_4k")) and not os.path.exists(os.path.join(out, "sft"))

    cfg = run_cfg(data)
    rec = Recorder(model)  # the reference's model: the resume loads its weights and restarts the step kept on it
    resumed = run_training(cfg, out, resume=out, model=model, data_factory=rec, progress=False)
    assert [s["stage"] for s in resumed["stages"]] == ["sft_4k", "sft_8k"]
    # no compile: the reference run's step, kept on the model, restarted (a kept step trains as a new one:
    # tests/train/test_kept_step.py; a resume on a new step: the resumes of test_resume.py and test_soak.py)
    assert [s["compiled_graphs"] for s in resumed["stages"]] == [0, 0]
    assert losses(out) == losses(ref_dir)  # every logged loss, both runs, bit for bit
    start = read_tensors(summary["stages"][0]["checkpoint"])
    for k, t in start.items():  # the resumed variant started from the multitask weights, not sft_2k's
        assert np.array_equal(rec.seen["sft_4k"]["params"][k], t.float32()), k
    pairs = [(s["checkpoint"], os.path.join(out, os.path.relpath(s["checkpoint"], ref_dir))) for s in summary["stages"]]
    for a, b in pairs + [(summary["merges"][0]["checkpoint"], os.path.join(out, "sft", "merged"))]:
        ta, tb = read_tensors(a), read_tensors(b)
        assert set(ta) == set(tb) and all(np.array_equal(ta[k].data, tb[k].data) for k in ta), b

    # killed after the last variant's end, before its merge was written: the resume only merges (same bytes)
    shutil.rmtree(os.path.join(out, "sft", "merged"))
    again = run_training(cfg, out, resume=out, model=tiny_model(cfg), progress=False)
    assert again["stages"] == [] and [m["checkpoint"] for m in again["merges"]] == [os.path.join(out, "sft", "merged")]
    ta, tb = read_tensors(summary["merges"][0]["checkpoint"]), read_tensors(os.path.join(out, "sft", "merged"))
    assert set(ta) == set(tb) and all(np.array_equal(ta[k].data, tb[k].data) for k in ta)
