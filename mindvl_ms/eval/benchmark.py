"""`mindvl eval`: run a checkpoint over a benchmark file, write predictions.jsonl and scores.json.

    mindvl eval --ckpt ckpt/merged --data bench/docvqa_val.jsonl [--min-pixels N --max-pixels N] [--out DIR]
    mindvl eval --ckpt ckpt/merged --data MMBench_DEV_EN.tsv [--metric NAME]

A `.tsv` file is a VLMEvalKit benchmark (eval/tsv.py: base64 images, VLMEvalKit's prompts, answer
extraction and circular grouping); any other file is this project's JSONL, described here.

Benchmark lines use the training format (docs/DATA.md) plus optional evaluation fields:
    {"id": "q1", "images": ["img/1.png"], "messages": [{"role": "user", "content": "<image>\\nTitle?"},
     {"role": "assistant", "content": "Annual report"}],
     "answers": ["Annual report", "annual report 2020"],   # else the last assistant turn is the answer
     "task": "docvqa", "metric": "anls",                   # metric defaults from task (metrics.TASK_METRIC)
     "options": {"A": "cat", "B": "dog"},                  # multiple choice: appended to the question
     "group": "img1", "category": "HME100k",               # MME/circular grouping, OCRBench category
     "answer_after": "Answer: "}                           # score only the text after its last occurrence
`--metric` (`metric=`) is the metric of lines that name none (before the task's default).
The prompt is every turn before the last assistant turn. `answer_after` is for answers that follow a
generated description or reasoning: the metric sees the prediction's text after the last occurrence of
that string (all of it when the string does not occur); predictions.jsonl keeps the whole prediction.
For `circular` (MMBench) a line with options becomes one pass per circular shift of its options; the
question counts when every pass is right.

Design:
- Generation is a backend object: `backend.generate(samples) -> list[str]` (batched greedy decoding),
  optionally `backend.encode_images([(path, height, width), ...]) -> [features, ...]` (a generation
  batch's new images in one call). Each sample dict carries the
  prompt `messages`, absolute `images`, their resized `image_hw` [(h, w)] and, when the backend
  encodes images, `image_features` from a VisionCache keyed on (image, resized h, w), so repeated
  images and resolution-search settings that resize an image identically encode it once. The default
  backend is the real model (`mindvl_ms.infer.generate`); tests inject a fake.
- Pixel limits: the flags, else the checkpoint's inference_config.json (written by
  `mindvl search-resolution --save`), else its preprocessor_config.json, else Qwen2-VL's defaults.
- scores.json has per task the metric's aggregate, and per `category` (and a TSV's `l2-category`,
  `split`) the same aggregate as by_category / by_l2-category / by_split.
- Bad lines are collected and reported together (file:line: problem); nothing is skipped silently.
  Lines are decoded one at a time, so a non-UTF-8 byte is named with its line, column and field.
  Unknown top-level fields are kept (one warning names them), so training files evaluate as they are.
- Image sizes: the file header is read once per image; a line whose `image_sizes` disagrees with it
  fails with file:line and the field (a wrong size would resize the image wrongly).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from mindvl_ms.config.data import ImageConfig
from mindvl_ms.data.image import image_size, smart_resize
from mindvl_ms.data.schema import IMAGE_PLACEHOLDER, SampleError, decode_line, normalise_messages, warn_unknown
from mindvl_ms.eval import metrics as M
from mindvl_ms.eval.items import EvalItem
from mindvl_ms.eval.tsv import BREAKDOWN_COLUMNS, load_tsv
from mindvl_ms.infer.generate import load_eval_backend

INFERENCE_CONFIG = "inference_config.json"
MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."
EVAL_FIELDS = {"id", "images", "image_sizes", "messages", "source", "meta", "answers", "task", "metric",
               "options", "group", "category", "answer_after"}


def _options_block(options: Dict[str, str]) -> str:
    return "\n" + "\n".join(f"{k}. {v}" for k, v in options.items()) + "\n" + MC_INSTRUCTION


def _with_options(messages, options):
    msgs = [dict(m) for m in messages]
    msgs[-1]["content"] = msgs[-1]["content"] + _options_block(options)
    return msgs


def _parse_line(obj, path: str, line: int, default_task: str, default_metric: Optional[str] = None) -> List[EvalItem]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - EVAL_FIELDS)
    if unknown:
        warn_unknown(path, unknown, sorted(EVAL_FIELDS))
    msgs = normalise_messages(obj.get("messages"))
    last_a = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    prompt = msgs[:last_a] if last_a is not None else msgs
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError("messages: the prompt (turns before the last assistant turn) must end with a user turn")
    answers = obj.get("answers")
    if answers is None:
        if last_a is None:
            raise ValueError("no reference: give an 'answers' list or an assistant turn"
                             + (f" (unknown fields kept as metadata: {', '.join(unknown)})" if unknown else ""))
        answers = [msgs[last_a]["content"]]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, (str, int, float)) for a in answers):
        raise ValueError("answers: expected a non-empty list of strings")
    answers = [str(a) for a in answers]
    images = obj.get("images") or []
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise ValueError("images: expected a list of non-empty path strings")
    n_ph = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt)
    if n_ph != len(images):
        raise ValueError(f"{n_ph} <image> placeholder(s) in the prompt for {len(images)} image(s)")
    base = os.path.dirname(os.path.abspath(path))
    images = [p if os.path.isabs(p) else os.path.join(base, p) for p in images]
    sizes = obj.get("image_sizes")
    if sizes is not None:
        if not (isinstance(sizes, list) and len(sizes) == len(images) and all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and v > 0 for v in s) for s in sizes)):
            raise ValueError(f"image_sizes: expected {len(images)} [width, height] pairs of positive integers")
        sizes = [(s[0], s[1]) for s in sizes]
    task = str(obj.get("task") or default_task)
    named = obj.get("metric") or default_metric
    metric = M.metric_for(task, named)
    options = obj.get("options")
    if isinstance(options, list):
        options = {chr(ord("A") + i): str(v) for i, v in enumerate(options)}
    if options is not None and not (isinstance(options, dict) and options):
        raise ValueError("options: expected a {letter: text} object or a list of option texts")
    uid = str(obj.get("id", f"line{line}"))
    group = str(obj.get("group") or (images[0] if metric == "mme" and images else uid))
    ref = {"answers": answers, "category": str(obj.get("category") or "")}
    after = obj.get("answer_after")
    if after is not None:
        if not isinstance(after, str) or not after:
            raise ValueError(f"answer_after: expected a non-empty string, got {after!r}")
        ref["answer_after"] = after
    if metric == "grounding" and M.parse_box(answers[0]) is None:
        raise ValueError(f"grounding reference {answers[0]!r} holds no box")
    if not options:
        if metric in ("multiple_choice", "circular") and M.answer_letter(answers[0]) is None:
            raise ValueError(f"multiple-choice answer {answers[0]!r} names no option letter")
        return [EvalItem(uid, uid, line, task, metric, prompt, images, ref, group, sizes, source=path)]
    options = {str(k).strip().upper(): str(v) for k, v in options.items()}
    if metric not in ("multiple_choice", "circular"):
        if named:
            raise ValueError(f"options given but metric is {metric!r} (use multiple_choice or circular)")
        metric = "multiple_choice"
    want = M.answer_letter(answers[0], options)
    if want is None:
        raise ValueError(f"answer {answers[0]!r} is not one of the options {sorted(options)}")
    letters = list(options)
    passes = len(letters) if metric == "circular" else 1
    items = []
    for k in range(passes):  # pass k: letter i shows the original option (i + k) % n
        shifted = {letters[i]: options[letters[(i + k) % len(letters)]] for i in range(len(letters))}
        ans = letters[(letters.index(want) - k) % len(letters)]
        r = dict(ref, answers=[ans], options=shifted)
        items.append(EvalItem(uid if passes == 1 else f"{uid}#{k}", uid, line, task, metric,
                              _with_options(prompt, shifted), images, r, group, sizes, {"pass": k}, source=path))
    return items


def load_benchmark(path: str, limit: Optional[int] = None, metric: Optional[str] = None) -> List[EvalItem]:
    """All generation requests of a benchmark JSONL; raises ValueError listing every bad line. `metric`:
    the metric of lines that name none."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark file not found: {path}")
    default_task = os.path.splitext(os.path.basename(path))[0]
    items, errors, seen = [], [], set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if limit is not None and n > limit:
                break
            text = decode_line(raw, path, n)
            if isinstance(text, SampleError):
                errors.append(str(text))
                continue
            if not text.strip():
                errors.append(f"{path}:{n}: blank line")
                continue
            try:
                new = _parse_line(json.loads(text), path, n, default_task, metric)
            except (ValueError, json.JSONDecodeError) as e:
                errors.append(f"{path}:{n}: {e}")
                continue
            dup = [it.uid for it in new if it.uid in seen]
            if dup:
                errors.append(f"{path}:{n}: duplicate id {dup[0]!r}")
                continue
            seen.update(it.uid for it in new)
            items.extend(new)
    if errors:
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise ValueError(f"{len(errors)} bad line(s) in {path}:\n  " + "\n  ".join(errors[:20]) + more)
    if not items:
        raise ValueError(f"{path}: no samples")
    return items


