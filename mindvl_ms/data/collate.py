"""Host-side batch builder: processed samples -> the numpy arrays the compiled model takes.

A batch is a list of rows; each row is a list of samples packed one after another (a row with one sample
is an ordinary unpacked batch row). Everything value-dependent is computed here, in numpy.

The data contract (what makes the arrays shardable by rows, `parallel.runtime.dataset_strategy`): every
model input has the micro-batch row dimension first and every index in it is local to its row, so the
rows of a data-parallel rank mean the same in the global graph as in its own batch; the graph adds the
row offsets itself (`models.mindvl.flat_vision_inputs`). Concatenating ranks' arrays along dim 0 gives
the global batch's arrays (segment ids aside: they are compared within a row only).
  input_ids, segment_ids   int32[B, L]    tokens; sample ids (1, 2, ... numbered over the batch, 0 =
                                          padding): attention is block-diagonal + causal within a sample
  position_ids             int32[B, 3, L] M-RoPE (t, h, w) positions, restarting at 0 for every sample
  pixel_values             float32[B, P, K] each row's patches (its images and videos packed in text
                           order), padded to P patches; padding patches form their own windows and frames
                           (never attended to by a real patch, never gathered into the text)
  vision_pos_ids           int32[B, P, 2] and the ViT metadata of `rope_index.vision_metadata` per row:
  window_index, reverse_index int32[B, P/4]; window_segment_ids, full_segment_ids int32[B, P] (1-based)
  embed_index              int32[B, L] gather index into the row's concat(text [L], visual [P/4]): each
                           <|image_pad|> / <|video_pad|> token takes its merged feature (a count mismatch
                           is a ValueError, never a crop), every other token its own embedding
  window_gather / full_gather int32[B, S, W] patches of each ViT window / frame of the row, padded with P
                           (see `block_gather`), so attention runs per block, not over an N x N mask
  actual_seq_len           int32[B, K] each row's cumulative segment ends (`llm_actual_seq_len`), for the
                           Ascend TND flash-attention kernel
plus next-token `targets` (never crossing a sample boundary) and each target's order within its sample.
Sizes: L = pad_to (or the longest row); P, S, W, K = the batch's largest (dynamic shapes, CPU training and
inference) or, given a `RowBudget`, the stage's fixed budget (semi-auto parallel: every rank's local
arrays have the same shape at every step).
"""
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
from mindspore import Tensor

from mindvl_ms.config import MindVLConfig
from mindvl_ms.data.rope_index import pad_grids, rope_index, vision_metadata, visual_order
from mindvl_ms.data.tokens import IGNORE_INDEX

INPUT_NAMES = ("input_ids", "position_ids", "segment_ids", "pixel_values", "vision_pos_ids", "window_index",
               "reverse_index", "window_segment_ids", "full_segment_ids", "embed_index", "window_gather",
               "full_gather", "actual_seq_len")
# rank of each input (row dimension first): what its `dataset_strategy` entry spans
INPUT_RANKS = {"input_ids": 2, "position_ids": 3, "segment_ids": 2, "pixel_values": 3, "vision_pos_ids": 3,
               "window_index": 2, "reverse_index": 2, "window_segment_ids": 2, "full_segment_ids": 2,
               "embed_index": 2, "window_gather": 3, "full_gather": 3, "actual_seq_len": 2}
# the ViT's inputs: with the ViT data parallel inside a tensor-parallel group they carry each rank's balanced
# share of the micro-batch's images instead of its rows (`parallel.vit_balance`)
VISION_NAMES = ("pixel_values", "vision_pos_ids", "window_index", "reverse_index", "window_segment_ids",
                "full_segment_ids", "window_gather", "full_gather")


