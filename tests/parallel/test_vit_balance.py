"""Balanced encoder data parallelism (openPangu-VL section 6.1): the cost model against hand arithmetic and the
ViT's own window metadata, the split against a brute-force optimum on skewed mixes, the gather index, and two
msrun CPU workers (a stand-in TP group) whose all-gathered, merged features equal one process's, the share
budget and the token-count fallback by hand. The in-graph form over dp x tp ranks:
tests/parallel/test_shard_consistency.py."""
import itertools
import os

import numpy as np
import pytest

from mindvl_ms.config import load_model_config
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.collate import share_budget
from mindvl_ms.data.rope_index import vision_metadata
from mindvl_ms.parallel.vit_balance import (assign, balance, gather_index, group_embed_index, image_costs, lpt,
                                            makespan, rank_tokens)

from tests.support import msrun
from tests.support.paths import ROOT

TINY = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml")).vision      # d 64, f 128, 2 blocks
BIG = load_model_config(os.path.join(ROOT, "configs", "model", "mindvl-8b.yaml")).vision   # Qwen2.5-ViT 32 blocks


def test_cost_by_hand_and_window_term_from_the_vit_metadata():
    # tiny ViT: depth 2 (block 1 full, block 0 window), d 64, gated FFN 128; window 112 px = 4x4 merge units.
    # Image 8 x 12 patches, N = 96: linear 2 * 2 * 96 * (4 * 64^2 + 3 * 64 * 128) = 15,728,640;
    # full attention 4 * 64 * 96^2 = 2,359,296; windows: rows 4 units -> [4], cols 6 -> [4, 2]: one window of
    # 64 patches and one of 32, 64^2 + 32^2 = 5120, times 4 * 64 = 1,310,720
    assert image_costs([[1, 8, 12]], TINY)[0] == 15_728_640 + 2_359_296 + 1_310_720
    # the window term equals sum(n_w^2) over the windows vision_metadata builds, edge windows included
    for grid in ([1, 10, 14], [2, 6, 22], [1, 36, 50]):
        seg = vision_metadata(np.array([grid]), BIG.window_size, BIG.patch_size, BIG.spatial_merge_size)
        n_w = np.bincount(seg["window_segment_ids"])[1:]
        d, f, n = BIG.hidden_size, BIG.intermediate_size, int(np.prod(grid))
        linear = BIG.depth * 2.0 * n * (4 * d * d + 3 * d * f)
        full = 4.0 * d * 4 * grid[0] * float(grid[1] * grid[2]) ** 2
        window = 4.0 * d * 28 * float((n_w.astype(np.float64) ** 2).sum())
        assert image_costs([grid], BIG)[0] == pytest.approx(linear + full + window, rel=1e-12)


def brute_force(costs, ranks):
    costs = np.asarray(costs)
    best = np.inf
    for a in itertools.product(range(ranks), repeat=len(costs) - 1):
        lab = np.array((0,) + a)  # image 0 on rank 0 (symmetry)
        best = min(best, max(costs[lab == r].sum() for r in range(ranks)))
    return best


# skewed mixes: a document page among thumbnails, a video-like pair of large frames, a wide panorama
MIXES = [
    [[1, 40, 56], [1, 8, 8], [1, 12, 16], [1, 16, 16], [1, 20, 28], [1, 8, 12], [1, 32, 32], [1, 4, 4], [1, 24, 24],
     [1, 10, 14]],
    [[2, 40, 40], [1, 56, 56], [1, 8, 8], [1, 8, 8], [1, 16, 12], [1, 28, 28], [1, 20, 20], [1, 12, 12], [1, 6, 6]],
    [[1, 16, 200], [1, 30, 30], [1, 44, 44], [1, 10, 10], [1, 14, 18], [1, 22, 26], [1, 8, 40], [1, 36, 12]],
]


@pytest.mark.parametrize("mix", range(len(MIXES)))
@pytest.mark.parametrize("ranks", [2, 3])
def test_balance_reaches_the_brute_force_optimum(mix, ranks):
    costs = image_costs(MIXES[mix], BIG)
    got = balance(costs, ranks)
    assert sorted(i for a in got for i in a) == list(range(len(costs)))
    opt = brute_force(costs, ranks)
    span = makespan(costs, got)
    assert span <= makespan(costs, lpt(costs, ranks)) and span <= (4 / 3 - 1 / (3 * ranks)) * opt
    greedy = makespan(costs, balance(costs, ranks, exact_max=0))  # LPT + local search alone
    assert span <= greedy <= makespan(costs, lpt(costs, ranks))
    assert span == pytest.approx(opt, rel=1e-9)
    # against the naive split (equal image counts in order) and an equal-patch greedy split
    naive = [list(a) for a in np.array_split(np.arange(len(costs)), ranks)]
    patches = np.prod(np.asarray(MIXES[mix]), 1).astype(float)
    by_patches = lpt(patches, ranks)
    print(f"mix {mix} ranks {ranks}: max/mean load balanced {span / (costs.sum() / ranks):.3f}, "
          f"LPT+local search {greedy / (costs.sum() / ranks):.3f}, "
          f"equal count {makespan(costs, naive) / (costs.sum() / ranks):.3f}, "
          f"patch-count LPT {makespan(costs, by_patches) / (costs.sum() / ranks):.3f}")
    assert span < makespan(costs, naive)


