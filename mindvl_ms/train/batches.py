"""Row sources for the trainer: where each global batch of packed rows comes from, resumably.

A *row* is a list of processed samples packed into one sequence (the `rows` argument of
`data.collate.build_model_inputs`). A source hands out whole **global** batches in a deterministic
order (a fresh permutation per epoch from `seed + epoch`); the trainer gives rank r the slice
`[r*per_rank, (r+1)*per_rank)`, and splits that into micro-batches. Every rank therefore sees the
same stream and the same state, so a single `state_dict()` ({epoch, pos}) resumes all of them and a
single process with more accumulation sees exactly the rows that data-parallel ranks see.

Any object with `rows_per_epoch`, `next_global_batch(n)`, `state_dict()` and
`load_state_dict(d)` can be passed to `run_training` through `data_factory`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np


class RowSource:
    """In-memory rows with per-epoch deterministic shuffling and an exact resume position."""

    def __init__(self, rows: Sequence[Sequence[Dict[str, Any]]], seed: int = 0, shuffle: bool = True):
        if not rows:
            raise ValueError("RowSource: no rows (the stage's data produced nothing to train on)")
        self.rows = list(rows)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch, self.pos = 0, 0
        self._order: Optional[np.ndarray] = None

    @property
    def rows_per_epoch(self) -> int:
        return len(self.rows)

    def _perm(self) -> np.ndarray:
        if self._order is None:
            n = len(self.rows)
            self._order = (np.random.RandomState((self.seed + self.epoch) % 2**32).permutation(n)
                           if self.shuffle else np.arange(n))
        return self._order

    def next_global_batch(self, n: int) -> List[Sequence[Dict[str, Any]]]:
        """The next `n` rows of the stream, continuing into the next epoch when one ends."""
        out = []
        while len(out) < n:
            order = self._perm()
            take = min(n - len(out), len(order) - self.pos)
            out.extend(self.rows[i] for i in order[self.pos:self.pos + take])
            self.pos += take
            if self.pos == len(order):
                self.epoch, self.pos, self._order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, d: Dict[str, int]) -> None:
        if d.get("rows", len(self.rows)) != len(self.rows):
            raise ValueError(f"data state is for {d['rows']} rows, this source has {len(self.rows)}: "
                             "resuming on different data would not continue the same run")
        self.epoch, self.pos, self._order = int(d["epoch"]), int(d["pos"]), None


def rank_slice(global_rows: List, rank: int, world: int) -> List:
    """Rank r's contiguous share of a global batch."""
    per = len(global_rows) // world
    return global_rows[rank * per:(rank + 1) * per]


def micro_batches(rows: List, micro: int) -> List[List]:
    return [rows[i:i + micro] for i in range(0, len(rows), micro)]


class LoaderSource:
    """Adapter for the per-rank `mindvl_ms.data.dataset.DataLoader` (already collated micro-batches).

    The loader reads only this rank's shard/stride, so the trainer takes `accumulation` micro-batches
    from it per step (`next_micro_batches`) instead of slicing a global batch. Its state is the
    loader's exact consumed position; each rank stores its own (`data_rank<r>` in the checkpoint).
    """

    def __init__(self, loader, rows_per_epoch: Optional[int] = None):
        self.loader = loader
        self.rows_per_epoch = rows_per_epoch
        self._it = None

    def next_micro_batches(self, k: int) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        empty_epochs = 0
        while len(out) < k:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                out.append(next(self._it))
                empty_epochs = 0
            except StopIteration:
                self._it = None
                empty_epochs += 1
                if empty_epochs > 1:
                    raise RuntimeError("the data loader produced no batch in a whole epoch (is the data empty?)")
        return out

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        self.loader.load_state_dict(d)
        self._it = None
