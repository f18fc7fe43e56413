"""Checkpoint checksums (checkpoint/integrity.py): every writer leaves a checksums.json covering every file;
a byte flipped inside a tensor's data (the header still valid) is named by file and tensor in every load
(resume, load_pretrained behind generate/eval/export, merge, convert) and by the CLI in one line with
exit 2; --no-verify loads it; directories without a manifest load with one info line; a listed file that
is missing is named, a file the manifest does not list is ignored.

    python -m pytest -q tests/checkpoint/test_manifest.py
"""
import json
import logging
import os
import shutil

import crc32c
import mindspore as ms
import numpy as np
import pytest

from mindvl_ms.checkpoint import integrity
from mindvl_ms.checkpoint import trainer_state as ts
from mindvl_ms.checkpoint.hf import convert
from mindvl_ms.checkpoint.integrity import MANIFEST, atomic_dir, read_manifest, skip_verification, \
    verify_checkpoint
from mindvl_ms.checkpoint.io import CheckpointError, RawTensor, read_file, read_header, verified_header, write_tensors
from mindvl_ms.checkpoint.merge import merge
from mindvl_ms.checkpoint.pretrained import load_pretrained, save_pretrained
from mindvl_ms.cli import main
from mindvl_ms.config import load_model_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from tests.support.paths import ROOT
from tests.support.train_tiny import TinyVLM, collate, make_rows

EMB = "model.embed_tokens.weight"
ROWS = make_rows(16, seed=5)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A tiny native MindVL checkpoint written by save_pretrained (with its manifest)."""
    path = str(tmp_path_factory.mktemp("native") / "ck")
    ms.set_seed(0)
    save_pretrained(MindVLModel(load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))), path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d).replace(os.sep, "/")
                  for r, _, fs in os.walk(d) for f in fs if f != MANIFEST)


def _covers_everything(d):
    """The manifest lists every file of the directory, with sizes, and the directory verifies."""
    m = read_manifest(d)
    assert m["algorithm"] == "crc32c" and sorted(m["files"]) == _files(d)
    for rel, e in m["files"].items():
        assert e["bytes"] == os.path.getsize(os.path.join(d, rel))
        if rel.endswith(".safetensors"):
            assert sorted(e["tensors"]) == sorted(read_header(os.path.join(d, rel)))
    assert verify_checkpoint(d, model_only=False) == m
    return m


def _flip(path, tensor):
    """Invert one byte in the middle of `tensor`'s data (the header stays valid)."""
    with open(path, "rb") as f:
        header, start = verified_header(path, f)
    a, b = header[tensor]["data_offsets"]
    pos = start + (a + b) // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    read_header(path)  # still a valid safetensors file


def _named(path, tensor):
    return f"{path}: tensor '{tensor}' fails its checksum"


def _snapshot(d):
    return {os.path.join(r, n): (os.path.getsize(os.path.join(r, n)), os.path.getmtime(os.path.join(r, n)))
            for r, _, fs in os.walk(d) for n in fs}


# -- every writer carries the manifest ---------------------------------------------------------------

