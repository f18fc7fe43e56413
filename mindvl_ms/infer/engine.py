"""Host-side generation loop over three compiled graphs (vision, prefill, decode), backend-agnostic.

`Engine(backend)` runs batched generation; a backend supplies `spec` (an EngineSpec) and four calls on
numpy arrays: `vision(pixels, meta, uint8) -> [M, D]`, `new_cache(B, S)`, `prefill(arrays, cache)` and
`decode(arrays, cache)` -> (logits [B, V], cache). The eager MindSpore cells (generate.py) and the exported
MindIR graphs (mindir_runner.py) are two such backends, so both run exactly this code.

Everything value-dependent is computed here, in numpy: M-RoPE positions (`rope_index`; decode positions
continue from each prompt's max position + 1, transformers' rope_deltas), vision window metadata, the
gather index that puts image and video features at the <|image_pad|> / <|video_pad|> tokens (items in
the order the prompt places them; videos as float temporal patches with `second_per_grid_ts`), cache
slots and the valid-slot mask.
Prompts of different lengths share one batch with left (default) or right padding: with left padding all
rows write the same decode slot; with right padding each row writes its own; the graphs are the same.

Image features are cached by content (sha1 of the patch bytes and grid), so a chat that re-sends an image
in later turns, or a batch that repeats one, runs the vision encoder once per distinct image.
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindvl_ms.data.rope_index import rope_index, vision_metadata, visual_order
from mindvl_ms.infer.sampling import SamplingConfig, choose, stop_reason


@dataclass
class EngineSpec:
    """What the host side needs to know about the model (from a MindVLConfig or an export JSON)."""

    image_token_id: int
    spatial_merge_size: int
    tokens_per_second: int
    window_size: int
    patch_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    cache_dtype: str = "float32"
    video_token_id: int = -1         # <|video_pad|> (-1: the model takes no videos)
    mrope_accumulate: bool = False   # text.mrope_accumulate (video positions frame by frame)

    @classmethod
    def from_config(cls, cfg, cache_dtype: str = "float32") -> "EngineSpec":
        v, t = cfg.vision, cfg.text
        return cls(cfg.image_token_id, v.spatial_merge_size, v.tokens_per_second, v.window_size, v.patch_size,
                   t.num_hidden_layers, t.num_key_value_heads, t.head_dim_, t.hidden_size, t.vocab_size,
                   t.max_position_embeddings, cache_dtype, cfg.video_token_id, t.mrope_accumulate)


def _visual_parts(sample: Dict, spec: "EngineSpec"):
    """Per-image and per-video (kind, pixels or features, grid) of one sample in prompt order; videos are
    'float' temporal patches."""
    parts = _image_parts(sample, spec.spatial_merge_size)
    vgrid = sample.get("video_grid_thw")
    if vgrid is None:
        return parts
    vgrid = np.asarray(vgrid, np.int64).reshape(-1, 3)
    pix = np.asarray(sample["pixel_values_videos"], np.float32)
    counts = vgrid.prod(1)
    if pix.shape[0] != counts.sum():
        raise ValueError(f"{pix.shape[0]} video patch rows but video_grid_thw {vgrid.tolist()} needs {int(counts.sum())}")
    starts = np.concatenate([[0], np.cumsum(counts)])
    videos = [("float", pix[starts[i]:starts[i + 1]], vgrid[i]) for i in range(len(vgrid))]
    igrid = Engine._grids(sample) if parts else None
    order = visual_order(np.asarray(sample["input_ids"]).reshape(-1), igrid, spec.image_token_id, vgrid,
                         spec.video_token_id, spec.spatial_merge_size)
    return [(parts if kind == "image" else videos)[k] for kind, k, _ in order]


def _image_parts(sample: Dict, merge: int):
    """Per-image (kind, pixels or features, grid) of one sample; kind is 'float', 'uint8' or 'features'."""
    grid = sample.get("image_grid_thw")
    feats = sample.get("image_features")
    if feats is not None:
        return [("features", np.asarray(f, np.float32), None) for f in feats]
    if grid is None:
        if sample.get("pixel_values") is not None or sample.get("pixel_frames") is not None:
            raise ValueError("pixel_values / pixel_frames given without image_grid_thw")
        return []
    grid = np.asarray(grid, np.int64).reshape(-1, 3)
    kind, pix = ("uint8", sample.get("pixel_frames")) if sample.get("pixel_frames") is not None else \
        ("float", sample.get("pixel_values"))
    if pix is None:
        raise ValueError("image_grid_thw given without pixel_values or pixel_frames")
    pix = np.asarray(pix)
    counts = grid.prod(1)
    if pix.shape[0] != counts.sum():
        raise ValueError(f"{pix.shape[0]} patch rows but image_grid_thw {grid.tolist()} needs {int(counts.sum())}")
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [(kind, pix[starts[i]:starts[i + 1]], grid[i]) for i in range(len(grid))]


class Engine:
    def __init__(self, backend, max_cached_images: int = 256):
        self.backend = backend
        self.spec: EngineSpec = backend.spec
        self.image_cache: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self.max_cached_images = max_cached_images
        self.stats = {"vision_calls": 0, "images_encoded": 0, "images_reused": 0}

    # -- vision ---------------------------------------------------------------------------------
    def image_features(self, samples: Sequence[Dict]) -> List[List[np.ndarray]]:
        """Merged visual tokens [m_i, D] for every image of every sample, encoding only unseen images. The
        features returned are held apart from the bounded cache, so a call with more images than the cache
        keeps gets all of them."""
        parts = [_visual_parts(s, self.spec) for s in samples]
        todo: Dict[str, tuple] = {}
        found: Dict[str, np.ndarray] = {}
        keys = []
        for sp in parts:
            row = []
            for kind, pix, grid in sp:
                if kind == "features":
                    row.append(None)
                    continue
                key = hashlib.sha1(kind.encode() + np.ascontiguousarray(pix).tobytes() +
                                   grid.astype(np.int64).tobytes()).hexdigest()
                row.append(key)
                if key in self.image_cache:
                    self.image_cache.move_to_end(key)
                    found[key] = self.image_cache[key]
                    self.stats["images_reused"] += 1
                elif key not in todo:
                    todo[key] = (kind, pix, grid)
            keys.append(row)
        for kind in ("float", "uint8"):
            batch = [(k, p, g) for k, (kd, p, g) in todo.items() if kd == kind]
            if batch:
                found.update(self._encode(batch, kind == "uint8"))
        out = []
        for sp, row in zip(parts, keys):
            out.append([pix if key is None else found[key] for (_, pix, _), key in zip(sp, row)])
        return out

    def _encode(self, batch, uint8: bool) -> Dict[str, np.ndarray]:
        """One vision call over `batch` [(key, pixels, grid)]: {key: features}, also kept in the cache."""
        s = self.spec
        grids = np.stack([g for _, _, g in batch])
        meta = vision_metadata(grids, s.window_size, s.patch_size, s.spatial_merge_size)
        feats = self.backend.vision(np.concatenate([p for _, p, _ in batch]), meta, uint8)  # [M, D]
        self.stats["vision_calls"] += 1
        self.stats["images_encoded"] += len(batch)
        start, new = 0, {}
        for key, _, g in batch:
            n = int(np.prod(g)) // s.spatial_merge_size ** 2
            new[key] = self.image_cache[key] = feats[start:start + n]
            start += n
        while len(self.image_cache) > self.max_cached_images:
            self.image_cache.popitem(last=False)
        return new

    # -- generation -----------------------------------------------------------------------------
    def generate(self, samples: Sequence[Dict], cfg: SamplingConfig, padding_side: str = "left",
                 decode: Optional[Callable] = None, on_token: Optional[Callable[[int, int], None]] = None,
                 group_seeds: Optional[Sequence[Tuple[int, int]]] = None) -> List[List[int]]:
        """Generated ids per sample (an eos token is kept, as transformers does).

        `group_seeds` [(seed, rows), ...] splits the batch into consecutive row groups, each sampling from
        its own generator seeded `seed` instead of `cfg.seed`: a group then draws what a call holding only
        its rows draws (rollouts of many prompts in one batch, each reproducible from its own seed)."""
        cfg.validate()
        if group_seeds is not None and sum(n for _, n in group_seeds) != len(samples):
            raise ValueError(f"group_seeds cover {sum(n for _, n in group_seeds)} rows, the batch has "
                             f"{len(samples)}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if not samples:
            return []
        s = self.spec
        ids = [np.asarray(x["input_ids"], np.int64).reshape(-1) for x in samples]
        for i, x in enumerate(ids):
            if x.size == 0:
                raise ValueError(f"sample {i}: empty prompt")
            if x.size + cfg.max_new_tokens > s.max_positions:
                raise ValueError(f"sample {i}: prompt of {x.size} tokens + max_new_tokens {cfg.max_new_tokens} "
                                 f"exceeds the model's context of {s.max_positions} tokens")
            if x.max() >= s.vocab_size or x.min() < 0:
                bad = int(x.max()) if x.max() >= s.vocab_size else int(x.min())
                raise ValueError(f"sample {i}: token id {bad} outside the model vocabulary "
                                 f"({s.vocab_size}); is the tokenizer the model's?")
        arrays, state = self._prefill_arrays(samples, ids, self.image_features(samples), padding_side,
                                             cfg.max_new_tokens)
        cache = self.backend.new_cache(len(ids), arrays["kv_valid"].shape[1])
        logits, cache = self.backend.prefill(arrays, cache)
        rng = (np.random.default_rng(cfg.seed) if group_seeds is None else
               [(np.random.default_rng(seed), n) for seed, n in group_seeds])
        return self._decode_loop(logits, cache, ids, *state, arrays["kv_valid"], cfg, decode, on_token, rng)

    def _prefill_arrays(self, samples, ids, feats, padding_side: str, max_new: int):
        """The prefill graph's inputs for a padded batch, plus (next position, next slot) per row."""
        s = self.spec
        b, length = len(ids), max(x.size for x in ids)
        input_ids = np.zeros((b, length), np.int32)
        pos = np.zeros((3, b, length), np.int32)
        kv_valid = np.zeros((b, length + max_new), np.int32)  # cache slots: prompt columns, then new tokens
        image_slot = np.full((b, length), -1, np.int64)
        next_pos, next_slot, last = np.zeros(b, np.int64), np.zeros(b, np.int64), np.zeros(b, np.int64)
        n_feat = 0
        for r, (x, fl) in enumerate(zip(ids, feats)):
            grid = self._grids(samples[r]) if _image_parts(samples[r], s.spatial_merge_size) else None
            try:
                p = rope_index(x, grid, s.image_token_id, s.spatial_merge_size, s.tokens_per_second,
                               video_grid_thw=samples[r].get("video_grid_thw"), video_token_id=s.video_token_id,
                               second_per_grid_ts=samples[r].get("second_per_grid_ts"),
                               accumulate=s.mrope_accumulate)  # [3, n]
            except ValueError as e:
                raise ValueError(f"sample {r}: {e}") from None
            start = length - x.size if padding_side == "left" else 0
            col = slice(start, start + x.size)
            input_ids[r, col] = x
            pos[:, r, col] = p
            kv_valid[r, col] = 1
            last[r] = r * length + start + x.size - 1
            next_pos[r] = int(p.max()) + 1  # decode positions continue here (rope_deltas)
            next_slot[r] = start + x.size
            where = start + np.flatnonzero((x == s.image_token_id) | (x == s.video_token_id))
            need = sum(f.shape[0] for f in fl)
            if where.size != need:
                raise ValueError(f"sample {r}: {where.size} image tokens but its images give {need} features")
            image_slot[r, where] = n_feat + np.arange(need)
            n_feat += need
        flat = image_slot.reshape(-1)
        embed_index = np.where(flat >= 0, b * length + flat, np.arange(b * length)).astype(np.int32)
        all_feats = [f for fl in feats for f in fl]
        image_embeds = np.concatenate(all_feats).astype(np.float32) if all_feats else \
            np.zeros((1, s.hidden_size), np.float32)  # no image: one row nothing gathers
        arrays = {"input_ids": input_ids, "position_ids": pos, "image_embeds": image_embeds,
                  "embed_index": embed_index,
                  "write_pos": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),  # = column
                  "kv_valid": kv_valid, "last_index": last.astype(np.int32)}
        return arrays, (next_pos, next_slot)

    @staticmethod
    def _grids(sample):
        grid = sample.get("image_grid_thw")
        if grid is not None:
            return np.asarray(grid, np.int64).reshape(-1, 3)
        raise ValueError("image_features need image_grid_thw (the patch grid of each image)")

    def _decode_loop(self, logits, cache, ids, next_pos, next_slot, kv_valid, cfg, decode, on_token, rng):
        b = len(ids)
        out: List[List[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        for step in range(cfg.max_new_tokens):
            hist = [np.concatenate([ids[r], out[r]]) for r in range(b)]
            tok = choose(logits, hist, cfg, rng)
            for r in range(b):
                if done[r]:
                    continue
                out[r].append(int(tok[r]))
                if on_token is not None:
                    on_token(r, int(tok[r]))
                if stop_reason(out[r], cfg, decode):
                    done[r] = True
            if done.all() or step == cfg.max_new_tokens - 1:
                break
            slot = next_slot + step  # [B]
            kv_valid[np.arange(b), slot] = 1
            p = (next_pos + step).astype(np.int32)
            arrays = {"input_ids": tok.astype(np.int32)[:, None],
                      "position_ids": np.broadcast_to(p[None, :, None], (3, b, 1)).copy(),
                      "write_pos": slot.astype(np.int32)[:, None], "kv_valid": kv_valid}
            logits, cache = self.backend.decode(arrays, cache)
        return out
