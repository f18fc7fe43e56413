"""Post-training sections of a stage (`stage.type: dpo | grpo`): the DPO/MPO and GRPO settings.

A DPO stage reads preference lines (`messages` + images + `chosen`/`rejected`) from the stage's
`data.sources`, a GRPO stage reads RL prompt lines (`messages` + images + `answer` + optional `reward`);
see mindvl_ms/data/preference.py. For these stages `global_batch_size` counts pairs (DPO) or prompts
(GRPO) per step and `micro_batch_size` packed rows per forward/backward.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List

from mindvl_ms.config.base import ConfigError, F

REWARD_NAME = re.compile(r"[A-Za-z_]\w*|[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # a verifier name or package.module:function


@dataclass
class DPOConfig:
    """DPO with the Mixed Preference Optimization losses and the NTP mix (train/post/dpo.py)."""

    beta: float = F(0.1, "DPO temperature beta (log-ratio scale)")
    preference_weight: float = F(1.0, "weight of the sigmoid DPO loss")
    quality_weight: float = F(0.0, "weight of the BCO-style quality loss (MPO; 0: off)")
    sft_weight: float = F(0.0, "weight of the SFT (generation) loss on the chosen responses (MPO; 0: off)")
    ntp_sources: List[str] = F([], "SFT JSONL files mixed in with the next-token-prediction loss")
    ntp_batch_size: int = F(0, "NTP rows per step over all ranks, next to global_batch_size pairs (0: no mix)")

    def check(self, name: str) -> None:
        if self.beta <= 0:
            raise ConfigError(f"stage '{name}': dpo.beta must be > 0, got {self.beta}")
        ws = (self.preference_weight, self.quality_weight, self.sft_weight)
        if min(ws) < 0 or sum(ws) <= 0:
            raise ConfigError(f"stage '{name}': dpo loss weights must be >= 0 and not all 0, got {ws}")
        if self.ntp_batch_size < 0 or bool(self.ntp_batch_size) != bool(self.ntp_sources):
            raise ConfigError(f"stage '{name}': dpo.ntp_batch_size > 0 and dpo.ntp_sources go together "
                              f"(got {self.ntp_batch_size} and {self.ntp_sources})")


@dataclass
class GRPOConfig:
    """GRPO with verifiable rewards and DAPO's clip-higher (train/post/grpo.py, train/post/rewards.py)."""

    group_size: int = F(8, "sampled responses per prompt (G)")
    mini_batch_size: int = F(0, "responses per optimizer update over all ranks (0: the whole rollout batch); "
                                "global_batch_size * group_size / mini_batch_size updates per step")
    max_new_tokens: int = F(256, "longest sampled response")
    temperature: float = F(1.0, "sampling temperature (the surrogate's log-probs use the same temperature)")
    top_p: float = F(1.0, "nucleus sampling threshold (1: off)")
    clip_low: float = F(0.2, "ratio clip below: 1 - clip_low")
    clip_high: float = F(0.28, "ratio clip above: 1 + clip_high (DAPO clip-higher: > clip_low)")
    kl_coef: float = F(0.0, "weight of the k3 KL term to the stage's starting weights (0: none, as DAPO)")
    reward: str = F("exact_match", "accuracy verifier when a prompt line names none: exact_match | numeric | "
                                   "grounding_iou | boxed_format | package.module:function")
    accuracy_weight: float = F(1.0, "reward = accuracy_weight * accuracy + format_weight * boxed format")
    format_weight: float = F(0.0, "weight of the \\boxed{} format reward")
    numeric_rel_tol: float = F(0.01, "relative tolerance of the numeric verifier")

    def check(self, name: str, global_batch: int) -> None:
        if self.group_size < 2:
            raise ConfigError(f"stage '{name}': grpo.group_size must be >= 2 (advantages are relative), "
                              f"got {self.group_size}")
        total = global_batch * self.group_size
        if self.mini_batch_size < 0 or (self.mini_batch_size and total % self.mini_batch_size):
            raise ConfigError(f"stage '{name}': grpo.mini_batch_size {self.mini_batch_size} must divide "
                              f"global_batch_size x group_size = {total}")
        if self.max_new_tokens < 1 or self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"stage '{name}': grpo needs max_new_tokens >= 1, temperature > 0, 0 < top_p <= 1")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.kl_coef < 0 or self.numeric_rel_tol < 0:
            raise ConfigError(f"stage '{name}': grpo needs 0 <= clip_low < 1, clip_high >= 0, kl_coef >= 0, "
                              f"numeric_rel_tol >= 0")
        if not REWARD_NAME.fullmatch(self.reward):  # the name resolves where the stage is built (train/post)
            raise ConfigError(f"stage '{name}': grpo.reward {self.reward!r}: expected a verifier name (exact_match, "
                              f"numeric, ...) or package.module:function")

    def updates_per_step(self, global_batch: int) -> int:
        total = global_batch * self.group_size
        return total // self.mini_batch_size if self.mini_batch_size else 1
