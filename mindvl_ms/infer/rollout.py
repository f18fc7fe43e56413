"""Rollouts with the KV-cache engine: the GRPO stage's sampler and `mindvl rollout`'s preference pairs.

`EngineSampler` is the `train.post.sampler.ResponseSampler` that `mindvl train`, the demo and the tests
pass to `run_training`: the prompts of a step share one engine call (each repeated k times), each
prompt's k rows drawing from their own generator (seeds from `train.post.sampler.rollout_seed`).

Pair rule (openPangu-VL report 4.2: "at least one response scored above four and another scored below
two" on a 1-5 scale): a prompt yields a pair when its best candidate scores strictly above `high` and its
worst strictly below `low`; chosen is the first best-scoring candidate, rejected the first worst. The
verifiers' scores are in [0, 1] (accuracy_weight 1, no format reward), so the defaults 0.75 / 0.25 are
the report's thresholds mapped by (score - 1) / 4. A pair whose chosen and rejected texts are equal (the
thresholds overlap, or two samples agree) is no preference and is not written.

`mindvl rollout --ckpt DIR --data PROMPTS.jsonl --out PAIRS.jsonl -k 4` writes preference lines
(data/preference.py) with the prompt's messages and images, the chosen/rejected texts (what the verifier
read) and their sampled token ids (`chosen_ids` / `rejected_ids`, what DPO trains on: a decoded text need
not encode back to the same tokens).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from mindvl_ms.data.preference import encode_prompt
from mindvl_ms.infer.generate import decode_answer, generate, get_engine, stop_token_ids
from mindvl_ms.infer.kv_cache import supports_cache
from mindvl_ms.train.post.sampler import rollout_seed


def sample_groups(model, prompts: Sequence[Dict[str, Any]], k: int, seeds: Sequence[int], max_new_tokens: int,
                  temperature: float = 1.0, top_p: float = 1.0, eos_token_ids: Sequence[int] = ()
                  ) -> List[List[List[int]]]:
    """k sampled responses per prompt (token ids, an emitted eos kept), all prompts in one engine call:
    each prompt's k rows draw from their own generator seeded `seeds[i]`, so a prompt's responses do not
    depend on the others in the call. One call for many prompts decodes faster than a call per prompt on
    a small model, whose per-token cost is mostly fixed overhead (docs/PERFORMANCE.md, ## train)."""
    rows = [{key: p[key] for key in ("input_ids", "pixel_values", "image_grid_thw") if p.get(key) is not None}
            for p in prompts]
    if supports_cache(model.config):
        get_engine(model).image_cache.clear()  # the weights may have changed since the last call
    out = generate(model, [r for r in rows for _ in range(k)], max_new_tokens, do_sample=True,
                   temperature=temperature, top_p=top_p, eos_token_ids=tuple(eos_token_ids),
                   group_seeds=[(int(s), k) for s in seeds])
    return [out[i * k:(i + 1) * k] for i in range(len(prompts))]


def sample_group(model, prompt: Dict[str, Any], k: int, seed: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, eos_token_ids: Sequence[int] = ()) -> List[List[int]]:
    """k sampled responses (token ids, an emitted eos kept) for one prompt sample."""
    return sample_groups(model, [prompt], k, [seed], max_new_tokens, temperature, top_p, eos_token_ids)[0]


def strip_eos(ids: Sequence[int], eos: Sequence[int]) -> List[int]:
    return list(ids[:-1]) if ids and ids[-1] in eos else list(ids)


def response_text(processor, ids: Sequence[int], eos: Sequence[int]) -> str:
    """A sampled response as the verifiers read it: the text `mindvl generate` prints (special tokens
    dropped except the grounding tags, so `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` stays a box)."""
    return decode_answer(processor, strip_eos(ids, eos)).strip()


class EngineSampler:
    """`train.post.sampler.ResponseSampler` with the KV-cache engine (`sample_groups`, `response_text`)."""

    def stop_ids(self, processor) -> Tuple[int, ...]:
        return stop_token_ids(processor)

    def sample(self, model, prompts, k, seeds, max_new_tokens, temperature, top_p, stop_ids):
        return sample_groups(model, prompts, k, seeds, max_new_tokens, temperature, top_p, stop_ids)

    def response_text(self, processor, ids, stop_ids) -> str:
        return response_text(processor, ids, stop_ids)


def choose_pair(scores: Sequence[float], high: float, low: float) -> Optional[Tuple[int, int]]:
    """(chosen index, rejected index) by the report's rule, or None."""
    s = np.asarray(scores, np.float64)
    best, worst = int(np.argmax(s)), int(np.argmin(s))
    if s[best] > high and s[worst] < low:
        return best, worst
    return None


def rollout_pairs(model, processor, prompts, verifier, k: int, seed: int, max_new_tokens: int,
                  temperature: float = 1.0, top_p: float = 1.0, high: float = 0.75, low: float = 0.25,
                  progress: bool = False, batch_prompts: int = 8) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Preference lines and a summary for parsed prompt lines (`PostSample`s of kind 'prompt');
    `batch_prompts` prompts are sampled per engine call (the samples do not depend on it)."""
    eos = stop_token_ids(processor)
    lines, all_scores = [], []
    groups: List[List[List[int]]] = []
    bar = tqdm(total=len(prompts), desc="rollout", unit="prompt", disable=not progress)
    for start in range(0, len(prompts), batch_prompts):  # batch_prompts prompts per engine call
        chunk = range(start, min(start + batch_prompts, len(prompts)))
        groups += sample_groups(model, [encode_prompt(processor, prompts[j]) for j in chunk], k,
                                [rollout_seed(seed, 0, j) for j in chunk], max_new_tokens, temperature, top_p, eos)
        bar.update(len(chunk))
    bar.close()
    for s, outs in zip(prompts, groups):
        texts = [response_text(processor, o, eos) for o in outs]
        scores = [verifier(t, s.answer, s.reward or None) for t in texts]
        all_scores.append(scores)
        pick = choose_pair(scores, high, low)
        if pick is None or texts[pick[0]] == texts[pick[1]]:  # the same text twice is no preference
            continue
        line = {"id": f"{s.id}-pair", "messages": s.messages,
                "chosen": texts[pick[0]], "rejected": texts[pick[1]],
                "chosen_ids": strip_eos(outs[pick[0]], eos), "rejected_ids": strip_eos(outs[pick[1]], eos),
                "meta": {"scores": [float(x) for x in scores], "prompt_id": s.id}}
        if s.images:
            line["images"] = list(s.images)  # absolute here; relative to the output file when written
        lines.append(line)
    sc = np.asarray(all_scores, np.float64)
    summary = {"prompts": len(prompts), "pairs": len(lines), "k": k,
               "mean_score": float(sc.mean()) if sc.size else 0.0,
               "best_of_k": float(sc.max(1).mean()) if sc.size else 0.0}
    return lines, summary


def write_pairs(lines: List[Dict[str, Any]], out: str) -> None:
    """Preference JSONL with image paths relative to the output file."""
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            if line.get("images"):
                line = dict(line, images=[os.path.relpath(p, out_dir) for p in line["images"]])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
