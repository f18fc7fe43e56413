"""Benchmark metrics with their standard definitions; per-sample scores plus per-benchmark aggregates.

    from mindvl_ms.eval.metrics import anls, relaxed_accuracy, vqa_accuracy, ocrbench_hit, ...
    score_sample("anls", "hello", {"answers": ["Hello"]}) -> 1.0
    aggregate("mme", [{"score": 1.0, "group": "img1"}, ...]) -> {"acc": ..., "acc_plus": ..., "primary": ...}

Definitions (each has a hand-computed test in tests/eval/test_metrics.py):
- anls (DocVQA, InfoVQA): per question max over answers of 1 - NL if NL < 0.5 else 0, NL = Levenshtein
  distance / max length, on lower-cased, whitespace-collapsed strings (Biten et al. 2019).
- relaxed_accuracy (ChartQA): numbers within 5% relative error of the target ("12%" reads as 0.12, as in
  the ChartQA/pix2struct reference), otherwise case-insensitive exact match; max over answers.
- vqa_accuracy (VQAv2, TextVQA): min(#humans that gave the answer / 3, 1) after the official answer
  normalisation (punctuation, number words, articles, contractions), applied to prediction and answers.
  With 10 answers it is averaged over the 10 leave-one-annotator-out subsets as the official code does.
- ocrbench: 1 if any answer is a substring of the prediction (lower-cased; for the HME100k category, named
  "Handwritten Mathematical Expression Recognition" in VLMEvalKit's TSV, spaces and newlines are removed
  instead); the benchmark score is the sum of hits (out of 1000 on OCRBench).
- multiple_choice: the option letter extracted from the prediction equals the answer letter. Extraction is
  `extract_option`, or VLMEvalKit's rule-based `can_infer` for a reference with `matcher: "vlmevalkit"`
  (TSV benchmarks; VLMEvalKit's LLM-judge fallback is not run: an answer the rules cannot place is wrong).
- circular (MMBench CircularEval): a question counts only if every circular shift of its options is right.
- grounding (RefCOCO): Acc@IoU0.5 of the first predicted box (openPangu-VL box syntax, 0..999) vs the box.
- mme: yes/no answers; acc over questions, acc+ over images (both questions right), score = 100*(acc+acc+).
- exact_match: normalised string equality (the default when a line names no metric).
Every aggregate carries `primary`, a 0..1 number used to compare settings (MME: (acc + acc+) / 2).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence

from mindvl_ms.data.grounding import box_iou, parse_grounding

METRICS = ("anls", "relaxed_accuracy", "vqa_accuracy", "ocrbench", "multiple_choice", "circular", "grounding",
           "mme", "exact_match")
TASK_METRIC = {"docvqa": "anls", "infovqa": "anls", "chartqa": "relaxed_accuracy", "vqav2": "vqa_accuracy",
               "textvqa": "vqa_accuracy", "vizwiz": "vqa_accuracy", "ocrbench": "ocrbench", "mmbench": "circular",
               "mmstar": "multiple_choice", "ai2d": "multiple_choice", "mmmu": "multiple_choice",
               "scienceqa": "multiple_choice", "refcoco": "grounding", "refcoco+": "grounding",
               "refcocog": "grounding", "mme": "mme", "pope": "mme"}


def _ws(s: str) -> str:
    return " ".join(str(s).strip().lower().split())


def exact_match(pred: str, answers: Sequence[str]) -> float:
    return float(any(_ws(pred) == _ws(a) for a in answers))


# --------------------------------------------------------------------------------------------- ANLS

def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(pred: str, answers: Sequence[str], threshold: float = 0.5) -> float:
    best = 0.0
    p = _ws(pred)
    for a in answers:
        g = _ws(a)
        n = max(len(p), len(g))
        nl = levenshtein(p, g) / n if n else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


# ----------------------------------------------------------------------------------- ChartQA relaxed

def _to_float(text: str) -> Optional[float]:
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_accuracy(pred: str, answers: Sequence[str], tolerance: float = 0.05) -> float:
    p = pred.strip()
    for a in answers:
        a = str(a).strip()
        pf, af = _to_float(p), _to_float(a)
        if pf is not None and af:  # af == 0 falls back to string equality, as in the reference
            ok = abs(pf - af) / abs(af) <= tolerance
        else:
            ok = p.lower() == a.lower()
        if ok:
            return 1.0
    return 0.0


# --------------------------------------------------------------------------------------------- VQA

_CONTRACTIONS = dict(pair.split(":") for pair in (
    "aint:ain't arent:aren't cant:can't couldve:could've couldnt:couldn't couldn'tve:couldn't've "
    "couldnt've:couldn't've didnt:didn't doesnt:doesn't dont:don't hadnt:hadn't hadnt've:hadn't've "
    "hadn'tve:hadn't've hasnt:hasn't havent:haven't hed:he'd hed've:he'd've he'dve:he'd've hes:he's howd:how'd "
    "howll:how'll hows:how's Id've:I'd've I'dve:I'd've Im:I'm Ive:I've isnt:isn't itd:it'd itd've:it'd've "
    "it'dve:it'd've itll:it'll let's:let's maam:ma'am mightnt:mightn't mightnt've:mightn't've "
    "mightn'tve:mightn't've mightve:might've mustnt:mustn't mustve:must've neednt:needn't notve:not've "
    "oclock:o'clock oughtnt:oughtn't ow's'at:'ow's'at 'ows'at:'ow's'at 'ow'sat:'ow's'at shant:shan't "
    "shed've:she'd've she'dve:she'd've she's:she's shouldve:should've shouldnt:shouldn't "
    "shouldnt've:shouldn't've shouldn'tve:shouldn't've somebody'd:somebodyd somebodyd've:somebody'd've "
    "somebody'dve:somebody'd've somebodyll:somebody'll somebodys:somebody's someoned:someone'd "
    "someoned've:someone'd've someone'dve:someone'd've someonell:someone'll someones:someone's "
    "somethingd:something'd somethingd've:something'd've something'dve:something'd've somethingll:something'll "
    "thats:that's thered:there'd thered've:there'd've there'dve:there'd've therere:there're theres:there's "
    "theyd:they'd theyd've:they'd've they'dve:they'd've theyll:they'll theyre:they're theyve:they've "
    "twas:'twas wasnt:wasn't wed've:we'd've we'dve:we'd've weve:we've werent:weren't whatll:what'll "
    "whatre:what're whats:what's whatve:what've whens:when's whered:where'd wheres:where's whereve:where've "
    "whod:who'd whod've:who'd've who'dve:who'd've wholl:who'll whos:who's whove:who've whyll:why'll "
    "whyre:why're whys:why's wont:won't wouldve:would've wouldnt:wouldn't wouldnt've:wouldn't've "
    "wouldn'tve:wouldn't've yall:y'all yall'll:y'all'll y'allll:y'all'll yall'd've:y'all'd've "
    "y'alld've:y'all'd've y'all'dve:y'all'd've youd:you'd youd've:you'd've you'dve:you'd've youll:you'll "
    "youre:you're youve:you've").split())
_NUMBERS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_NUMBERS["none"] = "0"
_ARTICLES = {"a", "an", "the"}
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")


def vqa_normalize(text: str) -> str:
    """The official VQA answer processing: punctuation, then digits/articles/contractions."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    out = text
    for p in _PUNCT:
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _PERIOD_STRIP.sub("", out)
    words = [_NUMBERS.get(w, w) for w in out.lower().split()]
    words = [_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES]
    return " ".join(words)


