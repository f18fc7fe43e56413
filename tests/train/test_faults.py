"""Training faults without the data pipeline (tiny model, in-memory rows): a global batch without a
supervised token is never stepped, a resume on changed data sources stops unless allowed (then the
change is recorded), a full disk during a save is one line and leaves no partial checkpoint.

    python -m pytest -q tests/train/test_faults.py
"""
import errno
import json
import os

import numpy as np
import pytest
import yaml

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.cli import main
from mindvl_ms.train import TrainingStopped, load_run_config, run_training
from mindvl_ms.train import trainer as trainer_mod
from mindvl_ms.train.batches import RowSource
from tests.support.stopped_run import nothing_written as _nothing_written, params as _params
from tests.support.stopped_run import kept_model as _model, snapshot as _snapshot
from tests.support.train_tiny import IGNORE, collate, make_rows


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
