"""Post-training data: preference pairs (DPO) and RL prompts (GRPO), parsed and validated like SFT lines.

Preference line (`mindvl rollout` writes these; hand-made pairs work the same):
    {"id": "p1", "images": ["img/1.png"], "image_sizes": [[640, 480]],
     "messages": [{"role": "user", "content": "<image>\\nHow many cats?"}],
     "chosen": "Two.", "rejected": "Five."}
RL prompt line:
    {"id": "q1", "images": ["img/1.png"],
     "messages": [{"role": "user", "content": "<image>\\nHow many cats? Put the answer in \\\\boxed{}."}],
     "answer": "2", "reward": "numeric"}
`messages` is the prompt: it must end with a user turn (the model answers next). Where prompts are read
(GRPO stages, `mindvl rollout`) an SFT line also serves: its last assistant turn is the `answer`. `chosen`, `rejected`
and `answer` are strings; `reward` (optional) names the verifier of that line (train/post/rewards.py).
Image, placeholder, raw-token and grounding checks are the SFT ones (`data/validate.py` dispatches a
line with `chosen`/`rejected` or `answer` here); the chosen/rejected answers are grounding-checked too.

Processing (`encode_prompt`, `encode_response`): the prompt is rendered with the generation prompt
(`<|im_start|>assistant\\n`), a response is appended as token ids followed by `<|im_end|>`, and only the
response tokens are supervised. Chosen and rejected of a pair share the prompt's pixels.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mindvl_ms.data.image import load_image, process_images
from mindvl_ms.data.schema import (IMAGE_PLACEHOLDER, Sample, SampleError, normalise_messages, parse_line,
                                   parse_sample)
from mindvl_ms.data.tokens import IGNORE_INDEX, IM_END

PREF_FIELDS = ("chosen", "rejected")
PREF_IDS = ("chosen_ids", "rejected_ids")  # optional: the token ids a rollout sampled (`infer.rollout`)
RL_FIELDS = ("answer", "reward")


@dataclass
class PostSample:
    """A parsed preference or prompt line (kind 'preference' or 'prompt')."""

    kind: str
    messages: List[Dict[str, str]]
    images: List[str] = field(default_factory=list)
    image_sizes: Optional[List[Tuple[int, int]]] = None
    chosen: str = ""
    rejected: str = ""
    answer: str = ""
    reward: str = ""
    chosen_ids: Optional[List[int]] = None  # with rejected_ids: what the rollout sampled, trained as is
    rejected_ids: Optional[List[int]] = None
    id: str = ""
    source: str = ""
    line: int = 0

    def as_sample(self) -> Sample:
        return Sample(self.messages, self.images, self.image_sizes, self.id, self.source, self.line)


def is_post_line(obj: Any) -> bool:
    return isinstance(obj, dict) and any(k in obj for k in PREF_FIELDS + RL_FIELDS)


def parse_post(obj: Any, source: str, line: int) -> PostSample:
    """Validate one decoded preference / prompt line; raises SampleError(reason='schema')."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        pref = any(k in obj for k in PREF_FIELDS)
        rl = any(k in obj for k in RL_FIELDS)
        if pref and rl:
            raise ValueError("a line is either a preference pair (chosen/rejected) or an RL prompt (answer/reward)")
        extra = PREF_FIELDS + PREF_IDS if pref else RL_FIELDS
        unknown = set(obj) - {"id", "images", "image_sizes", "messages", "source", "meta", *extra}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)} (expected id, images, image_sizes, messages, "
                             f"{', '.join(extra)})")
        _check_ids(obj)
        messages = normalise_messages(obj.get("messages"))
        if messages[-1]["role"] != "user":
            raise ValueError("messages: the prompt must end with a user turn (the answers are "
                             + ("chosen/rejected)" if pref else "sampled)"))
        need = PREF_FIELDS if pref else ("answer",)
        for k in need:
            if not isinstance(obj.get(k), str) or not obj[k].strip():
                raise ValueError(f"'{k}': expected a non-empty string")
        if pref and obj["chosen"] == obj["rejected"]:
            raise ValueError("chosen and rejected are identical")
        if "reward" in obj and (not isinstance(obj["reward"], str) or not obj["reward"]):
            raise ValueError("'reward': expected a verifier name (e.g. exact_match, numeric, pkg.mod:fn)")
    except ValueError as e:
        raise SampleError(source, line, "schema", str(e)) from None
    # images / image_sizes / message checks: the SFT parser, with a placeholder assistant turn
    base = parse_sample({k: obj[k] for k in ("id", "images", "image_sizes") if k in obj}
                        | {"messages": obj["messages"] + [{"role": "assistant", "content": "-"}]}, source, line)
    return PostSample("preference" if pref else "prompt", messages, base.images, base.image_sizes,
                      obj.get("chosen", ""), obj.get("rejected", ""), obj.get("answer", ""), obj.get("reward", ""),
                      obj.get("chosen_ids"), obj.get("rejected_ids"), base.id, source, line)


