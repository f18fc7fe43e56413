"""`mindvl demo --seeds 0 1 2`: the demo once per seed, each into OUT/seed_<s>, and the per-seed table of the
merged checkpoint's held-out scores against the demo's targets, with their mean, sd and minimum over seeds.

The seed (`seed` of the run config) draws the data as well as the initial weights and the row order
(`datasets.write_demo_data` seeds every task's stream with it, unless the YAML's `demo.data_seed` fixes the
data), so each seed writes its own OUT/seed_<s>/data.

easy-VQA's target is relative to its image-blind prior: each held-out question answered with the most
frequent train answer of its question template (`vqa_data.question_prior`), computed per question type
as the report does for yes/no (`baselines.vqa.by_type`) and weighted by the type's held-out count; that is
the same number as the report's overall `question_prior`, since every template belongs to one type.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from mindvl_ms.config.base import ConfigError
from mindvl_ms.recipes.demo.run import run_demo


# the demo's targets, in percent of the held-out split; easy-VQA's is points above its image-blind prior
TARGETS = {"ocr": 90.0, "grounding": 90.0, "colour": 95.0, "shape": 75.0}
VQA_MARGIN = 15.0
COLUMNS = ("ocr", "grounding", "colour", "shape", "vqa", "vqa_prior", "vqa_margin", "yes_no", "yes_no_prior",
           "wall_min")  # the numeric columns of a row, in table order


def check_seeds(seeds: Sequence[int], overrides: Sequence[str]) -> List[int]:
    """The seeds as given, or a ConfigError: at least one, none repeated or negative, and no `--set seed=`
    beside them (each seed's run sets it)."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ConfigError("--seeds needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))}: a seed is repeated")
    if min(seeds) < 0:
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))}: seeds are >= 0")
    if any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        raise ConfigError("--set seed=... and --seeds both set the seed: give one of them")
    return seeds


def seed_row(report: Dict[str, Any]) -> Dict[str, float]:
    """One seed's row from its demo report (`run.run_demo`): the merged checkpoint's scores in percent,
    easy-VQA's prior (per-type priors weighted by held-out counts) and its margin, yes/no and its prior,
    the wall time in minutes."""
    scores, by_type = report["scores"]["merged"], report["vqa_by_type"]["merged"]
    types = report["baselines"]["vqa"]["by_type"]
    n = sum(t["n"] for t in types.values())
    prior = 100 * sum(t["n"] * t["question_prior"] for t in types.values()) / n
    vqa = 100 * scores["vqa"]
    return {"ocr": 100 * scores["ocr"], "grounding": 100 * scores["grounding"],
            "colour": 100 * by_type["colour"], "shape": 100 * by_type["shape"], "vqa": vqa, "vqa_prior": prior,
            "vqa_margin": vqa - prior, "yes_no": 100 * by_type["yes/no"],
            "yes_no_prior": 100 * types["yes/no"]["question_prior"], "wall_min": report["wall_time_s"]["total"] / 60}


def missed(row: Dict[str, float]) -> List[str]:
    """The targets a row misses, in table order (empty: it meets them all). A score on its target meets it
    (the 1e-9 absorbs the rounding of fraction x 100); a score that is nan (no such question) misses it."""
    out = [k for k, v in TARGETS.items() if not row[k] >= v - 1e-9]
    return out + ([] if row["vqa_margin"] >= VQA_MARGIN - 1e-9 else ["vqa"])


def seed_summary(rows: Dict[int, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Mean, sd (n - 1 denominator; nan for one seed) and minimum over seeds of every column."""
    out: Dict[str, Dict[str, float]] = {"mean": {}, "sd": {}, "min": {}}
    for c in COLUMNS:
        v = [r[c] for r in rows.values()]
        mean = sum(v) / len(v)
        out["mean"][c] = mean
        out["sd"][c] = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else float("nan")
        out["min"][c] = min(v)
    return out


def seed_table(reports: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """{rows: {seed: row}, missed: {seed: [targets]}, summary: mean/sd/min} of the seeds' demo reports."""
    rows = {s: seed_row(r) for s, r in reports.items()}
    return {"rows": rows, "missed": {s: missed(r) for s, r in rows.items()}, "summary": seed_summary(rows)}


def _cells(r: Dict[str, float]) -> str:
    def f(v: float, w: int) -> str:
        return f"{'-':>{w}}" if math.isnan(v) else f"{v:>{w}.1f}"
    return (f"{f(r['ocr'], 6)}{f(r['grounding'], 10)}{f(r['colour'], 8)}{f(r['shape'], 7)}{f(r['vqa'], 9)}"
            f"{f(r['vqa_prior'], 7)}{f(r['vqa_margin'], 8)}{f(r['yes_no'], 8)}{f(r['yes_no_prior'], 7)}"
            f"{f(r['wall_min'], 9)}")


def format_seed_table(table: Dict[str, Any]) -> str:
    """The table `mindvl demo --seeds` prints: a row per seed, mean / sd / min, the targets each seed misses."""
    names = {"ocr": "OCR", "grounding": "grounding", "colour": "colour", "shape": "shape", "vqa": "easy-VQA"}
    head = (f"  {'seed':<6}{'OCR':>6}{'grounding':>10}{'colour':>8}{'shape':>7}{'easy-VQA':>9}{'prior':>7}"
            f"{'+pts':>8}{'yes/no':>8}{'prior':>7}{'wall min':>9}  targets missed")
    lines = ["", "== mindvl demo --seeds: merged checkpoint, held-out (%); targets OCR >= 90, grounding >= 90, "
             f"colour >= 95, shape >= 75, easy-VQA >= its prior + {VQA_MARGIN:g} points ==", head]
    for s, r in table["rows"].items():
        miss = table["missed"][s]
        lines.append(f"  {s:<6}{_cells(r)}  {', '.join(names[m] for m in miss) if miss else 'none (all met)'}")
    for name, r in table["summary"].items():
        lines.append(f"  {name:<6}{_cells(r)}")
    met = [s for s, m in table["missed"].items() if not m]
    lines.append(f"  seeds meeting every target: {len(met)} of {len(table['rows'])}"
                 + (f" ({', '.join(map(str, met))})" if met else ""))
    lines.append("  easy-VQA prior: each held-out question answered with its template's most frequent train answer, "
                 "per question type (yes/no, colour, shape) weighted by its held-out count; +pts = easy-VQA - prior")
    return "\n".join(lines)


def run_seeds(out_dir: str, seeds: Sequence[int], quick: bool = False, config: Optional[str] = None,
              overrides: Optional[List[str]] = None, progress: bool = True) -> Dict[str, Any]:
    """`run_demo` once per seed into OUT/seed_<s> (one after the other: a seed on one machine reproduces its
    single run exactly), then the per-seed table, printed and written to OUT/seeds.json."""
    overrides = list(overrides or [])
    seeds = check_seeds(seeds, overrides)
    reports = {s: run_demo(os.path.join(out_dir, f"seed_{s}"), quick=quick, config=config,
                           overrides=overrides + [f"seed={s}"], progress=progress) for s in seeds}
    table = seed_table(reports)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "seeds.json"), "w", encoding="utf-8") as f:
        json.dump({"seeds": seeds, "reports": {s: os.path.join(out_dir, f"seed_{s}", "report.json") for s in seeds},
                   **table}, f, indent=2)
    print(format_seed_table(table))
    return table
