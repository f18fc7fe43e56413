"""`report_to: [tensorboard]`: the step records and the run summary as TensorBoard event files in
OUT/tensorboard/, read back here from the raw TFRecord files with the Event protobuf tensorboardX ships
(length, masked CRC-32C of the length, Event bytes, masked CRC-32C of the bytes).

A tiny two-stage run on the trainer tests' stand-in model: every logged step's loss, LR, gradient norm
and tokens/s equal metrics.jsonl's values at the step counted over the run, and the summary's MFU is
there; without `report_to` no event file is written; a stage that stops on non-finite steps closes its
writer with the logged steps on disk, and its resume hides the steps past the checkpoint as
metrics.jsonl drops them; an unknown target is a config error naming the key and the accepted values.
"""
import json
import os
import struct

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c

from mindvl_ms.config.base import ConfigError
from mindvl_ms.train import TrainingStopped, load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from mindvl_ms.train.callbacks import TensorBoardLog
from tests.support.stopped_run import kept_model as model  # one network: its runs restart the step kept on it
from tests.support.train_tiny import collate, make_rows

ROWS = make_rows(48, seed=5)
STAGE = dict(trainable="all", seq_length=28, global_batch_size=4, micro_batch_size=2, max_lr=5e-3,
             warmup_ratio=0.25, epochs=None, max_steps=3)


def run_cfg(stages, **run):
    return load_run_config(data={"seed": 3, "plot": False, "stages": stages, **run})


def factory(rc, stage, i, dist):
    return RowSource(ROWS, seed=rc.seed + i)


def read_events(path):
    """Every Event of one event file, each record's two CRCs checked."""
    with open(path, "rb") as f:
        data = f.read()
    events, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12:pos + 12 + n]
        assert struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(body)
        ev = Event()
        ev.ParseFromString(body)
        events.append(ev)
        pos += 16 + n
    return events


def read_scalars(logdir):
    """{tag: {step: value}} as TensorBoard shows it: files in name order, and a SessionLog START at step s
    drops every value at a step >= s read before it (a step logged twice otherwise fails here)."""
    scalars = {}
    for name in sorted(os.listdir(logdir)):
        assert name.startswith("events.out.tfevents."), name
        for ev in read_events(os.path.join(logdir, name)):
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                scalars = {t: {s: v for s, v in pts.items() if s < ev.step} for t, pts in scalars.items()}
            for val in ev.summary.value:
                pts = scalars.setdefault(val.tag, {})
                assert ev.step not in pts, f"{val.tag} logged twice at step {ev.step}"
                pts[ev.step] = val.simple_value
    return scalars


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def run_steps(recs):
    """Each record's step counted over the run: a stage starts one past the last step of the one before."""
    offset, ends = {}, {}
    for r in recs:
        ends[r["stage_index"]] = r["step"]
    for i in sorted(ends):
        offset[i] = sum(ends[j] + 1 for j in ends if j < i)
    return [offset[r["stage_index"]] + r["step"] for r in recs]


def assert_matches_jsonl(out, keys=("loss", "lr", "grad_norm", "tokens_per_s", "stage_index")):
    recs, scalars = records(out), read_scalars(os.path.join(out, "tensorboard"))
    steps = run_steps(recs)
    for key in keys:
        assert sorted(scalars[key]) == steps, key  # exactly the logged steps
        logged = np.array([scalars[key][s] for s in steps], np.float32)
        assert np.array_equal(logged, np.array([r[key] for r in recs], np.float32), equal_nan=True), key
    return recs, scalars


def test_event_file_holds_every_logged_step(tmp_path):
    out = str(tmp_path / "tb")
    stages = [dict(STAGE, name="warmup", log_every=2), dict(STAGE, name="sft", max_steps=4)]
    summary = run_training(run_cfg(stages, report_to=["tensorboard"]), out, model=model(), data_factory=factory,
                           collate=collate, progress=False)
    recs, scalars = assert_matches_jsonl(out)
    # warm-up logs its steps 0 and 2 (log_every 2, and always its last), so sft's steps 0..3 are 3..6
    assert [(r["stage"], r["step"]) for r in recs] == [("warmup", 0), ("warmup", 2)] + [("sft", i) for i in range(4)]
    assert sorted(scalars["loss"]) == [0, 2, 3, 4, 5, 6]
    assert scalars["summary/mfu"] == {6: np.float32(summary["mfu"])}
    assert scalars["summary/tokens_per_s"] == {6: np.float32(summary["tokens_per_s"])}
    assert "step" not in scalars and "applied" not in scalars  # the x axis, and a flag rather than a figure


def test_no_event_file_without_report_to(tmp_path):
    out = str(tmp_path / "plain")
    run_training(run_cfg([dict(STAGE, name="sft", max_steps=2)]), out, model=model(), data_factory=factory,
                 collate=collate, progress=False)
    assert records(out)
    assert not os.path.exists(os.path.join(out, "tensorboard"))
    assert not [f for _, _, files in os.walk(out) for f in files if "tfevents" in f]


def test_stopped_stage_closes_its_writer_and_resume_hides_the_dropped_steps(tmp_path):
    out = str(tmp_path / "stopped")
    cfg = run_cfg([dict(STAGE, name="sft", max_steps=6, save_every=1, max_nonfinite=2)], report_to=["tensorboard"])
    calls = {"n": 0}

    def poisoned(rows, stage):
        arrays = collate(rows, stage)
        calls["n"] += 1
        if calls["n"] > 4:  # 2 micro-batches per step: steps 2, 3, ... see NaN inputs
            arrays["pixel_values"][:] = np.nan
        return arrays

    with pytest.raises(TrainingStopped, match="2 steps in a row had a non-finite"):
        run_training(cfg, out, model=model(), data_factory=factory, collate=poisoned, progress=False)
    recs, scalars = assert_matches_jsonl(out)  # on disk: the writer was flushed and closed
    assert [r["step"] for r in recs] == [0, 1, 2, 3] and np.isnan(scalars["loss"][3])

    run_training(cfg, out, resume=out, model=model(), data_factory=factory, collate=collate, progress=False)
    recs, scalars = assert_matches_jsonl(out)  # step 3 of the stopped run (NaN) is hidden, the resumed one kept
    assert [r["step"] for r in recs] == list(range(6)) and np.isfinite(scalars["loss"][3])
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 3  # stopped stage, resumed stage, summary


def test_two_logs_of_one_process_in_one_second_keep_both_files(tmp_path, monkeypatch):
    """A stopped run and its resume in one process can open their event files within one second (tensorboardX
    names files by the second): both files stay, each with its own step."""
    import tensorboardX.event_file_writer as efw

    monkeypatch.setattr(efw.time, "time", lambda: 1_800_000_000.0)  # the same second for every file
    for loss in (1.0, 2.0):
        log = TensorBoardLog(str(tmp_path))
        log.write({"stage_index": 0, "step": int(loss), "loss": loss})
        log.close()
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2
    assert [[v.simple_value for e in read_events(os.path.join(tmp_path, f)) for v in e.summary.value
             if v.tag == "loss"] for f in files] == [[1.0], [2.0]]


def test_unknown_report_target_is_a_config_error():
    with pytest.raises(ConfigError, match=r"report_to: unknown \['wandb'\]; accepted values: \['tensorboard'\]"):
        run_cfg([dict(STAGE, name="sft")], report_to=["tensorboard", "wandb"])
    assert run_cfg([dict(STAGE, name="sft")]).report_to == []
