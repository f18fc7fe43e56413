"""Host-side batch builder: processed samples -> the numpy arrays the compiled model takes.

A batch is a list of rows; each row is a list of samples packed one after another (a row with one sample
is an ordinary unpacked batch row). Everything value-dependent is computed here, in numpy:
- M-RoPE position ids, restarting at 0 for every sample of a pack;
- batch-unique segment ids (attention is block-diagonal + causal within a segment, 0 = padding);
- vision metadata for all images and videos of the batch packed into one patch sequence (window order,
  2D RoPE positions, window / full attention segments; a video's full attention is per temporal patch,
  as in Qwen2.5-VL);
- `embed_index`, a gather index into concat(text embeddings [B*L], visual features [M]) that puts each
  image's or video's merged features at its <|image_pad|> / <|video_pad|> tokens, items in the order the
  text places them (a count mismatch is a ValueError, never a crop);
- next-token `targets` (never crossing a sample boundary) and each target's order within its sample;
- the attention layouts (see `segment_ends`, `block_gather`, `llm_actual_seq_len`):
  `window_gather` int32[Sw, Ww] / `full_gather` int32[Sf, Wf]: the patches of each ViT window / image
  (frame) padded to the longest one with the index N (a zero row), so window and full attention run per
  block ([S, H, W, W] scores) instead of over one N x N mask; `actual_seq_len` int32[B*K]: the LLM's
  cumulative segment ends over the flattened [B*L] tokens for the Ascend TND flash-attention kernel.
With no image in the batch a dummy 2x2-patch image is added whose features nothing gathers, so the graph
is the same for text-only and multimodal batches.
"""
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import Tensor

from mindvl_ms.config import MindVLConfig
from mindvl_ms.data.rope_index import rope_index, vision_metadata, visual_order
from mindvl_ms.data.tokens import IGNORE_INDEX

INPUT_NAMES = ("input_ids", "position_ids", "segment_ids", "pixel_values", "vision_pos_ids", "window_index",
               "reverse_index", "window_segment_ids", "full_segment_ids", "embed_index", "window_gather",
               "full_gather", "actual_seq_len")


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
    """segment_ids int32[B, L] -> int32[B*K]: each row's segment ends offset by r*L (the row's start in the
    flattened [B*L] tokens), padded to K entries with the row's end (MindFormers' compressed-EOD layout;
    the padding tail of a row is a segment of its own). K = the most segments in a row, or `slots`.
    A fixed K per row keeps the array splittable by rows under data parallelism, strategy (dp,)."""
    b, l = segment_ids.shape
    ends = [segment_ends(row) for row in segment_ids]
    k = max([e.size for e in ends] + [1])
    if slots is not None:
        if slots < k:
            raise ValueError(f"a row holds {k} segments, more than slots={slots}")
        k = slots
    out = np.empty((b, k), np.int64)
    for r, e in enumerate(ends):
        out[r] = r * l + l
        out[r, :e.size] = r * l + e
    return out.reshape(-1).astype(np.int32)


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


def build_model_inputs(rows: Sequence[Sequence[Dict]], config: MindVLConfig,
                       pad_to: Optional[int] = None) -> Dict[str, np.ndarray]:
    """See the module docstring; returns INPUT_NAMES arrays plus targets, token_index and num_samples."""
    v = config.vision
    m = v.spatial_merge_size
    unit = m * m
    lengths = [sum(len(np.asarray(s["input_ids"]).reshape(-1)) for s in row) for row in rows]
    length = max(lengths) if lengths else 0
    if pad_to is not None:
        if length > pad_to:
            raise ValueError(f"a row holds {length} tokens, more than pad_to={pad_to}")
        length = pad_to
    b = len(rows)
    input_ids = np.zeros((b, length), np.int32)
    position_ids = np.zeros((3, b, length), np.int32)
    segment_ids = np.zeros((b, length), np.int32)
    targets = np.full((b, length), IGNORE_INDEX, np.int32)
    token_index = np.full((b, length), -1, np.int32)
    image_slot = np.full((b, length), -1, np.int64)  # merged-feature index for image tokens
    pixels: List[np.ndarray] = []
    grids: List[np.ndarray] = []
    n_feat, sample_id = 0, 0
    for r, row in enumerate(rows):
        col = 0
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
            input_ids[r, sl] = ids
            position_ids[:, r, sl] = pos
            segment_ids[r, sl] = sample_id
            if s.get("labels") is not None:
                targets[r, sl], token_index[r, sl] = _targets(s["labels"], n, where)
            vis_pos = np.flatnonzero((ids == config.image_token_id) | (ids == config.video_token_id))
            for pv, g in items:
                pixels.append(pv)
                grids.append(g[None])
            image_slot[r, col + vis_pos] = n_feat + np.arange(vis_pos.size)
            n_feat += vis_pos.size
            col += n
    if not grids:  # dummy image: one merge unit, never gathered
        grids.append(np.array([[1, m, m]], np.int64))
        pixels.append(np.zeros((unit, patch_dim(config)), np.float32))
    grid_all = np.concatenate(grids)
    meta = vision_metadata(grid_all, v.window_size, v.patch_size, m)
    flat_slot = image_slot.reshape(-1)
    embed_index = np.where(flat_slot >= 0, b * length + flat_slot, np.arange(b * length)).astype(np.int32)
    out = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "pixel_values": np.concatenate(pixels).astype(np.float32),
        **meta,
        "embed_index": embed_index,
        "window_gather": block_gather(meta["window_segment_ids"]),
        "full_gather": block_gather(meta["full_segment_ids"]),
        "actual_seq_len": llm_actual_seq_len(segment_ids),
        "targets": targets,
        "token_index": token_index,
        "num_samples": np.int32(sample_id),
        "image_grid_thw": grid_all.astype(np.int32),
    }
    return out


def model_args(batch: Dict[str, np.ndarray]):
    """The positional model inputs (as MindSpore Tensors) in INPUT_NAMES order."""
    return [Tensor(batch[k]) for k in INPUT_NAMES]
