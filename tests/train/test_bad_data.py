"""Training on bad data: a stage on data without usable samples stops before any step, the skip
threshold with its per-reason summary, one bad line never aborts, skipped counts in the stage
summary; in each stop nothing is written and no weight moves. The real data loader
(tokenizer, image decoding, online packing) feeds the tiny stand-in model through an adapter.

    python -m pytest -q tests/train/test_bad_data.py
"""
import dataclasses
import json
import logging
import os
import re
import warnings

import numpy as np
import pytest
import yaml
from PIL import Image

from mindvl_ms.cli import main
from mindvl_ms.config.base import deep_merge, load, to_dict
from mindvl_ms.config.data import DataConfig
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.train import TrainingStopped, load_run_config, run_training
from mindvl_ms.train import trainer as trainer_mod
from mindvl_ms.train.batches import LoaderSource
from tests.support.stopped_run import nothing_written as _nothing_written, params as _params
from tests.support.stopped_run import tiny_model as _model
from tests.support.train_tiny import IGNORE, collate

NON_UTF8 = (b'{"images": ["img/ok.png"], "task": "vqa", "metric": "exact_match", "messages": [{"role": "user", '
            b'"content": "<image>Q"}, {"role": "assistant", "content": "caf\xff"}]}')


def _tiny(rows, stage):
    """Processed samples -> the tiny model's arrays (ids mod 32, one 8-dim pixel summary per sample)."""
    conv = [[{"input_ids": np.asarray(s["input_ids"]) % 32,
              "labels": np.where(np.asarray(s["labels"]) == -100, IGNORE, np.asarray(s["labels"]) % 32),
              "pixel": (np.asarray(s["pixel_values"]).mean(0)[:8] if s["pixel_values"] is not None
                        else np.zeros(8)).astype(np.float32)} for s in row] for row in rows]
    if not any(conv):  # nothing survived: same arrays, no sample
        out = collate([[{"input_ids": np.zeros(1, np.int64), "labels": np.full(1, IGNORE), "pixel": np.zeros(8)}]]
                      * len(rows), stage)
        out["input_ids"][:] = 0
        out["segment_ids"][:] = 0
        return out
    return collate([r if r else [{"input_ids": np.zeros(1, np.int64), "labels": np.full(1, IGNORE),
                                  "pixel": np.zeros(8, np.float32)}] for r in conv], stage)


def loader_factory(rc, stage, i, dist):
    """default_data_factory with the tiny adapter as collate."""
    cfg = load(DataConfig, deep_merge(to_dict(rc.data), stage.data))
    cfg = dataclasses.replace(cfg, seq_length=stage.seq_length, micro_batch_size=stage.micro_batch_size)
    loader = DataLoader.from_config(cfg, collate=lambda rows: _tiny(rows, stage))
    return LoaderSource(loader, sum(1 for _ in loader.source.epoch_packs(0)))


def _cfg(src, **stage):
    st = dict(name="sft", trainable="all", seq_length=128, global_batch_size=1, micro_batch_size=1, max_lr=5e-3,
              warmup_ratio=0.0, epochs=1.0)
    st.update(stage)
    return load_run_config(data={"seed": 3, "plot": False, "stages": [st],
                                 "data": {"packing": "online", "shuffle": False, "online_buffer": 2,
                                          "sources": [{"path": src}]}})


def _img(d, name, w=64, h=48):
    os.makedirs(d, exist_ok=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(d, name))
    return os.path.join(d, name)


def _line(img=None, answer="a red square", **kw):
    o = {"messages": [{"role": "user", "content": ("<image>" if img else "") + "What is it?"},
                      {"role": "assistant", "content": answer}], **kw}
    if img:
        o["images"] = [f"img/{img}"]
    return json.dumps(o).encode()


def _write(path, lines):
    with open(path, "wb") as f:
        f.write(b"".join(x + b"\n" for x in lines))
    return str(path)


