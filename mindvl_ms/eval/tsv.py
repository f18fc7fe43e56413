"""VLMEvalKit TSV benchmarks for `mindvl eval --data BENCH.tsv`: prompts, references and grouping as
VLMEvalKit builds them (open-compass/VLMEvalKit, vlmeval/dataset/image_base.py, image_mcq.py, image_vqa.py).

    mindvl eval --ckpt ckpt/merged --data MMBench_DEV_EN.tsv OCRBench.tsv DocVQA_VAL.tsv [--metric NAME]

Columns (tab-separated, a header line, fields quoted with `"` where they hold tabs or newlines):
    index     unique id (an integer for circular benchmarks)
    image     base64 image, a list literal of them (multi-image), or a short string (<= 64 characters)
              naming another row's `index` whose image this row shows (VLMEvalKit's space saving)
    image_path  path(s) of the image (relative to the TSV's directory) when there is no `image` column
    question, answer; optional hint, category, l2-category, split
    A, B, C, ... options of a multiple-choice benchmark (empty fields: fewer options on that row)

Multiple choice (a file with option columns):
    prompt  "Hint: {hint}\\n" (when given) "Question: {question}\\nOptions:\\nA. {A}\\nB. {B}\\n...
            Please select the correct answer from the options above. \\n", after the images
            (ImageMCQDataset.build_prompt). MMMU's "<image k>" tags place image k inside the text.
    answer  the letter; scored by VLMEvalKit's rule-based `can_infer` (letter, else option text, see
            metrics.can_infer). VLMEvalKit's LLM-judge step is not run: an answer the rules cannot place
            counts as wrong, as in VLMEvalKit's `exact_matching` mode.
    circular  when the file name contains mmbench, ccbench, circular or mmcr (VLMEvalKit's rule) or
            `--metric circular`: the file's rows with index + k * 1000000 are shifted copies of question
            `index`; a question counts when all its rows are right.
    MMMU    rows without options (open questions) are scored as VLMEvalKit does: options {A: answer,
            B: "Other Answers"}, the right choice A.
Open questions (no option columns): the metric is `--metric`, else the default of the benchmark the file
name starts with (metrics.TASK_METRIC: DocVQA/InfoVQA anls, ChartQA relaxed_accuracy, TextVQA/VQAv2
vqa_accuracy, OCRBench ocrbench), else exact_match. The prompt is the question, plus "\\nAnswer the
question using a single word or phrase." for the benchmarks VLMEvalKit's ImageVQADataset serves (those
whose metric is anls, relaxed_accuracy, vqa_accuracy or exact_match: by name, else by `--metric`), not for
OCRBench or yes/no (mme) benchmarks; `answer` is a string or a list literal of accepted answers
("['a', 'b']").

Images are decoded once into `image_dir`, one file per distinct image named by its content's SHA-1 (the
bytes as given: no re-encoding), so a later run over the same directory writes nothing. With `limit`,
only the first `limit` questions (a circular question with all its copies) are read and decoded.
Every bad row is reported together, by file, line and field; nothing is skipped silently.
"""
from __future__ import annotations

import ast
import base64
import binascii
import csv
import hashlib
import io
import os
import re
import string
import struct
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

from PIL import Image

from mindvl_ms.data.schema import IMAGE_PLACEHOLDER
from mindvl_ms.eval import metrics as M
from mindvl_ms.eval.items import EvalItem

MCQ_PROMPT = "Please select the correct answer from the options above. \n"
VQA_SUFFIX = "\nAnswer the question using a single word or phrase."
VQA_METRICS = ("anls", "relaxed_accuracy", "vqa_accuracy", "exact_match")   # ImageVQADataset's suffix
CHOICE_METRICS = ("multiple_choice", "circular")
CIRCULAR_NAMES = ("mmbench", "ccbench", "circular", "mmcr")
COPY_STRIDE = 1_000_000           # circular copy k of question i has index i + k * COPY_STRIDE
REF_MAX = 64                      # an image field this short names another row's index
OPTION_LETTERS = tuple(string.ascii_uppercase)
MMMU_OTHER = "Other Answers"
BREAKDOWN_COLUMNS = ("category", "l2-category", "split")
_IMAGE_TAG = re.compile(r"<image (\d+)>")
_PIL_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


@dataclass
class Benchmark:
    """What a TSV file is: its name (the file's stem), metric and prompt style."""

    path: str
    name: str
    metric: str
    choices: bool                      # option columns: multiple choice
    circular: bool
    mmmu: bool                         # "<image k>" tags and open questions as VLMEvalKit's MMMU
    vqa_suffix: bool                   # open questions end with VQA_SUFFIX


