"""Balanced encoder data parallelism for the ViT (openPangu-VL report, section 6.1).

With the ViT data-parallel inside the LLM's tensor-parallel group, the `t` ranks of a TP group hold the same
micro-batch. Instead of every rank encoding every image (or an equal image count each), the images are split
by a resolution-aware cost, each rank encodes its share, and the merged visual tokens are all-gathered in the
TP group and put back in image order, so the LLM sees exactly what a single encoder would have produced.

Design:
- Host side, numpy (value-dependent, so never in `construct`): `image_costs` from `image_grid_thw`,
  `balance` (which rank encodes which images), `rank_vision_inputs` (a rank's pixel rows and ViT metadata),
  `gather_index` (where each merged token of the micro-batch sits in the all-gathered buffer).
- Cost of an image with grid (t, h, w), N = t*h*w patches, width d, FFN f, forward FLOPs:
    linear    depth * 2N (4d^2 + 3df)        (qkv + proj, gated FFN; 2df for a plain fc1/fc2 FFN)
    attention 4d * (n_full * t (hw)^2 + n_window * sum over windows of n_w^2)
  where window blocks attend within windows of (window_size / patch)^2 patches (edge windows smaller,
  computed exactly from the grid) and full blocks within each frame. Large images cost more than their
  patch count says: the quadratic term is what makes an equal-patch split unbalanced.
- `balance` is greedy LPT (largest cost first onto the least loaded rank; makespan <= (4/3 - 1/(3t)) of the
  optimum, Graham 1969) followed by a local search: the move or swap of single images between the most
  loaded rank and another that gives the lowest pair maximum, while that is below the most loaded rank's
  load (the sum of squared loads falls strictly, so it ends); then, for micro-batches of up to `exact_max`
  images, a depth-first branch and bound (largest image first, ranks of equal load tried once, branches whose
  load reaches the best makespan cut) that returns the optimum unless it exceeds `node_limit` nodes, in
  which case the best split found so far (never worse than the local search) is kept. Each rank encodes its
  images in image order.
- In the graph: `BalancedVisualEncoder` runs the unchanged ViT on the rank's images, padded on the host by a
  zero image to a static `pad_to` merged tokens, all-gathers ([pad_to, D] -> [t * pad_to, D]) and gathers
  `gather_index` ([M]) to get [M, D] in image order: what the model's embedding gather expects from the ViT.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
from mindspore import nn, ops

from mindvl_ms.data.rope_index import vision_metadata


def _window_sq_sum(n: int, size: int) -> int:
    """Sum of squared chunk lengths when n units are cut into chunks of `size` (the last one shorter)."""
    full, rem = divmod(n, size)
    return full * size * size + rem * rem


def image_costs(grid_thw, vision) -> np.ndarray:
    """Forward FLOPs of encoding each image (see the module docstring): float64 [I]."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    d, f, m = vision.hidden_size, vision.intermediate_size, vision.spatial_merge_size
    unit = m * m
    ffn = 3 * d * f if vision.mlp_type == "gated" else 2 * d * f
    n_full = len(vision.fullatt_block_indexes)
    n_win = vision.depth - n_full
    vmw = vision.window_size // vision.patch_size // m  # window side in merge units
    out = np.zeros(len(grid))
    for i, (t, h, w) in enumerate(grid.tolist()):
        n = t * h * w
        linear = vision.depth * 2.0 * n * (4 * d * d + ffn)
        win = t * unit * unit * _window_sq_sum(h // m, vmw) * _window_sq_sum(w // m, vmw)
        out[i] = linear + 4.0 * d * (n_full * t * float(h * w) ** 2 + n_win * float(win))
    return out


def makespan(costs: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    costs = np.asarray(costs, np.float64)
    return max(float(costs[list(a)].sum()) if len(a) else 0.0 for a in assignment)


def lpt(costs: Sequence[float], ranks: int) -> List[List[int]]:
    """Greedy longest-processing-time-first: images by decreasing cost onto the least loaded rank."""
    costs = np.asarray(costs, np.float64)
    load = np.zeros(ranks)
    out: List[List[int]] = [[] for _ in range(ranks)]
    for i in np.argsort(-costs, kind="stable"):
        r = int(np.argmin(load))
        out[r].append(int(i))
        load[r] += costs[i]
    return [sorted(a) for a in out]


def _local_search(costs: np.ndarray, bins: List[List[int]], max_rounds: int) -> List[List[int]]:
    ranks = len(bins)
    load = np.array([costs[a].sum() if a else 0.0 for a in bins])
    for _ in range(max_rounds):
        hi = int(np.argmax(load))
        best, move = load[hi], None
        for r in range(ranks):
            if r == hi:
                continue
            for i in bins[hi]:  # move image i from hi to r
                peak = max(load[hi] - costs[i], load[r] + costs[i])
                if peak < best - 1e-9 * best:
                    best, move = peak, (r, i, None)
                for j in bins[r]:  # swap i (hi) with j (r)
                    delta = costs[i] - costs[j]
                    if delta <= 0:
                        continue
                    peak = max(load[hi] - delta, load[r] + delta)
                    if peak < best - 1e-9 * best:
                        best, move = peak, (r, i, j)
        if move is None:
            break
        r, i, j = move
        bins[hi].remove(i)
        bins[r].append(i)
        load[hi] -= costs[i]
        load[r] += costs[i]
        if j is not None:
            bins[r].remove(j)
            bins[hi].append(j)
            load[r] -= costs[j]
            load[hi] += costs[j]
    return bins


def _branch_and_bound(costs: np.ndarray, ranks: int, bins: List[List[int]], node_limit: int) -> List[List[int]]:
    order = [int(i) for i in np.argsort(-costs, kind="stable")]
    best = [makespan(costs, bins), [list(a) for a in bins]]
    lower = max(costs.max(), costs.sum() / ranks)  # no split beats the largest image or the mean load
    load = [0.0] * ranks
    label = [0] * len(costs)
    nodes = [0]

    def go(k: int) -> bool:  # True: stop (optimum reached or node budget spent)
        nodes[0] += 1
        if nodes[0] > node_limit:
            return True
        if k == len(order):
            span = max(load)
            if span < best[0] * (1 - 1e-12):
                best[0] = span
                best[1] = [[i for i in range(len(costs)) if label[i] == r] for r in range(ranks)]
            return best[0] <= lower * (1 + 1e-12)
        i, seen = order[k], set()
        for r in sorted(range(ranks), key=lambda q: load[q]):
            if load[r] in seen or load[r] + costs[i] >= best[0] * (1 - 1e-12):
                continue
            seen.add(load[r])
            load[r] += costs[i]
            label[i] = r
            stop = go(k + 1)
            load[r] -= costs[i]
            if stop:
                return True
        return False

    go(0)
    return best[1]


def balance(costs: Sequence[float], ranks: int, max_rounds: int = 1000, exact_max: int = 16,
            node_limit: int = 200_000) -> List[List[int]]:
    """Which images each of `ranks` ranks encodes: LPT, local search, then branch and bound (module docstring).

    Returns each rank's image indices in ascending order (every image exactly once)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    costs = np.asarray(costs, np.float64)
    if (costs < 0).any():
        raise ValueError("image costs must be >= 0")
    bins = _local_search(costs, [list(a) for a in lpt(costs, ranks)], max_rounds)
    if 0 < len(costs) <= exact_max and ranks > 1:
        bins = _branch_and_bound(costs, ranks, bins, node_limit)
    return [sorted(a) for a in bins]


def rank_vision_inputs(pixel_values: np.ndarray, grid_thw, images: Sequence[int], vision,
                       pad_to: int = None) -> Dict[str, np.ndarray]:
    """The pixel rows of `images` (in that order) and their ViT metadata, as `build_model_inputs` makes them.

    With `pad_to`, a zero padding image of the missing merged tokens (grid [1, m, m * missing]) is appended so
    the rank's ViT output has exactly `pad_to` rows (equal shapes for the all-gather); its rows are never
    gathered by `gather_index`."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    starts = np.concatenate([[0], np.cumsum(grid.prod(1))])
    if starts[-1] != len(pixel_values):
        raise ValueError(f"pixel_values has {len(pixel_values)} rows, image_grid_thw needs {starts[-1]}")
    if not len(images):
        raise ValueError("a rank with no image: give the TP group fewer ranks than images, or a dummy image")
    pixels = np.asarray(pixel_values, np.float32)[np.concatenate([np.arange(starts[i], starts[i + 1]) for i in images])]
    grid = grid[list(images)]
    m = vision.spatial_merge_size
    if pad_to is not None:
        missing = pad_to - int(grid.prod(1).sum()) // (m * m)
        if missing < 0:
            raise ValueError(f"these images hold {pad_to - missing} merged tokens, more than pad_to={pad_to}")
        if missing:
            grid = np.concatenate([grid, [[1, m, m * missing]]])
            pixels = np.concatenate([pixels, np.zeros((m * m * missing, pixels.shape[1]), np.float32)])
    meta = vision_metadata(grid, vision.window_size, vision.patch_size, m)
    return {"pixel_values": pixels, **meta}


def gather_index(grid_thw, assignment: Sequence[Sequence[int]], spatial_merge_size: int, pad_to: int) -> np.ndarray:
    """int32 [M]: for each merged token of the micro-batch, in image order, its row in the all-gathered
    [ranks * pad_to, D] buffer (rank r's encoded images fill rows [r * pad_to, r * pad_to + its tokens))."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    tokens = grid.prod(1) // spatial_merge_size ** 2
    where = [None] * len(grid)
    for r, imgs in enumerate(assignment):
        at = r * pad_to
        for i in imgs:
            where[i] = np.arange(at, at + tokens[i])
            at += tokens[i]
        if at - r * pad_to > pad_to:
            raise ValueError(f"rank {r} encodes {at - r * pad_to} merged tokens, more than pad_to={pad_to}")
    if any(w is None for w in where):
        raise ValueError("every image must be assigned to exactly one rank")
    return np.concatenate(where).astype(np.int32)


def rank_tokens(grid_thw, assignment: Sequence[Sequence[int]], spatial_merge_size: int) -> List[int]:
    """Merged tokens each rank encodes (the smallest valid `pad_to` is their maximum)."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    tokens = grid.prod(1) // spatial_merge_size ** 2
    return [int(tokens[list(a)].sum()) for a in assignment]


class BalancedVisualEncoder(nn.Cell):
    """This rank's ViT inputs (padded to `pad_to` merged tokens by `rank_vision_inputs`) -> [M, D] merged
    tokens of the whole micro-batch in image order.

    visual: the `VisionTransformer` cell (unchanged; the same weights on every rank of the group).
    group: the communication group of the TP ranks (None: the world group)."""

    def __init__(self, visual, group: str = None):
        super().__init__()
        self.visual = visual
        self.all_gather = ops.AllGather(group) if group else ops.AllGather()

    def construct(self, pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                  full_segment_ids, gather_index):
        local = self.visual(pixel_values, vision_pos_ids, window_index, reverse_index, window_segment_ids,
                            full_segment_ids)  # [pad_to, D], this rank's images in order, then padding
        return ops.gather(self.all_gather(local), gather_index, 0)  # [t * pad_to, D] -> [M, D]
