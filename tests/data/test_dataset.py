"""Loader: per-rank shards, deterministic order, exact resume (offline and online), the MindSpore
pipeline, and packed-vs-one-by-one per-sample loss through the model. Run: pytest -q tests/data/test_dataset.py"""
import json
import os

import numpy as np
import pytest

from tests.support.data import make_jsonl
from mindvl_ms.config.data import DataConfig, DataSource
from mindvl_ms.config.model import MindVLConfig, TextConfig, VisionConfig
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data.offline import pack_file
from mindvl_ms.data.collate import INPUT_NAMES, build_model_inputs

SEQ = 400


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    src = make_jsonl(str(d / "d.jsonl"), 60, seed=1)
    man = pack_file(src, str(d / "out"), DataConfig(seq_length=SEQ, max_image_tokens=120, dp_size=2), workers=1,
                    progress=False)
    return src, str(d / "out"), man


def _loader(cfg, model_config=None):
    return DataLoader.from_config(cfg, model_config=model_config or MindVLConfig())


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _offline_cfg(out, rank, **kw):
    return DataConfig(packed_dir=out, seq_length=SEQ, max_image_tokens=120, dp_size=2, dp_rank=rank, **kw)


def test_ranks_read_only_their_shard_and_cover_all(packed):
    src, out, man = packed
    lines = []
    for rank in (0, 1):
        # copy the directory without the other rank's shard: the loader must not need it
        solo = os.path.join(os.path.dirname(out), f"solo{rank}")  # sibling of out: relative image paths hold
        os.makedirs(solo, exist_ok=True)
        for name in os.listdir(out):
            if name != man["shards"][1 - rank]:
                os.symlink(os.path.join(out, name), os.path.join(solo, name))
        loader = _loader(_offline_cfg(solo, rank, micro_batch_size=2), model_config=None)
        loader.collate = lambda rows: rows
        for rows in loader:
            lines += [s["line"] for row in rows for s in row]
            assert all(s["source"] == os.path.abspath(src) for row in rows for s in row)
        assert loader.skipped == []
    assert sorted(lines) == sorted(ln for p in man["packs"] for ln in p["lines"])


def test_order_is_deterministic_per_seed_and_epoch(packed):
    _, out, _ = packed
    run = lambda seed: [[s["line"] for s in row] for rows in _with_rows(_offline_cfg(out, 0, seed=seed))  # noqa
                        for row in rows]
    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c and sorted(map(tuple, a)) == sorted(map(tuple, c))


def _with_rows(cfg, epochs=1):
    loader = _loader(cfg)
    loader.collate = lambda rows: rows
    out = []
    for _ in range(epochs):
        out += list(loader)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_offline_resume_batch_by_batch(packed, rank):
    _, out, man = packed
    cfg = _offline_cfg(out, rank, micro_batch_size=2)
    ref_loader = _loader(cfg)
    ref = list(ref_loader) + list(ref_loader)  # two epochs, uninterrupted
    n_epoch = -(-man["rank_packs"][rank] // 2)
    assert len(ref) == 2 * n_epoch
    first = _loader(cfg)
    it = iter(first)
    for _ in range(3):
        next(it)  # stop mid-epoch after 3 batches
    state = json.loads(json.dumps(first.state_dict()))  # as saved in a checkpoint
    assert state["epoch"] == 0 and state["position"] == 3
    resumed = _loader(cfg)
    resumed.load_state_dict(state)
    got = list(resumed) + list(resumed)
    assert len(got) == len(ref) - 3  # rest of epoch 0, then all of epoch 1
    for a, b in zip(got, ref[3:]):
        _same(a, b)
    # the second epoch is a different order than the first
    assert not all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(ref[:n_epoch], ref[n_epoch:]))
    with pytest.raises(ValueError, match="seed"):
        _loader(_offline_cfg(out, rank, micro_batch_size=2, seed=7)).load_state_dict(state)