def load_items(path: str, limit: Optional[int] = None, metric: Optional[str] = None,
               image_dir: Optional[str] = None) -> List[EvalItem]:
    """The generation requests of a benchmark file: a VLMEvalKit `.tsv` (eval/tsv.py; its images decoded
    into `image_dir`), else this project's JSONL (`image_dir` unused)."""
    if path.lower().endswith(".tsv"):
        return load_tsv(path, limit, metric, image_dir)
    return load_benchmark(path, limit, metric)


# ----------------------------------------------------------------------------------------------
# pixel limits

def resolve_pixels(ckpt: Optional[str], min_pixels: Optional[int] = None,
                   max_pixels: Optional[int] = None) -> Tuple[int, int, str]:
    """(min_pixels, max_pixels, where they came from): flags > inference_config.json >
    preprocessor_config.json > ImageConfig defaults."""
    d = ImageConfig()
    lo, hi, src = d.min_pixels, d.max_pixels, "defaults"
    for name in ("preprocessor_config.json", INFERENCE_CONFIG):
        p = os.path.join(ckpt, name) if ckpt else ""
        if p and os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                cfg = json.load(f)
            if "min_pixels" in cfg or "max_pixels" in cfg:
                lo, hi, src = int(cfg.get("min_pixels", lo)), int(cfg.get("max_pixels", hi)), p
    if min_pixels is not None or max_pixels is not None:
        lo, hi, src = min_pixels or lo, max_pixels or hi, "command line"
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got {lo}, {hi} (from {src})")
    return lo, hi, src


