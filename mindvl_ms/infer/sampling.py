"""Next-token selection on host-side logits: repetition penalty, temperature, top-k, top-p, greedy/sample.

The order and semantics follow transformers' logits processors (RepetitionPenaltyLogitsProcessor, then
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, each keeping at least one token), which
tests/infer/test_sampling.py checks against transformers itself. Logits are float32 numpy [B, V].
"""
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np


@dataclass
class SamplingConfig:
    """How tokens are chosen and when generation stops."""

    max_new_tokens: int = 32  # tokens generated at most per prompt
    do_sample: bool = False  # False: greedy (argmax after the repetition penalty)
    temperature: float = 1.0  # logits / temperature before sampling
    top_k: int = 0  # keep the k most likely tokens (0: off)
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p (1: off)
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the prompt or the output
    eos_token_ids: Sequence[int] = field(default_factory=tuple)  # a row stops after emitting one of these
    stop_strings: Sequence[str] = field(default_factory=tuple)  # a row stops once its text contains one
    seed: Optional[int] = 0  # sampling RNG seed (None: nondeterministic)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def repetition_penalty(logits: np.ndarray, histories: Sequence[np.ndarray], penalty: float) -> np.ndarray:
    """Divide positive / multiply negative logits of every token seen in each row's history."""
    if penalty == 1.0:
        return logits
    out = logits.copy()
    for b, hist in enumerate(histories):
        ids = np.unique(np.asarray(hist, np.int64))
        ids = ids[(ids >= 0) & (ids < logits.shape[1])]
        s = out[b, ids]
        out[b, ids] = np.where(s < 0, s * penalty, s / penalty)
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = -np.sort(-logits, axis=-1)[:, k - 1:k]  # [B, 1] k-th largest value
    return np.where(logits < kth, -np.inf, logits)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    if p >= 1.0:
        return logits
    order = np.argsort(logits, axis=-1, kind="stable")  # ascending
    sorted_logits = np.take_along_axis(logits, order, -1)
    probs = _softmax(sorted_logits)
    remove_sorted = np.cumsum(probs, -1) <= (1 - p)
    remove_sorted[:, -1] = False  # always keep the most likely token
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, -1)
    return np.where(remove, -np.inf, logits)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def process_logits(logits: np.ndarray, histories: Sequence[np.ndarray], cfg: SamplingConfig) -> np.ndarray:
    """The scores the next token is chosen from (penalty, then the sampling warpers when sampling)."""
    scores = repetition_penalty(np.asarray(logits, np.float32), histories, cfg.repetition_penalty)
    if not cfg.do_sample:
        return scores
    scores = scores / np.float32(cfg.temperature)
    return top_p_filter(top_k_filter(scores, cfg.top_k), cfg.top_p)


def choose(logits: np.ndarray, histories: Sequence[np.ndarray], cfg: SamplingConfig,
           rng) -> np.ndarray:
    """int64[B] next tokens. `rng` is one np.random.Generator for the batch, or a list of
    (Generator, rows) for consecutive row groups that each draw from their own generator (a group's
    draws are then those of a call holding that group alone)."""
    scores = process_logits(logits, histories, cfg)
    if not cfg.do_sample:
        return scores.argmax(-1)
    if isinstance(rng, np.random.Generator):
        u = rng.random(scores.shape[0])
    else:
        u = np.concatenate([g.random(n) for g, n in rng])
    return sample_scores(scores, u)


def sample_scores(scores: np.ndarray, u: np.ndarray, block: int = 1024) -> np.ndarray:
    """int64[B]: one draw per row from softmax(scores [B, V]) by inverse CDF at the row's uniform u[b] in
    [0, 1) (numpy's `Generator.choice(V, p=row)` rule), cheap over a large vocabulary: exp in float32, float64
    sums of blocks of `block` tokens, and a float64 cumulative sum only inside the block holding the uniform
    (faster than a float64 softmax and full cumulative sum over a 151,936-token vocabulary: docs/PERFORMANCE.md,
    ## infer). The
    draws are choice()'s with the same uniforms except where one falls within float32 rounding of a
    cumulative boundary (tests/infer/test_sampling.py counts the agreement)."""
    x = np.asarray(scores, np.float32)
    b, v = x.shape
    e = np.exp(x - x.max(-1, keepdims=True))                                        # [B, V], -inf -> 0
    starts = np.arange(0, v, block)
    csum = np.cumsum(np.add.reduceat(e, starts, axis=1, dtype=np.float64), -1)    # [B, nb]
    u = np.asarray(u, np.float64) * csum[:, -1]                                   # [B]
    out = np.empty(b, np.int64)
    for r in range(b):
        k = min(int(np.searchsorted(csum[r], u[r], side="right")), len(starts) - 1)
        lo = int(starts[k])
        part = e[r, lo:lo + block]
        cdf = np.cumsum(part, dtype=np.float64) + (csum[r, k - 1] if k else 0.0)
        j = min(int(np.searchsorted(cdf, u[r], side="right")), part.size - 1)
        nz = np.flatnonzero(part[:j + 1])     # rounding past the block's end: its last possible token
        out[r] = lo + (j if part[j] > 0 else int(nz[-1]) if nz.size else int(np.flatnonzero(part)[0]))
    return out


def stop_reason(generated: List[int], cfg: SamplingConfig, decode=None) -> Optional[str]:
    """'eos', 'stop_string', 'length' or None for one row's generated ids."""
    if generated and generated[-1] in cfg.eos_token_ids:
        return "eos"
    if cfg.stop_strings and decode is not None:
        text = decode(generated)
        if any(s in text for s in cfg.stop_strings):
            return "stop_string"
    if len(generated) >= cfg.max_new_tokens:
        return "length"
    return None
