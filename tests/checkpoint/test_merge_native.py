"""Merging native MindVL checkpoints written by `save_pretrained`: the result loads with `from_pretrained`
and its parameters equal the numpy average of the inputs (bf16 inputs stay bf16).

Run: pytest -q tests/checkpoint/test_merge_native.py
"""
import os

import mindspore as ms
import numpy as np
import torch

from mindvl_ms.checkpoint.hf import write_checkpoint
from mindvl_ms.checkpoint.pretrained import load_pretrained, model_tensors, save_pretrained
from mindvl_ms.checkpoint.io import read_tensors
from mindvl_ms.checkpoint.merge import merge
from mindvl_ms.config import load_model_config
from mindvl_ms.models.mindvl import MindVLModel

from tests.support.paths import ROOT  # noqa: E402


def _config():
    return load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))


def _torch_bf16(bits):
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def test_native_sft_variants_merge_and_load(tmp_path):
    cfg = _config()
    params = []
    for seed in range(3):
        ms.set_seed(seed)
        m = MindVLModel(cfg)
        save_pretrained(m, str(tmp_path / f"sft{seed}"), max_shard_bytes=400_000 if seed == 0 else None)
        params.append({k: v for k, v in model_tensors(m).items()})
    k0 = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(params[0][k0].data, params[1][k0].data)  # different random inits
    rec = merge([str(tmp_path / f"sft{i}") for i in range(3)], str(tmp_path / "merged"), progress=False)
    assert rec["merged_tensors"] == len(params[0]) and rec["copied_tensors"] == 0
    loaded = load_pretrained(MindVLModel, str(tmp_path / "merged"))
    got = model_tensors(loaded)
    assert set(got) == set(params[0])
    for k, t in got.items():
        ref = sum(p[k].float32().astype(np.float64) for p in params) / 3
        np.testing.assert_allclose(t.float32(), ref, rtol=1e-6, atol=1e-7, err_msg=k)
    assert os.path.isfile(tmp_path / "merged" / "model.safetensors.index.json")


def test_native_bf16_checkpoint_stays_bf16(tmp_path):
    cfg = _config()
    tensors = []
    for seed in range(2):
        ms.set_seed(10 + seed)
        m = MindVLModel(cfg)
        ts = model_tensors(m, dtype="BF16")
        write_checkpoint(str(tmp_path / f"b{seed}"), cfg, ts)
        tensors.append(ts)
    merge([str(tmp_path / "b0"), str(tmp_path / "b1")], str(tmp_path / "m"), weights=[3, 1], progress=False)
    out = read_tensors(str(tmp_path / "m"))
    for k, t in out.items():
        assert t.dtype == "BF16", k
        a, b = (_torch_bf16(ts[k].data).double() for ts in tensors)
        want = (0.75 * a + 0.25 * b).to(torch.bfloat16)  # torch's own bf16 rounding as the reference
        assert torch.equal(_torch_bf16(t.data), want), k
