"""Per-rank loading with an exact, resumable position (the paper's consumed-data tracker).

Two sources of packs, one loader:
- `PackedShardSource` (offline mode): rank r opens only `rank_{r:05d}.jsonl` of a `mindvl data pack`
  directory and indexes its line offsets; a pack is read by seeking to it. Shard position i is
  global step i on every rank (the packer aligned ViT load per step), so the epoch order is a
  permutation of shard positions drawn from (seed, epoch) only, identical on all ranks; the rank
  enters through its shard.
- `OnlinePackSource` (online mode): rank r reads only its stride of each JSONL source (lines
  r, r+dp, ...; a source with a `format:` is converted as it is read, `data/formats/source.py`), shuffles it
  with (seed, epoch, rank, source), repeats/subsamples by mix weight, computes
  token counts from metadata and packs with `OnlinePacker`. Resuming replays the epoch's metadata
  stream (no image decoding) up to the saved pack, which reproduces the packer's state exactly.
- Both hand each sample on with its source file (`sample.source`: the source's path online, the packed
  file offline), which is how the processor applies a source's own `video:` settings to its videos
  (`DataConfig.video_for`) when counting tokens and when decoding.

`DataLoader` turns packs into micro-batches: every sample of a pack is processed
(`MindVLProcessor.process_sample`), the rows go through `collate` (by default the model's
`build_model_inputs(rows, config, pad_to)`). It counts batches as they are handed to the trainer,
so `state_dict()` is the consumed position even when a MindSpore pipeline prefetches ahead;
`load_state_dict()` restores it and the next batch is exactly the one that would have come.
`to_mindspore()` wraps the same batches in a `mindspore.dataset.GeneratorDataset` (random access
over the remaining batches of the epoch, order preserved).

Bad samples: any failure of one line (undecodable bytes, schema, unreadable image, a size that
disagrees with `image_sizes`, a quality filter, or any other exception while processing it) skips
that line with a warning naming file:line; it is counted in `skips` (a `skiplog.SkipLog`) and in the
epoch counters `skip_stats()` hands the trainer's `SkipGuard`, which stops a stage whose skipped
fraction exceeds `data.max_skip_fraction`.
"""
from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore.dataset as msd
import numpy as np

from mindvl_ms.config.data import DataConfig
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.data.formats import SourceRecords
from mindvl_ms.data.jsonl import line_offsets, read_at
from mindvl_ms.data.offline import sample_meta
from mindvl_ms.data.packing import Item, OnlinePacker
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError, parse_raw, parse_sample
from mindvl_ms.data.skiplog import SkipLog, data_fingerprint

Pack = List[Tuple[Dict[str, Any], str, int]]  # [(raw sample object, source path for relative images, line)]


class PackedShardSource:
    """Packs of one rank's offline shard (see module doc)."""

    kind = "offline"

    def __init__(self, packed_dir: str, config: DataConfig):
        man_path = os.path.join(packed_dir, "manifest.json")
        if not os.path.isfile(man_path):
            raise FileNotFoundError(f"{packed_dir}: no manifest.json (run `mindvl data pack` first)")
        with open(man_path, encoding="utf-8") as f:
            man = json.load(f)
        if man["dp_size"] != config.dp_size:
            raise ValueError(f"{man_path}: packed for dp_size={man['dp_size']}, but data.dp_size={config.dp_size}")
        if man["seq_length"] > config.seq_length:
            raise ValueError(f"{man_path}: packs of {man['seq_length']} tokens exceed data.seq_length={config.seq_length}")
        self.config, self.source = config, man.get("source", man_path)
        self.shard = os.path.join(packed_dir, man["shards"][config.dp_rank])
        self.offsets = [o for _, o in line_offsets(self.shard)]
        if len(self.offsets) != man["rank_packs"][config.dp_rank]:
            raise ValueError(f"{self.shard}: {len(self.offsets)} packs, manifest says {man['rank_packs'][config.dp_rank]}")
        packs = man.get("packs")
        self.epoch_total = (sum(len(p["lines"]) for p in packs if p["rank"] == config.dp_rank)
                            if packs is not None else None)
        self.on_skip: Optional[Callable[[SampleError], None]] = None

    def skip(self, epoch: int, packs: int) -> Iterator[Pack]:
        """The epoch's packs after the first `packs` (cheap: the order is known up front)."""
        n, c = len(self.offsets), self.config
        order = np.random.default_rng([c.seed, epoch]).permutation(n) if c.shuffle else np.arange(n)
        for i in order[packs:]:
            rec = json.loads(read_at(self.shard, self.offsets[i]))
            yield [(obj, self.shard, line) for obj, line in zip(rec["samples"], rec["lines"])]

    def epoch_packs(self, epoch: int) -> Iterator[Pack]:
        return self.skip(epoch, 0)