def test_gather_index_restores_image_order():
    grid = np.array([[1, 8, 8], [1, 4, 4], [1, 12, 8], [1, 4, 8]])
    tokens = grid.prod(1) // 4  # 16, 4, 24, 8 merged tokens
    assignment = [[1, 2], [0, 3]]
    assert rank_tokens(grid, assignment, 2) == [28, 24]
    pad = 30
    buf = np.full(2 * pad, -1)
    label = np.concatenate([np.full(n, i) * 100 + np.arange(n) for i, n in enumerate(tokens)])  # image*100+token
    starts = np.concatenate([[0], np.cumsum(tokens)])
    for r, imgs in enumerate(assignment):
        mine = np.concatenate([label[starts[i]:starts[i + 1]] for i in imgs])
        buf[r * pad:r * pad + len(mine)] = mine
    assert np.array_equal(buf[gather_index(grid, assignment, 2, pad)], label)
    with pytest.raises(ValueError, match="more than pad_to=20"):
        gather_index(grid, assignment, 2, 20)
    with pytest.raises(ValueError, match="exactly one rank"):
        gather_index(grid, [[0], [1]], 2, pad)


@pytest.mark.slow
def test_two_msrun_workers_merge_what_one_process_merges(tmp_path):
    """Two msrun ranks as one TP group: each encodes its share, a real AllGather joins them, GroupMerge puts
    them into the text; equal to one process's row-by-row merge."""
    out = tmp_path / "out"
    logs = msrun.run(2, os.path.join(ROOT, "tests", "workers", "vit_balance_msrun.py"), [out], tmp_path / "logs",
                     timeout=300)
    assert "RANK 0 OF 2" in logs and "RANK 1 OF 2" in logs
    assert "IMAGES [0]" in logs and "IMAGES [1, 2, 3, 4, 5, 6]" in logs  # the 16x24 image alone
    got = np.load(out / "features.npz")
    assert got["single"].shape == (2, 192, 128) and int(got["share_patches"]) == 896  # of 1,024
    err = float(np.abs(got["merged"] - got["single"]).max())
    print(f"max |merged - single process| = {err:.2e}")
    np.testing.assert_allclose(got["merged"], got["single"], rtol=1e-5, atol=1e-6)


def test_share_budget_by_hand():
    """2 rows of P = 128 merged tokens = 512 patches; the largest item is a 384-patch image (max_pixels 384 x
    196) or a 256-patch video (video_total_pixels): Pd = ceil(1024 / 2) + 384 = 896 for 2 ranks, 256 + 384 =
    640 for 4, never above the micro-batch's 1024; the block budgets are a row's for Pd patches."""
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    data = DataConfig(seq_length=192, max_image_tokens=128, micro_batch_size=2,
                      image=ImageConfig(min_pixels=16 * 196, max_pixels=384 * 196),
                      video=VideoConfig(video_min_pixels=16 * 196, video_max_pixels=64 * 196,
                                        video_total_pixels=256 * 196))
    two, four, one = (share_budget(cfg, data, n) for n in (2, 4, 1))
    assert (two.patches, four.patches, one.patches) == (896, 640, 1024)
    assert (two.rows, two.seq_length) == (1, 192)
    assert two.window_blocks == 896 // 4 and two.window_width == 64  # 4x4 merge units of 4 patches
    assert two.full_blocks == 896 // 16 + 896 // 64 + 1 and two.full_width == 384


def test_assign_falls_back_to_token_counts_when_the_cost_split_overflows():
    """A 100x100-patch page (full attention: costly per token) against 200 8x8 thumbnails, Qwen2.5-ViT: the
    cost-balanced split puts 3,056 of the 5,700 merged tokens on the thumbnails' rank; under a cap of 2,900
    `assign` splits by token counts (list scheduling: 2,852 at most, within mean + one item)."""
    grid = np.array([[1, 100, 100]] + [[1, 8, 8]] * 200)
    assert sorted(rank_tokens(grid, balance(image_costs(grid, BIG), 2), 2)) == [2644, 3056]
    assert assign(grid, BIG, 2, 3100) == balance(image_costs(grid, BIG), 2)  # fits: the cost split stays
    got = assign(grid, BIG, 2, 2900)
    assert sorted(i for a in got for i in a) == list(range(201))
    assert max(rank_tokens(grid, got, 2)) == 2852 <= 5700 / 2 + 2500
    with pytest.raises(ValueError, match="share budget of 2400"):
        assign(grid, BIG, 2, 2400)  # the 2,500-token page alone is over it


def test_group_embed_index_by_hand():
    """2 rows of L = 4: row 0 = [t, img0 tok0, img0 tok1, t], row 1 = [img1 tok0, t, t, t]; image 0 (2 tokens)
    on rank 1, image 1 (1 token) on rank 0, Ud = 3: gathered buffer rows 3, 4 (image 0) and 0 (image 1)."""
    embed = np.array([[0, 4, 5, 3], [4, 1, 2, 3]])
    where = gather_index(np.array([[1, 2, 4], [1, 2, 2]]), [[1], [0]], 2, 3)
    assert where.tolist() == [3, 4, 0]
    got = group_embed_index(embed, np.array([0, 1]), np.array([2, 1]), where)
    assert got.tolist() == [[0, 8 + 3, 8 + 4, 3], [8 + 0, 5, 6, 7]]
