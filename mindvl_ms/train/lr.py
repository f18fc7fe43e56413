"""Learning-rate schedule: linear warm-up by ratio, then cosine decay to the minimum.

The schedule is evaluated on the host (plain Python floats) and fed to the compiled update graph
as a scalar tensor, so changing LR never recompiles and resume only needs the step number.

    lr(s) = max_lr * (s + 1) / W                                     for s < W   (W = round(ratio*T))
    lr(s) = min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2       p = (s - W) / max(1, T - W - 1)

`s` is the 0-based optimizer step and T the stage's total steps, so the last step uses exactly
min_lr and the first post-warm-up step exactly max_lr. max_lr == min_lr gives a constant LR
(openPangu-VL's annealing stage).
"""
from __future__ import annotations

import math
from typing import List


class WarmupCosine:
    """lr(step) for a stage of `total_steps` optimizer steps."""

    def __init__(self, max_lr: float, min_lr: float, total_steps: int, warmup_ratio: float):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.max_lr, self.min_lr, self.total = float(max_lr), float(min_lr), int(total_steps)
        self.warmup = int(round(warmup_ratio * total_steps))

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup:
            return self.max_lr * (step + 1) / self.warmup
        decay = max(1, self.total - self.warmup - 1)
        p = min(1.0, (step - self.warmup) / decay)
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    def values(self) -> List[float]:
        return [self(s) for s in range(self.total)]