@dataclass
class Row:
    """One TSV row: its fields (lower-cased column names, option letters kept) and, once known, images."""

    line: int
    index: str
    fields: Dict[str, str]
    group: str
    images: List[str] = field(default_factory=list)
    image_ref: str = ""               # index of the row whose image this row shows


def benchmark_of(path: str, columns: Sequence[str], metric: Optional[str] = None) -> Benchmark:
    """The metric and prompt style of a TSV from its name, its columns and `--metric`."""
    name = os.path.splitext(os.path.basename(path))[0]
    low = name.lower()
    choices = any(c in OPTION_LETTERS for c in columns)
    if metric:
        metric = M.metric_for(None, metric)  # validates the name
        if choices and metric not in CHOICE_METRICS:
            raise ValueError(f"{path}: option columns (A, B, ...) make it multiple choice, but --metric is "
                             f"{metric!r} (use multiple_choice or circular)")
        if not choices and metric in CHOICE_METRICS:
            raise ValueError(f"{path}: --metric {metric} needs option columns (A, B, ...); the file has none")
    elif choices:
        metric = "circular" if any(k in low for k in CIRCULAR_NAMES) else "multiple_choice"
    else:
        metric = M.metric_for(name, None)
        if metric in CHOICE_METRICS:
            raise ValueError(f"{path}: {name} is a multiple-choice benchmark ({metric}) but the file has no "
                             "option columns (A, B, ...)")
    known = M.metric_for(name, None)  # the prompt follows the benchmark's style, else the metric's
    style = known if known != "exact_match" else metric
    return Benchmark(path, name, metric, choices, metric == "circular", "mmmu" in low,
                     not choices and style in VQA_METRICS)


# ----------------------------------------------------------------------------------------------
# reading

Errors = List[Tuple[int, str]]            # (line, message): every bad row, reported together in line order


def _records(f, path: str) -> Tuple[List[str], Iterator[Tuple[int, object]]]:
    """The header's column names (lower-cased, option letters kept) and an iterator of (first line of the
    row, {column: field} or an error message) over open file `f`; fields are quoted as pandas writes them."""
    csv.field_size_limit(min(sys.maxsize, 2 ** 31 - 1))  # base64 images are far above the 128 KiB default
    reader = csv.reader(f, delimiter="\t")
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{path}: empty file (expected a header line of column names)") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}:1: unreadable header ({e})") from None
    cols = [c if c in OPTION_LETTERS else c.strip().lower() for c in header]

    def rows():
        start = reader.line_num + 1
        while True:
            try:
                raw = next(reader)
            except StopIteration:
                return
            except (UnicodeDecodeError, csv.Error) as e:
                yield start, f"unreadable ({e}); the rest of the file is not read"
                return
            if raw:  # blank lines are no rows, as for pandas
                yield start, (dict(zip(cols, raw)) if len(raw) == len(cols) else
                              f"{len(raw)} fields for {len(cols)} columns")
            start = reader.line_num + 1

    return cols, rows()


def _open(path: str):
    return open(path, encoding="utf-8-sig", newline="")


def _listed(text: str) -> Optional[list]:
    """A Python list literal ("['a', 'b']") as VLMEvalKit writes lists in TSV fields, else None."""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


def _group_of(index: str, bench: Benchmark) -> str:
    if not bench.circular:
        return index
    try:
        return str(int(index) % COPY_STRIDE)
    except ValueError:
        raise ValueError(f"field index: {index!r} is not an integer (circular evaluation groups rows by "
                         f"index % {COPY_STRIDE})") from None


class ImageStore:
    """Base64 images written once into `root` as files named by the SHA-1 of their bytes."""

    EXT = {"JPEG": ".jpg", "MPO": ".jpg", "PNG": ".png", "GIF": ".gif", "BMP": ".bmp", "WEBP": ".webp",
           "TIFF": ".tif"}

    def __init__(self, root: str):
        self.root = root
        self.written = self.reused = 0

    def put(self, text: str) -> str:
        """The path of the decoded image; raises ValueError saying what is wrong with `text`."""
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"not base64 ({e})") from None
        try:
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or ""
        except _PIL_ERRORS as e:
            raise ValueError(f"base64 of no image PIL reads ({type(e).__name__}: {e})") from None
        path = os.path.join(self.root, hashlib.sha1(data).hexdigest() + self.EXT.get(fmt, "." + fmt.lower()))
        if os.path.isfile(path):
            self.reused += 1
            return path
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
        self.written += 1
        return path


