"""Truncated or corrupted safetensors files (faults made on the fly) are named by file and tensor in every
command that loads weights: resume, generate, eval, convert, export; nothing is written or changed.

    python -m pytest -q tests/checkpoint/test_corrupt.py
"""
import dataclasses
import json
import os
import struct

import numpy as np
import pytest

from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.hf import NATIVE
from mindvl_ms.checkpoint.io import CheckpointError, RawTensor, read_header, read_tensors, write_file
from mindvl_ms.cli import main
from mindvl_ms.config.base import read_yaml, load
from mindvl_ms.config.model import MindVLConfig

from tests.support.paths import ROOT  # noqa: E402
EMB = "model.embed_tokens.weight"


def _native_ckpt(d, optimizer=False):
    """A native checkpoint directory: tiny config.json, lm_head.weight [4, 4] (bytes 0..64) and
    model.embed_tokens.weight [1000, 16] float32 (64,000 bytes at 64..64,064)."""
    os.makedirs(d, exist_ok=True)
    cfg = load(MindVLConfig, read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml")))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"format": NATIVE, "config": dataclasses.asdict(cfg)}, f)
    rng = np.random.default_rng(0)
    write_file(os.path.join(d, "model.safetensors"),
               {"lm_head.weight": RawTensor.of(rng.standard_normal((4, 4), np.float32)),
                EMB: RawTensor.of(rng.standard_normal((1000, 16), np.float32))}, {"format": "pt"})
    if optimizer:
        write_file(os.path.join(d, ts.OPTIM), {"m.weight": RawTensor.of(np.zeros((50, 50), np.float32))})
        with open(os.path.join(d, ts.STATE), "w") as f:
            json.dump({"stage_index": 0, "stage": "sft", "step": 2, "stage_done": False}, f)
    return os.path.join(d, "model.safetensors")


def _data_start(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _truncate(path, keep_after_tensor_start):
    """Cut the file so that model.embed_tokens.weight (at data offset 64) keeps only the given bytes."""
    start = _data_start(path)
    with open(path, "r+b") as f:
        f.truncate(start + 64 + keep_after_tensor_start)


def _snapshot(d):
    return {os.path.join(r, n): (os.path.getsize(os.path.join(r, n)), os.path.getmtime(os.path.join(r, n)))
            for r, _, fs in os.walk(d) for n in fs}


def test_truncated_tensor_named_with_bytes_needed_and_available(tmp_path):
    path = _native_ckpt(str(tmp_path / "checkpoint-000021"))
    _truncate(path, 30_000)
    want = f"checkpoint-000021/model.safetensors: tensor '{EMB}' needs 64,000 bytes, the file ends after 30,000"
    for read in (read_tensors, read_header):
        with pytest.raises(CheckpointError) as e:
            read(path)
        assert want in str(e.value)


def test_flipped_header_bytes(tmp_path):
    path = _native_ckpt(str(tmp_path / "ck"))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # header length's high byte flipped: the header cannot fit
        f.seek(5)
        f.write(b"\xff")
    with pytest.raises(CheckpointError) as e:
        read_tensors(path)
    n = struct.unpack("<Q", open(path, "rb").read(8))[0]
    assert str(e.value) == (f"{path}: the header needs {n:,} bytes, the file ends after {size - 8:,} "
                            f"(truncated or not a safetensors file)")
    path = _native_ckpt(str(tmp_path / "ck2"))
    raw = bytearray(open(path, "rb").read())
    i = raw.index(b'"shape":[1000,16]')
    raw[i + 9:i + 13] = b"2000"  # shape [2000, 16] no longer matches its data_offsets span
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        read_tensors(path)
    assert f"{path}: tensor '{EMB}' of shape [2000, 16] F32 needs 128,000 bytes, its data_offsets are " \
           f"[64, 64064] (corrupt header)" == str(e.value)


@pytest.mark.parametrize("argv", [
    lambda ck, tmp: ["generate", "--ckpt", ck, "--prompt", "hi"],
    lambda ck, tmp: ["export", "--ckpt", ck, "--out", os.path.join(tmp, "exported")],
    lambda ck, tmp: ["convert", "ms2hf", ck, os.path.join(tmp, "converted")],
    lambda ck, tmp: ["eval", "--ckpt", ck, "--data", _bench(tmp), "--out", os.path.join(tmp, "ev")],
], ids=["generate", "export", "convert", "eval"])
def test_commands_name_file_and_tensor(tmp_path, capsys, argv):
    ck = str(tmp_path / "checkpoint-000021")
    path = _native_ckpt(ck)
    _truncate(path, 40_000)
    args = argv(ck, str(tmp_path))
    before = _snapshot(str(tmp_path))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mindvl {args[0]}: error: {path}: tensor '{EMB}' needs 64,000 bytes, the file ends after "
                   f"40,000 (truncated: re-copy or re-save the checkpoint)"]
    assert _snapshot(str(tmp_path)) == before  # nothing written


def _bench(tmp):
    p = os.path.join(tmp, "bench.jsonl")
    if not os.path.isfile(p):
        with open(p, "w") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    return p


@pytest.mark.parametrize("which", ["model.safetensors", ts.OPTIM])
def test_resume_from_truncated_checkpoint_changes_nothing(tmp_path, which):
    import mindspore as ms

    from mindvl_ms.train import load_run_config, run_training
    from tests.support.train_tiny import TinyVLM

    out = str(tmp_path / "run")
    ck = os.path.join(out, "sft", "checkpoint-000002")
    _native_ckpt(ck, optimizer=True)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"stage": "sft", "stage_index": 0, "step": 0, "loss": 1.0}\n' * 3)
    path = os.path.join(ck, which)
    if which == ts.OPTIM:  # m.weight: 10,000 bytes at data offset 0; keep 1,234
        with open(path, "r+b") as f:
            f.truncate(_data_start(path) + 1234)
        want = f"{path}: tensor 'm.weight' needs 10,000 bytes, the file ends after 1,234"
    else:
        _truncate(path, 5)
        want = f"{path}: tensor '{EMB}' needs 64,000 bytes, the file ends after 5"
    before = _snapshot(out)
    cfg = load_run_config(data={"plot": False, "stages": [{"name": "sft", "max_steps": 4, "seq_length": 16,
                                                            "global_batch_size": 1}]})
    ms.set_seed(0)
    with pytest.raises(CheckpointError) as e:
        run_training(cfg, out, resume=ck, model=TinyVLM(), data_factory=lambda *a: None, progress=False)
    assert want in str(e.value)
    assert _snapshot(out) == before
