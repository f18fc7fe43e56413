"""Host-side (numpy) position indices: the 3D M-RoPE index of a token sequence and the vision tower's
per-patch metadata (2D RoPE positions, window order, attention segments).

These are value-dependent computations kept out of the compiled graph. They follow transformers'
Qwen2_5_VLModel.get_rope_index and Qwen2_5_VisionTransformerPretrainedModel.rot_pos_emb /
get_window_index exactly (images; a video is an image with t > 1 and `second_per_grid`).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


def visual_order(input_ids: np.ndarray, image_grid_thw: Optional[np.ndarray], image_token_id: int,
                 video_grid_thw: Optional[np.ndarray] = None, video_token_id: Optional[int] = None,
                 spatial_merge_size: int = 2) -> List[Tuple[str, int, int]]:
    """The visual items of one sample in order of appearance: [(kind 'image'|'video', index, first token)].

    Each item is a run of `t * h/m * w/m` pad tokens of its kind; images and videos interleave as the
    text places them (transformers' get_rope_index walks them the same way).
    """
    ids = np.asarray(input_ids).reshape(-1)
    kinds = [("image", image_grid_thw, image_token_id), ("video", video_grid_thw, video_token_id)]
    runs = {}
    for kind, grids, tok in kinds:
        grids = np.zeros((0, 3), np.int64) if grids is None else np.asarray(grids).reshape(-1, 3)
        pos = np.zeros(0, np.int64) if tok is None else np.flatnonzero(ids == tok)
        need = [int(t) * (int(h) // spatial_merge_size) * (int(w) // spatial_merge_size) for t, h, w in grids]
        if pos.size != sum(need):
            raise ValueError(f"sample has {pos.size} {kind} tokens but its {kind}s give {sum(need)} merged "
                             f"patches ({len(need)} {kind}s)")
        starts = np.concatenate([[0], np.cumsum(need)[:-1]]).astype(np.int64) if need else np.zeros(0, np.int64)
        runs[kind] = [(kind, k, int(pos[st])) for k, st in enumerate(starts)]
    return sorted(runs["image"] + runs["video"], key=lambda item: item[2])


def rope_index(input_ids: np.ndarray, image_grid_thw: Optional[np.ndarray], image_token_id: int,
               spatial_merge_size: int = 2, tokens_per_second: int = 2,
               second_per_grid: float = 0.0, video_grid_thw: Optional[np.ndarray] = None,
               video_token_id: Optional[int] = None,
               second_per_grid_ts: Optional[Sequence[float]] = None, accumulate: bool = False) -> np.ndarray:
    """M-RoPE positions int64[3, n] for one sample (no padding).

    Text tokens get equal (t, h, w) positions counting on from the previous maximum + 1; the
    `grid_t * grid_h/m * grid_w/m` tokens of each image or video get (t, row, col) offsets from the
    position where it starts. The temporal offset of temporal patch i is
    `int(i * second_per_grid * tokens_per_second)` (Qwen2.5-VL's absolute time): `second_per_grid` for
    images, `second_per_grid_ts[k]` for video k (seconds spanned by one temporal patch).

    With `accumulate` (openPangu-VL's accumulative strategy, `text.mrope_accumulate`), the temporal
    patches of a video are placed one after another like separate images: patch i gets (0, row, col)
    offsets from its own start, and the next starts after it (start + max(h/m, w/m)), so successive
    frames never share a spatial position. Images accumulate either way (each starts after the previous
    maximum). Positions then follow frame order, not seconds: `second_per_grid_ts` is not read, and the
    same frames sampled at 2 fps or at 1 fps get the same positions. This is the report's reading: section
    2.3 accumulates "to facilitate better differentiation between distinct spatial positions across
    multiple input sources (e.g., ... successive frames in a video)", and section 2.4 trains "precise
    time-aware tasks like temporal localization" at "a constant FPS of 1 ..., enabling the model to
    perceive temporal information to some extent", a constant rate that is needed only because the
    positions do not carry seconds (the Qwen3-VL 3D-IM-RoPE it cites likewise numbers frames, not seconds).

    Unlike transformers 4.57.1, which casts `second_per_grid_t` to an integer tensor before multiplying
    (so 0.75 s becomes 0), the product is taken in floating point, as Qwen2.5-VL defines it.
    """
    ids = np.asarray(input_ids).reshape(-1)
    grids = {"image": None if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3),
             "video": None if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3)}
    order = visual_order(ids, grids["image"], image_token_id, grids["video"], video_token_id, spatial_merge_size)
    if order and grids["video"] is not None and second_per_grid_ts is not None \
            and len(second_per_grid_ts) != len(grids["video"]):
        raise ValueError(f"second_per_grid_ts has {len(second_per_grid_ts)} entries for {len(grids['video'])} videos")
    parts, st, nxt = [], 0, 0
    for kind, k, ed in order:
        t, h, w = grids[kind][k]
        lt, lh, lw = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        n = lt * lh * lw
        text_len = ed - st
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + nxt)
        h_idx = np.broadcast_to(np.arange(lh)[None, :, None], (lt, lh, lw)).reshape(-1)
        w_idx = np.broadcast_to(np.arange(lw)[None, None, :], (lt, lh, lw)).reshape(-1)
        if accumulate and kind == "video":  # frame order, not time (docstring)
            t_idx = np.zeros(lt * lh * lw, np.int64)
            frame_start = np.repeat(np.arange(lt) * max(lh, lw), lh * lw)  # [lt*lh*lw]
        else:
            spg = second_per_grid if kind == "image" else (
                float(second_per_grid_ts[k]) if second_per_grid_ts is not None else 1.0)
            t_idx = (np.arange(lt)[:, None] * spg * tokens_per_second).astype(np.int64)
            t_idx = np.broadcast_to(t_idx, (lt, lh * lw)).reshape(-1)
            frame_start = 0
        vis = np.stack([t_idx, h_idx, w_idx]) + frame_start + text_len + nxt
        parts.append(vis)
        nxt = int(vis.max()) + 1
        st = ed + n
    if st < ids.size:
        parts.append(np.broadcast_to(np.arange(ids.size - st), (3, ids.size - st)) + nxt)
    return np.concatenate(parts, axis=1).astype(np.int64) if parts else np.zeros((3, 0), np.int64)


def vision_metadata(grid_thw: np.ndarray, window_size: int, patch_size: int,
                    spatial_merge_size: int = 2) -> Dict[str, np.ndarray]:
    """Per-patch metadata of a packed list of images, all in window order (N patches, N/4 merge units).

    Returns vision_pos_ids int32[N, 2], window_index int32[N/4], reverse_index int32[N/4],
    window_segment_ids int32[N] (1-based window ids), full_segment_ids int32[N] (1-based frame ids).
    """
    m = spatial_merge_size
    unit = m * m
    vmw = window_size // m // patch_size  # windows are vmw x vmw merge units
    pos, win_idx, win_seg, full_seg = [], [], [], []
    offset, next_win, next_frame = 0, 1, 1
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3):
        t, h, w = int(t), int(h), int(w)
        hp = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
        wp = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
        pos.append(np.tile(np.stack([hp.reshape(-1), wp.reshape(-1)], -1), (t, 1)))  # image order
        lh, lw = h // m, w // m
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = vmw - lh % vmw, vmw - lw % vmw
        nwh, nww = (lh + pad_h) // vmw, (lw + pad_w) // vmw
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nwh, vmw, nww, vmw).transpose(0, 1, 3, 2, 4).reshape(t, nwh * nww, vmw * vmw)
        for f in range(t):
            for wi in range(nwh * nww):
                units = padded[f, wi][padded[f, wi] != -100]
                if units.size == 0:
                    continue
                win_idx.append(units + offset)
                win_seg.append(np.full(units.size * unit, next_win))
                full_seg.append(np.full(units.size * unit, next_frame + f))
                next_win += 1
        next_frame += t
        offset += t * lh * lw
    window_index = np.concatenate(win_idx).astype(np.int64)
    pos = np.concatenate(pos).reshape(-1, unit, 2)[window_index].reshape(-1, 2)
    return {
        "vision_pos_ids": pos.astype(np.int32),
        "window_index": window_index.astype(np.int32),
        "reverse_index": np.argsort(window_index, kind="stable").astype(np.int32),
        "window_segment_ids": np.concatenate(win_seg).astype(np.int32),
        "full_segment_ids": np.concatenate(full_seg).astype(np.int32),
    }


def pad_grids(units: int, spatial_merge_size: int, window_units: int) -> List[np.ndarray]:
    """Grids (t, h, w) of blank frames that cover `units` padding merge units of a row's patch budget:
    frames of one attention window (window_units^2 units) and a 1-unit-high strip for the rest, so each
    padding block (window or frame) is at most one window wide and none joins a real image's blocks."""
    m, w = spatial_merge_size, window_units
    whole, rest = divmod(int(units), w * w)
    grids = [np.array([1, m * w, m * w], np.int64) for _ in range(whole)]
    if rest:
        grids.append(np.array([1, m, m * rest], np.int64))
    return grids


def merged_tokens(grid_thw: Sequence[int], spatial_merge_size: int = 2) -> int:
    """Number of LLM tokens (<|image_pad|>) one image of grid (t, h, w) becomes."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (spatial_merge_size ** 2)
