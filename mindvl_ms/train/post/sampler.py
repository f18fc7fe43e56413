"""What a GRPO stage asks of a generation engine: the `ResponseSampler` protocol and the rollout seeds.

train/ sits below infer/ in the layer order, so a GRPO stage does not sample by itself: whoever runs
one passes a sampler to `run_training(..., sampler=...)` (`mindvl_ms.infer.rollout.EngineSampler`
samples with the KV-cache engine; `mindvl train`, the demo and the tests pass it). A sampler gives
the stage three things: the token ids that end a response, k sampled responses per prompt, and a
response as the verifiers read it.

Reproducibility: the k responses of a prompt are drawn from the prompt's own generator, seeded by
`rollout_seed(run seed, step, the prompt's index in its dataset)` only, so a prompt's rollouts do not
depend on which rank samples it, on the data-parallel size, or on the other prompts of the call:
N ranks produce exactly the rollouts of one process with the same global batch.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np


class ResponseSampler(Protocol):
    """k sampled responses per prompt, and how a response is read."""

    def stop_ids(self, processor) -> Tuple[int, ...]:
        """The token ids that end a response (a sampled response keeps the one it emitted)."""

    def sample(self, model, prompts: Sequence[Dict[str, Any]], k: int, seeds: Sequence[int], max_new_tokens: int,
               temperature: float, top_p: float, stop_ids: Sequence[int]) -> List[List[List[int]]]:
        """Token ids of k responses for each prompt (dicts with input_ids and optional pixel_values /
        image_grid_thw, the input ending with the generation prompt); prompt i's responses draw from a
        generator seeded `seeds[i]` alone. -> [len(prompts)][k][response length]."""

    def response_text(self, processor, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
        """A sampled response as the verifiers read it (the text a user of the model would see)."""


def rollout_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of a prompt's rollouts: from (run seed, step, dataset index) only."""
    return int(np.random.SeedSequence([int(seed) % 2**32, int(step), int(index)]).generate_state(1)[0])


def require_sampler(stage, sampler: Optional[ResponseSampler]) -> ResponseSampler:
    """The sampler a GRPO stage samples with; a clear error when its caller gave none."""
    if sampler is None:
        raise ValueError(f"stage '{stage.name}' (grpo) samples responses but no sampler was given: call "
                         "run_training(..., sampler=mindvl_ms.infer.rollout.EngineSampler()) (`mindvl train` does)")
    return sampler