def _check_ids(obj: Dict[str, Any]) -> None:
    """chosen_ids / rejected_ids: both or neither, each a non-empty list of token ids (ints >= 0)."""
    given = [k for k in PREF_IDS if k in obj]
    if given and len(given) != len(PREF_IDS):
        raise ValueError(f"'{given[0]}' without '{(set(PREF_IDS) - set(given)).pop()}': give both or neither")
    for k in given:
        v = obj[k]
        if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in v):
            raise ValueError(f"'{k}': expected a non-empty list of token ids (integers >= 0)")


def read_post_file(path: str, kind: str) -> List[PostSample]:
    """All lines of a preference ('preference') or prompt ('prompt') file; the first bad line is an error
    (run `mindvl data validate` for a full report)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise SampleError(path, n, "invalid json", str(e)) from None
            s = prompt_from_sft(obj, path, n) if kind == "prompt" and not is_post_line(obj) else parse_post(obj, path, n)
            if s.kind != kind:
                raise SampleError(path, n, "schema", f"expected a {kind} line, got a {s.kind} line")
            n_ph = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in s.messages)
            if n_ph != len(s.images):
                raise SampleError(path, n, "image count mismatch", f"{n_ph} <image> placeholders for "
                                                                   f"{len(s.images)} images")
            out.append(s)
    if not out:
        raise ValueError(f"{path}: no {kind} lines")
    return out


def prompt_from_sft(obj: Any, source: str, line: int) -> PostSample:
    """An SFT line used as an RL prompt: its last (assistant) turn is the answer, the turns before the prompt."""
    smp = parse_sample(obj, source, line)
    if len(smp.messages) < 2 or smp.messages[-1]["role"] != "assistant" or smp.messages[-2]["role"] != "user":
        raise SampleError(source, line, "schema", "an SFT line used as a prompt must end with a user turn "
                                                  "followed by the assistant's answer")
    return PostSample("prompt", smp.messages[:-1], smp.images, smp.image_sizes, answer=smp.messages[-1]["content"],
                      id=smp.id, source=source, line=line)


def response_texts(s: PostSample) -> List[str]:
    """Texts the grounding check looks at beyond the messages."""
    return [t for t in (s.chosen, s.rejected) if t]


# -- processing ------------------------------------------------------------------------------------

def encode_prompt(processor, s: PostSample) -> Dict[str, Any]:
    """Prompt tokens (ending with the generation prompt) + pixels: {input_ids, pixel_values, image_grid_thw}."""
    try:
        images = [load_image(p) for p in s.images]
    except (OSError, FileNotFoundError) as e:
        raise SampleError(s.source, s.line, "unreadable image", str(e)) from None
    pixel_values, grid = process_images(images, processor.image_config)
    counts = [] if grid is None else [int(np.prod(g)) // processor.image_config.merge_size ** 2 for g in grid]
    ids, _ = processor.encode(s.messages, counts, add_generation_prompt=True)
    return {"input_ids": ids, "pixel_values": pixel_values, "image_grid_thw": grid, "id": s.id}


def end_ids(processor) -> List[int]:
    return [processor.tokenizer.token_to_id(IM_END)]


def encode_response(prompt: Dict[str, Any], response_ids, end: List[int] = ()) -> Dict[str, Any]:
    """prompt + response (+ end tokens unless the response already ends with them); labels on the response."""
    resp = [int(t) for t in response_ids]
    if end and resp[-len(end):] != list(end):
        resp = resp + list(end)
    p = np.asarray(prompt["input_ids"], np.int64).reshape(-1)
    ids = np.concatenate([p, np.asarray(resp, np.int64)])
    labels = np.concatenate([np.full(p.size, IGNORE_INDEX, np.int64), np.asarray(resp, np.int64)])
    return {"input_ids": ids, "labels": labels, "pixel_values": prompt.get("pixel_values"),
            "image_grid_thw": prompt.get("image_grid_thw")}


def encode_text_response(processor, prompt: Dict[str, Any], text: str) -> Dict[str, Any]:
    return encode_response(prompt, processor.tokenizer.encode(text), end_ids(processor))


def encode_pair(processor, prompt: Dict[str, Any], s: PostSample) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(chosen, rejected) samples of a preference line: the token ids a rollout sampled when the line carries
    them (a decoded text need not encode back to the same tokens: '(' then 'circle' sampled may encode as
    '(circle', which a vocabulary subset has no row for), else the texts encoded."""
    if s.chosen_ids is not None:
        end = end_ids(processor)
        return encode_response(prompt, s.chosen_ids, end), encode_response(prompt, s.rejected_ids, end)
    return encode_text_response(processor, prompt, s.chosen), encode_text_response(processor, prompt, s.rejected)


def parse_line_any(text: str, source: str, line: int):
    """`schema.parse_line` for SFT, preference and prompt lines (what `mindvl data validate` checks).
    A post-training line comes back as a Sample whose messages also hold the answers as assistant turns,
    so the placeholder, raw-token and grounding checks cover them."""
    try:
        obj = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        obj = None
    if not is_post_line(obj):
        return parse_line(text, source, line)
    try:
        s = parse_post(obj, source, line)
    except SampleError as e:
        return e
    texts = response_texts(s) or [s.answer]
    return Sample(s.messages + [{"role": "assistant", "content": t} for t in texts], s.images, s.image_sizes,
                  s.id, source, line)
