"""Skipped-sample accounting, the training stage's skip guard, and the data-source fingerprint.

- `SkipLog`: counts skipped lines by reason (each line once) and keeps the first few `file:line` of
  each reason (the loader fills it; it is saved in the loader state and printed in summaries).
- `SkipGuard` (used by the trainer once per global batch, before the optimizer step):
  * a global batch with no supervised token on any rank is never stepped (an empty step would still
    move weights through weight decay);
  * the stage stops when the loader has skipped more than `data.max_skip_fraction` of the epoch's
    samples. The denominator is the epoch's sample count when the source knows it (so the stop comes
    as soon as the threshold is certain and one early bad line cannot trigger it), else the samples
    seen so far; the counters restart with each epoch and after a resume;
  * the stage stops when a whole epoch's worth of consecutive batches held nothing to train on.
  Counts are summed over data-parallel ranks (one host all-reduce), so every rank decides alike.
- `data_fingerprint(config)`: paths, sizes and content hashes (first and last MiB) of a DataConfig's
  sources, or of the offline manifest; `--resume` compares it with the checkpoint's.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from mindvl_ms.config.base import ConfigError
from mindvl_ms.data.tokens import IGNORE_INDEX

FIRST = 3  # file:line kept per reason


class SkipLog:
    """Skipped samples by reason: {reason: {"count": n, "first": ["file:line", ...]}}. A line counts once
    however often it comes round (epochs, mix weights above 1)."""

    def __init__(self, reasons: Optional[Dict[str, Dict[str, Any]]] = None):
        self.reasons: Dict[str, Dict[str, Any]] = {k: {"count": int(v["count"]), "first": list(v["first"])}
                                                  for k, v in (reasons or {}).items()}
        self._lines = set()

    def add(self, reason: str, where: str) -> None:
        if (reason, where) in self._lines:
            return
        self._lines.add((reason, where))
        r = self.reasons.setdefault(reason, {"count": 0, "first": []})
        r["count"] += 1
        if len(r["first"]) < FIRST:
            r["first"].append(where)

    def merge(self, other: Dict[str, Dict[str, Any]]) -> None:
        for k, v in other.items():
            r = self.reasons.setdefault(k, {"count": 0, "first": []})
            r["count"] += int(v["count"])
            r["first"] = (r["first"] + [w for w in v["first"] if w not in r["first"]])[:FIRST]

    @property
    def total(self) -> int:
        return sum(v["count"] for v in self.reasons.values())

    def summary(self, indent: str = "  ") -> str:
        rows = sorted(self.reasons.items(), key=lambda kv: -kv[1]["count"])
        return "\n".join(f"{indent}{k}: {v['count']} (first: {', '.join(v['first'])})" for k, v in rows)


def supervised_tokens(micro_batches: List[Dict[str, Any]]) -> int:
    """Supervised targets in collated micro-batches (`targets`, else `labels`); -1 when neither exists."""
    n, known = 0, False
    for mb in micro_batches:
        t = mb.get("targets", mb.get("labels")) if isinstance(mb, dict) else None
        if t is not None:
            known = True
            n += int((np.asarray(t) != IGNORE_INDEX).sum())
    return n if known else -1


class SkipGuard:
    """The trainer's per-batch check (see module doc). `check()` returns (supervised tokens over all
    ranks, stop message or None)."""

    def __init__(self, stage: str, max_fraction: float, allreduce: Callable, rows_per_epoch: Optional[int],
                 batch_rows: int, gather: Optional[Callable] = None):
        self.stage, self.max_fraction, self.allreduce, self.gather = stage, max_fraction, allreduce, gather
        self.empty_limit = max(1, -(-(rows_per_epoch or 0) // max(batch_rows, 1))) if rows_per_epoch else None
        self.empty_run = 0

    def check(self, micro_batches: List[Dict[str, Any]], source) -> tuple:
        stats = source.skip_stats() if hasattr(source, "skip_stats") else None
        sup = supervised_tokens(micro_batches)
        s = stats or {}
        vec = np.array([max(sup, 0), sup < 0, s.get("epoch_skipped", 0), s.get("epoch_seen", 0),
                        s.get("epoch_total") or 0, s.get("epoch_total") is None], np.float64)
        g = np.asarray(self.allreduce(vec.astype(np.float32)), np.float64)
        g_sup = -1 if g[1] > 0 else int(g[0])
        skipped, seen, total = int(g[2]), int(g[3]), int(g[4])
        denom = seen if g[5] > 0 else max(total, seen)
        if stats is not None and skipped and skipped > self.max_fraction * denom:
            return g_sup, self._message(stats, skipped, denom, "" if g[5] > 0 else " this epoch's")
        self.empty_run = self.empty_run + 1 if g_sup == 0 else 0
        limit = self.empty_limit or (int(total) if total else None)
        if g_sup == 0 and limit is not None and self.empty_run >= limit:
            return g_sup, self._message(stats, skipped, denom, "", empty=True)
        return g_sup, None

    def skipped(self, loader) -> tuple:
        """(skipped lines, {reason: count}) of a loader with a SkipLog; (0, {}) for other sources."""
        log = getattr(loader, "skips", None)
        return (log.total, {k: v["count"] for k, v in log.reasons.items()}) if log is not None else (0, {})

    def no_data_message(self, loader, err: Exception) -> str:
        """The stage cannot start or go on: the loader produced no batch in a whole epoch."""
        log = getattr(loader, "skips", None) or SkipLog()
        body = log.summary() if log.reasons else "  (no line was skipped: the data sources have no samples)"
        return (f"stage '{self.stage}': the data produced no batch in a whole epoch ({err}); no checkpoint was "
                f"written. Skipped by reason:\n{body}\nCheck data.sources (`mindvl data validate FILE`).")

    def _message(self, stats, skipped: int, denom: int, of: str, empty: bool = False) -> str:
        log = SkipLog((stats or {}).get("reasons"))
        if self.gather is not None:  # every rank's reasons (all ranks reach this point together)
            log = SkipLog()
            for r in self.gather((stats or {}).get("reasons", {})).values():
                log.merge(r)
        head = (f"stage '{self.stage}': {self.empty_run} global batches in a row (a whole epoch) held no "
                f"supervised token" if empty else
                f"stage '{self.stage}': {skipped} of{of} {denom} samples were skipped "
                f"({100.0 * skipped / max(denom, 1):.1f}%, above data.max_skip_fraction={self.max_fraction:g})")
        body = log.summary() if log.reasons else "  (no sample was skipped: the samples have no supervised token)"
        return (f"{head}; this batch was not stepped and no checkpoint was written. "
                f"Skipped by reason:\n{body}\nFix or drop the bad lines (`mindvl data validate FILE --drop-bad "
                f"CLEAN.jsonl`) or raise data.max_skip_fraction.")


def _file_id(path: str) -> Dict[str, Any]:
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read())
    return {"path": os.path.abspath(path), "size": st.st_size, "sha256_ends": h.hexdigest()[:16]}


def data_fingerprint(config) -> Dict[str, Any]:
    """What identifies a stage's data (see module doc); comparable with `==`."""
    if getattr(config, "packing", "online") == "offline" and getattr(config, "packed_dir", ""):
        man = os.path.join(config.packed_dir, "manifest.json")
        return {"packed": _file_id(man) if os.path.isfile(man) else {"path": os.path.abspath(man)}}
    return {"sources": [_source_id(s) for s in getattr(config, "sources", [])]}