def vqa_accuracy(pred: str, answers: Sequence[str]) -> float:
    p = vqa_normalize(pred)
    gts = [vqa_normalize(a) for a in answers]
    if len(gts) >= 10:  # official: mean over the leave-one-annotator-out subsets
        accs = [min(1.0, sum(g == p for j, g in enumerate(gts) if j != i) / 3.0) for i in range(len(gts))]
        return sum(accs) / len(accs)
    return min(1.0, sum(g == p for g in gts) / 3.0)


# ----------------------------------------------------------------------------------------- OCRBench

HME_CATEGORIES = ("hme100k", "handwritten mathematical expression recognition")


def ocrbench_hit(pred: str, answers: Sequence[str], category: str = "") -> float:
    if category.lower().startswith(HME_CATEGORIES):
        norm = lambda s: str(s).strip().replace("\n", " ").replace(" ", "")  # noqa: E731
    else:
        norm = lambda s: str(s).lower().strip().replace("\n", " ")  # noqa: E731
    return float(any(norm(a) in norm(pred) for a in answers))


# ---------------------------------------------------------------------------------- multiple choice

def extract_option(pred: str, options: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The option letter a free-form answer picks, or None when it is absent or ambiguous.

    In order: the letter alone or leading with punctuation ("B", "(B)", "B. text"); "answer is B" / "Answer: (B)"; exactly one
    standalone option letter in the text; exactly one option text contained in the answer."""
    letters = sorted(options) if options else list("ABCDEFGH")
    text = pred.strip()
    m = re.match(r"^\(?([A-Z])(?:\s*$|[.):,])", text)  # "B", "(B)", "B. cat", "B) cat"
    if m and m.group(1) in letters:
        return m.group(1)
    m = re.search(r"(?:answer|option|choice)\s*(?:is|:)?\s*[:(]?\s*\(?([A-Z])\)?(?![A-Za-z])", text, re.I)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    found = {c for c in re.findall(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])", text) if c in letters}
    if len(found) == 1:
        return found.pop()
    if options:
        hits = [k for k, v in options.items() if str(v).strip() and str(v).strip().lower() in text.lower()]
        if len(hits) == 1:
            return hits[0]
    return None


def answer_letter(answer: str, options: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The letter of a reference answer given as "B", "(B)", "B. text" or as the option's text."""
    a = answer.strip()
    if options:
        hits = [k for k, v in options.items() if _ws(v) == _ws(a)]
        if len(hits) == 1:
            return hits[0]
    m = re.match(r"^\(?([A-Za-z])(?:\s*$|[.):,])", a)
    if m and (not options or m.group(1).upper() in options):
        return m.group(1).upper()
    return extract_option(a, options)


def multiple_choice(pred: str, answer: str, options: Optional[Dict[str, str]] = None) -> float:
    want = answer_letter(answer, options)
    if want is None:
        raise ValueError(f"multiple-choice answer {answer!r} names no option letter")
    return float(extract_option(pred, options) == want)


# VLMEvalKit's rule-based extraction (vlmeval/utils/matching_util.py: can_infer_option, can_infer_text)
_REFUSALS = ("Sorry, I can't help with images of people yet.", "I can't process this file.",
             "I'm sorry, but without the image provided", "Cannot determine the answer")
_SEPARATORS = re.compile(r"[.()\[\],:;!*#{}]")
_VERBOSE_ANSWER = re.compile(r"(?:correct\s+)?answer\s+is\s+\**([ABCD])\**", re.I)


def _infer_option(pred: str, options: Dict[str, str]) -> Optional[str]:
    """The letter named by the answer: exactly one option letter among its words (punctuation
    `.()[],:;!*#{}` splits words), and that one among the last four words; else "answer is X"."""
    if any(r in pred for r in _REFUSALS):
        return "Z"
    words = _SEPARATORS.sub(" ", pred).split()
    named = [c for c in options if c in words]
    if len(named) == 1:
        if words.index(named[0]) > len(words) - 5:
            return named[0]
    elif not named and "Z" in words:
        return "Z"
    m = _VERBOSE_ANSWER.search(pred)
    return m.group(1).upper() if m and m.group(1).upper() in options else None


def _infer_text(pred: str, options: Dict[str, str]) -> Optional[str]:
    """The option whose text the answer contains, when exactly one does and the answer is at most twice
    as long as all option texts together."""
    text = pred.lower()
    if len(text) > 2 * sum(len(str(v)) for v in options.values()):
        return None
    hits = [k for k, v in options.items() if str(v).lower() in text]
    return hits[0] if len(hits) == 1 else None


def can_infer(pred: str, options: Dict[str, str]) -> Optional[str]:
    """VLMEvalKit's rule-based choice extraction: an option letter, "Z" for a refusal or a lone "Z", or None
    when the rules cannot place the answer (VLMEvalKit then asks an LLM judge; here it scores as wrong)."""
    pred = str(pred)
    return _infer_option(pred, options) or _infer_text(pred, options)


def chosen_letter(pred: str, ref: dict) -> Optional[str]:
    """The option a multiple-choice prediction picks, by the reference's matcher (see score_sample)."""
    pred = answer_part(pred, ref.get("answer_after"))
    if ref.get("matcher") == "vlmevalkit":
        return can_infer(pred, ref["options"])
    return extract_option(pred, ref.get("options"))


def circular_accuracy(records: Iterable[dict]) -> float:
    """MMBench CircularEval: fraction of groups (questions) whose every circular pass is right."""
    groups: Dict[str, List[float]] = defaultdict(list)
    for r in records:
        groups[str(r["group"])].append(r["score"])
    return sum(all(s == 1.0 for s in v) for v in groups.values()) / max(len(groups), 1)


# --------------------------------------------------------------------------------------- grounding

_PLAIN_BOX = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*,\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def parse_box(text: str) -> Optional[tuple]:
    """First box (x1, y1, x2, y2) in `text`: a <|box_start|>...<|box_end|> label, else a bare '(x1,y1),(x2,y2)'."""
    for obj in parse_grounding(text):
        for s in obj.shapes:
            if s.kind == "box":
                return s.box
    m = _PLAIN_BOX.search(text)
    return tuple(int(v) for v in m.groups()) if m else None


def grounding_hit(pred: str, gt_box: Sequence[float], threshold: float = 0.5) -> float:
    box = parse_box(pred)
    return float(box is not None and box_iou(box, gt_box) >= threshold)


# ------------------------------------------------------------------------------------------- MME

def yes_no(pred: str) -> Optional[str]:
    """'yes' / 'no' from an answer (leading word first, else the only one mentioned), else None."""
    words = re.findall(r"[a-z]+", pred.lower())
    if words and words[0] in ("yes", "no"):
        return words[0]
    found = {w for w in words if w in ("yes", "no")}
    return found.pop() if len(found) == 1 else None


def mme_scores(records: Iterable[dict]) -> Dict[str, float]:
    recs = list(records)
    groups: Dict[str, List[float]] = defaultdict(list)
    for r in recs:
        groups[str(r["group"])].append(r["score"])
    acc = sum(r["score"] for r in recs) / max(len(recs), 1)
    acc_plus = sum(all(s == 1.0 for s in v) for v in groups.values()) / max(len(groups), 1)
    return {"acc": acc, "acc_plus": acc_plus, "score": 100.0 * (acc + acc_plus), "primary": (acc + acc_plus) / 2}


# ------------------------------------------------------------------------------------ dispatching

def metric_for(task: Optional[str], metric: Optional[str]) -> str:
    """The metric of a line: its `metric` field, else the default of the benchmark its `task` names
    (longest TASK_METRIC key the task starts with), else exact_match."""
    if metric:
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}: expected one of {', '.join(METRICS)}")
        return metric
    name = (task or "").lower()
    for key in sorted(TASK_METRIC, key=len, reverse=True):  # "docvqa_val" -> docvqa, "refcoco+" before refcoco
        if name.startswith(key):
            return TASK_METRIC[key]
    return "exact_match"


