"""Verifiable rewards for GRPO and for scoring `mindvl rollout` candidates.

A verifier is a function `(response: str, answer: str) -> float`. Built-in verifiers (by registry name,
the name configs and prompt lines use; the functions are `<name>_reward`):
- `exact_match`   1.0 when the answer equals the reference after normalisation (case-folded, inner
                  whitespace collapsed, surrounding whitespace and one trailing period removed); when
                  the response holds a `\\boxed{...}`, the content of the last one is compared.
- `boxed_format`  1.0 when the response has a balanced `\\boxed{...}` with non-empty content (the
                  openPangu-VL format reward: the answer is placed inside `\\boxed{}`).
- `numeric`       1.0 when the last number of the answer (boxed content first) is within
                  max(abs_tol, rel_tol * |reference|) of the reference's number; integers, decimals,
                  thousands separators (`1,234`), fractions (`3/4`) and a percent sign (kept as written:
                  `50%` is 50) are read.
- `grounding_iou` IoU in [0, 1] of the first `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` box (0..999
                  coordinates, `mindvl_ms.data.grounding`) of the response and of the reference;
                  0.0 when the response has no valid box.
- `"package.module:function"` any importable callable with the same signature.

`Verifier` combines an accuracy verifier and the format reward as the report does:
    reward = accuracy_weight * accuracy(response, answer) + format_weight * boxed_format(response)
A prompt line may name its own accuracy verifier (`"reward": "numeric"`), which replaces the default.

Design: verifiers run on the host on decoded text (they are rule-based and value-dependent), never in a
graph; a verifier that raises is a bug in the verifier, so the exception propagates with the name.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Optional

from mindvl_ms.data.grounding import box_iou, parse_grounding

RewardFn = Callable[[str, str], float]


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last balanced `\\boxed{...}` (nested braces allowed), or None."""
    out, i = None, 0
    while True:
        k = text.find("\\boxed{", i)
        if k < 0:
            return out
        depth, j = 1, k + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:  # unbalanced: no more complete boxes
            return out
        out, i = text[k + len("\\boxed{"):j - 1], j


def normalise_answer(text: str) -> str:
    t = " ".join(text.split()).casefold()
    return t[:-1].rstrip() if t.endswith(".") else t


def _final(response: str) -> str:
    boxed = extract_boxed(response)
    return response if boxed is None else boxed


def exact_match_reward(response: str, answer: str) -> float:
    return float(normalise_answer(_final(response)) == normalise_answer(answer))


def boxed_format_reward(response: str, answer: str = "") -> float:
    boxed = extract_boxed(response)
    return float(boxed is not None and boxed.strip() != "")


_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")


def parse_number(text: str) -> Optional[float]:
    """The last number in `text` (see module doc), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = found[-1].replace(",", "").replace(" ", "")
    if "/" in s:
        num, den = s.split("/")
        if float(den) == 0:
            return None
        return float(Fraction(num) / Fraction(den))
    return float(s)


def numeric_reward(response: str, answer: str, rel_tol: float = 1e-2, abs_tol: float = 1e-6) -> float:
    got, ref = parse_number(_final(response)), parse_number(answer)
    if got is None or ref is None:
        return 0.0
    return float(abs(got - ref) <= max(abs_tol, rel_tol * abs(ref)))


def _first_box(text: str):
    for obj in parse_grounding(text):
        for shape in obj.shapes:
            if shape.kind == "box":
                return shape.box
    return None


def grounding_iou_reward(response: str, answer: str) -> float:
    ref = _first_box(answer)
    if ref is None:
        raise ValueError(f"grounding_iou: the reference {answer!r} has no <|box_start|>(x1,y1),(x2,y2)<|box_end|>")
    got = _first_box(response)
    return 0.0 if got is None else float(box_iou(got, ref))


BUILTIN: Dict[str, RewardFn] = {"exact_match": exact_match_reward, "boxed_format": boxed_format_reward,
                                "numeric": numeric_reward, "grounding_iou": grounding_iou_reward}


def resolve_reward(name: str, rel_tol: float = 1e-2, abs_tol: float = 1e-6) -> RewardFn:
    """A verifier by built-in name or `module:function`; unknown names are a ValueError listing the choices."""
    if name == "numeric":
        return lambda r, a: numeric_reward(r, a, rel_tol, abs_tol)
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        mod, _, fn = name.partition(":")
        try:
            f = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {fn} from {mod} ({e})") from None
        if not callable(f):
            raise ValueError(f"reward {name!r} is not callable")
        return f
    raise ValueError(f"unknown reward {name!r}: expected one of {sorted(BUILTIN)} or 'module:function'")


@dataclass
class Verifier:
    """accuracy_weight * accuracy + format_weight * boxed_format (see module doc)."""

    accuracy: str = "exact_match"
    accuracy_weight: float = 1.0
    format_weight: float = 0.0
    rel_tol: float = 1e-2
    abs_tol: float = 1e-6

    def __post_init__(self):
        self._cache: Dict[str, RewardFn] = {}
        self.fn(self.accuracy)  # fail early on a bad default name

    def fn(self, name: str) -> RewardFn:
        if name not in self._cache:
            self._cache[name] = resolve_reward(name, self.rel_tol, self.abs_tol)
        return self._cache[name]

    def __call__(self, response: str, answer: str, reward: Optional[str] = None) -> float:
        name = reward or self.accuracy
        acc = float(self.fn(name)(response, answer))
        if not math.isfinite(acc):
            raise ValueError(f"reward {name!r} returned {acc} for response {response[:80]!r}")
        out = self.accuracy_weight * acc
        if self.format_weight:
            out += self.format_weight * boxed_format_reward(response)
        return out