def _source_id(source) -> Dict[str, Any]:
    """A source's file identity and weight, plus how it is read when that is not the default (a `format:`
    other than jsonl, an `image_root`, its own `video:` settings), so changing only those is a data change too."""
    ident = _file_id(source.path) if os.path.isfile(source.path) else {"path": os.path.abspath(source.path)}
    ident["weight"] = source.weight
    for key, default in (("format", "jsonl"), ("image_root", "")):
        if getattr(source, key, default) != default:
            ident[key] = getattr(source, key)
    video = source.video.overrides()
    if video:  # frame counts, and so the packs, follow them
        ident["video"] = video
    return ident


def stage_fingerprint(run_cfg, stage) -> Dict[str, Any]:
    """`data_fingerprint` of a stage's data section (the run's `data` merged with the stage's)."""
    try:
        cfg = run_cfg.stage_data(stage)
    except ConfigError:
        return {}  # the data factory reports the config error itself
    return data_fingerprint(cfg)


def fingerprint_diff(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    """A one-line description of how two fingerprints differ ('' when equal)."""
    if old == new:
        return ""
    a = {d.get("path"): d for d in old.get("sources", [])} or {old.get("packed", {}).get("path"): old.get("packed")}
    b = {d.get("path"): d for d in new.get("sources", [])} or {new.get("packed", {}).get("path"): new.get("packed")}
    parts = [f"removed {p}" for p in a if p not in b] + [f"added {p}" for p in b if p not in a]
    keys = ("size", "sha256_ends", "weight", "format", "image_root", "video")
    parts += [f"{p} changed ({', '.join(k for k in keys if a[p].get(k) != b[p].get(k))})"
              for p in a if p in b and a[p] != b[p]]
    return "; ".join(parts) or "data sources changed"
