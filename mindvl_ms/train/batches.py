"""Row sources for the trainer: where each global batch of packed rows comes from, resumably.

A *row* is a list of processed samples packed into one sequence (the `rows` argument of
`data.collate.build_model_inputs`). A source hands out whole **global** batches in a deterministic
order (a fresh permutation per epoch from `seed + epoch`); the trainer gives rank r the slice
`[r*per_rank, (r+1)*per_rank)`, and splits that into micro-batches. Every rank therefore sees the
same stream and the same state, so a single `state_dict()` ({epoch, pos}) resumes all of them and a
single process with more accumulation sees exactly the rows that data-parallel ranks see.

Any object with `rows_per_epoch`, `next_global_batch(n)`, `state_dict()` and
`load_state_dict(d)` can be passed to `run_training` through `data_factory`. One that also has
`peek_global_batch(n)` (the next batch, position unchanged) gets its next batch collated on a thread
while the current step runs (`CollateAhead`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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

    def peek_global_batch(self, n: int) -> List[Sequence[Dict[str, Any]]]:
        """The rows `next_global_batch(n)` returns next, without moving the position (RowSource's own
        draw: a subclass's side effects on drawing do not run)."""
        saved = self.epoch, self.pos, self._order
        try:
            return RowSource.next_global_batch(self, n)
        finally:
            self.epoch, self.pos, self._order = saved

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, d: Dict[str, int]) -> None:
        if d.get("rows", len(self.rows)) != len(self.rows):
            raise ValueError(f"data state is for {d['rows']} rows, this source has {len(self.rows)}: "
                             "resuming on different data would not continue the same run")
        self.epoch, self.pos, self._order = int(d["epoch"]), int(d["pos"]), None


class CollateAhead:
    """Collates the rows of the next step on one background thread while the current step runs.

    Collation (image decode, patches, tokens, position ids) is host work that otherwise sits between two
    compiled steps. `ahead(rows)` starts collating rows that the source has not handed out yet (its
    `peek_global_batch`); `take(rows)` returns the collated micro-batches of the rows actually drawn: the
    thread's result when they are the same row objects, else a collation done here. The source's position
    only moves in the draw, so checkpoints and resume see what they see without this. Collation runs on one
    thread at a time and in draw order, so a collate that uses the global RNGs draws the same numbers.
    """

    def __init__(self, collate: Callable[[List], List[Dict[str, np.ndarray]]]):
        self.collate = collate
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Tuple[List, Future]] = None

    def ahead(self, rows: List) -> None:
        """Start collating `rows` (the next step's, not drawn yet) on the thread."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mindvl-collate")
        self._pending = (rows, self._pool.submit(self.collate, rows))

    def take(self, rows: List) -> List[Dict[str, np.ndarray]]:
        """The collated micro-batches of `rows` (this step's, drawn): an error of the thread's collation
        is raised here, at the step that needs the batch."""
        if self._pending is not None:
            ahead, fut = self._pending
            if len(ahead) == len(rows) and all(a is b for a, b in zip(ahead, rows)):
                self._pending = None
                return fut.result()
        self.wait()  # nothing started, or another batch was drawn (a subclass's draw): the thread's work dropped
        return self.collate(rows)

    def wait(self) -> None:
        """Let a started collation finish and drop it (stage end, error): nothing runs on after."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].exception()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


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
