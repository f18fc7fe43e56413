"""Worker for tests/parallel/test_vit_balance.py: a micro-batch of two packed rows holding seven images of
skewed sizes, merged into the text as the training graph does.

Under msrun the 2 ranks stand in for one tensor-parallel group under `vision_parallel: dp`: each takes its
share of the images (`vit_balance.balanced_batch`), encodes it with the tiny ViT, all-gathers the features
over the group (a real AllGather) and merges them into the text through `GroupMerge`. Rank 0 also builds the
embeddings as one process does (`RowMerge` over the rows' own ViT inputs) and writes both to
OUT_DIR/features.npz.

    python tests/workers/vit_balance_msrun.py OUT_DIR
"""
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops
from mindspore.communication import get_group_size, get_rank, init

from mindvl_ms.config import load_model_config
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.collate import VISION_NAMES, build_model_inputs, patch_dim, row_budget, share_budget
from mindvl_ms.models.mindvl import RowMerge, flat_vision_inputs
from mindvl_ms.models.vision import VisionTransformer
from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.parallel.vit_balance import GroupMerge, assign, balanced_batch
from tests.support import msrun
from tests.support.paths import ROOT

GRID = np.array([[1, 16, 24], [1, 4, 4], [1, 8, 8], [1, 4, 8], [1, 12, 8], [1, 4, 4], [1, 6, 10]])
ROWS = ([0, 1, 2, 3], [4, 5, 6])  # images of each packed row's one sample


def sample(cfg, images, rng):
    """A sample whose text holds <|vision_start|> <|image_pad|> x tokens <|vision_end|> per image."""
    ids = [11, 12]
    for i in images:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(GRID[i].prod()) // 4) + \
               [cfg.vision_end_token_id, 13]
    pixels = rng.standard_normal((int(GRID[images].prod(1).sum()), patch_dim(cfg))).astype(np.float32)
    return {"input_ids": np.array(ids, np.int32), "pixel_values": pixels, "image_grid_thw": GRID[images]}


def encode(vit, batch):
    return vit(*flat_vision_inputs(*[Tensor(batch[k]) for k in VISION_NAMES]))


def main(out: str) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    ms.set_seed(0)
    vit = VisionTransformer(cfg.vision)
    rng = np.random.default_rng(3)
    data = DataConfig(seq_length=192, max_image_tokens=128, micro_batch_size=2,  # shares of 512 + 384 patches
                      image=ImageConfig(min_pixels=16 * 196, max_pixels=384 * 196),
                      video=VideoConfig(video_min_pixels=16 * 196, video_max_pixels=64 * 196,
                                        video_total_pixels=384 * 196))
    batch = build_model_inputs([[sample(cfg, list(r), rng)] for r in ROWS], cfg, budget=row_budget(cfg, data))
    text = Tensor(rng.standard_normal((2, 192, cfg.text.hidden_size)).astype(np.float32))
    init()
    rank, ranks = get_rank(), get_group_size()
    if rank == 0:  # one process's merge, which rank 0 writes
        single = RowMerge()(text, encode(vit, batch), Tensor(batch["embed_index"])).asnumpy()  # [B, L, D]
    share = share_budget(cfg, data, ranks)
    mine = balanced_batch(batch, cfg, ranks, share, rank)[0]
    feats = ops.AllGather()(encode(vit, mine))  # [ranks * Ud, D], rank order
    merged = GroupMerge(1, ranks)(text, feats, Tensor(mine["embed_index"])).asnumpy()  # [B, L, D]
    images = assign(GRID, cfg.vision, ranks, share.patches // 4)[rank]  # what balanced_batch gave this rank
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        np.savez(os.path.join(out, "features.npz"), single=single, merged=merged,
                 share_patches=mine["pixel_values"].shape[1])
    print("RANK", rank, "OF", ranks, "SHARE", mine["pixel_values"].shape, "IMAGES", images, flush=True)


if __name__ == "__main__":
    msrun.schedule_only()  # msrun's scheduler runs this script too: it only schedules
    freeze_imported_objects()  # the gc.collect() before each graph compile skips the imports (ops/process.py)
    main(sys.argv[1])