def segment_ends(seg) -> np.ndarray:
    """Segment ids of one sequence (contiguous runs) -> int32 cumulative end of each run.

    No leading 0, last entry = len(seg): the `actual_seq_qlen` / `actual_seq_kvlen` convention of
    FlashAttentionScore's TND layout. [1, 1, 2, 2, 2, 0] -> [2, 5, 6].
    """
    seg = np.asarray(seg).reshape(-1)
    if seg.size == 0:
        return np.zeros(0, np.int32)
    change = np.flatnonzero(seg[1:] != seg[:-1]) + 1
    return np.append(change, seg.size).astype(np.int32)


def llm_actual_seq_len(segment_ids: np.ndarray, slots: Optional[int] = None) -> np.ndarray:
    """segment_ids int32[B, L] -> int32[B, K]: each row's cumulative segment ends within the row, padded to
    K entries with the row's end L (MindFormers' compressed-EOD layout; the padding tail of a row is a
    segment of its own). K = the most segments in a row, or `slots`. Row-local, so the array splits by rows
    under data parallelism; the graph adds each row's start r*L (`models.mindvl.flat_vision_inputs`)."""
    b, l = segment_ids.shape
    ends = [segment_ends(row) for row in segment_ids]
    k = max([e.size for e in ends] + [1])
    if slots is not None:
        if slots < k:
            raise ValueError(f"a row holds {k} segments, more than slots={slots}")
        k = slots
    out = np.full((b, k), l, np.int32)
    for r, e in enumerate(ends):
        out[r, :e.size] = e
    return out


def block_gather(seg) -> np.ndarray:
    """1-based block ids of N tokens (blocks contiguous and numbered 1..S in order) -> int32[S, W].

    Row s lists the token indices of block s, padded to W (the longest block) with N, the index of a zero
    row the model appends. The block of token t is seg[t] - 1, its slot is t - gather[seg[t] - 1, 0].
    """
    seg = np.asarray(seg, np.int64).reshape(-1)
    ends = segment_ends(seg)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    if seg.size and not np.array_equal(seg[starts], np.arange(1, ends.size + 1)):
        raise ValueError("block ids must be contiguous runs numbered 1, 2, ... in order")
    width = int((ends - starts).max()) if seg.size else 1
    slot = np.arange(width)
    gather = starts[:, None] + slot[None, :]
    return np.where(slot[None, :] < (ends - starts)[:, None], gather, seg.size).astype(np.int32)


def patch_dim(config: MindVLConfig) -> int:
    v = config.vision
    return v.in_channels * v.temporal_patch_size * v.patch_size ** 2


def _check_sample(s: Dict, where: str) -> None:
    if "input_ids" not in s:
        raise ValueError(f"{where}: sample has no input_ids")
    if (s.get("pixel_values") is None) != (s.get("image_grid_thw") is None):
        raise ValueError(f"{where}: pixel_values and image_grid_thw must be given together")
    if (s.get("pixel_values_videos") is None) != (s.get("video_grid_thw") is None):
        raise ValueError(f"{where}: pixel_values_videos and video_grid_thw must be given together")


def visual_items(s: Dict, ids: np.ndarray, config: MindVLConfig, where: str):
    """A sample's images and videos in order of appearance: [(patches float32[n, patch_dim], grid int64[3])],
    plus (image grids, video grids, second_per_grid_ts) for the rope index."""
    m, pd = config.vision.spatial_merge_size, patch_dim(config)
    split = {}
    grids = {}
    for kind, pkey, gkey in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        g = s.get(gkey)
        grids[kind] = None if g is None else np.asarray(g, np.int64).reshape(-1, 3)
        if g is None:
            split[kind] = []
            continue
        pv = np.asarray(s[pkey], np.float32)
        need = int(grids[kind].prod(axis=1).sum())
        if pv.shape != (need, pd):
            raise ValueError(f"{where}: {pkey} shape {pv.shape}, expected ({need}, {pd}) for {gkey} "
                             f"{grids[kind].tolist()}")
        split[kind] = np.split(pv, np.cumsum(grids[kind].prod(axis=1))[:-1])
    spg = s.get("second_per_grid_ts")
    try:
        order = visual_order(ids, grids["image"], config.image_token_id, grids["video"], config.video_token_id, m)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    items = [(split[kind][k], grids[kind][k]) for kind, k, _ in order]
    return items, grids["image"], grids["video"], (None if spg is None else np.asarray(spg, np.float64).reshape(-1))


