"""Packing: BFD against a plain reference implementation, budgets, rank balance, online packer, and the
offline `pack_file` manifest against actually processed samples. Run: pytest -q tests/data/test_packing.py"""
import json
import os

import numpy as np
import pytest

from tests.support.data import make_jsonl
from mindvl_ms.config.data import DataConfig
from mindvl_ms.data.offline import pack_file
from mindvl_ms.data.packing import (Item, OnlinePacker, assign_ranks, efficiency, pack_bfd, pack_first_fit,
                                    split_oversized)
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import parse_sample


def _reference_bfd(sizes, cap):
    """Textbook best-fit decreasing, O(n * packs): list of pack totals."""
    packs = []
    for s in sorted(sizes, reverse=True):
        best = None
        for i, t in enumerate(packs):
            if t + s <= cap and (best is None or t > packs[best]):
                best = i
        if best is None:
            packs.append(s)
        else:
            packs[best] += s
    return sorted(packs)


def _check_packs(packs, items, cap, img_cap):
    keys = sorted(it.key for p in packs for it in p.items)
    assert keys == sorted(it.key for it in items)  # every item exactly once
    for p in packs:
        assert p.tokens == sum(it.tokens for it in p.items) <= cap
        assert p.image_tokens == sum(it.image_tokens for it in p.items) <= img_cap