class OnlinePackSource:
    """Streaming packs from this rank's stride of the JSONL sources (see module doc)."""

    kind = "online"

    def __init__(self, config: DataConfig, processor):
        if not config.sources:
            raise ValueError("data.sources is empty: online packing needs at least one JSONL file")
        self.config, self.proc = config, processor
        r, dp = config.dp_rank, config.dp_size
        self.lines, self.records = [], []  # per source: [(line, offset)] of this rank, the lines' reader
        for s in config.sources:
            if not os.path.isfile(s.path):
                raise FileNotFoundError(f"data source not found: {s.path}")
            self.records.append(SourceRecords(s, lambda n: (n - 1) % dp == r))  # converts `format:` sources
            self.lines.append(self.records[-1].offsets)
        self.dropped: Counter = Counter()
        self.epoch_total: Optional[int] = None
        self.on_skip: Optional[Callable[[SampleError], None]] = None  # set by the DataLoader
        self._muted = False
        self._counting = False

    def _epoch_order(self, epoch: int) -> List[Tuple[int, int, int]]:
        """[(source index, line, offset)] for the epoch: weight w gives floor(w) passes + a random fraction."""
        c, out = self.config, []
        for k, (src, lines) in enumerate(zip(c.sources, self.lines)):
            rng = np.random.default_rng([c.seed, epoch, c.dp_rank, k])
            reps = [rng.permutation(len(lines)) for _ in range(int(np.ceil(src.weight)))]
            take = np.concatenate(reps)[: int(round(src.weight * len(lines)))] if reps else []
            out += [(k, *lines[i]) for i in take]
        rng = np.random.default_rng([c.seed, epoch, c.dp_rank])
        perm = rng.permutation(len(out)) if c.shuffle else np.arange(len(out))
        return [out[i] for i in perm]

    def _items(self, epoch: int) -> Iterator[Item]:
        order = self._epoch_order(epoch)
        self.epoch_total = len(order)
        for k, line, off in order:
            path = self.config.sources[k].path
            try:
                s = parse_raw(self.records[k].raw(line, off), path, line)
                if isinstance(s, SampleError):
                    raise s
                tokens, img = sample_meta(self.proc, s)
            except Exception as e:  # any per-line failure costs the line, never the run
                err = e if isinstance(e, SampleError) else SampleError(path, line, "error", f"{type(e).__name__}: {e}")
                self.dropped[err.reason] += 1
                self._skipped(err)
                continue
            yield Item((k, line, off), tokens, img)

    def _skipped(self, err: SampleError) -> None:
        if not (self._muted or self._counting):  # a resume replays the epoch up to the saved pack: counted once
            warnings.warn(f"skipping {err}")
            if self.on_skip is not None:
                self.on_skip(err)

    def skip(self, epoch: int, packs: int) -> Iterator[Pack]:
        self.dropped = Counter()  # per pass over the epoch (a resume replays the pass)
        packer = OnlinePacker(self.config.seq_length, self.config.visual_budget(), self.config.online_buffer)
        self._muted = packs > 0
        for n, pack in enumerate(packer.pack_stream(self._items(epoch))):
            if n < packs:
                self._muted = n < packs - 1
                continue
            self._muted = False
            yield [(json.loads(self.records[k].raw(line, off)), self.config.sources[k].path, line)
                   for (k, line, off) in (it.key for it in pack.items)]
        self._muted = False
        for it, reason in packer.dropped:
            k, line, _ = it.key
            self.dropped[reason.split(" (")[0]] += 1
            self._skipped(SampleError(self.config.sources[k].path, line, reason.split(" (")[0], reason))

    def epoch_packs(self, epoch: int) -> Iterator[Pack]:
        """Every pack of an epoch, e.g. to count them; its skips are left to the loader's own pass."""
        self._counting = True
        try:
            yield from self.skip(epoch, 0)
        finally:
            self._counting = False


