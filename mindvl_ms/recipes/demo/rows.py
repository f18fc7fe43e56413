"""The rows a demo stage trains on (`DemoRows`, the `data_factory` of `run_training`).

Samples are parsed once and measured from metadata, mix weights repeat/subsample a source
deterministically, and `data.packing.pack_bfd` packs them into rows of the stage's sequence length; the
trainer gets them as an in-memory `RowSource`, and images are decoded per batch (`DemoRows.collate`).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

import numpy as np

from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.data.offline import sample_meta
from mindvl_ms.data.packing import Item, pack_bfd, split_oversized
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError, iter_jsonl
from mindvl_ms.train.batches import RowSource


log = logging.getLogger(__name__)


class DemoRows:
    """`data_factory` for run_training: mix-weighted, packed rows of parsed samples per stage.

    Rows hold parsed samples (`data.schema.Sample`, text and image paths only); lengths for packing
    come from metadata (`data.offline.sample_meta`, no image decoding). The images are decoded and
    patchified when a batch is built (`collate`), so memory stays flat however large the data is.
    """

    def __init__(self, progress: bool = True):
        self.parsed: Dict[str, List[Any]] = {}
        self.proc = None
        self.progress = progress
        self.reports: Dict[str, Dict[str, Any]] = {}

    def processor(self, data_cfg):
        if self.proc is None or self.proc.config.image != data_cfg.image or \
                self.proc.config.system_prompt != data_cfg.system_prompt:
            self.proc, self.parsed = MindVLProcessor(config=data_cfg), {}
        return self.proc

    def samples(self, path: str, data_cfg) -> List[Any]:
        """[(Sample, tokens, image_tokens)] of a JSONL file (parsed once, cached)."""
        proc = self.processor(data_cfg)
        if path not in self.parsed:
            out = []
            for n, s in iter_jsonl(path):
                try:
                    if isinstance(s, SampleError):
                        raise s
                    out.append((s, *sample_meta(proc, s)))
                except SampleError as e:  # demo data is generated, so a bad line is a bug: stop loudly
                    raise ValueError(str(e)) from None
            self.parsed[path] = out
        return self.parsed[path]

    def collate(self, model_cfg):
        """Trainer collate: process the row's samples, `build_model_inputs` (padded to the longest row);
        the train step compacts the supervised positions itself (`train.loss_head`)."""
        def collate(rows, stage):
            done = [[self.proc.process_sample(s) for s in row] for row in rows]
            return build_model_inputs(done, model_cfg)
        return collate

    def __call__(self, run_cfg, stage, stage_index: int, dist):
        data_cfg = run_cfg.stage_data(stage)
        rng = np.random.default_rng([run_cfg.seed, stage_index])
        chosen: List[Any] = []
        for src in data_cfg.sources:
            pool = self.samples(src.path, data_cfg)
            reps = int(np.floor(src.weight))
            idx = np.concatenate([np.arange(len(pool))] * reps + [
                rng.choice(len(pool), size=int(round((src.weight - reps) * len(pool))), replace=False)])
            chosen.extend(pool[int(i)] for i in idx)
        items = [Item(i, tokens, image_tokens) for i, (_, tokens, image_tokens) in enumerate(chosen)]
        budget = min(data_cfg.visual_budget(), stage.seq_length)
        ok, dropped = split_oversized(items, stage.seq_length, budget)
        if dropped:
            log.warning("stage %s: %d sample(s) do not fit a %d-token row and are left out (first: %s)",
                        stage.name, len(dropped), stage.seq_length, dropped[0][1])
        packs = pack_bfd(ok, stage.seq_length, budget)
        rows = [[chosen[it.key][0] for it in p.items] for p in packs]
        fill = sum(p.tokens for p in packs) / max(1, len(packs) * stage.seq_length)
        self.reports[stage.name] = {"samples": len(ok), "dropped": len(dropped), "rows": len(rows),
                                    "fill": round(fill, 3)}
        log.info("stage %s: %d samples packed into %d rows of %d tokens (%.1f%% full)", stage.name, len(ok),
                 len(rows), stage.seq_length, 100 * fill)
        return RowSource(rows, seed=run_cfg.seed + stage_index, shuffle=data_cfg.shuffle)