def test_save_pretrained_merge_and_convert_write_manifests(native, tmp_path):
    _covers_everything(native)
    ms.set_seed(1)
    model = load_pretrained(MindVLModel, native)
    save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=400_000)
    m = _covers_everything(str(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in m["files"] and len([f for f in m["files"] if "-of-" in f]) > 1
    merge([native, str(tmp_path / "sharded")], str(tmp_path / "merged"), progress=False)
    m = _covers_everything(str(tmp_path / "merged"))
    assert {"merge_record.json", "tokenizer.json", "chat_template.json"} <= set(m["files"])
    assert main(["convert", "ms2hf", str(tmp_path / "merged"), str(tmp_path / "hf")]) == 0
    m = _covers_everything(str(tmp_path / "hf"))  # the processor files are written before the checksums
    assert {"tokenizer.json", "preprocessor_config.json", "chat_template.json", "config.json"} <= set(m["files"])
    assert main(["convert", "hf2ms", str(tmp_path / "hf"), str(tmp_path / "ms"), "--max-shard-mb", "0.3"]) == 0
    _covers_everything(str(tmp_path / "ms"))


def test_tensor_checksums_span_chunk_boundaries(tmp_path, monkeypatch):
    """Per-tensor values equal the CRC32C of each tensor's bytes when tensors cross read chunks."""
    monkeypatch.setattr(integrity, "CHUNK", 1000)
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": RawTensor.of(rng.standard_normal((i * 37 + 1, 5)).astype(np.float32)) for i in range(8)}
    tensors["empty"] = RawTensor.of(np.zeros((0, 4), np.float32))
    with atomic_dir(str(tmp_path / "ck")) as tmp:
        write_tensors(tmp, tensors)
    entry = read_manifest(str(tmp_path / "ck"))["files"]["model.safetensors"]
    fn = str(tmp_path / "ck" / "model.safetensors")
    assert entry["tensors"] == {k: f"{crc32c.crc32c(v.data.tobytes()):08x}" for k, v in read_file(fn).items()}
    assert entry["checksum"] == f"{crc32c.crc32c(open(fn, 'rb').read()):08x}"


# -- training checkpoints: written with the manifest, verified on resume ------------------------------

def _run_cfg():
    return load_run_config(data={"seed": 3, "plot": False, "stages": [dict(
        name="sft", trainable="all", seq_length=28, global_batch_size=2, micro_batch_size=2, max_lr=1e-3,
        epochs=None, max_steps=2, save_every=2)]})


def _train(out, resume=None):
    ms.set_seed(0)
    return run_training(_run_cfg(), out, resume=resume, model=TinyVLM(), progress=False, collate=collate,
                        data_factory=lambda rc, stage, i, dist: RowSource(ROWS, seed=rc.seed))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "run")
    _train(out)
    return out


@pytest.mark.parametrize("which,tensor", [("model.safetensors", "lm_head.weight"),
                                          (ts.OPTIM, None)], ids=["weights", "optimizer"])
def test_resume_names_flipped_tensor(trained, tmp_path, which, tensor):
    out = _copy(trained, tmp_path / "run")
    ck = ts.find_latest(out)
    m = _covers_everything(ck)
    assert {ts.STATE, ts.OPTIM, "model.safetensors"} <= set(m["files"])
    path = os.path.join(ck, which)
    tensor = tensor or sorted(read_header(path), key=lambda k: -read_header(path)[k]["data_offsets"][1])[0]
    _flip(path, tensor)
    before = _snapshot(out)
    with pytest.raises(CheckpointError) as e:
        _train(out, resume=out)
    assert str(e.value).startswith(_named(path, tensor))
    assert _snapshot(out) == before  # nothing changed
    with skip_verification():  # --no-verify: the flipped byte loads
        _train(out, resume=out)


# -- every loader of a model names the flipped tensor -----------------------------------------------

@pytest.fixture
def flipped(native, tmp_path):
    ck = _copy(native, tmp_path / "flipped")
    path = os.path.join(ck, "model.safetensors")
    _flip(path, EMB)
    return ck, path


@pytest.mark.parametrize("load", [
    lambda ck, tmp: load_pretrained(MindVLModel, ck),
    lambda ck, tmp: merge([ck, ck], os.path.join(tmp, "m"), progress=False),
    lambda ck, tmp: convert(ck, os.path.join(tmp, "c"), to="hf"),
], ids=["load_pretrained", "merge", "convert"])
def test_loaders_name_file_and_tensor(flipped, tmp_path, load):
    ck, path = flipped
    with pytest.raises(CheckpointError) as e:
        load(ck, str(tmp_path))
    assert str(e.value).startswith(_named(path, EMB)) and "--no-verify" in str(e.value)
    assert not os.path.exists(tmp_path / "m") and not os.path.exists(tmp_path / "c")
    with skip_verification():
        load(ck, str(tmp_path))


def _bench(tmp):
    p = os.path.join(tmp, "bench.jsonl")
    with open(p, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                + "\n")
    return p


@pytest.mark.parametrize("argv", [
    lambda ck, tmp: ["generate", "--ckpt", ck, "--prompt", "hi"],
    lambda ck, tmp: ["eval", "--ckpt", ck, "--data", _bench(tmp), "--out", os.path.join(tmp, "ev")],
    lambda ck, tmp: ["export", "--ckpt", ck, "--out", os.path.join(tmp, "exported")],
    lambda ck, tmp: ["merge", ck, ck, "--out", os.path.join(tmp, "merged"), "--quiet"],
    lambda ck, tmp: ["convert", "ms2hf", ck, os.path.join(tmp, "converted")],
], ids=["generate", "eval", "export", "merge", "convert"])
def test_cli_one_line_exit_2(flipped, tmp_path, capsys, argv):
    ck, path = flipped
    args = argv(ck, str(tmp_path))
    before = _snapshot(str(tmp_path))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mindvl {args[0]}: error: {_named(path, EMB)}"), err
    assert _snapshot(str(tmp_path)) == before  # nothing written


def test_cli_no_verify_loads(flipped, tmp_path):
    ck, _ = flipped
    assert main(["convert", "ms2hf", ck, str(tmp_path / "c")]) == 2
    assert main(["convert", "ms2hf", ck, str(tmp_path / "c"), "--no-verify"]) == 0
    assert main(["merge", ck, ck, "--out", str(tmp_path / "m"), "--quiet", "--no-verify"]) == 0
    _covers_everything(str(tmp_path / "c"))  # the output's own checksums are those of what was written


def test_train_cli_resume_names_flipped_tensor(trained, tmp_path, capsys):
    out = _copy(trained, tmp_path / "run")
    path = os.path.join(ts.find_latest(out), "model.safetensors")
    _flip(path, "lm_head.weight")
    assert main(["train", "--config", "configs/stage/tiny-cpu.yaml", "--resume", out, "--out", out,
                 "--no-progress"]) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if "error" in e]  # INFO log lines aside
    assert len(err) == 1 and err[0].startswith(f"mindvl train: error: {_named(path, 'lm_head.weight')}"), err


