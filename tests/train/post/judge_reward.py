"""A judge reward: a GRPO verifier that scores responses with a loaded checkpoint (docs/DATA.md, "Judge rewards").

Named like any reward, `grpo.reward: tests.train.post.judge_reward:judge_reward` (or a prompt line's
`"reward"`). The name carries no arguments, so the judge's checkpoint comes from the environment
(`MINDVL_JUDGE`, read at the first call); the model and its processor are loaded once per checkpoint and kept
in a module global, since the verifier calls the function once per sampled response.

Score: the judge's mean per-token likelihood of the response after a prompt holding the reference answer,
exp(-mean cross entropy) in (0, 1]; a real judge would be a model trained to grade (a reward model, or an
LLM asked for a 1-5 score and parsed), with the same load-once structure.
"""
import math
import os
from typing import Dict, List, Tuple

from mindvl_ms import MindVLForConditionalGeneration, MindVLProcessor

JUDGE_ENV = "MINDVL_JUDGE"
_JUDGES: Dict[str, Tuple[MindVLForConditionalGeneration, MindVLProcessor]] = {}
LOADS: List[str] = []  # checkpoints loaded, in order (the test checks each is loaded once)


def judge(path: str) -> Tuple[MindVLForConditionalGeneration, MindVLProcessor]:
    """(model, processor) of the checkpoint at `path`, loaded on first use."""
    if path not in _JUDGES:
        _JUDGES[path] = MindVLForConditionalGeneration.from_pretrained(path), MindVLProcessor.from_pretrained(path)
        LOADS.append(path)
    return _JUDGES[path]


def judge_prompt(response: str, answer: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": f"Reference answer: {answer}\nWrite an answer."},
            {"role": "assistant", "content": response}]


def judge_reward(response: str, answer: str) -> float:
    """exp(-mean cross entropy) of `response` under the judge checkpoint named by $MINDVL_JUDGE."""
    path = os.environ.get(JUDGE_ENV)
    if not path:
        raise RuntimeError(f"judge_reward: set {JUDGE_ENV} to the judge checkpoint's directory")
    model, proc = judge(path)
    out = model(**proc(messages=judge_prompt(response, answer)))  # labels on the response tokens
    return math.exp(-float(out.loss.asnumpy()))