def answer_part(pred: str, after: Optional[str]) -> str:
    """The text of `pred` after the last occurrence of `after` (all of `pred` when it does not occur)."""
    return pred.rsplit(after, 1)[-1] if after else pred


def score_sample(metric: str, pred: str, ref: dict) -> float:
    """Score of one prediction; `ref` holds answers (list of str), and options/category/box when needed;
    with `answer_after` only the text after its last occurrence in `pred` is scored (`answer_part`);
    `matcher: "vlmevalkit"` extracts a choice with `can_infer` instead of `extract_option`."""
    answers = ref["answers"]
    pred = answer_part(pred, ref.get("answer_after"))
    if metric == "anls":
        return anls(pred, answers)
    if metric == "relaxed_accuracy":
        return relaxed_accuracy(pred, answers)
    if metric == "vqa_accuracy":
        return vqa_accuracy(pred, answers)
    if metric == "ocrbench":
        return ocrbench_hit(pred, answers, ref.get("category", ""))
    if metric in ("multiple_choice", "circular"):
        if ref.get("matcher") == "vlmevalkit":  # the answer is the letter itself, as VLMEvalKit compares it
            return float(can_infer(pred, ref["options"]) == answers[0])
        return multiple_choice(pred, answers[0], ref.get("options"))
    if metric == "grounding":
        gt = parse_box(answers[0])
        if gt is None:
            raise ValueError(f"grounding reference {answers[0]!r} holds no box")
        return grounding_hit(pred, gt)
    if metric == "mme":
        return float(yes_no(pred) == yes_no(answers[0]))
    if metric == "exact_match":
        return exact_match(pred, answers)
    raise ValueError(f"unknown metric {metric!r}")


def aggregate(metric: str, records: Sequence[dict]) -> Dict[str, float]:
    """Benchmark score from per-sample records ({'score', 'group'}); always has 'primary' and 'n'."""
    n = len(records)
    mean = sum(r["score"] for r in records) / max(n, 1)
    if metric == "circular":
        out = {"circular_accuracy": circular_accuracy(records), "vanilla_accuracy": mean}
        out["primary"] = out["circular_accuracy"]
    elif metric == "mme":
        out = mme_scores(records)
    elif metric == "ocrbench":
        out = {"sum": sum(r["score"] for r in records), "accuracy": mean, "primary": mean}
    else:
        out = {metric: mean, "primary": mean}
    out["n"] = n
    return out
