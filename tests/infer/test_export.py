"""MindIR export round trip: the exported vision / prefill / decode graphs, run by the GraphCell runner,
give the eager model's greedy tokens; fp16 export through the CLI. Run: pytest tests/infer/test_export.py
"""
import json
import os

import numpy as np
import pytest
from PIL import Image

from tests.support import infer_tiny as infer_tiny
from mindvl_ms import cli
from mindvl_ms.cli import main
from mindvl_ms.config.data import ImageConfig
from mindvl_ms.infer.export import export
from mindvl_ms.infer.generate import generate
from mindvl_ms.infer.preprocess import uint8_patches
from mindvl_ms.infer.mindir_runner import ExportedRunner

pytestmark = pytest.mark.slow  # over ~12 s: -m 'not slow' leaves it out, CI runs it

N_NEW = 5


def _uint8_samples():
    rng = np.random.default_rng(7)
    cfg = ImageConfig(max_pixels=28 * 28 * 12)
    a, ga = uint8_patches(Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)), cfg)
    b, gb = uint8_patches(Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)), cfg)
    two = np.concatenate([infer_tiny.image_prompt(ga, tail=(9,)), infer_tiny.image_prompt(gb, text=(3,))])
    return [{"input_ids": infer_tiny.image_prompt(ga), "pixel_frames": a, "image_grid_thw": ga[None]},
            {"input_ids": np.array([3, 4, 9, 10, 11, 12, 13], np.int64)},
            {"input_ids": two, "pixel_frames": np.concatenate([a, b]), "image_grid_thw": np.stack([ga, gb])}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = infer_tiny.setup()[0]
    out = str(tmp_path_factory.mktemp("export") / "fp32")
    meta = export(path, out)
    return path, out, meta


@pytest.fixture(scope="module")
def runner32(exported):
    """The fp32 export loaded once by the GraphCell runner (its graphs compile on first use), for every test."""
    return ExportedRunner(exported[1], backend="graphcell")


def test_graphcell_runner_equals_eager_model(exported, runner32):
    _, out, meta = exported
    model = infer_tiny.setup()[2]
    samples = _uint8_samples()
    runner = runner32
    got = runner.generate(samples, N_NEW)
    assert got == generate(model, samples, N_NEW)
    assert runner.generate(samples, N_NEW, padding_side="right") == got
    # other batch sizes and cache lengths through the same loaded graphs
    assert runner.generate(samples[1:], 3) == generate(model, samples[1:], 3)
    frames, grid = uint8_patches(Image.fromarray(np.full((100, 30, 3), 77, np.uint8)), ImageConfig())
    third = [{"input_ids": infer_tiny.image_prompt(grid), "pixel_frames": frames, "image_grid_thw": grid[None]}]
    assert runner.generate(third, 4) == generate(model, third, 4)  # a new image size through the vision graph
    assert [len(g) for g in got] == [N_NEW] * 3
    # a video (float temporal patches through the vision_video graph) next to an image
    rng = np.random.default_rng(5)
    vid = {"input_ids": np.array([3, 4, infer_tiny.hf_tiny.VSTART] + [253] * 12 + [infer_tiny.hf_tiny.VEND, 7],
                                 np.int64),
           "pixel_values_videos": rng.standard_normal((48, 3 * 2 * 14 * 14)).astype(np.float32),
           "video_grid_thw": np.array([[2, 4, 6]]), "second_per_grid_ts": np.array([1.0])}
    mixed = dict(vid, input_ids=np.concatenate([third[0]["input_ids"], vid["input_ids"]]),
                 pixel_frames=third[0]["pixel_frames"], image_grid_thw=third[0]["image_grid_thw"])
    assert runner.generate([vid, mixed], 4) == generate(model, [vid, mixed], 4)
    print("exported bytes:", {k: g["bytes"] for k, g in meta["graphs"].items()}, "total", meta["total_bytes"])


def test_export_json_describes_dynamic_graphs(exported):
    _, out, meta = exported
    with open(os.path.join(out, "export.json")) as f:
        assert json.load(f) == meta
    for name in ("vision", "vision_video", "prefill", "decode"):
        g = meta["graphs"][name]
        assert os.path.getsize(os.path.join(out, g["file"])) == g["bytes"] > 0
        # only MindSpore's own operators: no node names the C++ kernel library in this machine's cache
        with open(os.path.join(out, g["file"]), "rb") as f:
            assert b"libmindvl_cpu" not in f.read(), name
    vis = {i["name"]: i for i in meta["graphs"]["vision"]["inputs"]}
    assert vis["pixel_frames"] == {"name": "pixel_frames", "shape": [-1, 588], "dtype": "uint8"}
    pre = {i["name"]: i for i in meta["graphs"]["prefill"]["inputs"]}
    assert pre["input_ids"]["shape"] == [-1, -1] and pre["cache_k"]["shape"] == [2, -1, 2, -1, 16]
    dec = {i["name"]: i for i in meta["graphs"]["decode"]["inputs"]}
    assert dec["input_ids"]["shape"] == [-1, 1]
    assert meta["tokens"]["image_token_id"] == 250 and meta["engine"]["max_positions"] == 512
    assert meta["preprocess"]["image_mean"] == ImageConfig().image_mean
    # the processor travels with the graphs (this checkpoint records none: the defaults)
    assert {"tokenizer.json", "preprocessor_config.json", "chat_template.json"} <= set(meta["processor_files"])
    assert all(os.path.isfile(os.path.join(out, f)) for f in meta["processor_files"])
    assert meta["system_prompt"] == "You are a helpful assistant."
    with open(os.path.join(out, "preprocessor_config.json")) as f:
        assert json.load(f)["max_pixels"] == meta["preprocess"]["max_pixels"]


def test_each_weight_is_written_once(exported):
    """The four graphs share one copy of the weights: every graph parameter points into weights/, a
    parameter used by several graphs at the same bytes, and the weight files hold each model parameter
    once (its bytes plus the 64-byte alignment MindSpore's loader expects)."""
    from mindspore.train.mind_ir_pb2 import ModelProto

    _, out, meta = exported
    model = infer_tiny.setup()[2]
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    where = {}
    for name, g in meta["graphs"].items():
        proto = ModelProto()
        with open(os.path.join(out, g["file"]), "rb") as f:
            proto.ParseFromString(f.read())
        assert proto.graph.parameter, name
        for p in proto.graph.parameter:
            key = p.name[p.name.find(":") + 1:]
            assert not p.raw_data and p.external_data.location.startswith("weights/"), (name, key)
            loc = (p.external_data.location, p.external_data.offset, p.external_data.length)
            assert where.setdefault(key, loc) == loc, key  # the same bytes in every graph
    assert set(where) == set(params)  # prefill and decode: the whole language model; vision: the tower
    spans = sorted(where.values())
    assert len(set(spans)) == len(spans)  # no two parameters share bytes, none is written twice
    for key, (loc, off, length) in where.items():
        with open(os.path.join(out, loc), "rb") as f:
            f.seek(off)
            assert f.read(length) == params[key].tobytes(), key
    unique = sum(a.nbytes for a in params.values())
    files = sum(os.path.getsize(os.path.join(out, "weights", f)) for f in os.listdir(os.path.join(out, "weights")))
    assert meta["weights"]["bytes"] == files and unique <= files <= unique + 64 * (len(params) + 1)
    assert meta["total_bytes"] == files + sum(g["bytes"] for g in meta["graphs"].values())


def test_fp16_export_runs_and_is_close(exported, runner32, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["mindvl_ms.cli.infer"])  # `mindvl export` alone
    path, out32, meta32 = exported
    out16 = str(tmp_path / "fp16")
    assert main(["export", "--ckpt", path, "--out", out16, "--fp16"]) == 0
    assert "MiB" in capsys.readouterr().out
    r16, r32 = ExportedRunner(out16, "graphcell"), runner32
    assert r16.meta["dtype"] == "float16" and r16.meta["kv_cache"]["dtype"] == "float16"
    # weights are half the bytes (each weight is stored once in weights/, padded to 64 bytes; the graph
    # files hold structure only, so the totals differ by less than the weights do)
    w16, w32 = r16.meta["weights"], meta32["weights"]
    assert w16["tensors"] == w32["tensors"]
    assert abs(w16["bytes"] - w32["bytes"] / 2) <= 64 * w32["tensors"] + 64
    assert r16.meta["total_bytes"] < meta32["total_bytes"]
    samples = _uint8_samples()
    # N_NEW tokens, as test_graphcell_runner_equals_eager_model generates: the same input and cache shapes,
    # so r16 runs each graph on one compile and runner32 on the ones it has
    assert [len(x) for x in r16.generate(samples, N_NEW)] == [N_NEW] * 3
    logits = []
    for r in (r16, r32):  # first-token logits of the same prompts through both exports
        first = []
        real_prefill = r.engine.backend.prefill

        def spy(arrays, cache, real_prefill=real_prefill, first=first):
            out = real_prefill(arrays, cache)
            first.append(out[0])
            return out
        monkeypatch.setattr(r.engine.backend, "prefill", spy)  # the shared runner32 gets its own back
        r.generate(samples, N_NEW)
        logits.append(first[0])
    assert logits[0].shape == (3, 256)
    assert np.abs(logits[0] - logits[1]).max() < 2e-2 * max(1.0, np.abs(logits[1]).max())