class DataLoader:
    """Micro-batches of processed packs with an exact consumed-data state (see module doc)."""

    def __init__(self, source, processor, config: DataConfig, collate: Optional[Callable] = None,
                 model_config=None):
        self.source, self.proc, self.config = source, processor, config
        if collate is None and model_config is not None:
            pad = config.pad_to or config.seq_length
            collate = lambda rows: build_model_inputs(rows, model_config, pad_to=pad)  # noqa: E731
        self.collate = collate or (lambda rows: rows)
        self.epoch, self.position, self.consumed_samples = 0, 0, 0
        self.skipped: List[str] = []
        self.skips = SkipLog()                      # every skip of this loader, by reason
        self.epoch_seen, self.epoch_skipped = 0, 0  # this epoch (since the start or the resume)
        source.on_skip = self._source_skip

    def _source_skip(self, err: SampleError) -> None:
        """A line the source dropped before packing (metadata pass, over-length): seen and skipped."""
        self.epoch_seen += 1
        self._skip(err)

    def _skip(self, err: SampleError) -> None:
        self.skipped.append(str(err))
        self.epoch_skipped += 1
        self.skips.add(err.reason, f"{err.source}:{err.line}")

    def skip_stats(self) -> Dict[str, Any]:
        """Counters for the trainer's SkipGuard (see skiplog.py)."""
        return {"epoch_seen": self.epoch_seen, "epoch_skipped": self.epoch_skipped,
                "epoch_total": getattr(self.source, "epoch_total", None), "reasons": self.skips.reasons}

    def fingerprint(self) -> Dict[str, Any]:
        return data_fingerprint(self.config)

    @classmethod
    def from_config(cls, config: DataConfig, processor=None, model_config=None, collate=None) -> "DataLoader":
        proc = processor or MindVLProcessor(config=config)
        if config.packing == "offline" and not config.packed_dir:
            raise ValueError("data.packing is offline but data.packed_dir is empty: run `mindvl data pack IN.jsonl "
                             "OUT_DIR` and set data.packed_dir: OUT_DIR, or set data.packing: online")
        src = (PackedShardSource(config.packed_dir, config) if config.packing == "offline"
               else OnlinePackSource(config, proc))
        return cls(src, proc, config, collate=collate, model_config=model_config)

    def _rows(self, packs: Sequence[Pack]) -> List[List[Dict]]:
        rows = []
        for pack in packs:
            row = []
            for obj, path, line in pack:
                src = getattr(self.source, "source", path)  # the original JSONL, not the shard
                self.epoch_seen += 1
                try:
                    s = parse_sample(obj, src, line)
                    base = os.path.dirname(os.path.abspath(path))  # shard paths are relative to the shard
                    s.images = [os.path.normpath(os.path.join(base, p)) for p in (obj.get("images") or [])]
                    out = self.proc.process_sample(s)
                    out["source"] = src
                    row.append(out)
                except Exception as e:  # any per-line failure: counted and reported, never silent, never fatal
                    err = e if isinstance(e, SampleError) else SampleError(src, line, "error",
                                                                           f"{type(e).__name__}: {e}")
                    self._skip(err)
                    warnings.warn(f"skipping {err}")
            rows.append(row)
        return rows

    def _pack_batches(self, epoch: int, start: int) -> Iterator[List[Pack]]:
        """Raw packs grouped into micro-batches, from micro-batch `start` of the epoch."""
        mbs, buf = self.config.micro_batch_size, []
        for pack in self.source.skip(epoch, start * mbs):
            buf.append(pack)
            if len(buf) == mbs:
                yield buf
                buf = []
        if buf:
            yield buf

    def __iter__(self) -> Iterator[Any]:
        """Batches from the saved position to the end of the epoch; then the epoch advances."""
        if self.position == 0:
            self.epoch_seen, self.epoch_skipped = 0, 0
        for packs in self._pack_batches(self.epoch, self.position):
            batch = self.collate(self._rows(packs))
            self.position += 1
            self.consumed_samples += sum(len(p) for p in packs)
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> Dict[str, Any]:
        c = self.config
        return {"kind": self.source.kind, "epoch": self.epoch, "position": self.position,
                "consumed_samples": self.consumed_samples, "seed": c.seed, "dp_rank": c.dp_rank,
                "dp_size": c.dp_size, "micro_batch_size": c.micro_batch_size, "skipped": len(self.skipped),
                "dropped": dict(getattr(self.source, "dropped", {})), "skip_reasons": self.skips.reasons}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        c = self.config
        for key in ("kind", "seed", "dp_rank", "dp_size", "micro_batch_size"):
            mine = self.source.kind if key == "kind" else getattr(c, key)
            if state.get(key) != mine:
                raise ValueError(f"loader state was saved with {key}={state.get(key)!r}, this loader has {mine!r}: "
                                 f"resuming would not continue the same data order")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.consumed_samples = int(state["consumed_samples"])
        self.skips = SkipLog(state.get("skip_reasons"))
        self.epoch_seen, self.epoch_skipped = 0, 0

    def to_mindspore(self, column_names: Sequence[str]):
        """A MindSpore GeneratorDataset over the rest of the current epoch (random access, order kept,
        samples processed in the pipeline's workers). Iterate it with
        `create_tuple_iterator(num_epochs=1, output_numpy=True)` and call `mark_consumed()` once per batch
        taken, so the state follows what the trainer used, not what the pipeline prefetched."""
        groups = list(self._pack_batches(self.epoch, self.position))  # raw JSON only, no image decoding
        names = list(column_names)
        loader = self

        class _Source:
            def __len__(self):
                return len(groups)

            def __getitem__(self, i):
                out = loader.collate(loader._rows(groups[i]))
                return tuple(np.asarray(out[k]) for k in names)

        self._ms_start, self._ms_counts = self.position, [sum(len(p) for p in g) for g in groups]
        return msd.GeneratorDataset(_Source(), column_names=names, shuffle=False,
                                    num_parallel_workers=self.config.num_workers, python_multiprocessing=False)

    def mark_consumed(self) -> None:
        """Advance the state by one batch of the `to_mindspore()` pipeline (the epoch rolls over at its end)."""
        i = self.position - self._ms_start
        if not 0 <= i < len(self._ms_counts):
            raise RuntimeError("mark_consumed called more often than the pipeline has batches")
        self.consumed_samples += self._ms_counts[i]
        self.position += 1
        if i + 1 == len(self._ms_counts):
            self.epoch, self.position, self._ms_start, self._ms_counts = self.epoch + 1, 0, 0, []