def _decode(field_text: str, store: ImageStore) -> List[str]:
    """Paths of the image(s) of an `image` field holding base64 (or a list literal of base64 strings)."""
    texts = _listed(field_text) or [field_text]
    out = []
    for k, t in enumerate(texts):
        try:
            out.append(store.put(t))
        except ValueError as e:
            raise ValueError(f"field image{f'[{k}]' if len(texts) > 1 else ''}: {e}") from None
    return out


@dataclass
class _Scan:
    """The rows of one pass over a TSV and what their images still need."""

    rows: List[Row] = field(default_factory=list)
    errors: Errors = field(default_factory=list)
    images: Dict[str, List[str]] = field(default_factory=dict)   # index -> decoded paths
    undecoded: Set[str] = field(default_factory=set)             # rows with an image outside --limit
    plain: Set[str] = field(default_factory=set)                 # every index with a full image field


def _scan(bench: Benchmark, records, store: ImageStore, limit: Optional[int]) -> _Scan:
    """Read every row; keep and decode the rows of the first `limit` questions (all with no limit)."""
    scan, seen, chosen = _Scan(), {}, set()
    for line, rec in records:
        if isinstance(rec, str):
            scan.errors.append((line, rec))
            continue
        index = rec.get("index", "").strip()
        try:
            if not index:
                raise ValueError("field index: empty")
            if index in seen:
                raise ValueError(f"field index: {index!r} already on line {seen[index]}")
            group = _group_of(index, bench)
        except ValueError as e:
            scan.errors.append((line, str(e)))
            continue
        seen[index] = line
        image = rec.pop("image", "")
        full = len(image) > REF_MAX
        if full:
            scan.plain.add(index)
        if limit is not None and group not in chosen and len(chosen) >= limit:
            if full:
                scan.undecoded.add(index)
            continue
        chosen.add(group)
        scan.rows.append(Row(line, index, rec, group, image_ref="" if full else image.strip()))
        if full:
            try:
                scan.images[index] = _decode(image, store)
            except ValueError as e:
                scan.errors.append((line, f"index {index}: {e}"))
    return scan


def _decode_outside_limit(path: str, wanted: Set[str], store: ImageStore) -> Dict[str, List[str]]:
    """Second pass for images that rows inside --limit borrow from rows outside it."""
    out = {}
    with _open(path) as f:
        for line, rec in _records(f, path)[1]:
            index = "" if isinstance(rec, str) else rec.get("index", "").strip()
            if index in wanted:
                try:
                    out[index] = _decode(rec.get("image", ""), store)
                except ValueError as e:
                    raise ValueError(f"{path}:{line}: index {index}: {e}") from None
    return out


def _attach_images(bench: Benchmark, scan: _Scan, store: ImageStore, image_col: str) -> None:
    """Give every kept row its image paths: decoded, borrowed from the row its short field names, or
    `image_path`; rows with none are errors."""
    borrowed = {r.image_ref for r in scan.rows if r.image_ref in scan.undecoded}
    if borrowed:
        scan.images.update(_decode_outside_limit(bench.path, borrowed, store))
    base = os.path.dirname(os.path.abspath(bench.path))
    for r in scan.rows:
        if r.image_ref:
            if r.image_ref not in scan.plain:
                scan.errors.append((r.line, f"index {r.index}: field image: {r.image_ref!r} names no row "
                                            "with a base64 image"))
            r.images = scan.images.get(r.image_ref, [])
        elif r.index in scan.images:
            r.images = scan.images[r.index]
        elif r.fields.get("image_path", "").strip():
            text = r.fields["image_path"].strip()
            r.images = [p if os.path.isabs(p) else os.path.join(base, p) for p in (_listed(text) or [text])]
        elif r.index not in scan.plain:  # (a row whose base64 failed already has its error)
            scan.errors.append((r.line, f"index {r.index}: field {image_col}: empty (no image)"))


# ----------------------------------------------------------------------------------------------
# prompts and references

def _options(fields: Dict[str, str]) -> Dict[str, str]:
    return {k: fields[k] for k in OPTION_LETTERS if fields.get(k, "").strip()}


def mcq_prompt(question: str, options: Dict[str, str], hint: str = "") -> str:
    """ImageMCQDataset.build_prompt's text."""
    text = f"Hint: {hint}\n" if hint else ""
    text += f"Question: {question}\n"
    if options:
        text += "Options:\n" + "".join(f"{k}. {v}\n" for k, v in options.items()) + MCQ_PROMPT
    return text