def test_every_image_truncated_stops_before_any_step(tmp_path):
    lines = []
    for k in range(6):
        p = _img(tmp_path / "img", f"t{k}.png")
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
        lines.append(_line(f"t{k}.png"))
    src = _write(tmp_path / "train.jsonl", lines)
    out, model = str(tmp_path / "run"), _model()
    before = _params(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TrainingStopped) as e:
            run_training(_cfg(src), out, model=model, data_factory=loader_factory, progress=False)
    msg = str(e.value)
    head, reasons = msg.split("Skipped by reason:\n")
    # the first global batch already holds 3 of the epoch's 6 samples: the threshold is certain, stop there
    assert head == ("stage 'sft': 3 of this epoch's 6 samples were skipped (50.0%, above "
                    "data.max_skip_fraction=0.05); this batch was not stepped and no checkpoint was written. ")
    m = re.fullmatch(r"  unreadable image: 3 \(first: (.*)\)\nFix or drop the bad lines .*", reasons, re.S)
    firsts = m.group(1).split(", ")
    assert len(firsts) == 3 and set(firsts) <= {f"{src}:{n}" for n in range(1, 7)}
    _nothing_written(out)
    assert all(np.array_equal(v, before[k]) for k, v in _params(model).items())   # no weight moved


def test_bad_lines_are_skipped_named_and_counted_in_the_summary(tmp_path, caplog):
    _img(tmp_path / "img", "ok.png")
    _img(tmp_path / "img", "strip.png", 2000, 20)
    tm = {"task": "vqa", "metric": "exact_match"}
    lines = [_line("ok.png", f"answer {k}", **tm) for k in range(10)]
    lines[2] = NON_UTF8
    lines[4] = _line("strip.png", image_sizes=[[112, 112]], **tm)
    src = _write(tmp_path / "train.jsonl", lines)
    out = str(tmp_path / "run")
    cfg = _cfg(src)
    cfg.data.max_skip_fraction = 0.25    # 2 of 10 bad
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.INFO, "mindvl_ms.train.trainer"):
        warnings.simplefilter("always")
        summary = run_training(cfg, out, model=_model(), data_factory=loader_factory, progress=False)
    msgs = [str(x.message) for x in w]
    col = NON_UTF8.index(b"\xff") + 1
    assert [m for m in msgs if m.startswith("skipping")] == [
        f"skipping {src}:3: undecodable bytes: byte 0xff at column {col} in field 'messages[1].content' is not "
        f"UTF-8 (re-save the file as UTF-8)",
        f"skipping {src}:5: image size mismatch: field image_sizes[0]=[112, 112] but "
        f"{tmp_path / 'img' / 'strip.png'} is 2000x20"]
    assert len([m for m in msgs if "unknown top-level field(s) metric, task kept as metadata" in m]) == 1
    st = summary["stages"][0]
    assert st["skipped_samples"] == 2
    assert st["skipped_by_reason"] == {"undecodable bytes": 1, "image size mismatch": 1}
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert len(recs) == st["steps"] >= 1 and all(r["applied"] and r["supervised"] > 0 for r in recs)
    assert f"stage sft done: {st['steps']} steps, 2 samples skipped (undecodable bytes: 1, image size " \
           f"mismatch: 1)" in caplog.text


@pytest.mark.parametrize("kind", ["empty", "all invalid"])
def test_empty_or_all_invalid_data_stops_with_reasons_through_the_cli(tmp_path, capsys, monkeypatch, kind):
    src = _write(tmp_path / "train.jsonl", [] if kind == "empty" else [b"{not json"] * 3)
    out = str(tmp_path / "run")
    cfg = str(tmp_path / "run.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump({"plot": False, "data": {"packing": "online", "sources": [{"path": src}]},
                        "stages": [{"name": "sft", "seq_length": 128, "global_batch_size": 1}]}, f)
    monkeypatch.setattr(trainer_mod, "build_model", lambda rc: _model())
    monkeypatch.setattr(trainer_mod, "default_data_factory", loader_factory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", cfg, "--out", out, "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    body = ("  (no line was skipped: the data sources have no samples)" if kind == "empty" else
            f"  invalid json: 3 (first: {src}:1, {src}:2, {src}:3)")
    assert err == ("training stopped: stage 'sft': the data produced no batch in a whole epoch (the data loader "
                   "produced no batch in a whole epoch (is the data empty?)); no checkpoint was written. Skipped "
                   f"by reason:\n{body}\nCheck data.sources (`mindvl data validate FILE`).")
    _nothing_written(out)
