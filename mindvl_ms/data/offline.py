"""Offline packing (`mindvl data pack`): metadata pass, best-fit-decreasing, per-rank shards, manifest.

1. Metadata pass (multi-process, tqdm): every line is parsed; image token counts come from
   `image_sizes` when present, else from the image header (PIL opens lazily: no pixel decoding);
   given `image_sizes` are checked against the headers (a line whose sizes disagree is dropped as
   "image size mismatch" with the field named: its token count would be wrong) unless
   `check_sizes=False` (`mindvl data pack --trust-image-sizes`, no image file is opened then);
   text token counts from the chat template via the tokenizer (`MindVLProcessor.count_tokens`,
   the same function the loader's lengths agree with). Bad lines become `dropped` entries with a
   reason, never silent skips.
2. `pack_bfd` under seq_length and max_image_tokens, then `assign_ranks` (equal pack counts,
   token-balanced ranks, ViT-balanced steps).
3. Output in OUT_DIR: `rank_00000.jsonl` ... one shard per data-parallel rank (a line is a pack:
   {"tokens", "image_tokens", "lines", "samples": [original JSON objects]}, image paths rewritten
   relative to OUT_DIR) and `manifest.json` as in docs/DATA.md plus balance statistics.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from tqdm import tqdm

from mindvl_ms.config.data import DataConfig
from mindvl_ms.data.image import image_size, image_tokens, quality_errors
from mindvl_ms.data.jsonl import line_offsets
from mindvl_ms.data.processor import MindVLProcessor, check_text
from mindvl_ms.data.packing import Item, assign_ranks, efficiency, pack_bfd, split_oversized
from mindvl_ms.data.schema import Sample, SampleError, count_placeholders, parse_raw, read_raw_lines

_PROC = None  # per-worker processor (tokenizer loaded once per process)
_CHECK = True  # per-worker: compare image_sizes with the image headers


def _init_worker(config: DataConfig, check_sizes: bool = True) -> None:
    global _PROC, _CHECK
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _PROC, _CHECK = MindVLProcessor(config=config), check_sizes


def sample_meta(proc, sample: Sample, check_sizes: bool = True) -> Tuple[int, int]:
    """(tokens, image_tokens) of a parsed sample from metadata (sizes or image headers); with
    `check_sizes`, given image_sizes must match the headers. Text holding a raw vision token is a
    SampleError here as in the loader (`check_text`)."""
    n_ph = count_placeholders(sample)
    if n_ph != len(sample.images):
        raise SampleError(sample.source, sample.line, "image count mismatch",
                          f"{n_ph} <image> placeholders for {len(sample.images)} images")
    check_text(sample)
    sizes = sample.image_sizes
    if sizes is None or check_sizes:
        real = []
        for k, p in enumerate(sample.images):
            try:
                real.append(image_size(p))
            except OSError as e:
                raise SampleError(sample.source, sample.line, "unreadable image", f"field images[{k}]: {e}") from None
        for k, (given, got) in enumerate(zip(sizes or real, real)):
            if tuple(given) != tuple(got):
                raise SampleError(sample.source, sample.line, "image size mismatch",
                                  f"field image_sizes[{k}]={list(given)} but {sample.images[k]} is {got[0]}x{got[1]}")
        sizes = real
    field = "image_sizes" if sample.image_sizes is not None else "images"
    for k, (w, h) in enumerate(sizes):
        bad = quality_errors(w, h, proc.image_config, sample.images[k])
        if bad:
            raise SampleError(sample.source, sample.line, bad[0][0], f"field {field}[{k}]: {bad[0][1]}")
    try:
        counts = [image_tokens(w, h, proc.image_config) for w, h in sizes]
    except (ValueError, OverflowError) as e:  # OverflowError: trusted image_sizes too large for a float
        raise SampleError(sample.source, sample.line, "bad image size", f"field {field}: {e}") from None
    vcounts = proc.video_token_counts(sample, proc.video_metas(sample, check=check_sizes))
    return proc.count_tokens(sample.messages, counts, vcounts), sum(counts) + sum(vcounts)


def _meta_chunk(args) -> List[Tuple[int, Optional[Tuple[int, int]], Optional[Tuple[str, str]]]]:
    """[(line, (tokens, image_tokens) or None, (reason, detail) or None)] for a chunk of raw lines
    (plain tuples: they cross process boundaries)."""
    path, chunk = args
    out = []
    for line, raw in chunk:
        try:
            s = parse_raw(raw, path, line)
            if isinstance(s, SampleError):
                raise s
            out.append((line, sample_meta(_PROC, s, _CHECK), None))
        except SampleError as e:
            out.append((line, None, (e.reason, e.detail)))
        except Exception as e:  # any per-line failure costs the line, never the run
            out.append((line, None, ("error", f"{type(e).__name__}: {e}")))
    return out


def compute_metadata(path: str, config: DataConfig, workers: int = 0, chunk: int = 2000,
                     progress: bool = True, check_sizes: bool = True) -> Tuple[List[Item], List[Dict[str, Any]]]:
    """Items (key = 1-based line) and dropped entries for every line of `path`."""
    lines = read_raw_lines(path)
    chunks = [(path, lines[i:i + chunk]) for i in range(0, len(lines), chunk)]
    workers = workers or os.cpu_count() or 1
    items, dropped = [], []
    bar = tqdm(total=len(lines), desc="metadata", unit="sample", disable=not progress)
    if workers > 1 and len(chunks) > 1:
        with mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(config, check_sizes)) as pool:
            results = pool.imap(_meta_chunk, chunks)
            for res in results:
                _collect(res, items, dropped)
                bar.update(len(res))
    else:
        _init_worker(config, check_sizes)
        for c in chunks:
            res = _meta_chunk(c)
            _collect(res, items, dropped)
            bar.update(len(res))
    bar.close()
    return items, dropped


def _collect(res, items, dropped) -> None:
    for line, meta, err in res:
        if meta is None:
            dropped.append({"line": line, "reason": err[0], "detail": err[1]})
        else:
            items.append(Item(line, meta[0], meta[1]))


def pack_file(path: str, out_dir: str, config: DataConfig, workers: Optional[int] = None,
              progress: bool = True, check_sizes: bool = True) -> Dict[str, Any]:
    """Pack `path` into per-rank shards under `out_dir`; returns the manifest (also written)."""
    t0 = time.perf_counter()
    items, dropped = compute_metadata(path, config, config.pack_workers if workers is None else workers,
                                      progress=progress, check_sizes=check_sizes)
    budget = config.visual_budget()
    if config.over_length == "error":
        _, bad = split_oversized(items, config.seq_length, budget)
        if bad:
            raise ValueError(f"{path}:{bad[0][0].key}: {bad[0][1]} (over_length: error; "
                             f"{len(bad)} such samples)")
    ok, bad = split_oversized(items, config.seq_length, budget)
    dropped += [{"line": it.key, "reason": reason} for it, reason in bad]
    t_meta = time.perf_counter() - t0
    packs = pack_bfd(ok, config.seq_length, budget)
    if len(packs) < config.dp_size:
        why = ""
        if dropped:
            dropped.sort(key=lambda d: d["line"])
            shown = "; ".join(f"{path}:{d['line']}: {d['reason']}" + (f": {d['detail']}" if d.get("detail") else "")
                              for d in dropped[:3])
            why = (f": {len(dropped)} of {len(items) + len(dropped) - len(bad)} lines were dropped ({shown}"
                   f"{'; ...' if len(dropped) > 3 else ''})")
        raise ValueError(f"{path}: only {len(packs)} packs for {config.dp_size} ranks{why}; "
                         f"add data or lower dp_size")
    ranks, stats = assign_ranks(packs, config.dp_size)
    t_pack = time.perf_counter() - t0 - t_meta
    os.makedirs(out_dir, exist_ok=True)
    _write_shards(path, out_dir, ranks, progress)
    all_packs = [p for r in ranks for p in r]
    dropped.sort(key=lambda d: d["line"])
    manifest = {
        "seq_length": config.seq_length, "dp_size": config.dp_size, "max_image_tokens": budget,
        "source": os.path.abspath(path), "num_lines": len(items) + len(dropped) - len(bad),
        "num_samples": sum(len(p.items) for p in all_packs), "num_packs": len(all_packs),
        "efficiency": round(efficiency(all_packs, config.seq_length), 6),
        "rank_tokens": stats["rank_tokens"], "rank_packs": stats["rank_packs"],
        "rank_image_tokens": stats["rank_image_tokens"], "rank_token_ratio": round(stats["rank_token_ratio"], 6),
        "vit_step_max_min_ratio_mean": round(stats["vit_step_max_min_ratio_mean"], 6),
        "dropped_counts": dict(Counter(d["reason"].split(" (")[0] for d in dropped)),
        "dropped": dropped,
        "shards": [f"rank_{r:05d}.jsonl" for r in range(config.dp_size)],
        "timing_s": {"metadata": round(t_meta, 3), "packing": round(t_pack, 3)},
        "packs": [{"rank": r, "tokens": p.tokens, "image_tokens": p.image_tokens, "lines": [it.key for it in p.items]}
                  for r, rp in enumerate(ranks) for p in rp],
    }
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))
    return manifest


def _write_shards(path: str, out_dir: str, ranks, progress: bool) -> None:
    """One JSONL shard per rank; samples copied verbatim except image paths (relative to out_dir).
    Only byte offsets are held in memory; each sample is read back with a seek when its pack is written."""
    offsets = dict(line_offsets(path))  # one offset index, no JSON parsing
    base, out_abs = os.path.dirname(os.path.abspath(path)), os.path.abspath(out_dir)
    bar = tqdm(total=sum(len(p.items) for r in ranks for p in r), desc="shards", unit="sample", disable=not progress)
    with open(path, "rb") as src:
        for r, rp in enumerate(ranks):
            tmp = os.path.join(out_dir, f"rank_{r:05d}.jsonl.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for p in rp:
                    samples = []
                    for it in p.items:
                        src.seek(offsets[it.key])
                        obj = json.loads(src.readline().decode("utf-8"))
                        if obj.get("images"):
                            obj["images"] = [os.path.relpath(q if os.path.isabs(q) else os.path.join(base, q), out_abs)
                                             for q in obj["images"]]
                        samples.append(obj)
                    f.write(json.dumps({"tokens": p.tokens, "image_tokens": p.image_tokens,
                                        "lines": [it.key for it in p.items], "samples": samples},
                                       ensure_ascii=False) + "\n")
                    bar.update(len(p.items))
            os.replace(tmp, os.path.join(out_dir, f"rank_{r:05d}.jsonl"))
    bar.close()
