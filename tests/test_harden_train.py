"""Training on bad data: no step on an empty global batch, the skip threshold with its per-reason
summary, one bad line never aborts, skipped counts in the stage summary, a resume on changed data
stops, a full disk is one line; in each stop nothing is written or changed. The real data loader
(tokenizer, image decoding, online packing) feeds the tiny stand-in model through an adapter.

    python -m pytest -q tests/test_harden_train.py
"""
import dataclasses
import errno
import json
import logging
import os
import re
import warnings

import mindspore as ms
import numpy as np
import pytest
from PIL import Image

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.cli import main
from mindvl_ms.train import TrainingStopped, load_run_config, run_training
from mindvl_ms.train import trainer as trainer_mod
from mindvl_ms.train.data import LoaderSource, RowSource
from train_tiny import IGNORE, TinyVLM, collate, make_rows

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
    from mindvl_ms.config.base import deep_merge, load, to_dict
    from mindvl_ms.config.data import DataConfig
    from mindvl_ms.data.dataset import DataLoader

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


def _model():
    ms.set_seed(0)
    return TinyVLM()


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


def _snapshot(d):
    return {os.path.join(r, n): (os.path.getsize(os.path.join(r, n)), os.path.getmtime(os.path.join(r, n)))
            for r, _, fs in os.walk(d) for n in fs}


def _params(model):
    return {p.name: p.asnumpy().copy() for p in model.get_parameters()}


def _nothing_written(out):
    assert not os.path.exists(os.path.join(out, "latest.json"))
    assert not os.path.exists(os.path.join(out, "summary.json"))
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert not [d for _, ds, _ in os.walk(out) for d in ds if d.startswith("checkpoint-") or ".tmp-" in d]


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
    import yaml

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


def _unsupervised(row):
    return [dict(s, labels=np.full_like(s["labels"], IGNORE)) for s in row]


def test_global_batch_without_supervised_token_is_never_stepped(tmp_path):
    rows = make_rows(6, seed=4)
    mixed = [_unsupervised(rows[0])] + rows[1:]
    cfg = load_run_config(data={"plot": False, "stages": [dict(name="sft", seq_length=28, global_batch_size=1,
                                                              max_steps=3, warmup_ratio=0.0)]})
    out = str(tmp_path / "a")
    run_training(cfg, out, model=_model(), data_factory=lambda *a: RowSource(mixed, shuffle=False),
                 collate=collate, progress=False)
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [0, 1, 2] and all(r["supervised"] > 0 and r["applied"] for r in recs)
    # the reference: the same run on the rows without the unsupervised one gives the same losses
    ref = str(tmp_path / "ref")
    run_training(cfg, ref, model=_model(), data_factory=lambda *a: RowSource(rows[1:], shuffle=False),
                 collate=collate, progress=False)
    assert [r["loss"] for r in recs] == [json.loads(x)["loss"] for x in open(os.path.join(ref, "metrics.jsonl"))]
    # nothing supervised at all: stops after a whole epoch of batches, weights untouched, nothing written
    out, model = str(tmp_path / "b"), _model()
    before = _params(model)
    with pytest.raises(TrainingStopped) as e:
        run_training(cfg, out, model=model, data_factory=lambda *a: RowSource([_unsupervised(r) for r in rows]),
                     collate=collate, progress=False)
    assert str(e.value).startswith("stage 'sft': 6 global batches in a row (a whole epoch) held no supervised "
                                   "token; this batch was not stepped")
    assert all(np.array_equal(v, before[k]) for k, v in _params(model).items())
    _nothing_written(out)


def test_resume_on_changed_data_stops_unless_allowed(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"x": 1}\n')
    rows = make_rows(16, seed=2)
    cfg = load_run_config(data={"plot": False, "data": {"sources": [{"path": str(data)}]},
                                "stages": [dict(name="sft", seq_length=28, global_batch_size=2, micro_batch_size=2,
                                                max_steps=4, save_every=2, warmup_ratio=0.0)]})
    kw = dict(data_factory=lambda *a: RowSource(rows, seed=1), collate=collate, progress=False)
    out = str(tmp_path / "run")
    run_training(cfg, out, model=_model(), **kw)
    mid = os.path.join(out, "sft", "checkpoint-000002")
    data.write_text('{"x": 2}\n{"x": 3}\n')
    before = _snapshot(out)
    with pytest.raises(TrainingStopped) as e:
        run_training(cfg, out, resume=mid, model=_model(), **kw)
    assert str(e.value) == (f"--resume {mid}: the data of stage 'sft' is not the data of {mid} ({data} changed "
                            f"(size, sha256_ends)); resuming would continue its saved position on other data. "
                            f"Restore the original data, or pass --resume-allow-data-change")
    assert _snapshot(out) == before
    run_training(cfg, out, resume=mid, model=_model(), allow_data_change=True, **kw)
    state, _, _ = ts.load_checkpoint(os.path.join(out, "sft", "checkpoint-000004"))
    assert state["data_changes"] == [{"stage": "sft", "step": 2, "change": f"{data} changed (size, sha256_ends)"}]


def test_disk_full_during_save_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, capsys, monkeypatch):
    import yaml

    out = str(tmp_path / "run")
    cfg = str(tmp_path / "run.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump({"plot": False, "stages": [{"name": "sft", "seq_length": 28, "global_batch_size": 2,
                                                   "micro_batch_size": 2, "max_steps": 2}]}, f)
    monkeypatch.setattr(trainer_mod, "build_model", lambda rc: _model())
    monkeypatch.setattr(trainer_mod, "default_collate", lambda rc: collate)
    monkeypatch.setattr(trainer_mod, "default_data_factory", lambda *a: RowSource(make_rows(8, seed=5)))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ts, "write_tensors", full)
    assert main(["train", "--config", cfg, "--out", out, "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mindvl train: error: cannot write {out}: no space left on the device (No space left on device); free "
        f"space there or choose another output directory. Files written before this one are intact "
        f"(checkpoints are renamed into place only when complete).")
    assert os.listdir(os.path.join(out, "sft")) == []          # the partial checkpoint was removed
    assert not os.path.exists(os.path.join(out, "latest.json"))
