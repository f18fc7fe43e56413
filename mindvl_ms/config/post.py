"""Post-training sections of a stage (`stage.type: dpo | grpo`): the DPO/MPO and GRPO settings.

A DPO stage reads preference lines (`messages` + images + `chosen`/`rejected`) from the stage's
`data.sources`, a GRPO stage reads RL prompt lines (`messages` + images + `answer` + optional `reward`);
see mindvl_ms/data/preference.py. For these stages `global_batch_size` counts pairs (DPO) or prompts
(GRPO) per step and `micro_batch_size` packed rows per forward/backward.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Dict, List

from mindvl_ms.config.base import ConfigError, F

REWARD_NAME = re.compile(r"[A-Za-z_]\w*|[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # a verifier name or package.module:function


@dataclass
class DPOConfig:
    """DPO with the Mixed Preference Optimization losses and the NTP mix (train/post/dpo.py).

    The NTP mix is a ratio, as the openPangu-VL report has it (section 4.2: "we also proportionally mix in
    the remaining SFT data and train it with the standard next-token prediction (NTP) loss")."""

    beta: float = F(0.1, "DPO temperature beta (log-ratio scale)")
    preference_weight: float = F(1.0, "weight of the sigmoid DPO loss")
    quality_weight: float = F(0.0, "weight of the BCO-style quality loss (MPO; 0: off)")
    sft_weight: float = F(0.0, "weight of the SFT (generation) loss on the chosen responses (MPO; 0: off)")
    ntp_sources: List[str] = F([], "SFT JSONL files mixed in with the next-token-prediction loss (the rest of "
                                   "the SFT data); read when ntp_ratio > 0, which then needs at least one")
    ntp_ratio: float = F(0.0, "NTP rows per preference pair: each step draws round(ntp_ratio x pairs) rows of "
                              "ntp_sources on every rank next to its pairs (at least one), so the mix stays "
                              "proportional to the pairs whatever global_batch_size is (0: no mix)")

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {  # load() names the replacement of a key older configs use
        "ntp_batch_size": "was replaced by dpo.ntp_ratio, NTP rows per preference pair "
                          "(ntp_batch_size / global_batch_size: 2 rows next to 4 pairs is ntp_ratio 0.5)"}

    def check(self, name: str) -> None:
        if self.beta <= 0:
            raise ConfigError(f"stage '{name}': dpo.beta must be > 0, got {self.beta}")
        ws = (self.preference_weight, self.quality_weight, self.sft_weight)
        if min(ws) < 0 or sum(ws) <= 0:
            raise ConfigError(f"stage '{name}': dpo loss weights must be >= 0 and not all 0, got {ws}")
        if self.ntp_ratio < 0:
            raise ConfigError(f"stage '{name}': dpo.ntp_ratio must be >= 0, got {self.ntp_ratio}")
        if self.ntp_sources and not self.ntp_ratio:
            raise ConfigError(f"stage '{name}': dpo.ntp_sources {self.ntp_sources} are mixed in only with "
                              f"dpo.ntp_ratio > 0 (NTP rows per preference pair); set both, or neither")

    def ntp_rows(self, global_batch: int, dp: int = 1) -> int:
        """NTP rows of one step over all `dp` ranks next to `global_batch` pairs: round(ntp_ratio x pairs) per
        rank (at least one when ntp_ratio > 0), times dp, so every rank draws the same share; 0 without a mix.
        The stage's data is checked for ntp_sources when it is read (train/post/sources.py)."""
        if not self.ntp_ratio:
            return 0
        return max(1, round(self.ntp_ratio * global_batch / dp)) * dp


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