# ----------------------------------------------------------------------------------------------
# generation with caches

class VisionCache:
    """Vision features keyed on (image path, resized height, resized width); least recently used entries
    are dropped beyond `max_bytes` (features of a large benchmark need not all stay in memory)."""

    def __init__(self, max_bytes: int = 2 << 30):
        self.store: "OrderedDict[Tuple[str, int, int], object]" = OrderedDict()
        self.max_bytes, self.nbytes = max_bytes, 0
        self.hits = self.misses = 0

    def get_many(self, requests: Sequence[Tuple[str, Tuple[int, int]]], encode: Callable) -> list:
        """Features of each (image path, (resized h, w)) in `requests`, in order. The distinct ones not
        cached are encoded in one `encode([(path, h, w), ...]) -> [features, ...]` call (one vision graph
        call for a generation batch's images instead of one per image); the bound is applied afterwards,
        so the features returned are those of this batch even when it alone exceeds `max_bytes`."""
        keys = [(path, int(hw[0]), int(hw[1])) for path, hw in requests]
        new = [k for k in dict.fromkeys(keys) if k not in self.store]
        got = list(encode(new)) if new else []
        if len(got) != len(new):
            raise RuntimeError(f"encode returned {len(got)} features for {len(new)} images")
        for key, feat in zip(new, got):
            self.store[key] = feat
            self.nbytes += getattr(feat, "nbytes", 0)
        self.misses += len(new)
        self.hits += len(keys) - len(new)
        out = []
        for key in keys:
            self.store.move_to_end(key)
            out.append(self.store[key])
        while self.nbytes > self.max_bytes and len(self.store) > 1:
            _, old = self.store.popitem(last=False)
            self.nbytes -= getattr(old, "nbytes", 0)
        return out