def _targets(labels, n: int, where: str):
    """A sample's labels int[n] -> (next-token targets int[n], order of each supervised target in the sample
    int[n], -1 elsewhere); the last position has no next token within the sample."""
    lab = np.asarray(labels, np.int64).reshape(-1)
    if lab.size != n:
        raise ValueError(f"{where}: labels has {lab.size} entries, input_ids {n}")
    tgt = np.concatenate([lab[1:], [IGNORE_INDEX]])
    sup = tgt != IGNORE_INDEX
    return tgt, np.where(sup, np.cumsum(sup) - 1, -1)


class RowBudget(NamedTuple):
    """A stage's fixed per-row sizes (`row_budget`): with them every rank's local arrays have one shape at
    every step, as semi-auto parallel's static graph needs."""
    seq_length: int      # L, tokens per row
    patches: int         # P, vision patches per row (a multiple of the merge unit)
    slots: int           # K, segments per row in actual_seq_len
    window_blocks: int   # S of window_gather
    window_width: int    # W of window_gather
    full_blocks: int     # S of full_gather
    full_width: int      # W of full_gather
    rows: int = 0        # B at least: a short micro-batch (an epoch's last) gets empty rows (0: as given)


MIN_SAMPLE_TOKENS = 8  # a processed sample holds at least its chat turn markers: bounds samples per row


