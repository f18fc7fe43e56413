"""Pruning old training checkpoints never leaves a half-deleted `checkpoint-*` directory: a crash in the
middle of the deletion leaves only a temporary directory, which the next start removes.
Run: pytest -q tests/checkpoint/test_prune.py"""
import os
import shutil

import pytest

from mindvl_ms.checkpoint import trainer_state as ts


def _checkpoints(stage_dir, steps):
    for s in steps:
        d = stage_dir / f"checkpoint-{s:06d}"
        d.mkdir()
        for name in ("model.safetensors", "optimizer.safetensors", "trainer_state.json"):
            (d / name).write_bytes(b"x" * 64)


def test_prune_keeps_the_newest_and_the_protected(tmp_path):
    _checkpoints(tmp_path, [20, 40, 60, 80])
    ts.prune(str(tmp_path), 2, protect=str(tmp_path / "checkpoint-000020"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000020", "checkpoint-000060", "checkpoint-000080"]


def test_a_crash_during_the_deletion_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    _checkpoints(tmp_path, [20, 40, 60])
    real = shutil.rmtree

    def dies_after_one_file(path, ignore_errors=False):
        if os.path.isdir(path) and os.listdir(path):
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            raise KeyboardInterrupt("killed mid-delete")
        return real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ts.shutil, "rmtree", dies_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        ts.prune(str(tmp_path), 2)
    monkeypatch.setattr(ts.shutil, "rmtree", real)
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-000040", "checkpoint-000060"]
    for n in names:
        if n.startswith("checkpoint-"):
            assert len(os.listdir(tmp_path / n)) == 3  # whole
    assert ts.clean_partial(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000040", "checkpoint-000060"]