# -- directories without a manifest, missing and extra files, the manifest itself ---------------------

def test_without_manifest_loads_with_one_info_line(native, tmp_path, caplog):
    ck = _copy(native, tmp_path / "old")
    os.remove(os.path.join(ck, MANIFEST))
    _flip(os.path.join(ck, "model.safetensors"), EMB)  # nothing to compare with: loads as before
    with caplog.at_level(logging.INFO, logger="mindvl_ms.checkpoint.integrity"):
        load_pretrained(MindVLModel, ck)
        load_pretrained(MindVLModel, ck)
        merge([ck, ck], str(tmp_path / "m"), progress=False)
    notes = [r for r in caplog.records if r.name == "mindvl_ms.checkpoint.integrity"]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and MANIFEST in notes[0].getMessage()
    _covers_everything(str(tmp_path / "m"))  # what it writes carries one


def test_missing_listed_file_named(native, tmp_path):
    ck = str(tmp_path / "sharded")
    save_pretrained(load_pretrained(MindVLModel, native), ck, max_shard_bytes=400_000)
    shard = os.path.join(ck, sorted(f for f in os.listdir(ck) if "-of-" in f)[-1])
    os.remove(shard)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(MindVLModel, ck)
    assert str(e.value).startswith(f"{shard}: listed in {MANIFEST} but missing")


def test_file_not_in_manifest_ignored(native, tmp_path):
    ck = _copy(native, tmp_path / "ck")
    with open(os.path.join(ck, "inference_config.json"), "w") as f:  # as search-resolution --save adds
        json.dump({"min_pixels": 3136, "max_pixels": 50176}, f)
    assert verify_checkpoint(ck) is not None
    load_pretrained(MindVLModel, ck)


def test_truncated_and_flipped_side_files(native, tmp_path):
    ck = _copy(native, tmp_path / "ck")
    path = os.path.join(ck, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # cut inside the last tensor: the header check names it
        f.truncate(size - 10)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ck)
    assert str(e.value).startswith(f"{path}: tensor '") and "the file ends after" in str(e.value)
    ck2 = _copy(native, tmp_path / "ck2")
    cfg = os.path.join(ck2, "config.json")
    raw = bytearray(open(cfg, "rb").read())
    raw[raw.index(b"mindvl-native") + 7] ^= 0x20  # "mindvl-Native": still valid JSON
    open(cfg, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ck2)
    assert str(e.value).startswith(f"{cfg}: fails its checksum (crc32c ")
    with open(os.path.join(ck2, MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ck2)
    assert str(e.value).startswith(f"{os.path.join(ck2, MANIFEST)}: unreadable checksum manifest")


def test_export_dir_verified_by_runner(tmp_path):
    """The MindIR runner verifies an export directory's checksums before loading its graphs."""
    from mindvl_ms.infer.export import EXPORT_JSON, FORMAT
    from mindvl_ms.infer.mindir_runner import GraphBackend

    out = str(tmp_path / "export")
    with atomic_dir(out) as tmp:
        with open(os.path.join(tmp, EXPORT_JSON), "w") as f:
            json.dump({"format": FORMAT, "graphs": {}}, f)
        os.makedirs(os.path.join(tmp, "prefill_variables"))
        with open(os.path.join(tmp, "prefill_variables", "data_0"), "wb") as f:
            f.write(bytes(range(256)) * 64)
    assert "prefill_variables/data_0" in read_manifest(out)["files"]
    with open(os.path.join(out, "prefill_variables", "data_0"), "r+b") as f:
        f.seek(5000)
        f.write(b"\x00")
    with pytest.raises(CheckpointError) as e:
        GraphBackend(out)
    assert str(e.value).startswith(f"{os.path.join(out, 'prefill_variables', 'data_0')}: fails its checksum")
