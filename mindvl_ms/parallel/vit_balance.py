"""Balanced encoder data parallelism for the ViT (openPangu-VL report, section 6.1).

With the ViT data-parallel inside the LLM's tensor-parallel group, the `t` ranks of a TP group hold the same
micro-batch. Instead of every rank encoding every image (or an equal image count each), the images are split
by a resolution-aware cost, each rank encodes its share, and the merged visual tokens are all-gathered in the
TP group and put back in image order, so the LLM sees exactly what a single encoder would have produced.

Design:
- Host side, numpy (value-dependent, so never in `construct`): `image_costs` from `image_grid_thw`,
  `balance` (which rank encodes which images; `assign` adds the share budget), `balanced_batch` (what each
  rank of the group feeds), `gather_index` (where each merged token of the micro-batch sits in the
  all-gathered buffer).
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
- Static shapes: a rank's share is one row of `data.collate.share_budget` patches, padded like any row.
  When the cost split puts more merged tokens on a rank than that, `assign` splits by token counts instead
  (list scheduling: within the mean plus one item, which the budget holds).
- In the graph (semi-auto parallel): the ViT's inputs carry each rank's share (`runtime.dataset_strategy`
  splits them over dp * tp), so the ViT, data parallel over every rank of a stage (`parallelize.vision_layout`),
  encodes each rank's own images; `GroupMerge` declares the features whole within each TP group, where the
  compiled graph all-gathers them, and gathers them into the text by the group's `embed_index`
  (`group_embed_index`). Stand-alone, the same graph over all ranks' arrays concatenated gives the global
  batch's result (tests/parallel/test_shard_consistency.py); two msrun workers with a real AllGather give
  what one process computes (tests/workers/vit_balance_msrun.py).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
from mindspore import nn, ops
from mindspore.ops.operations import Identity
from mindspore.parallel import Layout as DeviceLayout

from mindvl_ms.data.collate import row_items, vision_arrays


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


def assign(grid_thw, vision, ranks: int, cap: int) -> List[List[int]]:
    """Which items each of `ranks` ranks encodes: `balance` on the costs, or, when that puts more than `cap`
    merged tokens on a rank, list scheduling on the token counts (each rank within the mean plus one item,
    which `data.collate.share_budget` sizes for). ValueError when even that does not fit."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    bins = balance(image_costs(grid, vision), ranks)
    m = vision.spatial_merge_size
    if max(rank_tokens(grid, bins, m)) > cap:
        bins = lpt(grid.prod(1) // (m * m), ranks)
    if max(rank_tokens(grid, bins, m)) > cap:
        raise ValueError(f"the micro-batch's {len(grid)} visual items hold {rank_tokens(grid, bins, m)} merged "
                         f"tokens per rank, more than the share budget of {cap}: raise max_image_tokens")
    return bins


def group_embed_index(embed_index: np.ndarray, image_rows: np.ndarray, tokens: np.ndarray,
                      where: np.ndarray) -> np.ndarray:
    """Row-local embed_index [B, L] (the text j -> j, the row's f-th merged token -> L + f) -> the index into
    the data-parallel rank's concat(text rows [B*L], all-gathered shares [ranks*Ud]) that `GroupMerge` takes:
    text j of row r -> r*L + j, a merged token -> B*L + its row in the gathered buffer (`where`, per merged
    token of the micro-batch in item order, from `gather_index`). The same on every rank of the group."""
    b, l = embed_index.shape
    starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    out = embed_index.astype(np.int64) + (np.arange(b, dtype=np.int64) * l)[:, None]
    for r in range(b):
        mine = [where[starts[i]:starts[i + 1]] for i in np.flatnonzero(image_rows == r)]
        pos = np.concatenate(mine) if mine else np.zeros(0, np.int64)
        vis = embed_index[r] >= l
        out[r, vis] = b * l + pos[embed_index[r, vis] - l]
    return out.astype(np.int32)


def balanced_batch(batch: Dict[str, np.ndarray], config, ranks: int, share, rank: int = None
                   ) -> List[Dict[str, np.ndarray]]:
    """A data-parallel rank's micro-batch (`data.collate.build_model_inputs` under the stage's RowBudget) ->
    what each of the `ranks` ranks of its tensor-parallel group feeds (only `rank`'s when given): the same
    text arrays, the group's `embed_index` (`group_embed_index`), and in place of the rows' ViT inputs
    (VISION_NAMES) its own share of the items (`assign`) as one row of `share.patches` patches
    (`data.collate.share_budget`), items in micro-batch order, padded like any row."""
    v = config.vision
    m = v.spatial_merge_size
    grid = batch["image_grid_thw"].reshape(-1, 3)
    units = share.patches // (m * m)
    bins = assign(grid, v, ranks, units)
    where = gather_index(grid, bins, m, units) if len(grid) else np.zeros(0, np.int32)
    embed = group_embed_index(batch["embed_index"], batch["image_rows"], grid.prod(1) // (m * m), where)
    items = [it for row in row_items(batch) for it in row]
    out = []
    for t in range(ranks) if rank is None else [rank]:
        share_arrays = vision_arrays([[items[i] for i in bins[t]]], share.patches, config, share)
        out.append({**batch, **share_arrays, "embed_index": embed})
    return out


def _redistribute(layout):
    """An Identity whose input and output carry `layout` (self-defined shard): placed after one with
    another layout, semi-auto parallel inserts the redistribution between the two (MindSpore's own reshard
    cell, parallel/_cell_wrapper.py, is built this way)."""
    return Identity().shard(in_strategy=(layout,), out_strategy=(layout,)).add_prim_attr("self_define_shard", True)


class GroupMerge(nn.Cell):
    """The visual merge of `MindVLModel` (`models.mindvl.RowMerge`) when the `ranks` ranks of each of the
    `groups` tensor-parallel groups split the micro-batch's items (balanced encoder data parallelism):

      text [B, L, D], image [groups*ranks*Ud, D] (the ViT over every rank's share, rank order),
      embed_index [B, L] (`group_embed_index`) -> embeddings [B, L, D]

    The features leave the ViT split over the groups and their ranks ((dp, tp, 1) on [groups, ranks*Ud, D]);
    the second Identity declares them whole within a group ((dp, 1, 1)), so the compiled graph all-gathers
    them over the TP group there, and its backward reduce-scatters their gradients back to the rank that
    encoded them. A per-group gather (batch_dims 1) then reads each group's text rows and gathered shares
    by the group-local `embed_index`, the same on every rank of the group."""

    def __init__(self, groups: int, ranks: int):
        super().__init__()
        self.groups = groups
        dev = DeviceLayout((groups, ranks), ("dp", "tp"))
        self.split = _redistribute(dev("dp", "tp", "None"))
        self.whole = _redistribute(dev("dp", "None", "None"))
        self.concat = ops.Concat(1).shard(((groups, 1, 1), (groups, 1, 1)))
        self.gather = ops.Gather(batch_dims=1).shard(((groups, 1, 1), (groups, 1)))

    def construct(self, text, image, embed_index):
        b, l, d = text.shape
        g = self.groups
        feats = self.whole(self.split(image.reshape(g, -1, d)))  # [dp, tp*Ud, D], whole in each group
        table = self.concat((text.reshape(g, -1, d), feats.astype(text.dtype)))  # [dp, B/dp*L + tp*Ud, D]
        return self.gather(table, embed_index.reshape(g, -1), 1).reshape(b, l, d)  # [B, L, D]