def _place_images(text: str, images: List[str], bench: Benchmark) -> Tuple[str, List[str]]:
    """The user turn with `<image>` placeholders and its images in placeholder order: all images first
    (VLMEvalKit's message order), or for MMMU each "<image k>" tag replaced by image k."""
    if not (bench.mmmu and _IMAGE_TAG.search(text)):
        return IMAGE_PLACEHOLDER * len(images) + text, list(images)
    order = []

    def swap(m):
        k = int(m.group(1))
        if not 1 <= k <= len(images):
            raise ValueError(f"field question: tag <image {k}> but the row has {len(images)} image(s)")
        order.append(images[k - 1])
        return IMAGE_PLACEHOLDER

    return _IMAGE_TAG.sub(swap, text), order


def _reference(row: Row, bench: Benchmark) -> Tuple[str, dict]:
    """(prompt text, reference) of a row."""
    f = row.fields
    question = f.get("question", "")
    if not question.strip():
        raise ValueError("field question: empty")
    answer = f.get("answer", "").strip()
    if not answer:
        raise ValueError("field answer: empty")
    ref = {k: f.get(k, "").strip() for k in BREAKDOWN_COLUMNS}
    if not bench.choices:
        text = question + (VQA_SUFFIX if bench.vqa_suffix else "")
        answers = _listed(answer)
        if answers is not None and not all(a.strip() for a in answers or [""]):
            raise ValueError(f"field answer: {answer!r}: an empty list or an empty answer")
        return text, dict(ref, answers=answers or [answer])
    options = _options(f)
    text = mcq_prompt(question, options, f.get("hint", "").strip())
    if not options:
        if not bench.mmmu:
            raise ValueError(f"fields {', '.join(c for c in OPTION_LETTERS if c in f)}: all empty (no options)")
        options, answer = {"A": answer, "B": MMMU_OTHER}, "A"  # VLMEvalKit's MMMU_preproc
    elif answer not in options:
        raise ValueError(f"field answer: {answer!r} is not one of the option letters {''.join(options)}")
    return text, dict(ref, answers=[answer], options=options, matcher="vlmevalkit")


def _item(row: Row, bench: Benchmark) -> EvalItem:
    text, ref = _reference(row, bench)
    content, images = _place_images(text, row.images, bench)
    return EvalItem(row.index, row.index, row.line, bench.name, bench.metric, [{"role": "user", "content": content}],
                    images, ref, row.group, source=bench.path, extra={"index": row.index})


def _check_groups(rows: List[Row], bench: Benchmark) -> Errors:
    """Circular copies whose question row (index % 1000000) is missing: VLMEvalKit drops them unscored."""
    if not bench.circular:
        return []
    mains = {r.index for r in rows if r.index == r.group}
    return [(r.line, f"index {r.index}: circular copy of question {r.group}, which has no row")
            for r in rows if r.group not in mains]


def load_tsv(path: str, limit: Optional[int] = None, metric: Optional[str] = None,
             image_dir: Optional[str] = None) -> List[EvalItem]:
    """All generation requests of a VLMEvalKit TSV; raises ValueError listing every bad row.

    `limit`: the first N questions only. `image_dir`: where images are decoded to (default: `images`
    beside the TSV; `mindvl eval` uses OUT/images)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark file not found: {path}")
    with _open(path) as f:
        columns, records = _records(f, path)
        missing = [c for c in ("index", "question", "answer") if c not in columns]
        if not ("image" in columns or "image_path" in columns):
            missing.append("image (or image_path)")
        if missing:
            hint = " (a test split without answers cannot be scored)" if "answer" in missing else ""
            raise ValueError(f"{path}:1: missing column(s) {', '.join(missing)}{hint}; the header has "
                             f"{', '.join(columns)}")
        bench = benchmark_of(path, columns, metric)
        store = ImageStore(image_dir or os.path.join(os.path.dirname(os.path.abspath(path)), "images"))
        scan = _scan(bench, records, store, limit)
    _attach_images(bench, scan, store, "image" if "image" in columns else "image_path")
    items = []
    for row in scan.rows:
        try:
            items.append(_item(row, bench))
        except ValueError as e:
            scan.errors.append((row.line, f"index {row.index}: {e}"))
    errors = [f"{path}:{n}: {msg}" for n, msg in sorted(scan.errors + _check_groups(scan.rows, bench),
                                                         key=lambda e: e[0])]
    if errors:
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise ValueError(f"{len(errors)} bad row(s) in {path}:\n  " + "\n  ".join(errors[:20]) + more)
    if not items:
        raise ValueError(f"{path}: no rows")
    return items
