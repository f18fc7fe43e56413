"""Checkpoint merging on native-layout safetensors: maths vs hand/torch references, checks, dtypes, memory.

Run: pytest -q tests/checkpoint/test_merge.py
"""
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mindvl_ms.checkpoint.merge import MergeError, merge
from tests.support import allocator
from tests.support.paths import ROOT


def _ckpt(path, tensors, config=None, shards=None):
    """Write a checkpoint dir: {name: torch tensor}; `shards`: list of key lists -> sharded with an index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or {"model_type": "mindvl", "tag": os.path.basename(path)}, f)
    if not shards:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    wmap = {}
    for i, ks in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in ks}, os.path.join(path, name), metadata={"format": "pt"})
        wmap.update({k: name for k in ks})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wmap}, f)
    return path


def _load_dir(path):
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _random(seed, dtypes=None):
    g = torch.Generator().manual_seed(seed)
    dtypes = dtypes or {}
    shapes = {"visual.blocks.0.attn.qkv.weight": (12, 4), "visual.merger.mlp.0.weight": (8, 16),
              "model.layers.0.mlp.up_proj.weight": (6, 8), "model.norm.weight": (8,), "lm_head.weight": (5, 8)}
    return {k: torch.randn(s, generator=g).to(dtypes.get(k, torch.float32)) for k, s in shapes.items()}


def test_ties_hand_computed(tmp_path):
    base = {"w": torch.zeros(4)}
    t1 = {"w": torch.tensor([1.0, -2.0, 3.0, 0.5])}   # top-2 by magnitude: [0, -2, 3, 0]
    t2 = {"w": torch.tensor([-1.0, 1.5, 4.0, 0.1])}   # [0, 1.5, 4, 0]
    t3 = {"w": torch.tensor([2.0, -3.0, -1.0, 0.2])}  # [2, -3, 0, 0]
    # elected signs of the sum [2, -3.5, 7, 0]: +, -, +, none -> means of agreeing values
    paths = [_ckpt(str(tmp_path / n), t) for n, t in [("a", t1), ("b", t2), ("c", t3), ("base", base)]]
    merge(paths[:3], str(tmp_path / "out"), method="ties", base=paths[3], density=0.5, progress=False)
    got = _load_dir(str(tmp_path / "out"))["w"]
    assert torch.equal(got, torch.tensor([2.0, -2.5, 3.5, 0.0]))


def test_linear_task_arithmetic_sharded_and_side_files(tmp_path):
    ts = [_random(s) for s in range(3)]
    keys = list(ts[0])
    shards = [keys[:2], keys[2:]]
    paths = [_ckpt(str(tmp_path / f"in{i}"), t, shards=shards if i == 0 else None) for i, t in enumerate(ts)]
    with open(os.path.join(paths[0], "preprocessor_config.json"), "w") as f:
        f.write('{"max_pixels": 1003520}')
    with open(os.path.join(paths[0], "trainer_state.json"), "w") as f:
        f.write("{}")
    save_file({"exp_avg.lm_head.weight": torch.zeros(5, 8)}, os.path.join(paths[0], "optimizer.safetensors"))
    rec = merge(paths, str(tmp_path / "lin"), weights=[2, 1, 1], progress=False)
    out = _load_dir(str(tmp_path / "lin"))
    for k in keys:
        ref = (2 * ts[0][k].double() + ts[1][k].double() + ts[2][k].double()) / 4
        torch.testing.assert_close(out[k].double(), ref, rtol=1e-6, atol=1e-6)
    files = sorted(os.listdir(tmp_path / "lin"))
    assert files == ["checksums.json", "config.json", "merge_record.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "preprocessor_config.json"]
    index = json.load(open(tmp_path / "lin" / "model.safetensors.index.json"))
    assert index["weight_map"] == {k: f"model-0000{1 if k in shards[0] else 2}-of-00002.safetensors" for k in keys}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ts[0].values())
    assert json.load(open(tmp_path / "lin" / "config.json"))["tag"] == "in0"
    assert rec["normalised_weights"] == [0.5, 0.25, 0.25]
    saved = json.load(open(tmp_path / "lin" / "merge_record.json"))
    assert [i["weight"] for i in saved["inputs"]] == [2.0, 1.0, 1.0] and saved["method"] == "linear"

    base = _ckpt(str(tmp_path / "base"), _random(7))
    bt = _random(7)
    merge(paths[1:], str(tmp_path / "ta"), method="task_arithmetic", base=base, weights=[0.7, 0.4], scale=0.5,
          progress=False)
    out = _load_dir(str(tmp_path / "ta"))
    for k in keys:
        ref = bt[k].double() + 0.5 * (0.7 * (ts[1][k].double() - bt[k]) + 0.4 * (ts[2][k].double() - bt[k]))
        torch.testing.assert_close(out[k].double(), ref, rtol=1e-5, atol=1e-6)


def test_dtypes_preserved_fp32_accumulation(tmp_path):
    dt = {"visual.blocks.0.attn.qkv.weight": torch.bfloat16, "visual.merger.mlp.0.weight": torch.float16,
          "model.norm.weight": torch.float64}
    ts = [_random(s, dt) for s in range(3)]
    for t in ts:
        t["model.position_ids"] = torch.arange(10, dtype=torch.int64)
    paths = [_ckpt(str(tmp_path / f"in{i}"), t) for i, t in enumerate(ts)]
    merge(paths, str(tmp_path / "out"), progress=False)
    out = _load_dir(str(tmp_path / "out"))
    for k, v in ts[0].items():
        assert out[k].dtype == v.dtype, k
        if v.is_floating_point():
            # torch reference: average in float64, one rounding to the storage dtype
            ref = (sum(t[k].double() for t in ts) / 3).to(v.dtype)
            if v.dtype == torch.float32:  # fp32 accumulation: within an ulp or two of the float64 result
                torch.testing.assert_close(out[k], ref, rtol=3e-7, atol=1e-7)
            else:
                assert torch.equal(out[k], ref), k
    assert torch.equal(out["model.position_ids"], torch.arange(10))
    ts[2]["model.position_ids"][3] = 99
    _ckpt(paths[2], ts[2])
    with pytest.raises(MergeError, match="model.position_ids"):
        merge(paths, str(tmp_path / "out2"), progress=False)
    assert not os.path.exists(tmp_path / "out2")


def test_mismatch_listing_and_bad_arguments(tmp_path):
    a, b = _random(0), _random(1)
    del b["lm_head.weight"]
    b["model.norm.weight"] = torch.zeros(9)
    b["visual.merger.mlp.0.weight"] = b["visual.merger.mlp.0.weight"].half()
    b["extra.bias"] = torch.zeros(2)
    pa, pb = _ckpt(str(tmp_path / "a"), a), _ckpt(str(tmp_path / "b"), b)
    with pytest.raises(MergeError) as e:
        merge([pa, pb], str(tmp_path / "out"), progress=False)
    msg = str(e.value)
    assert "1 key(s) missing, e.g. lm_head.weight" in msg and "1 extra key(s), e.g. extra.bias" in msg
    assert "model.norm.weight: F32[8]" in msg and "F32[9]" in msg
    assert "visual.merger.mlp.0.weight: F32[8, 16]" in msg and "F16[8, 16]" in msg
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(MergeError, match="needs --base"):
        merge([pa, pa], str(tmp_path / "o"), method="ties")
    with pytest.raises(MergeError, match="2 weight"):
        merge([pa, pa, pa], str(tmp_path / "o"), weights=[1, 2])
    with pytest.raises(MergeError, match="matches no tensor"):
        merge([pa, pa], str(tmp_path / "o"), only=["language_model."])
    with pytest.raises(MergeError, match="exists and is not empty"):
        merge([pa, pa], pb)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # no partial output left behind


def test_only_prefix_merges_llm_with_base_llm(tmp_path):
    vlm = _random(0)
    llm = {k: v for k, v in _random(1).items() if k.startswith("model.layers")}  # an LLM-only checkpoint
    pv, pl = _ckpt(str(tmp_path / "vlm"), vlm), _ckpt(str(tmp_path / "llm"), llm)
    rec = merge([pv, pl], str(tmp_path / "out"), only=["model.layers"], progress=False)
    out = _load_dir(str(tmp_path / "out"))
    assert rec["merged_tensors"] == 1 and rec["copied_tensors"] == 4
    k = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(out[k], (vlm[k] + llm[k]) / 2)
    for key in vlm:
        if key != k:
            assert torch.equal(out[key], vlm[key]), key


def test_streaming_memory_is_not_n_checkpoints(tmp_path):
    """3 x 96 MB inputs: the merge's peak RSS growth (a few chunks per merging thread, whatever the
    checkpoint's size) stays well under one checkpoint."""
    g = np.random.default_rng(0)
    paths = []
    for i in range(3):
        t = {f"layer.{j}.weight": torch.from_numpy(g.standard_normal((1024, 1024), dtype=np.float32))
             for j in range(24)}
        paths.append(_ckpt(str(tmp_path / f"in{i}"), t))
    size = os.path.getsize(os.path.join(paths[0], "model.safetensors"))
    code = ("import sys, json; import mindvl_ms.checkpoint.merge as m\n"
            "def hwm():\n"  # peak RSS (KiB) of this process image; ru_maxrss would inherit the parent's
            "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
            "m.CHUNK = 1 << 18\n"  # 1 MiB chunks: the bound below is then far from the N-checkpoint case
            "before = hwm()\n"
            "m.merge(sys.argv[2:], sys.argv[1], progress=False)\n"
            "print(json.dumps([before, hwm()]))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")] + paths, capture_output=True,
                         text=True, check=True, cwd=ROOT, env=allocator.system_env())  # glibc's malloc, as a user's
    before, peak = json.loads(res.stdout.strip().splitlines()[-1])
    grown = (peak - before) * 1024  # KiB -> bytes
    assert grown < 0.4 * size, (grown, size)  # loading all three: 3 x size
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        x = f.get_tensor("layer.5.weight")
    ref = sum(load_file(os.path.join(p, "model.safetensors"))["layer.5.weight"].double() for p in paths) / 3
    np.testing.assert_allclose(x, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_cli_merge(tmp_path, capsys):
    from mindvl_ms import cli

    a, b = _random(0), _random(1)
    pa, pb = _ckpt(str(tmp_path / "a"), a), _ckpt(str(tmp_path / "b"), b)
    assert cli.main(["merge", pa, pb, "--out", str(tmp_path / "m"), "--weights", "1", "3", "--quiet"]) == 0
    out = _load_dir(str(tmp_path / "m"))
    torch.testing.assert_close(out["lm_head.weight"], 0.25 * a["lm_head.weight"] + 0.75 * b["lm_head.weight"])
    assert "5 tensors merged" in capsys.readouterr().out
    assert cli.main(["merge", pa, "--out", str(tmp_path / "t"), "--method", "ties"]) == 2
    assert "needs --base" in capsys.readouterr().err


def _ties_torch(base, xs, w, density, scale):
    """TIES per tensor (Yadav et al. 2023; weighted as in mergekit), vectorised in torch."""
    trimmed = []
    for x in xs:
        t = (x - base).double()
        k = math.ceil(density * t.numel())
        thr = t.abs().flatten().topk(k).values.min()
        trimmed.append(torch.where(t.abs() >= thr, t, torch.zeros_like(t)))
    T = torch.stack(trimmed)
    W = torch.tensor(w, dtype=torch.float64).view(-1, *([1] * base.dim()))
    sign = torch.sign((W * T).sum(0))
    agree = (torch.sign(T) == sign) & (T != 0)
    merged = (W * T * agree).sum(0) / (W * agree).sum(0).clamp(min=1e-300)
    return base.double() + scale * merged


def test_ties_and_chunking_against_torch(tmp_path, monkeypatch):
    import mindvl_ms.checkpoint.merge as merge_mod

    monkeypatch.setattr(merge_mod, "CHUNK", 7)  # many chunks per tensor, thresholds still per whole tensor
    ts = [_random(s) for s in range(4)]
    paths = [_ckpt(str(tmp_path / f"in{i}"), t) for i, t in enumerate(ts)]
    merge(paths[1:], str(tmp_path / "ties"), method="ties", base=paths[0], weights=[1.0, 0.5, 2.0], density=0.3,
          scale=0.8, progress=False)
    merge(paths[1:], str(tmp_path / "lin"), progress=False)
    ties, lin = _load_dir(str(tmp_path / "ties")), _load_dir(str(tmp_path / "lin"))
    for k in ts[0]:
        ref = _ties_torch(ts[0][k], [t[k] for t in ts[1:]], [1.0, 0.5, 2.0], 0.3, 0.8)
        torch.testing.assert_close(ties[k].double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin[k].double(), sum(t[k].double() for t in ts[1:]) / 3, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ties["lm_head.weight"], lin["lm_head.weight"])


def test_bare_safetensors_files(tmp_path):
    a, b = _random(0), _random(1)
    save_file(a, str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
    save_file(b, str(tmp_path / "b.safetensors"), metadata={"format": "pt"})
    (tmp_path / "notes.txt").write_text("not part of a checkpoint")
    merge([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")], str(tmp_path / "m"), progress=False)
    assert sorted(os.listdir(tmp_path / "m")) == ["a.safetensors", "checksums.json", "merge_record.json"]
    out = load_file(str(tmp_path / "m" / "a.safetensors"))
    torch.testing.assert_close(out["model.norm.weight"], (a["model.norm.weight"] + b["model.norm.weight"]) / 2)


def test_inputs_verified_as_read_once(tmp_path, monkeypatch):
    """A merge of checkpoints with checksums.json reads their tensor bytes once: each tensor's CRC32C is
    checked from the chunks the merge reads (no verifying pass over the safetensors files first), and a
    byte flipped in the middle of a tensor, past several chunks, is still named with file and tensor."""
    import mindvl_ms.checkpoint.integrity as integrity
    import mindvl_ms.checkpoint.merge as merge_mod
    from mindvl_ms.checkpoint.io import CheckpointError

    monkeypatch.setattr(merge_mod, "CHUNK", 7)  # every tensor spans several chunks
    a, b = _random(0), _random(1)
    pa, pb = _ckpt(str(tmp_path / "a"), a), _ckpt(str(tmp_path / "b"), b)
    merge([pa, pb], str(tmp_path / "m1"), progress=False)  # written with checksums.json
    m1 = str(tmp_path / "m1")
    streamed = []
    real_stream = integrity._stream
    monkeypatch.setattr(integrity, "_stream", lambda p: (streamed.append(p), real_stream(p))[1])
    merge([m1, m1], str(tmp_path / "m2"), weights=[1, 3], progress=False)
    assert not [p for p in streamed if p.endswith(".safetensors")], streamed  # before: both inputs, in full
    got = _load_dir(str(tmp_path / "m2"))
    for k in a:  # the weighted mean of two equal inputs is the input; m1 is the mean of a and b
        ref = (a[k].double() + b[k].double()) / 2
        torch.testing.assert_close(got[k].double(), ref, rtol=1e-6, atol=1e-7)

    key = "visual.blocks.0.attn.qkv.weight"  # 48 float32 elements: 7 chunks
    path = os.path.join(m1, "model.safetensors")
    with safe_open(path, "np") as f:
        assert key in f.keys()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    at = 8 + n + header[key]["data_offsets"][0] + 4 * 30  # element 30 of 48: the fifth chunk
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError) as e:
        merge([m1, pa], str(tmp_path / "m3"), progress=False)
    assert str(e.value).startswith(f"{path}: tensor '{key}' fails its checksum (crc32c "), str(e.value)
    assert not os.path.exists(tmp_path / "m3")


def test_bf16_rounding_matches_torch_bit_for_bit():
    """from_float's bf16 rounding (round to nearest even on the upper half of each word, NaN as 0x7FC0) on
    random float32 bit patterns, ties, infinities and NaNs, against torch's own float32 -> bfloat16; no
    warning when a chunk's sum overflows (the NaN check sums the chunk)."""
    from mindvl_ms.checkpoint.merge import from_float

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 200_003, dtype=np.uint64).astype(np.uint32)
    bits[:4096] = (bits[:4096] & 0xFFFF0000) | 0x8000  # exact ties: the even neighbour wins
    x = bits.view(np.float32)
    x[5000:5010] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, -1e-40]
    assert np.isnan(x).sum() > 100  # random patterns hold NaNs of many payloads too
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    want[nan] = 0x7FC0  # torch's CPU conversion writes 0xFFFF for a NaN here; any NaN is one, merge writes 0x7FC0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = from_float(x.copy(), "BF16", reuse=True)
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    with np.errstate(invalid="ignore"):  # NaN payloads widened to float64
        wide = x.astype(np.float64)
    assert np.array_equal(from_float(wide, "BF16"), want)  # from a float64 sum too


def test_threaded_chunks_match_numpy_mean_and_corruption_is_named(tmp_path, monkeypatch):
    """Chunks merged on the pool threads (many in flight, written in order) give the bytes of a numpy
    reference: the float64 weighted mean rounded once to float32 (power-of-two weights, so the weighted
    inputs are exact in float32), and for bf16 the mean of two inputs (exact in float32) rounded by
    torch; a byte flipped in a middle chunk of an input is still named."""
    import threading

    import mindvl_ms.checkpoint.merge as merge_mod
    from mindvl_ms.checkpoint.io import CheckpointError

    monkeypatch.setattr(merge_mod, "CHUNK", 64)  # 1000-element tensors: 16 chunks each, several in flight
    threads = set()
    real_chunk = merge_mod._merge_chunk
    monkeypatch.setattr(merge_mod, "_merge_chunk",
                        lambda *a: (threads.add(threading.current_thread().name), real_chunk(*a))[1])
    g = torch.Generator().manual_seed(7)
    shapes = {"a.weight": (40, 25), "b.weight": (1000,), "c.bias": (3,), "d.weight": (25, 40)}
    ins = [{k: torch.randn(s, generator=g) * (1 + 9 * i) for k, s in shapes.items()} for i in range(3)]
    f32 = [_ckpt(str(tmp_path / f"f{i}"), t) for i, t in enumerate(ins)]
    merge(f32, str(tmp_path / "m32"), weights=[1.0, 2.0, 4.0], progress=False)  # w * x exact in float32
    got = _load_dir(str(tmp_path / "m32"))
    for k in shapes:
        want = sum(wi * t[k].numpy().astype(np.float64) for wi, t in zip([1.0, 2.0, 4.0], ins)) / 7.0
        assert np.array_equal(got[k].numpy().view(np.uint32), want.astype(np.float32).view(np.uint32)), k
    assert threads and not any(t == threading.main_thread().name for t in threads), threads

    bf = [_ckpt(str(tmp_path / f"b{i}"), {k: v.to(torch.bfloat16) for k, v in t.items()})
          for i, t in enumerate(ins[:2])]
    merge(bf, str(tmp_path / "m16"), progress=False)
    got = _load_dir(str(tmp_path / "m16"))
    for k in shapes:
        mean = (ins[0][k].to(torch.bfloat16).double() + ins[1][k].to(torch.bfloat16).double()) / 2
        want = mean.float().to(torch.bfloat16)
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k].view(torch.int16), want.view(torch.int16)), k

    path = os.path.join(str(tmp_path / "m16"), "model.safetensors")  # written with checksums.json
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    at = 8 + n + header["b.weight"]["data_offsets"][0] + 2 * 520  # element 520 of 1000: chunk 9 of 16
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError) as e:
        merge([bf[0], str(tmp_path / "m16")], str(tmp_path / "m3"), progress=False)
    assert str(e.value).startswith(f"{path}: tensor 'b.weight' fails its checksum (crc32c "), str(e.value)
    assert not os.path.exists(tmp_path / "m3")
