"""Bad input named by file:line and field on every data path (validate, pack, the loader, eval), with the
faults made on the fly; config errors naming key and file; output errors as one line; the data
defaults (quality filters, visual budget); unknown fields kept; the demo's plain run YAML.

    python -m pytest -q tests/data/test_bad_input.py
"""
import errno
import json
import os
import re
import warnings

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.cli import main
from mindvl_ms.config.data import DataConfig, DataSource, ImageConfig
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data.schema import iter_jsonl, parse_sample

from tests.support.paths import ROOT  # noqa: E402


def _img(d, name, w, h, seed=0):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(d, name))
    return os.path.join(d, name)


def _obj(img=None, answer="a red square", **kw):
    o = {"messages": [{"role": "user", "content": ("<image>" if img else "") + "What is it?"},
                      {"role": "assistant", "content": answer}], **kw}
    if img:
        o["images"] = [f"img/{img}"]
    return o


def _write(path, lines):
    with open(path, "wb") as f:
        for x in lines:
            f.write((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n")
    return str(path)


NON_UTF8 = (b'{"images": ["img/ok.png"], "messages": [{"role": "user", "content": "<image>Q"}, '
            b'{"role": "assistant", "content": "caf\xff au lait"}]}')


def _non_utf8_detail():
    col = NON_UTF8.index(b"\xff") + 1
    return f"undecodable bytes: byte 0xff at column {col} in field 'messages[1].content' is not UTF-8 " \
           f"(re-save the file as UTF-8)"


@pytest.fixture
def mixed(tmp_path):
    """6 lines: line 3 holds a 0xff byte, line 5 says 112x112 for a 2000x20 image."""
    _img(tmp_path / "img", "ok.png", 64, 48)
    _img(tmp_path / "img", "strip.png", 2000, 20)
    lines = [_obj("ok.png"), _obj("ok.png", image_sizes=[[64, 48]]), NON_UTF8, _obj(),
             _obj("strip.png", image_sizes=[[112, 112]]), _obj("ok.png", answer="blue")]
    return _write(tmp_path / "train.jsonl", lines), str(tmp_path / "img" / "strip.png")


def test_non_utf8_named_in_validate_pack_loader_and_eval(mixed, tmp_path, capsys):
    from mindvl_ms.data.offline import pack_file
    from mindvl_ms.eval.benchmark import load_benchmark

    src, _ = mixed
    want = f"{src}:3: {_non_utf8_detail()}"
    assert main(["data", "validate", src, "--quiet", "--workers", "1"]) == 1
    assert want in capsys.readouterr().out.splitlines()
    man = pack_file(src, str(tmp_path / "packed"), DataConfig(seq_length=512), workers=1, progress=False)
    assert {"line": 3, "reason": "undecodable bytes", "detail": _non_utf8_detail().split(": ", 1)[1]} in man["dropped"]
    assert [n for n, s in iter_jsonl(src) if not hasattr(s, "messages")] == [3]
    with pytest.raises(ValueError) as e:
        load_benchmark(src)
    assert want in str(e.value).splitlines()[1].strip()


def test_size_mismatch_costs_one_line_in_the_loader_and_is_named_everywhere(mixed, capsys):
    from mindvl_ms.data.validate import validate_file
    from mindvl_ms.eval.benchmark import Sizes, load_benchmark

    src, strip = mixed
    mismatch = f"image size mismatch: field image_sizes[0]=[112, 112] but {strip} is 2000x20"
    rep = validate_file(src, workers=1, progress=False)
    assert {"line": 5, "reason": "image size mismatch", "detail": mismatch.split(": ", 1)[1]} in rep["errors"]
    cfg = DataConfig(packing="online", seq_length=512, sources=[DataSource(path=src)], shuffle=False)
    loader = DataLoader.from_config(cfg)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rows = [r for batch in loader for r in batch]
    skipped = sorted(str(x.message) for x in w if str(x.message).startswith("skipping"))
    assert skipped == [f"skipping {src}:3: {_non_utf8_detail()}", f"skipping {src}:5: {mismatch}"]
    assert sorted(s["line"] for r in rows for s in r) == [1, 2, 4, 6]          # every other line trained
    st = loader.skip_stats()
    assert (st["epoch_seen"], st["epoch_skipped"], st["epoch_total"]) == (6, 2, 6)
    assert st["reasons"] == {"undecodable bytes": {"count": 1, "first": [f"{src}:3"]},
                             "image size mismatch": {"count": 1, "first": [f"{src}:5"]}}
    # pack: checked against the header and dropped; with --trust-image-sizes packed, then skipped by the loader
    from mindvl_ms.data.offline import pack_file

    packed = src.replace("train.jsonl", "packed")
    man = pack_file(src, packed, DataConfig(seq_length=512), workers=1, progress=False)
    assert {"line": 5, "reason": "image size mismatch", "detail": mismatch.split(": ", 1)[1]} in man["dropped"]
    man = pack_file(src, packed, DataConfig(seq_length=512), workers=1, progress=False, check_sizes=False)
    assert [d["line"] for d in man["dropped"]] == [3]
    loader = DataLoader.from_config(DataConfig(packed_dir=packed, seq_length=512, shuffle=False))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rows = [r for batch in loader for r in batch]
    assert [str(x.message) for x in w if str(x.message).startswith("skipping")] == [f"skipping {src}:5: {mismatch}"]
    assert sorted(s["line"] for r in rows for s in r) == [1, 2, 4, 6]
    st = loader.skip_stats()   # offline: the epoch is the 5 packed samples of the shard
    assert (st["epoch_seen"], st["epoch_skipped"], st["epoch_total"]) == (5, 1, 5)
    bench = src.replace("train.jsonl", "bench.jsonl")
    _write(bench, [_obj("strip.png", image_sizes=[[112, 112]])])
    with pytest.raises(ValueError) as e:
        Sizes().resized(load_benchmark(bench)[0], 3136, 1003520)
    assert str(e.value) == f"{bench}:1: {mismatch}"


def test_pack_of_one_too_long_line_says_why(tmp_path, capsys):
    src = _write(tmp_path / "long.jsonl", [_obj(answer=" ".join(["word"] * 200))])
    out = str(tmp_path / "out")
    assert main(["data", "pack", src, out, "--seq-length", "64", "--workers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"mindvl data: error: {re.escape(src)}: only 0 packs for 1 ranks: 1 of 1 lines were "
                        rf"dropped \({re.escape(src)}:1: longer than seq_length \(\d+ > 64 tokens\)\); "
                        rf"add data or lower dp_size", err), err
    assert not os.path.exists(out)


def test_unknown_fields_kept_as_metadata_with_one_warning(tmp_path, capsys):
    src = _write(tmp_path / "tm.jsonl", [_obj(task="vqa", metric="exact_match", id=f"q{i}") for i in range(3)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        samples = [s for _, s in iter_jsonl(src)]
    assert [s.extra for s in samples] == [{"metric": "exact_match", "task": "vqa"}] * 3
    msgs = [str(x.message) for x in w]
    assert msgs == [f"{src}: unknown top-level field(s) metric, task kept as metadata (the schema reads id, "
                    f"images, image_sizes, videos, video_meta, messages, source, meta)"]
    assert main(["data", "validate", src, "--quiet", "--workers", "1"]) == 0
    assert "note: unknown top-level field(s) kept as metadata: metric (3 lines), task (3 lines)" in \
        capsys.readouterr().out


def test_quality_filters_are_defaults_and_smart_resize_limits_stay_hard(tmp_path):
    from mindvl_ms.data.offline import sample_meta
    from mindvl_ms.data.image import smart_resize
    from mindvl_ms.data.processor import MindVLProcessor

    cfg = DataConfig()
    assert (cfg.image.min_side, cfg.image.max_aspect_ratio) == (28, 50.0)
    proc = MindVLProcessor(config=cfg)
    tall = _img(tmp_path / "img", "tall.png", 30, 1800)   # 60:1
    dot = _img(tmp_path / "img", "dot.png", 1, 1)
    src = str(tmp_path / "q.jsonl")
    for k, (img, reason, detail) in enumerate([
            (tall, "extreme aspect ratio", f"field images[0]: {tall}: 30x1800, ratio above 50 "
                                           f"(data.image.max_aspect_ratio)"),
            (dot, "below minimum resolution", f"field images[0]: {dot}: 1x1, shortest side must be >= 28 "
                                              f"(data.image.min_side)")], 1):
        s = parse_sample(_obj(os.path.basename(img)), src, k)
        with pytest.raises(Exception) as e:
            sample_meta(proc, s)
        assert (e.value.reason, e.value.detail, e.value.line) == (reason, detail, k)
    assert smart_resize(1800, 30) == (64 * 28, 28)       # within smart_resize's own limit: resizes
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(20000, 20)                          # the hard limit stays
    with pytest.raises(ValueError, match="max_aspect_ratio 300: must be in 1..200"):
        ImageConfig(max_aspect_ratio=300).validate()


def test_default_visual_budget_does_not_cap_fill_on_image_heavy_mix():
    from mindvl_ms.data.packing import Item, efficiency, pack_bfd

    rng = np.random.default_rng(0)
    img = rng.integers(600, 2000, 1500)  # every item fits either budget
    items = [Item(i, int(v) + int(t), int(v)) for i, (v, t) in enumerate(zip(img, rng.integers(40, 300, 1500)))]
    cfg = DataConfig(seq_length=4096)
    assert cfg.visual_budget() == 4096 and cfg.max_image_tokens == 0
    eff_default = efficiency(pack_bfd(items, 4096, cfg.visual_budget()), 4096)
    eff_half = efficiency(pack_bfd(items, 4096, 2048), 4096)
    # with 2048 visual tokens per pack, packs >= total visual / 2048: an upper bound on fill
    bound = sum(it.tokens for it in items) / (np.ceil(img.sum() / 2048) * 4096)
    assert eff_half <= bound < 0.75
    assert eff_default > 0.95 and eff_default - eff_half > 0.25  # measured 0.963 vs 0.504 (bound 0.565)


def test_config_errors_name_key_and_file(tmp_path, capsys):
    import yaml

    out = str(tmp_path / "out")
    cases = [({"stages": [{"name": "s", "max_steps": -3}]}, "stages[0]: stage 's': max_steps must be >= 1, got -3"),
             ({"data": {"global_batch_size": 8}, "stages": [{"name": "s"}]},
              "key 'data.global_batch_size' is not a field of DataConfig"),
             ({"data": {"max_skip_fraction": 2}, "stages": [{"name": "s"}]},
              "data: max_skip_fraction 2.0 must be in [0, 1]")]
    for k, (doc, want) in enumerate(cases):
        p = str(tmp_path / f"run{k}.yaml")
        with open(p, "w") as f:
            yaml.safe_dump(doc, f)
        assert main(["train", "--config", p, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"config error: {p}: ") and want in err, err
    assert not os.path.exists(out)


def test_output_errors_are_one_line_with_path_and_remedy(tmp_path, capsys, monkeypatch):
    from mindvl_ms.data import offline

    src = _write(tmp_path / "d.jsonl", [_obj(answer=f"answer {i}") for i in range(4)])
    out = str(tmp_path / "packed")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(offline, "_write_shards", full)
    assert main(["data", "pack", src, out, "--workers", "1", "--quiet"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mindvl data: error: cannot write {out}: no space left on the device (No space left on device); free "
        f"space there or choose another output directory. Files written before this one are intact "
        f"(checkpoints are renamed into place only when complete)."]
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    shard = os.path.join(out, "rank_00000.jsonl.tmp")

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", shard)
    monkeypatch.setattr(offline, "_write_shards", denied)
    assert main(["data", "pack", src, out, "--workers", "1", "--quiet"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mindvl data: error: cannot access {shard}: Permission denied; make it writable (outputs) or readable "
        f"(inputs), or choose another output directory, and run again."]


@pytest.mark.parametrize("command", ["merge", "eval"])
def test_unwritable_output_of_merge_and_eval(tmp_path, capsys, monkeypatch, command):
    from mindvl_ms.checkpoint.io import RawTensor, write_file

    out = str(tmp_path / "out")
    if command == "merge":
        ins = [str(tmp_path / f"{k}.safetensors") for k in range(2)]
        for k, p in enumerate(ins):
            write_file(p, {"w": RawTensor.of(np.full((2, 2), k, np.float32))})
        argv = ["merge", *ins, "--out", out, "--quiet"]
    else:
        argv = ["eval", "--ckpt", str(tmp_path / "no_ckpt"), "--data",
                _write(tmp_path / "b.jsonl", [_obj(answer="x")]), "--out", out]

    def denied(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", path)
    monkeypatch.setattr(os, "makedirs", denied)
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"mindvl {command}: error: cannot access {re.escape(str(tmp_path))}\S*: Permission denied; make it "
        rf"writable \(outputs\) or readable \(inputs\), or choose another output directory, and run again\.",
        err[0]), err
    assert not os.path.exists(out)


def test_demo_plain_run_yaml_equals_the_demo_recipe(tmp_path):
    """configs/demo/train.yaml is full.yaml's recipe; over a demo's vocabulary subset (data_dir/tokenizer),
    both loaders give the same restricted model (vocab size and special ids from the subset)."""
    from mindvl_ms.config.base import to_dict
    from mindvl_ms.data.tokens import IM_END, IM_START, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
    from mindvl_ms.data.tokenizer import load_tokenizer
    from mindvl_ms.data.vocab_subset import follow_vocab_subset, write_subset
    from mindvl_ms.recipes.demo.config import load_demo_config
    from mindvl_ms.train import load_run_config

    yaml_plain = os.path.join(ROOT, "configs", "demo", "train.yaml")
    yaml_demo = os.path.join(ROOT, "configs", "demo", "full.yaml")
    plain = load_run_config(yaml_plain)
    demo, _ = load_demo_config(yaml_demo, "runs/demo/data")
    a, b = to_dict(plain), to_dict(demo)
    assert a["model"] == b["model"] and a["stages"] == b["stages"] and a["seed"] == b["seed"]
    assert [s["path"] for s in a["data"]["sources"]] == [s["path"] for s in b["data"]["sources"]]
    assert a["data"]["packing"] == "online" and a["data"]["tokenizer"] == os.path.join("runs/demo/data", "tokenizer")
    for d in (a, b):
        d["data"].pop("packing"), d["data"].pop("tokenizer")
    assert a["data"] == b["data"]

    base = load_tokenizer()
    specials = [base.token_to_id(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_START, IM_END)]
    ids = sorted(set(specials + base.encode("What colour is the shape?")))
    write_subset(str(tmp_path / "tokenizer"), base, ids)
    plain = load_run_config(yaml_plain, overrides=[f"data.tokenizer={tmp_path / 'tokenizer'}"])
    follow_vocab_subset(plain)  # as training does before it builds the model
    demo, _ = load_demo_config(yaml_demo, str(tmp_path))
    assert plain.model == demo.model and plain.model.text.vocab_size == len(ids)
    assert plain.model.image_token_id == ids.index(base.token_to_id(IMAGE_PAD))
    assert plain.model.vision_end_token_id == ids.index(base.token_to_id(VISION_END))


@pytest.mark.parametrize("value, named", [
    ('"a cat\\ud800"', True),                  # a lone escape: a surrogate in the decoded value
    ('"a cat\\uD83D\\uDE00"', False),          # an escaped pair: one character, nothing to name
    ('"a cat\\\\ud800"', False),               # an escaped backslash, then the letters "ud800"
    ('"a cat \udc80"', True),                  # the text holds a surrogate already (not from an escape)
])
def test_surrogate_check_of_a_line_names_the_field_whatever_the_shortcut(value, named):
    """parse_line walks the decoded value for surrogates only when its text could make one (schema
    `_SURROGATE_ESCAPE`); the verdict is the full walk's on each kind of line."""
    from mindvl_ms.data.schema import SampleError, parse_line

    text = ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ' + value
            + '}]}')
    got = parse_line(text, "f.jsonl", 3)
    full = parse_sample(json.loads(text), "f.jsonl", 3) if not named else None
    if named:
        assert isinstance(got, SampleError) and "messages[1].content" in str(got) and "surrogate" in str(got)
    else:
        assert not isinstance(got, SampleError) and got.messages == full.messages