def _item_patches(config: MindVLConfig, data):
    """(smallest, largest) frame of any image or video item in patches, a multiple of the merge unit."""
    v = config.vision
    unit = v.spatial_merge_size ** 2
    p2 = v.patch_size ** 2
    smallest = max(unit, min(data.image.min_pixels, data.video.video_min_pixels) // p2 // unit * unit)
    largest = -(-max(data.image.max_pixels, data.video.video_max_pixels) // p2 // unit) * unit
    return smallest, largest


def _blocks(config: MindVLConfig, data, patches: int, seq_length: int, rows: int) -> RowBudget:
    """A RowBudget for rows of `patches` patches: the block counts and widths that hold for any such row."""
    v = config.vision
    unit = v.spatial_merge_size ** 2
    vmw = v.window_size // v.spatial_merge_size // v.patch_size
    window = min(unit * vmw * vmw, patches)
    smallest, largest = _item_patches(config, data)
    return RowBudget(seq_length=seq_length, patches=patches, slots=seq_length // MIN_SAMPLE_TOKENS + 1,
                     window_blocks=patches // unit, window_width=window,
                     full_blocks=patches // smallest + patches // window + 1,
                     full_width=min(patches, max(largest, window)), rows=rows)


def row_budget(config: MindVLConfig, data) -> RowBudget:
    """The fixed sizes of a stage from its data config (`RunConfig.stage_data`). P is the packer's
    visual-token budget (`DataConfig.visual_budget`) in patches; the block counts and widths are bounds that
    hold for any row of at most P patches: a window holds 1..vmw^2 merge units, a frame at least the
    smallest and at most the largest resized image or video frame, padding comes in chunks of one window."""
    patches = data.visual_budget() * config.vision.spatial_merge_size ** 2
    return _blocks(config, data, patches, data.seq_length, data.micro_batch_size)


def share_budget(config: MindVLConfig, data, ranks: int) -> RowBudget:
    """The fixed sizes of one rank's share of a micro-batch's images when `ranks` ranks split them
    (`parallel.vit_balance`): one "row" of Pd patches, Pd = ceil(B*P / ranks) + the largest item (an image,
    or a whole video up to video_total_pixels, at most P), at most B*P and a multiple of the merge unit.
    Any split of whole items in which each rank's patches stay within the mean plus one item (list
    scheduling's bound, which `vit_balance.assign` falls back to) fits it."""
    rows = row_budget(config, data)
    unit = config.vision.spatial_merge_size ** 2
    total = rows.rows * rows.patches
    _, largest = _item_patches(config, data)
    video = -(-data.video.video_total_pixels // config.vision.patch_size ** 2 // unit) * unit
    item = min(rows.patches, max(largest, video))
    per = min(total, -(-(-(-total // ranks) + item) // unit) * unit)
    return _blocks(config, data, per, rows.seq_length, 1)


def _text_arrays(rows: Sequence[Sequence[Dict]], config: MindVLConfig, length: int):
    """Token-side arrays of a batch (module docstring) plus each row's visual items in text order."""
    v = config.vision
    m = v.spatial_merge_size
    b = len(rows)
    out = {"input_ids": np.zeros((b, length), np.int32), "position_ids": np.zeros((b, 3, length), np.int32),
           "segment_ids": np.zeros((b, length), np.int32),
           "embed_index": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
           "targets": np.full((b, length), IGNORE_INDEX, np.int32), "token_index": np.full((b, length), -1, np.int32)}
    row_items: List[List] = []
    sample_id = 0
    for r, row in enumerate(rows):
        col, n_feat, items_r = 0, 0, []
        for k, s in enumerate(row):
            where = f"row {r} sample {k}"
            _check_sample(s, where)
            ids = np.asarray(s["input_ids"], np.int64).reshape(-1)
            n = ids.size
            items, igrid, vgrid, spg = visual_items(s, ids, config, where)
            try:
                pos = rope_index(ids, igrid, config.image_token_id, m, v.tokens_per_second,
                                 video_grid_thw=vgrid, video_token_id=config.video_token_id,
                                 second_per_grid_ts=spg, accumulate=config.text.mrope_accumulate)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            sample_id += 1
            sl = slice(col, col + n)
            out["input_ids"][r, sl] = ids
            out["position_ids"][r, :, sl] = pos
            out["segment_ids"][r, sl] = sample_id
            if s.get("labels") is not None:
                out["targets"][r, sl], out["token_index"][r, sl] = _targets(s["labels"], n, where)
            vis_pos = np.flatnonzero((ids == config.image_token_id) | (ids == config.video_token_id))
            out["embed_index"][r, col + vis_pos] = length + n_feat + np.arange(vis_pos.size)
            items_r += items
            n_feat += vis_pos.size
            col += n
        row_items.append(items_r)
    out["num_samples"] = np.int32(sample_id)
    return out, row_items


def _row_vision(items, patches: int, config: MindVLConfig) -> Dict[str, np.ndarray]:
    """One row's visual items [(patches float32[n, K], grid [3])] padded to `patches` -> its row-local ViT
    arrays. The padding is a chain of window-sized blank frames (`rope_index.pad_grids`)."""
    v = config.vision
    m = v.spatial_merge_size
    real = sum(pv.shape[0] for pv, _ in items)
    if real > patches:
        raise ValueError(f"a row holds {real} vision patches, more than its budget of {patches}")
    grids = [np.asarray(g, np.int64).reshape(3) for _, g in items]
    grids += list(pad_grids((patches - real) // (m * m), m, v.window_size // m // v.patch_size))
    meta = vision_metadata(np.stack(grids), v.window_size, v.patch_size, m)
    pixels = np.zeros((patches, patch_dim(config)), np.float32)
    if items:
        pixels[:real] = np.concatenate([pv for pv, _ in items])
    meta["pixel_values"] = pixels
    meta["window_gather"] = block_gather(meta["window_segment_ids"])
    meta["full_gather"] = block_gather(meta["full_segment_ids"])
    return meta


def _stack_blocks(gathers: Sequence[np.ndarray], fill: int, size, what: str) -> np.ndarray:
    """Rows' block gathers [S_r, W_r] -> int32[B, S, W] padded with `fill` (empty blocks at the end of a
    row, every slot a padding slot); (S, W) = the largest, or `size` when fixed."""
    s = max(g.shape[0] for g in gathers)
    w = max(g.shape[1] for g in gathers)
    if size is not None:
        if s > size[0] or w > size[1]:
            raise ValueError(f"a row needs {s} {what} blocks of up to {w} patches, over the budget {size}")
        s, w = size
    out = np.full((len(gathers), s, w), fill, np.int32)
    for r, g in enumerate(gathers):
        out[r, :g.shape[0], :g.shape[1]] = g
    return out


def build_model_inputs(rows: Sequence[Sequence[Dict]], config: MindVLConfig, pad_to: Optional[int] = None,
                       budget: Optional[RowBudget] = None) -> Dict[str, np.ndarray]:
    """See the module docstring; returns INPUT_NAMES arrays plus targets, token_index, num_samples and
    image_grid_thw (the batch's real grids, in row and text order) with image_rows (each grid's row).
    `budget` fixes every size (it sets L, overriding `pad_to`); rows it adds to reach `budget.rows` are empty:
    all padding, no targets, no samples, so the loss is unchanged."""
    unit = config.vision.spatial_merge_size ** 2
    if budget is not None and len(rows) < budget.rows:
        rows = list(rows) + [[] for _ in range(budget.rows - len(rows))]
    length = max([sum(len(np.asarray(s["input_ids"]).reshape(-1)) for s in row) for row in rows] + [0])
    pad_to = budget.seq_length if budget is not None else pad_to
    if pad_to is not None:
        if length > pad_to:
            raise ValueError(f"a row holds {length} tokens, more than pad_to={pad_to}")
        length = pad_to
    out, row_items = _text_arrays(rows, config, length)
    real = [sum(pv.shape[0] for pv, _ in items) for items in row_items]
    patches = budget.patches if budget is not None else max(real + [unit])
    out.update(vision_arrays(row_items, patches, config, budget))
    out["actual_seq_len"] = llm_actual_seq_len(out["segment_ids"], budget.slots if budget is not None else None)
    grids = [np.asarray(g, np.int64).reshape(1, 3) for items in row_items for _, g in items]
    out["image_grid_thw"] = (np.concatenate(grids) if grids else np.zeros((0, 3))).astype(np.int32)
    out["image_rows"] = np.array([r for r, items in enumerate(row_items) for _ in items], np.int32)
    return out


def vision_arrays(row_items: Sequence[Sequence], patches: int, config: MindVLConfig,
                  budget: Optional[RowBudget] = None) -> Dict[str, np.ndarray]:
    """The VISION_NAMES arrays of rows of visual items [(patches float32[n, K], grid [3])], each row padded
    to `patches`; the block gathers sized by `budget` when given (else the rows' largest)."""
    metas = [_row_vision(items, patches, config) for items in row_items]
    out = {key: np.stack([meta[key] for meta in metas]) for key in VISION_NAMES[:6]}
    fixed = budget is not None
    out["window_gather"] = _stack_blocks([meta["window_gather"] for meta in metas], patches,
                                         (budget.window_blocks, budget.window_width) if fixed else None, "window")
    out["full_gather"] = _stack_blocks([meta["full_gather"] for meta in metas], patches,
                                       (budget.full_blocks, budget.full_width) if fixed else None, "frame")
    return out


def row_items(batch: Dict[str, np.ndarray]) -> List[List]:
    """The visual items [(patches [n, K], grid [3])] of each row of a `build_model_inputs` batch, in text
    order (read back from its pixel_values, image_grid_thw and image_rows)."""
    out: List[List] = [[] for _ in range(batch["pixel_values"].shape[0])]
    at = [0] * len(out)
    for grid, r in zip(batch["image_grid_thw"], batch["image_rows"]):
        n = int(np.prod(grid))
        out[r].append((batch["pixel_values"][r, at[r]:at[r] + n], np.asarray(grid, np.int64)))
        at[r] += n
    return out


def model_args(batch: Dict[str, np.ndarray]):
    """The positional model inputs (as MindSpore Tensors) in INPUT_NAMES order."""
    return [Tensor(batch[k]) for k in INPUT_NAMES]
