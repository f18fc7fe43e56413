"""Worker for tests/parallel/test_vit_balance.py: the tiny ViT encodes a skewed micro-batch of images.

Under msrun (2 ranks standing in for one tensor-parallel group) each rank encodes the images `balance`
gives it (padded by a zero image to the largest rank's token count) through `BalancedVisualEncoder`, which
all-gathers the merged tokens and puts them back in image order; the same process also encodes all images
alone. Rank 0 writes both to OUT_DIR/features.npz.

    python tests/workers/vit_balance_msrun.py OUT_DIR
"""
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindvl_ms.config import load_model_config
from mindvl_ms.models.vision import VisionTransformer
from mindvl_ms.parallel.vit_balance import (BalancedVisualEncoder, balance, gather_index, image_costs, rank_tokens,
                                            rank_vision_inputs)
from tests.support.paths import ROOT

GRID = np.array([[1, 16, 24], [1, 4, 4], [1, 8, 8], [1, 4, 8], [1, 12, 8], [1, 4, 4], [1, 6, 10]])
NAMES = ("pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids", "full_segment_ids")


def encode(vit, inputs):
    return vit(*[Tensor(inputs[k]) for k in NAMES]).asnumpy()


def main(out: str) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    vision = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml")).vision
    ms.set_seed(0)
    vit = VisionTransformer(vision)
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = np.random.default_rng(3).standard_normal((int(GRID.prod(1).sum()), dim)).astype(np.float32)
    single = encode(vit, rank_vision_inputs(pixels, GRID, list(range(len(GRID))), vision))  # [M, D]

    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, ranks = get_rank(), get_group_size()
    assignment = balance(image_costs(GRID, vision), ranks)
    pad_to = max(rank_tokens(GRID, assignment, vision.spatial_merge_size))
    local = rank_vision_inputs(pixels, GRID, assignment[rank], vision, pad_to)  # padded to pad_to tokens
    index = gather_index(GRID, assignment, vision.spatial_merge_size, pad_to)
    encoder = BalancedVisualEncoder(vit)
    gathered = encoder(*[Tensor(local[k]) for k in NAMES], Tensor(index)).asnumpy()  # [M, D]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        np.savez(os.path.join(out, "features.npz"), single=single, gathered=gathered,
                 sizes=np.array([len(a) for a in assignment]))
    print("RANK", rank, "OF", ranks, "IMAGES", assignment[rank], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
