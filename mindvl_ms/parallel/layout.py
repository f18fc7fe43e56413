"""The parallel layout of a run and the coordinates of each rank in it: the one place that maps
`rank -> (pp, dp, tp, ep)`.

Design (MindSpore semi-auto parallel conventions, as MindFormers uses them):
- `world = pp * dp * tp`. Pipeline stages own contiguous rank blocks: stage `s` holds ranks
  `[s * dp * tp, (s + 1) * dp * tp)`.
- Inside a stage the device matrix of a `((dp, 1), (tp, 1))` strategy is `[dp, tp]` with the last
  axis fastest, so `rank_in_stage = dp_idx * tp + tp_idx`: tensor-parallel groups are the `tp`
  consecutive ranks (one node's NPUs), data-parallel groups are strided by `tp`.
- Expert parallel reuses the stage's `dp * tp` devices through the device matrix `(dp*tp/ep, ep)`,
  so `ep_idx = rank_in_stage % ep` and the ep group of a rank is `ep` consecutive ranks.
- Data loaders read by `dp_idx` (ranks of one tensor-parallel group read the same rows).

`Layout.from_run_config(run_cfg, world)` reads `parallel_config` (and fills `data_parallel` from the
world size when it is left at 1 under plain data parallel).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from mindvl_ms.config.base import ConfigError


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the layout."""

    rank: int
    pp: int   # pipeline stage index
    dp: int   # data-parallel index (what the data loader reads by)
    tp: int   # tensor-parallel index inside the TP group
    ep: int   # expert-parallel index inside the EP group


@dataclass(frozen=True)
class Layout:
    """Sizes of the four parallel axes plus the flags that change strategies."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    seq_parallel: bool = False     # parallel_config.use_seq_parallel
    vocab_emb_dp: bool = True      # parallel_config.vocab_emb_dp

    def __post_init__(self):
        for k in ("dp", "tp", "pp", "ep"):
            if getattr(self, k) < 1:
                raise ConfigError(f"parallel_config: {k} must be >= 1, got {getattr(self, k)}")
        if (self.dp * self.tp) % self.ep:
            raise ConfigError(f"parallel_config.expert_parallel {self.ep} must divide data_parallel x "
                              f"model_parallel = {self.dp * self.tp} (experts are spread over the devices "
                              f"of one pipeline stage)")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.dp * self.tp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the layout's {self.world} ranks "
                             f"(pp {self.pp} x dp {self.dp} x tp {self.tp})")
        stage, r = divmod(rank, self.stage_size)
        return RankCoords(rank=rank, pp=stage, dp=r // self.tp, tp=r % self.tp, ep=r % self.ep)

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return pp * self.stage_size + dp * self.tp + tp

    def tp_group(self, rank: int) -> List[int]:
        c = self.coords(rank)
        return [self.rank_of(c.pp, c.dp, t) for t in range(self.tp)]

    def dp_group(self, rank: int) -> List[int]:
        c = self.coords(rank)
        return [self.rank_of(c.pp, d, c.tp) for d in range(self.dp)]

    def pp_group(self, rank: int) -> List[int]:
        c = self.coords(rank)
        return [self.rank_of(s, c.dp, c.tp) for s in range(self.pp)]

    def ep_group(self, rank: int) -> List[int]:
        c = self.coords(rank)
        base = c.pp * self.stage_size + (rank - c.pp * self.stage_size) // self.ep * self.ep
        return list(range(base, base + self.ep))

    @classmethod
    def from_run_config(cls, run_cfg, world: int = None) -> "Layout":
        s = run_cfg.parallel_config
        dp = s.data_parallel
        if world is not None and dp == 1 and s.model_parallel * s.pipeline_stage == 1 and world > 1:
            dp = world
        return cls(dp=dp, tp=s.model_parallel, pp=s.pipeline_stage, ep=s.expert_parallel,
                   seq_parallel=bool(s.use_seq_parallel), vocab_emb_dp=bool(s.vocab_emb_dp))