class Sizes:
    """Original (width, height) of images: from the line's image_sizes, else read from the file header."""

    def __init__(self):
        self.known: Dict[str, Tuple[int, int]] = {}

    def resized(self, item: EvalItem, min_pixels: int, max_pixels: int, factor: int = 28) -> List[Tuple[int, int]]:
        out = []
        where = f"{item.source}:{item.line}"
        for i, p in enumerate(item.images):
            if p not in self.known:
                try:
                    self.known[p] = image_size(p)
                except (OSError, FileNotFoundError) as e:
                    raise ValueError(f"{where}: field images[{i}]: unreadable image ({e})") from None
            w, h = self.known[p]
            if item.sizes and tuple(item.sizes[i]) != (w, h):
                raise ValueError(f"{where}: image size mismatch: field image_sizes[{i}]={list(item.sizes[i])} but "
                                 f"{p} is {w}x{h}")
            try:
                out.append(smart_resize(h, w, factor, min_pixels, max_pixels))
            except ValueError as e:
                raise ValueError(f"{where}: field images[{i}]: {p} ({w}x{h}): {e}") from None
        return out


def predict(items: Sequence[EvalItem], backend, min_pixels: int, max_pixels: int, batch_size: int = 8,
            max_new_tokens: int = 128, vision_cache: Optional[VisionCache] = None, sizes: Optional[Sizes] = None,
            pred_cache: Optional[dict] = None, desc: str = "eval",
            progress: bool = True) -> Tuple[List[str], List[list], dict]:
    """Predictions for `items` at one pixel setting; returns (predictions, resized sizes, stats).

    `pred_cache` maps (benchmark file, uid, resized sizes) -> prediction: a sample whose images resize exactly
    as in an earlier setting (or an earlier call on the same file and backend: `evaluate`, then `search`) has
    identical model inputs, so its greedy answer is reused instead of regenerated."""
    sizes = sizes or Sizes()
    vision_cache = vision_cache if vision_cache is not None else VisionCache()
    hws = [sizes.resized(it, min_pixels, max_pixels) for it in items]
    preds: List[Optional[str]] = [None] * len(items)
    todo = []
    for i, (it, hw) in enumerate(zip(items, hws)):
        key = (it.source, it.uid, tuple(hw))
        if pred_cache is not None and key in pred_cache:
            preds[i] = pred_cache[key]
        else:
            todo.append(i)
    encode = getattr(backend, "encode_images", None)
    for s in tqdm(range(0, len(todo), batch_size), desc=desc, unit="batch", disable=not (todo and progress)):
        idx = todo[s:s + batch_size]
        batch = [{"id": items[i].uid, "messages": items[i].messages, "images": items[i].images, "image_hw": hws[i],
                  "max_new_tokens": max_new_tokens} for i in idx]
        if encode is not None:  # the batch's images in one call; each sample takes its own back in order
            feats = iter(vision_cache.get_many([(p, hw) for i in idx for p, hw in zip(items[i].images, hws[i])],
                                               encode))
            for sample in batch:
                sample["image_features"] = [next(feats) for _ in sample["images"]]
        out = backend.generate(batch)
        if len(out) != len(batch):
            raise RuntimeError(f"backend returned {len(out)} answers for a batch of {len(batch)}")
        for i, text in zip(idx, out):
            preds[i] = str(text)
            if pred_cache is not None:
                pred_cache[(items[i].source, items[i].uid, tuple(hws[i]))] = preds[i]
    stats = {"generated": len(todo), "reused": len(items) - len(todo),
             "vision_encoded": vision_cache.misses, "vision_reused": vision_cache.hits}
    return preds, hws, stats