def test_bfd_hand_case():
    items = [Item(i, t) for i, t in enumerate([6, 5, 4, 3, 2, 2, 1, 1])]  # 24 tokens, cap 8; by hand: 6|5|4, 3->5, 2->6, 2->4, 1->4+2, 1->4+2+1
    packs = pack_bfd(items, 8, 8)
    assert sorted(sorted(it.tokens for it in p.items) for p in packs) == [[1, 1, 2, 4], [2, 6], [3, 5]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_matches_reference(seed):
    rng = np.random.default_rng(seed)
    sizes = np.concatenate([rng.integers(20, 200, 300), rng.integers(800, 2000, 60), rng.integers(1, 10, 50)])
    items = [Item(i, int(s)) for i, s in enumerate(sizes)]
    packs = pack_bfd(items, 2048, 10 ** 9)
    _check_packs(packs, items, 2048, 10 ** 9)
    assert sorted(p.tokens for p in packs) == _reference_bfd(sizes.tolist(), 2048)


def test_bfd_respects_visual_budget_and_beats_first_fit():
    rng = np.random.default_rng(3)
    items = [Item(i, int(t), int(v)) for i, (t, v) in
             enumerate(zip(rng.integers(50, 1500, 400), rng.choice([0, 0, 64, 256, 900], 400)))]
    items = [Item(it.key, max(it.tokens, it.image_tokens + 20), it.image_tokens) for it in items]
    bfd = pack_bfd(items, 2048, 1024)
    ff = pack_first_fit(items, 2048, 1024)
    _check_packs(bfd, items, 2048, 1024)
    _check_packs(ff, items, 2048, 1024)
    assert efficiency(bfd, 2048) >= efficiency(ff, 2048)
    lower = int(np.ceil(max(sum(it.tokens for it in items) / 2048, sum(it.image_tokens for it in items) / 1024)))
    assert lower <= len(bfd) <= 1.1 * lower + 1


def test_oversized_are_reported_not_packed():
    ok, bad = split_oversized([Item(1, 10), Item(2, 5000), Item(3, 10, 600)], 4096, 512)
    assert [it.key for it in ok] == [1]
    assert [(it.key, r.split(" (")[0]) for it, r in bad] == [(2, "longer than seq_length"),
                                                             (3, "more visual tokens than max_image_tokens")]


def test_assign_ranks_equal_counts_and_balance():
    rng = np.random.default_rng(4)
    items = [Item(i, int(t), int(v)) for i, (t, v) in enumerate(zip(rng.integers(10, 900, 1001),
                                                                    rng.integers(0, 300, 1001)))]
    packs = pack_bfd(items, 2048, 1024)
    for dp in (1, 3, 8):
        ranks, stats = assign_ranks(list(packs), dp)
        counts = [len(r) for r in ranks]
        assert len(set(counts)) == 1 and sum(counts) >= len(packs)
        _check_packs([p for r in ranks for p in r], items, 2048, 1024)
        load = [sum(p.tokens for p in r) for r in ranks]
        assert stats["rank_tokens"] == load
        assert max(load) - min(load) <= 2048  # within one pack of perfect balance
        naive = [sum(p.tokens for p in packs[r::dp]) for r in range(dp)]  # round-robin in packing order
        assert max(load) - min(load) <= max(naive) - min(naive)
        # step-wise ViT balance: packs side by side in one step have close visual-token counts
        for s in range(counts[0]):
            step = [ranks[r][s].image_tokens for r in range(dp)]
            assert max(step) - min(step) <= 1024


def test_assign_ranks_splits_to_share_evenly():
    packs = pack_bfd([Item(i, 100) for i in range(50)], 1000, 1000)  # 5 packs of 10 items
    ranks, _ = assign_ranks(packs, 4)
    assert [len(r) for r in ranks] == [2, 2, 2, 2]
    assert sorted(it.key for r in ranks for p in r for it in p.items) == list(range(50))


def test_online_packer_emits_everything_once():
    rng = np.random.default_rng(5)
    items = [Item(i, int(t), int(v)) for i, (t, v) in enumerate(zip(rng.integers(10, 1200, 500),
                                                                    rng.choice([0, 100, 400], 500)))]
    items.append(Item(999, 9000))
    packer = OnlinePacker(2048, 512, buffer_size=32)
    packs = list(packer.pack_stream(items))
    _check_packs(packs, items[:-1], 2048, 512)
    assert [it.key for it, _ in packer.dropped] == [999]
    assert efficiency(packs, 2048) > 0.85


def test_pack_file_manifest(tmp_path):
    src = make_jsonl(str(tmp_path / "d.jsonl"), 40, bad_lines=True)
    cfg = DataConfig(seq_length=512, max_image_tokens=160, dp_size=2)
    man = pack_file(src, str(tmp_path / "out"), cfg, workers=2, progress=False)
    with open(tmp_path / "out" / "manifest.json") as f:
        assert json.load(f) == man
    lines = sorted([ln for p in man["packs"] for ln in p["lines"]] + [d["line"] for d in man["dropped"]])
    assert lines == list(range(1, 41))  # every line exactly once
    reasons = {d["line"]: d["reason"] for d in man["dropped"]}
    assert reasons[6] == "invalid json" and reasons[10] == "blank line" and reasons[14] == "unreadable image"
    assert reasons[18].startswith("longer than seq_length")
    assert man["num_packs"] == len(man["packs"]) and man["rank_packs"][0] == man["rank_packs"][1]
    # token counts from metadata equal the lengths of the actually processed samples
    proc = MindVLProcessor(config=cfg)
    with open(src) as f:
        raw = f.read().split("\n")
    real = {}
    for ln in [ln for p in man["packs"] for ln in p["lines"]]:
        out = proc.process_sample(parse_sample(json.loads(raw[ln - 1]), src, ln))
        real[ln] = (len(out["input_ids"]), 0 if out["image_grid_thw"] is None
                    else int(out["image_grid_thw"].prod(1).sum()) // 4)
    for p in man["packs"]:
        assert p["tokens"] == sum(real[ln][0] for ln in p["lines"]) <= 512
        assert p["image_tokens"] == sum(real[ln][1] for ln in p["lines"]) <= 160
    assert man["rank_tokens"] == [sum(p["tokens"] for p in man["packs"] if p["rank"] == r) for r in range(2)]
    assert man["efficiency"] == pytest.approx(sum(p["tokens"] for p in man["packs"]) / (man["num_packs"] * 512),
                                              abs=1e-6)
    # shards: rank r holds exactly its packs, images resolvable from the shard directory
    for r in range(2):
        with open(tmp_path / "out" / man["shards"][r]) as f:
            recs = [json.loads(x) for x in f]
        assert [x["lines"] for x in recs] == [p["lines"] for p in man["packs"] if p["rank"] == r]
        for rec in recs:
            for obj in rec["samples"]:
                for im in obj.get("images", []):
                    assert os.path.isfile(tmp_path / "out" / im)
