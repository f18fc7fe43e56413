"""The data of a DPO or GRPO stage: preference pairs (`PairSource`) and RL prompts (`PromptSource`).

Every rank loads the stage's whole (small) post-training set into memory (images decoded once), draws
the same global batch in a per-epoch shuffled order and takes its contiguous slice, like
`train.batches.RowSource`. `post_data_factory` reads the stage's `data.sources` files (the trainer's
default for dpo / grpo stages); a `data_factory` passed to `run_training` may return a `PairSource` or
`PromptSource` built in memory instead.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

from mindvl_ms.data.preference import encode_pair, encode_prompt, read_post_file
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError, iter_jsonl
from mindvl_ms.train.batches import RowSource
from mindvl_ms.train.post.sampler import ResponseSampler, require_sampler


class PairSource:
    """Preference pairs [(chosen sample, rejected sample)] and optional NTP rows, resumable."""

    def __init__(self, pairs: Sequence, ntp_rows: Optional[Sequence] = None, seed: int = 0):
        self.pairs = list(pairs)
        self.main = RowSource(list(range(len(self.pairs))), seed)
        self.ntp = RowSource(list(ntp_rows), seed + 1) if ntp_rows else None

    @property
    def rows_per_epoch(self) -> int:
        return len(self.pairs)

    def state_dict(self) -> Dict[str, Any]:
        return {"pairs": self.main.state_dict(), "ntp": self.ntp.state_dict() if self.ntp else None}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        self.main.load_state_dict(d["pairs"])
        if self.ntp is not None:
            self.ntp.load_state_dict(d["ntp"])


class PromptSource:
    """RL prompts: dicts with input_ids (ending with the generation prompt), pixels, answer, reward;
    `decode(sampled ids) -> text` gives a response as the verifiers read it, `eos` ends a response."""

    def __init__(self, prompts: Sequence[Dict], decode: Callable, eos_token_ids: Sequence[int], seed: int = 0):
        self.prompts = list(prompts)
        self.decode, self.eos = decode, tuple(eos_token_ids)
        self.main = RowSource(list(range(len(self.prompts))), seed)

    @property
    def rows_per_epoch(self) -> int:
        return len(self.prompts)

    def state_dict(self) -> Dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        self.main.load_state_dict(d)


def post_data_factory(run_cfg, stage, stage_index: int, dist, sampler: Optional[ResponseSampler] = None):
    """The stage's `data.sources` read as preference (dpo) or prompt (grpo) files; dpo.ntp_sources as SFT
    (`ntp_rows`; each step draws `DPOConfig.ntp_rows` of them next to its pairs).
    A grpo stage reads its responses' stop ids and text through `sampler`."""
    cfg = run_cfg.stage_data(stage)
    if not cfg.sources:
        raise ValueError(f"stage '{stage.name}' ({stage.type}): data.sources is empty")
    for src in cfg.sources:
        if src.format != "jsonl":
            raise ValueError(f"stage '{stage.name}' ({stage.type}): source {src.path}: format '{src.format}': "
                             f"preference and prompt lines are read in this project's JSONL only (format: jsonl)")
    proc = MindVLProcessor(config=cfg)
    kind = "preference" if stage.type == "dpo" else "prompt"
    lines = [s for src in cfg.sources for s in read_post_file(src.path, kind)]
    if stage.type == "grpo":
        sampler = require_sampler(stage, sampler)
        prompts = [dict(encode_prompt(proc, s), answer=s.answer, reward=s.reward) for s in lines]
        eos = sampler.stop_ids(proc)
        return PromptSource(prompts, functools.partial(sampler.response_text, proc, stop_ids=eos), eos, cfg.seed)
    pairs = []
    for s in lines:
        p = encode_prompt(proc, s)
        pairs.append(encode_pair(proc, p, s))
    return PairSource(pairs, ntp_rows(stage, proc) or None, cfg.seed)


def ntp_rows(stage, proc: MindVLProcessor) -> list:
    """The SFT rows of a dpo stage's NTP mix (one sample per row), read from dpo.ntp_sources when
    dpo.ntp_ratio > 0; a ratio without sources (the shipped openPangu-VL stage, whose SFT files the user
    names) is an error naming both keys."""
    d = stage.dpo
    if not d.ntp_ratio:
        return []
    if not d.ntp_sources:
        raise ValueError(f"stage '{stage.name}' (dpo): dpo.ntp_ratio {d.ntp_ratio} mixes in SFT rows, but "
                         f"dpo.ntp_sources is empty: name the SFT files (e.g. [sft.jsonl]), or set ntp_ratio 0")
    rows = []
    for path in d.ntp_sources:
        for _, smp in iter_jsonl(path):
            if isinstance(smp, SampleError):
                raise smp
            rows.append([proc.process_sample(smp)])
    if not rows:
        raise ValueError(f"stage '{stage.name}' (dpo): dpo.ntp_sources {d.ntp_sources} hold no samples")
    return rows