def test_mindspore_pipeline_matches_and_tracks_consumption(packed):
    _, out, _ = packed
    cfg = _offline_cfg(out, 0, num_workers=2)
    ref = list(_loader(cfg))
    loader = _loader(cfg)
    it = iter(loader)
    next(it)
    next(it)
    ds = loader.to_mindspore(INPUT_NAMES + ("targets",))
    got = []
    for i, cols in enumerate(ds.create_tuple_iterator(num_epochs=1, output_numpy=True)):
        got.append(dict(zip(INPUT_NAMES + ("targets",), cols)))
        loader.mark_consumed()
        if i == 1:
            saved = loader.state_dict()
    assert len(got) == len(ref) - 2
    for a, b in zip(got, ref[2:]):
        _same(a, {k: b[k] for k in a})
    assert saved["position"] == 4 and loader.state_dict()["epoch"] == 1
    again = _loader(cfg)
    again.load_state_dict(saved)
    _same(next(iter(again)), ref[4])


def test_online_resume_and_rank_split(tmp_path):
    src = make_jsonl(str(tmp_path / "a.jsonl"), 40, seed=2)
    os.makedirs(tmp_path / "b")
    src2 = make_jsonl(str(tmp_path / "b" / "b.jsonl"), 12, seed=3)
    mk = lambda rank: DataConfig(packing="online", seq_length=SEQ, max_image_tokens=120, online_buffer=6,  # noqa
                                 dp_size=2, dp_rank=rank, sources=[DataSource(path=src), DataSource(path=src2,
                                                                                                     weight=2.0)])
    seen = {}
    for rank in (0, 1):
        rows = _with_rows(mk(rank))
        seen[rank] = [(s["source"], s["line"]) for b in rows for row in b for s in row]
        for b in rows:
            assert sum(len(s["input_ids"]) for s in b[0]) <= SEQ
    assert not set(seen[0]) & set(seen[1])  # ranks read disjoint lines
    assert len(seen[0]) + len(seen[1]) == 40 + 2 * 12  # weight 2: the second file twice
    assert {ln for src_, ln in seen[0] if src_ == src} == set(range(1, 41, 2))
    ref_loader = _loader(mk(1))
    ref = list(ref_loader)
    first = _loader(mk(1))
    it = iter(first)
    for _ in range(4):
        next(it)
    resumed = _loader(mk(1))
    resumed.load_state_dict(first.state_dict())
    got = list(resumed)
    assert len(got) == len(ref) - 4
    for a, b in zip(got, ref[4:]):
        _same(a, b)


def test_packed_loss_equals_one_by_one(packed):
    """Per-sample loss of a packed row == the same samples run alone (block-diagonal attention, positions
    restarting per sample, labels never crossing samples)."""
    import mindspore as ms
    from mindvl_ms.data.collate import model_args
    from mindvl_ms.models.mindvl import MindVLModel

    _, out, _ = packed
    loader = _loader(_offline_cfg(out, 0, shuffle=False))
    pack = next(p for p in loader.source.epoch_packs(0)
                if len(p) >= 3 and sum("images" in obj for obj, _, _ in p) >= 2)
    row = loader._rows([pack])[0]
    # compact the Qwen ids to a small vocabulary (same map for packed and single runs)
    vocab_ids = np.unique(np.concatenate([s["input_ids"] for s in row]))
    remap = {int(v): i for i, v in enumerate(vocab_ids)}
    for s in row:
        s["input_ids"] = np.array([remap[int(t)] for t in s["input_ids"]])
        s["labels"] = np.array([remap[int(t)] if t != -100 else -100 for t in s["labels"]])
    V = len(vocab_ids) + 4
    cfg = MindVLConfig(
        vision=VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                            fullatt_block_indexes=[1], window_size=56),
        text=TextConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mrope_section=[2, 3, 3]),
        image_token_id=remap[151655], vision_start_token_id=remap[151652], vision_end_token_id=remap[151653],
        video_token_id=V - 1)
    ms.set_seed(0)
    model = MindVLModel(cfg).set_dynamic_inputs()

    def per_sample_loss(batch):
        logits = model(*model_args(batch))[0].asnumpy().astype(np.float64)  # [B, L, V]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        t, seg = batch["targets"], batch["segment_ids"]
        out = []
        for sid in range(1, int(seg.max()) + 1):
            m = (seg == sid) & (t != -100)
            out.append(-logp[m, t[m]].mean())
        return np.array(out)

    packed_loss = per_sample_loss(build_model_inputs([row], cfg, pad_to=SEQ))
    single = np.array([per_sample_loss(build_model_inputs([[s]], cfg))[0] for s in row])
    assert packed_loss.shape == (len(row),)
    np.testing.assert_allclose(packed_loss, single, rtol=2e-5, atol=2e-5)
    assert np.ptp(single) > 1e-3  # the samples really differ