def score(items: Sequence[EvalItem], preds: Sequence[str]) -> Tuple[List[float], Dict[str, dict]]:
    """Per-item scores and per-task aggregates ({task: {..., 'metric', 'primary', 'n'}}), with the
    aggregate per value of each breakdown column the items give (`by_category`, ...)."""
    per, by_task = [], {}
    for it, p in zip(items, preds):
        s = M.score_sample(it.metric, p, it.ref)
        per.append(s)
        rec = {"score": s, "group": it.group, **{k: it.ref.get(k) or "" for k in BREAKDOWN_COLUMNS}}
        by_task.setdefault(it.task, (it.metric, []))[1].append(rec)
    tasks = {}
    for t, (m, recs) in sorted(by_task.items()):
        tasks[t] = dict(M.aggregate(m, recs), metric=m)
        for key in BREAKDOWN_COLUMNS:
            values = sorted({r[key] for r in recs if r[key]})
            if values:
                tasks[t][f"by_{key}"] = {v: M.aggregate(m, [r for r in recs if r[key] == v]) for v in values}
    return per, tasks


def load_backend(ckpt: str, max_new_tokens: int = 128):
    """The real model behind `mindvl eval`: mindvl_ms.infer.generate.load_eval_backend."""
    return load_eval_backend(ckpt, max_new_tokens=max_new_tokens)


def evaluate(ckpt: Optional[str], data: str, out_dir: str, backend=None, min_pixels: Optional[int] = None,
             max_pixels: Optional[int] = None, batch_size: int = 8, max_new_tokens: int = 128,
             limit: Optional[int] = None, progress: bool = True, metric: Optional[str] = None,
             image_dir: Optional[str] = None, pred_cache: Optional[dict] = None) -> dict:
    """Run one benchmark file (JSONL or VLMEvalKit TSV); writes out_dir/predictions.jsonl and
    out_dir/scores.json; returns the scores. A TSV's images are decoded into `image_dir` (default
    out_dir/images). `pred_cache` (see `predict`) is filled with this run's answers, so that a later
    `resolution_search.search` of the same backend and file reuses them at the settings that resize as
    this one did."""
    items = load_items(data, limit, metric, image_dir or os.path.join(out_dir, "images"))
    lo, hi, src = resolve_pixels(ckpt, min_pixels, max_pixels)
    os.makedirs(out_dir, exist_ok=True)  # an unwritable output fails before any generation
    backend = backend if backend is not None else load_backend(ckpt, max_new_tokens)
    preds, hws, stats = predict(items, backend, lo, hi, batch_size, max_new_tokens, pred_cache=pred_cache,
                                progress=progress)
    per, tasks = score(items, preds)
    with open(os.path.join(out_dir, "predictions.jsonl"), "w", encoding="utf-8") as f:
        for it, p, s, hw in zip(items, preds, per, hws):
            rec = {"id": it.uid, "line": it.line, "task": it.task, "metric": it.metric, "prediction": p,
                   "answers": it.ref["answers"], "score": s, "group": it.group, "image_hw": [list(x) for x in hw]}
            if it.metric in ("multiple_choice", "circular"):
                rec["choice"] = M.chosen_letter(p, it.ref)  # the option the prediction was read as
            rec.update({k: it.ref[k] for k in BREAKDOWN_COLUMNS if it.ref.get(k)})
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    result = {"checkpoint": ckpt, "data": os.path.abspath(data), "min_pixels": lo, "max_pixels": hi,
              "pixels_from": src, "tasks": tasks,
              "average": sum(t["primary"] for t in tasks.values()) / len(tasks), **stats}
    with open(os.path.join(out_dir, "scores.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return result
