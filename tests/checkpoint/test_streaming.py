"""Checkpoints of real size: sharded output round trips bit for bit, loads place each tensor once, and
convert / merge / load stay within their memory bounds (peaks measured in child processes).

The memory tests use a ~300 MB bf16 checkpoint (150M parameters, fp32 model 0.6 GB): big enough that a
second copy of the checkpoint or of the model shows, small enough for a shared CI machine.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import allocator
from tests.support import hf_tiny as hf_tiny
from mindvl_ms.checkpoint.hf import read_config_json
from mindvl_ms.checkpoint.integrity import atomic_dir, read_manifest, verify_checkpoint
from mindvl_ms.checkpoint.io import INDEX, SINGLE, TensorSpec, read_header, read_tensors, weight_files, \
    write_sharded
from mindvl_ms.checkpoint.merge import merge
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.cli import main
from mindvl_ms.config import MindVLConfig, TextConfig
from mindvl_ms.config.model import VisionConfig
from mindvl_ms.models.mindvl import MindVLModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = "visual.patch_embed.proj.weight"


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].data.tobytes() == b[k].data.tobytes(), k


def _shards(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_tiny.tiny_qwen2_5_vl(tmp_path_factory.mktemp("hf"))[0]


def test_sharded_convert_round_trips_bit_exact(hf_dir, tmp_path):
    src = read_tensors(hf_dir)
    limit = 40_000  # bytes: the tiny model's ~190 KB of weights over several shards
    assert main(["convert", "hf2ms", hf_dir, str(tmp_path / "ms"), "--max-shard-mb", str(limit / 2 ** 20)]) == 0
    ms_dir = str(tmp_path / "ms")
    shards = _shards(ms_dir)
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(os.path.join(ms_dir, INDEX)) as f:
        index = json.load(f)
    files = weight_files(ms_dir)
    assert {k: os.path.basename(v) for k, v in files.items()} == index["weight_map"]
    sizes = {fn: sum(np.prod(h["shape"], dtype=np.int64) * 4 for h in read_header(os.path.join(ms_dir, fn)).values())
             for fn in shards}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for fn, n in sizes.items():  # a shard over the limit holds one tensor bigger than the limit
        assert n <= limit or len(read_header(os.path.join(ms_dir, fn))) == 1, fn
    native = read_tensors(ms_dir)
    assert native[PATCH].data.tobytes() == src[PATCH].data.tobytes() and native[PATCH].shape == (32, 1176)
    _same({k: v for k, v in src.items() if k != PATCH}, {k: v for k, v in native.items() if k != PATCH})
    m = verify_checkpoint(ms_dir)  # every shard and the index carry their checksums
    assert set(shards) | {INDEX, "config.json"} <= set(m["files"])
    # back to HF in one file (0: no sharding), and in shards again: the source's bytes both times
    assert main(["convert", "ms2hf", ms_dir, str(tmp_path / "hf1"), "--max-shard-mb", "0"]) == 0
    assert _shards(str(tmp_path / "hf1")) == [SINGLE]
    _same(src, read_tensors(str(tmp_path / "hf1")))
    assert main(["convert", "ms2hf", ms_dir, str(tmp_path / "hfs"), "--max-shard-mb", str(limit / 2 ** 20)]) == 0
    _same(src, read_tensors(str(tmp_path / "hfs")))
    # a sharded checkpoint loads as the single-file one does
    a = load_pretrained(MindVLModel, ms_dir)
    b = load_pretrained(MindVLModel, str(tmp_path / "hf1"))
    for (ka, pa), (kb, pb) in zip(a.parameters_and_names(), b.parameters_and_names()):
        assert ka == kb and np.array_equal(pa.asnumpy(), pb.asnumpy()), ka
        assert np.array_equal(pa.asnumpy(), native[ka].float32()), ka


def test_copied_spans_and_arrays_land_in_order(tmp_path, monkeypatch):
    """The streamed writer copies file spans through two alternating buffers written by a background
    thread while the next chunk is read, with in-memory arrays between them: with 5-byte buffers (many
    turns per tensor) the file holds every tensor's bytes where its header says, and the checksums
    recorded on the way equal a fresh pass over the written file."""
    import mindvl_ms.checkpoint.io as io
    from mindvl_ms.checkpoint.integrity import safetensors_checksums

    monkeypatch.setattr(io, "COPY_CHUNK", 5)
    rng = np.random.default_rng(0)
    ref = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([1, 7, 33, 2, 64, 3])}
    src = str(tmp_path / "src.safetensors")
    io.write_file(src, {k: io.RawTensor.of(v) for k, v in ref.items()})
    out = str(tmp_path / "out.safetensors")
    specs = [TensorSpec(k, "F32", v.shape) for k, v in ref.items()]
    with io.TensorFile(src) as tf:  # even tensors copied from the file, odd ones handed over as arrays
        io.write_stream(out, specs, lambda k: tf.span(k) if int(k[1:]) % 2 == 0 else ref[k].copy())
    got = io.read_file(out)
    assert list(io.read_header(out)) == list(ref)
    for k, v in ref.items():
        assert got[k].data.tobytes() == v.tobytes(), k
    value, size, tensors = safetensors_checksums(out)
    entry = io.written_entry(out)
    assert entry["bytes"] == size == os.path.getsize(out) and entry["checksum"] == f"{value:08x}"
    assert entry["tensors"] == {k: f"{v:08x}" for k, v in tensors.items()}


def test_merge_regroups_one_large_file_into_shards(hf_dir, tmp_path):
    ms1 = str(tmp_path / "one")
    assert main(["convert", "hf2ms", hf_dir, ms1, "--max-shard-mb", "0"]) == 0
    assert _shards(ms1) == [SINGLE]
    out = str(tmp_path / "merged")
    rec = merge([ms1, ms1], out, progress=False, max_shard_bytes=50_000)
    assert rec["merged_tensors"] == len(read_tensors(ms1))
    assert len(_shards(out)) > 2 and os.path.isfile(os.path.join(out, INDEX))
    _same(read_tensors(ms1), read_tensors(out))  # the mean of two equal fp32 inputs is the input, bit for bit
    verify_checkpoint(out)
    # a sharded first input keeps its shards (and index) when none is over the limit
    out2 = str(tmp_path / "merged2")
    merge([out, ms1], out2, progress=False, max_shard_bytes=50_000)
    assert _shards(out2) == _shards(out)
    with open(os.path.join(out, INDEX)) as f1, open(os.path.join(out2, INDEX)) as f2:
        assert json.load(f1)["weight_map"] == json.load(f2)["weight_map"]
    _same(read_tensors(ms1), read_tensors(out2))


def test_bf16_load_places_exact_values_in_requested_dtype(hf_dir, tmp_path):
    """bf16 widened to float32 exactly (torch agrees) and float16 casts per tensor, one parameter each."""
    import mindspore as ms
    import torch

    src = read_tensors(hf_dir)
    bf = str(tmp_path / "bf")
    with atomic_dir(bf) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(read_config_json(hf_dir), f)
        bits = {k: torch.from_numpy(v.float32()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                for k, v in src.items()}
        write_sharded(tmp, [TensorSpec(k, "BF16", v.shape) for k, v in bits.items()], bits.__getitem__, 60_000)
    model = load_pretrained(MindVLModel, bf)
    model16 = load_pretrained(MindVLModel, bf, dtype=ms.float16)
    params16 = dict(model16.parameters_and_names())
    for name, p in model.parameters_and_names():
        ref = torch.from_numpy(src[name].float32()).to(torch.bfloat16).float().numpy().reshape(p.shape)
        assert p.dtype == ms.float32 and np.array_equal(p.asnumpy(), ref), name
        assert params16[name].dtype == ms.float16 and np.array_equal(params16[name].asnumpy(), ref.astype(np.float16))


# -- memory, measured in child processes -------------------------------------------------------------

def _mid_config():
    vision = VisionConfig(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=1024,
                          fullatt_block_indexes=[1])
    text = TextConfig(model_type="qwen2", vocab_size=16000, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                      attention_bias=True, use_qk_norm=False, tie_word_embeddings=True)
    return MindVLConfig(vision=vision, text=text, image_token_id=15000, video_token_id=15001,
                        vision_start_token_id=15002, vision_end_token_id=15003)


@pytest.fixture(scope="module")
def mid_ckpt(tmp_path_factory):
    """A native bf16 checkpoint of `_mid_config` (~300 MB, 100 MB shards), random values."""
    import dataclasses

    from mindspore.nn.utils import no_init_parameters

    cfg = _mid_config()
    with no_init_parameters():
        model = MindVLModel(cfg)
    shapes = {k: tuple(p.shape) for k, p in model.parameters_and_names()}
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("mid") / "ms")
    with atomic_dir(path) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"format": "mindvl-native", "config": dataclasses.asdict(cfg)}, f)
        # bf16 bits of values in about [-0.03, 0.03] (exponent 0x3c..0x3d): finite, small
        write_sharded(tmp, [TensorSpec(k, "BF16", s) for k, s in shapes.items()],
                      lambda k: (rng.integers(0x3C00, 0x3D00, shapes[k], dtype=np.uint16)
                                 | (rng.integers(0, 2, shapes[k], dtype=np.uint16) << 15)), 100 << 20)
    n = sum(int(np.prod(s)) for s in shapes.values())
    return path, n


CHILD = """
import json, sys
import numpy as np
import mindspore as ms
from mindvl_ms.checkpoint.hf import convert
from mindvl_ms.checkpoint.pretrained import load_pretrained
from mindvl_ms.models.mindvl import MindVLModel
def status(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
what, src, dst = sys.argv[1:4]
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # peak RSS (VmHWM) restarts from the current RSS: the imports' own peak is not counted
base = status('VmRSS')
if what == 'load':
    model = load_pretrained(MindVLModel, src)
    n = sum(int(np.prod(p.shape)) for p in model.get_parameters())
else:
    n = convert(src, dst, to='hf', max_shard_bytes=int(dst.rsplit('_', 1)[1]))['parameters']
print(json.dumps({'base': base, 'peak': status('VmHWM'), 'params': n}))
"""


def _child(*args):
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=ROOT,
                         env=allocator.system_env(dict(os.environ, PYTHONPATH=ROOT)))  # glibc's malloc, as a user's
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_peak_is_about_the_fp32_model(mid_ckpt):
    """from_pretrained's memory above the process before it: at most 1.3x the float32 model (the model
    itself plus about one tensor in flight), not the checkpoint and the model side by side."""
    path, n = mid_ckpt
    got = _child("load", path, "-")
    assert got["params"] == n
    added, fp32 = got["peak"] - got["base"], 4 * n
    print(f"load: fp32 model {fp32 / 1e6:.0f} MB, peak {added / 1e6:.0f} MB above the start "
          f"({added / fp32:.2f}x)")
    assert added <= 1.3 * fp32


def test_convert_peak_is_far_below_a_shard(mid_ckpt, tmp_path):
    """convert streams: its memory above the process before it stays under a quarter of the largest
    output shard (the whole checkpoint was held twice before), and the output is the input bit for bit."""
    path, n = mid_ckpt
    shard = 120 << 20
    out = str(tmp_path / f"hf_{shard}")
    got = _child("convert", path, out)
    largest = max(os.path.getsize(os.path.join(out, f)) for f in _shards(out))
    assert len(_shards(out)) >= 3 and largest <= shard + (1 << 20)
    added = got["peak"] - got["base"]
    print(f"convert: largest shard {largest / 1e6:.0f} MB, peak {added / 1e6:.0f} MB above the start")
    assert added <= 0.25 * largest
    a, b = read_tensors(path), read_tensors(out)
    a[PATCH] = a[PATCH].reshape(*b[PATCH].shape)
    _same(a, b)
    assert read_manifest(out)["files"].keys() >= set(_shards(out))
